#!/usr/bin/env bash
# The 18-layer windowed map made with product commands only: kvferry fit with a window over target
# layers 18-24, kvferry distill through the target, kvferry eval at every real-pair map's settings.
# Writes runs/maps/smollm2-135m-l18__smollm2-135m/{0.9.0,0.9.1} and logs in runs/logs; never touches maps/.
#   bash scripts/research/l18_product.sh            (after make real-models; about an hour on 2 cores)
set -euo pipefail
cd "$(dirname "$0")/../.."
K=.venv/bin/kvferry
S=models/pretrained/smollm2-135m-l18 T=models/pretrained/smollm2-135m
OUT=runs/maps PAIR=runs/maps/smollm2-135m-l18__smollm2-135m
mkdir -p runs/logs runs/stats
[ -d "$PAIR/0.9.0" ] || $K --threads 2 fit --source $S --target $T --corpus data/calib.jsonl --max-tokens 30720 \
    --k 4 --min-gain 1e-3 --dtype bfloat16 --window 3 --window-layers 18-24 --window-sources 6 \
    --version 0.9.0 --out $OUT --stats runs/stats/l18w3.safetensors > runs/logs/fit_l18w3.log 2>&1
[ -f runs/data/train.jsonl ] || .venv/bin/python scripts/data/write_split.py --split train --out runs/data/train.jsonl
[ -d "$PAIR/0.9.1" ] || $K --threads 2 distill $PAIR/0.9.0 --source $S --target $T --corpus runs/data/train.jsonl \
    --max-tokens 98304 --heldout data/calib.jsonl --held-windows 12 --seq-len 1024 --from-layer 18 --tails 2 \
    --epochs 3 --lr 1e-5 --temperature 2 --seed 11 --version 0.9.1 --out $OUT > runs/logs/distill_l18w3.log 2>&1
for v in ${EVAL_VERSIONS:-0.9.0 0.9.1}; do
  [ -f runs/logs/eval_l18w3_$v.done ] && continue
  $K --threads 2 eval $PAIR/$v --source $S --target $T --prompts 60 --greedy-prompts 8 --recall-prompts 0 \
      --prose data/prose_heldout.jsonl --prose-prompts 40 --write > runs/logs/eval_l18w3_$v.log 2>&1
  touch runs/logs/eval_l18w3_$v.done
done
