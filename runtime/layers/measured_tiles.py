"""Launch configs measured fastest per GPU and weight shape: plain data, read by the kernel modules that launch them.

Each table maps a GPU name (torch.cuda.get_device_name()) to {shape key: entry}; a shape (or GPU) not listed falls back
to the kernel module's own choice (its autotuner or default tile). The kernel modules build their config objects from
these entries at import; nothing here imports them (measured data sits below the kernels in the import graph). Each
table names the benchmark under benchmarks/gpu/ that produced it; the runs, their figures and the A/Bs that kept or
replaced an entry are in docs/benchmark_history.md.

- GEMV_CONFIGS (gemv.py, the batch-1 GEMV on bf16/fp16 weights): {(weight rows, K, fused activation "" / "silu" /
  "gelu"): (BLOCK_N, BLOCK_K, num_warps, num_stages[, PROGRAMS: a persistent grid of that many programs])}. From
  benchmarks/gpu/gemv_shape_sweep.py (every layer's weight of the shape chained in one CUDA graph with PDL, as in a
  decode step); history: H200 session 10 ("batch-1 GEMV per shape, Gemma-2-9B", and the Llama-3-8B o_proj row of
  "batch-1 decode steps after the measured configs"). Triton's autotuner times one launch with L2 flushed, which
  misjudges the short GEMVs of the smaller projections.
- FP8_GEMV_CONFIGS (quantization/fp8_gemv.py, fp8_gemv at one row of x): {(weight rows, K, SiLU-and-mul fused):
  Fp8GemvConfig keywords}. From benchmarks/gpu/fp8_gemv_variants.py (all 32 layers' weights of a Llama-3-8B shape in
  one CUDA graph with PDL, every config checked within its error bound); history: H200 session 10 ("batch-1 fp8 GEMV
  per shape"). The H100 takes the H200's rows: benchmarks/gpu/fp8_gemv_table_ab.py measured them faster end to end
  there than both the first-call tuning and the H100 sweep's own winners (H100 session 19, "which fp8 GEMV table on
  the H100").
- FP8_SMALL_BATCH_CONFIGS (quantization/fp8_gemv.py, fp8_gemv at 2..16 rows of x): {(weight rows, K, SiLU-and-mul
  fused): Fp8GemvConfig keywords of a tensor-core variant}. The H200's tiles from benchmarks/gpu/fp8_small_batch_gemm.py
  (all 32 layers of a Llama-3-8B shape in one CUDA graph; H200 session 14); the H100's "tcq" tiles from the batch-8
  decode-step A/Bs of benchmarks/gpu/decode_step_ab.py (H100 session 23, "fp8 weights at 8 rows: tc against tcq" and
  "tcq tiles").
- SMALL_BATCH_TILES (small_batch_gemm.py, bf16/fp16 weights at 2..16 rows): {(weight rows, K, activation): (TcTile
  keywords, up to rows)}: the shapes on which a tile streamed faster than cuBLAS (with the activation as its own
  kernel after it) at every measured count of x rows from 2 up to `up to rows`. The dense Linear routes 2..up-to
  rows of these shapes to the tile; larger batches and every other shape stay on cuBLAS. From
  benchmarks/gpu/small_batch_gemm.py (its --write-table rewrites this table; --step times the decode step with and
  without the new rows); history: H100 sessions 16, 18 and 19, H200 sessions 21 and 22.
"""

GEMV_CONFIGS = {
    "NVIDIA H200": {
        (3584, 4096, ""): (2, 4096, 4, 1),  # Gemma-2-9B o_proj
        (28672, 3584, "gelu"): (4, 512, 8, 1),  # Gemma-2-9B gate_up + GELU-and-mul
        (4096, 4096, ""): (4, 2048, 4, 4),  # Llama-3-8B o_proj
    },
}

FP8_GEMV_CONFIGS = {
    "NVIDIA H200": {
        (6144, 4096, False): dict(variant="f16", block_n=4, block_k=2048, num_warps=4, num_stages=3, group=16),  # qkv
        (4096, 4096, False): dict(variant="f16", block_n=8, block_k=2048, num_warps=8, num_stages=3, group=16),  # o
        # gate_up + SiLU-and-mul
        (28672, 4096, True): dict(variant="f16", block_n=4, block_k=2048, num_warps=4, num_stages=3, group=16),
        (4096, 14336, False): dict(variant="f16", block_n=8, block_k=2048, num_warps=8, num_stages=3, group=16),  # down
    },
}
FP8_GEMV_CONFIGS["NVIDIA H100 80GB HBM3"] = FP8_GEMV_CONFIGS["NVIDIA H200"]

FP8_SMALL_BATCH_CONFIGS = {
    "NVIDIA H200": {
        (6144, 4096, False): dict(variant="tc", block_n=64, block_k=128, num_warps=4, num_stages=6, split_k=0),  # qkv
        (4096, 4096, False): dict(variant="tc", block_n=64, block_k=128, num_warps=4, num_stages=6, split_k=0),  # o
        # down
        (4096, 14336, False): dict(variant="tc", block_n=128, block_k=128, num_warps=4, num_stages=4, split_k=0),
    },
    # "tcq": x quantized per row by quantize_rows first, so that the kernel's weight loop holds no reduction
    "NVIDIA H100 80GB HBM3": {
        (6144, 4096, False): dict(variant="tcq", block_n=64, block_k=256, num_warps=4, num_stages=4, split_k=0),  # qkv
        (4096, 4096, False): dict(variant="tcq", block_n=64, block_k=256, num_warps=4, num_stages=4, split_k=0),  # o
        # down
        (4096, 14336, False): dict(variant="tcq", block_n=64, block_k=256, num_warps=4, num_stages=4, split_k=0),
        # gate_up + SiLU-and-mul
        (28672, 4096, True): dict(variant="tcq", block_n=64, block_k=256, num_warps=4, num_stages=4, split_k=0),
    },
}

# The H200's rows are Gemma-2-9B's: alone no tile beats cuBLAS clearly, but together in the batch-8 decode step at 8K
# these three do (they stream their first tiles during the kernel before); its qkv gains too little and stays on cuBLAS.
SMALL_BATCH_TILES = {
    "NVIDIA H100 80GB HBM3": {
        (3584, 14336, ""): (dict(block_n=64, block_k=128, num_warps=4, num_stages=4, split_k=0), 8),
        (28672, 3584, "gelu"): (dict(block_n=64, block_k=128, num_warps=4, num_stages=4, split_k=1), 8),
    },
    "NVIDIA H200": {
        (28672, 3584, "gelu"): (dict(block_n=64, block_k=128, num_warps=4, num_stages=4, split_k=1), 8),
        (3584, 14336, ""): (dict(block_n=64, block_k=128, num_warps=4, num_stages=4, split_k=0), 8),
        (3584, 4096, ""): (dict(block_n=64, block_k=128, num_warps=4, num_stages=4, split_k=0), 8),
    },
}
