#!/usr/bin/env bash
# Continue the l18 map's distillation on twice the train-split text, then evaluate it with
# 12 copy prompts per gap beside the shipped 0.2.0 re-measured the same way (copies in runs/; maps/ untouched).
#   bash scripts/research/l18_margin.sh     (after make real-models; about 45 minutes on 2 cores)
set -euo pipefail
cd "$(dirname "$0")/../.."
mkdir -p runs/logs
[ -f runs/data/train.jsonl ] || .venv/bin/python scripts/data/write_split.py --split train --out runs/data/train.jsonl
K=.venv/bin/kvferry
S=models/pretrained/smollm2-135m-l18 T=models/pretrained/smollm2-135m
PAIR=runs/maps/smollm2-135m-l18__smollm2-135m
date
[ -d "$PAIR/0.9.2" ] || $K --threads 2 distill maps/smollm2-135m-l18__smollm2-135m/0.2.0 --source $S --target $T \
    --corpus runs/data/train.jsonl --max-tokens 196608 --heldout data/calib.jsonl --held-windows 12 --seq-len 1024 \
    --from-layer 18 --tails 2 --epochs 2 --lr 1e-5 --temperature 2 --seed 12 --version 0.9.2 --out runs/maps \
    > runs/logs/distill_l18_092.log 2>&1
date
$K --threads 2 eval $PAIR/0.9.2 --source $S --target $T --prompts 60 --greedy-prompts 8 --recall-prompts 0 \
    --prose data/prose_heldout.jsonl --prose-prompts 40 --copy-prompts 12 --write --json runs/logs/eval_l18_092.json \
    > runs/logs/eval_l18_092.log 2>&1
date
# the shipped 0.2.0 on the same 12 prompts per gap (copy probe only, printed and kept in runs/; its manifest untouched)
$K --threads 2 eval maps/smollm2-135m-l18__smollm2-135m/0.2.0 --source $S --target $T --only-copy --copy-prompts 12 \
    --quiet --json runs/logs/copy12_l18_020.json
