"""The llguidance engine: regex, JSON schema, context-free grammars (Lark, GBNF / EBNF) and structural tags,
compiled on threads (the library drops the GIL) and matched by an Earley parser over a lazy lexer.

A grammar holds one matcher built at compile time; each request gets a copy (cheap: the compiled grammar is shared).
Masks of a batch are computed on the library's own thread pool straight into a packed bitmask. The start state's
mask is computed once, by the compile, off the scheduler's thread: a request's first mask (the one its extend
samples under) is a copy of it, not a walk of the vocabulary with its matcher's caches still cold.
"""

from __future__ import annotations

import concurrent.futures
import json
import threading

import llguidance
import torch

from .bitmask import allocate_bitmask
from .grammar_errors import GrammarError, GrammarShutDownError, GrammarTimeoutError
from .regex_index import check_regex_syntax
from .jump_forward import JumpForward
from .regex_classes import ascii_shorthand_classes
from .schema_prepare import prepare_schema
from .schema_strict import ascii_patterns, strict_schema
from .vocabulary import TokenVocabulary

# JSON as braid writes it by default: no whitespace between tokens (the outlines engine's default too)
_COMPACT_JSON = {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"}


class _BytesTokenizer:
    """What llguidance.TokenizerWrapper reads: each token's bytes, the specials, and an encode function."""

    def __init__(self, tokenizer, vocabulary: TokenVocabulary, vocab_size: int):
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self.eos_token_id = vocabulary.eos_token_id
        self.bos_token_id = getattr(tokenizer, "bos_token_id", None)
        names = tokenizer.convert_ids_to_tokens(list(range(len(vocabulary))))
        self.special_token_ids = [i for i, raw in enumerate(vocabulary.token_bytes) if raw is None]
        self.tokens = [raw if raw is not None else (names[i] or f"<special_{i}>").encode("utf-8")
                       for i, raw in enumerate(vocabulary.token_bytes)]
        self.tokens += [f"<unused_{i}>".encode() for i in range(len(self.tokens), vocab_size)]
        self.special_token_ids += list(range(len(vocabulary), vocab_size))

    def __call__(self, text: str) -> list[int]:
        return [t for t in self._tokenizer.encode(text, add_special_tokens=False) if t < self._vocab_size]


def ll_tokenizer(tokenizer, vocabulary: TokenVocabulary, vocab_size: int) -> "llguidance.LLTokenizer":
    """llguidance's tokenizer over `vocab_size` ids (the model's logits width; ids past the tokenizer never allowed)."""
    eos = vocabulary.eos_token_id
    try:
        import llguidance.hf

        if getattr(tokenizer, "backend_tokenizer", None) is not None and vocab_size >= len(tokenizer):
            return llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=eos)
    except (ValueError, TypeError, RuntimeError):
        pass  # a tokenizer llguidance cannot read as JSON: described token by token below
    return llguidance.LLTokenizer(llguidance.TokenizerWrapper(_BytesTokenizer(tokenizer, vocabulary, vocab_size)),
                                  n_vocab=vocab_size, eos_token=eos)


def structural_tag_grammar(spec: str) -> str:
    """SGLang's / vLLM's structural tag ({"structures": [{"begin", "schema", "end"}], "triggers": [...]}) as Lark:
    free text, where a trigger starts one of the tagged segments whose body follows its schema."""
    try:
        tag = json.loads(spec)
    except ValueError as e:
        raise GrammarError(f"structural_tag is not valid JSON: {e}") from None
    if not isinstance(tag, dict):
        raise GrammarError("structural_tag must be a JSON object")
    if "format" in tag:
        raise GrammarError("structural_tag's 'format' form is not supported; give 'structures' and 'triggers'")
    structures, triggers = tag.get("structures"), tag.get("triggers")
    if not isinstance(structures, list) or not structures:
        raise GrammarError("structural_tag.structures must be a non-empty list of {begin, schema, end}")
    if not isinstance(triggers, list) or not triggers or not all(isinstance(t, str) and t for t in triggers):
        raise GrammarError("structural_tag.triggers must be a non-empty list of strings")
    tags = []
    for i, s in enumerate(structures):
        if not isinstance(s, dict) or not isinstance(s.get("begin"), str) or not isinstance(s.get("end"), str):
            raise GrammarError(f"structural_tag.structures[{i}] needs string 'begin' and 'end'")
        schema = s.get("schema", s.get("parameters", {}))
        if not isinstance(schema, (dict, bool)):
            raise GrammarError(f"structural_tag.structures[{i}].schema must be a JSON schema object")
        trigger = next((t for t in triggers if s["begin"].startswith(t)), None)
        if trigger is None:
            raise GrammarError(f"structural_tag.structures[{i}].begin {s['begin']!r} starts with none of the triggers")
        grammar = prepare_schema(schema) if isinstance(schema, dict) else schema
        tags.append(llguidance.StructTag(trigger=trigger, begin=s["begin"], grammar=grammar, end=s["end"]))
    try:
        return llguidance.StructTag.to_grammar(tags, assume_special=False)
    except (ValueError, TypeError) as e:
        raise GrammarError(f"structural_tag: {e}") from None


class LLGuidanceGrammar:
    """One compiled grammar; immutable and shared by every request using it."""

    engine = "llguidance"

    def __init__(self, kind: str, spec: str, matcher: "llguidance.LLMatcher", vocab_size: int, eos_token_id: int,
                 executor: "llguidance.LLExecutor"):
        self.kind = kind
        self.executor = executor  # the engine's mask threads (grammar.fill_bitmasks)
        self.spec = spec
        self.vocab_size = vocab_size
        self.eos_token_id = eos_token_id
        self._matcher = matcher  # never advanced: the start state every request copies
        # [words] int32: the start state's allowed tokens (a copy's mask is computed; the template stays untouched)
        self.start_mask = allocate_bitmask(1, vocab_size)[0]
        matcher.deep_copy().unsafe_compute_mask_ptr(self.start_mask.data_ptr(), self.start_mask.numel() * 4)
        self.start_mask_np = self.start_mask.numpy()  # the same memory, for grammar.fill_bitmasks

    def new_state(self) -> "LLGuidanceState":
        return LLGuidanceState(self, self._matcher.deep_copy())

    def __repr__(self) -> str:
        return f"LLGuidanceGrammar(kind={self.kind!r}, spec={self.spec[:60]!r})"


class LLGuidanceState:
    """One request's matcher; llguidance keeps the history rollback needs."""

    def __init__(self, grammar: LLGuidanceGrammar, matcher: "llguidance.LLMatcher"):
        self.grammar = grammar
        self.matcher = matcher
        self.num_accepted = 0
        self.terminated = False  # EOS accepted

    def accept_token(self, token_id: int) -> None:
        token_id = int(token_id)
        if self.terminated:
            raise GrammarError(f"token {token_id} given after the grammar already terminated")
        if token_id == self.grammar.eos_token_id:  # kept out of the matcher: EOS ends the output, not the text
            if not self.is_accepting():
                raise GrammarError("EOS is not allowed by the grammar here")
            self.terminated = True
        # try_consume_tokens leaves the matcher as it was when the token is refused (consume_token would poison it)
        elif not 0 <= token_id < self.grammar.vocab_size or self.matcher.try_consume_tokens([token_id]) != 1:
            raise GrammarError(f"token {token_id} is not allowed by the grammar here")
        self.num_accepted += 1

    def rollback(self, n: int) -> None:
        if n < 0 or n > self.num_accepted:
            raise GrammarError(f"cannot roll back {n} tokens; {self.num_accepted} were accepted")
        self.num_accepted -= n
        if n and self.terminated:
            self.terminated, n = False, n - 1
        if n and not self.matcher.rollback(n):
            raise GrammarError(f"cannot roll back {n} tokens: {self.matcher.get_error()}")

    def is_terminated(self) -> bool:
        return self.terminated or self.matcher.is_stopped()

    def is_accepting(self) -> bool:
        return not self.terminated and not self.matcher.is_error() and self.matcher.is_accepting()

    def at_start(self) -> bool:
        """Whether the matcher is in the grammar's start state (nothing accepted, or all of it rolled back; not in
        the error state a refused token of a batched accept leaves): its mask is grammar.start_mask."""
        return self.num_accepted == 0 and not self.matcher.is_error()

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Overwrite `bitmask[row]` ([B, words] int32, contiguous, CPU) with this state's allowed tokens."""
        target = bitmask[row]
        if self.terminated:
            target.zero_()
            target[self.grammar.eos_token_id // 32] = _bit(self.grammar.eos_token_id % 32)
        elif self.at_start():
            target.copy_(self.grammar.start_mask)
        else:
            self.matcher.unsafe_compute_mask_ptr(target.data_ptr(), target.numel() * 4)

    def allowed_token_ids(self) -> torch.Tensor:
        from .bitmask import unpack_row

        bitmask = allocate_bitmask(1, self.grammar.vocab_size)
        self.fill_bitmask(bitmask, 0)
        return unpack_row(bitmask[0], self.grammar.vocab_size)

    def jump_forward(self, output_ids: list[int]) -> JumpForward | None:
        """The tokens the grammar forces next, already accepted (llguidance picks them so the tokenizer would too)."""
        if self.is_terminated():
            return None
        forced = self.matcher.compute_ff_tokens()
        if not forced:
            return None
        consumed = self.matcher.try_consume_tokens(forced)
        self.num_accepted += consumed
        return JumpForward(0, forced[:consumed]) if consumed else None


class LLGuidanceEngine:
    name = "llguidance"
    kinds = ("regex", "json", "grammar", "structural_tag")

    def __init__(self, tokenizer, vocabulary: TokenVocabulary, vocab_size: int, *, whitespace_pattern: str | None,
                 timeout_s: float, num_workers: int, json_strict: bool = True, mask_threads: int | None = None):
        """json_strict: strict_schema() every JSON schema (off: as the specification reads)."""
        self.vocab_size = vocab_size
        self.json_strict = json_strict
        self.eos_token_id = vocabulary.eos_token_id
        self.timeout_s = timeout_s
        self.json_options = dict(_COMPACT_JSON) if whitespace_pattern is None else \
            {"whitespace_flexible": True, "whitespace_pattern": whitespace_pattern}
        self.tokenizer = ll_tokenizer(tokenizer, vocabulary, vocab_size)
        self._compilers = concurrent.futures.ThreadPoolExecutor(num_workers, thread_name_prefix="llguidance-compile")
        self.executor = llguidance.LLExecutor(mask_threads)
        self.limits = llguidance.LLParserLimits()
        self._stats_lock = threading.Lock()
        self._stats = {"compiles": 0, "errors": 0, "timeouts": 0}

    def grammar_text(self, kind: str, spec: str) -> str:
        """llguidance's grammar for (kind, spec); GrammarError when it cannot be one."""
        try:
            if kind == "regex":
                return llguidance.LLMatcher.grammar_from_regex(ascii_shorthand_classes(spec))
            if kind == "json":
                schema = ascii_patterns(prepare_schema(json.loads(spec)))
                if self.json_strict:
                    schema = strict_schema(schema)
                return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=self.json_options)
            if kind == "grammar":
                return llguidance.grammar_from("grammar", spec)
            if kind == "structural_tag":
                return structural_tag_grammar(spec)
        except GrammarError:
            raise
        except (ValueError, TypeError, RuntimeError) as e:
            raise GrammarError(f"invalid {_NAMES[kind]}: {e}") from None
        raise GrammarError(f"unknown grammar kind {kind!r}")

    def check(self, kind: str, spec: str) -> None:
        """The errors found without compiling (JSON, a schema's keywords, GBNF or tag syntax, what Python's regex
        parser refuses): GrammarError. Lark syntax and regex features the engine lacks are found by the compile,
        off the scheduler's thread."""
        if kind == "regex":
            check_regex_syntax(spec)
        self.grammar_text(kind, spec)

    def compile(self, kind: str, spec: str) -> LLGuidanceGrammar:
        if kind == "regex":
            check_regex_syntax(spec)
        matcher = llguidance.LLMatcher(self.tokenizer, self.grammar_text(kind, spec), log_level=0, limits=self.limits)
        if matcher.is_error():
            raise GrammarError(f"invalid {_NAMES[kind]}: {matcher.get_error().strip()}")
        return LLGuidanceGrammar(kind, spec, matcher, self.vocab_size, self.eos_token_id, self.executor)

    def submit(self, kind: str, spec: str) -> concurrent.futures.Future:
        """Future of an LLGuidanceGrammar, failed with GrammarTimeoutError past timeout_s (the thread finishes
        its work in the background: the parser's limits bound it)."""
        outer: concurrent.futures.Future = concurrent.futures.Future()
        inner = self._compilers.submit(self.compile, kind, spec)
        timer = threading.Timer(self.timeout_s, self._time_out, args=(kind, outer))
        timer.daemon = True
        timer.start()
        inner.add_done_callback(lambda done: self._finish(outer, done, timer))
        return outer

    def stats(self) -> dict:
        with self._stats_lock:
            return dict(self._stats)

    def shutdown(self) -> None:
        self._compilers.shutdown(wait=False, cancel_futures=True)

    def _count(self, key: str) -> None:
        with self._stats_lock:
            self._stats[key] += 1

    def _time_out(self, kind: str, outer: concurrent.futures.Future) -> None:
        try:
            outer.set_exception(GrammarTimeoutError(f"compiling the {_NAMES[kind]} took longer than "
                                                    f"{self.timeout_s:g}s (the grammar is too complex)"))
            self._count("timeouts")
        except concurrent.futures.InvalidStateError:
            pass

    def _finish(self, outer: concurrent.futures.Future, done: concurrent.futures.Future, timer) -> None:
        timer.cancel()
        self._count("compiles")
        if done.cancelled():
            exc = GrammarShutDownError("the grammar backend is shut down")
        else:
            exc = done.exception()
        try:
            if exc is None:
                outer.set_result(done.result())
            else:
                self._count("errors")
                outer.set_exception(exc if isinstance(exc, GrammarError) else GrammarError(str(exc)))
        except concurrent.futures.InvalidStateError:
            pass  # already timed out


def _bit(i: int) -> int:
    """int32 word with only bit i set."""
    return (1 << i) - (1 << 32) if i == 31 else 1 << i


_NAMES = {"regex": "regex", "json": "JSON schema", "grammar": "grammar", "structural_tag": "structural tag"}
