#!/usr/bin/env bash
# Re-measure every number quoted in README.md and docs/benchmarks.md (writes runs/results/).
# Usage: scripts/measure_all.sh            (about 20 minutes on 2 CPU cores)
set -euo pipefail
cd "$(dirname "$0")/.."
K=.venv/bin/kvferry
R=runs/results
mkdir -p $R
.venv/bin/python scripts/family/build_family.py card | tee $R/card.txt
$K bench maps --prompts 60 --json $R/variants.json | tee $R/variants.txt
for T in T T64; do
  $K fit --source models/S --target models/$T --out maps --version 1.0.0 --overwrite --quiet | tee $R/fit_S__$T.txt
  $K eval maps/S__$T/1.0.0 --source models/S --target models/$T --prompts 100 --write --json $R/eval_S__$T.json --quiet | tee $R/eval_S__$T.txt
done
$K --threads 2 bench translate --json $R/bench_translate.json | tee $R/bench_translate.txt
$K --threads 2 bench redis --json $R/bench_redis.json | tee $R/bench_redis.txt
