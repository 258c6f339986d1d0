# Sourced by every script here at the start of a device call (they run from the repository root).
#
# What a call carries (prepared on the development machine; `.whl/` is git-ignored, add `/.gpu/` to
# .git/info/exclude so that `carry` accepts it):
#   .whl/        the wheels the H200 image lacks, for CPython 3.12 x86-64 (the pip download command of
#                /work/.library/device/README.md, --no-deps): pydantic==2.13.4 pydantic_core==2.46.4
#                annotated-types==0.7.0 typing-inspection==0.4.2 typing_extensions==4.16.0 gguf==0.19.0
#                outlines_core==0.2.14 pyzmq==27.3.0 msgspec==0.23.0 (6 MB)
#   .gpu/tok/    SmolLM2's tokenizer as an HF folder, for the Llama-3-8B-shaped dummy server:
#                python -c "from braid.runtime.loader.tokenizer import load_tokenizer as t; t('smollm2').save_pretrained('.gpu/tok')"
#   .gpu/a/part_aa, .gpu/b/part_ab, .gpu/tok/smollm2.sha256
#                the SmolLM2 GGUF split in two halves (one call's 64 MiB could not hold it with the wheels):
#                split -n 2 <gguf> part_a  (then part_aa -> .gpu/a, part_ab -> .gpu/b; sha256sum of the whole)
#   .gpu/trees/REF/   a commit's files (git archive REF | tar -x -C .gpu/trees/REF), for core_before_after.sh
#                when the device copy has no git history
# A call brings back at most 8 files from $OUT (two folders down): a script that writes more (the serving ones do)
# wants its command to end with `cd $OUT && tar czf out.tgz --remove-files *`.

if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    >/dev/null 2>&1 || echo "wheel install failed"
elif [ -d /tmp/site ]; then
  echo "no wheels in .whl/: using those an earlier call installed in /tmp/site on this machine"
else
  echo "no wheels in .whl/ (carry .whl)"
fi
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1

# A folder from which `import braid` loads the source tree TREE without pip (the package-dir mapping of
# pyproject.toml: braid = TREE/lang, braid.runtime = TREE/runtime, braid.backends = TREE/backends), built of links
# under /tmp so that the tree itself stays untouched. Prints the folder.
braid_import_dir() {
  local tree pkg entry
  tree=$(cd "$1" && pwd) || return 1
  pkg=/tmp/braid-import/$(echo "$tree" | md5sum | cut -c1-12)
  rm -rf "$pkg" && mkdir -p "$pkg/braid" || return 1
  for entry in "$tree"/lang/*; do ln -sfn "$entry" "$pkg/braid/"; done
  ln -sfn "$tree/runtime" "$pkg/braid/runtime"
  ln -sfn "$tree/backends" "$pkg/braid/backends"
  echo "$pkg"
}
PYTHONPATH=/tmp/site:$(braid_import_dir .)${PYTHONPATH:+:$PYTHONPATH}
export PYTHONPATH

# Llama-3-8B-shaped server with random weights: start_dummy_server PORT LOG [launch_server flags...]; waits up to
# SERVER_START_TIMEOUT_S for /health; sets SERVER_PID (its own process group, so stop_server ends its scheduler and
# detokenizer too).
SERVER_START_TIMEOUT_S=300
DUMMY_MODEL_FLAGS="--model-path llama3-8b-dummy --load-format dummy --model-config benchmarks/configs/llama3-8b.json \
  --tokenizer-path .gpu/tok --dtype bfloat16"
start_dummy_server() {
  local port=$1 log=$2
  shift 2
  # shellcheck disable=SC2086
  $(command -v setsid) python3 -m braid.launch_server $DUMMY_MODEL_FLAGS --port "$port" --log-level warning "$@" >"$log" 2>&1 &
  SERVER_PID=$!
  local i
  for i in $(seq "$SERVER_START_TIMEOUT_S"); do
    curl -sf "localhost:$port/health" >/dev/null && { echo "server up after ${i}s"; return 0; }
    kill -0 "$SERVER_PID" 2>/dev/null || { echo "server exited during start:"; tail -20 "$log"; return 1; }
    sleep 1
  done
  echo "server not up after ${SERVER_START_TIMEOUT_S}s"; return 1
}
stop_server() {
  [ -n "${SERVER_PID:-}" ] || return 0
  kill -- -"$SERVER_PID" 2>/dev/null || kill "$SERVER_PID" 2>/dev/null
  local i
  for i in $(seq 30); do kill -0 -- -"$SERVER_PID" 2>/dev/null || break; sleep 1; done
  kill -9 -- -"$SERVER_PID" 2>/dev/null
  SERVER_PID=
}
server_counters() {  # the load left on the server after a run: should be 0 running, 0 KV tokens used
  curl -s "localhost:$1/get_server_info" | python3 -c "import json, sys; d = json.load(sys.stdin); \
print({k: v for k, v in d.items() if k.startswith(('num_', 'kv_')) and not isinstance(v, (dict, list))})"
}
install_staged_flashinfer() {  # FlashInfer from the wheel halves staged as flashinfer_vs_triton.sh describes, if any
  local w=/tmp/flashinfer_python-0.7.2-py3-none-any.whl
  if ! python3 -c "import flashinfer" >/dev/null 2>&1 && [ -f /tmp/fi_part_aa ] && [ -f .gpu/fi2/fi_part_ab ]; then
    cat /tmp/fi_part_aa .gpu/fi2/fi_part_ab > $w && echo "$(cat .gpu/fi2/fi.sha256)  $w" | sha256sum -c \
      && python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site $w .gpu/fi2/apache_tvm_ffi-*.whl \
      2>&1 | tail -2
  fi
  export FLASHINFER_CUDA_ARCH_LIST=9.0 MAX_JOBS=16
}
