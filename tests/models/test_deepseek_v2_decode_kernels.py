"""How many GPU kernels one DeepSeek-V2 decode step launches, per layer and by kind, counted on CPU.

At batch 1 a V2-Lite decode step is bound by its kernel count as much as by its 4.9 GB of weights, so the count is
pinned here. The step runs a tiny V2-Lite-shaped config (no q_lora, 2 shared experts, first layer dense) through the
CUDA decode path on CPU: `torch.Tensor.is_cuda` reads True inside `cuda_path()` so that every `x.is_cuda` branch
takes its GPU kernels, which run under TRITON_INTERPRET=1. Each Triton launch (the interpreter's
InterpretedFunction.run) counts as one kernel of its name; each PyTorch op that launches a kernel on CUDA (all but
views, allocations and metadata) as one of its ATen name; a host sync fails the test.

  python tests/models/test_deepseek_v2_decode_kernels.py   # prints the per-layer table
"""

from __future__ import annotations

import collections
import contextlib
import json
import os
import sys

if __name__ == "__main__":  # before the kernel modules are imported; under pytest tests/conftest.py sets it
    os.environ.setdefault("TRITON_INTERPRET", "1")  # (never at collection: the GPU tier imports this module too)

import pytest  # noqa: E402
import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from braid.runtime.config import ServerArgs  # noqa: E402

# ops that launch no kernel on CUDA: views, allocations without a fill, metadata
NO_KERNEL_OPS = {
    "view", "_unsafe_view", "t", "transpose", "permute", "expand", "slice", "select", "split", "split_with_sizes",
    "unbind", "as_strided", "alias", "detach", "unsqueeze", "squeeze", "_reshape_alias", "empty", "empty_strided",
    "empty_like", "new_empty", "new_empty_strided", "lift_fresh", "is_same_size", "sym_size", "sym_stride",
    "sym_numel", "sym_storage_offset", "_has_compatible_shallow_copy_type", "set_", "resize_",
}
# ops that return their input itself when no conversion or copy is needed (then no kernel)
MAYBE_ALIAS_OPS = {"reshape", "to", "contiguous", "flatten", "view_as", "reshape_as", "type_as", "float"}
HOST_SYNC_OPS = {"_local_scalar_dense", "item", "nonzero", "_assert_async", "equal", "is_nonzero"}

TINY_V2_LITE = {
    "architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2", "hidden_size": 64,
    "intermediate_size": 96, "moe_intermediate_size": 32, "num_hidden_layers": 3, "num_attention_heads": 4,
    "num_key_value_heads": 4, "kv_lora_rank": 32, "q_lora_rank": None, "qk_nope_head_dim": 16,
    "qk_rope_head_dim": 8, "v_head_dim": 16, "n_routed_experts": 16, "n_shared_experts": 2, "num_experts_per_tok": 6,
    "first_k_dense_replace": 1, "moe_layer_freq": 1, "topk_method": "greedy", "n_group": 1, "topk_group": 1,
    "norm_topk_prob": False, "routed_scaling_factor": 1.0, "scoring_func": "softmax", "hidden_act": "silu",
    "rms_norm_eps": 1e-6, "rope_theta": 10000, "max_position_embeddings": 256,
    "rope_scaling": {"type": "yarn", "factor": 4, "original_max_position_embeddings": 64, "beta_fast": 32,
                     "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 0.707},
    "attention_bias": False, "vocab_size": 512, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
}


def _same_storage(a, b) -> bool:
    return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)
            and a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr())


class KernelCounter(TorchDispatchMode):
    """Counts kernels by (section, kind); `section` is set by the layer hooks."""

    def __init__(self):
        super().__init__()
        self.section = "embed+final_norm"
        self.counts: collections.Counter = collections.Counter()
        self.host_syncs: list[str] = []
        self._in_triton = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        out = func(*args, **(kwargs or {}))
        if not self._in_triton:  # the interpreter's own host copies are no kernels
            if name in HOST_SYNC_OPS:
                self.host_syncs.append(f"{self.section}: {name}")
            elif name in MAYBE_ALIAS_OPS and _same_storage(out, args[0]):
                pass
            elif name not in NO_KERNEL_OPS:
                self.counts[(self.section, f"torch {name}")] += 1
        return out

    @contextlib.contextmanager
    def counting_triton(self):
        from triton.runtime.interpreter import InterpretedFunction

        original = InterpretedFunction.run
        counter = self

        def run(fn_self, *args, **kwargs):
            if not kwargs.get("warmup"):
                counter.counts[(counter.section, f"triton {fn_self.fn.__name__}")] += 1
            counter._in_triton += 1
            try:
                return original(fn_self, *args, **kwargs)
            finally:
                counter._in_triton -= 1

        InterpretedFunction.run = run
        try:
            yield
        finally:
            InterpretedFunction.run = original

    def per_section(self) -> dict[str, collections.Counter]:
        out: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
        for (section, kind), n in self.counts.items():
            out[section][kind] += n
        return out


@contextlib.contextmanager
def cuda_path(monkeypatch_pools=True):
    """Inside: every tensor reports is_cuda, and the KV pools take their Triton store kernels."""
    from braid.runtime.mem_cache import pools

    original_run_on = pools._triton_kernels_run_on
    torch.Tensor.is_cuda = property(lambda self: True)
    if monkeypatch_pools:
        pools._triton_kernels_run_on = lambda device: True
    try:
        yield
    finally:
        del torch.Tensor.is_cuda
        pools._triton_kernels_run_on = original_run_on


def tiny_runner(**config_overrides):
    from braid.runtime.layers.attention.triton_backend import TritonAttnBackend
    from braid.runtime.mem_cache import pools
    from braid.runtime.model_executor.model_runner import ModelRunner

    cfg = {**TINY_V2_LITE, **config_overrides}
    args = ServerArgs(model_path="dsv2-tiny-dummy", load_format="dummy", model_config=json.dumps(cfg), device="cpu",
                      dtype="bfloat16", max_total_tokens=1024, max_running_requests=8, log_level="warning")
    original_run_on = pools._triton_kernels_run_on
    pools._triton_kernels_run_on = lambda device: True  # the pool picks its Triton stores when it is built
    try:
        runner = ModelRunner(args)
    finally:
        pools._triton_kernels_run_on = original_run_on
    runner.attn_backend = TritonAttnBackend(runner, num_kv_splits=2)
    return runner


def count_decode_step(runner, batch: int = 1, context: int = 9) -> tuple[KernelCounter, torch.Tensor]:
    """Prefills `batch` requests of `context` tokens, then counts the kernels of one decode step (model + LM head;
    the attention metadata, prepared outside the CUDA graph, is not counted). -> (counter, the step's logits, and
    the same step's logits through the CPU path)."""
    from test_deepseek_v2_parity import Driver

    driver = Driver(runner)
    gen = torch.Generator().manual_seed(0)
    rows = [runner.req_to_token_pool.alloc() for _ in range(batch)]
    for row in rows:
        driver.extend(row, torch.randint(0, 512, (context,), generator=gen).tolist(), 0)
    fb = driver.decode_batch(rows, torch.randint(0, 512, (batch,), generator=gen).tolist(), [context] * batch)
    fb.req_to_token_pool, fb.kv_pool, fb.attn_backend = (runner.req_to_token_pool, runner.kv_pool,
                                                                  runner.attn_backend)
    counter = KernelCounter()
    model = runner.model
    hooks = []
    for i, layer in enumerate(model.model.layers):
        kind = "moe" if type(layer.mlp).__name__ == "FusedMoE" else "dense"

        def enter(module, inputs, label=f"layer {i} ({kind})"):
            counter.section = label

        def leave(module, inputs, output):
            counter.section = "embed+final_norm"

        hooks += [layer.register_forward_pre_hook(enter), layer.register_forward_hook(leave)]
    try:
        with torch.inference_mode():
            runner.attn_backend.init_forward_metadata(fb)
            with cuda_path():  # a warm-up pass first, as before CUDA-graph capture (one-time allocations)
                model.lm_head(model(fb))
            with cuda_path(), counter.counting_triton(), counter:
                hidden = model(fb)
                counter.section = "lm_head"
                logits = model.lm_head(hidden)
    finally:
        for h in hooks:
            h.remove()
    with torch.inference_mode():  # the same step again (it rewrites the same cache rows) on the CPU path
        cpu_logits = model.lm_head(model(fb))
    return counter, logits.float(), cpu_logits.float()


def format_table(counter: KernelCounter) -> str:
    sections = counter.per_section()
    lines = []
    for section, kinds in sections.items():
        lines.append(f"{section}: {sum(kinds.values())} kernels")
        for kind, n in sorted(kinds.items(), key=lambda kv: (-kv[1], kv[0])):
            lines.append(f"    {n:3d}  {kind}")
    moe = [sum(k.values()) for s, k in sections.items() if "(moe)" in s]
    dense = [sum(k.values()) for s, k in sections.items() if "(dense)" in s]
    other = sum(sum(k.values()) for s, k in sections.items() if "layer" not in s)
    # DeepSeek-V2-Lite: 27 layers, the first dense
    lines.append(f"V2-Lite decode step: 1 x {dense[0]} (dense) + 26 x {moe[0]} (moe) + {other} = "
                 f"{dense[0] + 26 * moe[0] + other} kernels")
    if counter.host_syncs:
        lines.append(f"HOST SYNCS: {counter.host_syncs}")
    return "\n".join(lines)


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="counts launches under the Triton interpreter")
@pytest.mark.parametrize("batch", [1, 4])
def test_decode_step_kernel_count(batch):
    """Per MoE layer at batch <= 8: the attention's 7 launches (input norm, qkv GEMV, the latent store + q_nope x
    w_kc query build, two split-KV stages, x w_vc, o_proj; all Triton, no cuBLAS or copy) and 3 for the MoE
    (post-attention add-RMSNorm + router, gate_up, weighted down; shared experts inside). Same logits as the CPU path
    (bf16 rounding apart)."""
    counter, logits, cpu_logits = count_decode_step(tiny_runner(), batch=batch)
    print(format_table(counter))
    assert not counter.host_syncs, counter.host_syncs  # a CUDA graph captures no host sync
    sections = counter.per_section()
    moe_layers = [kinds for section, kinds in sections.items() if "(moe)" in section]
    assert len(moe_layers) == 2 and moe_layers[0] == moe_layers[1]
    moe = moe_layers[0]
    for kernel in ("_router_small_batch_kernel", "_silu_mul_gemv_kernel", "_weighted_down_gemv_kernel",
                   "_mla_decode_prepare_kernel", "_latent_to_values_kernel", "_rmsnorm_kernel"):
        assert moe[f"triton {kernel}"] == 1, moe
    # batch 1: the projections are Triton GEMVs too; above it cuBLAS matmuls (qkv, o_proj)
    assert [kind for kind in moe if kind.startswith("torch")] == ([] if batch == 1 else ["torch linear"]), moe
    assert sum(moe.values()) == 10, moe
    assert ((logits - cpu_logits).norm() / cpu_logits.norm()).item() < 2e-2


if __name__ == "__main__":
    for b in (1, 4):
        print(f"=== batch {b}")
        print(format_table(count_decode_step(tiny_runner(), batch=b)[0]))
    sys.exit(0)
