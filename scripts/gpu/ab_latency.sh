#!/usr/bin/env bash
# Batch-1 decode (graph replay) of the 8B model, dummy weights, triton backend, bf16 and FP8 weights, run
# alternately with an older tree and this one on the same machine: H200s differ by more than some changes
# (docs/benchmarks.md), so a change is judged side by side.
#
#   git archive <commit> app kernels scripts configs | (mkdir -p ab_old && tar -x -C ab_old)   # here
#   bash scripts/gpu/ab_latency.sh ab_old [ROUNDS]                                              # on the device
#
# ab_old/ is untracked (not ignored), so it travels with the working tree; delete it afterwards. Needs the
# .whl/ wheels (carry). Writes $OUT/ab_latency.json and prints a table: ms per step, old and new.
set -u
OLD=$1 ROUNDS=${2:-2}
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl >/dev/null 2>&1
mkdir -p /tmp/ab_new /tmp/ab_old
ln -sfn "$PWD/kernels" /tmp/ab_new/tokenspeed_kernels
ln -sfn "$(realpath "$OLD")/kernels" /tmp/ab_old/tokenspeed_kernels
ARGS="--model configs/models/llama-3.1-8b --load-format dummy --dtype bfloat16 --attention-backend triton
  --batch-size 1 --input-len 512 --output-len 128"
one() {  # one TREE_DIR KERNELS_DIR NAME [flags]: the graph replay ms, or "failed"
  local dir=$1 kernels=$2 name=$3; shift 3
  rm -f "/tmp/ab_$name.json"  # a failed run must not report an earlier call's figure
  ( cd "$dir" && PYTHONPATH=/tmp/site:$kernels:$PWD timeout 120 python3 scripts/bench_latency.py $ARGS "$@" \
      --json "/tmp/ab_$name.json" > "/tmp/ab_$name.log" 2>&1 ) \
    && python3 -c "import json; print(json.load(open('/tmp/ab_$name.json'))['graph_replay_ms'])" || echo failed
}
: > /tmp/ab_rows.txt
for round in $(seq "$ROUNDS"); do
  for weights in bf16 fp8; do
    flags=(); [ "$weights" = fp8 ] && flags=(--quantization fp8)
    new=$(one . /tmp/ab_new "new_$weights" "${flags[@]}")
    old=$(one "$OLD" /tmp/ab_old "old_$weights" "${flags[@]}")
    echo "$round $weights $old $new" | tee -a /tmp/ab_rows.txt
  done
done
python3 - "$OUT/ab_latency.json" <<'PY'
import json, sys
rows = [line.split() for line in open("/tmp/ab_rows.txt")]
ms = lambda v: None if v == "failed" else float(v)  # noqa: E731
json.dump([{"round": int(r), "weights": w, "old_ms": ms(o), "new_ms": ms(n)} for r, w, o, n in rows],
          open(sys.argv[1], "w"), indent=2)
print("| round | weights | old ms | new ms | new / old |\n|---|---|---|---|---|")
for r, w, o, n in rows:
    ratio = f"{float(n) / float(o):.3f}" if "failed" not in (o, n) else "-"
    print(f"| {r} | {w} | {o} | {n} | {ratio} |")
PY
