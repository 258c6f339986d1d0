"""EAGLE / EAGLE-3 proposer: chain drafts (topk 1) or tree drafts (topk > 1, draft_tree.py) from a draft head fed
with the target's hidden states.

The head's row at position r takes the token at r + 1 and the target's feature at r (EAGLE: the final hidden state;
EAGLE-3: three layers' input residual streams, concatenated) and predicts the token at r + 2. A request whose target
KV covers positions < Q (kv_committed_len; its last token, at Q, has none yet) has every row < Q computable from
target features. Per step, for each request:

1. catch-up: the head runs over the rows it has not seen yet (after prefill, the whole prompt; after a verify pass,
   the accepted tokens and the target's token after them), from the features the target passes recorded
   (`record`: prefill chunks, mixed-in decode rows, verify passes); its output at row Q - 1 gives draft token 1;
2. chain: draft token s - 1 at row Q + s - 2 with the head's own output at the row before as its feature gives draft
   token s (greedy, argmax), for `--speculative-num-steps` tokens (a tree, `propose_trees`: each depth one head
   pass over the frontier's k rows a request, under a tree mask);
3. the rows of step 2 never enter the head's KV (they live in the batch's working copy, head_batch.py): after
   verification the accepted tokens' rows are computed in the next catch-up from the target's features, as the
   head was trained.

Steps 1 and 2 run all requests at once: one head pass for the whole batch at a time (a `HeadBatch`, one attention
call a layer), and the draft tokens stay on the device until the drafts are complete (one copy to the host a propose
call, which verification needs anyway).

A greedy draft is deterministic: its draft distribution is a point mass on each drafted token, which is what
acceptance.py's rule takes (accept with probability p(d), resample from p without d), so sampled output keeps the
target's distribution; a tree's top-k children are deterministic too (draft_tree.walk's multi-candidate rule).

The head's KV is kept per request (`head_kv.HeadKVCache` on `Req.spec_state`, rows in the head's own paged pool,
pages taken as tokens are accepted and given back on rejection), not in the target's KV pool: it is not counted in
that pool's budget, and it is not shared through the radix cache, so a request whose prompt prefix came from the
cache starts the head's context at the first position it computed itself (its drafts see less context;
verification keeps the output exact). The state goes with the request when it finishes or is aborted (`release`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Optional

import torch

from braid.runtime.core import Req
from braid.runtime.layers.logits import compute_logits
from braid.runtime.loader.hf import hf_config
from braid.runtime.speculative.draft_tree import DraftTree, TreeExpansion
from braid.runtime.speculative.eagle_head import load_eagle_head
from braid.runtime.speculative.head_batch import HeadBatch
from braid.runtime.speculative.head_kv import HeadKVCache

logger = logging.getLogger(__name__)


@dataclass
class EagleState:
    """A request's draft-head state: its KV cache and the target features not consumed yet (feats [n, F] for
    positions feat_start.., or None)."""

    cache: HeadKVCache
    feats: Optional[torch.Tensor] = None
    feat_start: int = 0
    # the head rows known to hold the request's tokens: the first `checked` rows of the cache, checked against the
    # list checked_ids (the request's fill_ids then) with the cache starting at checked_start (_catch_up_rows)
    checked_ids: Optional[list] = None
    checked_start: int = 0
    checked: int = 0

    @property
    def feat_end(self) -> int:
        return self.feat_start + (0 if self.feats is None else self.feats.shape[0])


def eagle3_aux_layers(draft_config: dict, num_layers: int) -> tuple[int, ...]:
    """The target layers whose input residual stream EAGLE-3 reads: the head's config
    `eagle_config.eagle_aux_hidden_state_layer_ids` names layers whose output it takes (so the input of the next),
    else layers 2, num_layers // 2 and num_layers - 3 as the published heads were trained."""
    ids = (draft_config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    layers = tuple(int(i) + 1 for i in ids) if ids else (2, num_layers // 2, num_layers - 3)
    bad = [i for i in layers if not 0 <= i < num_layers]
    if bad:
        raise ValueError(f"EAGLE-3 reads the hidden states entering target layers {list(layers)}; the target has "
                         f"{num_layers} layers (a head for a deeper model?)")
    return layers


class EagleProposer:
    def __init__(self, server_args, runner, context_len: int):
        algo = server_args.speculative_algorithm
        model = runner.model
        decoder = getattr(model, "model", None)
        embed = getattr(decoder, "embed_tokens", None)
        if embed is None or not hasattr(model, "lm_head"):
            raise ValueError(f"--speculative-algorithm {algo} needs a decoder model with an embedding and an LM "
                             f"head; {type(model).__name__} has none braid can hand to the draft head")
        mc = runner.model_config
        vocab = runner.vocab_size
        path = server_args.speculative_draft_model_path
        self.head = load_eagle_head(path, embed, lambda h: compute_logits(model.lm_head, h, None, vocab),
                                    mc.hidden_size, vocab, device=runner.device, dtype=runner.dtype,
                                    max_position=context_len + server_args.speculative_num_steps + 1)
        if self.head.c.kind != algo:
            raise ValueError(f"--speculative-algorithm {algo}, but {path} holds an {self.head.c.kind} head; give "
                             f"--speculative-algorithm {self.head.c.kind}")
        self.aux_layers: Optional[tuple[int, ...]] = None
        if algo == "EAGLE3":
            if not (hasattr(decoder, "captures_aux_hidden") and decoder.captures_aux_hidden()):
                raise ValueError(f"--speculative-algorithm EAGLE3 reads hidden states from inside the target; "
                                 f"{type(model).__name__}'s layers do not hand them out yet (EAGLE works)")
            self.aux_layers = eagle3_aux_layers(hf_config(path), mc.num_layers)
        self.device = runner.device
        self.num_steps = server_args.speculative_num_steps
        logger.info("speculative decoding: %s head %s (%d layer(s), %s), chains of %d draft tokens", algo, path,
                    self.head.c.num_layers, f"target layers {list(self.aux_layers)}" if self.aux_layers else
                    "the target's final hidden state", self.num_steps)

    # ---- target features ----
    def features(self, hidden: torch.Tensor, aux_hidden: Optional[torch.Tensor]) -> torch.Tensor:
        """A target pass's outputs -> the head's feature rows [T, F]."""
        if self.aux_layers is None:
            return hidden
        if aux_hidden is None:
            raise RuntimeError("an EAGLE-3 target pass ran without capturing its layers' hidden states")
        return aux_hidden

    @staticmethod
    def tracks(req: Req) -> bool:
        """Requests that may ever draft: penalties change the target's distribution with each draft token, and a
        prompt with media holds placeholder ids, not tokens."""
        sp = req.sampling_params
        return (req.mm_inputs is None and not sp.frequency_penalty and not sp.presence_penalty
                and sp.repetition_penalty == 1.0 and not req.is_internal)

    def record(self, req: Req, start: int, feats: torch.Tensor) -> None:
        """feats: [n, F] the target's features at positions start..start + n - 1 of this request (a view of the
        pass's output: copied). Earlier features at those positions, and head rows built on them, are dropped."""
        self.record_many([req], [start], feats, [feats.shape[0]])

    def record_many(self, reqs: list[Req], starts: list[int], feats: torch.Tensor, counts: list[int]) -> None:
        """`record` for several requests at once: feats [sum(counts), F] holds request i's counts[i] rows (positions
        starts[i]..) after request i - 1's. Each request's features kept from before and its new rows are joined
        in one copy for the batch (each request's state then holds a view of it)."""
        pieces, states = [], []
        offset = 0
        for req, start, n in zip(reqs, starts, counts):
            rows = feats.narrow(0, offset, n)
            offset += n
            if n == 0 or not self.tracks(req):
                continue
            st = req.spec_state
            if st is None:
                st = req.spec_state = EagleState(self.head.new_cache(start))
            cache = st.cache
            if start <= cache.start:
                cache.reset(start)
            else:
                cache.truncate(start - cache.start)
            kept, first = None, start
            if st.feats is not None and st.feat_start <= start <= st.feat_end:
                kept, first = st.feats[:start - st.feat_start], st.feat_start
            # features of rows the cache holds are not needed again, but the last (a step with no new row reruns
            # it): at most the kept ones
            drop = min(cache.start + cache.length - 1, start) - first
            if kept is not None and drop > 0:
                kept, first = kept[drop:], first + drop
            if kept is not None and kept.shape[0]:
                pieces.append(kept)
            pieces.append(rows)
            states.append((st, first, n + (0 if kept is None else kept.shape[0])))
        if not states:
            return
        joined = torch.cat(pieces, dim=0) if len(pieces) > 1 else pieces[0].clone()
        for (st, first, _), part in zip(states, joined.split([size for *_, size in states])):
            st.feats, st.feat_start = part, first

    @staticmethod
    def release(req: Req) -> None:
        if req.spec_state is not None:
            req.spec_state.cache.close()
        req.spec_state = None

    # ---- drafts ----
    def _catch_up_rows(self, req: Req) -> Optional[tuple[int, int]]:
        """(lo, Q): the rows lo..Q-1 the head must run before drafting (at least row Q - 1, whose output gives draft
        token 1), after rolling its cache back to rows it can keep; None when the target features do not reach
        position Q - 1 (the request then rides its verify pass without a draft, which records them)."""
        st = req.spec_state
        if st is None:
            return None
        Q = req.kv_committed_len
        cache = st.cache
        cache.truncate(Q - cache.start)  # rows at positions >= Q were built on rolled-back tokens
        # a row whose token no longer is the request's (jump-forward rewrote it) and every row after it. The
        # scheduler only appends to a fill_ids list in place (a rewrite makes a new list), so rows checked against
        # this same list at this same start still match: only the rows after them are compared
        ids, first = req.fill_ids, cache.start + 1
        checked = min(st.checked, cache.length) if st.checked_ids is ids and st.checked_start == cache.start else 0
        actual = ids[first + checked:first + cache.length]
        if cache.tokens[checked:] != actual:  # compared at C speed; walked only when they differ
            kept = checked
            for tok, want in zip(cache.tokens[checked:], actual):
                if tok != want:
                    break
                kept += 1
            cache.truncate(kept)
        st.checked_ids, st.checked_start, st.checked = ids, cache.start, cache.length
        if st.feats is None or st.feat_start >= Q or st.feat_end < Q:
            return None
        end = cache.start + cache.length
        if cache.length == 0 or st.feat_start > end:
            # nothing kept, or the features start past the head's rows (a prefix this request took from the radix
            # cache, a pass that recorded none): the head's context (re)starts at the first feature
            cache.reset(st.feat_start)
            end = st.feat_start
        if end == Q:  # nothing new since the last draft: run its last row again for draft token 1
            cache.truncate(cache.length - 1)
            end = Q - 1
        return end, Q

    def _catch_up(self, reqs: list[Req], rooms: list[int], width: int
                  ) -> tuple[list[tuple[int, int, int, int]], Optional[HeadBatch], Optional[torch.Tensor]]:
        """Step 1 for every request that can draft: -> (plan, batch, hidden): plan entries (request index, lo, Q,
        depth: min(room, num_steps)), longest head context first; the head's batch, ready for its draft depths of
        `width` rows a request; hidden [len(plan), hidden] the head's output at each one's row Q - 1 (whose
        distribution gives depth 1). Each request keeps the feature of row Q - 1 (a step with no new row runs it
        again)."""
        plan = []
        for i, (req, room) in enumerate(zip(reqs, rooms)):
            k = min(room, self.num_steps)
            if k < 1:
                continue
            rows = self._catch_up_rows(req)
            if rows is not None:
                plan.append((i, rows[0], rows[1], k))
        if not plan:
            return plan, None, None
        # the batch's attention groups are runs of this order (head_batch.py): longest context first
        plan.sort(key=lambda e: reqs[e[0]].spec_state.cache.start - e[2])
        ids, feats, caches, counts = [], [], [], []
        for i, lo, Q, _ in plan:
            req = reqs[i]
            st = req.spec_state
            ids.extend(req.fill_ids[lo + 1:Q + 1])
            feats.append(st.feats[lo - st.feat_start:Q - st.feat_start])
            caches.append(st.cache)
            counts.append(Q - lo)
        batch = self.head.batch(caches, counts, ids, max(d for *_, d in plan) - 1, width)
        feats = torch.cat(feats, dim=0) if len(feats) > 1 else feats[0]  # [T, F]
        hidden = self.head.extend(batch, feats)  # [T, hidden]
        kept = feats.index_select(0, batch.last)  # [P, F] the features of rows Q - 1
        for j, (i, lo, Q, _) in enumerate(plan):
            st = reqs[i].spec_state
            st.feats = kept[j:j + 1] if st.feat_end == Q else st.feats[Q - 1 - st.feat_start:].clone()
            st.feat_start = Q - 1
        return plan, batch, hidden.index_select(0, batch.last)

    @torch.inference_mode()
    def propose(self, reqs: list[Req], rooms: list[int]) -> list[list[int]]:
        """Chain drafts: up to min(rooms[i], --speculative-num-steps) tokens for request i ([] where rooms[i] < 1 or
        the head cannot draft for it this step). The tokens stay on the device until the chains are complete (one
        copy to the host)."""
        drafts: list[list[int]] = [[] for _ in reqs]
        plan, batch, hidden = self._catch_up(reqs, rooms, width=1)
        if not plan:
            return drafts
        tokens = self.head.greedy_tokens(hidden)  # [P] draft token 1: each request's output at row Q - 1
        steps = [tokens]
        for depth in range(1, batch.draft_steps + 1):
            # draft token d sits at position Q + d - 1, fed the head's output at the row before; requests whose
            # chains are shorter run along (their extra tokens are dropped below)
            hidden = self.head.draft(batch, tokens, hidden, depth)
            tokens = self.head.greedy_tokens(hidden)
            steps.append(tokens)
        chains = torch.stack(steps, dim=1).tolist()  # [P, max depth]
        for (i, _, _, depth), chain in zip(plan, chains):
            drafts[i] = chain[:depth]
        return drafts

    @torch.inference_mode()
    def propose_trees(self, reqs: list[Req], rooms: list[int], topk: int, num_nodes: int) -> list[DraftTree]:
        """Tree drafts (draft_tree.py): request i's tree of up to num_nodes nodes, of depth at most
        min(rooms[i], --speculative-num-steps) (empty where rooms[i] < 1 or the head cannot draft for it).

        Depth s + 1 comes from one head pass over the depth-s frontier (k rows a request, at position Q + s - 1,
        each fed its token and the head's output at its parent's row): each row attends to the request's committed
        rows and to the frontier rows of its ancestors, and its output's top-k gives its children. The tree stays
        on the device until `select`."""
        trees = [DraftTree([], []) for _ in reqs]
        plan, batch, hidden = self._catch_up(reqs, rooms, width=topk)
        if not plan:
            return trees
        P, k = len(plan), topk
        tree = TreeExpansion(*self.head.top_tokens(hidden, k))  # depth 1: the root's top-k
        hidden = hidden.repeat_interleave(k, dim=0)  # [P * k] each frontier node's parent output (the root's)
        first_row = torch.arange(P, device=self.device).view(P, 1) * k  # [P, 1] each request's first frontier row
        for depth in range(1, batch.draft_steps + 1):
            hidden = self.head.draft(batch, tree.frontier_tokens(), hidden, depth, tree.frontier_ancestors)
            tree.expand(*self.head.top_tokens(hidden, k))
            # the new frontier's nodes are fed their parent's output next
            hidden = hidden.index_select(0, (first_row + tree.frontier_slot_parent).view(-1))
        for (i, *_), t in zip(plan, tree.select(num_nodes, [d for *_, d in plan])):
            trees[i] = t
        return trees
