#!/usr/bin/env bash
# Re-measure every number quoted in README.md, docs/benchmarks.md and docs/rollout.md (writes runs/results/).
# Usage: scripts/measure_all.sh            (about 35 minutes on 2 CPU cores for the tiny family; QWEN=1 adds the Qwen2.5-Coder
#        pair's evaluation and bench, about 1 h 40 min more; the vLLM bench needs `make test-vllm` first)
set -euo pipefail
cd "$(dirname "$0")/.."
K=.venv/bin/kvferry
R=runs/results
mkdir -p $R
.venv/bin/python scripts/family/build_family.py card | tee $R/card.txt
$K bench maps --prompts 60 --json $R/variants.json | tee $R/variants.txt
# Refits go to runs/maps (never over the shipped maps/: measuring does not overwrite a shipped artifact); the shipped
# maps are re-evaluated without --write, so their recorded evidence stays what shipped.
M=runs/maps
for T in T T64; do
  $K fit --source models/S --target models/$T --out $M --version 1.0.0 --overwrite --quiet | tee $R/fit_S__$T.txt
  $K eval maps/S__$T/1.0.0 --source models/S --target models/$T --prompts 100 --json $R/eval_S__$T.json --quiet | tee $R/eval_S__$T.txt
done
$K fit --source models/S --target models/T --out $M --version 1.1.0 --dtype bfloat16 --overwrite --quiet | tee $R/fit_S__T_1.1.0.txt
$K eval maps/S__T/1.1.0 --source models/S --target models/T --prompts 100 --json $R/eval_S__T_1.1.0.json --quiet | tee $R/eval_S__T_1.1.0.txt
for a in maps/S__T/1.0.0 maps/S__T/1.1.0 maps/S__T64/1.0.0; do $K maps inspect $a; done | tee $R/inspect.txt
$K --threads 2 bench translate --sizes 2048 8192 --reps 5 --json $R/bench_translate.json | tee $R/bench_translate.txt
$K --threads 2 bench hits --sizes 2048 8192 --reps 11 --json $R/bench_hits.json | tee $R/bench_hits.txt
$K --threads 2 bench rollout --json $R/bench_rollout.json | tee $R/bench_rollout.txt
$K --threads 2 bench load --clients 32 --requests 200 --json $R/bench_load.json | tee $R/bench_load.txt
make fuzz | tee $R/fuzz.txt
if [ -x .venv-vllm/bin/kvferry ]; then
  .venv-vllm/bin/kvferry bench vllm --json $R/bench_vllm.json | tee $R/bench_vllm.txt
fi
if [ "${QWEN:-0}" = 1 ]; then
  Q="--source qwen2.5-coder-0.5b --target qwen2.5-coder-1.5b"
  P=qwen2.5-coder-0.5b__qwen2.5-coder-1.5b
  $K eval maps/$P/0.6.1 $Q --prompts 30 --max-len 384 --greedy-prompts 4 --recall-prompts 0 --copy-gaps 500,1000,3000 \
    --copy-prompts 12 --prose data/prose_heldout.jsonl --prose-prompts 20 --completion-tasks 16 --json $R/eval_qwen.json
  rm -rf runs/bench_maps && mkdir -p runs/bench_maps && cp -r maps/$P runs/bench_maps/
  $K --threads 2 bench translate $Q --maps-dir runs/bench_maps --sizes 2048 8192 --reps 1 --json $R/bench_translate_qwen.json
fi
