#!/usr/bin/env bash
# One device call: wheels, GPU tests of the new paths, then the figures (priority order).
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
T0=$SECONDS
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl 2>&1 | tail -2
mkdir -p /tmp/tsk && ln -sfn "$PWD/kernels" /tmp/tsk/tokenspeed_kernels
export PYTHONPATH=/tmp/site:/tmp/tsk:$PWD PATH=/tmp/site/bin:$PATH PYTHONUNBUFFERED=1
echo "install $((SECONDS-T0)) s"
M="--model configs/models/llama-3.1-8b --load-format dummy --dtype bfloat16"
step() { local name=$1 lim=$2; shift 2; local t=$SECONDS
  timeout $lim "$@" > "$OUT/$name.log" 2>&1; echo "== $name rc=$? $((SECONDS-t)) s (at $((SECONDS-T0)) s)"; tail -n ${TAILN:-14} "$OUT/$name.log"; }
TAILN=6 step tests 100 python3 -m pytest -q -p no:cacheprovider -x tests/gpu/test_grammar_mask_gpu.py \
  tests/gpu/test_spec_drafters_gpu.py tests/gpu/test_model_runner_gpu.py -k "not 8b"
step spec 60 python3 scripts/gpu/bench_speculative.py $M --steps 30 --json "$OUT/spec.json"
V=$(python3 -c "import json;d=json.load(open('$OUT/spec.json'));print(d['verify_step_ms'])" 2>/dev/null)
step eagle3 50 python3 scripts/gpu/bench_eagle3.py $M --context 512 --iters 30 --json "$OUT/eagle3.json" ${V:+--verify-ms $V}
step grammar 70 python3 scripts/gpu/bench_grammar.py $M --batch-sizes 1,64 --trials 3 --json "$OUT/grammar.json"
step latency 50 python3 -m app.bench.latency $M --attention-backend triton --batch-size 1 --input-len 512 \
  --output-len 128 --json "$OUT/latency.json"
