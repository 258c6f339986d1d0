"""Every Triton launch of a decode step names every parameter of its kernel: none is left to a signature default.

Inductor launches a Triton kernel called inside a torch.compile region (--enable-torch-compile) with what the call
passes and what the autotune configs set, nothing else: a constexpr left to its default is missing from the launcher
it generates (`TypeError: launcher() missing 1 required positional argument: 'PERSISTENT'`, the batch-1 GEMV's, on
torch 2.11 / Triton 3.6). Inductor runs no user-defined Triton kernel on the CPU, so this checks the rule it needs
instead: decode steps of tiny models take the GPU dispatch path under TRITON_INTERPRET=1 (the harness of
benchmarks/gpu/gemma2_decode_launches.py), and each launch's arguments, after the autotuner's config and the
heuristics are added (what reaches InterpretedFunction.run), must cover the kernel's parameters.
"""

import collections
import importlib
import importlib.util
import inspect
import os
import pkgutil
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu" / "gemma2_decode_launches.py"
RUNTIME = Path(__file__).resolve().parents[2] / "runtime"
KERNEL_PACKAGES = ("layers", "lora")  # runtime's packages that define Triton kernels

TINY = {"max_position_embeddings": 512, "vocab_size": 512, "tie_word_embeddings": False, "bos_token_id": 1,
        "eos_token_id": 2, "torch_dtype": "bfloat16", "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
        "hidden_size": 64, "intermediate_size": 128}
LLAMA = dict(TINY, architectures=["LlamaForCausalLM"], model_type="llama", num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2)
# MLA (latent 32 + rope 16) and MoE (8 experts, top 2, one shared) after one dense layer
DEEPSEEK_V2 = dict(TINY, architectures=["DeepseekV2ForCausalLM"], model_type="deepseek_v2", num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=4, moe_intermediate_size=32, n_routed_experts=8,
                   n_shared_experts=1, num_experts_per_tok=2, first_k_dense_replace=1, kv_lora_rank=32,
                   q_lora_rank=None, qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=16, topk_method="greedy",
                   n_group=1, topk_group=1)

# (config name, batch) -> kernels that decode step must launch, so the check covers the paths it names
CASES = {
    ("llama", 1): {"_gemv_kernel", "_gemv_rotary_store_kernel", "_decode_stage1_kernel"},
    ("llama", 4): {"_small_batch_tc_kernel", "_decode_stage1_kernel"},
    ("gemma2", 1): {"_gemv_kernel", "_post_norm_add_norm_kernel"},
    ("deepseek_v2", 1): {"_gemv_kernel", "_silu_mul_gemv_kernel", "_weighted_down_gemv_kernel",
                         "_router_small_batch_kernel", "_grouped_gemm_kernel", "_mla_decode_prepare_kernel",
                         "_latent_to_values_kernel"},
}


def _harness():
    spec = importlib.util.spec_from_file_location("gemma2_decode_launches", SCRIPT)
    harness = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(harness)
    return harness


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                    reason="runs the GPU dispatch path under the interpreter")
@pytest.mark.parametrize("family,batch", list(CASES))
def test_decode_launches_pass_every_kernel_parameter(family, batch, monkeypatch):
    from triton.runtime.interpreter import InterpretedFunction

    from braid.runtime.layers import small_batch_gemm

    harness = _harness()
    config = {"llama": LLAMA, "gemma2": harness.TINY_GEMMA2, "deepseek_v2": DEEPSEEK_V2}[family]
    # the 2..16-row tensor-core GEMM runs where a tile was measured faster than cuBLAS on that GPU; here, everywhere
    monkeypatch.setattr(small_batch_gemm, "measured_tile", lambda *a: small_batch_gemm.DEFAULT_TILE)
    launched, left_to_default = collections.Counter(), collections.defaultdict(set)
    run = InterpretedFunction.run

    def recorded(self, *args, **kwargs):
        params = list(inspect.signature(self.fn).parameters)
        launched[self.fn.__name__] += 1
        left_to_default[self.fn.__name__].update(set(params) - set(params[:len(args)]) - set(kwargs))
        return run(self, *args, **kwargs)

    monkeypatch.setattr(InterpretedFunction, "run", recorded)
    harness.count_decode_step(config, context=20, batch=batch)
    assert CASES[family, batch] <= set(launched), sorted(launched)
    assert {name: sorted(p) for name, p in left_to_default.items() if p} == {}


def test_no_triton_kernel_of_the_layers_declares_a_default():
    """The launches the decode steps above do not reach (fp8, extend, sampling, LoRA kernels) are held to the same
    rule by their signatures: a parameter without a default cannot be left out at any launch site."""
    from triton.runtime.jit import KernelInterface

    found, defaults = {}, {}
    infos = [info for package in KERNEL_PACKAGES
             for info in pkgutil.walk_packages(importlib.import_module(f"braid.runtime.{package}").__path__,
                                               f"braid.runtime.{package}.")]
    for info in infos:
        if info.name.endswith(".flashinfer_backend") and importlib.util.find_spec("flashinfer") is None:
            continue  # launches flashinfer's kernels, defines none
        module = importlib.import_module(info.name)
        for obj in vars(module).values():
            fn = obj
            while isinstance(fn, KernelInterface):  # Autotuner -> Heuristics -> JIT / interpreted function
                fn = fn.fn
            if fn is obj or getattr(fn, "__module__", None) != info.name:
                continue
            found.setdefault(info.name, set()).add(fn.__name__)
            declared = [p.name for p in inspect.signature(fn).parameters.values() if p.default is not p.empty]
            if declared:
                defaults[f"{info.name}.{fn.__name__}"] = declared
    defining = {"braid.runtime." + ".".join(path.relative_to(RUNTIME).with_suffix("").parts)
                for package in KERNEL_PACKAGES for path in (RUNTIME / package).rglob("*.py")
                if "@triton.jit" in path.read_text()}
    assert defining and defining <= set(found), sorted(defining - set(found))
    assert "_gemv_kernel" in found["braid.runtime.layers.gemv"]
    assert "_sgmv_expand_kernel" in found["braid.runtime.lora.sgmv_kernels"]
    assert defaults == {}
