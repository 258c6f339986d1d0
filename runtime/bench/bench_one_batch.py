"""`python -m braid.bench_one_batch`: latency of one static batch, in-process, without the scheduler.

For each (batch size, input length, output length): one prefill of the whole batch, then output_len - 1
decode steps, greedy (argmax on the device). Reports prefill latency and throughput, the median decode
step latency and decode tokens/s, and the total. Takes every ServerArgs flag (--model-path, --load-format
dummy --model-config cfg.json, --dtype, --attention-backend, --disable-cuda-graph, ...).
`--compare-hf` times HF transformers' `generate` (static cache) on the same batch and prints braid/HF.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import sys
import time
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from braid.runtime.bench.results import append_jsonl
from braid.runtime.config import ServerArgs
from braid.runtime.core import ForwardBatch, ForwardMode
from braid.runtime.mem_cache.kv_sizing import KVPoolTooLarge

__all__ = ["BenchOneBatchError", "BatchRun", "StaticBatchRunner", "latency_test", "build_parser", "parse_args",
           "run_benchmark", "main"]

logger = logging.getLogger(__name__)

CORRECTNESS_PROMPTS = [
    "The capital of France is",
    "The three primary colors are",
    "Here is a short poem about the sea:",
    "To make a cup of tea, first",
]


class BenchOneBatchError(ValueError):
    """A batch that the model or the KV pool cannot hold, or bad benchmark arguments."""


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class StepClock:
    """Per-step latencies without a host sync per step.

    On CUDA each mark records an event in the stream, read after the loop: a step's interval is its span on the
    GPU's timeline, including any gap while the host was still launching it. On CPU, marks read the wall clock.
    """

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.marks: list = []

    def mark(self) -> None:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.marks.append(event)
        else:
            self.marks.append(time.perf_counter())

    def intervals_s(self) -> list[float]:
        if self.cuda:
            torch.cuda.synchronize()
            return [a.elapsed_time(b) / 1e3 for a, b in zip(self.marks, self.marks[1:])]
        return [b - a for a, b in zip(self.marks, self.marks[1:])]


@dataclass
class BatchRun:
    output_ids: list[list[int]]  # [B][output_len]
    prefill_latency_s: float
    decode_latencies_s: list[float]  # one per decode step (output_len - 1)


class StaticBatchRunner:
    """Drives a ModelRunner through one prefill and the decode steps of a fixed batch; frees all KV after."""

    def __init__(self, runner):
        self.runner = runner
        self.device = runner.device
        self.req_pool = runner.req_to_token_pool
        self.kv_pool = runner.kv_pool

    def _check(self, prompts: list[list[int]], output_len: int) -> None:
        if not prompts or any(len(p) == 0 for p in prompts):
            raise BenchOneBatchError("every prompt needs at least one token")
        if output_len < 1:
            raise BenchOneBatchError(f"output_len must be >= 1, got {output_len}")
        longest = max(len(p) for p in prompts) + output_len
        if longest > self.runner.context_len:
            raise BenchOneBatchError(f"input + output ({longest} tokens) exceeds the model's context "
                                     f"({self.runner.context_len}); lower --input-len/--output-len")
        if len(prompts) > self.req_pool.available_size():
            raise BenchOneBatchError(f"batch size {len(prompts)} exceeds the {self.req_pool.available_size()} free "
                                     "request slots; raise --max-running-requests")
        need = sum(len(p) for p in prompts) + len(prompts) * (output_len - 1)
        free = self.kv_pool.available_size()
        if hasattr(self.kv_pool, "window_available_size"):  # a hybrid pool: nothing is released here
            free = min(free, self.kv_pool.window_available_size())
        if need > free:
            raise BenchOneBatchError(f"the batch needs {need} KV slots, the pool has {free} free; raise "
                                     "--max-total-tokens (or --window-kv-ratio)")

    @torch.no_grad()
    def run(self, prompts: list[list[int]], output_len: int) -> BatchRun:
        self._check(prompts, output_len)
        dev = self.device
        B = len(prompts)
        lens = [len(p) for p in prompts]
        rows = [self.req_pool.alloc() for _ in range(B)]
        allocated: list[torch.Tensor] = []
        try:
            req_idx = torch.tensor(rows, dtype=torch.int64, device=dev)
            lens_t = torch.tensor(lens, dtype=torch.int64, device=dev)
            _sync(dev)
            t0 = time.perf_counter()
            loc = self.kv_pool.alloc(sum(lens))
            allocated.append(loc)
            offset = 0
            for row, n in zip(rows, lens):
                self.req_pool.req_to_token[row, :n] = loc[offset:offset + n].to(torch.int32)
                offset += n
            ext = torch.tensor(lens, dtype=torch.int32, device=dev)
            fb = ForwardBatch(
                forward_mode=ForwardMode.EXTEND, batch_size=B,
                input_ids=torch.tensor([t for p in prompts for t in p], dtype=torch.int64, device=dev),
                positions=torch.cat([torch.arange(n, dtype=torch.int64, device=dev) for n in lens]),
                req_pool_indices=req_idx, seq_lens=ext.clone(), out_cache_loc=loc, seq_lens_cpu=list(lens),
                extend_prefix_lens=torch.zeros(B, dtype=torch.int32, device=dev), extend_seq_lens=ext,
                extend_start_loc=torch.cumsum(ext, 0, dtype=torch.int32) - ext,
                extend_prefix_lens_cpu=[0] * B, extend_seq_lens_cpu=list(lens),
            )
            next_ids = _greedy_next_ids(self.runner, fb)
            out = torch.empty((B, output_len), dtype=torch.int64, device=dev)  # [B, output_len]
            out[:, 0] = next_ids
            _sync(dev)
            prefill = time.perf_counter() - t0

            # No host sync inside the loop: the host launches step i+1 while the GPU still runs step i.
            clock = StepClock(dev)
            clock.mark()
            for step in range(1, output_len):
                loc = self.kv_pool.alloc(B)
                allocated.append(loc)
                positions = lens_t + (step - 1)  # position of the token fed in: the previous output
                self.req_pool.req_to_token[req_idx, positions] = loc.to(torch.int32)
                fb = ForwardBatch(
                    forward_mode=ForwardMode.DECODE, batch_size=B, input_ids=next_ids, positions=positions,
                    req_pool_indices=req_idx, seq_lens=(positions + 1).to(torch.int32), out_cache_loc=loc,
                    seq_lens_cpu=[n + step for n in lens],
                )
                next_ids = _greedy_next_ids(self.runner, fb)
                out[:, step] = next_ids
                clock.mark()
            decode = clock.intervals_s()
            return BatchRun(out.tolist(), prefill, decode)
        finally:
            if allocated:
                self.kv_pool.free(torch.cat(allocated))
            for r in rows:
                if r is not None:
                    self.req_pool.free(r)


def _median(xs: list[float]) -> float:
    s = sorted(xs)
    n = len(s)
    if n == 0:
        return 0.0
    return s[n // 2] if n % 2 else (s[n // 2 - 1] + s[n // 2]) / 2


def _greedy_next_ids(runner, fb: ForwardBatch) -> torch.Tensor:
    """Each row's argmax token, left on the device (ModelRunner.forward is greedy without sampling_info)."""
    return runner.forward(fb).next_token_ids


def random_prompts(vocab_size: int, batch_size: int, input_len: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (batch_size, input_len), generator=g).tolist()


def latency_test(sb: StaticBatchRunner, batch_size: int, input_len: int, output_len: int, seed: int = 0,
                 run_name: str = "default") -> tuple[dict, BatchRun]:
    prompts = random_prompts(sb.runner.vocab_size, batch_size, input_len, seed)
    run = sb.run(prompts, output_len)
    med = _median(run.decode_latencies_s)
    total = run.prefill_latency_s + sum(run.decode_latencies_s)
    result = {
        "run_name": run_name, "batch_size": batch_size, "input_len": input_len, "output_len": output_len,
        "prefill_latency_s": run.prefill_latency_s,
        "prefill_throughput": batch_size * input_len / run.prefill_latency_s,
        "median_decode_latency_s": med,
        "decode_throughput": batch_size / med if med > 0 else 0.0,
        "total_latency_s": total,
        "overall_throughput": batch_size * (input_len + output_len) / total,
    }
    return result, run


# ---------------------------------------------------------------------------------------------- HF reference
class HFReference:
    """The same model in HF transformers: the GGUF / HF folder's weights, or a random init of a dummy config."""

    def __init__(self, server_args: ServerArgs, runner):
        import transformers

        from braid.runtime.loader.model_path import is_gguf, resolve_model_path

        self.device = runner.device
        dtype = runner.dtype
        major, minor = (int(x) for x in transformers.__version__.split(".")[:2])
        dtype_kw = {"dtype" if (major, minor) >= (4, 56) else "torch_dtype": dtype}
        if server_args.load_format == "dummy":
            cfg = dict(runner.model_config.hf)
            model_type = cfg.pop("model_type", None)
            config = (transformers.AutoConfig.for_model(model_type, **cfg) if model_type
                      else transformers.LlamaConfig(**cfg))
            with torch.device(self.device):
                model = transformers.AutoModelForCausalLM.from_config(config, **dtype_kw)
        else:
            path = resolve_model_path(server_args.model_path)
            if is_gguf(path):
                model = transformers.AutoModelForCausalLM.from_pretrained(
                    os.path.dirname(path), gguf_file=os.path.basename(path), **dtype_kw)
            else:
                model = transformers.AutoModelForCausalLM.from_pretrained(path, **dtype_kw)
            model = model.to(self.device)
        self.model = model.eval()
        self.cache_impl = "static" if getattr(self.model, "_supports_static_cache", True) else None

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], output_len: int) -> tuple[float, list[list[int]]]:
        ids = torch.tensor(prompts, dtype=torch.int64, device=self.device)  # equal lengths: no padding
        kw = dict(max_new_tokens=output_len, min_new_tokens=output_len, do_sample=False,
                  attention_mask=torch.ones_like(ids), pad_token_id=0, eos_token_id=None)
        if self.cache_impl:
            # eager HF: a static cache would otherwise make generate torch.compile the model on its own
            kw.update(cache_implementation=self.cache_impl, disable_compile=True)
        _sync(self.device)
        t0 = time.perf_counter()
        out = self.model.generate(ids, **kw)
        _sync(self.device)
        return time.perf_counter() - t0, out[:, ids.shape[1]:].tolist()

    def latency_test(self, prompts: list[list[int]], output_len: int) -> dict:
        """HF's prefill and per-decode-step latency; output_len may be shorter than braid's run (HF is slow)."""
        self.generate(prompts, min(output_len, 2))  # warm-up (static cache allocation, kernels)
        prefill, _ = self.generate(prompts, 1)
        total, _ = self.generate(prompts, output_len)
        per_step = (total - prefill) / (output_len - 1) if output_len > 1 else 0.0
        return {"hf_prefill_latency_s": prefill, "hf_median_decode_latency_s": per_step, "hf_total_latency_s": total}


def _add_hf_ratios(result: dict, hf: dict) -> None:
    result.update(hf)
    result["prefill_throughput_ratio_vs_hf"] = hf["hf_prefill_latency_s"] / result["prefill_latency_s"]
    med, hf_step = result["median_decode_latency_s"], hf["hf_median_decode_latency_s"]
    result["decode_throughput_ratio_vs_hf"] = hf_step / med if med > 0 else 0.0
    result["hf_decode_throughput"] = result["batch_size"] / hf_step if hf_step > 0 else 0.0
    # HF's total for braid's output length (its run may have been shorter): prefill + steps x per-step latency
    hf_total = hf["hf_prefill_latency_s"] + hf_step * (result["output_len"] - 1)
    result["total_throughput_ratio_vs_hf"] = hf_total / result["total_latency_s"]


# ---------------------------------------------------------------------------------------------- correctness
def correctness_test(sb: StaticBatchRunner, server_args: ServerArgs, output_len: int,
                     hf: Optional[HFReference] = None) -> list[dict]:
    """Greedy continuations of a few real prompts in one batch (optionally checked token by token against HF)."""
    from braid.runtime.loader.tokenizer import get_tokenizer

    if server_args.load_format == "dummy":
        raise BenchOneBatchError("--correctness-test needs real weights (not --load-format dummy)")
    tok = get_tokenizer(server_args)
    prompts = [tok.encode(p) for p in CORRECTNESS_PROMPTS]
    run = sb.run(prompts, output_len)
    rows = []
    for text, ids, out in zip(CORRECTNESS_PROMPTS, prompts, run.output_ids):
        row = {"prompt": text, "output": tok.decode(out), "output_ids": out}
        if hf is not None:
            _, hf_out = hf.generate([ids], output_len)
            row["hf_output_ids"] = hf_out[0]
            row["hf_token_match"] = sum(a == b for a, b in zip(out, hf_out[0])) / output_len
        rows.append(row)
        print(f"[correctness] {text!r} -> {row['output']!r}"
              + (f"  (HF agreement {row['hf_token_match']:.0%})" if hf is not None else ""))
    return rows


# ---------------------------------------------------------------------------------------------- entry
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="braid.bench_one_batch", description=__doc__.splitlines()[0])
    ServerArgs.add_cli_args(p)
    g = p.add_argument_group("benchmark")
    g.add_argument("--run-name", default="default")
    g.add_argument("--batch-size", type=int, nargs="+", default=[1])
    g.add_argument("--input-len", type=int, nargs="+", default=[1024])
    g.add_argument("--output-len", type=int, nargs="+", default=[16])
    g.add_argument("--seed", type=int, default=0, help="seed of the random prompt tokens")
    g.add_argument("--result-filename", default=None, help="append one JSON line per run")
    g.add_argument("--correctness-test", action="store_true", help="also print greedy continuations of real prompts")
    g.add_argument("--compare-hf", action="store_true", help="time HF transformers generate on the same batches")
    g.add_argument("--hf-output-len", type=int, default=None,
                   help="tokens HF generates per run (default: --output-len); its per-step decode latency is "
                        "(total - prefill) / (tokens - 1), so a shorter run measures the same rate")
    g.add_argument("--skip-warmup", action="store_true")
    return p


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    return build_parser().parse_args(argv)


def server_args_for(args: argparse.Namespace) -> ServerArgs:
    """ServerArgs from the CLI, with the KV pool and request slots sized for the largest batch when not given."""
    for name in ("batch_size", "input_len", "output_len"):
        if any(v < 1 for v in getattr(args, name)):
            raise BenchOneBatchError(f"--{name.replace('_', '-')} values must be >= 1")
    kw = {f.name: getattr(args, f.name) for f in dataclasses.fields(ServerArgs)}
    # static batches drive the model runner without the scheduler, where these run: refused rather than ignored
    for flag, given in (("--speculative-algorithm / --speculative-config", kw["speculative_algorithm"] or
                         kw["speculative_config"]), ("--enable-lora", kw["enable_lora"])):
        if given:
            raise BenchOneBatchError(f"{flag}: bench_one_batch times static batches on the model runner, without the "
                                     "scheduler that runs them; measure with bench_offline_throughput or bench_serving")
    max_bs = max(args.batch_size)
    if kw["max_total_tokens"] is None:
        longest = max(args.input_len) + max(args.output_len)
        if args.correctness_test:
            longest = max(longest, 64 + max(args.output_len))
        kw["max_total_tokens"] = max(max_bs, len(CORRECTNESS_PROMPTS)) * longest + 64
    kw["max_running_requests"] = max(kw["max_running_requests"] or 0, max_bs)
    return ServerArgs(**kw)


def print_table(results: list[dict]) -> None:
    cols = [("bs", "batch_size", "d"), ("in", "input_len", "d"), ("out", "output_len", "d"),
            ("prefill ms", "prefill_latency_s", "ms"), ("prefill tok/s", "prefill_throughput", ".1f"),
            ("decode ms (median)", "median_decode_latency_s", "ms"), ("decode tok/s", "decode_throughput", ".1f"),
            ("total s", "total_latency_s", ".3f"), ("total tok/s", "overall_throughput", ".1f")]
    if results and "hf_total_latency_s" in results[0]:
        cols += [("HF decode tok/s", "hf_decode_throughput", ".1f"), ("prefill x HF", "prefill_throughput_ratio_vs_hf", ".2f"),
                 ("decode x HF", "decode_throughput_ratio_vs_hf", ".2f"),
                 ("total x HF", "total_throughput_ratio_vs_hf", ".2f")]

    def fmt(v, f):
        return f"{v * 1000:.2f}" if f == "ms" else format(v, f)

    widths = [max(len(h), *(len(fmt(r[k], f)) for r in results)) for h, k, f in cols]
    print("  ".join(h.rjust(w) for (h, _, _), w in zip(cols, widths)))
    for r in results:
        print("  ".join(fmt(r[k], f).rjust(w) for (_, k, f), w in zip(cols, widths)))
    if results and "hf_total_latency_s" in results[0]:
        print("x HF: braid throughput / HF transformers generate throughput (static cache), same batch")


def run_benchmark(args: argparse.Namespace) -> dict:
    """Builds the ModelRunner once and runs every (batch size, input len, output len).

    Returns {"runs": [one dict per run], "correctness": [per-prompt dicts] or None, plus the run's setup}."""
    from braid.runtime.model_executor.model_runner import ModelRunner

    server_args = server_args_for(args)
    runner = ModelRunner(server_args)
    sb = StaticBatchRunner(runner)
    hf = HFReference(server_args, runner) if args.compare_hf else None
    setup = {"model_path": server_args.model_path, "load_format": server_args.load_format,
             "device": str(runner.device), "dtype": str(runner.dtype).replace("torch.", ""),
             "attention_backend": runner.attn_backend_name, "cuda_graph": runner.cuda_graph_runner is not None,
             "date": time.strftime("%Y-%m-%dT%H:%M:%S"), "command": " ".join(sys.argv)}
    if runner.device.type == "cuda":
        setup["card"] = torch.cuda.get_device_name(runner.device)
    correctness = correctness_test(sb, server_args, max(args.output_len), hf) if args.correctness_test else None
    runs = []
    for bs in args.batch_size:
        for in_len in args.input_len:
            if not args.skip_warmup:
                sb.run(random_prompts(runner.vocab_size, bs, in_len, args.seed + 1), min(4, max(args.output_len)))
            for out_len in args.output_len:
                result, _ = latency_test(sb, bs, in_len, out_len, args.seed, args.run_name)
                if hf is not None:
                    hf_len = min(out_len, args.hf_output_len) if args.hf_output_len else out_len
                    _add_hf_ratios(result, hf.latency_test(random_prompts(runner.vocab_size, bs, in_len, args.seed),
                                                           max(hf_len, 2)))
                result.update(setup)
                runs.append(result)
                if args.result_filename:
                    append_jsonl(args.result_filename, result)
                if sb.kv_pool.available_size() != sb.kv_pool.size or (
                        getattr(sb.kv_pool, "window_size", None) is not None
                        and sb.kv_pool.window_available_size() != sb.kv_pool.window_size):
                    raise RuntimeError("KV slots leaked by a benchmark run")
    print_table(runs)
    return {**setup, "runs": runs, "correctness": correctness,
            "kv_free_after": sb.kv_pool.available_size(), "kv_size": sb.kv_pool.size,
            "req_slots_free_after": sb.req_pool.available_size(), "req_slots": sb.req_pool.size}


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=getattr(logging, str(args.log_level).upper(), logging.INFO),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        run_benchmark(args)
    except (BenchOneBatchError, KVPoolTooLarge) as e:
        print(f"bench_one_batch: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
