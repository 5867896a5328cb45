#!/bin/bash
# The GPU checks and benchmarks of bench/RESULTS.md in one command, in priority order, for a lent H200
# (torch 2.11, triton 3.6, transformers 5.17, no registry). Each step has a time cap and the whole run
# stops before DEADLINE_S, so whatever ran is written under $OUT even when the time box is short.
#
# Needs, carried from the repository root:
#   .whlU/site.tgz   bash ../shared/device/unsloth-site.sh   (Unsloth 2026.10.9, Liger, trl 1.15, bitsandbytes)
#   .whl/*.whl       trl 1.16, datasets, dill, multiprocess   (fastgrpo's trainer targets trl 1.16)
#   .whlT/*.whl      the same four wheels alone (1.8 MB), read when .whl is absent: with .whlU (whose site has
#                    bitsandbytes) both fit one call's 64 MiB, so trainer tests and Unsloth steps share a call
# Usage: DEADLINE_S=560 bash bench/device_session.sh [steps...]   (default: every step, in this order)
#        a step written a+b+c runs a, b and c side by side (for correctness and memory steps, never timings)
#        tests_failed re-runs the tests named in $FAILED_TESTS (pytest arguments, e.g. "-m gpu tests/test_offload.py"),
#        for FAILED_CAP seconds (default 240)
# Test failures are appended to $OUT/test_failures.txt (and $OUT/cuda_failures.txt for tests_on_cuda) as they
# happen, so a step cut by its cap still leaves them. A typical first call of a session:
#   DEADLINE_S=570 bash bench/device_session.sh "tests+tests_on_cuda+qlora+long_run" fastgrpo unsloth
#
# Lessons from 2026-11-29: one process per peer (Liger patches transformers' modules for the whole
# process, and its compiled loss cannot recompile for a second length); GPU tests under xdist with
# -v and a per-test timeout (otherwise a killed run reports nothing); flex_attention and inductor
# compiles of the 28-layer model take minutes: give packed rows their own step. A whole call with side-by-side
# correctness steps and three timed steps used ~415 s of its 570. Unsloth with a 1024-token prompt did not finish
# setup + compile + 3 steps in 120 s (its spread step now has 180 s). On nvidia-h200-x2 (second session of the
# day): "scaling" then "tests_distributed" need both GPUs; single-GPU tests see GPU 0 only (ONE_GPU below).
set -u
START=$(date +%s); DEADLINE=$((START + ${DEADLINE_S:-560}))
OUT=${OUT:-/tmp/fastgrpo-device}; mkdir -p "$OUT"
# Rows each results file holds before the run: only the rows this run appends come back (a call returns a limited
# number of files, and the tree's whole history would crowd out its own output).
declare -A ROWS_BEFORE
for f in bench/results/*.jsonl; do [ -f "$f" ] && ROWS_BEFORE[$f]=$(wc -l < "$f"); done
cap() { local left=$((DEADLINE - $(date +%s))); [ "$left" -lt "$1" ] && echo "$left" || echo "$1"; }
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
# Installed once per machine, so two sessions can run side by side (one per GPU: CUDA_VISIBLE_DEVICES, own OUT).
(
  flock 9
  if [ ! -f /tmp/site/.installed ]; then
    mkdir -p /tmp/site /tmp/site_t
    [ -f .whlU/site.tgz ] && tar xzf .whlU/site.tgz -C /tmp/site
    wheels=.whl; [ -d .whl ] || wheels=.whlT
    [ -d $wheels ] && python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site_t $wheels/*.whl
    python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -2
    touch /tmp/site/.installed
  fi
) 9>/tmp/site.lock
OURS="PYTHONPATH=/tmp/site_t:/tmp/site:$PWD"
PEERS="PYTHONPATH=/tmp/site:$PWD HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1 UNSLOTH_DISABLE_STATISTICS=1 UNSLOTH_COMPILE_LOCATION=/tmp/unsloth_cache HF_HOME=/tmp/hf_home"
# Two warm-up steps: the op graphs capture at a key's second call (fastgrpo/kernels/_graphs.py), so a first timed step
# after one warm-up still captures (Qwen2.5-0.5B at 1024: 505 then 184 ms).
STEP_ARGS=${STEP_ARGS:-"--warmup 2 --repeat 3"}
COMPLETIONS=${COMPLETIONS:-1024,4096,16384}  # of the fastgrpo, actmul and save steps
# The single-GPU tests see one GPU (with two visible, a plain Trainer would use nn.DataParallel, which GRPOTrainer
# refuses); tests_distributed and scaling see them all.
ONE_GPU="CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-0}"
eval "FAILED_TESTS_ARRAY=(${FAILED_TESTS:-})"  # shell words: quoted -k expressions stay one argument

step() {  # name, cap seconds, environment, command...
  local name=$1 seconds; seconds=$(cap "$2"); shift 2
  [ "$seconds" -le 5 ] && { echo "== $name: skipped (time box)"; return; }
  echo "== $name (cap ${seconds}s)"
  env $1 timeout "$seconds" "${@:2}" > "$OUT/$name.txt" 2>&1
  grep -E "RESULT|passed|failed|matched|Error|OOM" "$OUT/$name.txt" | grep -v Warning | tail -20
}

run_step() {
  case $1 in
    tests) step tests ${TESTS_CAP:-240} "$OURS $ONE_GPU FASTGRPO_FAILURE_LOG=$OUT/test_failures.txt" python3 -m pytest -m gpu -v -p no:cacheprovider -n 6 --timeout 150 -rfE --tb=short tests/ ;;
    # STEP_SYSTEMS: padded fastgrpo variants timed in this step (e.g. fastgrpo,fastgrpo_save), STEP_CAP its seconds.
    fastgrpo) step fastgrpo ${STEP_CAP:-160} "$OURS" python3 bench/grpo_step.py --systems ${STEP_SYSTEMS:-fastgrpo} --shape ${SHAPE:-qwen2.5-1.5b} --completions $COMPLETIONS $STEP_ARGS ;;
    unsloth) step unsloth 170 "$PEERS" python3 bench/peers/unsloth_step.py ${UNSLOTH_COMPLETIONS:-1024 4096 16384} --shape ${SHAPE:-qwen2.5-1.5b} $STEP_ARGS ;;
    inductor) step inductor 120 "$OURS" python3 bench/grpo_step.py --systems inductor --shape ${SHAPE:-qwen2.5-1.5b} --completions 1024,4096 $STEP_ARGS ;;
    liger) for c in ${LIGER_COMPLETIONS:-1024 4096 16384}; do step "liger_$c" 80 "$PEERS" python3 bench/grpo_step.py --systems liger --completions $c $STEP_ARGS; done ;;
    eager) step eager 90 "$OURS" python3 bench/grpo_step.py --systems eager --completions 1024,4096 $STEP_ARGS ;;
    # Re-run what failed last time (pytest's cache of failures does not travel: name them in FAILED_TESTS).
    tests_failed) step tests_failed ${FAILED_CAP:-240} "$OURS $ONE_GPU FASTGRPO_FAILURE_LOG=$OUT/test_failures.txt" python3 -m pytest -v -p no:cacheprovider -n 8 --timeout 200 -rfE --tb=short "${FAILED_TESTS_ARRAY[@]}" ;;
    # The policy step on each of SHAPES (bench/_harness.py names), each of SHAPE_SYSTEMS (fastgrpo, unsloth, inductor)
    # one process, at COMPLETIONS (Unsloth at the same lengths); SHAPE_CAP seconds a process.
    shapes)
      for shape in ${SHAPES:-qwen2.5-0.5b gemma-2-2b qwen2.5-7b llama-3.1-8b}; do for system in ${SHAPE_SYSTEMS:-fastgrpo unsloth inductor}; do
        if [ "$system" = unsloth ]; then
          step "unsloth_$shape" ${SHAPE_CAP:-120} "$PEERS" python3 bench/peers/unsloth_step.py ${COMPLETIONS//,/ } --shape $shape $STEP_ARGS
        else
          step "${system}_$shape" ${SHAPE_CAP:-120} "$OURS" python3 bench/grpo_step.py --systems $system --shape $shape --completions $COMPLETIONS $STEP_ARGS
        fi
      done; done ;;
    # Decoder-layer calls replayed as CUDA graphs (fastgrpo/compiler/layer_graphs.py): their GPU tests, then an
    # in-process A/B of the policy step on each of LAYER_GRAPH_SHAPES at 1024 completions.
    layer_graphs) step layer_graph_tests 180 "$OURS $ONE_GPU" python3 -m pytest -m gpu -v -p no:cacheprovider -n 6 --timeout 150 -rfE --tb=short tests/test_layer_graphs.py tests/test_offload.py
      for shape in ${LAYER_GRAPH_SHAPES:-qwen2.5-0.5b qwen2.5-1.5b}; do
        step "layer_graphs_$shape" 150 "$OURS" python3 bench/grpo_step.py --systems fastgrpo --shape $shape --completions 1024 --warmup 3 --repeat 5 --ab fastgrpo.compiler.layer_graphs.ENABLED=False
      done ;;
    # The layer graphs' pool holds one layer call's temporaries, the gated-MLP backward's chunk buffers the largest of
    # them (docs/measurements.md, "What is alive at the 1024 peak"): the 1024 step with smaller chunks, one process each.
    pool_chunks) for mib in ${POOL_CHUNK_MIBS:-256 64 32}; do
        step "pool_chunks_$mib" 110 "$OURS" python3 bench/grpo_step.py --systems fastgrpo --shape ${SHAPE:-qwen2.5-1.5b} --completions 1024 --warmup 3 --repeat 5 --mlp-chunk-mib $mib
      done ;;
    tests_on_cuda) step tests_on_cuda 200 "$OURS $ONE_GPU FASTGRPO_TEST_DEVICE=cuda FASTGRPO_FAILURE_LOG=$OUT/cuda_failures.txt" python3 -m pytest -q -p no:cacheprovider -n 3 --timeout 90 --maxfail 30 tests/test_pass_rms_norm.py tests/test_pass_rope_mlp.py tests/test_pass_selective_logprob.py ;;
    # SPREAD_PROMPT / SPREAD_COMPLETIONS: prompt length and longest completion of the spread rows (default 256 / 4096);
    # PACKED_CAP: the packed step's seconds.
    packed) step packed ${PACKED_CAP:-220} "$OURS" python3 bench/grpo_step.py --systems ${PACKED_SYSTEMS:-fastgrpo,fastgrpo_packed,fastgrpo_shared} --spread --prompt "${SPREAD_PROMPT:-256}" --completions ${SPREAD_COMPLETIONS:-4096} $STEP_ARGS ;;
    unsloth_spread) step unsloth_spread 180 "$PEERS" python3 bench/peers/unsloth_step.py ${SPREAD_COMPLETIONS:-4096} --spread --prompt "${SPREAD_PROMPT:-256}" $STEP_ARGS ;;
    offload) step offload 150 "$OURS" python3 bench/bench_offload.py --completions 4096,16384 $STEP_ARGS ;;
    offload_save) step offload_save 130 "$OURS" python3 bench/bench_offload.py --system fastgrpo_save --completions 4096,16384 $STEP_ARGS ;;
    qlora) step qlora 200 "$OURS TORCH_LOGS=recompiles" python3 bench/grpo_qlora_step.py --offload ;;
    # The QLoRA whole step under each of QLORA_AB's settings (";"-separated lists of MODULE.ATTR=VALUE for
    # grpo_qlora_step.py --set; an empty list is the tree as it is), one process each, in order (list them twice to
    # alternate); QLORA_CAP seconds a run. E.g. the NF4 kernel's launch before 394fb62 against the tree:
    # QLORA_AB="fastgrpo.kernels.nf4_lora_linear._BLOCK_N=64 fastgrpo.kernels.nf4_lora_linear._PROGRAMS_PER_SM=2;;" (then
    # the tree; repeat the whole string, ending in ";;", to alternate twice); QLORA_ARGS are added to every run
    # (e.g. "--steps 6")
    qlora_ab)
      local n=0 settings s
      IFS=';' read -ra QLORA_RUNS <<< "${QLORA_AB:-;}"
      for settings in "${QLORA_RUNS[@]}"; do
        local flags=""
        for s in $settings; do flags="$flags --set $s"; done
        n=$((n + 1)); step "qlora_ab_$n" ${QLORA_CAP:-120} "$OURS" python3 bench/grpo_qlora_step.py --offload ${QLORA_ARGS:-} $flags
      done ;;
    # Rollouts: the engine's tokens/s against the weight + KV read limit (GENERATION_ARGS, e.g. --shape gemma3-1b),
    # and its decode attention kernel against SDPA over the whole cache.
    generation) step generation ${GENERATION_CAP:-240} "$OURS" python3 bench/bench_generation.py ${GENERATION_ARGS:-} ;;
    decode_attention) step decode_attention 120 "$OURS" python3 bench/bench_decode_attention.py ${DECODE_ATTENTION_ARGS:-} ;;
    # The NF4 decode linear's forms (register table, joined) at the launch as it is, 8 and 64 rows (NF4_ARGS replaces
    # the arguments, e.g. "--rows 8 --sweep lut" for every launch setting of one form); its
    # outputs are checked against bitsandbytes + PEFT before the timing.
    nf4_forms) step nf4_forms ${NF4_CAP:-90} "$OURS" python3 bench/bench_nf4_linear.py ${NF4_ARGS:---rows 8 64 --sweep forms} ;;
    # Rollouts of a hybrid decoder (gated DeltaNet + attention: bench/_harness.py's qwen3.5-text-defaults), and
    # its GPU tests (CUDA-graph decode of hybrids, tests/test_generation_recurrent.py).
    hybrid) step hybrid_tests 200 "$OURS" python3 -m pytest -m gpu -v -p no:cacheprovider --timeout 190 -rfE --tb=short tests/test_generation_recurrent.py
      step hybrid_generation 200 "$OURS" python3 bench/bench_generation.py --shape qwen3.5-text-defaults --cases ${HYBRID_CASES:-64x256,128x512} ;;
    # Plain sampling as fastgrpo::race_sample against the eager race, one process each, alternating twice.
    fused_sampling)
      for fused in 0 1 0 1; do
        step "fused_sampling_$fused" 110 "$OURS" python3 bench/bench_generation.py --cases ${FUSED_CASES:-64x256,128x512} --fused-sampling $fused
      done ;;
    # GRPO groups of 8 rows: each row reading its prompt's one KV copy (1), a copy each (0, engine.SHARED_PROMPT_SLOTS
    # off), or the group's prompt attended once a step in every layer (g, engine.GROUPED_PROMPT_ATTENTION=True):
    # rollouts at SHARED_CASES of SHARED_SHAPE, one process each, in SHARED_ORDER (default: g 1 0, twice).
    shared_slots)
      local n=0
      for mode in ${SHARED_ORDER:-g 1 0 g 1 0}; do
        local flags="--shared-prompt-slots 1 --grouped-prompt 1"
        [ "$mode" = g ] || flags="--shared-prompt-slots $mode --grouped-prompt 0"
        n=$((n + 1)); step "shared_slots_${n}_$mode" 120 "$OURS" python3 bench/bench_generation.py --shape ${SHARED_SHAPE:-qwen2.5-1.5b} --generations 8 --cases ${SHARED_CASES:-64x512,128x512} $flags
      done ;;
    # The whole step with the generator's cache, graphs and joined copies kept between rollouts (0) or freed after
    # each (1, fastgrpo_generation_release_memory): step time against peak, one process each, alternating twice.
    release_memory)
      for release in 0 1 0 1; do
        step "release_memory_$release" ${TRAIN_CAP:-240} "$OURS" python3 bench/grpo_train_step.py --system fastgrpo \
          --shape ${TRAIN_SHAPES:-qwen2.5-1.5b} --steps 3 --release-memory $release ${TRAIN_ARGS:-}
      done ;;
    # The whole GRPO step (trainer.train(): generation, scoring, update) of fastgrpo's trainer and stock TRL's, one
    # process each, for each of TRAIN_SHAPES (bench/_harness.py names) and TRAIN_SYSTEMS (a system named twice runs
    # twice: the second finds the first's compile cache). TRAIN_ARGS are added to every run (e.g. "--steps 1");
    # TRAIN_PROFILE=1 writes each run's first-step cProfile next to its output.
    train_step)
      local n=0
      for shape in ${TRAIN_SHAPES:-qwen2.5-1.5b}; do for system in ${TRAIN_SYSTEMS:-fastgrpo trl}; do
        n=$((n + 1)); local name="train_${n}_${shape}_${system}"
        step "$name" ${TRAIN_CAP:-240} "$OURS" python3 bench/grpo_train_step.py --system $system --shape $shape \
          ${TRAIN_ARGS:-} ${TRAIN_PROFILE:+--profile-first $OUT/$name.pstats}
      done; done ;;
    long_run) step long_run ${LONG_RUN_CAP:-200} "$OURS" python3 bench/long_run.py --steps 200 --window 50 --max-completion 768 ;;
    # 2 GPUs (nvidia-h200-x2): DDP throughput of 2 GPUs against one process alone on one GPU, and the 2-GPU tests
    # of tests/test_distributed.py (DDP and FSDP2 through accelerate == 1 GPU; FSDP2 + inductor).
    # SCALING_BASELINE: the JSON lines of an earlier 1-GPU launch (same code path) instead of timing it again.
    scaling)
      [ -n "${SCALING_BASELINE:-}" ] ||
        step scaling_1gpu 150 "$OURS OUT=$OUT" torchrun --nproc_per_node 1 bench/grpo_scaling.py --completions 1024,4096 --warmup 3 --repeat 8
      step scaling_2gpu 170 "$OURS OUT=$OUT" torchrun --nproc_per_node 2 bench/grpo_scaling.py --completions 1024,4096 --warmup 3 --repeat 8 ${SCALING_BASELINE:+--baseline "$SCALING_BASELINE"} ;;
    tests_distributed) step tests_distributed 300 "$OURS FASTGRPO_FAILURE_LOG=$OUT/test_failures.txt" python3 -m pytest -m gpu -v -p no:cacheprovider --timeout 290 -rfE --tb=short tests/test_distributed.py ;;
    actmul) step actmul 160 "$OURS" python3 bench/grpo_step.py --systems fastgrpo_actmul --completions $COMPLETIONS $STEP_ARGS ;;
    # Where the step's time goes (kernel categories, GPU busy vs span, the host's cProfile), fastgrpo and Unsloth.
    profile) step profile 170 "$OURS" python3 bench/grpo_step.py --systems fastgrpo --completions 1024,4096 --warmup 2 --repeat 2 --profile-at 1024,4096
      step unsloth_profile 170 "$PEERS" python3 bench/peers/unsloth_step.py 1024 4096 --warmup 1 --repeat 2 --profile-at 1024,4096 ;;
    # What is alive at the peak of a step (MEMORY_PEAK_ARGS; by default the packed steps: the op keeping gate/up
    # against the act_mul form, and the shared prompt).
    memory_peak) step memory_peak 200 "$OURS" python3 bench/memory_peak.py ${MEMORY_PEAK_ARGS:---systems fastgrpo_packed,fastgrpo_packed_save,fastgrpo_shared --spread --prompt ${SPREAD_PROMPT:-1024}} ;;
    # Launch configurations of the RMSNorm (small widths, plain and with the residual add) and RoPE kernels.
    kernel_sweeps) step rms_sweep ${RMS_SWEEP_CAP:-150} "$OURS" python3 bench/bench_rms_norm.py --hidden ${RMS_SWEEP_HIDDEN:-576 1536} --sweep ${RMS_SWEEP_KINDS:-}
      step rope_sweep 60 "$OURS" python3 bench/bench_rope.py --sweep
      step act_mul_sweep 90 "$OURS" python3 bench/bench_gated_mlp.py --sweep-act-mul ;;
    # The gated-MLP block (down projection included) against inductor, eager and Liger; then where the op's GPU
    # time goes against inductor's (MLP_PROFILE_VARIANT: lora or plain).
    mlp_block) step mlp_block 200 "$OURS" python3 bench/bench_gated_mlp.py --block ;;
    # The same block under gradient checkpointing (y = x + mlp(x)), as the GRPO trainer runs it.
    mlp_checkpointed) step mlp_checkpointed 200 "$OURS" python3 bench/bench_gated_mlp.py --block --checkpointed ;;
    mlp_profile) step mlp_profile 90 "$OURS" python3 bench/bench_gated_mlp.py --block --profile-only --shapes qwen2.5-1.5b --profile-variant ${MLP_PROFILE_VARIANT:-lora} ;;
    rms_bench) step rms_bench 150 "$OURS" python3 bench/bench_rms_norm.py ;;
    # The same without dW (a frozen norm weight, as in every LoRA step).
    rms_frozen) step rms_frozen 150 "$OURS" python3 bench/bench_rms_norm.py --frozen-weight ;;
    rope_bench) step rope_bench 90 "$OURS" python3 bench/bench_rope.py ;;
    # Every provider's forward and forward + backward as CUDA graphs, ROPE_ROUNDS rounds taking turns.
    rope_rounds) step rope_rounds 150 "$OURS" python3 bench/bench_rope.py --rounds ${ROPE_ROUNDS:-5} ;;
    # Host time of one call of the RMSNorm and RoPE ops, eager and in a compiled training block (triton_ops).
    op_host) step op_host 90 "$OURS" python3 bench/bench_op_host.py ;;
    # SDPA's kernels (flash, cuDNN, memory-efficient) on the step's attention shapes: what the attention pattern picks.
    attention_bench) step attention_bench 120 "$OURS" python3 bench/bench_attention.py ;;
    # The lm-head log-prob op against TRL, inductor and Liger (LOGPROB_IMPLS), and its tile configurations.
    logprob_bench) step logprob_bench 200 "$OURS" python3 bench/bench_selective_logprob.py --impls ${LOGPROB_IMPLS:-fastgrpo fastgrpo_recompute trl compiled liger} ;;
    logprob_sweep) step logprob_sweep 150 "$OURS" python3 bench/bench_selective_logprob.py --sweep ;;
    save) step save 160 "$OURS" python3 bench/grpo_step.py --systems fastgrpo_save --completions $COMPLETIONS $STEP_ARGS ;;
    # Where the GPU waits in the step (STEP_SYSTEMS at PROFILE_AT tokens): kernel time, idle gaps, and for each gap
    # whether the host launched the kernel after it late or the kernel sat queued (gap_causes).
    device_profile) step device_profile ${STEP_CAP:-160} "$OURS" python3 bench/grpo_step.py --systems ${STEP_SYSTEMS:-fastgrpo} --shape ${SHAPE:-qwen2.5-1.5b} --completions ${PROFILE_AT:-4096} --warmup 1 --repeat 2 --profile-at ${PROFILE_AT:-4096} --device-profile-only ;;
    # A code change timed against what it replaced, in one call (lent machines differ by several % on the same
    # step): the fastgrpo step on this tree and on a copy of its fastgrpo/ and bench/ with the files under .baseline/
    # laid over them, twice each, alternating. Make them here, e.g. `mkdir -p .baseline/fastgrpo/kernels && git show
    # REV:fastgrpo/kernels/gated_mlp.py > .baseline/fastgrpo/kernels/gated_mlp.py`, and carry .baseline. The copy runs
    # from its own directory with itself first on PYTHONPATH, ahead of the editable install of this tree; its JSON
    # lines go to $OUT/baseline/. BASELINE_ARGS replaces the step's system argument, e.g. for the packed spread batch
    # BASELINE_ARGS="--systems fastgrpo_packed --spread".
    baseline)
      [ -d .baseline ] || { echo "baseline: no .baseline/ to lay over the tree"; return; }
      rm -rf /tmp/baseline_tree && mkdir -p /tmp/baseline_tree "$OUT/baseline" && cp -r fastgrpo bench /tmp/baseline_tree/ \
        && cp -r .baseline/. /tmp/baseline_tree/
      for round in 1 2; do
        step "now_$round" ${STEP_CAP:-120} "$OURS" python3 bench/grpo_step.py ${BASELINE_ARGS:---systems fastgrpo} --completions $COMPLETIONS $STEP_ARGS
        step "baseline_$round" ${STEP_CAP:-120} "PYTHONPATH=/tmp/baseline_tree:/tmp/site_t:/tmp/site FASTGRPO_BENCH_RESULTS=$OUT/baseline" bash -c "cd /tmp/baseline_tree && \
          exec python3 bench/grpo_step.py ${BASELINE_ARGS:---systems fastgrpo} --completions $COMPLETIONS $STEP_ARGS"
      done ;;
    *) echo "unknown step $1" ;;
  esac
}

STEPS=${*:-tests fastgrpo unsloth inductor liger eager packed unsloth_spread offload qlora generation long_run save}
for s in $STEPS; do
  if [[ $s == *+* ]]; then
    # a+b+c: run side by side and wait for all. Only for steps whose numbers are per process (correctness,
    # peak memory): timed steps must run alone.
    for part in ${s//+/ }; do run_step "$part" & done
    wait
  else
    run_step "$s"
  fi
done
# The JSON lines the benches appended to bench/results/ in this run come back with $OUT, a file for each bench.
mkdir -p "$OUT/results"
for f in bench/results/*.jsonl; do
  [ -f "$f" ] || continue
  before=${ROWS_BEFORE[$f]:-0}
  [ "$(wc -l < "$f")" -gt "$before" ] && tail -n +$((before + 1)) "$f" > "$OUT/results/$(basename "$f")"
done
STEP_ROWS=${FASTGRPO_BENCH_RESULTS:-bench/results}/grpo_step.jsonl  # where the benches wrote (harness.results_path)
[ -f "$STEP_ROWS" ] && python3 bench/grpo_step.py --merge "$STEP_ROWS"
