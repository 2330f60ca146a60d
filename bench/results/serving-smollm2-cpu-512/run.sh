#!/bin/bash
# Issue 33's load curves at the evaluation's answer length (512 tokens), on the evaluation split's
# first 16 prompts (vicuna), this 2-core CPU. Run from the repository root; see README.md here.
# Knobs (environment): O (results folder), PY (the python that runs the package), PASTA_SHARED_DATA.
set -e
O=${O:-bench/results/serving-smollm2-cpu-512}
PY=${PY:-.venv/bin/python}
SRC=${PASTA_SHARED_DATA:-../shared/data}/alpaca_eval/instructions.json
mkdir -p $O
$PY -c "import json,sys; r=[x for x in json.load(open(sys.argv[1])) if x.get('dataset')=='vicuna'][:16]; json.dump(r, open(sys.argv[2],'w'), indent=1)" $SRC $O/prompts.json
common="--prompts $O/prompts.json --num-prompts 16 --max-tokens 512 --slo-e2e-s 60 --no-progress"
. bench/serve_cpu.sh  # serve PORT ARGS...
serve 8311 --thread-policy critical_first
$PY bench/bench_serving.py --url http://127.0.0.1:8311 --mode pasta $common --concurrency 1 2 4 8 16 --label "pasta, critical_first" --out $O/pasta_critical_first.json
$PY bench/bench_serving.py --url http://127.0.0.1:8311 --mode inline $common --concurrency 1 4 16 --label "inline (same weights, sequential)" --out $O/inline_same_weights.json
pkill -f "serve --port 8311"; sleep 2
serve 8312 --thread-policy fcfs
$PY bench/bench_serving.py --url http://127.0.0.1:8312 --mode pasta $common --concurrency 4 8 16 --label "pasta, fcfs" --out $O/pasta_fcfs.json
pkill -f "serve --port 8312"; sleep 2
serve 8313 --no-adapter
$PY bench/bench_serving.py --url http://127.0.0.1:8313 --mode sequential $common --concurrency 1 2 4 8 16 --label "base model, sequential" --out $O/base_sequential.json \
  --compare $O/pasta_critical_first.json $O/inline_same_weights.json $O/pasta_fcfs.json --plot $O/curves.png
pkill -f "serve --port 8313"
