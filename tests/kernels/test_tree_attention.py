"""The extend pass's tree mask (speculative tree verify): each new token sees its request's whole cached prefix and
the new tokens its ancestor mask marks. The Triton extend kernel (under the interpreter on CPU), the Triton backend
and the torch backend all equal dense attention with that mask, over requests with and without a prefix, trees
that cross the kernel's 16-row tiles, a one-token request, and GQA."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from braid.runtime.core import ForwardBatch, ForwardMode
from braid.runtime.layers.attention.torch_backend import TorchAttnBackend
from braid.runtime.layers.attention.triton_backend import TritonAttnBackend
from braid.runtime.layers.attention.triton_ops import extend_attention_fwd
from braid.runtime.mem_cache.pools import MHAKVPool
from braid.runtime.speculative.draft_tree import DraftTree, tree_mask_batch

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
H, HKV, D = 4, 2, 16
PREFIX = [0, 5, 23, 9]
NODES = [6, 20, 0, 35]  # draft nodes a request (verify rows: one more, the root); 21 and 36 rows cross tiles


def random_tree(m: int, gen: torch.Generator) -> DraftTree:
    parents = [int(torch.randint(0, j + 1, (1,), generator=gen)) for j in range(m)]
    return DraftTree(list(range(m)), parents)


def dense_reference(q, keys, values, visible, scale):
    """q: [n, H, D]; keys, values: [L, HKV, D]; visible: [n, L] bool -> [n, H, D] fp32."""
    group = q.shape[1] // keys.shape[1]
    k = keys.float().repeat_interleave(group, dim=1)
    v = values.float().repeat_interleave(group, dim=1)
    s = torch.einsum("mhd,nhd->hmn", q.float(), k) * scale
    s = s.masked_fill(~visible[None], float("-inf"))
    return torch.einsum("hmn,nhd->mhd", torch.softmax(s, dim=-1), v)


class TreeBatch:
    """Requests with cached prefixes (KV in a pool at scattered slots) and a tree of new tokens each."""

    def __init__(self, seed: int = 0):
        gen = torch.Generator().manual_seed(seed)
        self.trees = [random_tree(m, gen) for m in NODES]
        self.lens = [m + 1 for m in NODES]
        total = sum(PREFIX) + sum(self.lens)
        self.pool = MHAKVPool(total + 8, torch.float32, HKV, D, 1, DEVICE)
        slots = (torch.randperm(total + 8, generator=gen)[:total] + 1).tolist()
        self.req_to_token = torch.zeros(6, 80, dtype=torch.int32, device=DEVICE)
        self.rows = [3, 0, 5, 1]
        self.prefix_kv, out_loc = [], []
        for row, p, n in zip(self.rows, PREFIX, self.lens):
            mine = [slots.pop() for _ in range(p + n)]
            self.req_to_token[row, :p + n] = torch.tensor(mine, dtype=torch.int32)
            k = torch.randn(p, HKV, D, generator=gen).to(DEVICE)
            v = torch.randn(p, HKV, D, generator=gen).to(DEVICE)
            if p:
                self.pool.set_kv(0, torch.tensor(mine[:p], device=DEVICE), k, v)
            self.prefix_kv.append((k, v))
            out_loc.extend(mine[p:])
        T = sum(self.lens)
        self.q = torch.randn(T, H, D, generator=gen).to(DEVICE)
        self.k = torch.randn(T, HKV, D, generator=gen).to(DEVICE)
        self.v = torch.randn(T, HKV, D, generator=gen).to(DEVICE)
        self.out_loc = torch.tensor(out_loc, dtype=torch.int64, device=DEVICE)
        self.tree_mask, self.tree_mask_start = tree_mask_batch(self.trees, DEVICE)
        self.scale = 1.0 / math.sqrt(D)

    def reference(self) -> torch.Tensor:
        outs, row = [], 0
        for (k, v), p, n, tree in zip(self.prefix_kv, PREFIX, self.lens, self.trees):
            keys = torch.cat([k, self.k[row:row + n]])
            values = torch.cat([v, self.v[row:row + n]])
            visible = torch.cat([torch.ones(n, p, dtype=torch.bool), tree.ancestor_mask()], dim=1).to(DEVICE)
            outs.append(dense_reference(self.q[row:row + n], keys, values, visible, self.scale))
            row += n
        return torch.cat(outs)

    def forward_batch(self, backend) -> ForwardBatch:
        i32 = lambda xs: torch.tensor(xs, dtype=torch.int32, device=DEVICE)  # noqa: E731
        seq = [p + n for p, n in zip(PREFIX, self.lens)]
        ext = i32(self.lens)
        positions = [p + d for p, t in zip(PREFIX, self.trees) for d in t.depths()]
        return ForwardBatch(
            forward_mode=ForwardMode.EXTEND, batch_size=len(self.lens),
            input_ids=torch.zeros(sum(self.lens), dtype=torch.int64, device=DEVICE),
            positions=torch.tensor(positions, device=DEVICE), req_pool_indices=torch.tensor(self.rows, device=DEVICE),
            seq_lens=i32(seq), out_cache_loc=self.out_loc, seq_lens_cpu=seq, extend_prefix_lens=i32(PREFIX),
            extend_seq_lens=ext, extend_start_loc=torch.cumsum(ext, 0, dtype=torch.int32) - ext,
            extend_prefix_lens_cpu=PREFIX, extend_seq_lens_cpu=self.lens,
            req_to_token_pool=SimpleNamespace(req_to_token=self.req_to_token), kv_pool=self.pool,
            attn_backend=backend, tree_mask=self.tree_mask, tree_mask_start=self.tree_mask_start)


def layer(window: int = -1) -> SimpleNamespace:
    return SimpleNamespace(layer_id=0, num_heads=H, num_kv_heads=HKV, head_dim=D, v_head_dim=D, scaling=D ** -0.5,
                           logit_cap=0.0, sliding_window=window)


def test_ancestor_mask_marks_each_node_and_its_ancestors():
    tree = DraftTree([7, 8, 9, 10], [0, 0, 1, 3])  # root -> 1, 2; 1 -> 3 -> 4
    assert tree.depths() == [0, 1, 1, 2, 3]
    expected = torch.tensor([[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 0, 1, 0, 0], [1, 1, 0, 1, 0], [1, 1, 0, 1, 1]],
                            dtype=torch.bool)
    assert torch.equal(tree.ancestor_mask(), expected)
    mask, start = tree_mask_batch([tree, DraftTree([], [])], "cpu")
    assert torch.equal(mask, torch.cat([expected.reshape(-1), torch.ones(1, dtype=torch.bool)]))
    assert start.tolist() == [0, 25]


def test_triton_extend_kernel_with_a_tree_mask_equals_dense_attention():
    b = TreeBatch()
    o = torch.full_like(b.q, float("nan"))
    i32 = lambda xs: torch.tensor(xs, dtype=torch.int32, device=DEVICE)  # noqa: E731
    ext = i32(b.lens)
    extend_attention_fwd(b.q, b.k, b.v, o, b.pool.get_key_buffer(0), b.pool.get_value_buffer(0), b.req_to_token,
                         torch.tensor(b.rows, device=DEVICE), i32([p + n for p, n in zip(PREFIX, b.lens)]), ext,
                         torch.cumsum(ext, 0, dtype=torch.int32) - ext, i32(PREFIX), max(b.lens), b.scale,
                         tree_mask=b.tree_mask, tree_mask_start=b.tree_mask_start)
    assert torch.allclose(o, b.reference(), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("backend_name", ["torch", "triton"])
def test_backends_attend_through_the_tree_mask(backend_name):
    b = TreeBatch(seed=1)
    if backend_name == "torch":
        backend = TorchAttnBackend()
    else:
        runner = SimpleNamespace(device=DEVICE, tp_size=1, model_config=SimpleNamespace(
            num_attention_heads=H, num_key_value_heads=HKV, head_dim=D, v_head_dim=D))
        backend = TritonAttnBackend(runner)
    assert backend.supports_tree_mask
    fb = b.forward_batch(backend)
    backend.init_forward_metadata(fb)
    out = backend.forward(b.q.reshape(len(b.q), -1), b.k.reshape(len(b.k), -1), b.v.reshape(len(b.v), -1), layer(), fb)
    assert torch.allclose(out.view(-1, H, D), b.reference(), atol=1e-4, rtol=1e-4)
    # the pass wrote the new tokens' KV at their slots
    assert torch.equal(b.pool.get_key_buffer(0)[b.out_loc], b.k)
    # a sliding-window layer cannot take a tree mask (its rows' positions are depths, not row indices)
    with pytest.raises(ValueError, match="sliding"):
        backend.forward(b.q.reshape(len(b.q), -1), b.k.reshape(len(b.k), -1), b.v.reshape(len(b.v), -1),
                        layer(window=8), fb)
