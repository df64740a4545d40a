#!/usr/bin/env bash
# The GPU checks, in two tiers, on a machine where the repo's requirements are installed (this
# script installs and builds nothing):
#
#   bash dev/gpu_check.sh correctness   # is the compiled kernel right on this GPU? (~4 min, H100)
#   bash dev/gpu_check.sh performance   # the full compiled test suites, speed, a compiled training
#   bash dev/gpu_check.sh all           # both
#
# correctness: the compiled kernel against the reference on the self-check problems of every tile
#   configuration (dtype x head_dim class of attention_kernel._configs), 16-bit inputs with row
#   scales of both signs and -0.0, offsets past 2^31, and a kernel made wrong on purpose; then
#   train.py for a few bf16 steps on the kernel (its own self-check first) and a passkey evaluation
#   (its self-check for evaluation). Most of its time is compilation: about 70 kernel
#   specialisations, 1-5 s each on one CPU core, 4 test processes at a time.
# performance: the kernel, prior and torch.compile test suites compiled instead of interpreted;
#   every prior's forward + backward time; the kernel against SDPA; the l12 training step's time,
#   BAM+SSMax / NoPE with MFU and BAM+SSMax with / without skipping (train.py's skip waits for it);
#   a 131,072-token l12 forward; a bf16 + torch.compile training on the demo data.
#
# Every step runs even if an earlier one failed (no -x: one failure does not hide the others). Each
# writes OUT/<step>.log, and OUT/summary.md gets its PASS/FAIL row as soon as it ends; the exit
# status is 1 if any step failed. OUT defaults to dev/results/gpu, PYTHON to python3.
set -u
cd "$(dirname "$0")/.."  # the repo root
tier=${1:-correctness}
case $tier in
  correctness | performance | all) ;;
  *) echo "gpu_check.sh: error: unknown tier '$tier'; use correctness, performance or all" >&2; exit 1 ;;
esac
PY=${PYTHON:-python3}
$PY -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'gpu_check.sh: error: torch finds no CUDA GPU here')" \
  || exit 1
OUT=${OUT:-dev/results/gpu}
WORK=$(mktemp -d)  # the runs' data and checkpoints
mkdir -p "$OUT"
summary=$OUT/summary.md
status=0

step() {  # step NAME CMD...: log to OUT/NAME.log, append its row to the summary, keep going
  local name=$1
  shift
  echo "=== $name: $*"
  local started=$SECONDS
  if "$@" > "$OUT/$name.log" 2>&1; then
    result=PASS
  else
    result=FAIL
    status=1
  fi
  local seconds=$((SECONDS - started))
  tail -n 3 "$OUT/$name.log"
  echo "=== $name: $result ($seconds s)"
  echo "| $name | $result | $seconds | $name.log |" >> "$summary"
}

{
  echo "# GPU check ($tier), $(date -u +%Y-%m-%dT%H:%MZ)"
  echo
  echo '```'
  nvidia-smi --query-gpu=name,compute_cap,driver_version,memory.total --format=csv
  $PY -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__)"
  echo '```'
  echo
  echo "| step | result | seconds | log |"
  echo "|---|---|---|---|"
} > "$summary"
cat "$summary"

kernel_tests="tests/test_kernel.py tests/test_priors.py tests/test_kernel_compile.py"
if [ "$tier" != performance ]; then
  step self_check env TRITON_INTERPRET=0 $PY -m pytest -q -n 4 -p no:cacheprovider tests/test_kernel.py \
    -k "self_check or half_precision or offsets_past_2_31 or single_key_rows"
  step demo_data $PY prepare_demo.py --out_dir "$WORK/data"
  step train_on_kernel $PY train.py config/demo_cpu.py --data_dir="$WORK/data" --out_dir="$WORK/run" \
    --device=cuda --dtype=bfloat16 --compile=False --attn_impl=triton --max_iters=40 --eval_interval=20 \
    --log_interval=10
  step passkey_on_kernel $PY eval_passkey.py --ckpt "$WORK/run" --template demo --max_length 4096 \
    --samples 4 --attn_impl triton --out "$OUT/passkey"
fi
if [ "$tier" != correctness ]; then
  step kernel_tests env TRITON_INTERPRET=0 $PY -m pytest -q -p no:cacheprovider $kernel_tests
  step prior_speed env TRITON_INTERPRET=0 $PY -m pytest -q -s -p no:cacheprovider tests/test_kernel.py \
    -k speed_of_every_prior
  step attention_bench $PY dev/bench_attention.py --quick --out "$OUT/bench_attention.json"
  step step_ratio $PY dev/bench.py --compile --steps 30 --out "$OUT/bench_l12.json"
  step long_forward $PY dev/bench.py --long_forward=131072 --out "$OUT/long_forward_131k.json"
  [ -d "$WORK/data" ] || step demo_data $PY prepare_demo.py --out_dir "$WORK/data"
  step train_compiled $PY train.py config/demo_cpu.py --data_dir="$WORK/data" --out_dir="$WORK/compiled" \
    --device=cuda --dtype=bfloat16 --compile=True --max_iters=200 --eval_interval=100 --log_interval=50
fi
rm -rf "$WORK"
echo
cat "$summary"
exit $status
