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
3. the rows of step 2 are dropped again (the head's KV rolls back to rows < Q): after verification the accepted
   tokens' rows are recomputed in the next catch-up from the target's features, as the head was trained.

A greedy draft is deterministic: its draft distribution is a point mass on each drafted token, which is what
acceptance.py's rule takes (accept with probability p(d), resample from p without d), so sampled output keeps the
target's distribution; a tree's top-k children are deterministic too (draft_tree.walk's multi-candidate rule).

The head's KV is kept per request (`eagle_head.HeadKVCache` on `Req.spec_state`, tensors grown as tokens are
accepted, truncated on rejection), not in the paged pool: it is not counted in the KV pool's budget, and it is not
shared through the radix cache, so a request whose prompt prefix came from the cache starts the head's context at
the first position it computed itself (its drafts see less context; verification keeps the output exact). The
state goes with the request when it finishes or is aborted (`release`).
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
from braid.runtime.speculative.eagle_head import HeadKVCache, load_eagle_head

logger = logging.getLogger(__name__)


@dataclass
class EagleState:
    """A request's draft-head state: its KV cache and the target features not consumed yet (feats [n, F] for
    positions feat_start.., or None)."""

    cache: HeadKVCache
    feats: Optional[torch.Tensor] = None
    feat_start: int = 0

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
        if not self.tracks(req) or feats.shape[0] == 0:
            return
        st = req.spec_state
        if st is None:
            st = req.spec_state = EagleState(self.head.new_cache(self.device, start))
        cache = st.cache
        if start <= cache.start:
            cache.reset(start)
        else:
            cache.truncate(start - cache.start)
        if st.feats is None or not st.feat_start <= start <= st.feat_end:
            st.feats, st.feat_start = feats.clone(), start
        else:
            st.feats = torch.cat([st.feats[:start - st.feat_start], feats], dim=0)
        # features of rows the cache holds are not needed again, but the last (a step with no new row reruns it)
        drop = min(cache.start + cache.length - 1, start) - st.feat_start
        if drop > 0:
            st.feats, st.feat_start = st.feats[drop:], st.feat_start + drop

    @staticmethod
    def release(req: Req) -> None:
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
        # a row whose token no longer is the request's (jump-forward rewrote it) and every row after it
        fill = req.fill_ids
        kept = 0
        for tok, actual in zip(cache.tokens, fill[cache.start + 1:cache.start + 1 + cache.length]):
            if tok != actual:
                break
            kept += 1
        cache.truncate(kept)
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

    def _catch_up(self, reqs: list[Req], rooms: list[int]) -> tuple[list[tuple[int, int, int, int]], torch.Tensor]:
        """Step 1 for every request that can draft: -> (plan, hidden): plan entries (request index, lo, Q, depth:
        min(room, num_steps)), hidden [len(plan), hidden] the head's output at each one's row Q - 1 (whose
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
            return plan, None
        dev = self.device
        ids, positions, feats, caches, counts = [], [], [], [], []
        for i, lo, Q, _ in plan:
            req = reqs[i]
            st = req.spec_state
            ids.extend(req.fill_ids[lo + 1:Q + 1])
            positions.extend(range(lo, Q))
            feats.append(st.feats[lo - st.feat_start:Q - st.feat_start])
            caches.append(st.cache)
            counts.append(Q - lo)
        hidden = self.head.extend(torch.tensor(ids, dtype=torch.int64, device=dev),
                                  torch.cat(feats, dim=0), torch.tensor(positions, dtype=torch.int64, device=dev),
                                  caches, counts, from_target=True)
        last = torch.tensor(counts, dtype=torch.int64, device=dev).cumsum(0) - 1
        for i, lo, Q, _ in plan:
            st = reqs[i].spec_state
            st.feats, st.feat_start = st.feats[Q - 1 - st.feat_start:].clone(), Q - 1
        return plan, hidden.index_select(0, last)

    @staticmethod
    def _roll_back(reqs: list[Req], plan) -> None:
        for i, lo, Q, _ in plan:
            cache = reqs[i].spec_state.cache
            cache.truncate(Q - cache.start)  # the draft's rows were built on the head's own guesses

    @torch.inference_mode()
    def propose(self, reqs: list[Req], rooms: list[int]) -> list[list[int]]:
        """Chain drafts: up to min(rooms[i], --speculative-num-steps) tokens for request i ([] where rooms[i] < 1 or
        the head cannot draft for it this step)."""
        drafts: list[list[int]] = [[] for _ in reqs]
        plan, hidden = self._catch_up(reqs, rooms)
        if not plan:
            return drafts
        dev = self.device
        tokens = self.head.greedy_tokens(hidden)  # [P]: each request's output at row Q - 1
        for (i, *_), tok in zip(plan, tokens.tolist()):
            drafts[i].append(tok)
        active = list(range(len(plan)))  # indices into plan still drafting
        for s in range(2, max(k for *_, k in plan) + 1):
            keep = [j for j in active if plan[j][3] >= s]
            if not keep:
                break
            if len(keep) != len(active):
                sel = torch.tensor([active.index(j) for j in keep], dtype=torch.int64, device=dev)
                hidden, tokens = hidden.index_select(0, sel), tokens.index_select(0, sel)
                active = keep
            # draft token s - 1 sits at position Q + s - 2
            pos = torch.tensor([plan[j][2] + s - 2 for j in active], dtype=torch.int64, device=dev)
            hidden = self.head.extend(tokens, hidden, pos, [reqs[plan[j][0]].spec_state.cache for j in active],
                                      [1] * len(active), from_target=False)
            tokens = self.head.greedy_tokens(hidden)
            for j, tok in zip(active, tokens.tolist()):
                drafts[plan[j][0]].append(tok)
        self._roll_back(reqs, plan)
        return drafts

    @torch.inference_mode()
    def propose_trees(self, reqs: list[Req], rooms: list[int], topk: int, num_nodes: int) -> list[DraftTree]:
        """Tree drafts (draft_tree.py): request i's tree of up to num_nodes nodes, of depth at most
        min(rooms[i], --speculative-num-steps) (empty where rooms[i] < 1 or the head cannot draft for it).

        Depth s + 1 comes from one head pass over the depth-s frontier (k rows a request, at position Q + s - 1,
        each fed its token and the head's output at its parent's row): each row attends to the request's committed
        rows and to the frontier rows of its ancestors (their rows stay in the cache until the tree is built), and
        its output's top-k gives its children."""
        trees = [DraftTree([], []) for _ in reqs]
        plan, hidden = self._catch_up(reqs, rooms)
        if not plan:
            return trees
        dev = self.device
        P, k = len(plan), topk
        tree = TreeExpansion(*self.head.top_tokens(hidden, k))  # depth 1: the root's top-k
        hidden = hidden.repeat_interleave(k, dim=0)  # [P * k] each frontier node's parent output (the root's)
        caches = [reqs[i].spec_state.cache for i, *_ in plan]
        committed = [Q - cache.start for (_, _, Q, _), cache in zip(plan, caches)]  # head rows before the draft's
        for s in range(1, max(d for *_, d in plan)):
            # the depth-s frontier: k rows a request at position Q + s - 1, over its committed rows and ancestors
            pos = torch.tensor([Q + s - 1 for _, _, Q, _ in plan for _ in range(k)], dtype=torch.int64, device=dev)
            masks = []
            for j, cache in enumerate(caches):
                past = cache.length  # committed[j] + (s - 1) * k rows of earlier frontiers
                mask = torch.ones(k, past + k, dtype=torch.bool, device=dev)
                mask[:, committed[j]:] = tree.frontier_ancestors[j]
                masks.append(mask)
            hidden = self.head.extend(tree.frontier_tokens(), hidden, pos, caches, [k] * P, from_target=False,
                                      masks=masks)
            tree.expand(*self.head.top_tokens(hidden, k))
            # the new frontier's nodes are fed their parent's output next
            parent_rows = (torch.arange(P, device=dev).view(P, 1) * k + tree.frontier_slot_parent).view(-1)
            hidden = hidden.index_select(0, parent_rows)
        self._roll_back(reqs, plan)
        for (i, *_), t in zip(plan, tree.select(num_nodes, [d for *_, d in plan])):
            trees[i] = t
        return trees
