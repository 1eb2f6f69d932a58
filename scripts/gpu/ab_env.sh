#!/usr/bin/env bash
# Batch-1 decode (graph replay) of the 8B model, dummy weights, triton backend, this tree run alternately
# under several environments (settings read by the code at import): a change behind a switch, judged side
# by side on one machine.
#   bash scripts/gpu/ab_env.sh ROUNDS WEIGHTS "NAME:VAR=V,VAR=V" ...     (WEIGHTS: bf16, fp8 or "bf16 fp8")
set -u
ROUNDS=$1 WEIGHTS=$2; shift 2
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl >/dev/null 2>&1
mkdir -p /tmp/ab_k && ln -sfn "$PWD/kernels" /tmp/ab_k/tokenspeed_kernels
ARGS="--model configs/models/llama-3.1-8b --load-format dummy --dtype bfloat16 --attention-backend triton
  --input-len 512 --output-len 128 --batch-size ${BATCH:-1}"
: > /tmp/ab_env_rows.txt
for round in $(seq "$ROUNDS"); do
  for weights in $WEIGHTS; do
    flags=(); [ "$weights" = fp8 ] && flags+=(--quantization fp8)
    for spec in "$@"; do
      name=${spec%%:*} settings=${spec#*:}
      rm -f /tmp/ab_env.json
      # shellcheck disable=SC2046
      if env $(tr ',' ' ' <<< "$settings") PYTHONPATH=/tmp/site:/tmp/ab_k:$PWD timeout 120 python3 scripts/bench_latency.py \
          $ARGS "${flags[@]}" --json /tmp/ab_env.json > "/tmp/ab_env_${name}_$weights.log" 2>&1; then
        ms=$(python3 -c "import json; print(json.load(open('/tmp/ab_env.json'))['graph_replay_ms'])")
      else ms=failed; fi
      echo "$round $weights $name $ms" | tee -a /tmp/ab_env_rows.txt
    done
  done
done
cp /tmp/ab_env_rows.txt "$OUT/ab_env_rows.txt"
python3 - <<'PY'
rows = [line.split() for line in open("/tmp/ab_env_rows.txt")]
names = list(dict.fromkeys(r[2] for r in rows))
print("| round | weights | " + " | ".join(names) + " |")
print("|---" * (2 + len(names)) + "|")
for key in dict.fromkeys((r[0], r[1]) for r in rows):
    v = {r[2]: r[3] for r in rows if (r[0], r[1]) == key}
    print(f"| {key[0]} | {key[1]} | " + " | ".join(f"{float(v[n]):.3f}" if v.get(n, "failed") != "failed" else "failed" for n in names) + " |")
PY
