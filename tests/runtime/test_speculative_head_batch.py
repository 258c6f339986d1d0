"""The draft head's batched passes (runtime/speculative/head_batch.py over head_kv.py's paged pool) against the
dense head run over each sequence alone: requests of uneven lengths split into several attention groups, catch-ups
that attend alone (with and without earlier rows) beside padded short ones, chain and tree draft depths under their
masks; and the pool's pages going back on truncation, close and garbage collection."""

import gc

import pytest
import torch
from torch import nn

from braid.runtime.speculative import head_batch
from braid.runtime.speculative.eagle_head import load_eagle_head
from braid.runtime.speculative.head_kv import PAGE, HeadKVCache, HeadKVPool
from eagle_tiny import DRAFT_V, H, V, eagle3_tensors, eagle_tensors, rand, write_checkpoint

CONFIG = dict(hidden_size=H, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2, vocab_size=V,
              rms_norm_eps=1e-5, rope_theta=10000.0, max_position_embeddings=128)


def make_head(tmp_path, kind: str):
    gen = torch.Generator().manual_seed(11)
    embed = nn.Embedding(V, H)
    embed.weight.data = rand(V, H, gen=gen)
    lm_head = nn.Linear(H, V, bias=False)
    lm_head.weight.data = rand(V, H, gen=gen)
    if kind == "EAGLE":
        path = write_checkpoint(tmp_path / "h", {**CONFIG, "num_hidden_layers": 2}, eagle_tensors(gen))
        return load_eagle_head(path, embed, lm_head, target_hidden_size=H, target_vocab_size=V), gen
    path = write_checkpoint(tmp_path / "h", {**CONFIG, "architectures": ["LlamaForCausalLMEagle3"],
                                             "draft_vocab_size": DRAFT_V}, eagle3_tensors(gen))
    return load_eagle_head(path, embed, None, target_hidden_size=H, target_vocab_size=V), gen


def dense_last(head, ids: list[int], inputs: torch.Tensor) -> torch.Tensor:
    """The dense head over one sequence (inputs: the target's features, then the head's own outputs; EAGLE-3's
    features already through fc) -> its output at the last row."""
    return head(torch.tensor(ids), inputs, torch.arange(len(ids)))[1][-1]


@pytest.mark.parametrize("kind", ["EAGLE", "EAGLE3"])
@pytest.mark.parametrize("width", [1, 2])
def test_batched_rows_are_each_requests_dense_rows(tmp_path, monkeypatch, kind, width):
    # small limits: requests past 8 catch-up rows attend alone, groups split past 32 padded rows
    monkeypatch.setattr(head_batch, "LONG", 8)
    monkeypatch.setattr(head_batch, "SLACK", 32)
    head, gen = make_head(tmp_path, kind)
    F_in = head.c.fc_in if kind == "EAGLE3" else H
    lengths, first = [40, 4, 12, 3, 25], [10, 0, 4, 0, 0]  # rows a request; rows run in an earlier pass
    seqs = [(torch.randint(0, V, (n,), generator=gen).tolist(), torch.randn(n, F_in, generator=gen))
            for n in lengths]
    with torch.no_grad():
        # the inputs the dense head takes for the target's features (EAGLE-3: through fc first)
        dense_in = [head.fc(f) if kind == "EAGLE3" else f for _, f in seqs]
        caches = [head.new_cache() for _ in seqs]
        early = [i for i, n in enumerate(first) if n]
        batch = head.batch([caches[i] for i in early], [first[i] for i in early],
                           [t for i in early for t in seqs[i][0][:first[i]]])
        head.extend(batch, torch.cat([seqs[i][1][:first[i]] for i in early]))
        steps = 3
        rest = [n - f for n, f in zip(lengths, first)]
        batch = head.batch(caches, rest, [t for (ids, _), f in zip(seqs, first) for t in ids[f:]], steps, width)
        assert len(batch.groups) == 2 and any(g.long for g in batch.groups)
        out = head.extend(batch, torch.cat([f[a:] for (_, f), a in zip(seqs, first)]))
        row = 0
        for i, ((ids, _), a) in enumerate(zip(seqs, first)):
            want = head(torch.tensor(ids), dense_in[i], torch.arange(len(ids)))[1][a:]
            assert torch.allclose(out[row:row + len(want)], want, atol=1e-5), i
            row += len(want)
        assert [c.length for c in caches] == lengths and caches[0].tokens == seqs[0][0]

        # drafts: each depth's rows fed random tokens and their parent's output (depth 1: the last committed row's)
        P = len(seqs)
        root = out.index_select(0, torch.tensor(rest).cumsum(0) - 1)  # [P, H]
        parent_out = root.repeat_interleave(width, dim=0)  # [P * width]
        paths = [[[] for _ in range(width)] for _ in range(P)]  # each row's ancestors: [(token, output)]
        ancestors = torch.eye(width, dtype=torch.bool).expand(P, width, width)
        for depth in range(1, steps + 1):
            tokens = torch.randint(0, V, (P * width,), generator=gen)
            hidden = head.draft(batch, tokens, parent_out, depth, ancestors if width > 1 else None)
            for i, (ids, _) in enumerate(seqs):
                for r in range(width):
                    path = paths[i][r]
                    fed = torch.stack([root[i]] + [h for _, h in path])  # the path's rows' and this row's inputs
                    want = dense_last(head, ids + [t for t, _ in path] + [int(tokens[i * width + r])],
                                      torch.cat([dense_in[i], fed]))
                    assert torch.allclose(hidden[i * width + r], want, atol=1e-5), (depth, i, r)
            # the next depth's rows: children of random rows of this one
            slots = torch.randint(0, width, (P, width), generator=gen)
            paths = [[paths[i][s] + [(int(tokens[i * width + s]), hidden[i * width + s])] for s in slots[i].tolist()]
                     for i in range(P)]
            parent_out = hidden.index_select(0, (torch.arange(P).view(P, 1) * width + slots).view(-1))
            inherited = ancestors.gather(1, slots.unsqueeze(2).expand(P, width, ancestors.shape[2]))
            ancestors = torch.cat([inherited, torch.eye(width, dtype=torch.bool).expand(P, width, width)], dim=2)
        assert [c.length for c in caches] == lengths  # draft rows never enter the caches


def test_pool_pages_go_back():
    pool = HeadKVPool(1, 2, 4, "cpu", torch.float32)
    a, b = HeadKVCache(pool), HeadKVCache(pool)
    a.reserve(PAGE + 1)
    a.length = PAGE + 1
    b.reserve(3 * PAGE)
    b.length = 3 * PAGE
    assert len(a.pages) == 2 and len(b.pages) == 3 and not set(a.pages) & set(b.pages)
    held = pool.num_pages - len(pool.free)
    a.truncate(PAGE)  # the second page goes back
    assert len(a.pages) == 1 and pool.num_pages - len(pool.free) == held - 1
    b.close()
    assert b.pages == [] and b.length == 0 and pool.num_pages - len(pool.free) == 1
    del a
    gc.collect()
    assert len(pool.free) == pool.num_pages  # a cache that goes without close gives its pages back too
    # growing the pool keeps the rows written
    c = HeadKVCache(pool)
    c.reserve(PAGE)
    rows = torch.tensor(c.pool_rows(0, PAGE))
    pool.k[0].index_copy_(0, rows, torch.ones(PAGE, 2, 4))
    HeadKVCache(pool).reserve(pool.num_pages * PAGE * 4)
    assert bool((pool.k[0].index_select(0, rows) == 1).all())


@pytest.mark.parametrize("n", [1, 3])
def test_grouped_heads_as_query_rows(n):
    """CUDA's layout for grouped-query attention (each KV head's query heads as its query rows, masks repeated)
    gives what SDPA's own GQA gives, with and without a mask."""
    gen = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(2, *shape, 8, generator=gen) for shape in ((n, 6), (5, 2), (5, 2)))
    mask = torch.rand(2, 1, n, 5, generator=gen) > 0.4
    mask[..., 0] = True
    for m in (mask, None):
        want = head_batch._kernel(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), m, gqa=True)
        got = head_batch._grouped_as_rows(q, k, v, m)
        assert torch.allclose(got, want.transpose(1, 2), atol=1e-6)
