"""A speculative decode step: propose a draft per running request, run the target once over [last token + draft]
of every request (an extend pass over the paged KV, KV written for all of them), accept by the rule in
acceptance.py, commit the emitted tokens through the usual finish checks, and give the KV slots of rejected tokens
back to the pool.

Speculative steps run synchronously (the scheduler turns the overlap schedule off while speculation is on): the
next step's drafts depend on this step's accepted tokens. Requests that cannot speculate this step (penalties, which
would change with each draft token; images or video in the prompt; no n-gram match) ride in the same pass with their
last token alone. NGRAM: a step where no request has a draft is a plain decode step (CUDA graphs, the batch-1 GEMV).
EAGLE / EAGLE3 (eagle.py): the draft head needs the target's hidden states of every token, so the verify pass runs
whenever a request the head follows is in the batch (with no draft: its last token alone), extend passes capture
their hidden states too (`prepare_extend` / `record_extend`), and a batch whose requests all have penalties is a
plain decode step.

Tree drafts (EAGLE / EAGLE3 with --speculative-eagle-topk > 1, draft_tree.py): a request's verify rows are its last
token and its tree's nodes (positions by depth), attending through a tree mask (ForwardBatch.tree_mask: the
committed KV and their ancestors), run eagerly (no extend graphs); acceptance walks the tree (draft_tree.walk), and
the accepted path's KV slots, scattered among the draft's, are moved to the request's next positions in
req_to_token before the slots past them go back to the pool. Chains are trees with one child a node: every draft
here is a DraftTree; a batch of chains needs no mask and is accepted by acceptance.accept.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
from typing import Optional

import msgspec
import torch

from braid.runtime.constrained.bitmask import allocate_bitmask, clear_tokens
from braid.runtime.constrained.grammar_errors import GrammarError
from braid.runtime.core import FinishReason, ForwardBatch, ForwardMode, Req, host_to_device
from braid.runtime.distributed import parallel_state as ps
from braid.runtime.error_kind import ErrorKind
from braid.runtime.layers.argmax_kernels import argmax_last_dim
from braid.runtime.layers.logits import compute_logits, token_logprobs
from braid.runtime.layers.sampler import SamplingBatchInfo, apply_penalties
from braid.runtime.speculative.acceptance import accept, target_probs
from braid.runtime.speculative.draft_tree import DraftTree, tree_mask_batch, walk
from braid.runtime.speculative.eagle import EagleProposer
from braid.runtime.speculative.ngram import NgramProposer, TokenMirror

logger = logging.getLogger(__name__)

_SAMPLING_FIELDS = tuple(f.name for f in dataclasses.fields(SamplingBatchInfo))


class SpeculativeDecoder:
    def __init__(self, server_args, runner, prefix_cache, output, context_len: int):
        algo = server_args.speculative_algorithm
        if algo not in ("NGRAM", "EAGLE", "EAGLE3"):
            raise ValueError(f"speculative_algorithm {algo!r} cannot run here")
        self.topk = server_args.speculative_eagle_topk
        if algo == "NGRAM" and self.topk != 1:
            raise ValueError("--speculative-eagle-topk > 1 (tree drafts) is not supported with NGRAM: its drafts are "
                             "chains")
        if self.topk > 1:
            check_tree_verify(runner, self.topk)
        if prefix_cache.window_pool is not None:
            raise ValueError("speculative decoding with window-layer KV trimming (this model mixes sliding-window and "
                             "global layers) is not supported yet; add --disable-window-kv-trimming")
        self.runner = runner
        self.prefix_cache = prefix_cache
        self.output = output  # scheduler.output.OutputProcessor
        self.context_len = context_len
        self.device = runner.device
        self.vocab_size = runner.vocab_size
        self.max_draft = server_args.speculative_num_draft_tokens - 1
        self.proposer, self.eagle = None, None
        if algo == "NGRAM":
            self.proposer = NgramProposer(server_args.speculative_ngram_min_match_window_size,
                                          server_args.speculative_ngram_max_match_window_size, self.max_draft)
            logger.info("speculative decoding: NGRAM, up to %d draft tokens a request a step (match windows %d..%d)",
                        self.max_draft, self.proposer.min_match, self.proposer.max_match)
        else:
            self.eagle = EagleProposer(server_args, runner, context_len)
        self.disable_by_batch_size = server_args.speculative_disable_by_batch_size
        self.num_steps_too_large = 0  # steps past --speculative-disable-by-batch-size, decoded without drafts
        self.num_verify_forward = 0
        self.num_drafts = 0  # drafts verified (one per request with a draft per pass)
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0

    # ---- the draft head's view of other passes (EAGLE) ----
    def prepare_extend(self, fb: ForwardBatch) -> None:
        """An extend pass about to run: EAGLE asks it for the hidden states the draft head reads."""
        if self.eagle is not None:
            fb.capture_hidden = True
            fb.aux_hidden_layers = self.eagle.aux_layers

    def record_extend(self, reqs: list[Req], fb: ForwardBatch, output) -> None:
        """After that pass (before its requests are committed or finished): each request's rows' features."""
        if self.eagle is None or output.hidden_states is None:
            return
        feats = self.eagle.features(output.hidden_states, output.aux_hidden_states)
        self.eagle.record_many(reqs, fb.extend_prefix_lens_cpu, feats, fb.extend_seq_lens_cpu)

    def release(self, req: Req) -> None:
        """A request that finished or was aborted: its draft-head state goes."""
        if self.eagle is not None:
            self.eagle.release(req)
        else:
            req.spec_state = None  # the n-gram TokenMirror

    def stats(self) -> dict:
        drafts = self.num_drafts
        return dict(spec_num_verify_forward=self.num_verify_forward, spec_num_drafts_total=drafts,
                    spec_num_steps_disabled_by_batch_size=self.num_steps_too_large,
                    spec_num_draft_tokens_total=self.num_draft_tokens,
                    spec_num_accepted_tokens_total=self.num_accepted_tokens,
                    # tokens a verified draft yields (its accepted tokens + the target's own; 1.0: no gain), as vLLM
                    spec_accept_length_mean=1.0 + self.num_accepted_tokens / drafts if drafts else 0.0,
                    spec_acceptance_rate=(self.num_accepted_tokens / self.num_draft_tokens
                                          if self.num_draft_tokens else 0.0))

    # ---- the step ----
    def step(self, sched, reqs: list[Req]) -> bool:
        """One speculative step for the running requests `reqs` (taken out of sched.running); each goes back to
        sched.running, to sched.resume_queue (jump-forward) or is finished. False (nothing done): no request has a
        draft, the pool cannot hold the drafts, or more requests run than --speculative-disable-by-batch-size; the
        caller runs a plain decode step."""
        if self.disable_by_batch_size is not None and len(reqs) > self.disable_by_batch_size:
            self.num_steps_too_large += 1
            return False
        trees, masks = self._propose(reqs)
        lens = [len(t) + 1 for t in trees]
        total = sum(lens)
        if self.eagle is None:
            if total == len(reqs) or self.prefix_cache.available_slots() < total:
                return False
        else:
            if total == len(reqs) and not any(self.eagle.tracks(r) for r in reqs):
                return False  # no request the head follows: a plain decode step
            if self.prefix_cache.available_slots() < total:
                # the pool holds one token per request (retraction saw to it), not the drafts: verify none, so that
                # the head still gets every request's features
                trees = [DraftTree([], []) for _ in reqs]
                masks = [m[:1] if m is not None else None for m in masks]
                lens = [1] * len(reqs)
                total = len(reqs)
        out_loc = self.prefix_cache.alloc_slots(total)
        fb, row_start = self._build_batch(reqs, trees, lens, out_loc)
        if self.eagle is not None:
            fb.aux_hidden_layers = self.eagle.aux_layers
        hidden = self.runner.forward_hidden(fb)
        feats = self.eagle.features(hidden, fb.aux_hidden) if self.eagle is not None else None
        logits = compute_logits(self.runner.model.lm_head, hidden, None, self.vocab_size)  # [T, V] fp32
        starts = [req.kv_committed_len for req in reqs]  # each request's root position
        for req, n in zip(reqs, lens):
            req.kv_committed_len += n
        emitted, paths, logprobs = self._accept(reqs, trees, row_start, logits, masks)
        if self.eagle is not None:
            # the head's features of each request's root and accepted nodes (positions start .. start + len(path) - 1),
            # gathered for all at once
            rows = host_to_device([first + r for first, path in zip(row_start, paths) for r in path], torch.int64,
                                  self.device)
            self.eagle.record_many(reqs, starts, feats.index_select(0, rows), [len(path) for path in paths])
        for req, start, n, path in zip(reqs, starts, lens, paths):
            if path != list(range(len(path))):
                self._move_path_kv(req, start, n, path)
        self.num_verify_forward += 1
        self.num_drafts += sum(1 for t in trees if len(t))
        self.num_draft_tokens += total - len(reqs)
        self.num_accepted_tokens += sum(len(e) - 1 for e in emitted)
        for req, tree, tokens in zip(reqs, trees, emitted):
            if len(tree):
                req.spec_drafts += 1
                req.spec_accepted_tokens += len(tokens) - 1
        sched.stats["num_tokens_through_model_total"] += total
        reasons = [self._append(req, emitted[i], logprobs[i] if logprobs is not None else None)
                   for i, req in enumerate(reqs)]
        self._release_rejected(reqs)
        for req, reason in zip(reqs, reasons):
            self._settle(sched, req, reason)
        return True

    def _move_path_kv(self, req: Req, start: int, n: int, path: list[int]) -> None:
        """The verify rows' KV sits at req_to_token[start + row] (row 0 the root, then the tree's nodes); the emitted
        path's rows are not the first ones of a tree: their slots move to positions start .. start + len(path) - 1
        and the other rows' slots after them (truncate_req_kv frees what lies past the kept tokens)."""
        row = self.runner.req_to_token_pool.req_to_token[req.req_pool_idx]
        on_path = set(path)
        order = path + [r for r in range(n) if r not in on_path]
        row[start:start + n] = row[start:start + n][host_to_device(order, torch.int64, row.device)]

    # ---- drafts ----
    def _propose(self, reqs: list[Req]) -> tuple[list[DraftTree], list[Optional[torch.Tensor]]]:
        """Each request's draft as a tree (a chain: one child a node), without the nodes its grammar refuses, and for
        requests that need one the token bitmask of each verified row ([len(tree) + 1, words] int32 on the host, row
        0 the root's; None: no mask)."""
        rooms = []
        for req in reqs:
            sp = req.sampling_params
            room = min(sp.max_new_tokens, self.context_len - len(req.input_ids)) - len(req.output_ids) - 1
            # penalties change with every draft token; a prompt with media holds placeholder ids, not tokens
            speculates = (req.finished_reason is None and room > 0 and not sp.frequency_penalty
                          and not sp.presence_penalty and sp.repetition_penalty == 1.0 and req.mm_inputs is None)
            rooms.append(room if speculates else 0)
        if self.eagle is not None and self.topk > 1:
            proposed = self.eagle.propose_trees(reqs, rooms, self.topk, self.max_draft)
        else:
            if self.eagle is not None:
                chains = self.eagle.propose(reqs, rooms)
            else:
                # braid's proposer reads each request's TokenMirror; one put in its place (a benchmark's wrapper)
                # gets the token list
                tokens = self._tokens if type(self.proposer) is NgramProposer else (lambda req: req.fill_ids)
                chains = [self.proposer.propose(tokens(req), room) if room > 0 else []
                          for req, room in zip(reqs, rooms)]
            proposed = [DraftTree.chain(c) for c in chains]
        if ps.tp_size() > 1:
            proposed = [DraftTree(tokens, parents) for tokens, parents in
                        _from_rank_zero([(t.tokens, t.parents) for t in proposed])]
        trees, masks = [], []
        for req, tree in zip(reqs, proposed):
            sp = req.sampling_params
            mask = None
            if req.grammar is not None or len(req.output_ids) < sp.min_new_tokens:
                tree, mask = self._position_masks(req, tree)
            trees.append(tree)
            masks.append(mask)
        return trees, masks

    @staticmethod
    def _tokens(req: Req):
        """NGRAM: the request's tokens as the int64 array its TokenMirror (on Req.spec_state) keeps."""
        mirror = req.spec_state
        if mirror is None:
            mirror = req.spec_state = TokenMirror()
        return mirror.view(req.fill_ids)

    def _position_masks(self, req: Req, tree: DraftTree) -> tuple[DraftTree, torch.Tensor]:
        """The grammar's mask after each node's path (depth first, the grammar takes a path's tokens and is rolled
        back), the nodes it refuses dropped with their subtrees; min_new_tokens bans (EOS, stop ids) in the rows
        whose token would come before the minimum, unless that leaves the row nothing."""
        rows = allocate_bitmask(len(tree) + 1, self.vocab_size)
        grammar = req.grammar
        if grammar is not None:
            grammar.fill_bitmask(rows, 0)
            kids = tree.children()
            kept = [True] * len(tree)

            def visit(node: int) -> None:
                for child in kids[node]:
                    try:
                        grammar.accept_token(tree.tokens[child - 1])
                    except GrammarError:
                        kept[child - 1] = False
                        continue
                    grammar.fill_bitmask(rows, child)
                    visit(child)
                    grammar.rollback(1)

            visit(0)
            tree, nodes = tree.keep(kept)
            rows = rows[nodes]
        sp = req.sampling_params
        banned = set() if sp.ignore_eos else set(self.output.eos_token_ids)
        banned = [t for t in banned | set(sp.stop_token_ids or ()) if t < self.vocab_size]
        need = sp.min_new_tokens - len(req.output_ids)
        for j, depth in enumerate(tree.depths()):
            if depth >= need:
                continue
            row = rows[j].clone()
            clear_tokens(row, banned)
            if bool(row.any()):
                rows[j] = row
        return tree, rows

    # ---- the pass ----
    def _build_batch(self, reqs: list[Req], trees: list[DraftTree], lens: list[int],
                     out_loc: torch.Tensor) -> tuple[ForwardBatch, list[int]]:
        """The verify pass: request i extends its committed KV by [its last token] + its tree's tokens at positions
        kv_committed_len + depth (an EXTEND batch; its KV slots out_loc written to req_to_token at
        kv_committed_len ..; a tree mask when a draft branches). -> (the batch, each request's first row in the
        pass's T rows)."""
        dev = self.device
        input_ids, positions, slot_rows, prefix_lens, row_start = [], [], [], [], []
        chains = all(t.is_chain() for t in trees)
        offset = 0
        for req, tree, n in zip(reqs, trees, lens):
            start = req.kv_committed_len  # == len(req.fill_ids) - 1: the last token's KV is not written yet
            row_start.append(offset)
            prefix_lens.append(start)
            input_ids.append(req.fill_ids[-1])
            input_ids.extend(tree.tokens)
            positions.extend(range(start, start + n) if chains else [start + d for d in tree.depths()])
            slot_rows.extend(itertools.repeat(req.req_pool_idx, n))
            offset += n
        seq_lens = [p + n for p, n in zip(prefix_lens, lens)]
        ext_starts = list(itertools.accumulate(lens, initial=0))[:-1]
        # the pass's index lists reach the device in two copies
        ids_d, pos_d, rows_d, req_idx, cols_d = _to_device_packed(
            [input_ids, positions, slot_rows, [r.req_pool_idx for r in reqs],
             [] if chains else [p + j for p, n in zip(prefix_lens, lens) for j in range(n)]], torch.int64, dev)
        if chains:
            cols_d = pos_d  # row j of a request sits at column start + j of req_to_token, at position start + j
        seq_lens_d, prefix_d, ext_d, ext_starts_d = _to_device_packed([seq_lens, prefix_lens, lens, ext_starts],
                                                                      torch.int32, dev)
        # each request's verify rows' KV slots at req_to_token[req, start ..], for the whole batch in one write
        self.runner.req_to_token_pool.req_to_token[rows_d, cols_d] = out_loc.to(torch.int32)
        fb = ForwardBatch(
            forward_mode=ForwardMode.EXTEND, batch_size=len(reqs), input_ids=ids_d, positions=pos_d,
            req_pool_indices=req_idx, seq_lens=seq_lens_d, out_cache_loc=out_loc, seq_lens_cpu=seq_lens,
            extend_prefix_lens=prefix_d, extend_seq_lens=ext_d, extend_start_loc=ext_starts_d,
            extend_prefix_lens_cpu=prefix_lens, extend_seq_lens_cpu=lens)
        if not chains:
            fb.tree_mask, fb.tree_mask_start = tree_mask_batch(trees, dev)
        return fb, row_start

    def _accept(self, reqs, trees, row_start, logits, masks):
        """-> (per request the emitted tokens, per request the rows (within its block) each was accepted or drawn
        under: the root, then the accepted nodes, per request [(logprob, top)] for them or None when no request
        asks)."""
        dev = self.device
        owner = [i for i, t in enumerate(trees) for _ in range(len(t) + 1)]  # the request of each of the T rows
        info = SamplingBatchInfo.build(reqs, self.vocab_size, dev)
        # the per-row copy of the batch's sampling tensors, when it has any (an all-greedy batch without penalties,
        # bias or allowed ids has none, and needs no index on the device)
        has_tensors = any(isinstance(getattr(info, name), torch.Tensor) for name in _SAMPLING_FIELDS)
        rows_info = info.filter(owner, host_to_device(owner, torch.int64, dev) if has_tensors else None)
        if any(m is not None for m in masks):
            words = (self.vocab_size + 31) // 32
            bitmask = torch.full((len(owner), words), -1, dtype=torch.int32)
            for i, m in enumerate(masks):
                if m is not None:
                    bitmask[row_start[i]:row_start[i] + m.shape[0]] = m
            rows_info.token_bitmask = bitmask.to(dev)
        processed = apply_penalties(logits, rows_info)
        emitted: list[list[int]] = [[] for _ in reqs]
        paths: list[list[int]] = [[0] for _ in reqs]
        drafted = [i for i, t in enumerate(trees) if len(t)]
        if info.all_greedy:
            # the acceptance rules' greedy case, and a request without a draft emits its row's argmax as the greedy
            # sampler does: one copy of the argmaxes to the host is the pass's only wait for the device
            emitted, paths = greedy_accept(argmax_last_dim(processed).tolist(), row_start, trees)
        elif drafted:
            probs = target_probs(processed, rows_info)
            starts, greedy = [row_start[i] for i in drafted], [info.is_greedy[i] for i in drafted]
            generators = [_request_generator(reqs[i]) for i in drafted]
            if all(trees[i].is_chain() for i in drafted):
                for i, tokens in zip(drafted, accept(probs, starts, [trees[i].tokens for i in drafted], greedy,
                                                     generators)):
                    emitted[i], paths[i] = tokens, list(range(len(tokens)))
            else:
                for i, (path, final) in zip(drafted, walk(probs, starts, [trees[i] for i in drafted], greedy,
                                                          generators)):
                    emitted[i] = [trees[i].tokens[node - 1] for node in path[1:]] + [final]
                    paths[i] = path
        plain = [] if info.all_greedy else [i for i, t in enumerate(trees) if not len(t)]
        if plain:
            # a request without a draft samples as a decode step does (a seeded one draws what it would there)
            rows = host_to_device([row_start[i] for i in plain], torch.int64, dev)
            plain_info = info.filter(plain, host_to_device(plain, torch.int64, dev))
            if rows_info.token_bitmask is not None:
                plain_info.token_bitmask = rows_info.token_bitmask.index_select(0, rows)
            for i, tok in zip(plain, self.runner.sampler(processed.index_select(0, rows), plain_info).tolist()):
                emitted[i] = [tok]
        if ps.tp_size() > 1:
            emitted, paths = _from_rank_zero([emitted, paths])
        if info.logprob_top_k is None:
            return emitted, paths, None
        lp_rows = [row_start[i] + r for i, path in enumerate(paths) for r in path]
        lp_toks = torch.tensor([t for e in emitted for t in e], dtype=torch.int64, device=dev)
        # the raw distribution's logprobs, as without speculation (apply_penalties leaves `logits` unmasked then)
        chosen, top_v, top_i = token_logprobs(logits.index_select(0, host_to_device(lp_rows, torch.int64, dev)),
                                              lp_toks, info.logprob_top_k)
        chosen = chosen.tolist()
        top_v = top_v.tolist() if top_v is not None else None
        top_i = top_i.tolist() if top_i is not None else None
        out, k = [], 0
        for req, e in zip(reqs, emitted):
            mine = []
            for _ in e:
                n = req.top_logprobs_num
                mine.append((chosen[k], list(zip(top_v[k][:n], top_i[k][:n])) if n and top_v is not None else None))
                k += 1
            out.append(mine)
        return emitted, paths, out

    # ---- commit ----
    def _append(self, req: Req, tokens: list[int], logprobs: Optional[list]) -> Optional[FinishReason]:
        """Append the emitted tokens one by one through the finish checks (EOS, stop ids and strings, the grammar,
        the length), stopping at the first that ends the request -> the reason it ends, if it does."""
        reason = req.finished_reason  # aborted while the step ran: nothing is appended
        if reason is None:
            for j, tok in enumerate(tokens):
                try:
                    reason = self.output.append_token(req, tok, logprobs[j] if logprobs is not None and
                                                      req.return_logprob else None)
                except GrammarError as e:
                    reason = FinishReason("abort", message=f"grammar error: {e}", kind=ErrorKind.GRAMMAR_INVALID)
                if reason is not None:
                    break
        return reason

    def _release_rejected(self, reqs: list[Req]) -> None:
        """Give back the KV slots of every verified position past each request's last kept token (rejected drafts,
        tokens after a stop), for the whole batch at once: the newest token's KV is written by the next pass, as
        after a decode step."""
        self.prefix_cache.truncate_reqs_kv(reqs, [len(req.fill_ids) - 1 for req in reqs])

    def _settle(self, sched, req: Req, reason: Optional[FinishReason]) -> None:
        """The request after its tokens: finished, or back to sched.running (sched.resume_queue when it jumped
        forward) with its output reported."""
        if reason is not None:
            sched.finish(req, reason)
            return
        jumped, reason = self.output.jump_forward(req)
        if reason is not None:
            sched.finish(req, reason)
            return
        (sched.resume_queue if jumped else sched.running).append(req)
        out = self.output.make_output(req)
        if out is not None:
            sched.outputs.append(out)


def check_tree_verify(runner, topk: int) -> None:
    """Tree drafts need a tree mask in the verify pass's attention: refuse at start-up what cannot run them."""
    backend = runner.attn_backend
    if not getattr(backend, "supports_tree_mask", False):
        name = getattr(runner, "attn_backend_name", type(backend).__name__)
        raise ValueError(f"--speculative-eagle-topk {topk} (tree drafts) needs a tree attention mask in the verify "
                         f"pass, which the {name} attention backend does not have yet: use --attention-backend "
                         "triton (or torch), or --speculative-eagle-topk 1 (chain drafts)")
    windows = [spec.sliding_window for spec in runner.model_config.layers]
    if any(w is not None and w > 0 for w in windows):
        raise ValueError(f"--speculative-eagle-topk {topk} (tree drafts) is not supported yet on models with "
                         "sliding-window layers (a tree row's window would follow its depth, not its row); use "
                         "--speculative-eagle-topk 1 (chain drafts)")


def greedy_accept(top: list[int], row_start: list[int], trees: list[DraftTree]) -> tuple[list[list[int]],
                                                                                     list[list[int]]]:
    """Acceptance of greedy requests from their verify rows' argmaxes (top[row_start[i] + node]: request i's row of
    that node) -> (per request the emitted tokens, per request the path: [0] + the accepted nodes). A greedy row's p
    is the one-hot of its argmax, so acceptance.accept and draft_tree.walk take the child whose token is the argmax
    and emit the argmax where none is (their uniforms decide nothing); without a draft, the root row's argmax."""
    emitted, paths = [], []
    for tree, first in zip(trees, row_start):
        draft, node = tree.tokens, 0
        if tree.is_chain():
            while node < len(draft) and draft[node] == top[first + node]:
                node += 1
            emitted.append(draft[:node] + [top[first + node]])
            paths.append(list(range(node + 1)))
            continue
        kids, path = tree.children(), [0]
        while True:
            want = top[first + node]
            node = next((c for c in kids[node] if draft[c - 1] == want), None)
            if node is None:
                break
            path.append(node)
        emitted.append([draft[c - 1] for c in path[1:]] + [want])
        paths.append(path)
    return emitted, paths


def _to_device_packed(lists: list[list[int]], dtype: torch.dtype, device) -> list[torch.Tensor]:
    """Host lists of ints -> tensors of `dtype` on `device`, views of one copy (host_to_device's), each starting on
    a 16-byte boundary (kernels are specialised on their pointers' alignment)."""
    per = 16 // dtype.itemsize
    flat, bounds = [], []
    for values in lists:
        start = len(flat)
        flat.extend(values)
        bounds.append((start, len(flat)))
        flat.extend(itertools.repeat(0, -len(flat) % per))
    packed = host_to_device(flat, dtype, device)
    return [packed[a:b] for a, b in bounds]


def _request_generator(req: Req) -> Optional[torch.Generator]:
    """A seeded sampling request's random stream at this point of its output (the same drafts and seed give the same
    tokens on any run, beside any batch mates); None for the others (torch's global stream)."""
    sp = req.sampling_params
    if sp.seed is None or sp.is_greedy:
        return None
    return torch.Generator().manual_seed((int(sp.seed) * 1_000_003 + len(req.output_ids)) & ((1 << 63) - 1))


def _from_rank_zero(value):
    """Tensor parallelism: rank 0's value (lists of ints) on every rank. The ranks must build the same verify pass and
    commit the same tokens, and a sampled acceptance draw (or a draft head's near-tie) need not come out alike on
    each rank; as with a decode step's sampled ids, rank 0's stand."""
    data = msgspec.msgpack.encode(value) if ps.tp_rank() == 0 else None
    return msgspec.msgpack.decode(ps.broadcast_bytes(data))
