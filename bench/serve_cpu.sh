# Sourced by the CPU load-curve scripts (bench/results/serving-smollm2-cpu*/run.sh), which set PY (the
# python that runs the package) and O (the results folder).
# serve PORT ARGS...: start `pasta-engine serve` on PORT with the load curves' server settings
# (8 running requests, 16 tokens per step) and ARGS, its log in $O/serve_PORT.log; wait until
# /health answers (at most 120 s; returns 1 if it never does).
serve() {
  port=$1; shift
  $PY -m pasta_engine.entrypoints.cli serve --port $port --max-running-requests 8 --max-num-batched-tokens 16 "$@" > $O/serve_$port.log 2>&1 &
  for i in $(seq 1 120); do sleep 1; curl -sf localhost:$port/health > /dev/null && return 0; done; return 1
}
