# Speculative decoding's verification cost on a Llama-3-8B-shaped dummy bf16 model in one call
# (speculative_verify_cost.py): the card's copy rate, the non-speculative engine's greedy outputs and decode tok/s at
# batch 1 and 32, then NGRAM and EAGLE engines whose drafts replay those outputs at acceptance lengths 2, 3, 4
# (batch 1) and 3 (batch 32), and NGRAM with --speculative-disable-by-batch-size at batch 32; a markdown table last.
# Flags after the script name go to the .py (e.g. --variants ngram eagle).
# carry: .whl .gpu/tok
#   bash benchmarks/gpu/speculative_verify_cost.sh
set -o pipefail
source benchmarks/gpu/setup.sh
nvidia-smi -L
timeout 540 python3 benchmarks/gpu/speculative_verify_cost.py --tokenizer-path .gpu/tok \
  --out "$OUT/speculative_verify_cost.json" "$@" 2>&1 | tee "$OUT/speculative_verify_cost.log"
