"""A real ``pasta-engine serve`` process on a free loopback port, for the server tests."""

from __future__ import annotations

import os
import queue
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

API_KEY = "test-key"
MODEL = "tiny"


@dataclass
class ServerProcess:
    url: str  # http://127.0.0.1:PORT
    api_key: str
    model: str
    proc: subprocess.Popen
    log: Path  # its stderr


def start_server(args: list[str], log: Path, timeout_s: float = 240.0) -> ServerProcess:
    """Start ``pasta-engine serve --port 0 ARGS`` and wait for its "serving ... at URL" line.

    Raises RuntimeError (with the end of its log) when it exits or says nothing in time."""
    cmd = [sys.executable, "-m", "pasta_engine.entrypoints.cli", "serve", "--host", "127.0.0.1", "--port", "0",
           "--log-level", "warning", *args]
    err = open(log, "w")
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in proc.stdout], daemon=True).start()
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            line = lines.get(timeout=1.0)
        except queue.Empty:
            if proc.poll() is not None:
                break
            continue
        if " at http://" in line:
            url = line.split(" at ", 1)[1].split()[0]
            return ServerProcess(url=url, api_key=API_KEY, model=MODEL, proc=proc, log=log)
    proc.kill()
    raise RuntimeError(f"the server did not start (exit {proc.poll()}):\n{log.read_text()[-3000:]}")


def stop_server(srv: ServerProcess) -> None:
    srv.proc.terminate()
    try:
        srv.proc.wait(30)
    except subprocess.TimeoutExpired:
        srv.proc.kill()
        srv.proc.wait(10)


@pytest.fixture(scope="session")
def server(tiny_llama, tmp_path_factory):
    """``pasta-engine serve`` over the tiny random-weight checkpoint, with an API key."""
    srv = start_server(["--model", str(tiny_llama), "--served-model-name", MODEL, "--api-key", API_KEY,
                        "--kv-cache-mb", "32", "--page-size", "4", "--max-new-tokens", "24",
                        "--max-running-requests", "16"], tmp_path_factory.mktemp("server") / "server.log")
    yield srv
    stop_server(srv)


@pytest.fixture(scope="module")
def open_server(tiny_llama, tmp_path_factory):
    """``pasta-engine serve`` on 127.0.0.1 without an API key (so its Host check is on by
    default), request bodies up to 32 MiB."""
    srv = start_server(["--model", str(tiny_llama), "--served-model-name", MODEL, "--kv-cache-mb", "32",
                        "--page-size", "4", "--max-new-tokens", "24", "--max-body-mb", "32"],
                       tmp_path_factory.mktemp("open_server") / "server.log")
    yield srv
    stop_server(srv)


@pytest.fixture
def built(monkeypatch):
    """The (engine, settings) pairs the CLI builds (``cli.build_engine`` recorded)."""
    from pasta_engine.entrypoints import cli

    out: list = []
    real = cli.build_engine
    monkeypatch.setattr(cli, "build_engine", lambda args, **kw: out.append(real(args, **kw)) or out[-1])
    return out
