#!/usr/bin/env bash
# The GPU checks, in one go (about 5 minutes on an H100/H200): `bash dev/gpu_check.sh` (or `make gpu-check`).
# Everything lands in results/gpu/ (logs and JSON); copy the numbers into the README.
#   1. the compiled Triton kernel vs the PyTorch reference: values and every gradient, fp32 / bf16, for ggd and
#      for cauchy (the kernel reads any prior from its tables)
#   2. the kernel, prior and torch.compile test suites on the GPU (compiled, not interpreted): every registered
#      prior and the tests' own priors, never seen by any other code, against the dense formula
#   3. the same compiled kernels for ggd, cauchy and a test prior (two trained parameters each): their
#      forward + backward times side by side
#   4. kernel vs SDPA-flash (no prior) and SDPA with a materialised prior, for ggd and for cauchy: TFLOP/s,
#      memory, and the performance model's predicted ratios next to the measured ones (perf_model.py)
#   5. a training step of l12: BAM+SSMax vs NoPE time ratio, tokens/s and MFU, bf16 + torch.compile
#   6. a 131,072-token forward of l12 BAM+SSMax in bf16: time and peak memory
#   7. train.py end to end for a few steps on the demo data, bf16 + torch.compile (ggd, then cauchy, both on the
#      kernel), then a passkey evaluation
# Each step runs even if an earlier one failed; the exit status says whether all passed.
set -u
cd "$(dirname "$0")/.."  # the repo root
PY=${PYTHON:-python}
OUT=results/gpu
mkdir -p "$OUT"
status=0
run() {  # run NAME CMD...: log to $OUT/NAME.log, keep going on failure
  local name=$1; shift
  echo "=== $name: $*"
  local t0=$SECONDS
  if "$@" 2>&1 | tee "$OUT/$name.log"; then echo "=== $name: ok ($((SECONDS - t0)) s)"
  else echo "=== $name: FAILED ($((SECONDS - t0)) s)"; status=1; fi
}
set -o pipefail  # a step's status is its command's, not tee's
$PY -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'no CUDA GPU here: nothing to check')" || exit 1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$OUT/gpu.txt"
$PY -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__)" \
  | tee -a "$OUT/gpu.txt"

run kernel_check        $PY dev/bench_attention.py --check --out "$OUT/kernel_check.json"
run kernel_check_cauchy $PY dev/bench_attention.py --check --prior cauchy --out "$OUT/kernel_check_cauchy.json"
run kernel_tests        env TRITON_INTERPRET=0 $PY -m pytest -q -x tests/test_kernel.py tests/test_priors.py \
                        tests/test_kernel_compile.py
run prior_speed         env TRITON_INTERPRET=0 $PY -m pytest -q -s tests/test_kernel.py -k speed_of_every_prior
run attention_bench     $PY dev/bench_attention.py --quick --out "$OUT/bench_attention.json"
run attention_bench_cauchy $PY dev/bench_attention.py --quick --prior cauchy --impls kernel_bam kernel_plain \
                        --out "$OUT/bench_attention_cauchy.json"
run perf_model          $PY dev/perf_model.py --archs 90 --head_dims 64 --variants none ggd_ssmax \
                        --compare "$OUT/bench_attention.json" --out "$OUT/perf_model"
run step_ratio          $PY dev/bench.py --compile --steps 30 --out "$OUT/bench_l12.json"
run long_forward        $PY dev/bench.py --long_forward=131072 --out "$OUT/long_forward_131k.json"
rm -rf /tmp/bam_gpu_run /tmp/bam_gpu_cauchy /tmp/bam_gpu_demo_data
run demo_data           $PY prepare_demo.py --out_dir /tmp/bam_gpu_demo_data
run train_compiled      $PY train.py config/demo_cpu.py --data_dir=/tmp/bam_gpu_demo_data --out_dir=/tmp/bam_gpu_run \
                        --device=cuda --dtype=bfloat16 --compile=True --max_iters=40 --eval_interval=20 --log_interval=10
run train_cauchy        $PY train.py config/demo_cpu.py --data_dir=/tmp/bam_gpu_demo_data --out_dir=/tmp/bam_gpu_cauchy \
                        --device=cuda --dtype=bfloat16 --compile=True --prior=cauchy --attn_impl=triton \
                        --max_iters=40 --eval_interval=20 --log_interval=10
run passkey_gpu         $PY eval_passkey.py --ckpt /tmp/bam_gpu_run --template demo --max_length 65536 --samples 10 \
                        --out "$OUT/passkey"
exit $status
