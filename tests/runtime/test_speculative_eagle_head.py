"""EAGLE and EAGLE-3 draft heads loaded from checkpoints written in their published layouts (tiny random configs):
the head's logits and hidden output equal a reference built from HF transformers' Llama modules with the same
weights; the loader refuses a checkpoint that does not fit the target, naming what; the proposer's chains and trees
(each frontier row under the tree mask) are the dense head's over each path."""

import pytest
import torch
from torch import nn
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import (LlamaAttention, LlamaDecoderLayer, LlamaMLP, LlamaRMSNorm,
                                                      LlamaRotaryEmbedding)

from braid.runtime.speculative.eagle_head import load_eagle_head
from eagle_tiny import DRAFT_V, H, V, eagle3_tensors, eagle_tensors, rand, write_checkpoint

T = 7
CONFIG = dict(hidden_size=H, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2, vocab_size=V,
              rms_norm_eps=1e-5, rope_theta=10000.0, max_position_embeddings=128)


@pytest.fixture
def target():
    gen = torch.Generator().manual_seed(0)
    embed = nn.Embedding(V, H)
    embed.weight.data = rand(V, H, gen=gen)
    lm_head = nn.Linear(H, V, bias=False)
    lm_head.weight.data = rand(V, H, gen=gen)
    return embed, lm_head


def hf_config() -> LlamaConfig:
    cfg = LlamaConfig(**CONFIG, num_hidden_layers=1)
    cfg._attn_implementation = "sdpa"  # causal without a mask
    return cfg


def load_linear(module: nn.Linear, weight: torch.Tensor) -> None:
    module.weight.data = weight.clone()


def test_eagle_head_matches_hf_llama_layers(tmp_path, target):
    embed, lm_head = target
    gen = torch.Generator().manual_seed(1)
    tensors = eagle_tensors(gen)
    path = write_checkpoint(tmp_path / "eagle", {**CONFIG, "architectures": ["LlamaForCausalLM"],
                                                 "num_hidden_layers": 2}, tensors)
    head = load_eagle_head(path, embed, lm_head, target_hidden_size=H, target_vocab_size=V)
    assert head.c.kind == "EAGLE" and head.c.num_layers == 2 and head.c.fc_bias

    ids = torch.randint(0, V, (T,), generator=gen)
    feats = torch.randn(T, H, generator=gen)
    positions = torch.arange(T)
    logits, hidden = head(ids, feats, positions)

    cfg = hf_config()
    layers = []
    for i in range(2):
        layer = LlamaDecoderLayer(cfg, i)
        layer.load_state_dict({k[len(f"layers.{i}."):]: v for k, v in tensors.items() if k.startswith(f"layers.{i}.")},
                              strict=False)
        if i == 0:
            layer.input_layernorm = nn.Identity()  # EAGLE's first layer has none
        else:
            layer.input_layernorm.weight.data = tensors["layers.1.input_layernorm.weight"].clone()
        layers.append(layer)
    x = (torch.cat([embed(ids), feats], -1) @ tensors["fc.weight"].T + tensors["fc.bias"]).unsqueeze(0)
    rope = LlamaRotaryEmbedding(cfg)(x, positions.view(1, -1))
    with torch.no_grad():
        for layer in layers:
            x = layer(x, position_ids=positions.view(1, -1), position_embeddings=rope)
        ref_logits = lm_head(x[0])
    assert torch.allclose(hidden, x[0], atol=1e-5)
    assert torch.allclose(logits, ref_logits, atol=1e-5)
    # causal: a later token does not change an earlier position's output
    changed = ids.clone()
    changed[-1] = (changed[-1] + 1) % V
    assert torch.allclose(head(changed, feats, positions)[0][:-1], logits[:-1], atol=1e-6)


def test_eagle3_head_matches_hf_llama_modules(tmp_path, target):
    embed, lm_head = target
    gen = torch.Generator().manual_seed(2)
    tensors = eagle3_tensors(gen)
    path = write_checkpoint(tmp_path / "eagle3", {**CONFIG, "architectures": ["LlamaForCausalLMEagle3"],
                                                  "num_hidden_layers": 1, "draft_vocab_size": DRAFT_V},
                            {("model." + k if k.startswith("midlayer") else k): v for k, v in tensors.items()})
    head = load_eagle_head(path, embed, None, target_hidden_size=H, target_vocab_size=V)
    assert head.c.kind == "EAGLE3" and head.c.draft_vocab_size == DRAFT_V and not head.c.fc_bias

    ids = torch.randint(0, V, (T,), generator=gen)
    feats3 = torch.randn(T, 3 * H, generator=gen)
    positions = torch.arange(T)
    logits, hidden = head(ids, feats3, positions)

    cfg = hf_config()
    norms = {}
    for name in ("midlayer.input_layernorm", "midlayer.hidden_norm", "midlayer.post_attention_layernorm", "norm"):
        norms[name] = LlamaRMSNorm(H, eps=CONFIG["rms_norm_eps"])
        norms[name].weight.data = tensors[name + ".weight"].clone()
    attn = LlamaAttention(cfg, 0)
    for p in ("q", "k", "v", "o"):
        proj = getattr(attn, f"{p}_proj")
        weight = tensors[f"midlayer.self_attn.{p}_proj.weight"]
        setattr(attn, f"{p}_proj", nn.Linear(weight.shape[1], weight.shape[0], bias=False))
        load_linear(getattr(attn, f"{p}_proj"), weight)
        del proj
    mlp = LlamaMLP(cfg)
    mlp.load_state_dict({k[len("midlayer.mlp."):]: v for k, v in tensors.items() if k.startswith("midlayer.mlp.")})
    with torch.no_grad():
        fused = feats3 @ tensors["fc.weight"].T
        x = torch.cat([norms["midlayer.input_layernorm"](embed(ids)), norms["midlayer.hidden_norm"](fused)], -1)
        x = x.unsqueeze(0)
        rope = LlamaRotaryEmbedding(cfg)(x, positions.view(1, -1))
        h = attn(x, position_embeddings=rope, attention_mask=None)[0][0] + fused
        out = mlp(norms["midlayer.post_attention_layernorm"](h)) + h
        draft_logits = norms["norm"](out) @ tensors["lm_head.weight"].T
    assert torch.allclose(hidden, out, atol=1e-5)
    mapped = tensors["d2t"] + torch.arange(DRAFT_V)
    assert torch.allclose(logits[:, mapped], draft_logits, atol=1e-5)
    others = torch.ones(V, dtype=torch.bool)
    others[mapped] = False
    assert torch.isinf(logits[:, others]).all()  # tokens outside the draft vocabulary are never drafted
    # a later draft step feeds the head's own hidden output instead of the target's three layers
    logits2, _ = head(ids, hidden, positions)
    assert logits2.shape == (T, V)


def test_loader_refuses_what_does_not_fit(tmp_path, target):
    embed, lm_head = target
    gen = torch.Generator().manual_seed(3)
    cfg = {**CONFIG, "architectures": ["LlamaForCausalLMEagle3"], "draft_vocab_size": DRAFT_V}
    tensors = eagle3_tensors(gen)
    missing = {k: v for k, v in tensors.items() if k != "midlayer.hidden_norm.weight"}
    with pytest.raises(ValueError, match=r"lacks \['midlayer.hidden_norm.weight'\]"):
        load_eagle_head(write_checkpoint(tmp_path / "a", cfg, missing), embed, None, H, V)
    with pytest.raises(ValueError, match=r"unexpected \['extra.weight'\]"):
        load_eagle_head(write_checkpoint(tmp_path / "b", cfg, {**tensors, "extra.weight": torch.zeros(2)}),
                        embed, None, H, V)
    with pytest.raises(ValueError, match="takes 96 features; a EAGLE3 head over a target of hidden size 48"):
        load_eagle_head(write_checkpoint(tmp_path / "c", cfg, tensors), embed, None, 48, V)
    with pytest.raises(ValueError, match="vocab_size 96 is not the target's 100"):
        load_eagle_head(write_checkpoint(tmp_path / "d", cfg, tensors), embed, None, H, 100)
    wrong = {**tensors, "midlayer.mlp.up_proj.weight": torch.zeros(65, H)}
    with pytest.raises(ValueError, match=r"midlayer.mlp.up_proj.weight has shape \(65, 32\)"):
        load_eagle_head(write_checkpoint(tmp_path / "e", cfg, wrong), embed, None, H, V)
    with pytest.raises(ValueError, match="no fc.weight"):
        load_eagle_head(write_checkpoint(tmp_path / "f", cfg, {"norm.weight": torch.ones(H)}), embed, None, H, V)
    (tmp_path / "g").mkdir()
    with pytest.raises(ValueError, match="no \\*.safetensors files"):
        load_eagle_head(str(tmp_path / "g"), embed, None, H, V)


@pytest.mark.parametrize("kind", ["EAGLE", "EAGLE3"])
def test_cached_extend_matches_the_dense_reference(tmp_path, target, kind):
    """`extend` over per-request caches (two requests in the same calls, in uneven chunks, a rolled-back row run
    again) gives the dense causal forward's outputs row for row."""
    embed, lm_head = target
    gen = torch.Generator().manual_seed(4)
    if kind == "EAGLE":
        path = write_checkpoint(tmp_path / "h", {**CONFIG, "num_hidden_layers": 2}, eagle_tensors(gen))
        head = load_eagle_head(path, embed, lm_head, target_hidden_size=H, target_vocab_size=V)
    else:
        path = write_checkpoint(tmp_path / "h", {**CONFIG, "architectures": ["LlamaForCausalLMEagle3"],
                                                 "draft_vocab_size": DRAFT_V}, eagle3_tensors(gen))
        head = load_eagle_head(path, embed, None, target_hidden_size=H, target_vocab_size=V)
    F_in = head.c.fc_in if kind == "EAGLE3" else H
    seqs = [(torch.randint(0, V, (9,), generator=gen), torch.randn(9, F_in, generator=gen)) for _ in range(2)]
    want = [head(ids, feats, torch.arange(9))[1] for ids, feats in seqs]
    caches = [head.new_cache(), head.new_cache()]
    chunks = [(3, 1), (1, 4), (2, 1), (1, 1), (2, 2)]  # rows per request per call: 9 each
    done = [0, 0]
    with torch.no_grad():
        for step, rows in enumerate(chunks):
            if step == 3:  # a row is added, rolled back, and then computed again in the next call
                for cache in caches:
                    cache.truncate(cache.length - 1)
                done = [d - 1 for d in done]
                rows = (rows[0] + 1, rows[1] + 1)
            ids = torch.cat([seqs[i][0][done[i]:done[i] + n] for i, n in enumerate(rows)])
            feats = torch.cat([seqs[i][1][done[i]:done[i] + n] for i, n in enumerate(rows)])
            batch = head.batch(caches, list(rows), ids.tolist())
            assert batch.positions.tolist() == [p for i, n in enumerate(rows) for p in range(done[i], done[i] + n)]
            out = head.extend(batch, feats)
            row = 0
            for i, n in enumerate(rows):
                assert torch.allclose(out[row:row + n], want[i][done[i]:done[i] + n], atol=1e-5), (step, i)
                row += n
                done[i] += n
    assert done == [9, 9] and [c.length for c in caches] == [9, 9]
    assert caches[0].tokens == seqs[0][0].tolist()
    tok = head.greedy_tokens(want[0][-1:])
    ref_logits = head(seqs[0][0], seqs[0][1], torch.arange(9))[0][-1]
    assert int(tok) == int(ref_logits.argmax())


def make_proposer(tmp_path, target, seed: int):
    """An EagleProposer over a random 2-layer EAGLE head, with a stub runner holding the target's embedding and LM
    head (depth 3) -> (proposer, generator)."""
    from types import SimpleNamespace

    from braid.runtime.speculative.eagle import EagleProposer

    embed, lm_head = target
    gen = torch.Generator().manual_seed(seed)
    path = write_checkpoint(tmp_path / "h", {**CONFIG, "num_hidden_layers": 2}, eagle_tensors(gen))
    model = nn.Module()
    model.model = nn.Module()
    model.model.embed_tokens, model.lm_head = embed, lm_head
    runner = SimpleNamespace(model=model, model_config=SimpleNamespace(hidden_size=H, num_layers=2), vocab_size=V,
                             device=torch.device("cpu"), dtype=torch.float32)
    args = SimpleNamespace(speculative_algorithm="EAGLE", speculative_draft_model_path=path, speculative_num_steps=3)
    return EagleProposer(args, runner, context_len=64), gen


def prefilled_request(gen, feats: torch.Tensor, proposer):
    """A request after prefill: KV of positions 0..5, the first sampled token 5, the prefill's features recorded."""
    from braid.runtime.core import Req
    from braid.runtime.sampling_params import SamplingParams

    req = Req(rid="r", input_ids=torch.randint(0, V, (6,), generator=gen).tolist(), sampling_params=SamplingParams())
    req.fill_ids = req.input_ids + [5]
    req.kv_committed_len = 6
    proposer.record(req, 0, feats[:6])
    return req


def test_proposer_drafts_are_the_dense_heads_chain(tmp_path, target):
    """EagleProposer's bookkeeping (features recorded per pass, the catch-up rows, the chain, the rollback after a
    partial acceptance) gives the drafts of the dense reference: each draft token the argmax of the head run over the
    whole sequence, the target's features before the drafts and the head's own outputs inside them."""
    proposer, gen = make_proposer(tmp_path, target, 6)
    head = proposer.head

    def reference(tokens: list[int], feats: torch.Tensor, k: int) -> list[int]:
        # rows r < len(feats): token tokens[r + 1], the target's feature r; then the chain on the head's outputs
        ids, hidden, out = list(tokens[1:]), feats, []
        with torch.no_grad():
            for _ in range(k):
                _, h = head(torch.tensor(ids), hidden, torch.arange(len(ids)))
                tok = int(head.greedy_tokens(h[-1:]))
                out.append(tok)
                ids.append(tok)
                hidden = torch.cat([hidden, h[-1:]])
        return out

    feats = torch.randn(12, H, generator=gen)  # the target's features by position
    req = prefilled_request(gen, feats, proposer)
    draft = proposer.propose([req], [3])[0]
    assert draft == reference(req.fill_ids, feats[:6], 3)
    # the verify pass over [5] + draft recorded 4 features; the first draft token was accepted, then 7
    proposer.record(req, 6, feats[6:10])
    req.fill_ids += [draft[0], 7]
    req.kv_committed_len = 8
    assert proposer.propose([req], [2])[0] == reference(req.fill_ids, feats[:8], 2)
    assert req.spec_state.cache.length == 8  # the chain's rows rolled back
    # a step that brought no new token (nothing recorded): the same draft again
    assert proposer.propose([req], [2])[0] == reference(req.fill_ids, feats[:8], 2)
    proposer.release(req)
    assert req.spec_state is None


@pytest.mark.parametrize("k, num", [(2, 5), (3, 9)])
def test_proposer_trees_are_the_dense_heads_tree(tmp_path, target, k, num):
    """Tree drafts: each frontier row, run beside its cousins under the tree mask, sees the committed rows and its
    own ancestors only: the tree equals one built from the dense head run over each node's path alone (SGLang's
    rule: the k best path products a depth expanded, the num best of all candidates), and the rows roll back."""
    proposer, gen = make_proposer(tmp_path, target, 8)
    head = proposer.head
    feats = torch.randn(12, H, generator=gen)
    req = prefilled_request(gen, feats, proposer)
    tokens, committed = req.fill_ids, feats[:6]

    outputs = {}  # a node's path -> the dense head's output at its row

    def children(path: list[int], hidden: torch.Tensor, score: float):
        # the head over the committed rows, then the path's rows fed the head's output at the row before
        ids = tokens[1:] + path
        with torch.no_grad():
            _, h = head(torch.tensor(ids), hidden, torch.arange(len(ids)))
            probs, top = head.top_tokens(h[-1:], k)
        outputs[tuple(path)] = h[-1]
        nxt = torch.cat([hidden, h[-1:]])
        return [(path + [t], nxt, score * p) for p, t in zip(probs[0].tolist(), top[0].tolist())]

    candidates = frontier = children([], committed, 1.0)
    frontiers = []
    for _ in range(2):
        frontiers.append([tuple(path) for path, _, _ in frontier])
        depth = [c for path, hidden, score in frontier for c in children(path, hidden, score)]
        candidates = candidates + depth
        frontier = sorted(depth, key=lambda c: -c[2])[:k]
    want = sorted(tuple(path) for path, _, _ in sorted(candidates, key=lambda c: -c[2])[:num])

    calls = []  # the head's outputs of each pass: the catch-up, then one a depth (frontier rows, likeliest first)
    for name in ("extend", "draft"):
        def recorded(*args, run=getattr(head, name), **kwargs):
            calls.append(run(*args, **kwargs))
            return calls[-1]

        setattr(head, name, recorded)
    tree = proposer.propose_trees([req], [3], k, num)[0]
    paths = [[]]
    for tok, parent in zip(tree.tokens, tree.parents):
        paths.append(paths[parent] + [tok])
    assert sorted(tuple(p) for p in paths[1:]) == want
    # every frontier row's output is the dense head's over its own path (the tree mask hides its cousins)
    assert len(calls) == 3
    for out, nodes in zip(calls[1:], frontiers):
        assert torch.allclose(out, torch.stack([outputs[n] for n in nodes]), atol=1e-5)
    assert req.spec_state.cache.length == 6  # the tree's rows rolled back
    # a request with room for one token drafts depth 1 only
    assert set(proposer.propose_trees([req], [1], k, num)[0].parents) == {0}
