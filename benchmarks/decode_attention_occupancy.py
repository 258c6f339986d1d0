"""Decode attention stage 1 compiled for sm90 on this machine (no GPU: Triton's compiler and its bundled ptxas), per
model shape and launch config: registers, spills, shared memory, how many programs an SM holds (the tighter of its
65,536 registers and 228 KB of shared memory, 1 KB of it reserved per program) and the waves a batch's grid makes on
an H200 / H100 (132 SMs).

  python benchmarks/decode_attention_occupancy.py [--shapes gemma2-9b llama3-8b llama3-8b-fp8] [--batch-sizes 1 8 64]
      [--splits 4 6 8 12 16 32] [--configs 64,4,2 32,4,3,ahead ...]   (",ahead": ROWS_AHEAD)

Run with TRITON_INTERPRET unset (the test suite sets it; interpreted kernels are not compiled).
"""

from __future__ import annotations

import argparse
import math
import os
import subprocess
import sys
import tempfile

REGISTERS_PER_SM = 65536
SHARED_BYTES_PER_SM = 228 * 1024
SHARED_BYTES_RESERVED_PER_PROGRAM = 1024
SMS = 132
# name: (query heads per KV head, KV heads, head dim, soft-cap, KV element type)
SHAPES = {
    "gemma2-9b": (2, 8, 256, True, "bf16"),
    "llama3-8b": (4, 8, 128, False, "bf16"),
    "llama3-8b-fp8": (4, 8, 128, False, "fp8e4nv"),
}
DEFAULT_CONFIGS = ["64,4,2", "64,2,2", "32,4,2", "32,2,2", "16,4,2", "64,8,2", "32,4,3,ahead", "64,2,3,ahead"]


def stage1_for_sm90(constants: dict, kv_type: str, num_warps: int, num_stages: int):
    """Decode stage 1 compiled for sm90 with `constants` (its tl.constexpr arguments; one head block of 16 query
    rows, no window, no soft-cap, no rope part, no ROWS_AHEAD, PDL on unless given) and K/V buffers of kv_type
    ("bf16", "fp8e4nv", "fp8e5") -> Triton's compiled kernel (.asm["cubin"], .metadata.shared)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from braid.runtime.layers.attention.triton_ops.decode_attention import _decode_stage1_kernel as fn

    constants = dict(dict(HEAD_BLOCKS=1, BLOCK_H=16, USE_CAP=False, USE_WINDOW=False, BLOCK_DPE=0, ROWS_AHEAD=False,
                          USE_PDL=True), **constants)
    pointers = dict(Q="*bf16", K_buf="*" + kv_type, V_buf="*" + kv_type, Req_to_token="*i32", B_req_idx="*i64",
                    B_seq_len="*i64", Att="*fp32")
    signature = {n: pointers.get(n, "fp32" if n in ("sm_scale", "logit_cap", "v_scale") else "i32")
                 for n in fn.arg_names}
    signature.update({n: "constexpr" for n in constants})
    # as the launcher specializes them: 16-byte aligned pointers, strides divisible by 16
    aligned = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in fn.arg_names
               if n in pointers or n.startswith("stride")}
    return triton.compile(ASTSource(fn, signature, constants, aligned), target=GPUTarget("cuda", 90, 32),
                          options=dict(num_warps=num_warps, num_stages=num_stages))


def run_on_cubin(kernel, tool: str, *args: str) -> str:
    """The stdout of Triton's bundled CUDA tool ("cuobjdump", "nvdisasm") run on a compiled kernel's cubin."""
    import triton

    path = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", tool)
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        return subprocess.run([path, *args, f.name], capture_output=True, text=True, check=True).stdout


def compile_stage1(shape: str, block_n: int, num_warps: int, num_stages: int, rows_ahead: bool = False) -> dict:
    """-> {"registers", "spill_bytes", "shared_bytes"} of stage 1 for sm90 at this shape and config."""
    import triton.language as tl

    group, _, head_dim, cap, kv_type = SHAPES[shape]
    fp8 = kv_type != "bf16"
    constants = dict(KV_GROUP=group, D=head_dim, DV=head_dim, BLOCK_D=head_dim, BLOCK_DV=head_dim, BLOCK_N=block_n,
                     USE_CAP=cap, DOT_DTYPE=tl.float16 if fp8 else tl.bfloat16, CLAMP_Q=fp8, STAGE_V=fp8,
                     ROWS_AHEAD=rows_ahead)
    kernel = stage1_for_sm90(constants, kv_type, num_warps, num_stages)
    # "... REG:254 STACK:0 SHARED:0 LOCAL:0 ..." (SHARED: static only; Triton's is dynamic, in its metadata)
    usage = run_on_cubin(kernel, "cuobjdump", "-res-usage")
    fields = dict(item.split(":", 1) for item in usage.split() if item[:4] in ("REG:", "STAC", "LOCA"))
    registers, spills = int(fields["REG"]), int(fields["LOCAL"])
    return {"registers": registers, "spill_bytes": spills, "shared_bytes": kernel.metadata.shared}


def programs_per_sm(registers: int, shared_bytes: int, num_warps: int) -> int:
    # registers are allocated per warp in multiples of 8 per thread
    by_registers = REGISTERS_PER_SM // (math.ceil(registers / 8) * 8 * 32 * num_warps)
    by_shared = SHARED_BYTES_PER_SM // (shared_bytes + SHARED_BYTES_RESERVED_PER_PROGRAM)
    return min(by_registers, by_shared, 64 // num_warps)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 64])
    p.add_argument("--splits", type=int, nargs="+", default=[4, 6, 8, 12, 16, 32])
    p.add_argument("--configs", nargs="+", default=DEFAULT_CONFIGS, help="BLOCK_N,num_warps,num_stages")
    args = p.parse_args()
    if os.environ.get("TRITON_INTERPRET") == "1":
        p.error("unset TRITON_INTERPRET: interpreted kernels are not compiled")
    import triton
    print(f"Triton {triton.__version__}, sm90")
    print("waves = batch x KV heads x splits / (programs per SM x %d SMs)" % SMS)
    print(f"{'shape':<14} {'config':<13} {'regs':>4} {'spill':>5} {'smem KB':>7} {'per SM':>6}  waves "
          + " ".join(f"b{b}" for b in args.batch_sizes) + " at splits " + ",".join(map(str, args.splits)))
    for shape in args.shapes:
        for text in args.configs:
            block_n, num_warps, num_stages = (int(v) for v in text.split(",")[:3])
            r = compile_stage1(shape, block_n, num_warps, num_stages, text.endswith(",ahead"))
            per_sm = programs_per_sm(r["registers"], r["shared_bytes"], num_warps)
            kv_heads = SHAPES[shape][1]
            waves = "  ".join(f"b{b}: " + "/".join(f"{b * kv_heads * s / (per_sm * SMS):.2f}" for s in args.splits)
                              for b in args.batch_sizes)
            print(f"{shape:<14} {text:<13} {r['registers']:>4} {r['spill_bytes']:>5} {r['shared_bytes'] / 1024:>7.1f} "
                  f"{per_sm:>6}  {waves}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
