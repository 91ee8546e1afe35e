#!/usr/bin/env bash
# One device-box run: installs the carried wheels, then runs the GPU phases named in $PHASES
# (default: tests pool capture; all: tests prefix soak server served), each bounded by its own timeout, logging everything under $OUT.
# Usage (device tool, carry .whl): PHASES="tests capture" bash scripts/gpu_check.sh
set -uo pipefail
OUT=${OUT:-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
# Once per machine: several invocations in one call (each with its own settings) share the install.
[ -f /tmp/site/.installed ] || { python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl >"$OUT/pip.log" 2>&1 && touch /tmp/site/.installed; } ||
  { echo "wheel install failed"; tail "$OUT/pip.log"; exit 1; }
export PYTHONPATH=/tmp/site:$PWD:$PWD/service PATH=/tmp/site/bin:$PATH
phase() {  # name, timeout seconds, command...
  local name=$1 t=$2; shift 2
  echo "=== $name ($(date -u +%H:%M:%S))"
  # The card sampled each second while the phase runs: a run slower than its twin at lower clocks was throttled.
  nvidia-smi --query-gpu=clocks.sm,temperature.gpu,power.draw --format=csv,noheader,nounits -l 1 \
    >"$OUT/$name.gpu.csv" 2>/dev/null & local smi=$!
  timeout "$t" "$@" >"$OUT/$name.log" 2>&1; local rc=$?
  kill "$smi" 2>/dev/null
  echo "--- $name rc=$rc"; tail -n "${TAIL:-25}" "$OUT/$name.log"
  # Clocks only while busy (over 250 W): an idle card parks its clocks low.
  awk -F', *' 'NF >= 3 && $3 > 250 { n++; if (!lo || $1 < lo) lo = $1; if ($1 > hi) hi = $1; if ($2 > t) t = $2
    if ($3 > w) w = $3 } END { if (n) printf "    gpu busy: SM clock %d-%d MHz, up to %d C and %d W (%d s)\n",
    lo, hi, t, w, n }' "$OUT/$name.gpu.csv"
  # At most 8 files come back from the device: every log so far, packed again after each phase, returns even
  # when a later phase runs the call out of time (the per-second CSV has been summarized above).
  rm -f "$OUT/$name.gpu.csv"
  (cd "$OUT" && find . -name '*.log' | tar czf logs.tgz -T - 2>/dev/null)
}
old_bench_files() {  # this tree's benchmark files into the old tree (.old); a tree from before the engine's
  # stage folders (no engine/loop) gets the old module paths
  cp benchmarks/offline_throughput.py benchmarks/workloads.py benchmarks/model_shapes.py benchmarks/step_trace.py \
    benchmarks/roofline.py .old/benchmarks/ &&
    { [ -d .old/service/graphcache/engine/loop ] ||
      sed -i -E 's/graphcache\.engine\.(loop|sched|worker|sample)\./graphcache.engine./g' .old/benchmarks/*.py; }
}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c 'import torch; print("torch", torch.__version__, torch.cuda.get_device_name())'
for p in ${PHASES:-tests pool capture}; do
  case $p in
    # Every file with cuda-marked tests (grep -l "mark.cuda" tests/*.py tests/*/*.py), found afresh each run.
    tests)   phase tests 420 python3 -m pytest -q -m cuda -p no:cacheprovider \
               $(grep -l "mark.cuda" tests/*.py tests/*/*.py) -rfs --durations=15 ${PYTEST_ARGS:-} ;;
    # The cuda tests of the files named in $TEST_FILES only (a quicker check of what a change touched).
    tests_some) phase tests_some 420 python3 -m pytest -q -m cuda -p no:cacheprovider ${TEST_FILES:?name test files} -rfs ;;
    sampler) phase sampler 120 python3 benchmarks/sampler_bench.py --out "$OUT/sampler.json" ${SAMPLER_ARGS:-} ;;
    # The attention kernels alone; *_ARGS: --kv-cache-dtype fp8 (an FP8 cache), --shapes, --cases; *_TAG names the run.
    kernels) phase kernels${DECODE_ATTN_TAG:-} 200 python3 benchmarks/decode_attention_bench.py ${DECODE_ATTN_ARGS:-} ;;
    mixed_attn) phase mixed_attn${MIXED_ATTN_TAG:-} 300 python3 benchmarks/mixed_attention_bench.py ${MIXED_ATTN_ARGS:-} ;;
    # Dense prefill kernels (cuDNN / flash / efficient SDPA, FlexAttention, varlen) against the unified kernel (issue 41).
    prefill_attn) TAIL=${TAIL:-90} phase prefill_attn 300 python3 benchmarks/prefill_attention_bench.py \
               --out "$OUT/prefill_attn.json" ${PREFILL_ATTN_ARGS:-} ;;
    decode_step) phase decode_step 400 python3 benchmarks/decode_step.py --make-qwen05b /tmp/qwen05b \
               --modes "${DECODE_MODES:-full,breakable,varlen,eager}" --out "$OUT/decode_step.json" ;;
    offline_old) (cd .old && phase offline_old 400 python3 benchmarks/offline_throughput.py \
               --model /tmp/qwen05b --modes "${OFFLINE_MODES:-graph}" --out "$OUT/offline_old.json") ;;
    tests_sdpa)  GRAPHCACHE_ATTENTION_BACKEND=sdpa phase tests_sdpa 240 python3 -m pytest -q -m cuda -p no:cacheprovider \
                   tests/gpu/test_runner_cuda.py tests/gpu/test_engine_cuda.py -rs ;;
    tests_flash) GRAPHCACHE_ATTENTION_BACKEND=flash phase tests_flash 240 python3 -m pytest -q -m cuda -p no:cacheprovider \
                   tests/gpu/test_runner_cuda.py tests/gpu/test_engine_cuda.py -rs ;;
    tests_paged) GRAPHCACHE_BLOCK_SIZE=256 GRAPHCACHE_ATTENTION_BACKEND=flash_paged phase tests_paged 240 python3 -m pytest -q -m cuda -p no:cacheprovider \
                   tests/gpu/test_runner_cuda.py tests/gpu/test_engine_cuda.py -rs ;;
    host_step) phase host_step 200 python3 benchmarks/host_step.py --batch 256 --steps 300 ;;
    host_step_old) (cd .old && phase host_step_old 200 python3 benchmarks/host_step.py --batch 256 --steps 300) ;;
    pool)    phase pool 150 python3 benchmarks/pool_eviction.py --out "$OUT/pool_eviction.json" ;;
    warmup)  TRITON_CACHE_DIR=$(mktemp -d) phase warmup 300 python3 benchmarks/warmup_bench.py --make-qwen05b /tmp/qwen05b \
               --out "$OUT/warmup.json" ${WARMUP_ARGS:-} ;;
    cache_load) phase cache_load 420 python3 benchmarks/cache_load.py --make-qwen05b /tmp/qwen05b \
               --clients "${CACHE_LOAD_CLIENTS:-64}" --duration "${CACHE_LOAD_DURATION:-60}" --log-dir "$OUT" \
               --out "$OUT/cache_load.json" ${CACHE_LOAD_ARGS:-} ;;
    capture) phase capture 300 python3 benchmarks/capture_bench.py --out "$OUT/capture_bench.json" ;;
    offline) phase offline 540 python3 benchmarks/offline_throughput.py --make-qwen05b /tmp/qwen05b \
               --modes "${OFFLINE_MODES:-graph,eager,hf}" --out "$OUT/offline${OFFLINE_TAG:-}.json" ${OFFLINE_ARGS:-} ;;
    offline256) GRAPHCACHE_BLOCK_SIZE=256 phase offline256 300 python3 benchmarks/offline_throughput.py \
               --make-qwen05b /tmp/qwen05b --modes graph --out "$OUT/offline_block256.json" ;;
    profile) phase profile 300 python3 benchmarks/profile_engine.py --make-qwen05b /tmp/qwen05b \
               --mode "${PROFILE_MODE:-graph}" --top 40 --out "$OUT/profile.txt" ;;
    served)  GRAPHCACHE_ENGINE_PROCESS=false phase served 420 python3 benchmarks/served_throughput.py --make-qwen05b /tmp/qwen05b \
               --clients "${SERVED_CLIENTS:-64}" --duration "${SERVED_DURATION:-30}" --out "$OUT/served.json" \
               --log "$OUT/served_server.log" ${SERVED_ARGS:-} ;;
    served_proc) GRAPHCACHE_ENGINE_PROCESS=true phase served_proc 420 python3 benchmarks/served_throughput.py \
               --make-qwen05b /tmp/qwen05b --clients "${SERVED_CLIENTS:-64}" --duration "${SERVED_DURATION:-30}" \
               --out "$OUT/served_proc.json" --log "$OUT/served_proc_server.log" ${SERVED_ARGS:-} ;;
    server)  phase server 420 python3 benchmarks/server_check.py --make-qwen05b /tmp/qwen05b \
               --out "$OUT/server_check.json" --log "$OUT/server.log" ;;
    prefix)  phase prefix 420 python3 benchmarks/prefix_burst.py --make-qwen05b /tmp/qwen05b \
               --out "$OUT/prefix_burst.json" ${PREFIX_ARGS:-} ;;
    router)  phase router 540 python3 benchmarks/router_bench.py --replicas 2 --make-qwen05b /tmp/qwen05b --device cuda \
               --kv-blocks 0 --replica-setting gpu_memory_utilization=0.4 --replica-setting max_num_seqs=64 \
               --replica-setting max_num_batched_tokens=4096 --requests "${ROUTER_REQUESTS:-2000}" --concurrency 32 \
               --system-words 400 --log-dir "$OUT/router" --out "$OUT/router.json" ${ROUTER_ARGS:-} ;;
    soak)    phase soak $(( ${SOAK_DURATION:-300} + 280 )) python3 benchmarks/soak.py --make-qwen05b /tmp/qwen05b \
               --duration "${SOAK_DURATION:-300}" --out "$OUT/soak.json" --log-dir "$OUT" ${SOAK_ARGS:-} ;;
    # Realistic offline traffic (lognormal lengths, sampling, 2x max_num_seqs requests) next to nano's, graph and eager, steps by kind.
    # REALISTIC_ARGS / REALISTIC_WORKLOADS / REALISTIC_TAG: other flags, workloads and a name for the run.
    realistic) phase realistic${REALISTIC_TAG:-} 540 python3 benchmarks/offline_throughput.py --make-model qwen05b:/tmp/qwen05b \
               --modes "${REALISTIC_MODES:-graph,eager}" --workload "${REALISTIC_WORKLOADS:-nano,realistic}" \
               --out "$OUT/realistic${REALISTIC_TAG:-}.json" ${REALISTIC_ARGS:-} ;;
    # The same workloads on the old tree (.old): this tree's benchmark files are copied in (they use only its engine APIs).
    realistic_old) old_bench_files && (cd .old && phase realistic_old 540 python3 \
               benchmarks/offline_throughput.py --make-model qwen05b:/tmp/qwen05b --modes "${REALISTIC_MODES:-graph,eager}" \
               --workload nano,realistic --out "$OUT/realistic_old.json") ;;
    # The 8B shape on the old tree; REALISTIC8_OLD_ARGS: more flags (--realistic-requests 1024).
    realistic_llama8b_old) old_bench_files && (cd .old && phase realistic_llama8b_old 590 python3 benchmarks/offline_throughput.py \
               --make-model llama8b:/tmp/llama8b --modes "${REALISTIC_MODES:-graph}" --workload "${REALISTIC8_WORKLOADS:-realistic}" \
               --out "$OUT/realistic_llama8b_old.json" ${REALISTIC8_OLD_ARGS:-}) ;;
    # Both workloads on a Llama-3-8B-shaped random bf16 checkpoint (written on the GPU first, about a minute).
    # REALISTIC8_ARGS: more offline_throughput flags (--max-num-seqs 512 --realistic-requests 512); REALISTIC8_TAG names the run.
    realistic_llama8b) phase realistic_llama8b${REALISTIC8_TAG:-} 590 python3 benchmarks/offline_throughput.py \
               --make-model llama8b:/tmp/llama8b --modes "${REALISTIC_MODES:-graph,eager}" \
               --workload "${REALISTIC8_WORKLOADS:-nano,realistic}" --out "$OUT/realistic_llama8b${REALISTIC8_TAG:-}.json" \
               ${REALISTIC8_ARGS:-} ;;
    # One decode step, wall vs GPU, at the Llama-3-8B shape. DECODE_ARGS: more flags, e.g. "--batches 1,16,64 --small-gemm off,on"
    # (settings.engine.bf16_small_gemm off, then on: the bf16 decode GEMMs of 1-64 rows through model/bf16_gemv.py).
    decode_step_llama8b) phase decode_step_llama8b 500 python3 benchmarks/decode_step.py --make-model llama8b:/tmp/llama8b \
               --modes "${DECODE_MODES:-full,eager}" --out "$OUT/decode_step_llama8b.json" ${DECODE_ARGS:-} ;;
    # Poisson arrivals per rate against the served engine: TTFT/TPOT/ITL p50/p99, goodput; OPEN_LOOP_MODEL=qwen05b|llama8b.
    open_loop) m=${OPEN_LOOP_MODEL:-qwen05b}; TAIL=${TAIL:-45} phase open_loop_$m 590 python3 benchmarks/open_loop.py --make-model "$m:/tmp/$m" \
               --rates "${OPEN_LOOP_RATES:-2,8,32,inf}" --out "$OUT/open_loop_$m.json" --log "$OUT/open_loop_${m}_server.log" \
               ${OPEN_LOOP_ARGS:-} ;;
    # Issue 41's TTFT bar (~6 min at 8B): saturation (512 at once), then 60 s windows at 0.5x of it without and after a
    # burst of 512, at the server's default slots, 4 client processes; server queue/prefill/TTFT, captures, Triton JITs.
    # GRAPHCACHE_* in the environment reach the server (e.g. GRAPHCACHE_ADMISSION=never: no lazy captures).
    open_loop_ttft) m=${OPEN_LOOP_MODEL:-llama8b}; TAIL=${TAIL:-45} phase open_loop_ttft_$m 520 python3 benchmarks/open_loop.py \
               --make-model "$m:/tmp/$m" --rates "${OPEN_LOOP_RATES:-sat,0.5x}" --duration 60 --burst 512 --max-num-seqs 0 \
               --client-procs 4 --out "$OUT/open_loop_ttft_$m.json" --log "$OUT/open_loop_ttft_${m}_server.log" ${OPEN_LOOP_ARGS:-} ;;
    # Per-kernel CUDA time of a decode, a mixed and a prefill step against its roofline bound, at both shapes.
    # KERNEL_TABLE_ARGS: other step shapes (--decode-rows 1 --kinds decode, --quantization fp8); KERNEL_TABLE_TAG names them.
    kernel_table) for m in ${KERNEL_TABLE_MODELS:-qwen05b llama8b}; do TAIL=${TAIL:-120} phase kernel_table_$m${KERNEL_TABLE_TAG:-} 300 \
               python3 benchmarks/kernel_table.py --make-model "$m:/tmp/$m" ${KERNEL_TABLE_ARGS:-} \
               --out "$OUT/kernel_table_$m${KERNEL_TABLE_TAG:-}.json"; done ;;
    # Mixed steps past 256 tokens at both shapes: eager vs breakable vs full graphs, capture s, pool MiB, padding.
    big_steps) phase big_steps 420 python3 benchmarks/big_steps.py --make-model qwen05b:/tmp/qwen05b \
               --make-model llama8b:/tmp/llama8b --out "$OUT/big_steps.json" ${BIG_STEPS_ARGS:-} ;;
    # Mixture of experts: the grouped-GEMM and MoE-model GPU tests alone.
    moe_tests) phase moe_tests 300 python3 -m pytest -q -m cuda -p no:cacheprovider tests/gpu/test_moe_cuda.py \
               -rs --durations=10 ;;
    # A Qwen3-30B-A3B-layer MoE (16 layers, 128 experts, top-8; ~21 GB bf16, written on the GPU first) offline,
    # graph and eager, nano and realistic workloads.
    # MOE_SHAPE: qwen3moe (default) or mixtral (benchmarks/model_shapes.py).
    moe)     phase moe "${MOE_TIMEOUT:-540}" python3 benchmarks/offline_throughput.py \
               --make-model "${MOE_SHAPE:-qwen3moe}:/tmp/${MOE_SHAPE:-qwen3moe}" \
               --modes "${MOE_MODES:-graph,eager}" --workload "${MOE_WORKLOADS:-nano,realistic}" --out "$OUT/moe.json" ;;
    # FP8 (issue 25): the Llama-3-8B shape in bf16 and with --quantization fp8: full-graph decode at batch 1 and 256,
    # logits error and greedy agreement against bf16, the GEMM kernels (fp8_sweep: the decode kernel's designs).
    fp8) phase fp8 420 python3 benchmarks/fp8_bench.py --make-model llama8b:/tmp/llama8b --out "$OUT/fp8.json" ${FP8_ARGS:-} ;;
    # Decode-sized FP8 GEMM designs (fp8 dot with x quantized inside, W dequantized to bf16, FMA, split K) per 8B shape.
    fp8_sweep) TAIL=${TAIL:-60} phase fp8_sweep 300 python3 benchmarks/fp8_gemv_sweep.py --out "$OUT/fp8_sweep.json" \
               ${FP8_SWEEP_ARGS:-} ;;
    # FP8 GEMMs at 17-512 rows: cuBLASLt's row-scaled _scaled_mm (the engine's path there) against a Triton W8A8
    # kernel's tiles, per 8B shape and in a layer's sum (issue 41). FP8_MID_ARGS: --rows 64,134.
    fp8_mid) TAIL=${TAIL:-40} phase fp8_mid 300 python3 benchmarks/fp8_mid_rows_sweep.py --out "$OUT/fp8_mid.json" \
               ${FP8_MID_ARGS:-} ;;
    # Small-batch bf16 GEMMs (M = 1..64): cuBLAS against model/bf16_gemv.py's tiles per 8B and 0.5B shape, the best tile
    # per (M bucket, N, K) as a TILES table (issue 41). BF16_SWEEP_ARGS: --rows 1,16 / --shapes 8b.qkv,8b.o.
    bf16_sweep) TAIL=${TAIL:-80} phase bf16_sweep 300 python3 benchmarks/bf16_gemv_sweep.py --out "$OUT/bf16_sweep.json" \
               ${BF16_SWEEP_ARGS:-} ;;
    # The FP8 GPU tests alone (kernels vs the CPU emulation, graph replay vs eager).
    tests_fp8) phase tests_fp8 300 python3 -m pytest -q -m cuda -p no:cacheprovider tests/gpu/test_fp8_cuda.py -rs ;;
    # Offline throughput of the 8B shape, nano workload, graph mode: bf16, then --quantization fp8.
    fp8_offline) for q in auto fp8; do GRAPHCACHE_QUANTIZATION=$q phase fp8_offline_$q 400 python3 benchmarks/offline_throughput.py \
               --make-model llama8b:/tmp/llama8b --modes graph --workload nano --out "$OUT/fp8_offline_$q.json"; done ;;
    # Speculative decoding (issue 37, benchmarks/spec_decode.py): 1 and 8 streams without and with the n-gram proposer on
    # copy prompts, one decode and one verify step per k (1,2,4,8) at 1 and 8 rows, TPOT against what they predict.
    # SPEC_MODEL=qwen05b|llama8b|llama8btied (n-gram drafts every step); SPEC_ARGS: more flags (--self-draft, --draft-model DIR, --output-len 128, --k 8).
    spec) m=${SPEC_MODEL:-qwen05b}; TAIL=${TAIL:-40} phase spec_$m 480 python3 benchmarks/spec_decode.py \
               --make-model "$m:/tmp/$m" --out "$OUT/spec_$m.json" ${SPEC_ARGS:-} ;;
    # The realistic offline workload at the defaults, graph mode, without and with n-gram speculation configured:
    # the throughput ratio (issue 37: >= 0.97). SPEC_MODEL as above; SPEC_REALISTIC_ARGS: --realistic-requests N.
    spec_realistic) m=${SPEC_MODEL:-qwen05b}; phase spec_realistic_$m 560 python3 benchmarks/spec_decode.py \
               --make-model "$m:/tmp/$m" --streams none --ks "" --realistic --out "$OUT/spec_realistic_$m.json" \
               ${SPEC_REALISTIC_ARGS:-} ;;
    # LoRA (issue 38, benchmarks/lora_bench.py): an engine without --enable-lora, then one with --max-loras 4 and four
    # random rank-16 adapters: the realistic workload (512 requests) without adapters and mixed over them, one stream
    # with and without, a fifth adapter loaded at runtime under load (step times around it); a PASS/FAIL table.
    # LORA_MODEL=llama8b|qwen05b; LORA_ARGS: more flags (--realistic-requests 1024, --repeats 1).
    lora) m=${LORA_MODEL:-llama8b}; TAIL=${TAIL:-70} phase lora_$m 540 python3 benchmarks/lora_bench.py \
               --make-model "$m:/tmp/$m" --out "$OUT/lora_$m.json" ${LORA_ARGS:-} ;;
    # The LoRA kernels alone (issue 38, benchmarks/lora_kernel_bench.py): per 8B projection, T and slot mix, the kernels
    # before against now (serial, and the shrink forked beside the base GEMM), ms and ratio to the base GEMM in a graph.
    # LORA_KERNELS_ARGS: a subset (--ts 1,512 --projections qkv,o --iters 10).
    lora_kernels) TAIL=${TAIL:-60} phase lora_kernels 540 python3 benchmarks/lora_kernel_bench.py \
               --out "$OUT/lora_kernels.json" ${LORA_KERNELS_ARGS:-} ;;
    # Greedy equality with speculation (issue 37; benchmarks/spec_decode.py --greedy-check): GREEDY_N (64) greedy requests,
    # 8 at a time, without and with n-gram and a draft model, per dtype in GREEDY_DTYPES (one a call: float32 = equal
    # expected, bfloat16 = near ties may flip); identical share, first divergence positions, top-2 margins there.
    # GREEDY_DRAFT: the draft (default the self-draft; in float32 at 8B two 8B models need 64 GB: use
    # GREEDY_DRAFT="--draft-model llama1b:/tmp/llama1b" there).
    spec_greedy) m=${SPEC_MODEL:-llama8b}; for d in ${GREEDY_DTYPES:-bfloat16}; do TAIL=${TAIL:-12} phase spec_greedy_${m}_$d 560 \
               python3 benchmarks/spec_decode.py --make-model "$m:/tmp/$m" --greedy-check "${GREEDY_N:-64}" --dtype "$d" \
               ${GREEDY_DRAFT:---self-draft} --token-cost 0 --output-len 128 --max-num-seqs 64 \
               --out "$OUT/spec_greedy_${m}_$d.json" ${SPEC_GREEDY_ARGS:-}; done ;;
    *) echo "unknown phase $p" ;;
  esac
done
