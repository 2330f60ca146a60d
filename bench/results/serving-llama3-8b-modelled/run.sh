#!/bin/bash
# Modelled load curves at the llama-3-8b shape on an H100 (issue 33 item 3; see README.md here).
# No GPU: the real scheduler replays the shipped adapter's traces, each step's time is MODELLED.
# Run from the repository root. The engine is a snapshot of HEAD's pasta_engine/ (git archive), so
# edits in progress in the working tree never enter the figures; its commit is recorded.
# Knobs (environment): O (results folder), PY (the python), SNAP (where the snapshot goes).
# Resumable: points whose raw/ file exists are read back, not replayed (--overwrite replays them).
set -e
O=${O:-bench/results/serving-llama3-8b-modelled}
PY=${PY:-.venv/bin/python}
SNAP=${SNAP:-$(mktemp -d)}
git archive HEAD pasta_engine | tar -x -C "$SNAP"
git rev-parse HEAD > "$SNAP/COMMIT"
PYTHONPATH="$SNAP" nice -n 19 $PY bench/model_serving_8b.py --num-prompts 80 --concurrency 1 2 4 8 16 \
  --request-rate 4 8 16 32 --budget 32 --slo-ttft-s 0.25 --slo-tpot-s 0.010 --no-progress --out "$O" "$@"
