"""One mode of benchmarks/gpu/gemma2_window_kv_capacity.sh: a Gemma-2-9B-shaped dummy model (bf16) in an Engine,
its KV pool's capacity, and 8 requests of 8,000 prompt tokens decoded through the scheduler.

  python3 benchmarks/gpu/gemma2_window_kv_capacity.py trimmed|untrimmed RESULT.jsonl [--attention-backend NAME]

Capacity: the pool's full-layer token slots (and window slots when trimmed) for the same byte budget
(--mem-fraction-static), and how many 8,192-token requests fit. Decode: tokens/s of the 8 requests' decode steps
(the time of a run with DECODE_TOKENS + 1 new tokens minus that of a 1-token run, on fresh prompts each), while a
thread samples the pool's usage (the window space must stay within the running requests' windows).
"""

from __future__ import annotations

import argparse
import json
import os
import threading
import time

import torch

from braid.runtime.mem_cache.window_pool import RELEASE_STEP

# Gemma-2-9B (google/gemma-2-9b config.json): 42 layers, window 4096 on the even ones, 8 KV heads of 256
GEMMA2_9B = {
    "architectures": ["Gemma2ForCausalLM"], "model_type": "gemma2", "attn_logit_softcapping": 50.0,
    "final_logit_softcapping": 30.0, "head_dim": 256, "hidden_act": "gelu_pytorch_tanh",
    "hidden_activation": "gelu_pytorch_tanh", "hidden_size": 3584, "intermediate_size": 14336,
    "max_position_embeddings": 8192, "num_attention_heads": 16, "num_hidden_layers": 42, "num_key_value_heads": 8,
    "query_pre_attn_scalar": 256, "rms_norm_eps": 1e-06, "rope_theta": 10000.0, "sliding_window": 4096,
    "vocab_size": 256000, "bos_token_id": 2, "eos_token_id": 1, "pad_token_id": 0, "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
}
BATCH, PROMPT_LEN, DECODE_TOKENS, CONTEXT = 8, 8000, 128, 8192


def model_config_path(out_dir: str) -> str:
    shipped = "benchmarks/configs/gemma2-9b.json"
    if os.path.exists(shipped):
        return shipped
    path = os.path.join(out_dir, "gemma2-9b.json")
    with open(path, "w") as f:
        json.dump(GEMMA2_9B, f)
    return path


def prompts(seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(10, 40000, (BATCH, PROMPT_LEN), generator=g).tolist()


def timed_generate(engine, seed: int, new_tokens: int, peaks: dict) -> float:
    stop = threading.Event()

    def sample():
        while not stop.is_set():
            s = engine.get_stats()
            for key in ("kv_used_tokens", "window_kv_used_tokens"):
                if key in s:
                    peaks[key] = max(peaks.get(key, 0), s[key])
            time.sleep(0.05)

    t = threading.Thread(target=sample, daemon=True)
    t.start()
    start = time.perf_counter()
    out = engine.generate(input_ids=prompts(seed), sampling_params={"temperature": 0, "max_new_tokens": new_tokens,
                                                                    "ignore_eos": True})
    elapsed = time.perf_counter() - start
    stop.set()
    t.join()
    assert all(len(o["output_ids"]) == new_tokens for o in out), "every request generates all its tokens"
    return elapsed


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("mode", choices=["trimmed", "untrimmed"])
    p.add_argument("result")
    p.add_argument("--attention-backend", default="triton")
    args = p.parse_args()
    from braid.runtime import Engine

    out_dir = os.path.dirname(os.path.abspath(args.result))
    tok = ".gpu/tok" if os.path.isdir(".gpu/tok") else None
    engine = Engine(model_path="gemma2-9b-dummy", load_format="dummy", model_config=model_config_path(out_dir),
                    tokenizer_path=tok, dtype="bfloat16", attention_backend=args.attention_backend,
                    disable_window_kv_trimming=args.mode == "untrimmed", cuda_graph_max_bs=16,
                    context_length=CONTEXT, log_level="warning")
    try:
        stats = engine.get_stats()
        pool = engine.scheduler.runner.kv_pool
        full = stats["kv_total_tokens"]
        window = stats.get("window_kv_total_tokens", full)
        bound = engine.scheduler.runner._extend_tokens_bound() if args.mode == "trimmed" else 0
        per_request_window = min(CONTEXT, GEMMA2_9B["sliding_window"]) if args.mode == "trimmed" else CONTEXT
        requests_8k = min(full // CONTEXT, max(window - bound, 0) // per_request_window)
        timed_generate(engine, 99, 2, {})  # warm-up: kernels for these shapes
        peaks: dict = {}
        prefill_s = timed_generate(engine, 1, 1, peaks)
        total_s = timed_generate(engine, 2, DECODE_TOKENS + 1, peaks)
        decode_s = max(total_s - prefill_s, 1e-9)
        end = engine.get_stats()
        result = {
            "mode": args.mode, "attention_backend": args.attention_backend, "card": torch.cuda.get_device_name(),
            "kv_pool_bytes": pool.mem_usage_bytes(), "full_tokens": full, "window_tokens": window,
            "requests_8k_fit": requests_8k, "tokens_8k_fit": requests_8k * CONTEXT,
            "prefill_s": prefill_s, "run_s": total_s,
            "decode_tok_s": BATCH * DECODE_TOKENS / decode_s, "peak_kv_used": peaks.get("kv_used_tokens"),
            "peak_window_used": peaks.get("window_kv_used_tokens"),
            # each request's window (W - 1, released in steps of RELEASE_STEP) plus one extend batch's new tokens
            "window_bound_8x": BATCH * (GEMMA2_9B["sliding_window"] - 1 + RELEASE_STEP) + bound,
            "idle_kv_used": end["kv_used_tokens"], "idle_window_used": end.get("window_kv_used_tokens", 0),
        }
    finally:
        engine.shutdown()
    with open(args.result, "a") as f:
        f.write(json.dumps(result) + "\n")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
