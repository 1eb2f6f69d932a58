#!/usr/bin/env bash
# One command for the H200 machine (run from the repository root, there):
#   scripts/gpu/run_h200.sh [STAGE...]     (default: every stage, in order)
# Installs the wheels brought along in .whl/ (flashinfer-python 0.6.1 + apache-tvm-ffi, pydantic and
# friends for app.config), measures the copy bandwidth and a bf16 matmul, runs the GPU tests and the
# latency / offline benchmarks on configs/models/llama-3.1-8b (dummy bf16 weights) and transformers'
# generate for reference, writes JSON under $OUT and prints one table last. flashinfer's JIT cache
# lives in .fi_cache/ (carry it in; it comes back as $OUT/fi_cache.tar.gz) and compiles in the
# background while the first stages run. Stages: roofline latency_triton tests latency_flashinfer
# latency_b32 offline hf tests_8b.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/ts_out}
RUN=/tmp/ts_run
mkdir -p "$OUT" "$RUN"
export PYTHONUNBUFFERED=1
MODEL=configs/models/llama-3.1-8b
STAGES=${*:-roofline latency_triton tests latency_flashinfer latency_b32 offline hf tests_8b}

python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  || { echo "wheel install failed"; exit 1; }
mkdir -p /tmp/tsk && ln -sfn "$PWD/kernels" /tmp/tsk/tokenspeed_kernels
export PYTHONPATH=/tmp/site:/tmp/tsk:$PWD
export FLASHINFER_WORKSPACE_BASE=$PWD/.fi_cache
mkdir -p "$FLASHINFER_WORKSPACE_BASE"
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv > "$RUN/env.log" 2>&1
python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)" >> "$RUN/env.log" 2>&1
echo "commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown)" >> "$RUN/env.log"

# flashinfer JIT in the background; stages that need it wait for it.
(timeout 200 python3 scripts/gpu/warm_flashinfer.py > "$RUN/warm_flashinfer.log" 2>&1; echo "rc=$?" > "$RUN/warm_flashinfer.status"; \
 tar czf "$OUT/fi_cache.tar.gz" -C "$FLASHINFER_WORKSPACE_BASE" .) &
WARM=$!

DEADLINE=${DEADLINE:-260}  # seconds: no stage starts after it, none runs past it (the device call's limit)
stage() {  # stage NAME TIMEOUT CMD...: run, log, record the exit status; the log's tail if it failed
  local name=$1 limit=$2; shift 2
  local left=$((DEADLINE - SECONDS)) t0=$SECONDS
  if [ "$left" -lt 15 ]; then echo "skipped (deadline)" > "$RUN/$name.status"; echo "== $name: skipped"; return; fi
  [ "$limit" -gt "$left" ] && limit=$left
  timeout "$limit" "$@" > "$RUN/$name.log" 2>&1
  local rc=$?
  echo "rc=$rc ($((SECONDS - t0)) s)" > "$RUN/$name.status"
  echo "== $name: $(cat "$RUN/$name.status") at ${SECONDS} s"
  [ $rc -ne 0 ] && tail -c 2500 "$RUN/$name.log"
  return 0
}
latency() {  # latency NAME BACKEND BATCH [extra flags]
  local name=$1 backend=$2 batch=$3; shift 3
  stage "$name" 90 python3 scripts/bench_latency.py --model $MODEL --load-format dummy --dtype bfloat16 \
    --attention-backend "$backend" --batch-size "$batch" --input-len 512 --output-len 128 \
    --json "$RUN/$name.json" "$@"
}

for s in $STAGES; do
  case $s in
    roofline) stage roofline 40 python3 scripts/gpu/roofline.py "$RUN/roofline.json" ;;
    latency_triton) latency latency_triton_b1 triton 1 ;;
    tests) stage tests_tiny 110 python3 -m pytest -q -p no:cacheprovider tests/gpu -k "not 8b and not flashinfer" ;;
    latency_flashinfer)
      wait $WARM
      latency latency_flashinfer_b1 flashinfer 1
      stage tests_flashinfer 70 python3 -m pytest -q -p no:cacheprovider tests/gpu -k "flashinfer and not 8b" ;;
    latency_b32) wait $WARM; latency latency_flashinfer_b32 flashinfer 32; latency latency_triton_b32 triton 32 ;;
    offline) wait $WARM; stage offline 150 python3 scripts/bench_offline.py --model $MODEL --load-format dummy \
      --dtype bfloat16 --num-requests 128 --input-len 512 --output-len 128 --max-num-seqs 128 --json "$RUN/offline.json" ;;
    hf) stage hf_b1 120 python3 scripts/gpu/hf_reference.py --model $MODEL --batch-size 1 --output-len 64 --json "$RUN/hf_b1.json" ;;
    tests_8b) wait $WARM; stage tests_8b 240 python3 -m pytest -q -s -p no:cacheprovider tests/gpu -k "8b" ;;
    idle) stage gpu_idle 90 python3 scripts/gpu/gpu_idle.py --json "$RUN/gpu_idle.json" ;;
    serving) stage serving 200 bash scripts/gpu/serve_and_bench.sh "$RUN" ;;
    *) echo "unknown stage $s"; exit 2 ;;
  esac
done
wait $WARM
tar czf "$OUT/logs.tar.gz" -C "$RUN" .
python3 scripts/gpu/summarize.py "$RUN" "$OUT/results.json"
