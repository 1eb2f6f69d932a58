#!/usr/bin/env bash
# One command for the H200 machine (run from the repository root, there; docs/performance.md):
#   scripts/gpu/run_h200.sh [SUITE or STAGE ...]     (default: the gpu_tests suite)
# Installs the wheels brought along in .whl/ (flashinfer-python 0.6.1 + apache-tvm-ffi, pydantic and
# friends for app.config), runs the stages named, writes JSON under $OUT and prints one table last.
# flashinfer's JIT cache lives in .fi_cache/ (carry it in, or packed as .fi_cache.tar.gz: it comes back in
# 15 MiB pieces, $OUT/fi_cache.tar.gz.NN) and compiles in the background while the first stages run.
#
# Suites, each sized for one device call (10 minutes) with a warm JIT cache:
#   gpu_tests         every GPU test on one H200: tests, tests_flashinfer, tests_8b (~8 min)
#   figures_latency   the copy-bandwidth and matmul limits, batch-1 decode with bf16 and FP8 weights (the
#                     FP8 ratio), the KV pool with a bf16 and an FP8 cache, GPU idle between decode steps
#   figures_offline   1000 requests of 1000 in / 1000 out, bf16, then FP8 weights and KV (FITS_PERCENT=60
#                     with a warm cache)
#   figures_serving   the whole appliance over HTTP: start to ready, TTFT and TPOT at 1 and 4 streams
#   figures_tp        two GPUs (nvidia-h200-x2): TP=2 tests, batch-1 decode at TP=1 and 2, DP=2 serving
#   figures_moe       MoE (issue 33; run with NO_WARM=1 DEADLINE=570): the kernels' tuning (its table copied to
#                     kernels/ for the stages after it and to $OUT/moe_configs.json), Qwen3-30B-A3B batch-1
#                     decode bf16 and FP8 with transformers beside them, the MoE GPU tests, a profile of batch-1
#                     decode, and the 1000 x 1000 offline figures (bf16 KV, then FP8 KV at 512 running) as far as
#                     the time left allows (else calls of their own)
# Stages (a suite is a list of these; each can be named alone):
#   roofline                 copy bandwidth and a bf16 matmul (scripts/gpu/roofline.py): ~40 s
#   latency_triton latency_flashinfer latency_b4 latency_b32
#                            bench latency (in process) at batch 1, 4 or 32, 512-token prompts: ~60 s each
#   latency_fp8_triton       batch 1 on the triton backend, bf16 weights then FP8 (quantized at load): ~70 s
#   latency_fp8              the same on the flashinfer backend
#   kv_pool                  start-up only, bf16 KV then FP8 KV: kv_pool_tokens of each: ~50 s; the default backend
#                            is flashinfer only with its kernels cached, so it waits for the background build
#                            (warm_flashinfer.py builds the FP8-KV kernels too: ~110 s the first time)
#   cold_start               process start to /readiness 200 and the longest silent stretch of the log, Llama-3.1-8B
#                            shape, dummy weights, default backend: empty kernel caches, the same again, and after
#                            `tokenspeed warmup` (scripts/gpu/cold_start.py): ~300 s; run it with NO_WARM=1
#                            DEADLINE=580 so that no flashinfer build competes and it is not cut short
#   idle                     GPU idle between decode steps, plain and pipelined (gpu_idle.py): ~60 s
#   offline                  bench offline, 128 requests of 512 in / 128 out: ~60 s
#   offline_1000             1000 requests of 1000 in / 1000 out, flashinfer, bf16: ~200 s
#   offline_1000_fp8kv       the same with FP8 weights and an FP8 KV cache: ~150 s (run kv_pool before it,
#                            or carry a cache that has the FP8-KV kernels: warm_flashinfer builds bf16 only);
#                            FP8KV_SEQS running requests (default 512), decode graphs captured up to as many;
#                            FP8KV_CHUNK tokens a step (default 16384)
#   serving                  the appliance, then bench serving (serve_and_bench.sh): 4 streams of 1024-token
#                            prompts, the same with lengths +-50%, 1 stream (PYSPY_BENCH=b1: py-spy on it)
#   hf                       transformers' generate on the same shape, for reference
#   profile_prefill profile_b1_bf16 profile_b1_fp8 profile_b4
#                            torch.profiler over a window of steps in process: each kernel's GPU time and the
#                            GPU's busy share (a prefill; batch 1 bf16 and FP8 with PDL off; batch 4): ~40 s each
#   gemv                     decode-sized GEMVs (kernels/gemv.py) swept per shape of GEMV_SHAPES (llama-3.1-8b,
#                            or qwen3-30b-a3b: the MoE's attention and LM head) and row count (GEMV_ROWS),
#                            GEMV_WEIGHTS of bf16, fp8 (W8A16), w8a8, against cuBLAS: GEMV_BUDGET (200) s + ~40 s
#   gemv_chain               the W8A8 GEMV's configurations at one row after their producer kernels under PDL in
#                            a graph (bench_gemv_chain.py): ~30 s
#   attn                     decode attention alone per backend, bf16 and FP8 KV, batch 1 to 384 (ATTN_ARGS): ~90 s
#   attn_sweep               the Triton decode kernel's tile, warps, stages and split count (ATTN_CONFIGS) at
#                            ATTN_CASES (BATCHxCONTEXT,...), both caches: ~90 s
#   elementwise              rotary + KV write, RMSNorm and SiLU-and-mul with and without the fused FP8
#                            quantization, quantize_rows, at 1, 512 and 8704 rows or ELEMENTWISE_ROWS: ~40 s
#   tests                    every GPU test but the 8B and flashinfer ones: ~160 s
#   tests_flashinfer         the flashinfer tests but the 8B ones: ~90 s + JIT
#   tests_8b                 the 8B tests (pool sizing, logits against transformers): ~240 s
#   tests_decode             the decode step's kernels and backends, FP8 caches, the pipelined steps: ~120 s
#   tests_fp8w               the FP8 weights' GEMMs, GEMV and fused quantization: ~210 s
#   pytest                   the GPU tests PYTEST_ARGS names (pytest's arguments, quoted as on a command line)
#   tests_tp latency_tp      two GPUs: TP=2 GPU tests; batch-1 decode at TP=1, at TP=2 with the one-shot
#                            all-reduce for small tensors, and at TP=2 with NCCL only: ~150 s
#   serving_dp               two GPUs: the appliance at 1 replica, then --data-parallel-size 2: ~300 s
#   moe_tune                 bench_moe.py --tune on the Qwen3-30B-A3B and Mixtral expert shapes, bf16 and FP8, 1 to
#                            4096 tokens, for MOE_TUNE_BUDGET (280) s, the largest token counts skipped past it;
#                            MOE_TUNE_ARGS="--tune-models configs/models/qwen3-30b-a3b" tunes one model (330 s
#                            covered its every bucket; the other's rows are kept); the run takes the budget + ~30 s
#   moe_decode               bench_moe.py: Qwen3-30B-A3B batch 1, bf16 then FP8 weights, the active-weight roofline,
#                            transformers' generate: ~70 s
#   moe_tests                tests/gpu/test_moe_gpu.py: ~60 s
#   moe_profile              torch.profiler over 20 batch-1 decode steps of Qwen3-30B-A3B, PDL off: ~40 s
#   moe_offline_1000         1000 requests of 1000 in / 1000 out on Qwen3-30B-A3B, bf16, triton attention, MOE_SEQS
#                            (256) running; MOE_REQUESTS fewer requests or MOE_OUTPUT_LEN fewer tokens each for a
#                            shorter run (e.g. a profile of the mixed steps: 544 requests, 32 out, MOE_PROFILE_STEPS=8:4)
#   moe_offline_1000_fp8kv   the same with an FP8 KV cache and MOE_FP8KV_SEQS (512) running; MOE_PROFILE_STEPS
#                            (e.g. 1500:12) profiles a window of either run's steps; MOE_ATTN="triton flashinfer"
#                            runs each on both backends (flashinfer: xqa decode over an FP8 cache, FA3 prefill)
#                            after its JIT build, the second's results named moe_offline_1000*_flashinfer
#   moe_offline_1000_fp8     the FP8 KV run with FP8 weights too (quantized at load)
# A stage that cannot finish before DEADLINE is skipped rather than cut (offline_1000*), so give each
# 1000-request stage a device call of its own unless the estimates above add up.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/ts_out}
RUN=${RUN:-/tmp/ts_run}  # several instances may run at once (scripts/gpu/run_h200_x2.sh): each its own
mkdir -p "$OUT" "$RUN"
export PYTHONUNBUFFERED=1
MODEL=configs/models/llama-3.1-8b
suite() {  # suite NAME: its stages, or nothing for a name that is not a suite
  case $1 in
    gpu_tests) echo tests tests_flashinfer tests_8b ;;
    figures_latency) echo roofline latency_fp8_triton kv_pool idle ;;
    figures_offline) echo offline_1000 offline_1000_fp8kv ;;
    figures_serving) echo serving ;;
    figures_tp) echo tests_tp latency_tp serving_dp ;;
    figures_moe) echo moe_tune moe_decode moe_tests moe_profile moe_offline_1000 moe_offline_1000_fp8kv ;;
  esac
}
STAGES=
for name in ${*:-gpu_tests}; do stages=$(suite "$name"); STAGES="$STAGES ${stages:-$name}"; done
KNOWN=" roofline cold_start latency_triton latency_flashinfer latency_b4 latency_b32 latency_fp8 latency_fp8_triton kv_pool idle \
offline offline_1000 offline_1000_fp8kv serving hf profile_prefill profile_b1_fp8 profile_b1_bf16 profile_b4 gemv gemv_chain \
attn attn_sweep elementwise tests tests_flashinfer tests_8b tests_decode tests_fp8w pytest tests_tp latency_tp serving_dp \
moe_tune moe_decode moe_tests moe_profile moe_offline_1000 moe_offline_1000_fp8kv moe_offline_1000_fp8 "
SERVING_MORE="stagger:4:0.5:32:128 b1:1:0:3:256"  # the serving stages' benchmarks after the first (serve_and_bench.sh)
for s in $STAGES; do  # every name checked before anything runs
  [[ $KNOWN == *" $s "* ]] || { echo "unknown stage $s; suites: gpu_tests figures_latency figures_offline figures_serving figures_tp figures_moe; stages:$KNOWN"; exit 2; }
done

# Once per machine and set of wheels (a lock: parallel instances share /tmp/site). The stamp holds the
# wheels' names: a warm machine reinstalls when .whl/ changed since its last call.
# Without the wheels nothing that imports the appliance runs (pydantic): stop before any device time goes.
compgen -G ".whl/*.whl" > /dev/null || { echo ".whl/ has no wheels: name .whl in the device call's carry"; exit 1; }
WHEELS=$(cd .whl && ls -- *.whl)
( flock 9; [ "$(cat /tmp/site/.installed 2>/dev/null)" = "$WHEELS" ] || { python3 -m pip install -q --no-index \
  --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  && find /tmp/site -exec touch -h -d 2000-01-01 {} + && echo "$WHEELS" > /tmp/site/.installed; } ) 9>/tmp/site.lock \
  || { echo "wheel install failed"; exit 1; }
mkdir -p /tmp/tsk && ln -sfn "$PWD/kernels" /tmp/tsk/tokenspeed_kernels
export PYTHONPATH=/tmp/site:/tmp/tsk:$PWD PATH=/tmp/site/bin:$PATH
export FLASHINFER_WORKSPACE_BASE=$PWD/.fi_cache
mkdir -p "$FLASHINFER_WORKSPACE_BASE"
# flashinfer's JIT runs ninja, which rebuilds a kernel whose inputs are newer than it: the headers pip
# just wrote are, so they get an old date above, or a carried cache would be compiled again anyway.
# The cache may travel packed (carry .fi_cache.tar.gz: the unpacked one outgrows a call's 64 MiB).
( flock 9; [ -f .fi_cache.tar.gz ] && [ -z "$(ls -A "$FLASHINFER_WORKSPACE_BASE")" ] \
  && tar xzf .fi_cache.tar.gz -C "$FLASHINFER_WORKSPACE_BASE" ) 9>/tmp/fi_cache.lock
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv > "$RUN/env.log" 2>&1
python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)" >> "$RUN/env.log" 2>&1
echo "commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown)" >> "$RUN/env.log"

# flashinfer JIT in the background; stages that need it wait for it, and so does the call's end (to
# return the cache). NO_WARM=1 skips it: a call of stages that need no flashinfer kernels then ends when
# they do (a cold compile takes 300 s and more of device time).
WARM=
if [ -z "${NO_WARM:-}" ]; then
  (timeout 300 python3 scripts/gpu/warm_flashinfer.py > "$RUN/warm_flashinfer.log" 2>&1; echo "rc=$?" > "$RUN/warm_flashinfer.status") &
  WARM=$!
fi

MOE_ATTN=${MOE_ATTN:-triton}  # the MoE offline stages' attention backends: each stage runs once per name
# run_moe_offline NAME SEQS CHUNK [flags]: Qwen3-30B-A3B, 1000 x (1000 in / 1000 out), SEQS running, CHUNK
# tokens a step, on each backend of MOE_ATTN (NAME_flashinfer for that one: it waits for the background build)
run_moe_offline() {
  local name=$1 seqs=$2 chunk=$3 backend label; shift 3
  for backend in $MOE_ATTN; do
    label=$name; [ "$backend" = triton ] || { label=${name}_$backend; wait $WARM; }
    # shellcheck disable=SC2086
    fits "$label" 200 && stage "$label" 420 python3 -m app.bench.offline --model configs/models/qwen3-30b-a3b \
      --load-format dummy --dtype bfloat16 --attention-backend "$backend" --num-requests "${MOE_REQUESTS:-1000}" \
      --input-len 1000 --output-len "${MOE_OUTPUT_LEN:-1000}" --max-num-seqs "$seqs" --chunked-prefill-size "$chunk" \
      --json "$RUN/$label.json" ${MOE_PROFILE_STEPS:+--profile-steps "$MOE_PROFILE_STEPS"} "$@"
  done
}
MOE_TUNE_BUDGET=${MOE_TUNE_BUDGET:-280}  # seconds of tuning: the larger token counts left are skipped
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
  stage "$name" 90 python3 -m app.bench.latency --model $MODEL --load-format dummy --dtype bfloat16 \
    --attention-backend "$backend" --batch-size "$batch" --input-len 512 --output-len 128 \
    --json "$RUN/$name.json" "$@"
}
latency_bf16_and_fp8() {  # latency_bf16_and_fp8 BACKEND: batch 1, bf16 weights then FP8 (quantized at load)
  latency "latency_$1_b1_bf16w" "$1" 1
  latency "latency_$1_b1_fp8w" "$1" 1 --quantization fp8
}
fits() {  # fits NAME SECONDS: true if SECONDS are left before DEADLINE, else the stage is marked skipped
  # FITS_PERCENT scales the estimate (e.g. 60 when the JIT cache is warm and the device time is short)
  local left=$((DEADLINE - SECONDS)) need=$(($2 * ${FITS_PERCENT:-100} / 100))
  [ "$left" -ge "$need" ] && return 0
  echo "skipped (needs ~$need s, $left s left)" > "$RUN/$1.status"; echo "== $1: skipped (needs ~$need s, $left s left)"
  return 1
}
run_kv_pool() {  # run_kv_pool NAME TIMEOUT [flags]: start-up and one decode step; the default backend for the KV dtype
  local name=$1 limit=$2; shift 2
  stage "$name" "$limit" python3 -m app.bench.latency --model $MODEL --load-format dummy --dtype bfloat16 \
    ${KV_POOL_BACKEND:+--attention-backend "$KV_POOL_BACKEND"} --batch-size 1 --input-len 128 --output-len 2 \
    --max-model-len 2048 --json "$RUN/$name.json" "$@"
}
run_offline() {  # run_offline NAME TIMEOUT [flags]: bench offline on the model, dummy bf16 weights, flashinfer
  local name=$1 limit=$2; shift 2  # OFFLINE_FLAGS: more bench offline flags (e.g. --gpu-memory-utilization)
  # shellcheck disable=SC2086
  stage "$name" "$limit" python3 -m app.bench.offline --model $MODEL --load-format dummy --dtype bfloat16 \
    --attention-backend flashinfer --json "$RUN/$name.json" "$@" ${OFFLINE_FLAGS:-}
}
# The issue's offline figure: 1000 requests of 1000 in / 1000 out. A bf16 KV token of the 8B model is
# 32 layers x 8 heads x 128 x 2 (K, V) x 2 bytes = 128 KiB (8192 tokens per GiB): ~105 GiB of pool at
# --gpu-memory-utilization 0.9 hold ~860k tokens, 430 requests at their full 2000; 384 never preempt.
# FP8 KV halves the token: 512 fit with room to spare.
run_offline_1000() {  # run_offline_1000 NAME MAX_NUM_SEQS TIMEOUT CHUNK [flags]
  local name=$1 seqs=$2 limit=$3 chunk=$4; shift 4
  run_offline "$name" "$limit" --num-requests 1000 --input-len 1000 --output-len 1000 --max-num-seqs "$seqs" \
    --chunked-prefill-size "$chunk" --profile-steps "${PROFILE_STEPS:-1500:12}" "$@"
}

for s in $STAGES; do
  case $s in
    roofline) stage roofline 40 python3 scripts/gpu/roofline.py "$RUN/roofline.json" ;;
    cold_start) stage cold_start 570 python3 scripts/gpu/cold_start.py --json "$RUN/cold_start.json" ;;
    latency_triton) latency latency_triton_b1 triton 1 ;;
    # Batch 1 on the triton backend (the flashinfer backend's decode kernel for a 16-bit cache, and no
    # wait for flashinfer's JIT): bf16 weights, then FP8.
    latency_fp8_triton) latency_bf16_and_fp8 triton ;;
    latency_flashinfer) wait $WARM; latency latency_flashinfer_b1 flashinfer 1 ;;
    tests_flashinfer) wait $WARM; stage tests_flashinfer 200 python3 -m pytest -q -p no:cacheprovider tests/gpu \
      -k "flashinfer and not 8b" ;;
    tests) stage tests_tiny 240 python3 -m pytest -q -p no:cacheprovider tests/gpu -k "not 8b and not flashinfer" ;;
    latency_b4) wait $WARM; latency latency_flashinfer_b4 flashinfer 4 ;;
    latency_b32) wait $WARM; latency latency_flashinfer_b32 flashinfer 32; latency latency_triton_b32 triton 32 ;;
    profile_prefill) wait $WARM; run_offline profile_prefill 120 --num-requests 8 --input-len 1024 --output-len 1 \
      --max-num-seqs 2 --chunked-prefill-size 1024 --profile-steps 4:3 ;;
    profile_b1_fp8) wait $WARM; run_offline profile_b1_fp8 120 --num-requests 1 --input-len 512 --output-len 256 \
      --max-num-seqs 1 --quantization fp8 --profile-steps 100:20 --no-pdl ;;
    profile_b1_bf16) wait $WARM; run_offline profile_b1_bf16 120 --num-requests 1 --input-len 512 --output-len 256 \
      --max-num-seqs 1 --profile-steps 100:20 --no-pdl ;;
    profile_b4) wait $WARM; run_offline profile_b4 120 --num-requests 4 --input-len 1024 --output-len 256 --max-num-seqs 4 \
      --profile-steps 100:20 ;;
    offline) wait $WARM; run_offline offline 150 --num-requests 128 --input-len 512 --output-len 128 --max-num-seqs 128 ;;
    latency_fp8) wait $WARM; latency_bf16_and_fp8 flashinfer ;;
    kv_pool) wait $WARM; run_kv_pool kv_pool_bf16 90; run_kv_pool kv_pool_fp8kv 240 --kv-cache-dtype fp8_e4m3 ;;
    # The 1000-request stages do not wait for the background warm-up: their own start-up builds what
    # they need (flashinfer locks its JIT modules, so the two share one compile).
    offline_1000) fits offline_1000 280 && run_offline_1000 offline_1000 384 360 8192 ;;
    # MoE (issue 33), Qwen3-30B-A3B shape, dummy weights, the triton attention backend (NO_WARM=1: no
    # flashinfer). moe_tune's table is copied into kernels/ (and $OUT) so that the stages after it run
    # the tuned tiles.
    moe_tune) stage moe_tune $((MOE_TUNE_BUDGET + 90)) python3 scripts/gpu/bench_moe.py --tune \
        --tune-budget "$MOE_TUNE_BUDGET" --json "$RUN/moe_tune.json" ${MOE_TUNE_ARGS:-}
      [ -s "$RUN/moe_tune.json" ] && cp "$RUN/moe_tune.json" kernels/moe_configs.json && cp "$RUN/moe_tune.json" "$OUT/moe_configs.json" ;;
    moe_decode) stage moe_decode 240 python3 scripts/gpu/bench_moe.py --model configs/models/qwen3-30b-a3b \
        --attention-backend triton --hf-output-len 16 --json "$RUN/moe_decode.json" ;;
    moe_tests) stage moe_tests 150 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_moe_gpu.py ;;
    # Each kernel's GPU time over 20 batch-1 decode steps (PDL off: each kernel's own time), the tuned tiles.
    moe_profile) stage moe_profile 150 python3 -m app.bench.offline --model configs/models/qwen3-30b-a3b \
        --load-format dummy --dtype bfloat16 --attention-backend triton --num-requests 1 --input-len 512 \
        --output-len 160 --max-num-seqs 1 --profile-steps 100:20 --no-pdl --json "$RUN/moe_profile.json" ;;
    # 1000 x (1000 in / 1000 out): a Qwen3-30B-A3B KV token is 48 layers x 4 heads x 128 x 2 x 2 bytes =
    # 96 KiB; the ~60 GiB the 61 GB of weights leave at 0.9 hold ~650k tokens, 320 requests at 2000.
    moe_offline_1000) run_moe_offline moe_offline_1000 "${MOE_SEQS:-256}" 8192 ;;
    # The same with an FP8 KV cache (48 KiB a token): 512 requests at their full 2000 tokens fit.
    moe_offline_1000_fp8kv) run_moe_offline moe_offline_1000_fp8kv "${MOE_FP8KV_SEQS:-512}" 16384 \
        --max-cudagraph-capture-size "${MOE_FP8KV_SEQS:-512}" --kv-cache-dtype fp8_e4m3 ;;
    # And with FP8 weights too (quantized at load): half the experts' bytes a decode step.
    moe_offline_1000_fp8) run_moe_offline moe_offline_1000_fp8 "${MOE_FP8KV_SEQS:-512}" 16384 \
        --max-cudagraph-capture-size "${MOE_FP8KV_SEQS:-512}" --kv-cache-dtype fp8_e4m3 --quantization fp8 ;;
    offline_1000_fp8kv) fits offline_1000_fp8kv 250 && run_offline_1000 offline_1000_fp8kv "${FP8KV_SEQS:-512}" 330 \
      "${FP8KV_CHUNK:-16384}" --quantization fp8 --kv-cache-dtype fp8_e4m3 --max-cudagraph-capture-size "${FP8KV_SEQS:-512}" ;;
    hf) stage hf_b1 120 python3 scripts/gpu/hf_reference.py --model $MODEL --batch-size 1 --output-len 64 --json "$RUN/hf_b1.json" ;;
    tests_8b) wait $WARM; stage tests_8b 240 python3 -m pytest -q -s -p no:cacheprovider tests/gpu -k "8b" ;;
    idle) stage gpu_idle 90 python3 scripts/gpu/gpu_idle.py --json "$RUN/gpu_idle.json" ;;
    # 4 streams of 1024-token prompts (the issue's TTFT/TPOT case) with fixed lengths (the 4 arrive
    # together) and with lengths drawn within +-50% (arrivals spread, as in real traffic); one stream.
    serving) MORE=$SERVING_MORE PYSPY_BENCH=${PYSPY_BENCH:-} stage serving 260 bash scripts/gpu/serve_and_bench.sh "$RUN" serving ;;
    # ATTN_ARGS: more bench_decode_attention.py flags (--backends, --cases, --kv-dtypes).
    # shellcheck disable=SC2086
    attn) wait $WARM; stage attn 200 python3 scripts/gpu/bench_decode_attention.py --json "$RUN/attn.json" ${ATTN_ARGS:-} ;;
    # The Triton decode kernel's launch options (context tile : warps : stages[ : splits]), both caches.
    attn_sweep) stage attn_sweep 200 python3 scripts/gpu/bench_decode_attention.py --json "$RUN/attn_sweep.json" \
      --triton-configs "${ATTN_CONFIGS:-64:4:3,64:4:2,64:8:3,128:8:2,32:4:3}" \
      --sweep-cases "${ATTN_CASES:-384x1500,64x1500}" ;;
    gemv) stage gemv $((${GEMV_BUDGET:-200} + 60)) python3 scripts/gpu/bench_gemv.py --budget-s "${GEMV_BUDGET:-200}" \
      --weights "${GEMV_WEIGHTS:-bf16,fp8}" --rows "${GEMV_ROWS:-1,4,8,16}" --shapes "${GEMV_SHAPES:-llama-3.1-8b}" \
      --json "$RUN/gemv.json" ;;
    gemv_chain) stage gemv_chain 300 python3 scripts/gpu/bench_gemv_chain.py --json "$RUN/gemv_chain.json" ;;
    elementwise) stage elementwise 150 python3 scripts/gpu/bench_elementwise.py --json "$RUN/elementwise.json" \
      --rows "${ELEMENTWISE_ROWS:-1,512,8704}" ;;
    # shellcheck disable=SC2086
    pytest)  # PYTEST_ARGS is parsed as the shell would parse it, so that -k "a and b" stays one argument
      eval "pytest_args=(${PYTEST_ARGS:?PYTEST_ARGS names the tests})"
      stage pytest 240 python3 -m pytest -q -p no:cacheprovider "${pytest_args[@]}" ;;
    tests_fp8w) stage tests_fp8w 280 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_fp8_gpu.py \
      tests/gpu/test_gemv_gpu.py ;;
    tests_decode) wait $WARM; stage tests_decode 220 python3 -m pytest -q -p no:cacheprovider -k "not 8b" \
      tests/gpu/test_backends_gpu.py tests/gpu/test_fp8_kv_backends.py tests/gpu/test_pipeline_gpu.py \
      tests/gpu/test_greedy_gpu.py ;;
    # Two GPUs (nvidia-h200-x2): TP=2 parity tests, batch-1 decode TP=1 vs TP=2, and the appliance's
    # throughput with one replica vs two (--data-parallel-size 2) at twice the concurrency.
    tests_tp) wait $WARM; stage tests_tp 260 python3 -m pytest -v -s -p no:cacheprovider -o faulthandler_timeout=100 \
      tests/gpu/test_peer_all_reduce_gpu.py tests/gpu/test_tensor_parallel_gpu.py ;;
    latency_tp)
      wait $WARM
      latency latency_tp1_b1 flashinfer 1
      latency latency_tp2_b1 flashinfer 1 --tensor-parallel-size 2
      latency latency_tp2_b1_nccl flashinfer 1 --tensor-parallel-size 2 --disable-custom-all-reduce ;;
    serving_dp)
      wait $WARM
      NUM_PROMPTS=512 INPUT_LEN=512 OUTPUT_LEN=256 CONCURRENCY=128 MAX_NUM_SEQS=128 BACKEND=flashinfer \
        stage serving_dp1 170 bash scripts/gpu/serve_and_bench.sh "$RUN" serving_dp1
      NUM_PROMPTS=1024 INPUT_LEN=512 OUTPUT_LEN=256 CONCURRENCY=256 MAX_NUM_SEQS=128 BACKEND=flashinfer \
        SERVE_FLAGS="--data-parallel-size 2" stage serving_dp2 170 bash scripts/gpu/serve_and_bench.sh "$RUN" serving_dp2 ;;
    *) echo "unknown stage $s"; exit 2 ;;
  esac
done
wait $WARM
# The JIT cache comes back for the next call (NO_FI_TAR=1: another instance returns it).
# A call brings back files of 16 MiB at most: the tarball comes in pieces (fi_cache.tar.gz.00, .01, ...);
# here, cat them into .fi_cache.tar.gz to carry.
[ -n "${NO_FI_TAR:-}" ] || tar czf - -C "$FLASHINFER_WORKSPACE_BASE" . | split -d -b 15M - "$OUT/fi_cache.tar.gz."
tar czf "$OUT/logs.tar.gz" -C "$RUN" .
python3 scripts/gpu/summarize.py "$RUN" "$OUT/results.json"
