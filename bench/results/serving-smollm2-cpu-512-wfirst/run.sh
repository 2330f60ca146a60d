#!/bin/bash
# The load curves of ../serving-smollm2-cpu-512/ again with the writer-first adapter shipped since
# 2026-11-29: pasta (critical_first), inline (same weights, sequential) and the base model, the
# same day (the machine's rate drifts between days).
# Run from the repository root. Knobs (environment): O (results folder), PY, PASTA_SHARED_DATA.
set -e
O=${O:-bench/results/serving-smollm2-cpu-512-wfirst}
PY=${PY:-.venv/bin/python}
BASE=bench/results/serving-smollm2-cpu-512
mkdir -p $O
cp $BASE/prompts.json $O/prompts.json   # the first 16 vicuna prompts, as before
common="--prompts $O/prompts.json --num-prompts 16 --max-tokens 512 --slo-e2e-s 60 --no-progress"
. bench/serve_cpu.sh  # serve PORT ARGS...
serve 8321 --thread-policy critical_first
$PY bench/bench_serving.py --url http://127.0.0.1:8321 --mode pasta $common --concurrency 1 2 4 8 16 --label "pasta, critical_first (writer-first adapter)" --out $O/pasta_critical_first.json
$PY bench/bench_serving.py --url http://127.0.0.1:8321 --mode inline $common --concurrency 1 4 16 --label "inline (same weights, sequential)" --out $O/inline_same_weights.json \
  --compare $O/pasta_critical_first.json
pkill -f "serve --port 8321"
# the base model's curve again on the same day (its rate moves with the machine's state)
serve 8322 --no-adapter
$PY bench/bench_serving.py --url http://127.0.0.1:8322 --mode sequential $common --concurrency 1 2 4 8 16 --label "base model, sequential" --out $O/base_sequential.json \
  --compare $O/pasta_critical_first.json $O/inline_same_weights.json --plot $O/curves.png
pkill -f "serve --port 8322"
