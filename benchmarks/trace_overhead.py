"""What recording a run trace costs: the examples/ programs on one SmolLM2 server, each run with trace off and on in
turn (`repeats` pairs), median wall time of each and their ratio; and the recording's own cost per call on a
backend that answers at once (no model), where nothing hides it. The figures are in docs/benchmarks.md.

Run: python benchmarks/trace_overhead.py [--repeats 3] [--json out.json]
(examples/image_qa.py needs a vision model and is left out.)
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import time
from pathlib import Path

import braid
from braid.backends.base import ALL_CAPABILITIES, Backend, GenOutput, LogprobRequest

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
REVIEWS = [f"The {t} is {a}." for a in ("great", "awful", "fine", "poor") for t in ("battery", "screen", "case",
                                                                                   "price", "camera")]
CASES = {
    "few_shot_qa": lambda m, b, t: m.few_shot_qa.run(question="What is the capital of Italy?", backend=b,
                                                     temperature=0, trace=t),
    "json_extraction": lambda m, b, t: m.extract.run(
        passage="Paris, the capital of France, has about 2.1 million inhabitants.", backend=b, temperature=0, trace=t),
    "multi_turn_chat": lambda m, b, t: m.chat.run(
        questions=["What is the tallest mountain on Earth?", "How high is it?", "Who first climbed it?"], backend=b,
        temperature=0, stream=True, trace=t),
    "parallel_branches": lambda m, b, t: m.review.run(product="Pixel 9 phone", backend=b, temperature=0, trace=t),
    "react_tool_loop": lambda m, b, t: m.react.run(question="How many people live in Paris and Rome together?",
                                                   backend=b, temperature=0, trace=t),
    "run_batch": lambda m, b, t: m.classify.run_batch([{"review": r} for r in REVIEWS], backend=b,
                                                      progress_bar=False, trace=t),
}


def load_example(name: str):
    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def finish(result) -> None:
    """Wait for a run (a streamed one fills in the background) and fail on its error."""
    for state in result if isinstance(result, list) else [result]:
        if isinstance(state, Exception):
            raise state
        state.text()


def time_examples(backend, repeats: int, names: list[str]) -> dict:
    out = {}
    for name in names:
        run = CASES[name]
        module = load_example(name)
        finish(run(module, backend, False))  # warm-up: the server's cache and grammars
        times = {False: [], True: []}
        for _ in range(repeats):
            for trace in (False, True):
                start = time.perf_counter()
                finish(run(module, backend, trace))
                times[trace].append(time.perf_counter() - start)
        off, on = statistics.median(times[False]), statistics.median(times[True])
        out[name] = {"off_s": off, "on_s": on, "overhead": on / off - 1}
        print(f"{name:>18}: off {off:6.2f} s  on {on:6.2f} s  ({100 * (on / off - 1):+.1f}%)", flush=True)
    return out


class InstantBackend(Backend):
    """Answers every gen at once with three tokens and their logprobs: only the interpreter's own work is timed."""

    capabilities = ALL_CAPABILITIES

    def generate(self, prompt, sampling_params, logprobs=LogprobRequest()) -> GenOutput:
        meta = {"prompt_tokens": 10, "completion_tokens": 3, "cached_tokens": 4, "finish_reason": {"type": "stop"}}
        if logprobs.return_logprob:
            meta["output_token_logprobs"] = [[-0.1, 1, "a"], [-0.2, 2, "b"], [-0.3, 3, "c"]]
            meta["output_top_logprobs"] = [[[-0.1, 1, "a"], [-2.0, 9, "z"]]] * 3
        return GenOutput("abc", meta)


def time_per_call(num_gens: int = 2000) -> dict:
    @braid.function
    def many(s):
        for i in range(num_gens):
            s += f"{i}: " + braid.gen(f"g{i}", max_tokens=3) + "\n"

    backend = InstantBackend()
    best = {}
    for trace in (False, True, False, True):
        start = time.perf_counter()
        many.run(backend=backend, trace=trace).text()
        elapsed = (time.perf_counter() - start) / num_gens
        best[trace] = min(best.get(trace, elapsed), elapsed)
    out = {"off_us_per_call": best[False] * 1e6, "on_us_per_call": best[True] * 1e6}
    print(f"per call, no model: off {out['off_us_per_call']:.0f} us, on {out['on_us_per_call']:.0f} us")
    return out


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--examples", nargs="+", choices=sorted(CASES), default=list(CASES),
                        help="which example programs to time (default: all)")
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args(argv)
    result = {"per_call": time_per_call()}
    runtime = braid.Runtime(model_path="smollm2", max_total_tokens=8192, log_level="warning")
    try:
        result["examples"] = time_examples(runtime, args.repeats, args.examples)
    finally:
        runtime.shutdown()
    total_off = sum(r["off_s"] for r in result["examples"].values())
    total_on = sum(r["on_s"] for r in result["examples"].values())
    print(f"all examples: off {total_off:.2f} s  on {total_on:.2f} s  ({100 * (total_on / total_off - 1):+.1f}%)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
