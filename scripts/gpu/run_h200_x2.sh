#!/usr/bin/env bash
# The two-GPU machine (nvidia-h200-x2) used twice over: two lists of one-GPU stages run at once, one on
# each GPU, then a list of stages that need both GPUs (tests_tp latency_tp serving_dp).
#   scripts/gpu/run_h200_x2.sh "GPU0 STAGES" "GPU1 STAGES" "BOTH STAGES"
# Each part's results land in $OUT/gpu0, $OUT/gpu1, $OUT/both (results.json, logs.tar.gz); the last part
# returns flashinfer's JIT cache. DEADLINE (default 570 s) bounds the whole call.
# TP=2 against TP=1 at batch 1 (8B shape, dummy bf16), with the one-shot all-reduce and with NCCL alone,
# in one call (JSON per run in $OUT/both/results.json, the table and ratios at the end):
#   scripts/gpu/run_h200_x2.sh "" "" latency_tp
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/ts_out}
DEADLINE=${DEADLINE:-570}
SPLIT=${SPLIT:-330}  # seconds the parallel one-GPU parts may take
mkdir -p "$OUT/gpu0" "$OUT/gpu1" "$OUT/both"
part() {  # part NAME GPUS DEADLINE STAGES
  local name=$1 gpus=$2 limit=$3 stages=$4
  [ -n "$stages" ] || return 0
  # shellcheck disable=SC2086  # stages are a list
  CUDA_VISIBLE_DEVICES=$gpus RUN=/tmp/ts_run_$name OUT=$OUT/$name DEADLINE=$limit NO_FI_TAR=${5-1} \
    bash scripts/gpu/run_h200.sh $stages > "$OUT/$name.txt" 2>&1
}
part gpu0 0 "$SPLIT" "${1:-}" &
part gpu1 1 "$SPLIT" "${2:-}" &
wait
part both 0,1 $((DEADLINE - SECONDS)) "${3:-roofline}" ""
for name in gpu0 gpu1 both; do echo "######## $name"; tail -n 60 "$OUT/$name.txt" 2>/dev/null; done
