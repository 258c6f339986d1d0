"""API speculative execution of one program state (see braid.speculation): the state machine between the executor's
worker and the backend. A speculative gen asks for more tokens than it needs; the program's following literal text
is matched against the reply and the next gens are cut from it, so that one call serves several gens. On a chat
model an assistant() block is collected and generated as one turn, then split at the block's text.

The executor calls `gen`, `literal`, `leave`, `settle`, `collect_text` and `open_block` / `close_block` from its
worker thread; this calls back the executor's worker-side methods (`_append`, `_plain_gen`, `_gen_from_speculation`,
`snapshot`)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

from braid import ir
from braid.errors import ProgramError
from braid.runtime.sampling_params import SamplingParams
from braid.speculation import (SPEC_CHAT_TRIES, BlockGen, BlockItem, Speculation, speculative_params, split_reply,
                               stop_list)

if TYPE_CHECKING:
    from braid.interpreter import StreamExecutor


class SpeculativeRun:
    def __init__(self, executor: "StreamExecutor"):
        self.ex = executor
        self.speculation: Optional[Speculation] = None
        self.waiting_gen: Optional[tuple[ir.Gen, SamplingParams]] = None  # a gen cut by the next literal
        self.block: Optional[list[BlockItem]] = None  # chat models: the open assistant block's items

    @property
    def unsettled(self) -> bool:
        """A gen waits for the program's next literal, or an assistant block is being collected."""
        return self.waiting_gen is not None or self.block is not None

    def open_block(self) -> None:
        self.block = []

    def close_block(self) -> None:
        if self.block is not None:
            self._run_block()

    def collect_text(self, value: str) -> bool:
        """Inside a collected assistant block, the program's text joins the block (True); otherwise False."""
        if self.block is None:
            return False
        if self.block and isinstance(self.block[-1], str):
            self.block[-1] += value
        elif value:
            self.block.append(value)
        return True

    def gen(self, node: ir.Gen, sp: SamplingParams) -> None:
        if self.block is not None:
            self.block.append(BlockGen(node, sp))
            return
        self._settle_waiting_gen()
        if not self.speculation or not self.speculation.text:
            out = self.ex.backend.generate(self.ex.snapshot(), speculative_params(sp, self.ex.num_api_spec_tokens))
            self.speculation = Speculation.from_output(out.text, out.meta_info)
        spec = self.speculation
        stops = stop_list(sp)
        if not stops:
            self.waiting_gen = (node, sp)
            return
        cut = spec.cut_at_stop(stops)
        if cut is not None:
            self.ex._gen_from_speculation(node, cut[0], spec.meta("stop", cut[1]))
            return
        rest = spec.take_rest(sp.max_new_tokens)
        if rest is not None:
            self.ex._gen_from_speculation(node, rest, spec.meta("stop"))
            return
        self.speculation = None
        self.ex._plain_gen(node, sp)

    def literal(self, text: str) -> None:
        """The program is about to append literal text (its own or template markup): cut a waiting gen before
        it, or check it against the speculation."""
        spec = self.speculation
        if spec is None or not text:
            return
        if self.waiting_gen is not None:
            node, _ = self.waiting_gen
            value = spec.cut_before(text)
            if value is None:
                self._settle_waiting_gen()
                self.speculation = None
                return
            self.waiting_gen = None
            self.ex._gen_from_speculation(node, value, spec.meta("stop", text))
            return
        spec.consume_literal(text)

    def settle(self) -> None:
        """Someone waits on the state (or the program ended): decide what speculation still holds back. A chat
        model's assistant block collected so far is generated now; the block's later items then continue it."""
        if self.block is not None:
            self._run_block()
        self._settle_waiting_gen()

    def _settle_waiting_gen(self) -> None:
        """Decide a waiting gen without a following literal: the whole speculation when the model ended it
        within the gen's budget, otherwise the gen's normal call."""
        if self.waiting_gen is None:
            return
        node, sp = self.waiting_gen
        self.waiting_gen = None
        spec = self.speculation
        rest = spec.take_rest(sp.max_new_tokens) if spec is not None else None
        if rest is not None:
            self.ex._gen_from_speculation(node, rest, spec.meta("stop"))
        else:
            self.speculation = None
            self.ex._plain_gen(node, sp)

    def leave(self, node: ir.Node) -> None:
        """`node` cannot take part in speculation: settle what waits and drop the speculation."""
        if self.block is not None:
            if isinstance(node, ir.SetVar):
                return
            if any(isinstance(item, BlockGen) for item in self.block):
                raise ProgramError(f"{type(node).__name__} cannot follow a speculative gen in the same assistant() "
                                   "block (only text and gens without a grammar, dtype or logprobs can)")
            texts, self.block = self.block, None
            for text in texts:
                self.ex._append(text)
            return
        self._settle_waiting_gen()
        self.speculation = None

    def _run_block(self) -> None:
        """A chat model's speculative assistant block: one call for the whole turn, split at the block's text."""
        items, self.block = self.block, None
        gens = [item for item in items if isinstance(item, BlockGen)]
        if not gens:
            for text in items:
                self.ex._append(text)
            return
        params = speculative_params(gens[0].sp, self.ex.num_api_spec_tokens)
        prompt = self.ex.snapshot()
        can_fall_back = isinstance(items[0], BlockGen) and len(gens) == 1  # the gen's normal call needs no prefill
        replies = []
        for _ in range(1 if can_fall_back else SPEC_CHAT_TRIES):
            out = self.ex.backend.generate(prompt, params)
            replies.append(out.text)
            values = split_reply(out.text, items)
            if values is not None:
                break
        else:
            if can_fall_back:
                self.ex._plain_gen(items[0].node, items[0].sp)
                for text in items[1:]:
                    self.ex._append(text)
                return
            pattern = "".join(item if isinstance(item, str) else "{" + str(item.node.name) + "}" for item in items)
            raise ProgramError(f"speculative execution: {SPEC_CHAT_TRIES} replies of {self.ex.backend.name} did not "
                               f"follow the assistant block's text {pattern!r}; last reply: {replies[-1]!r}")
        spec = Speculation.from_output(out.text, out.meta_info)
        for item, value in zip(items, values):
            if isinstance(item, str):
                self.ex._append(value)
            else:
                self.ex._gen_from_speculation(item.node, value, spec.meta("stop"))
