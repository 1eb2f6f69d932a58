#!/usr/bin/env bash
# Batch-1 decode (graph replay) of the 8B model (or MODEL), dummy weights, triton backend, bf16 and FP8 weights, run
# alternately with older trees and this one on the same machine: H200s differ by up to 5% (docs/performance.md),
# more than some changes, so a change is judged side by side. BATCH="1 64" runs each batch size in turn: a
# change that speeds batch 1 can slow larger batches (one was 1.8% faster at batch 1, 3% slower at 64). WEIGHTS=fp8
# leaves out the bf16 runs (for a change to FP8's path alone; default "bf16 fp8"). MODEL picks another model
# directory (e.g. configs/models/qwen3-30b-a3b; default the 8B).
#
#   git archive <commit> app kernels scripts configs | (mkdir -p ab_old && tar -x -C ab_old)   # here
#   bash scripts/gpu/ab_latency.sh ab_old [ROUNDS [OTHER_TREE ...]]                            # on the device
#
# ab_old/ (and any other tree named, made the same way) is untracked (not ignored), so it travels with the
# working tree; delete it afterwards. Needs the .whl/ wheels (carry). Writes $OUT/ab_latency.json and
# prints a table: ms per step of each tree (this one is "new"), and its ratio to ab_old's.
set -u
OLD=$1 ROUNDS=${2:-2}
shift $(( $# < 2 ? $# : 2 ))
TREES=("$OLD" "$@" .)
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl >/dev/null 2>&1
name() { [ "$1" = . ] && echo new || basename "$1"; }
for tree in "${TREES[@]}"; do
  mkdir -p "/tmp/ab_k_$(name "$tree")"
  ln -sfn "$(realpath "$tree")/kernels" "/tmp/ab_k_$(name "$tree")/tokenspeed_kernels"
done
ARGS="--model ${MODEL:-configs/models/llama-3.1-8b} --load-format dummy --dtype bfloat16 --attention-backend triton
  --input-len 512 --output-len 128"
one() {  # one TREE_DIR RUN_NAME [flags]: the graph replay ms, or "failed"
  local dir=$1 run=$2 kernels=/tmp/ab_k_$(name "$1"); shift 2
  rm -f "/tmp/ab_$run.json"  # a failed run must not report an earlier call's figure
  local bench=(-m app.bench.latency)  # trees from before the benchmarks moved into app/ have the script
  [ -f "$dir/app/bench/latency.py" ] || bench=(scripts/bench_latency.py)
  ( cd "$dir" && PYTHONPATH=/tmp/site:$kernels:$PWD timeout 120 python3 "${bench[@]}" $ARGS "$@" \
      --json "/tmp/ab_$run.json" > "/tmp/ab_$run.log" 2>&1 ) \
    && python3 -c "import json; print(json.load(open('/tmp/ab_$run.json'))['graph_replay_ms'])" || echo failed
}
: > /tmp/ab_rows.txt
for batch in ${BATCH:-1}; do
  for round in $(seq "$ROUNDS"); do
    for weights in ${WEIGHTS:-bf16 fp8}; do
      flags=(--batch-size "$batch"); [ "$weights" = fp8 ] && flags+=(--quantization fp8)
      for tree in "${TREES[@]}"; do
        ms=$(one "$tree" "$(name "$tree")_$weights" "${flags[@]}")
        echo "$batch $round $weights $(name "$tree") $ms" | tee -a /tmp/ab_rows.txt
      done
    done
  done
done
python3 - "$OUT/ab_latency.json" "$(name "$OLD")" <<'PY'
import json, sys
rows = [line.split() for line in open("/tmp/ab_rows.txt")]
ms = lambda v: None if v == "failed" else float(v)  # noqa: E731
json.dump([{"batch": int(b), "round": int(r), "weights": w, "tree": t, "ms": ms(v)} for b, r, w, t, v in rows],
          open(sys.argv[1], "w"), indent=2)
old, trees = sys.argv[2], list(dict.fromkeys(t for *_, t, _ in rows))
table = {(b, r, w, t): ms(v) for b, r, w, t, v in rows}
print("| batch | round | weights | " + " | ".join(f"{t} ms" for t in trees) + " | " +
      " | ".join(f"{t} / {old}" for t in trees[1:]) + " |")
print("|---" * (3 + 2 * len(trees) - 1) + "|")
for b, r, w in dict.fromkeys((b, r, w) for b, r, w, _, _ in rows):
    values = [table[(b, r, w, t)] for t in trees]
    base = values[0]
    ratios = [f"{v / base:.3f}" if v and base else "-" for v in values[1:]]
    print(f"| {b} | {r} | {w} | " + " | ".join("failed" if v is None else f"{v:.3f}" for v in values) + " | " +
          " | ".join(ratios) + " |")
PY
