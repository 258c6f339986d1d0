# NGRAM speculation on the GPU with SmolLM2's real weights (benchmarks/speculative_ngram.py): speculation off vs on
# at batch 1, greedy, in fp32 and bf16 (decode graphs to 8 rows, extend graphs to 64 tokens); whether the outputs
# agree token for token, the mean acceptance length, ms per token. The GGUF travels in two halves over two calls on the same warm machine (setup.sh):
#   bash benchmarks/gpu/speculative_ngram.sh stage   carry .gpu/a (part_aa): keeps the first half in /tmp
#   bash benchmarks/gpu/speculative_ngram.sh         carry .gpu/sw .gpu/b .gpu/tok
# .whl with .gpu/b is more than the 64 MiB a call carries: .gpu/sw holds the wheels this needs (from .whl: pydantic,
# pydantic_core, annotated_types, typing_inspection, typing_extensions, gguf, outlines_core, pyzmq, msgspec,
# llguidance); setup.sh then notes that .whl is absent.
set -o pipefail
if [ "$1" = stage ]; then cp .gpu/a/part_aa /tmp/part_aa && echo "first half kept in /tmp"; exit; fi
if compgen -G ".gpu/sw/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .gpu/sw/*.whl >/dev/null 2>&1
fi
source benchmarks/gpu/setup.sh
cat /tmp/part_aa .gpu/b/part_ab > /tmp/smollm2.gguf && echo "$(cat .gpu/tok/smollm2.sha256)  /tmp/smollm2.gguf" | sha256sum -c || exit 1
export BRAID_SMOLLM2_GGUF=/tmp/smollm2.gguf
nvidia-smi -L
for dtype in float32 bfloat16; do
  echo "== dtype $dtype, --speculative-num-draft-tokens ${DRAFT_TOKENS:-5}" | tee -a "$OUT/speculative_ngram.log"
  timeout 200 python3 benchmarks/speculative_ngram.py --model-path /tmp/smollm2.gguf --dtype $dtype \
    --draft-tokens "${DRAFT_TOKENS:-5}" --rounds 2 2>&1 | grep -v "Warning\|INFO" | tail -8 \
    | tee -a "$OUT/speculative_ngram.log"
done
