"""A KV pool the GPU cannot hold is refused before allocation, with the sizes and what to lower.

The check is a function of sizes (the device's free bytes after the weights, its capacity, the pool's bytes), so it runs
here without a GPU: the ModelRunner's own check over the DeepSeek-V2-Lite config of benchmarks/configs with
--disable-mla, given the memory an H100 80GB reports after that model's bf16 weights.
"""

from pathlib import Path

import pytest
import torch

from braid.runtime.config import ServerArgs
from braid.runtime.loader import load_model_config
from braid.runtime.mem_cache.kv_sizing import KVPoolTooLarge, check_kv_pool_fits
from braid.runtime.model_executor.model_runner import ModelRunner

LITE_CONFIG = Path(__file__).resolve().parents[2] / "benchmarks" / "configs" / "deepseek-v2-lite.json"
H100_CAPACITY = 85_029_158_912  # torch.cuda.mem_get_info's total on an H100 80GB HBM3
LITE_WEIGHTS = 31_429_000_000  # 15.7B parameters in bf16
FREE_AFTER_WEIGHTS = H100_CAPACITY - LITE_WEIGHTS - 600_000_000  # less the CUDA context


def _unallocated_runner(tokens: int, **server_args) -> ModelRunner:
    """A ModelRunner holding only what _init_pools has decided when it checks the pool: config, sizes, device."""
    args = ServerArgs(model_path="deepseek-v2-lite", load_format="dummy", model_config=LITE_CONFIG.read_text(),
                      dtype="bfloat16", max_total_tokens=tokens, **server_args)
    runner = ModelRunner.__new__(ModelRunner)
    runner.server_args, runner.model_config = args, load_model_config(args)
    runner.context_len, runner.device = runner.model_config.context_len, torch.device("cuda", 0)
    runner.max_total_tokens, runner.window_kv_tokens = tokens, None
    return runner


def _check(runner: ModelRunner, kv_dtype=torch.bfloat16) -> None:
    reserved = H100_CAPACITY * (1 - runner.server_args.mem_fraction_static)
    runner._check_pool_fits(kv_dtype, None, FREE_AFTER_WEIGHTS, H100_CAPACITY, reserved, requested=True)


def test_expanded_deepseek_v2_lite_pool_of_200k_tokens_is_refused_with_its_sizes():
    runner = _unallocated_runner(200_000, disable_mla=True)
    # 27 layers x 16 heads x (192 key + 128 value dims) x 2 bytes; the latent layout: 27 x (512 + 64) x 2
    per_token, latent = 27 * 16 * (192 + 128) * 2, 27 * (512 + 64) * 2
    reserved = int(H100_CAPACITY * (1 - 0.85))
    available = FREE_AFTER_WEIGHTS - reserved
    fitting = available // per_token - 1  # the pool's dummy slot is paid for too
    with pytest.raises(KVPoolTooLarge) as refused:
        _check(runner)
    message = str(refused.value)
    assert isinstance(refused.value, ValueError)
    for names in ("--max-total-tokens 200,000", f"{200_001 * per_token:,} bytes", f"{per_token:,} bytes a token",
                  f"{available:,} bytes", f"{FREE_AFTER_WEIGHTS:,} bytes", f"{reserved:,} bytes",
                  f"lower --max-total-tokens to at most {fitting:,}", "--kv-cache-dtype fp8",
                  f"drop --disable-mla (the latent cache takes {latent:,} bytes a token)", "--tp-size"):
        assert names in message, (names, message)
    # more than all the free memory: no --mem-fraction-static can fit it
    assert "raise --mem-fraction-static" not in message
    # the size it names fits, one token more does not
    runner.max_total_tokens = fitting
    _check(runner)
    runner.max_total_tokens = fitting + 1
    with pytest.raises(KVPoolTooLarge):
        _check(runner)


def test_latent_pool_of_the_same_200k_tokens_fits():
    _check(_unallocated_runner(200_000))  # 31,104 bytes a token: 6.2 GB


def test_fp8_pool_holds_what_the_bf16_one_cannot():
    runner = _unallocated_runner(200_000, disable_mla=True)
    with pytest.raises(KVPoolTooLarge):
        _check(runner, torch.bfloat16)
    _check(runner, torch.float8_e5m2)  # half the bytes: 27.6 GB of the 40.3 available


def test_a_pool_inside_the_free_memory_but_over_the_reserve_names_the_fraction_that_fits():
    gib = 2**30
    with pytest.raises(KVPoolTooLarge) as refused:
        check_kv_pool_fits(10_000, 30 * gib, 3 * gib, 40 * gib, 12 * gib, 9_000, mem_fraction_static=0.85,
                           capacity_bytes=80 * gib, kv_dtype=torch.float8_e4m3fn)
    message = str(refused.value)
    # 40 GiB free - 12 GiB kept = 28 GiB for a 30 GiB pool; fits when the reserve is 10 GiB: 1 - 10/80 = 0.875
    assert f"more than the {28 * gib:,} bytes (28.00 GiB) available" in message
    assert "raise --mem-fraction-static from 0.85 to at least 0.875" in message
    assert "lower --max-total-tokens to at most 9,000" in message
    assert "--kv-cache-dtype" not in message  # already one byte a value
    check_kv_pool_fits(10_000, 28 * gib, 3 * gib, 40 * gib, 12 * gib, 9_000)  # exactly what is available: no error


def test_the_runtimes_own_smallest_pool_needs_only_the_free_memory():
    with pytest.raises(KVPoolTooLarge) as refused:
        check_kv_pool_fits(1024, 2_000_000_000, 2_000_000, 1_500_000_000, 0, 749, requested=False)
    message = str(refused.value)
    assert message.startswith("the smallest KV pool braid sizes on its own (1,024 tokens) needs a KV pool of "
                              "2,000,000,000 bytes")
    assert "1,500,000,000 bytes (1.40 GiB) free on cuda after the weights. To fit: ask for a smaller pool with " \
           "--max-total-tokens (at most 749 fit)" in message
    with pytest.raises(KVPoolTooLarge, match="To fit: free memory that other processes hold"):
        check_kv_pool_fits(1024, 2_000_000_000, 2_000_000, 1_500_000_000, 0, 0, requested=False)
    check_kv_pool_fits(1024, 1_500_000_000, 2_000_000, 1_500_000_000, 0, 749, requested=False)
