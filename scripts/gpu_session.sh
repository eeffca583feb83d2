#!/usr/bin/env bash
# The GPU figures of docs/benchmarks.md as one re-runnable device call (the tool library's `device` entry):
#
#   run(command="bash scripts/gpu_session.sh", carry=[".whl", ".triton_cache"])
#
# Jobs run in the order below. A job that ends (pass or fail) leaves a marker in $STATE and is skipped by
# later calls on the same warm machine, so repeating the same call continues where the last one stopped;
# a job still running DEADLINE seconds after the call started is killed and runs again next call
# (bench_grpo_trl.py --reuse keeps the systems it already finished). Logs and JSON land in $OUT.
#
# fla's Triton autotuning costs minutes per process on a fresh machine. TRITON_CACHE_AUTOTUNING keeps the
# chosen configs in Triton's cache, which lives in /tmp (kept between calls on a warm machine) and is seeded
# from a carried .triton_cache/ (git-ignored). The whole cache is far over what comes back (2026-11-30: over
# 60 MB compressed, mostly every candidate config's compiled kernel), so only the autotune results come
# back, as $OUT/triton_autotune.tgz (logs and JSON in $OUT/results.tgz): `tar xzf triton_autotune.tgz -C
# .triton_cache` in the repo root, then carry .triton_cache: Triton then compiles the chosen configs only.
#
# JOBS="grpo rollout" bash scripts/gpu_session.sh   # a subset, in that order
#
# DEADLINE must stay under the call's real limit with room for packing the results: near the end of a
# session's device budget the limit is what is left (2026-11-30: a call asked for 590 s got 533 s; 2026-12-02:
# with 300 s left a call got 190 s, since the machine's start counts too), and a
# call killed before the tar at the end returns nothing. Pipe nothing through `tail`: a killed pipe prints
# nothing either; the run tool already keeps the last 12,000 characters.
set -u
START=$SECONDS
DEADLINE=${DEADLINE:-560}
STATE=/tmp/gpu_session
OUT=${OUT:-$STATE/out}
mkdir -p "$STATE" "$OUT"
bash .whl/install.sh >/dev/null || { echo "wheel install failed"; exit 1; }
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 TRITON_CACHE_AUTOTUNING=1
export TRITON_CACHE_DIR=/tmp/triton_cache_k3 TORCHINDUCTOR_CACHE_DIR=/tmp/inductor_cache_k3
export NCCL_NVLS_ENABLE=0  # NVLink multicast off on the multi-GPU kinds (the device tool's notes say why)
if [ -d .triton_cache ] && [ ! -e "$STATE/cache_seeded" ]; then
    mkdir -p "$TRITON_CACHE_DIR" && cp -rn .triton_cache/. "$TRITON_CACHE_DIR"/ && touch "$STATE/cache_seeded"
fi

job() {  # job NAME COMMAND...: run unless done; timeout -> not done
    local name=$1 left rc
    shift
    [ -e "$STATE/$name.done" ] && return 0
    left=$((DEADLINE - (SECONDS - START)))
    if ((left < 30)); then echo "== $name: no time left in this call"; return 0; fi
    echo "== $name: start $(date -u +%H:%M:%S), $left s left: $*"
    timeout -k 5 "$left" "$@" >>"$STATE/$name.log" 2>&1
    rc=$?
    echo "== $name: rc=$rc at $(date -u +%H:%M:%S)"
    tail -n 40 "$STATE/$name.log"
    if ((rc != 124 && rc != 137)); then echo "$rc" >"$STATE/$name.done"; fi
}

run_job() {
    case $1 in
    grpo) job grpo python scripts/bench_grpo_trl.py --device cuda --preset k3-small --steps 5 --warmup 1 \
        --k3-form --work-dir /tmp/bgt --reuse --json "$STATE/grpo_vs_trl.json" ;;
    rollout) job rollout python scripts/bench_rollout.py --device cuda --batch-sizes 1,8,64 --peer hf \
        --rl-path --json "$STATE/bench_rollout.json" ;;
    tests) job tests python -m pytest tests/gpu/test_engine_cuda.py -q -rfE --tb=short -p no:cacheprovider ;;
    compile) job compile python scripts/bench_rollout.py --device cuda --batch-sizes 1,64 --compile-decode \
        --json "$STATE/bench_rollout_compile.json" ;;
    parity) job parity python -m pytest tests/gpu/test_cuda_parity.py tests/gpu/test_megatron_gpu.py -q -m gpu -rfE \
        --tb=short -p no:cacheprovider ;;
    megatron) job megatron python -m pytest tests/gpu/test_megatron_gpu.py -q -m gpu -rfE --tb=short \
        -p no:cacheprovider ;;
    logprobs) job logprobs python scripts/bench_logprobs.py --device cuda --tokens 8192,32768 \
        --json "$STATE/bench_logprobs.json" ;;
    cp) job cp python -m pytest tests/gpu/test_context_parallel_gpu.py -q -m gpu -rA --tb=short \
        -p no:cacheprovider ;;
    engine) job engine python scripts/bench_rollout.py --device cuda --batch-sizes 1,8,64 --rl-path \
        --json "$STATE/bench_rollout_engine.json" ;;
    unified) job unified python scripts/bench_unified_memory.py --device cuda --json "$STATE/bench_unified_memory.json" ;;
    trainmem) job trainmem python scripts/bench_train_memory.py --device cuda --preset k3-small \
        --lengths 1024,4096,16384 --json "$STATE/bench_train_memory.json" ;;
    rollout256) job rollout256 python scripts/bench_rollout.py --device cuda --batch-sizes 1,8,64,256 --peer hf \
        --rl-path --json "$STATE/bench_rollout_256.json" ;;
    grpo1k_ours) job grpo1k_ours python scripts/bench_grpo_trl.py --device cuda --preset k3-small --steps 3 --warmup 1 \
        --prompts 64 --samples 8 --max-new-tokens 1024 --ignore-eos --k3-form --skip-trl --work-dir /tmp/bgt1k \
        --reuse --json "$STATE/grpo1k_ours.json" ;;
    grpo1k) job grpo1k python scripts/bench_grpo_trl.py --device cuda --preset k3-small --steps 2 --warmup 1 \
        --prompts 64 --samples 8 --max-new-tokens 1024 --ignore-eos --trl-micro-batch 32 --work-dir /tmp/bgt1k \
        --reuse --json "$STATE/grpo1k_vs_trl.json" ;;  # one timed step a side: TRL's alone is minutes
    grpo1k_kimi) job grpo1k_kimi python scripts/bench_grpo_trl.py --device cuda --preset k3-small --steps 2 --warmup 1 \
        --prompts 64 --samples 8 --max-new-tokens 1024 --ignore-eos --skip-trl --work-dir /tmp/bgt1k --reuse \
        --json "$STATE/grpo1k_kimi.json" ;;  # our side of grpo1k alone (the Kimi-Linear form, the row TRL's compares to)
    # the same with one rollout wave of 512 (two waves of 256 by the recipe): 1,023 steps at batch 512, not 2 x 1,023
    grpo1k_kimi512) job grpo1k_kimi512 python scripts/bench_grpo_trl.py --device cuda --preset k3-small --steps 2 \
        --warmup 1 --prompts 64 --samples 8 --max-new-tokens 1024 --ignore-eos --skip-trl --work-dir /tmp/bgt1k512 \
        --ours-override rollout.max_running=512 --reuse --json "$STATE/grpo1k_kimi512.json" ;;
    grpo1k_trl) job grpo1k_trl python scripts/bench_grpo_trl.py --device cuda --preset k3-small --steps 2 --warmup 1 \
        --prompts 64 --samples 8 --max-new-tokens 1024 --ignore-eos --trl-micro-batch 32 --skip-ours \
        --work-dir /tmp/bgt1k --reuse --json "$STATE/grpo1k_trl.json" ;;  # TRL's side alone: a call of its own
    trainmem32) job trainmem32 python scripts/bench_train_memory.py --device cuda --preset k3-small \
        --lengths 4096,16384,32768 --variants baseline,recompute,logprobs --json "$STATE/bench_train_memory_32k.json" ;;
    spectest) job spectest python -m pytest tests/gpu/test_spec_gpu.py -q -m gpu -rA --tb=short -p no:cacheprovider ;;
    specbench) job specbench python scripts/bench_spec.py --target preset:k3-small --peaked --drafter controlled:0.8 \
        --device cuda --dtype bfloat16 --batch-sizes 1,8,64,256 --planners verify_all,cost_aware \
        --rollback replay --temperatures 0 --prompt-len 128 --gen-len 64 --memory-gb 16 \
        --json "$STATE/bench_spec_h200.json" ;;
    specbench_big) job specbench_big python scripts/bench_spec.py --target preset:k3-small --peaked \
        --drafter controlled:0.8 --device cuda --dtype bfloat16 --batch-sizes 64,256 --planners verify_all \
        --rollback replay --temperatures 0 --prompt-len 128 --gen-len 64 --memory-gb 16 \
        --json "$STATE/bench_spec_big_h200.json" ;;  # specbench's large batches, verify_all only (a short call)
    specsmall) job specsmall python scripts/bench_spec.py --target preset:k3-small --peaked --drafter controlled:0.8 \
        --device cuda --dtype bfloat16 --batch-sizes 1,8 --planners verify_all,cost_aware --rollback replay \
        --temperatures 0 --prompt-len 128 --gen-len 64 --memory-gb 16 \
        --json "$STATE/bench_spec_small_h200.json" ;;  # specbench's small batches, where a step is launch-bound
    specprof_small) job specprof_small python scripts/profile_spec.py --device cuda --batch-sizes 1,8 \
        --planners verify_all --gen-len 32 --rows 30 ;;
    specshadow) job specshadow python scripts/bench_spec.py --target preset:k3-small --peaked --drafter controlled:0.8 \
        --drafter-cost dspark --device cuda --dtype bfloat16 --batch-sizes 1,8,64,256 --planners verify_all \
        --rollback replay --temperatures 0 --prompt-len 128 --gen-len 64 --memory-gb 16 \
        --json "$STATE/bench_spec_shadow_h200.json" ;;  # the same with a real (untrained) DSpark drafter's cost
    specgate) job specgate python scripts/bench_spec.py --target preset:k3-small --peaked --drafter controlled:0.8 \
        --drafter-cost dspark --max-batch 32 --device cuda --dtype bfloat16 --batch-sizes 64,256 \
        --planners verify_all --rollback replay --temperatures 0 --prompt-len 128 --gen-len 64 --memory-gb 16 \
        --json "$STATE/bench_spec_gate_h200.json" ;;  # above 32 rows plain steps: against specshadow's 64 / 256
    specplan) job specplan python scripts/bench_spec.py --target preset:k3-small --peaked --drafter controlled:0.8 \
        --drafter-cost dspark --device cuda --dtype bfloat16 --batch-sizes 1,8,64,256 \
        --planners verify_all,cost_aware --rollback replay --temperatures 0 --prompt-len 128 --gen-len 64 \
        --memory-gb 16 --json "$STATE/bench_spec_plan_h200.json" ;;  # the planner (plain steps where no block pays)
    specmix) job specmix python scripts/bench_spec.py --target preset:k3-small --peaked --drafter controlled:0.3-0.95 \
        --drafter-cost dspark \
        --device cuda --dtype bfloat16 --batch-sizes 64,256 --planners verify_all,cost_aware --rollback replay \
        --temperatures 0 --prompt-len 128 --gen-len 64 --memory-gb 16 --json "$STATE/bench_spec_mixed_h200.json" ;;
    specprof) job specprof python scripts/profile_spec.py --device cuda --batch-sizes 256 \
        --planners verify_all --gen-len 32 --rows 30 ;;
    specprof_dspark) job specprof_dspark python scripts/profile_spec.py --device cuda --batch-sizes 1,256 \
        --planners verify_all --gen-len 32 --rows 30 --drafter-cost dspark ;;  # where a real drafter's time goes
    specprof_plan) job specprof_plan python scripts/profile_spec.py --device cuda --batch-sizes 1 \
        --planners verify_all,cost_aware --gen-len 64 --rows 20 --drafter-cost dspark ;;  # the planner's spec steps
    specprof_plan256) job specprof_plan256 python scripts/profile_spec.py --device cuda --batch-sizes 256 \
        --planners cost_aware --gen-len 64 --rows 25 --drafter-cost dspark ;;  # the planner's plain steps at 256
    decode256) job decode256 python scripts/bench_rollout.py --device cuda --batch-sizes 1,256 \
        --json "$STATE/bench_rollout_1_256.json" ;;  # plain decoding only, no peer: a short A/B of the step
    # issue 19 (needs nvidia-h200-x2 / -x4): the trainer's layouts through miles-train against one GPU, k3-small
    layouts2) job layouts2 python scripts/bench_layouts.py --recipe k3_small_gpu \
        --layouts single,tp2,sp2,dp2,pp2,ep2,cp2 --steps 2 --work-dir /tmp/layouts --timeout 900 \
        --json "$STATE/layouts2.json" ;;
    # the colocated loop's device memory per phase, nothing offloaded vs the trainer's and engine's idle state on
    # the host (issue 43's memory phases)
    memphases) job memphases python scripts/bench_memory_phases.py --recipe k3_small_gpu --steps 3 \
        --work-dir /tmp/memphases --json "$STATE/memphases.json" ;;
    # the K3-scale loop on two GPUs: engine replicas on the trainer's ranks, the adapter synced shard to shard
    loop2) job loop2 python scripts/bench_layouts.py --recipe k3_small_gpu \
        --layouts single,dp2,tp2_etp2,pp2_etp2,ep2_etp2 --steps 3 --work-dir /tmp/loop2 --timeout 900 \
        --json "$STATE/loop2.json" ;;
    loop4) job loop4 python scripts/bench_layouts.py --recipe k3_small_gpu --layouts single,tp2_pp2_etp4 \
        --steps 3 --work-dir /tmp/loop4 --timeout 900 --json "$STATE/loop4.json" ;;
    layouts4) job layouts4 python scripts/bench_layouts.py --recipe k3_small_gpu --layouts single,tp2_pp2,pp2_ep2 \
        --steps 2 --work-dir /tmp/layouts4 --timeout 900 --json "$STATE/layouts4.json" ;;
    # the sharded engine's layouts against one GPU (greedy agreement, decode tok/s at 1 / 64 / 256, KV per GPU)
    engine2) job engine2 python scripts/bench_engine_layouts.py --device cuda --layouts single,tp2,tp2_dcp2,ep2 \
        --batch-sizes 1,64,256 --json "$STATE/engine_layouts2.json" ;;
    engine4) job engine4 python scripts/bench_engine_layouts.py --device cuda --layouts single,tp4,tp4_dcp2,tp4_dcp4,ep4 \
        --batch-sizes 1,64,256 --json "$STATE/engine_layouts4.json" ;;
    specdrafttest) job specdrafttest python -m pytest tests/gpu/test_spec_gpu.py -q -m gpu -rA --tb=short \
        -p no:cacheprovider -k drafter ;;
    specdraft) job specdraft python scripts/bench_spec.py --target preset:k3-small --peaked --drafter controlled:0.8 \
        --drafter-cost dspark --device cuda --dtype bfloat16 --batch-sizes 1,8 --planners verify_all \
        --rollback replay --temperatures 0 --prompt-len 128 --gen-len 64 --memory-gb 16 \
        --json "$STATE/bench_spec_draft_h200.json" ;;  # specplan's small batches: the drafter from CUDA graphs
    specprof0) job specprof0 env MILES_K3_KERNELS=0 python scripts/profile_spec.py --device cuda --batch-sizes 256 \
        --planners verify_all --gen-len 32 --rows 30 ;;  # the same without our kernels (2026-12-02: 1.5x faster)
    trainmem_long) job trainmem_long python scripts/bench_train_memory.py --device cuda --preset k3-small \
        --lengths 16384,32768 --variants logprobs --json "$STATE/bench_train_memory_long.json" ;;
    kernelsq) job kernelsq python -m pytest tests/gpu/test_decode_kernels.py -q -m gpu -rA --tb=short -p no:cacheprovider \
        -k "not compiled" ;;  # without the torch.compile test (minutes of inductor)
    rolloutpeer) job rolloutpeer python scripts/bench_rollout.py --device cuda --batch-sizes 1,8,64,256 --peer hf \
        --json "$STATE/bench_rollout_peer.json" ;;
    mlabench) job mlabench python scripts/bench_mla.py --device cuda --batch-sizes 1,64,256 --histories 512,2048,8192 \
        --json "$STATE/bench_mla.json" ;;  # the MLA kernel alone against the torch path, one layer, seconds
    # the MLA attention A/B at a 2k-token history (2026-12-02: the kernel's first version, fp32 FMA dots, made the
    # 512-token step 1.5x-2.6x slower; this version runs its dots on tensor cores)
    longctx) job longctx python scripts/bench_rollout.py --device cuda --batch-sizes 1,64,256 --prompt-len 2048 \
        --gen-len 32 --prefill-len 512 --group-prompts 1 --group-n 2 --overlap off --mla-attention triton \
        --json "$STATE/bench_longctx.json" ;;
    longctx0) job longctx0 python scripts/bench_rollout.py --device cuda --batch-sizes 1,64,256 --prompt-len 2048 \
        --gen-len 32 --prefill-len 512 --group-prompts 1 --group-n 2 --overlap off --mla-attention torch \
        --json "$STATE/bench_longctx0.json" ;;
    # where the 1k-token GRPO train phase's time goes, ours against PEFT on transformers (TRL's train phase)
    profiletrain) job profiletrain python scripts/profile_train.py --device cuda --preset k3-small \
        --json "$STATE/profile_train.json" ;;
    profiletrain_ours) job profiletrain_ours python scripts/profile_train.py --device cuda --preset k3-small --skip-peer \
        --json "$STATE/profile_train_ours.json" ;;
    # by-kernel tables of decode steps at batch 1 and 256 (512- and 2,048-token prompts): what grows with the batch
    decodeprof) job decodeprof python scripts/bench_rollout.py --device cuda --batch-sizes 1,256 --gen-len 48 \
        --overlap off --profile "$STATE/decodeprof" --json "$STATE/decodeprof.json" ;;
    # the same with the overlap schedule on (the engine's default): does the host or the device set the step?
    decodeprof_on) job decodeprof_on python scripts/bench_rollout.py --device cuda --batch-sizes 256 --gen-len 48 \
        --profile "$STATE/decodeprof_on" --json "$STATE/decodeprof_on.json" ;;
    decodeprof_long) job decodeprof_long python scripts/bench_rollout.py --device cuda --batch-sizes 256 \
        --prompt-len 2048 --gen-len 32 --prefill-len 512 --group-prompts 1 --group-n 2 --overlap off \
        --profile "$STATE/decodeprof_long" --json "$STATE/decodeprof_long.json" ;;
    # where the GRPO loop's rollout step goes at batch 512 (MXFP4 experts, a rank-16 adapter, sampled)
    rlprof) job rlprof python scripts/bench_rollout.py --device cuda --batch-sizes 512 --gen-len 48 --sampled \
        --rl-path --profile "$STATE/decodeprof_rl" --json "$STATE/decodeprof_rl.json" ;;
    # decode as an RL rollout samples (temperature 1, a seed per request) at batch 1 / 64 / 256 / 512
    decodesampled) job decodesampled python scripts/bench_rollout.py --device cuda --batch-sizes 1,64,256,512 \
        --gen-len 64 --sampled --json "$STATE/decode_sampled.json" ;;
    samplingtest) job samplingtest python -m pytest tests/gpu/test_decode_kernels.py -q -m gpu -rA --tb=short \
        -p no:cacheprovider -k sampling ;;
    advtest) job advtest python -m pytest tests/gpu/test_decode_kernels.py -q -m gpu -rA --tb=short -p no:cacheprovider \
        -k "advancing or pooled or frozen" ;;  # the fold's and verify's recurrence against decode steps, bit for bit
    # the decode kernels against what they replace, at k3-small's shapes, inside CUDA graphs (a minute)
    decodekernels) job decodekernels python scripts/bench_decode_kernels.py --json "$STATE/bench_decode_kernels.json" ;;
    # the grouped expert GEMMs compiled in bf16 (bf16 and MXFP4 weights) and the engine with them (seconds)
    experttest) job experttest python -m pytest tests/gpu/test_engine_cuda.py -q -m gpu -rA --tb=short \
        -p no:cacheprovider -k "expert_gemms or graph_decode_equals or graph_decode_with" ;;
    kernels) job kernels python -m pytest tests/gpu/test_decode_kernels.py -q -m gpu -rA --tb=short -p no:cacheprovider ;;
    # routing replay on k3-small: the bf16 trainer against the MXFP4 engine, 50 GRPO steps with the trainer's own
    # routers and 50 replaying the engine's (issue 45; one arm a call: JOBS=routingoff, then JOBS=routingon)
    routingoff) job routingoff python scripts/bench_routing.py --recipe k3_small_gpu --steps 50 --arms off --reuse \
        --work-dir "$STATE/routing" --json "$STATE/bench_routing_off.json" ;;
    routingon) job routingon python scripts/bench_routing.py --recipe k3_small_gpu --steps 50 --arms rollout \
        --reuse --work-dir "$STATE/routing" --json "$STATE/bench_routing_on.json" ;;
    # exact mode (issue 45): k3-small in bf16, the engine's base the trainer's, eager steps; the same run in the
    # builds' own orders beside it (its |d logp| and its speed)
    exact) job exact python scripts/bench_exact.py --recipe k3_small_gpu --steps 6 --reuse --work-dir "$STATE/exact" \
        --json "$STATE/bench_exact.json" rollout.quantize=none rollout.cuda_graphs=false rollout.prompts_per_step=16 \
        rollout.samples_per_prompt=4 ;;
    # asynchronous RL (issue 44): k3-small colocated on GPU 0, then with one engine server of its own on GPU 1 at
    # staleness 0 / 1 / 2 (needs an x2 kind)
    async2) job async2 python scripts/bench_async.py --recipe k3_small_gpu --steps 8 --staleness 0,1,2 --servers 1 \
        --work-dir /tmp/async2 --json "$STATE/bench_async2.json" ;;
    *) echo "unknown job $1"; return 1 ;;
    esac
}

for name in ${JOBS:-grpo tests rollout parity compile}; do
    run_job "$name"
done

(cd "$STATE" && tar czf "$OUT/results.tgz" ./*.log ./*.json ./decodeprof* 2>/dev/null)
(cd "$TRITON_CACHE_DIR" 2>/dev/null && find . -name '*.autotune.json' -print0 | tar czf "$OUT/triton_autotune.tgz" --null -T -)
echo "done jobs: $(cd "$STATE" && ls ./*.done 2>/dev/null | tr '\n' ' '); $((SECONDS - START)) s"
