import random
from collections import Counter
from dataclasses import dataclass
from typing import Any, Optional

import pytest
import torch

from braid.runtime.core import Req, SamplingParams
from braid.runtime.mem_cache.chunk_cache import ChunkCache
from braid.runtime.mem_cache.pools import MHAKVPool, ReqToTokenPool
from braid.runtime.mem_cache.radix_cache import RadixCache

KV_SIZE = 64
MAX_CONTEXT = 32


@dataclass
class FakeReq:
    rid: str
    fill_ids: list[int]
    req_pool_idx: Optional[int] = None
    kv_committed_len: int = 0
    last_node: Any = None
    prefix_indices: Optional[torch.Tensor] = None
    lora_path: Optional[str] = None  # the request's prefix namespace (its LoRA adapter)
    # the reference model's view: how many leading row slots the cache owns (== locked prefix length)
    ref_locked_len: int = 0


@pytest.fixture
def pools():
    req_pool = ReqToTokenPool(8, MAX_CONTEXT, "cpu")
    kv_pool = MHAKVPool(KV_SIZE, torch.float32, head_num=1, head_dim=2, layer_num=1, device="cpu")
    yield req_pool, kv_pool
    assert req_pool.available_size() == req_pool.size


@pytest.fixture
def cache(pools):
    req_pool, kv_pool = pools
    cache = RadixCache(req_pool, kv_pool)
    yield cache
    cache.reset()
    assert cache.total_size() == cache.evictable_size() == cache.protected_size() == 0
    assert kv_pool.available_size() == kv_pool.size


def _insert(cache, key):
    """Insert key with fresh slots, freeing the ones the tree already had; return the tree's slots."""
    value = cache.kv_pool.alloc(len(key))
    prefix_len, slots, node = cache.insert(key, value)
    cache.kv_pool.free(value[:prefix_len])
    return slots


def _start_req(cache, rid, tokens):
    req = FakeReq(rid, list(tokens))
    req.req_pool_idx = cache.req_to_token_pool.alloc()
    prefix, node = cache.match_prefix(tokens)
    cache.inc_lock_ref(node)
    row = cache.req_to_token_pool.req_to_token[req.req_pool_idx]
    row[: len(prefix)] = prefix.to(torch.int32)
    new = cache.kv_pool.alloc(len(tokens) - len(prefix))
    row[len(prefix): len(tokens)] = new.to(torch.int32)
    req.kv_committed_len, req.last_node, req.prefix_indices = len(tokens), node, prefix
    return req, prefix, new


# ---- unit tests ----
def test_match_after_insert_and_split(cache):
    slots = _insert(cache, [1, 2, 3, 4])
    assert cache.total_size() == 4
    got, node = cache.match_prefix([1, 2, 3, 4, 5])
    assert got.tolist() == slots.tolist() and got.dtype == torch.int64
    got, node = cache.match_prefix([1, 2, 9])
    assert got.tolist() == slots[:2].tolist()
    assert node.key == [1, 2] and node.value.tolist() == slots[:2].tolist(), "the node covers exactly the match"
    assert list(node.children) == [3] and node.children[3].key == [3, 4]
    assert node.parent is cache.root_node
    assert cache.total_size() == 4, "splitting adds no tokens"
    got, node = cache.match_prefix([7, 1])
    assert got.numel() == 0 and node is cache.root_node
    got, node = cache.match_prefix([])
    assert got.numel() == 0 and node is cache.root_node


def test_namespaces_keep_prefixes_apart(cache):
    """A LoRA adapter's prefixes (namespace = its name) match only under that adapter, never under another or the
    base model (None), even for the same token ids; each namespace's tokens take their own slots."""
    base = _insert(cache, [1, 2, 3, 4])
    value = cache.kv_pool.alloc(4)
    prefix_len, sql, _ = cache.insert([1, 2, 3, 4], value, namespace="sql")
    assert prefix_len == 0 and sql.tolist() == value.tolist()
    assert cache.total_size() == 8
    assert cache.match_prefix([1, 2, 3, 9])[0].tolist() == base[:3].tolist()
    assert cache.match_prefix([1, 2, 3, 9], namespace="sql")[0].tolist() == sql[:3].tolist()
    got, node = cache.match_prefix([1, 2, 3, 4], namespace="router")
    assert got.numel() == 0 and node is cache.root_node
    assert cache.evict(8) == 8 and cache.total_size() == 0


def test_insert_shares_prefix_and_returns_tree_slots(cache):
    a = _insert(cache, [1, 2, 3])
    value = cache.kv_pool.alloc(4)
    prefix_len, slots, node = cache.insert([1, 2, 5, 6], value)
    assert prefix_len == 2
    assert slots.tolist() == a[:2].tolist() + value[2:].tolist()
    assert node.key == [5, 6] and node.parent.key == [1, 2]
    cache.kv_pool.free(value[:2])
    assert cache.total_size() == 5 == cache.evictable_size()
    # inserting a prefix of a cached sequence ends on a split node and adds nothing
    value = cache.kv_pool.alloc(1)
    prefix_len, slots, node = cache.insert([1], value)
    assert prefix_len == 1 and slots.tolist() == a[:1].tolist() and node.key == [1]
    cache.kv_pool.free(value)
    with pytest.raises(ValueError):
        cache.insert([1, 2], value)


def test_lock_prevents_eviction(cache):
    a = _insert(cache, [1, 2, 3, 4])
    _insert(cache, [1, 2, 7, 8, 9])
    _, node = cache.match_prefix([1, 2, 3, 4])
    cache.inc_lock_ref(node)
    cache.inc_lock_ref(node)
    assert cache.protected_size() == 4 and cache.evictable_size() == 3
    before = cache.kv_pool.available_size()
    assert cache.evict(100) == 3
    assert cache.kv_pool.available_size() == before + 3
    assert cache.match_prefix([1, 2, 3, 4])[0].tolist() == a.tolist()
    assert cache.match_prefix([1, 2, 7])[0].tolist() == a[:2].tolist()
    cache.dec_lock_ref(node)
    assert cache.evict(100) == 0, "still locked once"
    cache.dec_lock_ref(node)
    assert cache.protected_size() == 0 and cache.evictable_size() == 4
    with pytest.raises(RuntimeError):
        cache.dec_lock_ref(node)
    assert cache.evict(1) == 2, "a whole leaf edge goes at once"
    assert cache.evict(1) == 2
    assert cache.total_size() == 0


def test_locking_an_evicted_node_is_an_error(cache):
    _insert(cache, [1, 2])
    _, node = cache.match_prefix([1, 2])
    assert cache.evict(2) == 2
    with pytest.raises(RuntimeError, match="no longer in the cache"):
        cache.inc_lock_ref(node)
    _insert(cache, [3])
    _, node = cache.match_prefix([3])
    cache.reset()
    with pytest.raises(RuntimeError, match="no longer in the cache"):
        cache.inc_lock_ref(node)
    assert cache.protected_size() == cache.evictable_size() == 0
    cache.inc_lock_ref(cache.root_node)  # the root and None are always fine
    cache.dec_lock_ref(None)


def test_lock_of_a_split_node_protects_its_prefix(cache):
    _insert(cache, [1, 2, 3, 4])
    _, node = cache.match_prefix([1, 2, 3, 4])
    cache.inc_lock_ref(node)
    cache.match_prefix([1, 2])  # splits the locked edge
    assert cache.protected_size() == 4
    assert cache.evict(10) == 0
    cache.dec_lock_ref(node)
    assert cache.evictable_size() == 4 and cache.evict(10) == 4


def test_evict_in_lru_order(cache):
    a = _insert(cache, [1, 1])
    _insert(cache, [2, 2, 2])
    c = _insert(cache, [3])
    cache.match_prefix([1])  # refreshes only the first token of [1, 1]: the edge splits
    assert cache.evict(1) == 1, "the tail of [1, 1], untouched since its insert, is the oldest leaf"
    assert cache.match_prefix([1, 1])[0].tolist() == a[:1].tolist()
    assert cache.evict(1) == 3, "then [2, 2, 2], the oldest whole edge"
    assert cache.match_prefix([2])[0].numel() == 0
    assert cache.match_prefix([3])[0].tolist() == c.tolist()  # now [3] is newer than [1]
    assert cache.evict(1) == 1
    assert cache.match_prefix([1])[0].numel() == 0 and cache.match_prefix([3])[0].tolist() == c.tolist()
    assert cache.evict(0) == 0 and cache.total_size() == 1


def test_evicting_children_makes_the_parent_evictable(cache):
    _insert(cache, [1, 2, 3])
    _insert(cache, [1, 2, 4])
    assert cache.evict(3) == 4, "both leaves [3] and [4], then their parent [1, 2]"
    assert cache.total_size() == 0 and not cache.root_node.children


def test_reset_frees_everything(cache, pools):
    _, kv_pool = pools
    for key in ([1, 2, 3], [1, 2, 4, 5], [6]):
        _insert(cache, key)
    assert kv_pool.available_size() == kv_pool.size - 6
    cache.reset()
    assert cache.total_size() == 0 and cache.match_prefix([1, 2, 3])[0].numel() == 0
    assert kv_pool.available_size() == kv_pool.size
    _insert(cache, [1])
    assert cache.total_size() == 1


def test_cache_finished_req_frees_duplicates_and_releases(cache, pools):
    req_pool, kv_pool = pools
    shared = _insert(cache, [5, 6])
    req, prefix, new = _start_req(cache, "a", [5, 6, 7, 8])
    assert prefix.tolist() == shared.tolist() and cache.protected_size() == 2
    # another request caches [5, 6, 7] meanwhile: "a"'s slot for 7 becomes a duplicate
    other = _insert(cache, [5, 6, 7])
    free_before = kv_pool.available_size()
    cache.cache_finished_req(req)
    assert req.req_pool_idx is None and req.last_node is None
    assert kv_pool.available_size() == free_before + 1
    assert cache.match_prefix([5, 6, 7, 8])[0].tolist() == other.tolist() + new[1:].tolist()
    assert cache.protected_size() == 0 and cache.evictable_size() == 4
    assert req_pool.available_size() == req_pool.size


def test_cache_unfinished_req_moves_the_lock_and_rewrites_the_row(cache):
    req, prefix, new = _start_req(cache, "a", [1, 2, 3])
    assert prefix.numel() == 0
    dup = _insert(cache, [1, 2])  # a concurrent request got [1, 2] in first
    cache.cache_unfinished_req(req)
    expected = dup.tolist() + new[2:].tolist()
    assert req.prefix_indices.tolist() == expected and req.prefix_indices.dtype == torch.int64
    assert cache.req_to_token_pool.req_to_token[req.req_pool_idx, :3].tolist() == expected
    assert cache.protected_size() == 3 and cache.evict(100) == 0
    # the next chunk extends the committed prefix
    more = cache.kv_pool.alloc(2)
    cache.req_to_token_pool.req_to_token[req.req_pool_idx, 3:5] = more.to(torch.int32)
    req.fill_ids += [4, 5]
    req.kv_committed_len = 5
    cache.cache_unfinished_req(req)
    assert req.prefix_indices.tolist() == expected + more.tolist()
    assert cache.protected_size() == 5 and req.last_node.key == [4, 5]
    cache.cache_finished_req(req)
    assert cache.protected_size() == 0 and cache.evictable_size() == 5


def test_works_with_the_runtime_req(cache):
    req = Req("r0", [3, 1, 4, 1], SamplingParams())
    req.req_pool_idx = cache.req_to_token_pool.alloc()
    prefix, req.last_node = cache.match_prefix(req.input_ids)
    cache.inc_lock_ref(req.last_node)
    slots = cache.kv_pool.alloc(4)
    cache.req_to_token_pool.req_to_token[req.req_pool_idx, :4] = slots.to(torch.int32)
    req.fill_ids, req.kv_committed_len = req.all_ids(), 4
    cache.cache_unfinished_req(req)
    req.output_ids.append(5)
    req.fill_ids = req.all_ids()  # the sampled token's KV is not committed yet
    cache.cache_finished_req(req)
    assert cache.match_prefix([3, 1, 4, 1, 5])[0].tolist() == slots.tolist()


def test_chunk_cache(pools):
    req_pool, kv_pool = pools
    cache = ChunkCache(req_pool, kv_pool)
    assert cache.disabled and not RadixCache.disabled
    slots, node = cache.match_prefix([1, 2, 3])
    assert slots.numel() == 0 and node is None
    req = FakeReq("a", [1, 2, 3, 4], req_pool_idx=req_pool.alloc())
    kv = kv_pool.alloc(3)
    req_pool.req_to_token[req.req_pool_idx, :3] = kv.to(torch.int32)
    req.kv_committed_len = 3
    cache.cache_unfinished_req(req)
    assert req.prefix_indices.tolist() == kv.tolist() and req.prefix_indices.dtype == torch.int64
    cache.inc_lock_ref(None)
    cache.dec_lock_ref(None)
    assert cache.evict(10) == 0 and cache.total_size() == cache.evictable_size() == cache.protected_size() == 0
    cache.cache_finished_req(req)
    assert req.req_pool_idx is None
    with pytest.raises(RuntimeError):
        cache.cache_finished_req(req)
    cache.reset()
    assert kv_pool.available_size() == kv_pool.size and req_pool.available_size() == req_pool.size


# ---- randomized test against a naive model ----
class Reference:
    """The cache as a set of cached token prefixes (each maps to the slot of its last token)."""

    def __init__(self, kv_size: int):
        self.cached: dict[tuple, int] = {}
        self.time: dict[tuple, int] = {}
        self.locks: Counter = Counter()
        self.owner: dict[int, object] = {s: "free" for s in range(1, kv_size + 1)}
        self.clock = 0

    def tick(self) -> int:
        self.clock += 1
        return self.clock

    def match(self, key) -> list[int]:
        t = self.tick()
        out = []
        for j in range(len(key)):
            p = tuple(key[: j + 1])
            if p not in self.cached:
                break
            out.append(self.cached[p])
            self.time[p] = t
        return out

    def insert(self, key, slots, holder) -> list[int]:
        """Slots of `holder` that duplicate cached ones go back to the free list; the rest become the tree's."""
        t = self.tick()
        tree_slots = []
        for j, s in enumerate(slots):
            p = tuple(key[: j + 1])
            if p in self.cached:
                if s != self.cached[p]:
                    assert self.owner[s] == holder
                    self.owner[s] = "free"
            else:
                assert self.owner[s] == holder
                self.owner[s] = "tree"
                self.cached[p] = s
            tree_slots.append(self.cached[p])
            self.time[p] = t
        return tree_slots

    def lock(self, key, delta: int) -> None:
        for j in range(len(key)):
            self.locks[tuple(key[: j + 1])] += delta
            assert self.locks[tuple(key[: j + 1])] >= 0

    def evictable(self) -> int:
        return sum(1 for p in self.cached if self.locks[p] == 0)


def _tree_contents(cache) -> dict[tuple, tuple[int, int]]:
    """prefix -> (slot, lock_ref), checking the tree's structure on the way."""
    out = {}
    stack = [(cache.root_node, ())]
    while stack:
        node, prefix = stack.pop()
        for first, child in node.children.items():
            assert child.parent is node and child.key and child.key[0] == first
            assert len(child.key) == child.value.numel()
            assert child.lock_ref >= 0 and child.last_access <= node.last_access
            values = child.value.tolist()
            p = prefix
            for tok, slot in zip(child.key, values):
                p = p + (tok,)
                out[p] = (slot, child.lock_ref)
            stack.append((child, p))
    return out


class Harness:
    def __init__(self, seed: int):
        self.rng = random.Random(seed)
        self.req_pool = ReqToTokenPool(6, MAX_CONTEXT, "cpu")
        self.kv_pool = MHAKVPool(KV_SIZE, torch.float32, head_num=1, head_dim=2, layer_num=1, device="cpu")
        self.cache = RadixCache(self.req_pool, self.kv_pool)
        self.ref = Reference(KV_SIZE)
        self.live: list[FakeReq] = []
        self.external_locks: list[tuple[Any, tuple]] = []
        self.history: list[list[int]] = [[]]
        self.n_req = 0

    # ---- random inputs ----
    def random_key(self, max_len: int = MAX_CONTEXT) -> list[int]:
        base = self.rng.choice(self.history)
        key = base[: self.rng.randint(0, len(base))]
        key += [self.rng.randrange(3) for _ in range(self.rng.randint(0, 10))]
        key = key[:max_len]
        if self.rng.random() < 0.3:
            self.history.append(key)
            if len(self.history) > 30:
                self.history.pop(1)
        return key

    # ---- operations, each mirrored on the reference ----
    def op_match(self):
        key = self.random_key()
        got, node = self.cache.match_prefix(key)
        assert got.tolist() == self.ref.match(key)
        assert got.numel() == 0 or node.value[-1].item() == got[-1].item()

    def op_evict(self, n: Optional[int] = None):
        n = self.rng.randint(0, 12) if n is None else n
        before = dict(self.ref.cached)
        evictable_before = self.ref.evictable()
        freed = self.cache.evict(n)
        after = _tree_contents(self.cache)
        assert after.keys() <= before.keys()
        removed = before.keys() - after.keys()
        assert freed == len(removed) >= min(n, evictable_before)
        for p in removed:
            assert self.ref.locks[p] == 0, "evicted a locked token"
            self.ref.owner[self.ref.cached.pop(p)] = "free"
        if removed:
            newest_removed = max(self.ref.time[p] for p in removed)
            parents = {p[:-1] for p in after}
            for p in after:
                if p not in parents and self.ref.locks[p] == 0:
                    assert self.ref.time[p] >= newest_removed, "evicted a more recently used leaf first"
        return freed

    def op_insert(self):
        key = self.random_key()
        value = self.alloc(len(key))
        if value is None:
            return
        for s in value.tolist():
            self.ref.owner[s] = "ext"
        prefix_len, slots, node = self.cache.insert(key, value)
        self.kv_pool.free(value[:prefix_len])
        assert slots.tolist() == self.ref.insert(key, value.tolist(), "ext")
        assert all(self.ref.owner[s] != "ext" for s in value.tolist())

    def op_lock(self):
        key = self.random_key()
        got, node = self.cache.match_prefix(key)
        matched = key[: len(self.ref.match(key))]
        self.cache.inc_lock_ref(node)
        self.ref.lock(matched, +1)
        self.external_locks.append((node, tuple(matched)))

    def op_unlock(self):
        if self.external_locks:
            node, key = self.external_locks.pop(self.rng.randrange(len(self.external_locks)))
            self.cache.dec_lock_ref(node)
            self.ref.lock(key, -1)

    def alloc(self, n: int) -> Optional[torch.Tensor]:
        got = self.kv_pool.alloc(n)
        if got is None:
            self.op_evict(n - self.kv_pool.available_size())
            got = self.kv_pool.alloc(n)
        return got

    def op_new_req(self):
        if self.req_pool.available_size() == 0:
            return
        tokens = self.random_key(MAX_CONTEXT - 8) or [self.rng.randrange(3)]
        self.n_req += 1
        req = FakeReq(f"r{self.n_req}", tokens, req_pool_idx=self.req_pool.alloc())
        # as a scheduler does, leave at least one token to compute
        prefix, node = self.cache.match_prefix(tokens[:-1])
        assert prefix.tolist() == self.ref.match(tokens[:-1])
        self.cache.inc_lock_ref(node)
        self.ref.lock(tokens[: len(prefix)], +1)
        self.cache.req_to_token_pool.req_to_token[req.req_pool_idx, : len(prefix)] = prefix.to(torch.int32)
        req.kv_committed_len = req.ref_locked_len = len(prefix)
        req.last_node, req.prefix_indices = node, prefix
        self.live.append(req)
        self.op_extend(req)

    def op_extend(self, req: FakeReq):
        if req.kv_committed_len == len(req.fill_ids):
            if len(req.fill_ids) == MAX_CONTEXT:
                return self.op_finish(req)
            req.fill_ids.append(self.rng.randrange(3))  # a decode step
        chunk = self.rng.randint(1, len(req.fill_ids) - req.kv_committed_len)
        slots = self.alloc(chunk)
        if slots is None:
            return
        start = req.kv_committed_len
        self.req_pool.req_to_token[req.req_pool_idx, start: start + chunk] = slots.to(torch.int32)
        for s in slots.tolist():
            assert self.ref.owner[s] == "free"
            self.ref.owner[s] = req.rid
        req.kv_committed_len += chunk
        if self.rng.random() < 0.5:
            self.op_cache_unfinished(req)

    def _ref_hand_over(self, req: FakeReq) -> list[int]:
        committed = req.fill_ids[: req.kv_committed_len]
        row = self.req_pool.req_to_token[req.req_pool_idx, : req.kv_committed_len].tolist()
        return self.ref.insert(committed, row, req.rid)

    def op_cache_unfinished(self, req: FakeReq):
        expected = self._ref_hand_over(req)
        old_node = req.last_node
        self.cache.cache_unfinished_req(req)
        assert req.prefix_indices.tolist() == expected
        assert self.req_pool.req_to_token[req.req_pool_idx, : req.kv_committed_len].tolist() == expected
        assert req.last_node is not old_node or req.kv_committed_len == req.ref_locked_len
        self.ref.lock(req.fill_ids[: req.kv_committed_len], +1)
        self.ref.lock(req.fill_ids[: req.ref_locked_len], -1)
        req.ref_locked_len = req.kv_committed_len

    def op_finish(self, req: FakeReq):
        row_idx = req.req_pool_idx
        self._ref_hand_over(req)
        self.cache.cache_finished_req(req)
        assert req.req_pool_idx is None and req.last_node is None
        assert self.req_pool._is_free[row_idx]
        self.ref.lock(req.fill_ids[: req.ref_locked_len], -1)
        self.live.remove(req)

    def step(self):
        r = self.rng.random()
        if r < 0.2:
            self.op_new_req()
        elif r < 0.45 and self.live:
            self.op_extend(self.rng.choice(self.live))
        elif r < 0.55 and self.live:
            self.op_finish(self.rng.choice(self.live))
        elif r < 0.7:
            self.op_match()
        elif r < 0.8:
            self.op_evict()
        elif r < 0.88:
            self.op_insert()
        elif r < 0.94:
            self.op_lock()
        else:
            self.op_unlock()

    # ---- invariants ----
    def check(self):
        ref, cache = self.ref, self.cache
        tree = _tree_contents(cache)
        assert {p: s for p, (s, _) in tree.items()} == ref.cached, "tree content differs from the reference"
        for p, (_, lock_ref) in tree.items():
            assert (lock_ref > 0) == (ref.locks[p] > 0)
        assert cache.evictable_size() == ref.evictable()
        assert cache.protected_size() == len(ref.cached) - ref.evictable()
        assert cache.evictable_size() + cache.protected_size() == cache.total_size() == len(ref.cached)

        free = self.kv_pool.free_slots.tolist()
        assert len(free) == len(set(free)) == self.kv_pool.available_size()
        owner: dict[int, object] = {}
        for s in free:
            owner[s] = "free"
        for s, _ in tree.values():
            assert s not in owner, f"slot {s} owned twice"
            owner[s] = "tree"
        for req in self.live:
            row = self.req_pool.req_to_token[req.req_pool_idx, : req.kv_committed_len].tolist()
            for j, s in enumerate(row):
                if j < req.ref_locked_len:
                    assert ref.cached[tuple(req.fill_ids[: j + 1])] == s, "locked prefix slot is not the tree's"
                else:
                    assert s not in owner, f"slot {s} owned twice"
                    owner[s] = req.rid
        assert owner == ref.owner, "slot ownership differs from the reference"
        assert sorted(owner) == list(range(1, KV_SIZE + 1))
        assert self.req_pool.available_size() == self.req_pool.size - len(self.live)

    def drain(self):
        for req in list(self.live):
            self.op_finish(req)
        while self.external_locks:
            self.op_unlock()
        self.check()
        assert self.cache.protected_size() == 0
        self.op_evict(KV_SIZE + 1)
        assert not self.ref.cached and self.cache.total_size() == 0
        self.cache.reset()
        assert self.kv_pool.available_size() == self.kv_pool.size
        assert self.req_pool.available_size() == self.req_pool.size
        assert self.cache.total_size() == 0


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_randomized_against_reference(seed):
    h = Harness(seed)
    for _ in range(2000):
        h.step()
        h.check()
    h.drain()
