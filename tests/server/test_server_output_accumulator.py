"""OutputAccumulator (shared by the Engine and the server) on hand-made scheduler outputs: updates of
several tokens (stream_interval > 1), jump-forward rewrites, stop tokens and strings, logprobs, aborts."""

from braid.runtime.core import ReqOutput
from braid.runtime.sampling_params import SamplingParams
from braid.runtime.request_io.output_accumulator import OutputAccumulator

EOS = 0


class CharTokenizer:
    """Token id = code point; id 0 is the end-of-sequence token and decodes to "<eos>"."""

    def decode(self, ids, skip_special_tokens=True):
        return "".join("<eos>" if i == EOS else chr(i) for i in ids)


def ids(text: str) -> list[int]:
    return [ord(c) for c in text]


def out(offset: int, new: list[int], finished=False, reason=None, completion=0, **kw) -> ReqOutput:
    return ReqOutput(rid="r", index=0, output_ids_offset=offset, new_token_ids=new, finished=finished,
                     finish_reason=reason, prompt_tokens=3, completion_tokens=completion, cached_tokens=1,
                     completion_tokens_wo_jump_forward=completion, **kw)


def feed(text: str, step: int, sp: SamplingParams = SamplingParams(), reason=None, tail=()) -> OutputAccumulator:
    acc = OutputAccumulator(0, CharTokenizer(), sp, prompt_tokens=3)
    all_ids = ids(text) + list(tail)
    deltas = []
    for start in range(0, len(all_ids), step):
        last = start + step >= len(all_ids)
        update = acc.add(out(start, all_ids[start:start + step], finished=last, reason=reason if last else None,
                             completion=min(start + step, len(all_ids))))
        deltas.append(update.delta)
        assert update.text == "".join(deltas)
    assert acc.finished
    return acc


def test_updates_of_several_tokens_give_the_same_text_as_single_tokens():
    text = "The quick brown fox"
    reason = {"type": "length", "matched": None}
    for step in (1, 3, 4, len(text)):
        acc = feed(text, step, reason=reason)
        assert acc.text == text and acc.output_ids == ids(text) and acc.finish_reason == reason
        assert acc.completion_tokens == len(text) and acc.prompt_tokens == 3 and acc.cached_tokens == 1


def test_stop_token_is_no_part_of_the_text_but_of_the_ids():
    for step in (1, 5):
        acc = feed("hello", step, reason={"type": "stop", "matched": EOS}, tail=[EOS])
        assert acc.text == "hello" and acc.output_ids[-1] == EOS


def test_stop_string_split_across_a_multi_token_update():
    sp = SamplingParams(stop=["fox"])
    for step in (1, 2, 5):
        acc = feed("a red fox ran", step, sp=sp, reason={"type": "stop", "matched": "fox"})
        assert acc.text == "a red "


def test_jump_forward_rewrites_recent_ids():
    acc = OutputAccumulator(0, CharTokenizer(), SamplingParams(), prompt_tokens=3, snapshot_ids=True)
    first = acc.add(out(0, ids('{"a')))
    update = acc.add(out(1, ids('"ab": 1}'), finished=True, reason={"type": "stop", "matched": None}))
    assert acc.output_ids == ids('{"ab": 1}') and acc.text == '{"ab": 1}' and update.finished
    assert update.output_ids == acc.output_ids and first.output_ids == ids('{"a')  # each a snapshot
    plain = OutputAccumulator(0, CharTokenizer(), SamplingParams(), prompt_tokens=3)
    assert plain.add(out(0, ids("ab"))).output_ids is None  # no copy of the ids per update unless asked


def test_logprobs_append_and_meta_info():
    acc = OutputAccumulator(0, CharTokenizer(), SamplingParams(), prompt_tokens=3, return_logprob=True)
    acc.add(out(0, ids("ab"), output_token_logprobs=[(-0.5, 97), (-0.25, 98)], output_top_logprobs=[[(-0.5, 97)], None],
                input_token_logprobs=[(None, 1), (-1.0, 2)], input_top_logprobs=[None, [(-1.0, 2)]]))
    update = acc.add(out(2, ids("c"), finished=True, reason={"type": "length", "matched": None},
                         output_token_logprobs=[[-0.125, 99]], output_top_logprobs=[None]))
    assert update.new_token_logprobs == [(-0.125, 99)]
    meta = acc.native_result("r", token_text=chr)["meta_info"]
    assert meta["output_token_logprobs"] == [[-0.5, 97, "a"], [-0.25, 98, "b"], [-0.125, 99, "c"]]
    assert meta["output_top_logprobs"] == [[[-0.5, 97, "a"]], None, None]
    assert meta["input_token_logprobs"] == [[None, 1, "\x01"], [-1.0, 2, "\x02"]]
    assert acc.native_result("r")["meta_info"]["output_token_logprobs"][0] == [-0.5, 97]


def test_native_result_as_of_an_earlier_update():
    """The server applies outputs ahead of the handler writing them: a chunk shows the choice as of its update."""
    acc = OutputAccumulator(0, CharTokenizer(), SamplingParams(), prompt_tokens=3, return_logprob=True,
                            snapshot_ids=True)
    first = acc.add(out(0, ids("ab"), completion=2, output_token_logprobs=[(-0.5, 97), (-0.25, 98)],
                        output_top_logprobs=[None, None]))
    acc.add(out(2, ids("c"), finished=True, reason={"type": "length", "matched": None}, completion=3,
                output_token_logprobs=[(-0.125, 99)], output_top_logprobs=[None]))
    then = acc.native_result("r", update=first)
    assert then["text"] == "ab" and then["output_ids"] == ids("ab")
    assert then["meta_info"]["completion_tokens"] == 2 and then["meta_info"]["finish_reason"] is None
    assert then["meta_info"]["output_token_logprobs"] == [[-0.5, 97], [-0.25, 98]]
    assert acc.native_result("r")["meta_info"]["finish_reason"] == {"type": "length", "matched": None}


def test_abort_keeps_the_output_and_later_outputs_are_ignored():
    acc = OutputAccumulator(0, CharTokenizer(), SamplingParams(), prompt_tokens=3)
    acc.add(out(0, ids("abc"), completion=3))
    update = acc.abort("server shutting down")
    assert update.finished and acc.text == "abc" and acc.completion_tokens == 3
    assert acc.finish_reason == {"type": "abort", "matched": None, "message": "server shutting down"}
    assert acc.add(out(3, ids("d"))) is None and acc.abort() is None
