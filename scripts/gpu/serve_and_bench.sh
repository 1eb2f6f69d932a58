#!/usr/bin/env bash
# The whole appliance on the GPU: Llama-3.1-8B shape, dummy bf16 weights, a word-level tokenizer that
# covers the vocabulary (scripts/gpu/wordlevel_tokenizer.py: every token streams as visible text),
# then bench_serving. Defaults: 4 concurrent streams of 1024-token prompts (the issue's TTFT/TPOT case).
#   serve_and_bench.sh RUN_DIR [NAME]      writes RUN_DIR/NAME.json, NAME-ready.json, NAME-serve.log
# Environment: BACKEND (the appliance's default), SERVE_FLAGS (extra `serve` flags, e.g. --data-parallel-size 2),
# NUM_PROMPTS (16), INPUT_LEN (1024), OUTPUT_LEN (128), CONCURRENCY (4), MAX_NUM_SEQS (64),
# RANGE_RATIO (0: fixed lengths; R draws each request's lengths from [L*(1-R), L*(1+R)], bench_serving's
# --random-range-ratio, so that requests under CONCURRENCY do not all finish and arrive together),
# MORE (further benchmarks against the same server, each SUFFIX:CONCURRENCY:RANGE_RATIO:NUM_PROMPTS:OUTPUT_LEN,
# written to NAME-SUFFIX.json), PYSPY_BENCH and PYSPY_S (py-spy, when installed, samples the worker and the
# scheduler for PYSPY_S seconds from the start of the MORE benchmark PYSPY_BENCH: NAME-PROCESS.pyspy.txt,
# collapsed stacks, idle frames included), READY_TIMEOUT_S (600: how long the appliance may take to be ready).
# It stops with exit 1, saying why, when the appliance exits or is not ready in time, or a benchmark fails
# (bench_serving exits 1 when a request failed).
set -uo pipefail
RUN=${1:?run dir}
NAME=${2:-serving}
PORT=8000
MODEL=/tmp/llama-3.1-8b-wordlevel
[ -d $MODEL ] || python3 scripts/gpu/wordlevel_tokenizer.py configs/models/llama-3.1-8b $MODEL || exit 1
t0=$(date +%s.%N)
# Per-request stats in the log: summarize.py splits each TTFT into the scheduler's part and the rest.
# shellcheck disable=SC2086  # SERVE_FLAGS is a list of flags
python3 -m app.cli serve $MODEL --load-format dummy --dtype bfloat16 --device cuda \
  ${BACKEND:+--attention-backend "$BACKEND"} --max-model-len 4096 --max-num-seqs "${MAX_NUM_SEQS:-64}" \
  --enable-log-request-stats --port $PORT ${SERVE_FLAGS:-} > "$RUN/$NAME-serve.log" 2>&1 &
SERVER=$!
trap 'kill -TERM $SERVER 2>/dev/null; wait $SERVER' EXIT
deadline=$(( $(date +%s) + ${READY_TIMEOUT_S:-600} ))
until curl -sf "http://127.0.0.1:$PORT/readiness" > /dev/null; do
  kill -0 $SERVER 2>/dev/null || { echo "appliance exited before it was ready"; tail -50 "$RUN/$NAME-serve.log"; exit 1; }
  if [ "$(date +%s)" -ge $deadline ]; then
    echo "appliance not ready after ${READY_TIMEOUT_S:-600} s: no benchmark"; tail -50 "$RUN/$NAME-serve.log"; exit 1
  fi
  sleep 0.5
done
ready=$(python3 -c "import time; print(round(time.time() - $t0, 1))")
echo "start-to-ready ${ready} s"
echo "{\"start_to_ready_s\": $ready}" > "$RUN/$NAME-ready.json"
SEED=0
bench() {  # bench JSON CONCURRENCY RANGE_RATIO NUM_PROMPTS OUTPUT_LEN
  # Each benchmark its own prompts (seed): one that repeated an earlier one's would hit the prefix cache.
  SEED=$((SEED + 1))
  python3 -m app.bench.serving --base-url "http://127.0.0.1:$PORT" --num-prompts "$4" --seed $SEED \
    --input-len "${INPUT_LEN:-1024}" --output-len "$5" --max-concurrency "$2" \
    --random-range-ratio "$3" --vocab-size 128000 --min-token-id 10 \
    --json "$1" | tail -50  # the whole summary (about 46 lines); pipefail keeps bench_serving's status
  local status=$?
  [ $status -eq 0 ] || { echo "benchmark $1 failed (exit $status): stopping"; exit 1; }
}
bench "$RUN/$NAME.json" "${CONCURRENCY:-4}" "${RANGE_RATIO:-0}" "${NUM_PROMPTS:-16}" "${OUTPUT_LEN:-128}"
profile() {  # profile SUFFIX: py-spy on the engine processes while that benchmark runs
  [ "$1" = "${PYSPY_BENCH:-}" ] && command -v py-spy > /dev/null || return 0
  for proc in worker0 scheduler; do
    pid=$(grep -o "started $proc (pid [0-9]*" "$RUN/$NAME-serve.log" | grep -o "[0-9]*$" | head -1)
    [ -n "$pid" ] && py-spy record --idle --nonblocking -r 2000 -d "${PYSPY_S:-4}" -f raw \
      -o "$RUN/$NAME-$proc.pyspy.txt" --pid "$pid" > "$RUN/$NAME-$proc.pyspy.log" 2>&1 &
  done
}
for spec in ${MORE:-}; do
  IFS=: read -r suffix concurrency ratio prompts output_len <<< "$spec"
  echo "## $NAME-$suffix"
  profile "$suffix"
  bench "$RUN/$NAME-$suffix.json" "$concurrency" "$ratio" "$prompts" "$output_len"
done
