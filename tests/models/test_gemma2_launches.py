"""Kernel launches of a Gemma-2 decode step at batch 1 on the GPU dispatch path (counted under TRITON_INTERPRET=1 by
benchmarks/gpu/gemma2_decode_launches.py on a tiny config): a layer launches what a Llama layer does (norm, qkv
GEMV with rotary and the KV store in its epilogue, two attention stages, o GEMV, norm, gate_up GEMV with the
activation fused, down GEMV),
the sandwich norms fused in pairs and GELU-tanh inside the GEMV; window layers add nothing per layer (the hybrid KV
pool translates a pass's new slots once, which the last test checks for staleness)."""

import collections
import importlib.util
import os
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu" / "gemma2_decode_launches.py"


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="counts launches under the Triton interpreter")
def test_gemma2_decode_layer_launches_as_many_kernels_as_a_llama_layer():
    spec = importlib.util.spec_from_file_location("gemma2_decode_launches", SCRIPT)
    harness = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(harness)
    counter = harness.count_decode_step()
    per_layer = collections.defaultdict(collections.Counter)
    for scope, name in counter.launches:
        per_layer[scope][name] += 1
    layers = harness.TINY_GEMMA2["num_hidden_layers"]
    for i in range(1, layers - 1):  # the first has no previous post-norm, the last also runs the final norm
        names = per_layer[f"layer {i}"]
        assert names["triton._post_norm_add_norm_kernel"] == 2, (i, names)
        assert names["triton._gemv_kernel"] == 3 and names["triton._gemv_rotary_store_kernel"] == 1, (i, names)
        assert names["triton._decode_stage1_kernel"] == 1, (i, names)
        assert not {"triton._act_and_mul_kernel", "triton._rmsnorm_kernel", "triton._rotary_kernel"} & set(names), names
        assert sum(names.values()) == 8, (i, sorted(names.items()))
    assert sum(per_layer[f"layer {layers - 1}"].values()) == 9  # + the last post-norm fused with the final norm


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="runs the GPU dispatch path under the interpreter")
def test_qkv_epilogue_decodes_the_tokens_of_the_separate_rotary_store():
    """The batch-1 qkv GEMV with rotary and the KV store as its epilogue, through window and global layers of the
    hybrid pool over 3 decode steps (40 tokens in, window 16; each step reads the KV the steps before it wrote), gives the
    tokens of the GEMV then the rotary + store kernel."""
    spec = importlib.util.spec_from_file_location("gemma2_decode_launches", SCRIPT)
    harness = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(harness)
    runs = {off: harness.count_decode_step(decode_steps=3, qkv_epilogue=not off) for off in (False, True)}
    names = {off: {name for _, name in run.launches} for off, run in runs.items()}
    assert "triton._gemv_rotary_store_kernel" in names[False] and "triton._rotary_kernel" not in names[False]
    assert "triton._rotary_kernel" in names[True] and "triton._gemv_rotary_store_kernel" not in names[True]
    assert len(runs[False].output_ids[0]) == 4 and runs[False].output_ids == runs[True].output_ids


def test_window_slots_of_a_pass_are_translated_once_and_never_stale():
    """The hybrid pool reuses a pass's translated window slots for every window layer while it is given the same,
    unchanged out_cache_loc; an in-place change of the slots or of the slot map (a new allocation) retranslates."""
    import torch

    from braid.runtime.mem_cache.window_pool import HybridKVPool

    pool = HybridKVPool(64, 32, torch.float32, 2, 8, [16, None, 16], "cpu")
    loc = pool.alloc(5)
    window_pool = pool.window_pool
    want = pool.full_to_window[loc].long()
    translated = pool.translate_batch_slots(loc)
    assert torch.equal(translated, want) and pool._translated(window_pool, loc) is translated
    assert pool._translated(pool.full_pool, loc) is loc  # global layers use the full slots themselves
    assert pool._translated(window_pool, loc.clone()) is not translated  # another tensor: its own gather
    loc[0] = loc[1]  # changed in place: retranslated
    assert torch.equal(pool._translated(window_pool, loc), pool.full_to_window[loc].long())
    loc = pool.alloc(3)
    pool.translate_batch_slots(loc)
    pool.alloc(2)  # the slot map changed since
    got = pool._translated(window_pool, loc)
    assert got is not pool._batch_window_loc[2] and torch.equal(got, pool.full_to_window[loc].long())
    static = torch.full((8,), -5, dtype=torch.int64)  # CUDA graphs: a static buffer the captured layers read
    view = pool.translate_batch_slots(loc, out=static)
    assert view.data_ptr() == static.data_ptr() and torch.equal(static[:3], pool.full_to_window[loc].long())
    assert (static[3:] == -5).all() and pool._translated(window_pool, loc) is view
