"""The hybrid KV pool (mem_cache/window_pool.py): window layers' KV released once out of every request's window.

Pool and cache accounting under random admit / chunked extend / decode / finish / abort / evict sequences (both
slot spaces exact, every running request's window intact); outputs with trimming equal outputs without it
through the scheduler (chunked prefill crossing the window, prefix reuse, a prefix cut back because its window
KV was released); capacity at Gemma-2-9B shapes.
"""

import random

import pytest
import torch

from braid.runtime.core import Req, SamplingParams
from braid.runtime.mem_cache.chunk_cache import ChunkCache
from braid.runtime.mem_cache.kv_sizing import hybrid_tokens_for_budget, max_tokens_for_budget, mha_kv_bytes_per_token
from braid.runtime.mem_cache.pools import ReqToTokenPool
from braid.runtime.mem_cache.radix_cache import RadixCache
from braid.runtime.mem_cache.window_pool import JUMP_FORWARD_MARGIN, HybridKVPool, window_layer_split
from byte_tokenizer import byte_tokenizer

W = 4  # the pool's window in the accounting tests


def _pool(size=96, window_size=48, windows=(W, None), device="cpu"):
    return HybridKVPool(size, window_size, torch.float32, head_num=1, head_dim=2, layer_windows=list(windows),
                        device=device)


# ---------------------------------------------------------------------------------------------- the pool


def test_layer_split_and_refusals():
    assert window_layer_split([4096, None, 4096, None]) == ((1, 3), (0, 2))
    assert window_layer_split([16, 16]) is None  # all windowed (Mistral): one pool, unchanged
    assert window_layer_split([None, None]) is None
    with pytest.raises(ValueError, match="both sliding-window and global"):
        _pool(windows=(W, W))


def test_alloc_needs_both_spaces_and_window_layers_write_window_slots():
    pool = _pool(size=10, window_size=4)
    full = pool.alloc(3)
    assert pool.available_size() == 7 and pool.window_available_size() == 1
    assert pool.alloc(2) is None, "the window space has one slot left"
    window = pool.full_to_window[full].long()
    assert sorted(window.tolist()) == [1, 2, 3]
    k = torch.arange(6, dtype=torch.float32).view(3, 1, 2)
    pool.set_kv(0, full, k, k + 100)  # layer 0: window layer
    pool.set_kv(1, full, k + 10, k + 110)  # layer 1: global layer
    assert torch.equal(pool.get_key_buffer(0)[window], k)
    assert torch.equal(pool.get_key_buffer(1)[full], k + 10)
    assert pool.get_key_buffer(0).shape[0] == 5 and pool.get_key_buffer(1).shape[0] == 11
    pool.release_window(full[:2])
    assert pool.window_available_size() == 3 and pool.available_size() == 7
    assert pool.window_slots(full).tolist() == [0, 0, window[2].item()], "released slots read the dummy slot"
    pool.free(full)  # finds the one window slot still held
    assert pool.available_size() == 10 and pool.window_available_size() == 4
    assert (pool.full_to_window[1:] == -1).all()


# ---------------------------------------------------------------------------------------------- random sequences


class Sim:
    """Drives a prefix cache over a hybrid pool like the scheduler does, checking both spaces after each step."""

    def __init__(self, radix: bool, seed: int):
        self.rng = random.Random(seed)
        self.pool = _pool()
        self.req_pool = ReqToTokenPool(6, 64, "cpu")
        self.cache = (RadixCache if radix else ChunkCache)(self.req_pool, self.pool)
        self.bases = [[self.rng.randrange(5) for _ in range(self.rng.randrange(4, 20))] for _ in range(3)]
        self.live: list[Req] = []  # hold a row: mid-prefill (is_chunked) or decoding
        self.rolled_back: set[str] = set()  # requests whose last change was a rollback (the next is a forward pass)
        self.n = 0

    def new_req(self) -> Req:
        self.n += 1
        prompt = self.rng.choice(self.bases) + [self.rng.randrange(5) for _ in range(self.rng.randrange(1, 24))]
        req = Req(rid=str(self.n), input_ids=prompt, sampling_params=SamplingParams(max_new_tokens=64))
        req.fill_ids = list(prompt)
        if self.rng.random() < 0.5:  # constrained: jump-forward may roll its last tokens back
            req.grammar = "rolls back"
        return req

    def admit(self) -> None:
        if self.req_pool.available_size() == 0:
            return
        req = self.new_req()
        req.prefix_indices, req.last_node = self.cache.match_prefix(req.fill_ids[:-1])
        self.cache.inc_lock_ref(req.last_node)
        req.req_pool_idx = self.req_pool.alloc()
        p = len(req.prefix_indices)
        self.req_pool.req_to_token[req.req_pool_idx, :p] = req.prefix_indices.int()
        req.kv_committed_len = p
        req.is_chunked = True
        self.live.append(req)

    def extend(self, req: Req, n: int) -> bool:
        loc = self.cache.alloc_slots(n)
        if loc is None:
            return False
        start = req.kv_committed_len
        self.req_pool.req_to_token[req.req_pool_idx, start:start + n] = loc.int()
        req.kv_committed_len += n
        self.cache.trim_window_kv([req], exact=self.rng.random() < 0.5)
        self.rolled_back.discard(req.rid)
        return True

    def roll_back(self, req: Req) -> None:
        """Jump-forward's re-encoding: up to JUMP_FORWARD_MARGIN decoded tokens' KV dropped (once between passes)."""
        new_len = max(len(req.input_ids), req.kv_committed_len - self.rng.randrange(1, JUMP_FORWARD_MARGIN + 1))
        self.cache.truncate_req_kv(req, new_len)
        req.fill_ids = req.fill_ids[:new_len]
        self.rolled_back.add(req.rid)

    def step(self) -> None:
        op = self.rng.random()
        if op < 0.25 or not self.live:
            self.admit()
        elif op < 0.85:
            req = self.rng.choice(self.live)
            if req.is_chunked:
                n = min(self.rng.randrange(1, 9), len(req.fill_ids) - req.kv_committed_len)
                if self.extend(req, n):
                    req.is_chunked = req.kv_committed_len < len(req.fill_ids)
                    self.cache.cache_unfinished_req(req)  # a chunk, or the prompt published after its prefill
            elif (req.grammar is not None and req.rid not in self.rolled_back and self.rng.random() < 0.3
                  and req.kv_committed_len > len(req.input_ids)):
                self.roll_back(req)
            elif len(req.fill_ids) < 60:
                req.fill_ids.append(self.rng.randrange(5))  # the token sampled last step goes in now
                self.extend(req, 1)
        elif op < 0.97:
            req = self.rng.choice(self.live)  # finish, abort or retract: the same hand-over
            self.live.remove(req)
            req.fill_ids = req.fill_ids[:req.kv_committed_len] if req.is_chunked else req.fill_ids
            self.cache.cache_finished_req(req)
        else:
            self.cache.evict(self.rng.randrange(1, 16), self.rng.randrange(0, 8))
        self.check()

    def own_window(self, req: Req) -> int:
        return max(req.kv_committed_len - max(self.cache._cache_owned_len(req), req.window_kv_from), 0)

    def check(self) -> None:
        pool, cache = self.pool, self.cache
        own_full = sum(r.kv_committed_len - cache._cache_owned_len(r) for r in self.live)
        assert pool.available_size() + cache.total_size() + own_full == pool.size
        tree_window = tree_window_locked = 0
        if isinstance(cache, RadixCache):
            for node in cache._iter_nodes():
                assert 0 <= node.window_from <= len(node.key)
                tree_window += node.window_held
                tree_window_locked += node.window_held if node.lock_ref else 0
            assert cache.window_evictable_size() + cache.window_protected_size() == tree_window
            assert cache.window_protected_size() == tree_window_locked
        own_window = sum(self.own_window(r) for r in self.live)
        assert pool.window_available_size() + tree_window + own_window == pool.window_size
        mapped = pool.full_to_window[1:]
        held = mapped[mapped >= 0]
        assert held.numel() == pool.window_size - pool.window_available_size()
        assert held.unique().numel() == held.numel() and (held >= 1).all()
        for r in self.live:  # what the next query of each request sees holds window KV
            L = r.kv_committed_len
            row = self.req_pool.req_to_token[r.req_pool_idx, max(0, L - (W - 1)):L].long()
            assert (pool.full_to_window[row] >= 0).all(), f"request {r.rid} lost window KV it still needs"
        assert cache.available_slots() <= min(pool.size, pool.window_size)

    def drain(self) -> None:
        for req in list(self.live):
            self.live.remove(req)
            req.fill_ids = req.fill_ids[:req.kv_committed_len]
            self.cache.cache_finished_req(req)
            self.check()
        self.cache.reset()
        assert self.pool.available_size() == self.pool.size
        assert self.pool.window_available_size() == self.pool.window_size
        assert (self.pool.full_to_window[1:] == -1).all()
        assert self.req_pool.available_size() == self.req_pool.size


@pytest.mark.parametrize("radix", [True, False], ids=["radix", "chunk_cache"])
def test_random_admit_extend_finish_abort_evict_keeps_both_spaces_exact(radix):
    rollbacks = 0
    for seed in range(6):
        sim = Sim(radix, seed)
        for _ in range(250):
            sim.step()
            rollbacks += len(sim.rolled_back)
        sim.drain()
    assert rollbacks > 0, "the sequences rolled no constrained request back"


def test_rollback_within_the_first_window_is_allowed_and_past_released_window_kv_is_refused():
    pool = _pool(size=64, window_size=64)
    req_pool = ReqToTokenPool(2, 64, "cpu")
    cache = ChunkCache(req_pool, pool)
    req = Req(rid="short", input_ids=[1, 2], sampling_params=SamplingParams(max_new_tokens=8))
    req.req_pool_idx = req_pool.alloc()
    req_pool.req_to_token[req.req_pool_idx, :5] = pool.alloc(5).int()
    req.kv_committed_len = 5
    cache.truncate_req_kv(req, 2)  # nothing was released yet: a rollback to the prompt is fine
    assert req.kv_committed_len == 2 and pool.available_size() == pool.size - 2
    req_pool.req_to_token[req.req_pool_idx, 2:40] = pool.alloc(38).int()
    req.kv_committed_len = 40
    cache.trim_window_kv([req], exact=True)  # no grammar: keeps W - 1 positions
    assert req.window_kv_from == 40 - (W - 1)
    with pytest.raises(RuntimeError, match="window KV below position 37 was released"):
        cache.truncate_req_kv(req, 39)
    assert req.kv_committed_len == 40, "a refused rollback changes nothing"


def test_match_is_cut_back_to_a_prefix_whose_window_is_held():
    pool = _pool(size=64, window_size=64)
    req_pool = ReqToTokenPool(4, 64, "cpu")
    cache = RadixCache(req_pool, pool)
    key = list(range(30))
    slots = pool.alloc(30)
    cache.insert(key, slots, window_from=26)  # the tokens before position 26 lost their window KV
    got, _ = cache.match_prefix(key)
    assert len(got) == 30, "the last W - 1 tokens hold window KV: the whole prefix is reused"
    got, node = cache.match_prefix(key[:20] + [99])
    assert len(got) == 0, "positions 17..19 were released: computed again"
    cache.insert(key[:10] + [7, 7], pool.alloc(12))  # a branch at position 10 holding all its window KV
    got, _ = cache.match_prefix(key[:10] + [7, 7, 5])
    assert len(got) == 0, "its parent's tokens 8..9 hold no window KV"


# ---------------------------------------------------------------------------------------------- sizing


def test_gemma2_9b_capacity_at_8k_is_at_least_1_3x_an_untrimmed_pool_of_the_same_bytes():
    per_layer = mha_kv_bytes_per_token(8, 256, 1, torch.bfloat16)  # Gemma-2-9B: 8 KV heads of 256
    budget = 100 * 2**30
    full, window = hybrid_tokens_for_budget(budget, 21 * per_layer, 21 * per_layer, 4096, 8192, 4096 + 256)
    untrimmed = max_tokens_for_budget(budget, 42 * per_layer)
    assert (full + 1) * 21 * per_layer + (window + 1) * 21 * per_layer <= budget
    assert full / untrimmed >= 1.3, (full, untrimmed)
    # requests of 8192 tokens: each holds 8192 full slots and at most 4096 window slots
    assert full // 8192 * 4096 + 4096 + 256 <= window
    # --window-kv-ratio trades long-context capacity for short requests (each of their tokens needs window KV)
    full_08, window_08 = hybrid_tokens_for_budget(budget, 21 * per_layer, 21 * per_layer, 4096, 8192, 4352, 0.8)
    assert window_08 == pytest.approx(0.8 * full_08, rel=1e-3) and window < window_08 < untrimmed < full_08 < full
    assert hybrid_tokens_for_budget(budget, 21 * per_layer, 21 * per_layer, 4096, 8192, 4352, 1.0) == (untrimmed,) * 2


def test_window_kv_flags_are_checked():
    from braid.runtime.config import ServerArgs

    with pytest.raises(ValueError, match="window_kv_ratio"):
        ServerArgs(window_kv_ratio=1.5)
    with pytest.raises(ValueError, match="no effect"):
        ServerArgs(window_kv_ratio=0.8, disable_window_kv_trimming=True)


# ---------------------------------------------------------------------------------------------- through the scheduler

WINDOW = 16


@pytest.fixture(scope="module")
def mixed_window_model(tmp_path_factory):
    """A tiny Qwen2 with window layers 0 and 2 (W = 16) and global layers 1 and 3."""
    import transformers

    path = tmp_path_factory.mktemp("mixed_window")
    cfg = transformers.Qwen2Config(
        vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, sliding_window=WINDOW, use_sliding_window=True,
        layer_types=["sliding_attention", "full_attention"] * 2, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = transformers.Qwen2ForCausalLM(cfg).eval()
    with torch.no_grad():  # larger weights than HF's init so the logits are far from uniform
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.2)
    model.save_pretrained(path, safe_serialization=True)
    byte_tokenizer().save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    torch.set_num_threads(1)


@pytest.fixture(scope="module")
def gemma2_model(tmp_path_factory):
    """A tiny Gemma-2 (runtime/models/gemma2.py): window 16 on layers 0 and 2, soft-caps on."""
    import transformers

    path = tmp_path_factory.mktemp("gemma2_window")
    cfg = transformers.Gemma2Config(
        vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=512, sliding_window=WINDOW,
        query_pre_attn_scalar=24, attn_logit_softcapping=3.0, final_logit_softcapping=4.0)
    torch.manual_seed(0)
    model = transformers.Gemma2ForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(0, 0.5 if name.endswith("norm.weight") else 0.25)
    model.save_pretrained(path, safe_serialization=True)
    byte_tokenizer().save_pretrained(path)
    return str(path)


def _prompts():
    gen = torch.Generator().manual_seed(1)
    return [torch.randint(0, 49152, (n,), generator=gen).tolist() for n in (200, 40, 23, 90)]


GREEDY = {"temperature": 0, "max_new_tokens": 30, "ignore_eos": True}


def _run(model: str, trim: bool, **flags):
    from braid.runtime import Engine

    prompts = _prompts()
    with Engine(model_path=model, log_level="warning", max_total_tokens=4096,
                disable_window_kv_trimming=not trim, **flags) as engine:
        first = engine.generate(input_ids=prompts, sampling_params=GREEDY, return_logprob=True)
        stats = engine.get_stats()
        follow_ups = [
            prompts[0] + first[0]["output_ids"] + [11, 12, 13],  # the next turn: reuses all 229 cached tokens
            prompts[0][:150] + [7, 8, 9],  # shares 150 tokens whose window KV was released: cut back
            prompts[3][:60] + [5],  # shares 60 of a 90-token prompt
        ]
        second = engine.generate(input_ids=follow_ups, sampling_params=GREEDY, return_logprob=True)
        end_stats = engine.get_stats()
    return first + second, stats, end_stats


@pytest.mark.parametrize("model,chunk", [("mixed_window_model", 4096), ("mixed_window_model", 8),
                                         ("gemma2_model", 8)],
                         ids=["whole_prefill", "chunked_prefill_8", "gemma2_chunked_prefill_8"])
def test_trimmed_outputs_equal_untrimmed_and_window_kv_is_released(request, model, chunk):
    model = request.getfixturevalue(model)
    trimmed, stats, end = _run(model, True, chunked_prefill_size=chunk)
    plain, plain_stats, _ = _run(model, False, chunked_prefill_size=chunk)
    assert "window_kv_total_tokens" not in plain_stats, "trimming off: one pool"
    for a, b in zip(trimmed, plain):
        assert a["output_ids"] == b["output_ids"]
        lp_a = [lp for lp, _ in a["meta_info"]["output_token_logprobs"]]
        lp_b = [lp for lp, _ in b["meta_info"]["output_token_logprobs"]]
        assert lp_a == pytest.approx(lp_b, abs=1e-5)
    # the four finished requests keep window KV for their last W - 1 tokens only; nothing is held by a request
    assert stats["window_kv_used_tokens"] == 0 and stats["kv_used_tokens"] == 0
    assert stats["window_kv_cached_tokens"] <= 4 * (WINDOW - 1)
    assert stats["kv_cached_tokens"] >= 200 + 40 + 23 + 90
    assert trimmed[4]["meta_info"]["cached_tokens"] == plain[4]["meta_info"]["cached_tokens"] == 229
    assert trimmed[5]["meta_info"]["cached_tokens"] < plain[5]["meta_info"]["cached_tokens"] == 150
    assert end["window_kv_used_tokens"] == 0 and end["kv_used_tokens"] == 0


@pytest.fixture(scope="module")
def gemma2_bpe_model(tmp_path_factory):
    """A tiny Gemma-2 (window 16) with SmolLM2's BPE tokenizer: jump-forward's re-encoding of the last tokens with
    the forced text then rolls back tokens whose KV is computed."""
    from tiny_families import write_tiny_family

    return write_tiny_family(tmp_path_factory.mktemp("gemma2_bpe"), "gemma2")


def test_constrained_requests_roll_back_through_jump_forward_on_a_trimmed_pool(gemma2_bpe_model, monkeypatch):
    """JSON-schema requests at temperature 1 whose jump-forward rolls back computed tokens, with prompts shorter than
    the window (nothing released yet) and longer (window KV released): no failure, valid JSON, the same tokens as
    an untrimmed pool, both pools fully free afterwards."""
    import json

    from braid.runtime import Engine
    from braid.runtime.mem_cache.base import PrefixCache

    rollbacks = []
    truncate = PrefixCache.truncate_req_kv

    def counting_truncate(self, req, new_len):
        if new_len < req.kv_committed_len:
            rollbacks.append((new_len, req.window_kv_from))
        truncate(self, req, new_len)

    monkeypatch.setattr(PrefixCache, "truncate_req_kv", counting_truncate)  # the scheduler runs in this process
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                               "age": {"type": "integer"}}, "required": ["name", "age"]}
    prompts = ["A person as JSON: ", "Some people, one per line, then a person as JSON. " * 6]
    params = [{"max_new_tokens": 48, "json_schema": json.dumps(schema), "temperature": 1.0, "seed": seed}
              for seed in range(16)]
    outputs, stats = {}, {}
    for trim in (True, False):
        # outlines-core: its jump-forward re-encodes the last tokens with the forced text (llguidance's never rolls back)
        with Engine(model_path=gemma2_bpe_model, log_level="warning", max_total_tokens=2048,
                    disable_window_kv_trimming=not trim, grammar_backend="outlines") as engine:
            outputs[trim] = engine.generate(prompt=[p for p in prompts for _ in params], sampling_params=params * 2)
            stats[trim] = engine.get_stats()
    assert any(new_len < WINDOW for new_len, _ in rollbacks), "no rollback within the first window"
    assert any(window_from > 0 for _, window_from in rollbacks), "no rollback after window KV was released"
    for out in outputs[True]:
        if out["meta_info"]["finish_reason"]["type"] == "stop":
            assert set(json.loads(out["text"])) == {"name", "age"}
    assert [o["output_ids"] for o in outputs[True]] == [o["output_ids"] for o in outputs[False]]
    assert stats[True]["window_kv_used_tokens"] == 0 and stats[True]["kv_used_tokens"] == 0


@pytest.mark.parametrize("radix", [True, False], ids=["radix", "chunk_cache"])
def test_a_200_token_request_keeps_at_most_w_window_slots_after_decoding(mixed_window_model, radix):
    from braid.runtime import Engine

    prompt = _prompts()[0]
    with Engine(model_path=mixed_window_model, log_level="warning", max_total_tokens=4096,
                disable_radix_cache=not radix, chunked_prefill_size=64) as engine:
        engine.generate(input_ids=prompt, sampling_params=GREEDY)
        stats = engine.get_stats()
    assert stats["window_kv_used_tokens"] == 0 and stats["kv_used_tokens"] == 0
    if radix:  # the cache keeps all 229 tokens' full KV, the window KV of the last W - 1 only
        assert stats["kv_cached_tokens"] == 229
        assert 0 < stats["window_kv_cached_tokens"] <= WINDOW - 1
    else:
        assert stats["window_kv_free_tokens"] == stats["window_kv_total_tokens"]
        assert stats["kv_free_tokens"] == stats["kv_total_tokens"]


@pytest.mark.gpu
def test_gpu_triton_cuda_graphs_and_overlap_trimmed_equal_untrimmed(mixed_window_model):
    """On CUDA: decode steps replayed from CUDA graphs (window slots translated into the graphs' static rows),
    the overlap schedule (window KV released behind the step in flight), bf16; outputs equal untrimmed ones."""
    flags = dict(device="cuda", dtype="bfloat16", attention_backend="triton", chunked_prefill_size=64)
    trimmed, stats, _ = _run(mixed_window_model, True, **flags)
    plain, _, _ = _run(mixed_window_model, False, **flags)
    # the same kernels over the same KV values: equal in bf16 too (the cut-back prefixes, computed again in other
    # chunks, are left out: bf16 rounding may differ there)
    for a, b in zip(trimmed[:5], plain[:5]):
        assert a["output_ids"] == b["output_ids"]
    assert stats["window_kv_used_tokens"] == 0 and stats["window_kv_cached_tokens"] <= 4 * (WINDOW - 1)
