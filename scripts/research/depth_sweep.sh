#!/usr/bin/env bash
# Issue 13: how deep must a depth-cut source be for the closed-form map to keep the target's long-range copying?
# Per-token ridge maps (k = 4, --min-gain 1e-3, bf16) from the first N layers of SmolLM2-135M, every N fitted on the
# same 20,480 calibration tokens into runs/maps (never maps/), then the copy probe on fresh held-out prompts
# (seed 11, the research tables' prompts) with the shipped l25 map beside them.
#   bash scripts/research/depth_sweep.sh "10 12 15 18 20"      # 3.3-6.1 min a fit, then ~6 min of probes, on 2 cores
set -euo pipefail
cd "$(dirname "$0")/../.."
DEPTHS=${1:-"10 12 15 18 20"}
MAPS=()
for N in $DEPTHS; do
  .venv/bin/kvferry models cut smollm2-135m --layers "$N"
  .venv/bin/kvferry --threads 2 fit --source "models/pretrained/smollm2-135m-l$N" --target models/pretrained/smollm2-135m \
    --corpus data/calib.jsonl --max-tokens 20480 --dtype bfloat16 --min-gain 1e-3 --out runs/maps --version 0.9.0 --quiet
  MAPS+=("runs/maps/smollm2-135m-l${N}__smollm2-135m/0.9.0")
done
.venv/bin/python scripts/research/copy_levers.py --maps "${MAPS[@]}" maps/smollm2-135m-l25__smollm2-135m/0.2.0 \
  --gaps 500,1000,3000 --prompts 5 --refresh 16 --out runs/results/depth_sweep_copy
