#!/usr/bin/env bash
# Wall time of a decay-branch ablation against the from-scratch design, on the demo (CPU), in one script run:
#   bash ablations/measure_branch.sh [OUT]           # default OUT: runs/measure-branch
# Default: configs/demo.yaml as it is (its 13.6M model, corpus, batch, LR, sequence-length warmup, 308
# steps, the anneal and the LR decay from step 277, checkpoints every 50 steps). QUICK=1: 60,000 tokens
# (75 steps, anneal from 67); TINY=1: the tiny model at 32 tokens per sequence, 100 steps, anneal from 90.
# Measured: the stable phase once plus 3 arms x 3 replicates (python -m ablations.branch, report
# excluded), then ONE from-scratch run of the same budget (every arm and seed of the from-scratch design
# costs the same): the from-scratch design of 3 arms x 3 seeds is 9 such runs. The report (held-out loss
# only) is timed apart. Figures: ablations/README.md.
set -euo pipefail
OUT=${1:-runs/measure-branch}
PY=${PY:-.venv/bin/python}
SCALE=(--run.wandb false)
if [[ -n "${QUICK:-}" ]]; then
  SCALE=(--data.schedule.train_tokens 60000 --run.val_every_n_steps 1000 --run.ckpt_every_n_steps 1000 --run.wandb false)
fi
if [[ -n "${TINY:-}" ]]; then
  SCALE=(--model.model configs/model/tiny.yaml --data.schedule.train_tokens 12800 --data.schedule.seq_len.start 32
         --data.schedule.seq_len.end 32 --data.schedule.seq_len.multiple 32 --data.schedule.seq_len.warmup_steps 0
         --model.lr.warmup_steps 5 --data.val_tokens_per_source 256 --run.val_every_n_steps 1000
         --run.ckpt_every_n_steps 1000 --run.wandb false)
fi
t0=$(date +%s)
"$PY" -m ablations.branch --from "$OUT/stable" --train-stable --arms ablations/demo_branch_arms.yaml \
    --out "$OUT/branches" --no-report -- --config configs/demo.yaml "${SCALE[@]}"
t1=$(date +%s)
"$PY" -m train fit --config configs/demo.yaml --config ablations/demo_scheduled.yaml --run.val_every_n_steps 100 \
    "${SCALE[@]}" \
    --run.dir "$OUT/scratch"
t2=$(date +%s)
"$PY" ablations/report.py "$OUT/branches" --suite heldout || true
t3=$(date +%s)
b=$((t1 - t0)); s=$((t2 - t1))
echo "branch ablation (stable once + 9 branches): ${b} s; one from-scratch run: ${s} s, x 9 = $((9 * s)) s;" \
     "ratio $((100 * b / (9 * s)))%; report: $((t3 - t2)) s"
