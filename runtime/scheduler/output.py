"""Output: committing sampled tokens to requests, finish checks (stop tokens, stop strings, grammar end, length),
jump-forward, and the ReqOutput each step reports for a request."""

from __future__ import annotations

import enum
import time
from typing import Callable, Optional

import torch

from braid.runtime.constrained.bitmask import allocate_bitmask, clear_tokens
from braid.runtime.constrained.grammar import fill_bitmasks
from braid.runtime.core import FinishReason, Req, ReqOutput

_NEVER = 1 << 62  # an output length no request reaches
_REPLACEMENT = "\ufffd"  # what decode makes of a cut multi-byte character


class FinishTable:
    """What ends each request, by request slot (`req_pool_idx`), so that a step's finish checks over the whole batch
    are a few tensor ops instead of Python per request. Filled once per admission (`set`); per step `candidates`
    gives the rows whose token may end the request (EOS or a stop id, the length limit) or that need Python checks
    anyway (`slow`: stop strings, logprobs, an internal prefill, more stop ids than a row holds). Only those go
    through `OutputProcessor.commit`; the rest just append their token. (Grammars are advanced for the whole batch
    first; the scheduler flags the rows whose grammar ended or may jump forward.)"""

    STOP_IDS_PER_ROW = 4

    def __init__(self, num_slots: int, eos_token_ids: set[int], context_len: int):
        self.context_len = context_len
        self.eos = torch.tensor(sorted(eos_token_ids) or [-1], dtype=torch.int64)
        # per slot, in output tokens: the length that ends it, from which an EOS id ends it (_NEVER: ignore_eos),
        # below which it may not end (min_new_tokens: its decode step is not overlapped)
        self.out_limit = torch.zeros(num_slots, dtype=torch.int64)
        self.eos_from = torch.zeros(num_slots, dtype=torch.int64)
        self.min_new = torch.zeros(num_slots, dtype=torch.int64)
        self.max_new = torch.zeros(num_slots, dtype=torch.float64)  # max_new_tokens, for the decode reservation
        self.stop_ids = torch.full((num_slots, self.STOP_IDS_PER_ROW), -1, dtype=torch.int64)
        self.slow = torch.ones(num_slots, dtype=torch.bool)
        # sampling that needs the host's view of the previous step before the pass (penalties, logprobs; grammar
        # masks are filled after the pass is launched: DecodeRunner.sample_pending)
        self.blocks_overlap = torch.ones(num_slots, dtype=torch.bool)

    def set(self, req: Req) -> None:
        sp, slot = req.sampling_params, req.req_pool_idx
        stop_ids = sorted(set(sp.stop_token_ids or ()))
        self.out_limit[slot] = min(sp.max_new_tokens, self.context_len - len(req.input_ids))
        self.eos_from[slot] = _NEVER if sp.ignore_eos else sp.min_new_tokens
        self.min_new[slot] = sp.min_new_tokens
        self.max_new[slot] = sp.max_new_tokens
        self.stop_ids[slot] = -1
        self.stop_ids[slot, :min(len(stop_ids), self.STOP_IDS_PER_ROW)] = torch.tensor(
            stop_ids[:self.STOP_IDS_PER_ROW], dtype=torch.int64)
        self.slow[slot] = bool(req.return_logprob or sp.stop or req.is_internal
                               or len(stop_ids) > self.STOP_IDS_PER_ROW)
        self.blocks_overlap[slot] = bool(req.return_logprob or sp.frequency_penalty or sp.presence_penalty
                                         or sp.repetition_penalty != 1.0)

    def candidates(self, slots: torch.Tensor, token_ids: torch.Tensor, out_lens: torch.Tensor) -> torch.Tensor:
        """[B] bool: the rows that need `OutputProcessor.commit` after appending token_ids [B] (int64) to outputs
        that then hold out_lens [B] (int64) tokens; slots [B] int64."""
        hit = (out_lens >= self.out_limit[slots]) | self.slow[slots]
        hit |= torch.isin(token_ids, self.eos) & (out_lens >= self.eos_from[slots])
        hit |= (self.stop_ids[slots] == token_ids.unsqueeze(1)).any(dim=1) & (out_lens >= self.min_new[slots])
        return hit

    def reserved_tokens(self, slots: torch.Tensor, out_lens: torch.Tensor, ratio: float) -> int:
        """The KV tokens admission keeps free for these requests' decoding: `ratio` of each one's remaining
        max_new_tokens, rounded down per request."""
        return int(((self.max_new[slots] - out_lens) * ratio).floor().sum())

    def ends_by_length(self, slots: torch.Tensor, out_lens: torch.Tensor) -> torch.Tensor:
        """[B] bool: outputs of out_lens tokens are at the length limit (max_new_tokens or the context)."""
        return out_lens >= self.out_limit[slots]

    def can_overlap(self, slots: torch.Tensor, out_lens: torch.Tensor) -> bool:
        """Whether the rows may be sampled without the host's view of the step before (each will then have
        out_lens tokens before this sample): no penalty or logprobs, and min_new_tokens already met."""
        return not bool((self.blocks_overlap[slots] | (out_lens < self.min_new[slots])).any())


class NextStep(enum.Enum):
    """Where a request goes once a sampled token is committed."""

    DECODE = "decodes on"
    EXTEND = "needs an extend over the tokens it jumped forward (the resume queue)"
    FINISHED = "finished"


def jump_forward_enabled(server_args, device: torch.device) -> bool:
    """--enable-jump-forward / --disable-jump-forward, else on except on CUDA."""
    if server_args.enable_jump_forward or server_args.disable_jump_forward:
        return server_args.enable_jump_forward
    return device.type != "cuda"


class OutputProcessor:
    def __init__(self, server_args, tokenizer, eos_token_ids: set[int], context_len: int, vocab_size: int,
                 prefix_cache, device: torch.device):
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.context_len = context_len
        self.vocab_size = vocab_size
        self.prefix_cache = prefix_cache
        self.device = device
        self.jump_forward_enabled = jump_forward_enabled(server_args, device)
        self.stream_interval = server_args.stream_interval
        self.num_generated_tokens = 0
        self.grammar_mask_s = 0.0  # host time filling grammar masks, summed
        self._bitmask_buffers: list[Optional[torch.Tensor]] = [None, None]
        self._bitmask_turn = 0

    # ---- before sampling ----
    def bitmask_filler(self, reqs: list[Req]) -> Optional[Callable[[], torch.Tensor]]:
        """A function that fills the batch's token bitmask ([B, ceil(V / 32)] int32 on the device: grammars and
        min_new_tokens bans) from the requests' states as they are when it is called; None when no request needs
        one. The runner calls it once the model's pass is queued, so the host's mask work overlaps the device's;
        fill(to_device=False) leaves the mask on the host (a fill on another thread: the copy stays on the
        scheduler's)."""
        states = [r.grammar for r in reqs]
        min_new = [r.sampling_params.min_new_tokens for r in reqs]
        ban_rows = [i for i, (r, m) in enumerate(zip(reqs, min_new)) if m and len(r.output_ids) < m] \
            if any(min_new) else []
        if not ban_rows and states.count(None) == len(states):
            return None

        @torch.inference_mode()  # on the runner's thread or the mask thread alike
        def fill(to_device: bool = True) -> torch.Tensor:
            host = self._host_bitmask(len(reqs))
            host.fill_(-1)
            start = time.perf_counter()
            fill_bitmasks(states, host)
            self.grammar_mask_s += time.perf_counter() - start
            for i in ban_rows:
                sp = reqs[i].sampling_params
                banned = set() if sp.ignore_eos else set(self.eos_token_ids)
                banned |= set(sp.stop_token_ids or ())
                banned = [t for t in banned if t < self.vocab_size]
                if banned:
                    row = host[i].clone()
                    clear_tokens(row, banned)
                    if bool(row.any()):
                        host[i] = row
            return self.bitmask_to_device(host) if to_device else host
        return fill

    def bitmask_to_device(self, host: torch.Tensor) -> torch.Tensor:
        """A filled host bitmask on the device (an asynchronous copy from pinned memory on CUDA)."""
        return host.to(self.device, non_blocking=True) if self.device.type == "cuda" else host

    def _host_bitmask(self, batch_size: int) -> torch.Tensor:
        """[batch_size, words] view of one of two host buffers used in turn (pinned on CUDA): a step's buffer is
        written again only two steps later, after its copy to the device has long finished."""
        self._bitmask_turn ^= 1
        buf = self._bitmask_buffers[self._bitmask_turn]
        if buf is None or buf.shape[0] < batch_size:
            buf = allocate_bitmask(max(batch_size, 64), self.vocab_size, pin=self.device.type == "cuda")
            self._bitmask_buffers[self._bitmask_turn] = buf
        return buf[:batch_size]

    # ---- after sampling ----
    def commit(self, req: Req, host: dict, row: int, jump_forward: bool = True,
               grammar_ended: Optional[bool] = None) -> tuple[NextStep, Optional[FinishReason]]:
        """Append the token sampled in `row` of a ForwardOutput's host copy (grammar_ended: None, or the request's
        grammar has taken it already and this says whether it ended; the grammar is then not touched, as a mask
        fill may be reading it). -> where the request goes, with the reason when it finished."""
        lp = None
        if req.return_logprob:
            n, top_v = req.top_logprobs_num, host.get("next_top_logprobs")
            top = list(zip(top_v[row][:n], host["next_top_ids"][row][:n])) if n and top_v is not None else None
            lp = (host["next_token_logprobs"][row], top)
        reason = self.append_token(req, host["next_token_ids"][row], lp, grammar_ended)
        if reason is None and jump_forward:
            jumped, reason = self.jump_forward(req)
            if jumped and reason is None:
                return NextStep.EXTEND, None
        return (NextStep.FINISHED, reason) if reason is not None else (NextStep.DECODE, None)

    def append_token(self, req: Req, tok: int, logprobs: Optional[tuple],
                     grammar_ended: Optional[bool] = None) -> Optional[FinishReason]:
        """Record a sampled token; the reason the request ends with it, if it does."""
        req.output_ids.append(tok)
        req.fill_ids.append(tok)
        self.num_generated_tokens += 1
        if req.first_token_time is None:
            req.first_token_time = time.time()
        if logprobs is not None:
            req.output_token_logprobs.append((logprobs[0], tok))
            req.output_top_logprobs.append(logprobs[1])
        sp = req.sampling_params
        if req.grammar is not None and grammar_ended is None:
            req.grammar.accept_token(tok)
            grammar_ended = req.grammar.is_terminated()
        # as vLLM: nothing but the length ends a request before min_new_tokens (EOS and stop ids are also masked)
        if len(req.output_ids) >= sp.min_new_tokens:
            if not sp.ignore_eos and tok in self.eos_token_ids:
                return FinishReason("stop", matched=tok)
            if sp.stop_token_ids and tok in sp.stop_token_ids:
                return FinishReason("stop", matched=tok)
            if sp.stop and (matched := self._match_stop_str(req)) is not None:
                return FinishReason("stop", matched=matched)
        if grammar_ended:
            return FinishReason("stop", matched=None)
        return self._length_reason(req)

    def _length_reason(self, req: Req) -> Optional[FinishReason]:
        if len(req.output_ids) >= req.sampling_params.max_new_tokens or req.seqlen >= self.context_len:
            return FinishReason("length")
        return None

    def _match_stop_str(self, req: Req) -> Optional[str]:
        stops = req.sampling_params.stop
        longest = max(len(s) for s in stops)
        ids = req.output_ids
        # a token is at least one character: the last longest + 2 tokens hold any stop string that just completed.
        # Most tokens are several characters, so decode a shorter tail first and widen it only while it could miss
        # one: such a stop lies in the last token's text plus the longest - 1 characters before it, and the start
        # of a tail may decode differently (a cut multi-byte character, a dropped leading space).
        max_tokens = min(longest + 2, len(ids))
        num_tokens = min(max_tokens, longest // 4 + 8)
        tail = self.tokenizer.decode(ids[-num_tokens:], skip_special_tokens=False)
        if num_tokens < max_tokens:
            needed = longest + len(self.tokenizer.decode(ids[-1:], skip_special_tokens=False)) + 4
            while num_tokens < max_tokens and len(tail) < needed:
                num_tokens = min(max_tokens, 2 * num_tokens)
                tail = self.tokenizer.decode(ids[-num_tokens:], skip_special_tokens=False)
        # min_new_tokens: a stop string counts only if it ends in the text of the min_new_tokens-th token or later
        # (it may begin earlier), as in vLLM, which checks no stop string before min_tokens tokens are out and from
        # then on searches each step's new text plus the len(stop) - 1 characters before it (vLLM 0.6 searched one
        # character more, so a stop ending just before the min_tokens-th token matched too; later vLLM fixed that).
        held_off_end = req.sampling_params.min_new_tokens - 1
        tail_start = len(ids) - num_tokens
        held_off_chars = 0
        if tail_start < held_off_end:  # a character cut at the boundary belongs to the text after it
            held_off = self.tokenizer.decode(ids[tail_start:held_off_end], skip_special_tokens=False)
            held_off_chars = len(held_off.rstrip(_REPLACEMENT))
        for s in stops:
            if tail.find(s, max(0, held_off_chars - len(s) + 1)) != -1:
                return s
        return None

    def jump_forward(self, req: Req) -> tuple[bool, Optional[FinishReason]]:
        """Append the tokens the grammar forces next (possibly re-tokenizing the last few). (jumped, finish reason):
        a request that jumped and goes on needs an extend over the new tokens."""
        if req.grammar is None or not self.jump_forward_enabled:
            return False, None
        jf = req.grammar.jump_forward(req.output_ids)
        if jf is None or (jf.num_rollback == 0 and not jf.token_ids):
            return False, None
        keep = len(req.output_ids) - jf.num_rollback
        req.dirty_offset = min(req.dirty_offset, keep) if req.dirty_offset is not None else keep
        req.output_ids = req.output_ids[:keep] + list(jf.token_ids)
        req.jump_forward_tokens += len(jf.token_ids) - jf.num_rollback
        req.fill_ids = req.input_ids + req.output_ids
        self.prefix_cache.truncate_req_kv(req, min(req.kv_committed_len, len(req.input_ids) + keep))
        if (reason := self._length_reason(req)) is not None:
            req.output_ids = req.output_ids[:req.sampling_params.max_new_tokens]
            req.fill_ids = req.input_ids + req.output_ids
            req.kv_committed_len = min(req.kv_committed_len, len(req.fill_ids) - 1)
            return True, reason
        if req.grammar.is_terminated():
            return True, FinishReason("stop", matched=None)
        return True, None

    # ---- reporting ----
    def make_output(self, req: Req) -> Optional[ReqOutput]:
        """What to report for `req` now, or None (not streamed and unfinished; or within the stream interval).
        Runs for every streamed request on every step: the plain case (no logprobs) builds one ReqOutput."""
        reason = req.finished_reason
        if req.is_internal or not (reason is not None or req.stream):
            return None
        n = len(req.output_ids)
        sent, dirty = req.sent_offset, req.dirty_offset
        if reason is None and dirty is None and sent > 0 and n - sent < self.stream_interval:
            return None
        offset = sent if dirty is None else min(sent, dirty)
        out = ReqOutput(req.rid, req.index, offset, req.output_ids[offset:], reason is not None,
                        None if reason is None else reason.to_json(), len(req.input_ids), n, req.cached_tokens,
                        n - req.jump_forward_tokens)
        if req.return_logprob:
            lp_off = req.sent_logprob_offset
            out.output_token_logprobs = req.output_token_logprobs[lp_off:]
            out.output_top_logprobs = req.output_top_logprobs[lp_off:]
            if not req.sent_input_logprobs:
                out.input_token_logprobs, out.input_top_logprobs = req.input_token_logprobs, req.input_top_logprobs
                req.sent_input_logprobs = req.input_token_logprobs is not None
            req.sent_logprob_offset = len(req.output_token_logprobs)
        if reason is not None:
            out.first_token_time = req.first_token_time
            out.error_kind = reason.kind
            if req.scheduled_time is not None:
                out.queue_time = req.scheduled_time - req.created_time
            if req.spec_drafts:
                out.spec_accept_length = 1.0 + req.spec_accepted_tokens / req.spec_drafts
        req.sent_offset = n
        req.dirty_offset = None
        return out
