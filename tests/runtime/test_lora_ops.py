"""lora_shrink / lora_expand (runtime/lora/ops.py), the SGMV-shaped API a Triton kernel will take over: per row
y += scale[a] * B_s[a] (A[a] x) on each stacked output slice s, rows of adapter -1 untouched."""

import torch

from braid.runtime.lora.ops import adapter_groups, lora_expand, lora_shrink


def test_per_row_adapters_on_stacked_slices():
    gen = torch.Generator().manual_seed(0)
    T, d_in, R, outs, N = 9, 12, 4, [6, 3, 3], 3  # a qkv-like linear: three output slices
    x = torch.randn(T, d_in, generator=gen)
    a = torch.randn(N, len(outs) * R, d_in, generator=gen)
    bs = [torch.randn(N, o, R, generator=gen) for o in outs]
    scale = torch.tensor([0.5, 2.0, 1.5])
    idx = torch.tensor([-1, 0, 2, 2, -1, 1, 0, 2, -1])
    y0 = torch.randn(T, sum(outs), generator=gen)

    y = lora_expand(y0.clone(), lora_shrink(x, a, idx), bs, scale, idx)
    grouped = lora_expand(y0.clone(), lora_shrink(x, a, idx, adapter_groups(idx)), bs, scale, idx,
                          adapter_groups(idx))

    want = y0.clone()
    for t in range(T):
        n = int(idx[t])
        if n < 0:
            continue
        off = 0
        for s, o in enumerate(outs):
            h = a[n, s * R:(s + 1) * R] @ x[t]
            want[t, off:off + o] += scale[n] * (bs[s][n] @ h)
            off += o
    torch.testing.assert_close(y, want)
    torch.testing.assert_close(grouped, want)
    assert torch.equal(y[idx < 0], y0[idx < 0])
    assert [s for s, _ in adapter_groups(idx)] == [0, 1, 2]
