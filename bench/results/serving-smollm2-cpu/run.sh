#!/bin/bash
# The load curves of issue 33 on this 2-core CPU (see README.md here). Run from the repository root.
# Knobs (environment): O (results folder), NUM_PROMPTS, CONCURRENCY, MAX_TOKENS, PY (the python that runs
# the package; PYTHONPATH may point it at another checkout).
set -e
O=${O:-bench/results/serving-smollm2-cpu}
PY=${PY:-.venv/bin/python}
P=${PASTA_SHARED_DATA:-../shared/data}/alpaca_eval/instructions.json
mkdir -p $O
common="--prompts $P --num-prompts ${NUM_PROMPTS:-8} --concurrency ${CONCURRENCY:-1 2 4 8} --max-tokens ${MAX_TOKENS:-128} --slo-e2e-s 30 --no-progress"
. bench/serve_cpu.sh  # serve PORT ARGS...
serve 8301 --thread-policy critical_first
$PY bench/bench_serving.py --url http://127.0.0.1:8301 --mode pasta $common --label "pasta, critical_first" --out $O/pasta_critical_first.json
$PY bench/bench_serving.py --url http://127.0.0.1:8301 --mode sequential $common --label "sequential, same weights" --out $O/sequential_same_weights.json
pkill -f "serve --port 8301"; sleep 2
serve 8302 --thread-policy fcfs
$PY bench/bench_serving.py --url http://127.0.0.1:8302 --mode pasta $common --label "pasta, fcfs" --out $O/pasta_fcfs.json
pkill -f "serve --port 8302"; sleep 2
serve 8303 --no-adapter
$PY bench/bench_serving.py --url http://127.0.0.1:8303 --mode sequential $common --label "base model, sequential" --out $O/base_sequential.json \
  --compare $O/pasta_critical_first.json $O/sequential_same_weights.json $O/pasta_fcfs.json --plot $O/curves.png
pkill -f "serve --port 8303"
