#!/usr/bin/env bash
# One command for the H200 machine (run from the repository root, there):
#   scripts/gpu/run_h200.sh [STAGE...]     (default: every stage, in order)
# Installs the wheels brought along in .whl/ (flashinfer-python 0.6.1 + apache-tvm-ffi, pydantic and
# friends for app.config), measures the copy bandwidth and a bf16 matmul, runs the GPU tests and the
# latency / offline benchmarks on configs/models/llama-3.1-8b (dummy bf16 weights) and transformers'
# generate for reference, writes JSON under $OUT and prints one table last. flashinfer's JIT cache
# lives in .fi_cache/ (carry it in, or packed as .fi_cache.tar.gz: it comes back in 15 MiB pieces, $OUT/fi_cache.tar.gz.NN) and compiles in the
# background while the first stages run. Default stages: roofline latency_triton tests
# latency_flashinfer latency_b32 offline hf tests_8b. Named only (each with its own time needs):
#   idle serving             GPU idle between steps; the whole appliance over HTTP (PYSPY_BENCH=b1: py-spy on it;
#                            summarize.py splits each TTFT into the scheduler's part and the rest)
#   serving_eager_prefill    the serving stage with prefill and mixed steps eager (--piecewise-cuda-graph-max-tokens 0)
#   offline_b1               one request of 1024 in / 512 out in process (the overlapped loop at batch 1): ~40 s
#   pyspy_b4                 the profile_b4 run (1024 out) under py-spy (idle frames included): where the host's
#                            time goes in the overlapped loop (pyspy_b4-offline.pyspy.txt, collapsed stacks): ~50 s
#   pyspy_prefill            60 prefills of one 1024-token prompt (bench_latency --prefill-reps) under py-spy:
#                            where the host's time goes in an eager prefill: ~50 s
#   profile_prefill          8 requests of 1024 in / 1 out in process, one prefill a step (pipelined), torch.profiler
#                            over 3 of them: each kernel's GPU time, the GPU's busy share (the prefill's TFLOP/s): ~40 s
#   profile_b1_fp8           1 request of 512 in / 256 out, FP8 weights, torch.profiler over 20 decode steps: each
#                            kernel's GPU time at batch 1 (the FP8 batch-1 goal), PDL off so that kernels do not
#                            overlap (under PDL each one's time includes its wait for the one before): ~30 s
#   profile_b1_bf16          the same with bf16 weights: the bar FP8 is judged against, kernel by kernel
#   profile_b4               4 requests of 1024 in / 256 out in process, torch.profiler over 20 decode steps: each
#                            kernel's GPU time and calls, and the GPU's busy share (4-stream TPOT): ~50 s
#   latency_pdl              its GPU tests, then batch 1 and 4 (and batch 1 with FP8 weights), flashinfer, the
#                            decode kernels launched with programmatic dependent launch (the default) and
#                            without (bench_latency --no-pdl), side by side: ~150 s
#   pdl_batches              the offline run's decode step (FP8 weights and KV, 1024-token prompts, flashinfer) with
#                            PDL and without (--no-pdl) at PDL_BATCHES rows (default 64 256 512), two rounds: ~480 s
#   pieces                   GPU tests of the piecewise CUDA graphs (prefill and mixed steps), then batch 1 and 4
#                            (512-token prompts) with and without them: prefill time side by side: ~150 s
#   latency_fp8              batch-1 flashinfer latency, bf16 weights then FP8 (quantized at load): ~70 s
#   latency_fp8_triton       the same on the triton backend (the same decode kernels; no wait for the JIT)
#   kv_pool                  start-up only, bf16 KV then FP8 KV: kv_pool_tokens of each: ~50 s, plus
#                            ~110 s the first time for flashinfer's FP8-KV kernels (JIT; then cached)
#   offline_no_overlap       the offline stage without step overlap (compare with offline): ~30 s
#   offline_1000             1000 requests of 1000 in / 1000 out, flashinfer, bf16: ~200 s
#   offline_1000_g512        offline_1000 with decode graphs captured up to 512 (384 running: no eager decode)
#   offline_1000_fp8         the same with FP8 weights: ~170 s
#   offline_1000_fp8kv       the same with FP8 weights and an FP8 KV cache: ~150 s (run kv_pool before it,
#                            or carry a cache that has the FP8-KV kernels: warm_flashinfer builds bf16 only);
#                            FP8KV_SEQS running requests (default 512), decode graphs captured up to as many;
#                            FP8KV_CHUNK tokens a step (default 16384: 1-2% faster than 8192, as fast as 32768)
#   attn                     decode attention alone per backend (flashinfer CUDA-core and tensor-core, triton),
#                            bf16 and FP8 KV, batch 1 to 384: time and KV read rate vs the copy bandwidth: ~90 s
#   attn_sweep               the Triton decode kernel's tile, warps, stages and split count (ATTN_CONFIGS) at
#                            ATTN_CASES (BATCHxCONTEXT,...), both caches: ~90 s
#   gemv                     decode-sized GEMVs (kernels/gemv.py) swept per 8B shape and row count (GEMV_ROWS),
#                            GEMV_WEIGHTS of bf16, fp8 (W8A16), w8a8, against cuBLAS: GEMV_BUDGET (200) s + ~40 s
#   gemv_chain               the W8A8 GEMV's configurations at one row after their producer kernels under PDL in
#                            a graph (bench_gemv_chain.py): ~30 s
#   elementwise              rotary + KV write per heads-a-program, RMSNorm and SiLU-and-mul with and without the
#                            fused FP8 quantization, quantize_rows: time and share of the copy bandwidth at 1, 512
#                            and 8704 rows, or ELEMENTWISE_ROWS (bench_elementwise.py): ~40 s
#   overlap                  a decode step's xqa attention and FP8 GEMMs (512 x 1500) one after the other against
#                            two halves overlapped on two streams (bench_overlap.py, OVERLAP_SPLITS): ~60 s + JIT
#   prefill_fp8              prefill attention over an FP8 cache: FA2 with bf16 queries against FA3 with FP8
#                            queries, time and error (bench_prefill_fp8.py): ~30 s + the FA3 JIT (minutes)
#   xqa_layout               xqa decode over an FP8 cache (512 x 1500) per block size (XQA_BLOCKS) and layout
#                            (NHD, HND), blocks in pool order and scattered (bench_xqa_layout.py): ~20 s + JIT
#   scaled_mm                the FP8 GEMMs (_scaled_mm, row-wise) at 512 and 8704 rows, float32 against fast
#                            accumulation: time, TFLOP/s, error (bench_scaled_mm.py): ~30 s
#   tests_gemv               GPU tests of kernels/gemv.py and of the pipelined steps (no host sync at launch): ~60 s
#   tests_decode             GPU tests of the decode step's kernels and backends (fused rotary + KV write, both
#                            caches, graphs vs eager) and of the pipelined steps (PDL included): ~60 s
#   tests_fi_decode          the flashinfer backend's decode kernels (xqa included) against torch: ~30 s + JIT
#   tests_fp8kv              GPU tests of the FP8 KV backends, flashinfer sampling and FP8 GEMMs: ~150 s
#   tests_fp8w               GPU tests of the FP8 weights' GEMMs, GEMV and fused quantization: ~210 s
#   pytest                   the GPU tests PYTEST_ARGS names (pytest's arguments, quoted as on a command line)
#   tests_tp latency_tp      two GPUs (nvidia-h200-x2): TP=2 GPU tests; batch-1 decode at TP=1 and TP=2
#   serving_dp               two GPUs: the appliance at 1 replica, then --data-parallel-size 2: ~300 s
# A stage that cannot finish before DEADLINE is skipped rather than cut (offline_1000*), so give each
# 1000-request stage a device call of its own unless the estimates above add up.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/ts_out}
RUN=${RUN:-/tmp/ts_run}  # several instances may run at once (scripts/gpu/run_h200_x2.sh): each its own
mkdir -p "$OUT" "$RUN"
export PYTHONUNBUFFERED=1
MODEL=configs/models/llama-3.1-8b
STAGES=${*:-roofline latency_triton tests latency_flashinfer latency_b32 offline hf tests_8b}
KNOWN=" roofline latency_triton tests latency_flashinfer latency_b4 latency_pdl pieces latency_b32 offline offline_no_overlap latency_fp8 kv_pool \
latency_fp8_triton pdl_batches offline_1000 offline_1000_g512 offline_1000_fp8 offline_1000_fp8kv offline_b1 profile_prefill profile_b1_fp8 profile_b1_bf16 profile_b4 pyspy_b4 pyspy_prefill hf tests_8b idle serving serving_eager_prefill tests_tp latency_tp serving_dp tests_fp8kv tests_fp8w tests_decode tests_fi_decode tests_gemv gemv gemv_chain attn attn_sweep elementwise scaled_mm overlap prefill_fp8 xqa_layout pytest "
SERVING_MORE="stagger:4:0.5:32:128 b1:1:0:3:256"  # the serving stages' benchmarks after the first (serve_and_bench.sh)
for s in $STAGES; do  # every name checked before anything runs
  [[ $KNOWN == *" $s "* ]] || { echo "unknown stage $s; known:$KNOWN"; exit 2; }
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
run_offline() {  # run_offline NAME TIMEOUT [flags]: bench_offline on the model, dummy bf16 weights, flashinfer
  local name=$1 limit=$2; shift 2  # OFFLINE_FLAGS: more bench_offline flags (e.g. --gpu-memory-utilization)
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
    latency_triton) latency latency_triton_b1 triton 1 ;;
    # Batch 1 on the triton backend (the flashinfer backend's decode kernel for a 16-bit cache, and no
    # wait for flashinfer's JIT): bf16 weights, then FP8.
    latency_fp8_triton) latency_bf16_and_fp8 triton ;;
    tests) stage tests_tiny 240 python3 -m pytest -q -p no:cacheprovider tests/gpu -k "not 8b and not flashinfer" ;;
    latency_flashinfer)
      wait $WARM
      latency latency_flashinfer_b1 flashinfer 1
      stage tests_flashinfer 70 python3 -m pytest -q -p no:cacheprovider tests/gpu -k "flashinfer and not 8b" ;;
    latency_b4) wait $WARM; latency latency_flashinfer_b4 flashinfer 4 ;;
    latency_pdl)
      wait $WARM
      stage tests_pdl 150 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_pipeline_gpu.py \
        tests/gpu/test_gemv_gpu.py -k "programmatic or pdl"
      for b in 1 4; do latency latency_pdl_b$b flashinfer $b; latency latency_plain_b$b flashinfer $b --no-pdl; done
      latency latency_pdl_fp8_b1 flashinfer 1 --quantization fp8
      latency latency_plain_fp8_b1 flashinfer 1 --quantization fp8 --no-pdl ;;
    pdl_batches)  # the offline run's decode (FP8 weights and KV) with PDL and without, at PDL_BATCHES, two rounds
      wait $WARM
      for round in 1 2; do
        for b in ${PDL_BATCHES:-64 256 512}; do
          for launch in pdl plain; do
            no_pdl=(); [ "$launch" = plain ] && no_pdl=(--no-pdl)
            latency "latency_${launch}_r${round}_b$b" flashinfer "$b" --quantization fp8 --kv-cache-dtype fp8_e4m3 \
              --input-len 1024 --output-len 16 --max-cudagraph-capture-size "$b" "${no_pdl[@]}"
          done
        done
      done ;;
    pieces)
      wait $WARM
      stage tests_pieces 200 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_backends_gpu.py \
        -k "piecewise or float32_greedy or bfloat16_logits or graph_and_eager"
      for b in 1 4; do
        latency latency_pieces_b$b flashinfer $b --prefill-reps 5
        latency latency_eager_prefill_b$b flashinfer $b --prefill-reps 5 --piecewise-cuda-graph-max-tokens 0
      done
      latency latency_pieces_fp8_b1 flashinfer 1 --prefill-reps 5 --quantization fp8 ;;
    latency_b32) wait $WARM; latency latency_flashinfer_b32 flashinfer 32; latency latency_triton_b32 triton 32 ;;
    # One request in process: the overlapped engine loop's batch-1 step, without the appliance's processes.
    offline_b1) wait $WARM; run_offline offline_b1 120 --num-requests 1 --input-len 1024 --output-len 512 --max-num-seqs 8 ;;
    profile_prefill) wait $WARM; run_offline profile_prefill 120 --num-requests 8 --input-len 1024 --output-len 1 \
      --max-num-seqs 2 --chunked-prefill-size 1024 --profile-steps 4:3 ;;
    profile_b1_fp8) wait $WARM; run_offline profile_b1_fp8 120 --num-requests 1 --input-len 512 --output-len 256 \
      --max-num-seqs 1 --quantization fp8 --profile-steps 100:20 --no-pdl ;;
    profile_b1_bf16) wait $WARM; run_offline profile_b1_bf16 120 --num-requests 1 --input-len 512 --output-len 256 \
      --max-num-seqs 1 --profile-steps 100:20 --no-pdl ;;
    profile_b4) wait $WARM; run_offline profile_b4 120 --num-requests 4 --input-len 1024 --output-len 256 --max-num-seqs 4 \
      --profile-steps 100:20 ;;
    pyspy_b4) wait $WARM; stage pyspy_b4 150 py-spy record --idle --nonblocking -r 500 -f raw \
      -o "$RUN/pyspy_b4-offline.pyspy.txt" -- python3 -m app.bench.offline --model $MODEL --load-format dummy \
      --dtype bfloat16 --attention-backend flashinfer --num-requests 4 --input-len 1024 --output-len 1024 \
      --max-num-seqs 4 --json "$RUN/pyspy_b4.json" ;;
    pyspy_prefill) wait $WARM; stage pyspy_prefill 150 py-spy record --idle --nonblocking -r 500 -f raw \
      -o "$RUN/pyspy_prefill-latency.pyspy.txt" -- python3 -m app.bench.latency --model $MODEL --load-format dummy \
      --dtype bfloat16 --attention-backend flashinfer --batch-size 1 --input-len 1024 --output-len 4 --prefill-reps 60 \
      --json "$RUN/pyspy_prefill.json" ;;
    offline) wait $WARM; run_offline offline 150 --num-requests 128 --input-len 512 --output-len 128 --max-num-seqs 128 ;;
    offline_no_overlap) wait $WARM; run_offline offline_no_overlap 150 --num-requests 128 --input-len 512 --output-len 128 \
      --max-num-seqs 128 --no-overlap ;;
    latency_fp8) wait $WARM; latency_bf16_and_fp8 flashinfer ;;
    kv_pool) wait $WARM; run_kv_pool kv_pool_bf16 90; run_kv_pool kv_pool_fp8kv 240 --kv-cache-dtype fp8_e4m3 ;;
    # The 1000-request stages do not wait for the background warm-up: their own start-up builds what
    # they need (flashinfer locks its JIT modules, so the two share one compile).
    offline_1000) fits offline_1000 280 && run_offline_1000 offline_1000 384 360 8192 ;;
    offline_1000_g512) fits offline_1000_g512 280 && run_offline_1000 offline_1000_g512 384 360 8192 \
      --max-cudagraph-capture-size 512 ;;
    offline_1000_fp8) wait $WARM; fits offline_1000_fp8 170 && run_offline_1000 offline_1000_fp8 384 330 8192 --quantization fp8 ;;
    offline_1000_fp8kv) fits offline_1000_fp8kv 250 && run_offline_1000 offline_1000_fp8kv "${FP8KV_SEQS:-512}" 330 \
      "${FP8KV_CHUNK:-16384}" --quantization fp8 --kv-cache-dtype fp8_e4m3 --max-cudagraph-capture-size "${FP8KV_SEQS:-512}" ;;
    hf) stage hf_b1 120 python3 scripts/gpu/hf_reference.py --model $MODEL --batch-size 1 --output-len 64 --json "$RUN/hf_b1.json" ;;
    tests_8b) wait $WARM; stage tests_8b 240 python3 -m pytest -q -s -p no:cacheprovider tests/gpu -k "8b" ;;
    idle) stage gpu_idle 90 python3 scripts/gpu/gpu_idle.py --json "$RUN/gpu_idle.json" ;;
    # 4 streams of 1024-token prompts (the issue's TTFT/TPOT case) with fixed lengths (the 4 arrive
    # together) and with lengths drawn within +-50% (arrivals spread, as in real traffic); one stream.
    serving) MORE=$SERVING_MORE PYSPY_BENCH=${PYSPY_BENCH:-} stage serving 260 bash scripts/gpu/serve_and_bench.sh "$RUN" serving ;;
    serving_eager_prefill) MORE=$SERVING_MORE SERVE_FLAGS="--piecewise-cuda-graph-max-tokens 0" \
      stage serving_eager_prefill 260 bash scripts/gpu/serve_and_bench.sh "$RUN" serving_eager_prefill ;;
    # Two GPUs (nvidia-h200-x2): TP=2 parity tests, batch-1 decode TP=1 vs TP=2, and the appliance's
    # throughput with one replica vs two (--data-parallel-size 2) at twice the concurrency.
    # ATTN_ARGS: more bench_decode_attention.py flags (--backends, --cases, --kv-dtypes).
    # shellcheck disable=SC2086
    attn) wait $WARM; stage attn 200 python3 scripts/gpu/bench_decode_attention.py --json "$RUN/attn.json" ${ATTN_ARGS:-} ;;
    # The Triton decode kernel's launch options (context tile : warps : stages[ : splits]), both caches.
    attn_sweep) stage attn_sweep 200 python3 scripts/gpu/bench_decode_attention.py --json "$RUN/attn_sweep.json" \
      --triton-configs "${ATTN_CONFIGS:-64:4:3,64:4:2,64:8:3,128:8:2,32:4:3}" \
      --sweep-cases "${ATTN_CASES:-384x1500,64x1500}" ;;
    gemv) stage gemv $((${GEMV_BUDGET:-200} + 60)) python3 scripts/gpu/bench_gemv.py --budget-s "${GEMV_BUDGET:-200}" \
      --weights "${GEMV_WEIGHTS:-bf16,fp8}" --rows "${GEMV_ROWS:-1,4,8,16}" \
      --json "$RUN/gemv.json" ;;
    gemv_chain) stage gemv_chain 300 python3 scripts/gpu/bench_gemv_chain.py --json "$RUN/gemv_chain.json" ;;
    scaled_mm) stage scaled_mm 120 python3 scripts/gpu/bench_scaled_mm.py --json "$RUN/scaled_mm.json" ;;
    overlap) wait $WARM; stage overlap 200 python3 scripts/gpu/bench_overlap.py --splits "${OVERLAP_SPLITS:-256}" \
      --json "$RUN/overlap.json" ;;
    xqa_layout) wait $WARM; stage xqa_layout 200 python3 scripts/gpu/bench_xqa_layout.py \
      --block-sizes "${XQA_BLOCKS:-16,32,64}" --json "$RUN/xqa_layout.json" ;;
    prefill_fp8) wait $WARM; stage prefill_fp8 400 python3 scripts/gpu/bench_prefill_fp8.py --json "$RUN/prefill_fp8.json" ;;
    elementwise) stage elementwise 150 python3 scripts/gpu/bench_elementwise.py --json "$RUN/elementwise.json" \
      --rows "${ELEMENTWISE_ROWS:-1,512,8704}" ;;
    # shellcheck disable=SC2086
    pytest)  # PYTEST_ARGS is parsed as the shell would parse it, so that -k "a and b" stays one argument
      eval "pytest_args=(${PYTEST_ARGS:?PYTEST_ARGS names the tests})"
      stage pytest 240 python3 -m pytest -q -p no:cacheprovider "${pytest_args[@]}" ;;
    tests_fp8w) stage tests_fp8w 280 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_fp8_gpu.py \
      tests/gpu/test_gemv_gpu.py ;;
    tests_gemv) stage tests_gemv 150 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_gemv_gpu.py \
      tests/gpu/test_pipeline_gpu.py ;;
    tests_fi_decode) wait $WARM; stage tests_fi_decode 200 python3 -m pytest -q -s -p no:cacheprovider \
      tests/gpu/test_backends_gpu.py -k "flashinfer_decode_kernels" ;;
    tests_decode) wait $WARM; stage tests_decode 220 python3 -m pytest -q -p no:cacheprovider -k "not 8b" \
      tests/gpu/test_backends_gpu.py tests/gpu/test_fp8_kv_backends.py tests/gpu/test_pipeline_gpu.py \
      tests/gpu/test_greedy_gpu.py ;;
    tests_fp8kv) wait $WARM; stage tests_fp8kv 300 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_fp8_kv_backends.py \
      tests/gpu/test_flashinfer_sampling.py tests/gpu/test_fp8_gpu.py tests/gpu/test_gemv_gpu.py ;;
    tests_tp) wait $WARM; stage tests_tp 200 python3 -m pytest -v -s -p no:cacheprovider -o faulthandler_timeout=100 \
      tests/gpu/test_tensor_parallel_gpu.py ;;
    latency_tp)
      wait $WARM
      latency latency_tp1_b1 flashinfer 1
      latency latency_tp2_b1 flashinfer 1 --tensor-parallel-size 2 ;;
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
