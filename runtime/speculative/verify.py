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
"""

from __future__ import annotations

import logging
from typing import Optional

import torch

from braid.runtime.constrained.bitmask import allocate_bitmask, clear_tokens
from braid.runtime.constrained.grammar_errors import GrammarError
from braid.runtime.core import FinishReason, ForwardBatch, ForwardMode, Req, host_to_device
from braid.runtime.error_kind import ErrorKind
from braid.runtime.layers.logits import compute_logits, token_logprobs
from braid.runtime.layers.sampler import SamplingBatchInfo, apply_penalties
from braid.runtime.speculative.acceptance import accept, target_probs
from braid.runtime.speculative.eagle import EagleProposer
from braid.runtime.speculative.ngram import NgramProposer

logger = logging.getLogger(__name__)


class SpeculativeDecoder:
    def __init__(self, server_args, runner, prefix_cache, output, context_len: int):
        algo = server_args.speculative_algorithm
        if algo not in ("NGRAM", "EAGLE", "EAGLE3"):
            raise ValueError(f"speculative_algorithm {algo!r} cannot run here")
        if algo != "NGRAM" and server_args.speculative_eagle_topk != 1:
            raise ValueError(f"--speculative-eagle-topk {server_args.speculative_eagle_topk}: {algo} runs chain "
                             "drafts only (--speculative-eagle-topk 1)")
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
        row = 0
        for req, start, n in zip(reqs, fb.extend_prefix_lens_cpu, fb.extend_seq_lens_cpu):
            self.eagle.record(req, start, feats[row:row + n])
            row += n

    def release(self, req: Req) -> None:
        """A request that finished or was aborted: its draft-head state goes."""
        if self.eagle is not None:
            self.eagle.release(req)

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
        drafts, masks = self._propose(reqs)
        lens = [len(d) + 1 for d in drafts]
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
                drafts = [[] for _ in reqs]
                masks = [m[:1] if m is not None else None for m in masks]
                lens = [1] * len(reqs)
                total = len(reqs)
        out_loc = self.prefix_cache.alloc_slots(total)
        fb, row_start = self._build_batch(reqs, drafts, lens, out_loc)
        if self.eagle is not None:
            fb.aux_hidden_layers = self.eagle.aux_layers
        hidden = self.runner.forward_hidden(fb)
        if self.eagle is not None:
            feats = self.eagle.features(hidden, fb.aux_hidden)
            for req, start, n in zip(reqs, row_start, lens):
                self.eagle.record(req, req.kv_committed_len, feats[start:start + n])
        logits = compute_logits(self.runner.model.lm_head, hidden, None, self.vocab_size)  # [T, V] fp32
        for req, n in zip(reqs, lens):
            req.kv_committed_len += n
        emitted, logprobs = self._accept(reqs, drafts, row_start, logits, masks)
        self.num_verify_forward += 1
        self.num_drafts += sum(1 for d in drafts if d)
        self.num_draft_tokens += total - len(reqs)
        self.num_accepted_tokens += sum(len(e) - 1 for e in emitted)
        for req, draft, tokens in zip(reqs, drafts, emitted):
            if draft:
                req.spec_drafts += 1
                req.spec_accepted_tokens += len(tokens) - 1
        sched.stats["num_tokens_through_model_total"] += total
        for i, req in enumerate(reqs):
            self._commit(sched, req, emitted[i], logprobs[i] if logprobs is not None else None)
        return True

    # ---- drafts ----
    def _propose(self, reqs: list[Req]) -> tuple[list[list[int]], list[Optional[torch.Tensor]]]:
        """Each request's draft, cut where its grammar refuses a token, and for requests that need one the token
        bitmask of each verified position ([len(draft) + 1, words] int32 on the host; None: no mask)."""
        rooms = []
        for req in reqs:
            sp = req.sampling_params
            room = min(sp.max_new_tokens, self.context_len - len(req.input_ids)) - len(req.output_ids) - 1
            # penalties change with every draft token; a prompt with media holds placeholder ids, not tokens
            speculates = (req.finished_reason is None and room > 0 and not sp.frequency_penalty
                          and not sp.presence_penalty and sp.repetition_penalty == 1.0 and req.mm_inputs is None)
            rooms.append(room if speculates else 0)
        if self.eagle is not None:
            proposed = self.eagle.propose(reqs, rooms)
        else:
            proposed = [self.proposer.propose(req.fill_ids, room) if room > 0 else []
                        for req, room in zip(reqs, rooms)]
        drafts, masks = [], []
        for req, draft in zip(reqs, proposed):
            sp = req.sampling_params
            mask = None
            if req.grammar is not None or len(req.output_ids) < sp.min_new_tokens:
                draft, mask = self._position_masks(req, draft)
            drafts.append(draft)
            masks.append(mask)
        return drafts, masks

    def _position_masks(self, req: Req, draft: list[int]) -> tuple[list[int], torch.Tensor]:
        """The grammar's mask after each prefix of the draft (the grammar takes the draft's tokens and is rolled
        back), the draft cut at the first token it refuses; min_new_tokens bans (EOS, stop ids) in the rows whose
        token would come before the minimum, unless that leaves the row nothing."""
        rows = allocate_bitmask(len(draft) + 1, self.vocab_size)
        taken = 0
        grammar = req.grammar
        if grammar is not None:
            grammar.fill_bitmask(rows, 0)
            for tok in draft:
                try:
                    grammar.accept_token(tok)
                except GrammarError:
                    break
                taken += 1
                grammar.fill_bitmask(rows, taken)
            grammar.rollback(taken)
            draft = draft[:taken]
            rows = rows[:taken + 1]
        sp = req.sampling_params
        banned = set() if sp.ignore_eos else set(self.output.eos_token_ids)
        banned = [t for t in banned | set(sp.stop_token_ids or ()) if t < self.vocab_size]
        for j in range(min(len(draft) + 1, sp.min_new_tokens - len(req.output_ids))):
            row = rows[j].clone()
            clear_tokens(row, banned)
            if bool(row.any()):
                rows[j] = row
        return draft, rows

    # ---- the pass ----
    def _build_batch(self, reqs: list[Req], drafts: list[list[int]], lens: list[int],
                     out_loc: torch.Tensor) -> tuple[ForwardBatch, list[int]]:
        """The verify pass: request i extends its committed KV by [its last token] + drafts[i] at positions
        kv_committed_len .. (an EXTEND batch; its KV slots out_loc written to req_to_token). -> (the batch, each
        request's first row in the pass's T rows)."""
        dev = self.device
        req_to_token = self.runner.req_to_token_pool.req_to_token
        input_ids, positions, prefix_lens, row_start = [], [], [], []
        offset = 0
        for req, draft, n in zip(reqs, drafts, lens):
            start = req.kv_committed_len  # == len(req.fill_ids) - 1: the last token's KV is not written yet
            row_start.append(offset)
            prefix_lens.append(start)
            req_to_token[req.req_pool_idx, start:start + n] = out_loc[offset:offset + n].to(torch.int32)
            input_ids.append(req.fill_ids[-1])
            input_ids.extend(draft)
            positions.extend(range(start, start + n))
            offset += n
        seq_lens = [p + n for p, n in zip(prefix_lens, lens)]
        ext = host_to_device(lens, torch.int32, dev)
        fb = ForwardBatch(
            forward_mode=ForwardMode.EXTEND, batch_size=len(reqs),
            input_ids=host_to_device(input_ids, torch.int64, dev), positions=host_to_device(positions, torch.int64, dev),
            req_pool_indices=host_to_device([r.req_pool_idx for r in reqs], torch.int64, dev),
            seq_lens=host_to_device(seq_lens, torch.int32, dev), out_cache_loc=out_loc, seq_lens_cpu=seq_lens,
            extend_prefix_lens=host_to_device(prefix_lens, torch.int32, dev), extend_seq_lens=ext,
            extend_start_loc=torch.cumsum(ext, 0, dtype=torch.int32) - ext,
            extend_prefix_lens_cpu=prefix_lens, extend_seq_lens_cpu=lens)
        return fb, row_start

    def _accept(self, reqs, drafts, row_start, logits, masks):
        """-> (per request the emitted tokens, per request [(logprob, top)] for them or None when no request asks)."""
        dev = self.device
        owner = [i for i, d in enumerate(drafts) for _ in range(len(d) + 1)]  # the request of each of the T rows
        info = SamplingBatchInfo.build(reqs, self.vocab_size, dev)
        rows_info = info.filter(owner, host_to_device(owner, torch.int64, dev))
        if any(m is not None for m in masks):
            words = (self.vocab_size + 31) // 32
            bitmask = torch.full((len(owner), words), -1, dtype=torch.int32)
            for i, m in enumerate(masks):
                if m is not None:
                    bitmask[row_start[i]:row_start[i] + m.shape[0]] = m
            rows_info.token_bitmask = bitmask.to(dev)
        processed = apply_penalties(logits, rows_info)
        emitted: list[list[int]] = [[] for _ in reqs]
        drafted = [i for i, d in enumerate(drafts) if d]
        if drafted:
            probs = target_probs(processed, rows_info)
            got = accept(probs, [row_start[i] for i in drafted], [drafts[i] for i in drafted],
                         [info.is_greedy[i] for i in drafted], [_request_generator(reqs[i]) for i in drafted])
            for i, tokens in zip(drafted, got):
                emitted[i] = tokens
        plain = [i for i, d in enumerate(drafts) if not d]
        if plain:
            # a request without a draft samples as a decode step does (a seeded one draws what it would there)
            rows = host_to_device([row_start[i] for i in plain], torch.int64, dev)
            plain_info = info.filter(plain, host_to_device(plain, torch.int64, dev))
            if rows_info.token_bitmask is not None:
                plain_info.token_bitmask = rows_info.token_bitmask.index_select(0, rows)
            for i, tok in zip(plain, self.runner.sampler(processed.index_select(0, rows), plain_info).tolist()):
                emitted[i] = [tok]
        if info.logprob_top_k is None:
            return emitted, None
        lp_rows = [row_start[i] + j for i, e in enumerate(emitted) for j in range(len(e))]
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
        return emitted, out

    # ---- commit ----
    def _commit(self, sched, req: Req, tokens: list[int], logprobs: Optional[list]) -> None:
        """Append the emitted tokens one by one through the finish checks (EOS, stop ids and strings, the grammar,
        the length), stop at the first that ends the request, then release the KV of every verified position past
        the last kept token (rejected drafts, tokens after a stop)."""
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
        # the newest token's KV is written by the next pass, as after a decode step
        self.prefix_cache.truncate_req_kv(req, len(req.fill_ids) - 1)
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


def _request_generator(req: Req) -> Optional[torch.Generator]:
    """A seeded sampling request's random stream at this point of its output (the same drafts and seed give the same
    tokens on any run, beside any batch mates); None for the others (torch's global stream)."""
    sp = req.sampling_params
    if sp.seed is None or sp.is_greedy:
        return None
    return torch.Generator().manual_seed((int(sp.seed) * 1_000_003 + len(req.output_ids)) & ((1 << 63) - 1))
