# Sourced at the start of every device call: packages the H200 image lacks, travelling as wheels in .whl/.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1 || echo "wheel install failed"
export PYTHONPATH=/tmp/site:$PWD/.gpu/pkg:${PYTHONPATH:-}
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
# braid itself, importable without pip (the folder mapping of pyproject.toml)
mkdir -p .gpu/pkg && rm -f .gpu/pkg/braid && ln -s "$PWD/lang" .gpu/pkg/braid
[ -e lang/runtime ] || ln -s ../runtime lang/runtime
[ -e lang/backends ] || ln -s ../backends lang/backends
