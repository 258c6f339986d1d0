set -o pipefail
source benchmarks/gpu/setup.sh
nvidia-smi -L; python3 -c "import torch, triton; print(torch.__version__, triton.__version__, torch.cuda.get_device_name())"
python3 -m pytest tests/kernels -q -m gpu -x 2>&1 | tail -15 | tee $OUT/kernels.log
CFG=benchmarks/configs/llama3-8b.json
timeout 300 python3 -m braid.bench_one_batch --load-format dummy --model-config $CFG --model-path llama3-8b-dummy --dtype bfloat16 \
  --batch-size 1 --input-len 128 --output-len 512 --max-total-tokens 200000 --log-level warning 2>&1 | tail -25 | tee $OUT/one_batch_b1.log
