"""FP8 accuracy on SmolLM2-135M-Instruct (CPU), another real model, or random weights of a larger config: FP8 weights and
each FP8 KV cache against the fp32 baseline.

The baseline (fp32 weights, fp32 KV, torch attention) continues 64 prompts greedily for 64 tokens. Each variant
then
- reads the prompt plus the baseline's continuation (teacher forcing): top-1 agreement = how often its argmax is
  the baseline's token, mean |delta logprob| = the mean difference of the log-probabilities of the baseline's
  tokens; both over the same 64 x 64 positions;
- generates 64 tokens greedily on its own: free-running agreement = the share of positions holding the baseline's
  token, and the mean length of the common prefix.
bf16 weights (and KV) are measured the same way as the reference point for "how much does a cheaper dtype move".
"fp8 weights, x unquantized" multiplies by the same e4m3 weights without rounding activations to fp8: what the GPU
computes for decode batches of up to 16 rows (the weight-only GEMV and small-batch kernels); the CPU path, like the
GPU's larger batches and prefill, quantizes activations per token.

    python benchmarks/fp8_accuracy.py [--prompts 64] [--tokens 64] [--variants e4m3 ...] [--model-config JSON]
                                      [--model-path gemma3-270m]

--model-path runs another real model (a folder, a GGUF, or 'gemma3-270m'); prompts go through its chat template,
or are the plain requests when it has none (a base model).

--model-config runs a model of that config's shapes with random weights (load_format dummy) instead of SmolLM2's,
with SmolLM2's tokenizer and chat template for the prompts (the config's vocabulary must be SmolLM2's 49,152):
benchmarks/configs/llama-1b-class-smollm2-vocab.json is Llama-3.2-1B's shapes, where each output is a sum over 2,048
or 8,192 products instead of SmolLM2's 576 or 1,536.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import statistics
import time
from unittest import mock

import torch

from braid.runtime import Engine
from braid.runtime.layers.quantization import fp8

SUBJECTS = ["the ocean", "a small bakery", "volcanoes", "the history of Rome", "learning to play the piano",
            "black holes", "a rainy afternoon", "honey bees", "the printing press", "mountain climbing",
            "how vaccines work", "a lighthouse keeper", "the water cycle", "chess openings", "desert plants",
            "the first airplane"]
TEMPLATES = ["Write a short paragraph about {}.", "Explain {} to a ten-year-old.",
             "List three surprising facts about {}.", "Tell a very short story involving {}."]

VARIANTS = {
    "bf16 weights + bf16 KV": dict(dtype="bfloat16"),
    "fp8 weights (--quantization fp8)": dict(quantization="fp8"),
    "fp8 weights, x unquantized": dict(quantization="fp8"),
    "fp8_e5m2 KV": dict(kv_cache_dtype="fp8_e5m2"),
    "fp8_e4m3 KV (scale 1.0)": dict(kv_cache_dtype="fp8_e4m3"),
    "fp8_e4m3 KV (--calculate-kv-scales)": dict(kv_cache_dtype="fp8_e4m3", calculate_kv_scales=True),
    "fp8 weights + fp8_e4m3 KV": dict(quantization="fp8", kv_cache_dtype="fp8_e4m3"),
}


def chat_prompts(engine: Engine, count: int) -> list[list[int]]:
    tok = engine.tokenizer
    texts = [t.format(s) for t in TEMPLATES for s in SUBJECTS][:count]
    if not getattr(tok, "chat_template", None):  # a base model: the requests as plain text after BOS
        return [tok.encode(text) for text in texts]
    rendered = [tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                        tokenize=False) for text in texts]
    return [tok.encode(text, add_special_tokens=False) for text in rendered]


def _unquantized_rows(x, static_scale=None):
    """quantize_rows' stand-in for the weight-only variant: x itself, scale 1."""
    return x, torch.ones(x.shape[0], 1, dtype=torch.float32, device=x.device)


@torch.no_grad()
def _engine(embedding_std=None, model_path="smollm2", **kw) -> Engine:
    """kw: the variant's and --model-config's ServerArgs; embedding_std: --embedding-std."""
    engine = Engine(model_path=model_path, attention_backend="torch", log_level="warning", max_total_tokens=16384,
                    **kw)
    if embedding_std is not None:
        # the same random table in every engine (the dummy loader's seed), rescaled: with tied embeddings the logits
        # are the final normed hidden state times this table, so their spread across the vocabulary follows its std
        model = engine.scheduler.runner.model
        if not model.tie_word_embeddings:
            raise ValueError("--embedding-std needs a config with tied embeddings")
        embedding = model.model.embed_tokens.weight
        embedding.mul_(embedding_std / embedding.float().std().item())
        model.lm_head.prepack_weights()  # the CPU's packed copy of the (tied) LM head, from the rescaled table
    return engine


def greedy(engine: Engine, prompts, tokens: int) -> list[list[int]]:
    sp = {"temperature": 0, "max_new_tokens": tokens, "ignore_eos": True}
    return [r["output_ids"] for r in engine.generate(input_ids=prompts, sampling_params=sp)]


def teacher_forced(engine: Engine, prompts, continuations) -> tuple[list[list[float]], list[list[int]]]:
    """Per prompt: logprobs of the continuation's tokens and the argmax at each of their positions."""
    sp = {"temperature": 0, "max_new_tokens": 1, "ignore_eos": True}
    inputs = [p + c for p, c in zip(prompts, continuations)]
    res = engine.generate(input_ids=inputs, sampling_params=sp, return_logprob=True,
                          logprob_start_len=0, top_logprobs_num=1)
    logprobs, argmax = [], []
    for r, p, c in zip(res, prompts, continuations):
        meta = r["meta_info"]
        # input_token_logprobs[i] is token i given tokens < i (the first has none)
        lps = meta["input_token_logprobs"][len(p):]
        tops = meta["input_top_logprobs"][len(p):]
        assert len(lps) == len(c), (len(lps), len(c))
        logprobs.append([lp for lp, _ in lps])
        argmax.append([top[0][1] for top in tops])
    return logprobs, argmax


def compare(base_lps, base_out, lps, argmax, free) -> dict:
    pairs = [(a, b) for x, y in zip(base_lps, lps) for a, b in zip(x, y)]
    top1 = [t == a for c, m in zip(base_out, argmax) for t, a in zip(c, m)]
    same = [t == f for c, g in zip(base_out, free) for t, f in zip(c, g)]

    def prefix(c, g):
        n = 0
        while n < len(c) and c[n] == g[n]:
            n += 1
        return n

    return {"top1_agreement": sum(top1) / len(top1),
            "mean_abs_dlogprob": statistics.fmean(abs(a - b) for a, b in pairs),
            "free_running_agreement": sum(same) / len(same),
            "mean_common_prefix": statistics.fmean(prefix(c, g) for c, g in zip(base_out, free))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--variants", nargs="+", metavar="TEXT",
                        help="only the variants whose name contains one of these (default: all)")
    parser.add_argument("--model-path", default="smollm2", help="a real model instead of SmolLM2 (folder, GGUF, "
                        "or 'gemma3-270m')")
    parser.add_argument("--model-config", help="a config JSON: random weights of its shapes instead of SmolLM2's")
    parser.add_argument("--embedding-std", type=float,
                        help="with --model-config and tied embeddings: rescale the random embedding table to this "
                             "std, so that the logits spread (the dummy loader's ~0.012 leaves a 2,048-wide model's "
                             "next-token distribution nearly uniform, where fp8 noise moves nothing that matters)")
    args = parser.parse_args()
    model = dict(embedding_std=args.embedding_std, model_path=args.model_path)  # for every engine
    if args.model_config and args.model_path != "smollm2":
        raise ValueError("--model-config and --model-path exclude each other")
    if args.model_config:
        with open(args.model_config) as f:
            config = json.load(f)
        if config.get("vocab_size") != 49152:
            raise ValueError(f"--model-config needs SmolLM2's vocabulary of 49152 (its tokenizer makes the prompts); "
                             f"{args.model_config} has {config.get('vocab_size')}")
        model.update(load_format="dummy", model_config=json.dumps(config))
    model_name = (f"random weights of {args.model_config}'s shapes" if args.model_config else
                  "SmolLM2-135M-Instruct" if args.model_path == "smollm2" else args.model_path)
    started = time.perf_counter()
    with _engine(**model) as engine:
        prompts = chat_prompts(engine, args.prompts)
        base_out = greedy(engine, prompts, args.tokens)
        base_lps, base_argmax = teacher_forced(engine, prompts, base_out)
    self_check = compare(base_lps, base_out, base_lps, base_argmax, base_out)
    chosen = [lp for row in base_lps for lp in row]
    print(f"baseline fp32: teacher-forced top-1 agreement with its own greedy output {self_check['top1_agreement']:.4f}"
          f" (should be 1); its greedy tokens' mean probability {statistics.fmean(math.exp(lp) for lp in chosen):.4f}"
          f" (how peaked its distributions are), {len({t for row in base_out for t in row})} distinct tokens in its "
          f"{sum(map(len, base_out))} greedy ones", flush=True)
    rows = []
    for name, kw in VARIANTS.items():
        if args.variants and not any(text in name for text in args.variants):
            continue
        t0 = time.perf_counter()
        with contextlib.ExitStack() as stack:
            if name == "fp8 weights, x unquantized":
                stack.enter_context(mock.patch.object(fp8, "quantize_rows", _unquantized_rows))
            engine = stack.enter_context(_engine(**model, **kw))
            lps, argmax = teacher_forced(engine, prompts, base_out)
            free = greedy(engine, prompts, args.tokens)
        row = {"variant": name, **compare(base_lps, base_out, lps, argmax, free), "s": time.perf_counter() - t0}
        rows.append(row)
        print(row, flush=True)
    print(f"\n{model_name}, CPU, {args.prompts} prompts x {args.tokens} greedy tokens, against fp32 weights + "
          f"fp32 KV (torch attention); {time.perf_counter() - started:.0f} s\n")
    print("| variant | teacher-forced top-1 agreement | mean abs dlogprob (chosen tokens) | free-running agreement | "
          "mean common prefix (tokens) |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['variant']} | {r['top1_agreement']:.2%} | {r['mean_abs_dlogprob']:.4f} | "
              f"{r['free_running_agreement']:.2%} | {r['mean_common_prefix']:.1f} |")


if __name__ == "__main__":
    main()
