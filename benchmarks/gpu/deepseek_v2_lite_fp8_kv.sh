# DeepSeek-V2-Lite-shaped dummy bf16, MLA (latent cache) with the KV cache in bf16, fp8_e5m2 and fp8_e4m3 (scale 1.0:
# dummy weights have no calibrated scales): the pool capacity at the default memory budget and bench_one_batch
# (128 in / 512 out) at batch 1, 64 and 256 (or the batch sizes given) with CUDA graphs, plus batch-1 greedy agreement with the bf16 cache.
# carry: .whl
#   bash benchmarks/gpu/deepseek_v2_lite_fp8_kv.sh [BATCH_SIZE...]   (default 1 64 256; ~7 min; 1 64: ~4 min)
set -o pipefail
source benchmarks/gpu/setup.sh
BATCH_SIZES=${*:-1 64 256}
GRAPH_MAX_BS=$(printf '%s\n' $BATCH_SIZES | sort -n | tail -1)  # graphs only up to the largest batch timed
nvidia-smi -L
COMMON="--load-format dummy --model-config benchmarks/configs/deepseek-v2-lite.json --model-path dsv2-lite-dummy \
  --dtype bfloat16 --context-length 4096 --cuda-graph-max-bs $GRAPH_MAX_BS --log-level warning --input-len 128 --output-len 512"
for kv in auto fp8_e5m2 fp8_e4m3; do
  echo "== kv cache $kv"
  # shellcheck disable=SC2086
  timeout 150 python3 benchmarks/gpu/deepseek_v2_lite_mla.py $COMMON --kv-cache-dtype $kv --batch-size $BATCH_SIZES \
    --result-filename "$OUT/dsv2_lite_fp8_kv.jsonl" 2>&1 | grep -v Warning | tee "$OUT/kv_$kv.log" \
    || echo "FAIL kv $kv run (exit $?; a timeout is 124; see $OUT/kv_$kv.log)"
done

echo "== summary"
python3 - "$OUT/dsv2_lite_fp8_kv.jsonl" <<'EOF'
import json, sys
setups, runs = {}, {}
try:
    for line in open(sys.argv[1]):
        d = json.loads(line)
        if d["kind"] == "setup":
            setups[d["kv_cache_dtype"]] = d
        else:
            runs.setdefault(d["kv_cache_dtype"], {})[d["batch_size"]] = d
except FileNotFoundError:
    pass
for kv, d in setups.items():
    print(f"{kv}: KV pool {d['kv_pool_tokens']:,} tokens x {d['kv_bytes_per_token']:,} B ({d['kv_pool_gib']:.1f} GiB)")
sizes = sorted(set().union(*[set(v) for v in runs.values()])) if runs else []
print(f"{'kv cache':<16}" + "".join(f"{'bs ' + str(bs) + ' tok/s':>16}" for bs in sizes))
for kv, by_bs in runs.items():
    print(f"{kv:<16}" + "".join(f"{by_bs[bs]['decode_throughput']:>16.1f}" if bs in by_bs else f"{'-':>16}"
                                for bs in sizes))
ref = runs.get("bfloat16", {}).get(1, {}).get("output_ids")
for kv in ("float8_e5m2", "float8_e4m3fn"):
    if kv not in setups:
        print(f"FAIL {kv}: no result")
        continue
    got = runs.get(kv, {}).get(1, {}).get("output_ids")
    if ref and got:
        same = next((i for i, (s, t) in enumerate(zip(ref, got)) if s != t), min(len(ref), len(got)))
        print(f"info: {kv} batch-1 greedy tokens equal to the bf16 cache's for the first {same} of {len(ref)} "
              "(random weights: near-ties flip early)")
    base = runs.get("bfloat16", {}).get(max(sizes, default=1))
    this = runs.get(kv, {}).get(max(sizes, default=1))
    if base and this:
        print(f"{kv} at batch {max(sizes)}: {this['decode_throughput'] / base['decode_throughput']:.2f}x the bf16 "
              "cache's decode tok/s")
EOF
