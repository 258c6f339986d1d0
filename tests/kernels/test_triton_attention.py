"""Triton extend/decode attention vs a naive torch reference, and TritonAttnBackend end to end.

On CPU the kernels run under TRITON_INTERPRET=1 (set in conftest.py) at small shapes; the cases
marked `gpu` use real model shapes and need CUDA.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from braid.runtime.core import ForwardBatch, ForwardMode
from braid.runtime.layers.attention.triton_backend import TritonAttnBackend
from braid.runtime.layers.attention.triton_ops import decode_attention_fwd, extend_attention_fwd
from braid.runtime.layers.attention.triton_ops.extend_attention import extend_block_m, extend_block_table
from braid.runtime.mem_cache.pools import MHAKVPool

HAS_CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if HAS_CUDA else "cpu")

FP8_E4M3 = torch.float8_e4m3fn
FP8_E5M2 = torch.float8_e5m2


# ---------------------------------------------------------------------------------- reference


def ref_attention(q, k, v, q_pos, sm_scale, logit_cap=0.0, window=-1):
    """q: [M, H, D] at absolute positions q_pos [M]; k: [N, Hkv, D], v: [N, Hkv, Dv] at positions 0..N-1.

    Returns [M, H, Dv] fp32: masked softmax over the keys each query may see.
    """
    group = q.shape[1] // k.shape[1]
    k = k.float().repeat_interleave(group, dim=1)
    v = v.float().repeat_interleave(group, dim=1)
    s = torch.einsum("mhd,nhd->hmn", q.float(), k) * sm_scale
    if logit_cap > 0:
        s = logit_cap * torch.tanh(s / logit_cap)
    k_pos = torch.arange(k.shape[0], device=q.device)
    visible = k_pos[None, :] <= q_pos[:, None]
    if window > 0:
        visible &= k_pos[None, :] > q_pos[:, None] - window
    s = s.masked_fill(~visible[None], float("-inf"))
    return torch.einsum("hmn,nhd->mhd", torch.softmax(s, dim=-1), v)


def rel_err(out, ref):
    assert not torch.isnan(out).any(), "output has NaN (unwritten or bad masking)"
    return ((out.float() - ref).norm() / ref.norm()).item()


def tolerance(dtype, kv_dtype):
    return 1e-4 if dtype == torch.float32 and kv_dtype == torch.float32 else 1e-2


# ---------------------------------------------------------------------------------- cases


def random_layout(seq_lens, gen, device):
    """Scatter each request's tokens over random, non-contiguous KV slots (slot 0 stays a dummy)
    and place the requests at random rows of req_to_token."""
    batch, total = len(seq_lens), sum(seq_lens)
    num_slots = total + 1 + 7
    slots = torch.randperm(num_slots - 1, generator=gen)[:total] + 1
    rows = torch.randperm(batch + 3, generator=gen)[:batch]
    req_to_token = torch.zeros((batch + 3, max(seq_lens) + 5), dtype=torch.int32)
    per_req, off = [], 0
    for row, n in zip(rows.tolist(), seq_lens):
        req_to_token[row, :n] = slots[off:off + n].int()
        per_req.append(slots[off:off + n].long().to(device))
        off += n
    return num_slots, req_to_token.to(device), rows.to(device), per_req


def randn(shape, dtype, gen, device, scale=1.0):
    return (torch.randn(shape, generator=gen) * scale).to(dtype).to(device)


def run_extend_case(h, h_kv, d, dv, prefix_lens, extend_lens, dtype=torch.float32, kv_dtype=None,
                    logit_cap=0.0, window=-1, seed=0, device=DEVICE, k_scale=1.0, v_scale=1.0):
    kv_dtype = kv_dtype or dtype
    gen = torch.Generator().manual_seed(seed)
    seq_lens = [p + e for p, e in zip(prefix_lens, extend_lens)]
    num_slots, req_to_token, rows, per_req = random_layout(seq_lens, gen, device)
    total_ext = sum(extend_lens)
    k_buffer = randn((num_slots, h_kv, d), kv_dtype, gen, device)
    v_buffer = randn((num_slots, h_kv, dv), kv_dtype, gen, device)
    q = randn((total_ext, h, d), dtype, gen, device)
    k = randn((total_ext, h_kv, d), dtype, gen, device)
    v = randn((total_ext, h_kv, dv), dtype, gen, device)
    o = torch.full((total_ext, h, dv), float("nan"), dtype=dtype, device=device)
    start_loc = torch.tensor([0] + extend_lens[:-1], device=device).cumsum(0).int()
    as_i32 = lambda xs: torch.tensor(xs, dtype=torch.int32, device=device)  # noqa: E731
    sm_scale = 1.0 / math.sqrt(d)

    extend_attention_fwd(q, k, v, o, k_buffer, v_buffer, req_to_token, rows, as_i32(seq_lens),
                         as_i32(extend_lens), start_loc, as_i32(prefix_lens), max(extend_lens),
                         sm_scale, logit_cap, window, k_scale, v_scale)

    errs = []
    for b, (p, e) in enumerate(zip(prefix_lens, extend_lens)):
        s0 = int(start_loc[b])
        prefix_slots = per_req[b][:p]
        keys = torch.cat([k_buffer[prefix_slots].float() * k_scale, k[s0:s0 + e].float()])
        vals = torch.cat([v_buffer[prefix_slots].float() * v_scale, v[s0:s0 + e].float()])
        q_pos = torch.arange(p, p + e, device=device)
        ref = ref_attention(q[s0:s0 + e], keys, vals, q_pos, sm_scale, logit_cap, window)
        errs.append(rel_err(o[s0:s0 + e], ref))
    return max(errs)


def run_decode_case(h, h_kv, d, dv, seq_lens, num_kv_splits, dtype=torch.float32, kv_dtype=None,
                    logit_cap=0.0, window=-1, seed=0, device=DEVICE, k_scale=1.0, v_scale=1.0, launch_config=None):
    kv_dtype = kv_dtype or dtype
    gen = torch.Generator().manual_seed(seed)
    batch = len(seq_lens)
    num_slots, req_to_token, rows, per_req = random_layout(seq_lens, gen, device)
    k_buffer = randn((num_slots, h_kv, d), kv_dtype, gen, device)
    v_buffer = randn((num_slots, h_kv, dv), kv_dtype, gen, device)
    q = randn((batch, h, d), dtype, gen, device)
    o = torch.full((batch, h, dv), float("nan"), dtype=dtype, device=device)
    attn_logits = torch.full((batch, h, num_kv_splits, dv + 1), float("nan"), device=device)
    sm_scale = 1.0 / math.sqrt(d)

    decode_attention_fwd(q, k_buffer, v_buffer, o, req_to_token, rows,
                         torch.tensor(seq_lens, dtype=torch.int32, device=device),
                         attn_logits, num_kv_splits, sm_scale, logit_cap, window, k_scale, v_scale,
                         launch_config=launch_config)

    errs = []
    for b, n in enumerate(seq_lens):
        slots = per_req[b]
        q_pos = torch.tensor([n - 1], device=device)
        ref = ref_attention(q[b:b + 1], k_buffer[slots].float() * k_scale, v_buffer[slots].float() * v_scale,
                            q_pos, sm_scale, logit_cap, window)
        errs.append(rel_err(o[b:b + 1], ref))
    return max(errs)


# name: (H, Hkv, D, Dv, dtype, kv_dtype, logit_cap, sliding_window)
SMALL_CASES = {
    "mha_fp32": (2, 2, 32, 32, torch.float32, None, 0.0, -1),
    "gqa4_dv_ne_d_softcap": (8, 2, 32, 16, torch.float32, None, 0.8, -1),
    "gqa8_window": (8, 1, 16, 16, torch.float32, None, 0.0, 7),
    "bf16_d48_window_softcap": (4, 1, 48, 32, torch.bfloat16, None, 0.8, 20),
    "bf16_fp8_e4m3_kv": (4, 1, 32, 32, torch.bfloat16, FP8_E4M3, 0.0, -1),
}


@pytest.mark.parametrize("name", list(SMALL_CASES))
def test_extend_matches_reference(name):
    h, h_kv, d, dv, dtype, kv_dtype, cap, window = SMALL_CASES[name]
    # prefix reuse, a prefix-free request, a one-token extend, requests crossing several tiles
    err = run_extend_case(h, h_kv, d, dv, prefix_lens=[0, 21, 37, 5], extend_lens=[33, 1, 18, 9],
                          dtype=dtype, kv_dtype=kv_dtype, logit_cap=cap, window=window, seed=len(name))
    assert err <= tolerance(dtype, kv_dtype), err


@pytest.mark.parametrize("name", list(SMALL_CASES))
def test_decode_matches_reference(name):
    h, h_kv, d, dv, dtype, kv_dtype, cap, window = SMALL_CASES[name]
    err = run_decode_case(h, h_kv, d, dv, seq_lens=[1, 70, 17, 40], num_kv_splits=4,
                          dtype=dtype, kv_dtype=kv_dtype, logit_cap=cap, window=window, seed=len(name))
    assert err <= tolerance(dtype, kv_dtype), err


@pytest.mark.parametrize("name", ["gqa4_dv_ne_d_softcap", "gqa8_window", "bf16_fp8_e4m3_kv"])
def test_decode_with_slots_loaded_a_tile_ahead(name):
    # ROWS_AHEAD: each full tile's KV slots come from the iteration before; splits of 0..4 full 16-key tiles, with
    # and without a partial last tile
    h, h_kv, d, dv, dtype, kv_dtype, cap, window = SMALL_CASES[name]
    err = run_decode_case(h, h_kv, d, dv, seq_lens=[1, 16, 70, 64, 33], num_kv_splits=2, dtype=dtype,
                          kv_dtype=kv_dtype, logit_cap=cap, window=window, seed=len(name),
                          launch_config=dict(BLOCK_N=16, num_warps=4, num_stages=1, ROWS_AHEAD=True))
    assert err <= tolerance(dtype, kv_dtype), err


def test_decode_single_split_and_fp8_e5m2():
    err = run_decode_case(4, 2, 16, 16, seq_lens=[50, 3], num_kv_splits=1, kv_dtype=FP8_E5M2, seed=3)
    assert err <= 1e-4, err  # the reference reads the same fp8 values, so only fp32 rounding differs


def test_fp8_dequant_scales():
    # the buffers hold x / scale: both kernels multiply what they read from them back by the scales
    common = dict(h=4, h_kv=2, d=16, dv=16, kv_dtype=FP8_E4M3, k_scale=0.37, v_scale=2.5, seed=6)
    assert run_decode_case(seq_lens=[23, 5], num_kv_splits=2, **common) <= 1e-4
    assert run_extend_case(prefix_lens=[19, 0], extend_lens=[6, 4], **common) <= 1e-4


def test_window_longer_than_sequence_and_split_head_dim():
    # 72 = 64 + 16 exercises the split head dim (like MLA's 576 = 512 + 64); Dv differs from D
    err = run_decode_case(4, 1, 72, 64, seq_lens=[9, 30], num_kv_splits=3, window=100, seed=4)
    assert err <= 1e-4, err
    err = run_extend_case(4, 1, 72, 64, prefix_lens=[0, 12], extend_lens=[20, 3], window=100, seed=5)
    assert err <= 1e-4, err


def test_decode_zero_length_rows_write_zeros():
    # CUDA-graph padding rows carry seq_len 0: they must come out finite
    q = torch.randn(2, 2, 16, device=DEVICE)
    k_buffer = torch.randn(8, 1, 16, device=DEVICE)
    v_buffer = torch.randn(8, 1, 16, device=DEVICE)
    req_to_token = torch.arange(16, dtype=torch.int32, device=DEVICE).view(2, 8) % 8
    o = torch.full((2, 2, 16), float("nan"), device=DEVICE)
    scratch = torch.empty(2, 2, 2, 17, device=DEVICE)
    seq_lens = torch.tensor([0, 5], dtype=torch.int32, device=DEVICE)
    decode_attention_fwd(q, k_buffer, v_buffer, o, req_to_token, torch.tensor([0, 1], device=DEVICE),
                         seq_lens, scratch, 2, 0.25)
    assert torch.equal(o[0], torch.zeros_like(o[0]))
    ref = ref_attention(q[1:], k_buffer[req_to_token[1, :5].long()], v_buffer[req_to_token[1, :5].long()],
                        torch.tensor([4], device=DEVICE), 0.25)
    assert rel_err(o[1:], ref) <= 1e-4


def test_block_table_covers_each_query_block_once():
    lens = torch.tensor([5, 0, 33, 16, 0], dtype=torch.int32)
    seq, block = extend_block_table(lens, 16, 12)
    pairs = [(s, b) for s, b in zip(seq.tolist(), block.tolist()) if s >= 0]
    assert pairs == [(0, 0), (2, 0), (2, 1), (2, 2), (3, 0)]
    assert seq.tolist()[len(pairs):] == [-1] * (12 - len(pairs))
    # written into given buffers (what a CUDA graph replays)
    out = (torch.full((12,), 7, dtype=torch.int32), torch.full((12,), 7, dtype=torch.int32))
    extend_block_table(lens, 16, 12, out=out)
    assert out[0].tolist() == seq.tolist() and out[1].tolist() == block.tolist()


@pytest.mark.parametrize("window", [-1, 6])
def test_extend_through_block_table_equals_grid_launch(window):
    """The fixed-grid launch of a padded batch (as in an extend CUDA graph: requests with no new tokens, rows past
    the last request, more table entries than blocks) writes the same rows as the per-batch grid."""
    gen = torch.Generator().manual_seed(3)
    h, h_kv, d = 4, 2, 32
    prefix_lens, extend_lens = [7, 0, 21], [19, 3, 40]
    seq_lens = [p + e for p, e in zip(prefix_lens, extend_lens)]
    num_slots, req_to_token, rows, _ = random_layout(seq_lens, gen, DEVICE)
    total, padded_tokens = sum(extend_lens), sum(extend_lens) + 9
    k_buffer = randn((num_slots, h_kv, d), torch.float32, gen, DEVICE)
    v_buffer = randn((num_slots, h_kv, d), torch.float32, gen, DEVICE)
    q = randn((padded_tokens, h, d), torch.float32, gen, DEVICE)
    k = randn((padded_tokens, h_kv, d), torch.float32, gen, DEVICE)
    v = randn((padded_tokens, h_kv, d), torch.float32, gen, DEVICE)
    as_i32 = lambda xs: torch.tensor(xs, dtype=torch.int32, device=DEVICE)  # noqa: E731
    start_loc = as_i32([0, 19, 22])
    expected = torch.zeros((padded_tokens, h, d), device=DEVICE)
    extend_attention_fwd(q, k, v, expected, k_buffer, v_buffer, req_to_token, rows, as_i32(seq_lens),
                         as_i32(extend_lens), start_loc, as_i32(prefix_lens), max(extend_lens), 0.2, 0.0, window)
    # two padding requests (no new tokens) after the real ones
    pad_rows = torch.cat([rows, rows[:1], rows[:1]])
    pad = lambda xs, fill: as_i32(list(xs) + [fill, fill])  # noqa: E731
    block_m = extend_block_m(d, d, DEVICE, q.dtype)
    entries = -(-padded_tokens // block_m) + 5
    table = extend_block_table(pad(extend_lens, 0), block_m, entries)
    out = torch.zeros((padded_tokens, h, d), device=DEVICE)
    extend_attention_fwd(q, k, v, out, k_buffer, v_buffer, req_to_token, pad_rows, pad(seq_lens, 1),
                         pad(extend_lens, 0), pad(start_loc.tolist(), total), pad(prefix_lens, 0), 0, 0.2, 0.0,
                         window, block_table=table)
    torch.testing.assert_close(out[:total], expected[:total], rtol=0, atol=0)
    assert out[total:].abs().sum() == 0  # rows of no request are not written


@pytest.mark.parametrize("d,dv", [(64, 64), (128, 128), (256, 256), (576, 512)])
def test_extend_graph_tiles_fit_fp32(d, dv):
    """The extend graphs' block table is cut in the first config's BLOCK_M and cannot fall back: on a GPU that first
    config must fit shared memory in the model's dtype (Gemma-2's head_dim 256 in fp32 asked for 512 KB once);
    16-bit models keep the measured tiles."""
    from braid.runtime.layers.attention.triton_ops import extend_attention as ea

    cuda = torch.device("cuda")
    for dtype, size in ((torch.float32, 4), (torch.bfloat16, 2)):
        first = ea._extend_launch_configs(d, dv, cuda, size)[0]
        assert extend_block_m(d, dv, cuda, dtype) == first["BLOCK_M"]
        need = size * (first["num_stages"] * first["BLOCK_N"] * (d + dv) + first["BLOCK_M"] * d)
        assert need <= 200 * 1024 or (size == 2 and first == ea._extend_launch_configs(d, dv, cuda)[0]), (dtype, first)
    assert ea._extend_launch_configs(d, dv, cuda, 2) == ea._extend_launch_configs(d, dv, cuda)


def test_shape_errors_are_clear():
    q = torch.randn(2, 3, 16)
    k_buffer = torch.randn(8, 2, 16)
    with pytest.raises(ValueError, match="multiple of KV heads"):
        decode_attention_fwd(q, k_buffer, k_buffer, torch.empty(2, 3, 16), torch.zeros(2, 8, dtype=torch.int32),
                             torch.arange(2), torch.ones(2, dtype=torch.int32), torch.empty(2, 3, 1, 17), 1, 1.0)
    q = torch.randn(2, 4, 16)
    with pytest.raises(ValueError, match="attn_logits"):
        decode_attention_fwd(q, k_buffer, k_buffer, torch.empty(2, 4, 16), torch.zeros(2, 8, dtype=torch.int32),
                             torch.arange(2), torch.ones(2, dtype=torch.int32), torch.empty(2, 4, 1, 16), 1, 1.0)


def test_launch_falls_back_to_a_config_that_fits():
    from triton.runtime.errors import OutOfResources

    from braid.runtime.layers.attention.triton_ops.extend_attention import launch_first_fitting

    launches = []

    class FakeKernel:
        def __getitem__(self, grid):
            def run(*args, **kwargs):
                launches.append((grid, kwargs["BLOCK_M"]))
                if kwargs["BLOCK_M"] > 32:
                    raise OutOfResources(300_000, 232_448, "shared memory")
            return run

    configs = [dict(BLOCK_M=128), dict(BLOCK_M=64), dict(BLOCK_M=32)]
    key = ("fake", "test_launch_falls_back")
    assert launch_first_fitting(FakeKernel(), lambda c: (c["BLOCK_M"],), configs, key, 1, x=2) == configs[2]
    assert launches == [((128,), 128), ((64,), 64), ((32,), 32)]
    launches.clear()
    launch_first_fitting(FakeKernel(), lambda c: (c["BLOCK_M"],), configs, key)  # remembered: no retries
    assert launches == [((32,), 32)]
    with pytest.raises(OutOfResources):
        launch_first_fitting(FakeKernel(), lambda c: (1,), configs[:2], ("fake", "none fits"))


# ---------------------------------------------------------------------------------- backend end to end


class Scenario:
    """Three requests over one layer: chunked prefill, a radix-shared prefix, then decode steps.

    Every request has a full random q/k/v sequence; each forward pass feeds the slice the scheduler
    would, and the outputs are compared with attention over the whole sequence at those positions.
    """

    H, HKV, D, DV = 4, 2, 16, 16

    def __init__(self, device, dtype=torch.float32, logit_cap=0.0, window=-1, num_kv_splits=3,
                 kv_cache_dtype=None, k_scale=1.0, v_scale=1.0):
        self.device, self.dtype = device, dtype
        gen = torch.Generator().manual_seed(11)
        self.layer = SimpleNamespace(layer_id=1, num_heads=self.H, num_kv_heads=self.HKV, head_dim=self.D,
                                     v_head_dim=self.DV, scaling=self.D ** -0.5, logit_cap=logit_cap,
                                     sliding_window=window)
        model_config = SimpleNamespace(num_attention_heads=self.H, num_key_value_heads=self.HKV,
                                       head_dim=self.D, v_head_dim=self.DV)
        self.runner = SimpleNamespace(device=device, model_config=model_config, tp_size=1)
        self.backend = TritonAttnBackend(self.runner, num_kv_splits=num_kv_splits)
        self.pool = MHAKVPool(95, dtype, self.HKV, self.D, 2, device, v_head_dim=self.DV,
                              kv_cache_dtype=kv_cache_dtype, k_scale=k_scale, v_scale=v_scale)
        self.req_to_token_pool = SimpleNamespace(req_to_token=torch.zeros(6, 48, dtype=torch.int32, device=device))
        self.free_slots = (torch.randperm(95, generator=gen) + 1).tolist()
        lengths = {"a": 30, "b": 23, "c": 21}
        self.q = {r: randn((n, self.H, self.D), dtype, gen, device) for r, n in lengths.items()}
        self.k = {r: self._cacheable(randn((n, self.HKV, self.D), dtype, gen, device), k_scale)
                  for r, n in lengths.items()}
        self.v = {r: self._cacheable(randn((n, self.HKV, self.DV), dtype, gen, device), v_scale)
                  for r, n in lengths.items()}
        # "c" shares its first 12 tokens (and their KV slots) with "a"
        self.k["c"][:12], self.v["c"][:12] = self.k["a"][:12], self.v["a"][:12]
        self.row = {"a": 4, "b": 0, "c": 2}
        self.filled = {r: 0 for r in lengths}

    def _cacheable(self, x, scale):
        """Values an fp8 cache stores exactly (x / scale rounds to itself), so the reference needs no rounding."""
        if not self.pool.is_fp8:
            return x
        return ((x / scale).to(self.pool.cache_dtype).to(x.dtype) * scale).to(x.dtype)

    def _batch(self, mode, chunks):
        """chunks: [(request, new_tokens)]; allocates slots and fills req_to_token like the scheduler."""
        locs, prefix, ext, seq = [], [], [], []
        for r, n in chunks:
            start = self.filled[r]
            new = torch.tensor([self.free_slots.pop() for _ in range(n)], device=self.device)
            self.req_to_token_pool.req_to_token[self.row[r], start:start + n] = new.int()
            locs.append(new)
            prefix.append(start)
            ext.append(n)
            seq.append(start + n)
            self.filled[r] += n
        as_i32 = lambda xs: torch.tensor(xs, dtype=torch.int32, device=self.device)  # noqa: E731
        fb = ForwardBatch(
            forward_mode=mode, batch_size=len(chunks),
            input_ids=torch.zeros(sum(ext), dtype=torch.long, device=self.device),
            positions=torch.cat([torch.arange(p, p + e) for p, e in zip(prefix, ext)]).to(self.device),
            req_pool_indices=torch.tensor([self.row[r] for r, _ in chunks], device=self.device),
            seq_lens=as_i32(seq), out_cache_loc=torch.cat(locs), seq_lens_cpu=seq,
            req_to_token_pool=self.req_to_token_pool, kv_pool=self.pool, attn_backend=self.backend,
        )
        if mode == ForwardMode.EXTEND:
            fb.extend_prefix_lens, fb.extend_seq_lens = as_i32(prefix), as_i32(ext)
            fb.extend_prefix_lens_cpu, fb.extend_seq_lens_cpu = prefix, ext
            fb.extend_start_loc = torch.tensor([0] + ext[:-1], device=self.device).cumsum(0).int()
        return fb

    def share_prefix(self, dst, src, n):
        self.req_to_token_pool.req_to_token[self.row[dst], :n] = self.req_to_token_pool.req_to_token[self.row[src], :n]
        self.filled[dst] = n

    def inputs(self, chunks, spans):
        take = lambda t: torch.cat([t[r][s:e] for (r, _), (s, e) in zip(chunks, spans)])  # noqa: E731
        return (take(self.q).flatten(1), take(self.k).flatten(1), take(self.v).flatten(1))

    def step(self, mode, chunks, prepare=None):
        """Runs one forward pass; returns the max relative error against the reference."""
        spans = [(self.filled[r], self.filled[r] + n) for r, n in chunks]
        fb = self._batch(mode, chunks)
        (prepare or self.backend.init_forward_metadata)(fb)
        q, k, v = self.inputs(chunks, spans)
        out = self.backend.forward(q, k, v, self.layer, fb)
        assert out.shape == (sum(n for _, n in chunks), self.H * self.DV) and out.dtype == self.dtype
        out = out.view(-1, self.H, self.DV)
        errs, row = [], 0
        for (r, _), (s, e) in zip(chunks, spans):
            ref = ref_attention(self.q[r][s:e], self.k[r][:e], self.v[r][:e], torch.arange(s, e, device=self.device),
                                self.layer.scaling, self.layer.logit_cap, self.layer.sliding_window)
            errs.append(rel_err(out[row:row + e - s], ref))
            row += e - s
        return max(errs)

    def run_all(self, decode_prepare=None):
        tol = tolerance(self.dtype, self.dtype)
        errs = [self.step(ForwardMode.EXTEND, [("a", 12), ("b", 22)])]  # first chunk of "a" (chunked prefill)
        self.share_prefix("c", "a", 12)
        errs.append(self.step(ForwardMode.EXTEND, [("a", 17), ("c", 7)]))  # prefix reuse: 12 cached tokens each
        errs.append(self.step(ForwardMode.DECODE, [("a", 1), ("b", 1), ("c", 1)], decode_prepare))
        errs.append(self.step(ForwardMode.DECODE, [("c", 1)], decode_prepare))
        assert max(errs) <= tol, errs
        # the pool now holds every token's K/V at the slot req_to_token names
        for r in ("a", "b", "c"):
            slots = self.req_to_token_pool.req_to_token[self.row[r], :self.filled[r]].long()
            cached = self.pool.get_key_buffer(1)[slots].to(self.dtype)
            if self.pool.is_fp8:
                cached = cached * self.pool.kv_scales(1)[0]
            assert torch.equal(cached, self.k[r][:self.filled[r]])


@pytest.mark.parametrize("cap,window", [(0.0, -1), (0.8, 9)])
def test_backend_extend_then_decode(cap, window):
    Scenario(DEVICE, logit_cap=cap, window=window).run_all()


def test_backend_fp8_pool_with_scales():
    Scenario(DEVICE, kv_cache_dtype="fp8_e4m3", k_scale=0.5, v_scale=0.25).run_all()


def test_backend_graph_metadata_uses_static_scratch():
    sc = Scenario(DEVICE)
    sc.backend.init_cuda_graph_state(max_bs=8)
    seen = []

    def prepare(fb):
        sc.backend.init_forward_metadata_capture(fb.batch_size, fb)
        seen.append(fb.attn_metadata.attn_logits.data_ptr())

    sc.run_all(decode_prepare=prepare)
    assert seen == [sc.backend.cuda_graph_attn_logits.data_ptr()] * 2
    with pytest.raises(ValueError, match="capacity"):
        sc.backend.init_forward_metadata_replay(9, sc._batch(ForwardMode.DECODE, [("b", 1)]))


def test_backend_requires_metadata():
    sc = Scenario(DEVICE)
    fb = sc._batch(ForwardMode.DECODE, [("a", 1)])
    with pytest.raises(RuntimeError, match="init_forward_metadata"):
        sc.backend.forward(*sc.inputs([("a", 1)], [(0, 1)]), sc.layer, fb)


# ---------------------------------------------------------------------------------- real shapes (GPU)

LLAMA3_8B = dict(h=32, h_kv=8, d=128, dv=128)


@pytest.mark.gpu
def test_gpu_extend_llama3_8b():
    err = run_extend_case(**LLAMA3_8B, prefix_lens=[0, 512, 1500, 3000, 77], extend_lens=[2048, 700, 1, 1096, 129],
                          dtype=torch.bfloat16)
    assert err <= 1e-2, err


@pytest.mark.gpu
def test_gpu_decode_llama3_8b_batch64():
    gen = torch.Generator().manual_seed(0)
    seq_lens = torch.randint(1, 4097, (64,), generator=gen).tolist()
    seq_lens[:3] = [1, 4096, 4095]
    err = run_decode_case(**LLAMA3_8B, seq_lens=seq_lens, num_kv_splits=16, dtype=torch.bfloat16)
    assert err <= 1e-2, err


# name: (H, Hkv, D, Dv, kv_dtype, logit_cap, sliding_window)
GPU_VARIANTS = {
    "gemma2_softcap_window": (16, 8, 256, 256, None, 50.0, 1024),
    "mla_576_512": (16, 1, 576, 512, None, 0.0, -1),
    "fp8_e4m3_kv": (32, 8, 128, 128, FP8_E4M3, 0.0, -1),
    "fp8_e5m2_kv_mha": (16, 16, 64, 64, FP8_E5M2, 0.0, -1),
}


@pytest.mark.parametrize("name", list(GPU_VARIANTS))
@pytest.mark.gpu
def test_gpu_variants(name):
    h, h_kv, d, dv, kv_dtype, cap, window = GPU_VARIANTS[name]
    common = dict(h=h, h_kv=h_kv, d=d, dv=dv, dtype=torch.bfloat16, kv_dtype=kv_dtype, logit_cap=cap, window=window)
    assert run_extend_case(prefix_lens=[0, 1800, 300], extend_lens=[1500, 400, 1], **common) <= 1e-2
    assert run_decode_case(seq_lens=[1, 2500, 700, 33], num_kv_splits=16, **common) <= 1e-2


@pytest.mark.gpu
def test_gpu_fp32_and_fp16_llama_shapes():
    # fp32 tiles need twice the shared memory of bf16 ones: the launcher falls back to smaller configs
    for dtype in (torch.float32, torch.float16):
        assert run_extend_case(**LLAMA3_8B, prefix_lens=[300, 0], extend_lens=[200, 333], dtype=dtype) <= 1e-2
        assert run_decode_case(**LLAMA3_8B, seq_lens=[1, 900], num_kv_splits=16, dtype=dtype) <= 1e-2


@pytest.mark.gpu
def test_gpu_backend_bf16_end_to_end():
    Scenario(DEVICE, dtype=torch.bfloat16, logit_cap=0.8, window=9).run_all()


@pytest.mark.gpu
def test_gpu_decode_cuda_graph_replay():
    """Capture decode once, replay with new lengths/queries written into the same static tensors."""
    h, h_kv, d = 32, 8, 128
    max_bs, max_len, splits = 8, 1024, 16
    gen = torch.Generator().manual_seed(1)
    num_slots = max_bs * max_len + 1
    k_buffer = randn((num_slots, h_kv, d), torch.bfloat16, gen, DEVICE)
    v_buffer = randn((num_slots, h_kv, d), torch.bfloat16, gen, DEVICE)
    req_to_token = (torch.randperm(num_slots - 1, generator=gen) + 1).int().view(max_bs, max_len).to(DEVICE)
    model_config = SimpleNamespace(num_attention_heads=h, num_key_value_heads=h_kv, head_dim=d)
    backend = TritonAttnBackend(SimpleNamespace(device=DEVICE, model_config=model_config), num_kv_splits=splits)
    backend.init_cuda_graph_state(max_bs)
    q = torch.zeros(max_bs, h, d, dtype=torch.bfloat16, device=DEVICE)
    o = torch.zeros(max_bs, h, d, dtype=torch.bfloat16, device=DEVICE)
    req_pool_indices = torch.arange(max_bs, device=DEVICE)
    seq_lens = torch.ones(max_bs, dtype=torch.int32, device=DEVICE)
    scratch = backend.cuda_graph_attn_logits

    def launch():
        decode_attention_fwd(q, k_buffer, v_buffer, o, req_to_token, req_pool_indices, seq_lens, scratch,
                             splits, d ** -0.5)

    launch()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        launch()
    for trial in range(2):
        lens = torch.randint(1, max_len + 1, (max_bs,), generator=gen)
        seq_lens.copy_(lens)
        q.copy_(randn((max_bs, h, d), torch.bfloat16, gen, DEVICE))
        graph.replay()
        torch.cuda.synchronize()
        for b in range(max_bs):
            slots = req_to_token[b, :lens[b]].long()
            ref = ref_attention(q[b:b + 1], k_buffer[slots], v_buffer[slots], lens[b:b + 1].to(DEVICE) - 1, d ** -0.5)
            assert rel_err(o[b:b + 1], ref) <= 1e-2
