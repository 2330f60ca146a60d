#!/usr/bin/env bash
# Every GPU run of the kernels issue, in order, for a session that has the device tool.
# Run from the repository root on the GPU machine (torch/triton/transformers come from its image):
#   bash bench/run_gpu.sh [tests|tree|decode|csrc|speedup|all]
# It installs this package without dependencies (the machine has no network), plus any wheels
# carried in .whl/ (e.g. flashinfer-python and its needs, downloaded here with
# `pip download --no-deps --only-binary=:all: --python-version 3.12 ... -d .whl NAME==VERSION`),
# builds the CUDA extension, runs the GPU-marked tests, the microbenchmarks and the plots.
# `speedup` (not part of `all`: it takes about an hour at the Llama-3-8B shape; rerun it, it
# resumes) replays all 805 AlpacaEval answers annotated by `sot`; the device machine cannot see
# ../shared, so copy ../shared/data/alpaca_eval/gpt4_1106_preview_outputs.json into .data/
# (ignored by git) and carry .data with the call, or point ALPACA_OUTPUTS at the file.
# Results land in bench/results/ (and $OUT when set, so the device tool brings them back).
# Exit status: 0 when every stage it ran passed, 1 when one failed (each failed stage is named at
# the end), 2 when there is no CUDA GPU here (one line, before anything is installed or built).
set -uo pipefail
cd "$(dirname "$0")/.."
what=${1:-all}
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
if ! $PY -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
  echo "run_gpu.sh: no CUDA GPU visible to $PY (torch.cuda.is_available() is false): run it on the GPU machine" >&2
  exit 2
fi
failed=()
started=$(mktemp); trap 'rm -f "$started"' EXIT  # files newer than this one are this run's
# stage NAME CMD...: run one stage; a non-zero status (of any command in its pipeline) marks it failed
stage() { local name=$1; shift; "$@" || failed+=("$name"); }
if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then
  $PY -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
fi
$PY -m pip install -q --no-deps --no-build-isolation -e . || exit 1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
$PY -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
out=${OUT:-bench/results}
mkdir -p "$out"
if [ "$what" = csrc ] || [ "$what" = all ] || [ "$what" = tests ]; then
  build_csrc() {
    cmake -S . -B build -DPython3_EXECUTABLE="$(command -v $PY)" >"$out/csrc_build.log" 2>&1 \
      && cmake --build build -j >>"$out/csrc_build.log" 2>&1 && echo "csrc extension built"
  }
  stage "csrc build (see $out/csrc_build.log)" build_csrc
fi
if [ "$what" = tests ] || [ "$what" = all ]; then
  # only the files that hold GPU tests: collecting the rest imports the serve/test extras
  # (fastapi, pydantic, openai, playwright, grimp), which a bare GPU image lacks
  gpu_files=$(grep -rlE "mark\.gpu|pytestmark.*gpu" tests | sort | tr '\n' ' ')
  stage "gpu tests" bash -o pipefail -c "$PY -m pytest -m gpu -q -p no:cacheprovider -rs $gpu_files 2>&1 | tee '$out/gpu_tests.log' | tail -40"
fi
if [ "$what" = tree ] || [ "$what" = all ]; then
  stage "tree attention" bash -o pipefail -c "$PY bench/bench_tree_attention.py ${QUICK:+--quick} 2>&1 | tee '$out/tree_attention.log' | tail -5"
fi
if [ "$what" = decode ] || [ "$what" = all ]; then
  stage "decode step" bash -o pipefail -c "$PY bench/bench_decode_step.py 2>&1 | tee '$out/decode_step.log' | tail -5"
fi
if [ "$what" = csrc ] || [ "$what" = all ]; then
  stage "csrc ops" bash -o pipefail -c "$PY bench/bench_csrc_ops.py 2>&1 | tee '$out/csrc_ops.log' | tail -5"
fi
if [ "$what" = speedup ]; then
  resume=""
  [ -f bench/results/speedup-llama3-8b-sot-gpu/prompts.jsonl ] && resume=--resume
  stage "speedup" $PY -m pasta_engine.entrypoints.cli bench speedup --annotator sot \
    --responses "${ALPACA_OUTPUTS:-.data/gpt4_1106_preview_outputs.json}" ${LIMIT:+--limit $LIMIT} \
    --preset llama-3-8b --device cuda --dtype bfloat16 --attention-backend triton --cuda-graphs on \
    --max-threads 0 $resume --out bench/results/speedup-llama3-8b-sot-gpu
fi
shopt -s nullglob
plotted=(bench/results/tree_attention_*.json bench/results/decode_step_*.json)
shopt -u nullglob
if [ ${#plotted[@]} -gt 0 ]; then
  stage "plots" $PY bench/plot.py "${plotted[@]}"
fi
# copy back only what this run wrote (the device tool returns at most 8 files)
[ "$out" != bench/results ] && find bench/results -maxdepth 1 -type f \( -name '*.json' -o -name '*.png' \) \
  -newer "$started" -exec cp {} "$out"/ \; 2>/dev/null
if [ ${#failed[@]} -gt 0 ]; then
  printf 'run_gpu.sh: failed stage: %s\n' "${failed[@]}" >&2
  exit 1
fi
echo "run_gpu.sh: every stage passed"
