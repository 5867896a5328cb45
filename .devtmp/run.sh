#!/bin/bash
# one device call: issue-42 shapes and the combo-kernel A/B
export FASTGRPO_BENCH_COMMIT=2ee4a9b PYTHONUNBUFFERED=1
START=$(date +%s); END=$((START + ${BUDGET:-545}))
DEADLINE_S=60 bash bench/device_session.sh none >/dev/null 2>&1
O="PYTHONPATH=/tmp/site_t:/tmp/site:$PWD"
P="PYTHONPATH=/tmp/site:$PWD HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1 UNSLOTH_DISABLE_STATISTICS=1 UNSLOTH_COMPILE_LOCATION=/tmp/unsloth_cache HF_HOME=/tmp/hf_home"
go() {  # log cap env cmd...
  local log=$1 cap=$2 left=$((END - $(date +%s))); shift 2
  [ $left -lt 30 ] && { echo "skip $*"; return; }; [ $cap -gt $left ] && cap=$left
  echo "== $* (cap $cap)" >> $OUT/$log.txt
  local t0=$(date +%s)
  env $1 timeout $cap "${@:2}" >> $OUT/$log.txt 2>&1; echo "rc $? $(( $(date +%s) - t0 ))s: ${*:2}"
}
S=qwen2.5-0.5b
go shapes 110 "$O" python3 bench/grpo_step.py --systems fastgrpo --shape $S --completions 1024,4096 --warmup 1 --repeat 2
go shapes 150 "$P" python3 bench/peers/unsloth_step.py 1024 4096 --shape $S --warmup 1 --repeat 2
go shapes 110 "$O" python3 bench/grpo_step.py --systems inductor --shape $S --completions 1024,4096 --warmup 1 --repeat 2
for r in 1 2; do for s in fastgrpo fastgrpo_combo; do
  go combo 80 "$O" python3 bench/grpo_step.py --systems $s --completions 1024 --warmup 2 --repeat 3
done; done
S=gemma-2-2b
go shapes2 100 "$O" python3 bench/grpo_step.py --systems fastgrpo --shape $S --completions 1024 --warmup 1 --repeat 2
go shapes2 120 "$P" python3 bench/peers/unsloth_step.py 1024 --shape $S --warmup 1 --repeat 2
rm -rf $OUT/results; cp bench/results/grpo_step.jsonl $OUT/
grep -hE "^\| [a-z]|Error|error:" $OUT/*.txt | grep -v Warning | tail -30
