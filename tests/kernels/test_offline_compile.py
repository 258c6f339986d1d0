"""The decode path's batch-1 kernels compile for Hopper (sm_90) on a machine without a GPU: triton.compile with a
GPUTarget runs Triton's front end, its passes and ptxas, which the interpreter (the other kernel tests here, on CPU)
does not: a runtime branch whose variables differ in type, or a form only the interpreter accepts, fails here
instead of in the first decode step on a GPU. Each case compiles the kernel with PDL, at Llama-3-8B's shapes, with
and without the LoRA epilogue where it has one. The suite decorates kernels for the interpreter on a machine
without CUDA (conftest.py), so the compiles run in a child process without TRITON_INTERPRET (this file as a
script), which prints what the tests check as JSON.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys

HOPPER = ("cuda", 90, 32)
LORA_ARGS = {"lh_ptr": "*fp32", "lb_ptr": "*bf16", "lscale_ptr": "*bf16", "lidx_ptr": "*i64", "L_R": "i32",
             "L_P": "i32", "L_S": "i32", "l_stride_hp": "i32", "l_stride_bn": "i32", "l_stride_bo": "i32",
             "l_off1": "i32", "l_off2": "i32"}


def compile_for_hopper(fn, args: dict, constexprs: dict):
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    signature = dict(args, **{name: "constexpr" for name in constexprs})
    return triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constexprs), target=GPUTarget(*HOPPER))


def instructions(kernel) -> int:
    """PTX instruction lines (declarations, comments and debug sections left out)."""
    ptx = kernel.asm["ptx"].split("\t.section\t.debug")[0]
    return sum(1 for line in ptx.splitlines()
               if line.strip() and not line.strip().startswith(("//", ".", "{", "}", "$")) and "param" not in line)


def gemv_kernel(lora: bool, silu: bool):
    from braid.runtime.layers import gemv
    args = {"x_ptr": "*bf16", "w_ptr": "*bf16", "w_scale_ptr": "*bf16", "y_ptr": "*bf16", "N": "i32", "K": "i32",
            "w_row_stride": "i32", "num_programs": "i32", **LORA_ARGS}
    consts = dict(SILU_MUL=silu, GELU_GATE=False, W_SCALED=False, EVEN_K=True, USE_PDL=True, LORA=lora,
                  L_BLOCK_R=16, L_BLOCK_P=16 if lora else 1, BLOCK_N=4, BLOCK_K=1024, PERSISTENT=False)
    return compile_for_hopper(gemv._gemv_kernel, args, consts)


def rotary_store_kernel(lora: bool):
    from braid.runtime.layers import gemv
    args = {"x_ptr": "*bf16", "w_ptr": "*bf16", "q_ptr": "*bf16", "pos_ptr": "*i64", "cos_sin_ptr": "*fp32",
            "cos_sin_stride": "i32", "loc_ptr": "*i64", "k_cache_ptr": "*bf16", "v_cache_ptr": "*bf16",
            "k_cache_stride": "i32", "v_cache_stride": "i32", "K": "i32", "w_row_stride": "i32", **LORA_ARGS}
    consts = dict(NUM_Q_HEADS=32, NUM_KV_HEADS=8, HEAD_DIM=128, V_WIDTH=1024, EVEN_K=True, USE_PDL=True, LORA=lora,
                  L_BLOCK_R=16, L_BLOCK_P=16 if lora else 1, BLOCK_N=4, BLOCK_K=1024)
    return compile_for_hopper(gemv._gemv_rotary_store_kernel, args, consts)


def lora_and_activation_kernels():
    from braid.runtime.layers import activation_kernels
    from braid.runtime.lora import bgmv_kernels

    shrink = compile_for_hopper(
        bgmv_kernels._bgmv_shrink_kernel,
        {"x_ptr": "*bf16", "a_ptr": "*bf16", "idx_ptr": "*i64", "h_ptr": "*fp32", "K": "i32", "RT": "i32",
         "k_per_split": "i32", "stride_xt": "i32", "stride_an": "i32", "stride_ar": "i32", "stride_hp": "i32",
         "stride_ht": "i32"},
        dict(BLOCK_R=64, BLOCK_K=256, USE_PDL=True))
    expand = compile_for_hopper(
        bgmv_kernels._bgmv_expand_kernel,
        {"y_ptr": "*bf16", "h_ptr": "*fp32", "b0_ptr": "*bf16", "b1_ptr": "*bf16", "b2_ptr": "*bf16",
         "scale_ptr": "*bf16", "idx_ptr": "*i64", "OUT": "i32", "R": "i32", "P": "i32", "out0": "i32", "out1": "i32",
         "out2": "i32", "stride_yt": "i32", "stride_hp": "i32", "stride_ht": "i32", "stride_b0n": "i32",
         "stride_b0o": "i32", "stride_b1n": "i32", "stride_b1o": "i32", "stride_b2n": "i32", "stride_b2o": "i32"},
        dict(S=3, BLOCK_N=128, BLOCK_R=16, USE_PDL=True))
    act = compile_for_hopper(
        activation_kernels._act_and_mul_kernel,
        {"x_ptr": "*bf16", "out_ptr": "*bf16", "x_stride": "i32", "out_stride": "i32", "I": "i32"},
        dict(BLOCK=1024, ACT=0, USE_PDL=True))
    return {"bgmv_shrink": shrink, "bgmv_expand": expand, "act_and_mul": act}


def report() -> dict:
    """name -> {"instructions": n, "pdl": the PTX has griddepcontrol, "error": the compile's error or absent}."""
    builds = {f"gemv lora={lora} silu={silu}": functools.partial(gemv_kernel, lora, silu)
              for lora in (False, True) for silu in (False, True)}
    builds.update({f"rotary_store lora={lora}": functools.partial(rotary_store_kernel, lora) for lora in (False, True)})
    out = {}
    for name, build in builds.items():
        try:
            kernel = build()
            out[name] = {"instructions": instructions(kernel), "pdl": "griddepcontrol" in kernel.asm["ptx"]}
        except Exception as e:  # reported, the test names it
            out[name] = {"error": f"{type(e).__name__}: {str(e)[-600:]}"}
    try:
        for name, kernel in lora_and_activation_kernels().items():
            out[name] = {"instructions": instructions(kernel), "pdl": "griddepcontrol" in kernel.asm["ptx"]}
    except Exception as e:
        out["lora and activation kernels"] = {"error": f"{type(e).__name__}: {str(e)[-600:]}"}
    return out


@functools.lru_cache(maxsize=1)
def compiled() -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_every_kernel_compiles_for_hopper():
    failed = {name: r["error"] for name, r in compiled().items() if "error" in r}
    assert not failed, failed


def test_the_lora_epilogue_adds_code_only_where_it_is_on():
    r = compiled()
    for kind in ("gemv lora={} silu=False", "gemv lora={} silu=True", "rotary_store lora={}"):
        assert r[kind.format(True)]["instructions"] > r[kind.format(False)]["instructions"], kind


def test_decode_kernels_carry_the_pdl_wait():
    r = compiled()
    for name in ("gemv lora=False silu=False", "rotary_store lora=True", "bgmv_shrink", "bgmv_expand", "act_and_mul"):
        assert r[name]["pdl"], name


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(__file__))
    print(json.dumps(report()))
