#!/usr/bin/env bash
# The README's main command: set up, build the embedded demo corpus, look at the plan and the order,
# train the demo model on 2 CPU cores (a few minutes), report held-out loss per source, evaluate, diagnose.
# It writes runs/demo (configs/demo.yaml's run.dir); an earlier runs/demo is moved aside to
# runs/demo-<its date>, never deleted. It ends by naming the run directory and the next commands,
# the same lines as the README's "After the demo" (tests/integration/test_docs_commands.py runs them).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
PY=.venv/bin/python
RUN=runs/demo
if [ -e "$RUN" ]; then
    OLD="runs/demo-$(date -r "$RUN" +%Y%m%d-%H%M%S)"
    n=1
    while [ -e "$OLD" ]; do OLD="runs/demo-$(date -r "$RUN" +%Y%m%d-%H%M%S)-$n"; n=$((n + 1)); done
    mv "$RUN" "$OLD"
    echo "== an earlier $RUN moved aside to $OLD (nothing deleted)"
fi
mkdir -p "$RUN"

echo "== 1. the demo corpus (Dolma3 schema, built from CPython's own text)"
$PY scripts/make_demo_corpus.py --out demo_corpus

echo "== 2. the plan: tokens per source, implied epochs, schedules ($RUN/plan.png)"
$PY scripts/plan.py --config configs/demo.yaml --out "$RUN/plan.png"

echo "== 3. the first steps of the order, 2 ranks x 2 workers ($RUN/order.jsonl)"
$PY scripts/dump_order.py --config configs/demo.yaml --steps 4 --world-size 2 --num-workers 2 \
    --batch-size 2 --out "$RUN/order.jsonl"
$PY - "$RUN/order.jsonl" <<'PY'
import json, sys
for line in open(sys.argv[1]):
    d = json.loads(line)
    docs = ", ".join(f"{p[0]}[{p[1]}:+{p[2]}]" for p in d["pieces"][:4])
    print(f"step {d['step']} rank {d['rank']} seq {d['seq_len']} tokens {d['source_tokens']}  {docs} ...")
PY

echo "== 4. training (configs/demo.yaml, 308 steps, into $RUN; wandb offline in $RUN/wandb)"
echo "   interrupted? continue it with: .venv/bin/python -m train fit --config configs/demo.yaml --data.order_log true --ckpt_path last"
$PY -m train fit --config configs/demo.yaml --data.order_log true

echo "== 5. held-out loss per source"
$PY scripts/report_run.py "$RUN" --corpus demo_corpus

echo "== 6. evaluation in one command (held-out loss per source; lm-eval's offline tasks from the held-out chunks)"
$PY scripts/evaluate.py "$RUN" --tasks local

echo "== 7. the order diagnostics of this run ($RUN/diagnostics.md)"
set +e
$PY scripts/diagnose_run.py "$RUN" --corpus demo_corpus
rc=$?
set -e
if [ "$rc" -gt 1 ]; then exit "$rc"; fi   # 1: a diagnostic failed (reported above); anything else is an error

echo
echo "== done: the demo run is in $RUN"
# The lines below are the README's "After the demo" block, word for word (tests/integration/test_docs_commands.py).
cat <<'NEXT'
Next, in this order (source .venv/bin/activate first, or call .venv/bin/python):
  python scripts/evaluate.py runs/demo          # held-out loss per source + the offline lm-eval tasks; says first what runs
  python scripts/diagnose_run.py runs/demo      # the five order diagnostics, PASS/FAIL each: runs/demo/diagnostics.md
  python -m train fit --config configs/demo.yaml --data.order_log true --ckpt_path last   # resume runs/demo (a finished run stops at once)
NEXT
