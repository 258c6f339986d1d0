"""HF transformers batch generation on bench_serving's workload: the peer figure beside a braid server.

Builds the same prompts as `python -m braid.bench_serving` (same dataset flags and seed), then runs HF `generate`
over them in static batches (left padding, greedy, every request held to its requested output length by
generating the batch's longest and counting each request's own). Prints output tokens/s.

    python benchmarks/hf_batch_generate.py --model-config benchmarks/configs/llama3-8b.json --tokenizer smollm2 \
        --dataset-name random --num-prompts 1000 --random-input-len 1024 --random-output-len 256 \
        --random-range-ratio 0.5 --hf-num-prompts 128 --batch-size 64

`--model-config` makes a random-weight model of that config (throughput does not depend on the values);
`--model-path` loads a real HF folder instead. `--hf-num-prompts` runs the first N prompts only (HF is slow).
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from braid.runtime.bench.datasets import add_dataset_args, get_dataset
from braid.runtime.bench.results import append_jsonl
from braid.runtime.loader.tokenizer import load_tokenizer


def build_model(args):
    import transformers

    dtype = getattr(torch, args.dtype)
    if args.model_config:
        with open(args.model_config) as f:
            cfg = json.load(f)
        config = transformers.AutoConfig.for_model(cfg.pop("model_type"), **cfg)
        with torch.device(args.device):
            model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
    else:
        model = transformers.AutoModelForCausalLM.from_pretrained(args.model_path, dtype=dtype).to(args.device)
    return model.eval()


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--model-config", help="config.json of a random-weight model")
    src.add_argument("--model-path", help="HF model folder")
    p.add_argument("--tokenizer", required=True, help="path or 'smollm2'; builds the prompts")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--hf-num-prompts", type=int, default=None, help="only the first N prompts")
    p.add_argument("--output-file", default=None)
    add_dataset_args(p)
    args = p.parse_args(argv)

    tokenizer = load_tokenizer(args.tokenizer)
    requests = get_dataset(args, tokenizer)[: args.hf_num_prompts]
    model = build_model(args)
    vocab = model.config.vocab_size
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    batches = [requests[i:i + args.batch_size] for i in range(0, len(requests), args.batch_size)]

    def run_batch(batch) -> None:
        ids = [tokenizer.encode(r.prompt)[:r.prompt_len] for r in batch]
        width = max(len(x) for x in ids)
        input_ids = torch.tensor([[pad] * (width - len(x)) + x for x in ids], device=args.device) % vocab
        mask = torch.tensor([[0] * (width - len(x)) + [1] * len(x) for x in ids], device=args.device)
        longest = max(r.output_len for r in batch)
        with torch.no_grad():
            model.generate(input_ids, attention_mask=mask, max_new_tokens=longest, min_new_tokens=longest,
                           do_sample=False, pad_token_id=pad, eos_token_id=None)

    run_batch(batches[0][:2])  # warm-up
    if args.device == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    for batch in batches:
        run_batch(batch)
    if args.device == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    out_tokens = sum(r.output_len for r in requests)
    result = {"system": "hf-transformers generate", "num_prompts": len(requests), "batch_size": args.batch_size,
              "seconds": seconds, "input_tokens": sum(r.prompt_len for r in requests), "output_tokens": out_tokens,
              "output_throughput": out_tokens / seconds, "device": args.device,
              "card": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
              "date": time.strftime("%Y-%m-%dT%H:%M:%S")}
    print(f"HF batch generation: {len(requests)} prompts in batches of {args.batch_size}: {out_tokens} output tokens "
          f"in {seconds:.1f} s = {result['output_throughput']:.1f} output tok/s")
    if args.output_file:
        append_jsonl(args.output_file, result)
    return result


if __name__ == "__main__":
    main()
