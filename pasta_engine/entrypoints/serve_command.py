"""The ``pasta-engine serve`` command's flags (the server itself is :mod:`.openai.api_server`, imported only
when the command runs, so the rest of the CLI works without the ``serve`` extra)."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from .args import add_model_args, add_pasta_args, add_sampling_args, api_key_problem, positive_int, tcp_port

__all__ = ["add_serve_parser", "run_serve"]


def add_serve_parser(sub: Any) -> argparse.ArgumentParser:
    """Add ``serve`` to the CLI's subparsers: the flags of ``generate`` (model, PASTA,
    sampling: the defaults of requests that leave them out) plus the server's own."""
    v = sub.add_parser(
        "serve", help="OpenAI-compatible HTTP server (and a page at / that shows the threads decoding)",
        description="Serve the model over an OpenAI-compatible API (POST /v1/chat/completions, /v1/completions; "
        "GET /v1/models, /health, /version, /metrics, /openapi.json, /v1/pasta/events/ID) with a page at / that shows "
        "the threads decoding side by side. "
        "Sampling flags are the defaults of requests that leave them out; --seed seeds the seeds of requests "
        "that give none.",
    )
    g = v.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1, this machine only)")
    g.add_argument("--port", type=tcp_port, default=8000, help="TCP port (0: any free port; the URL is printed)")
    g.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on /v1 routes and /openapi.json (default: no key; an "
                   "empty key is refused)")
    g.add_argument("--allowed-hosts", type=_host_list, default=None, metavar="HOST[,HOST...]",
                   help="answer only requests whose Host header names one of these ('*': any). Default: localhost, "
                   "127.0.0.1 and [::1] when --host is a loopback address and there is no --api-key (so a web page "
                   "cannot reach the server through DNS rebinding), else any")
    g.add_argument("--max-body-mb", type=_positive_float, default=1.0,
                   help="largest request body in MiB (larger: 413; default 1)")
    g.add_argument("--event-log-mb", type=_positive_float, default=64.0,
                   help="memory for the thread events kept for GET /v1/pasta/events/ID, all completions together "
                   "(oldest dropped first; default 64)")
    g.add_argument("--served-model-name", default=None,
                   help="the model name clients use (default: the preset's, checkpoint's or embedded model's name)")
    g.add_argument("--max-running-requests", type=positive_int, default=16,
                   help="requests decoded together (continuous batching); more wait in a queue")
    g.add_argument("--log-level", default="info", choices=("critical", "error", "warning", "info", "debug"),
                   help="uvicorn's log level (info logs each request)")
    add_sampling_args(v, repetition_penalty=None)  # per request (vLLM's field), not a server-wide default
    add_model_args(v)
    add_pasta_args(v)
    return v


def _host_list(text: str) -> list[str]:
    hosts = [h.strip() for h in text.split(",") if h.strip()]
    if not hosts:
        raise argparse.ArgumentTypeError(f"expected host names separated by commas (or '*'), got {text!r}")
    return hosts


def _positive_float(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {text!r}") from None
    if not 0 < v < 2**20:
        raise argparse.ArgumentTypeError(f"expected a number > 0 (and < 2**20), got {text!r}")
    return v


def run_serve(args: argparse.Namespace) -> int:
    """Run the server until interrupted. Returns the exit status (2 when the ``serve`` extra
    is not installed, or for an ``--api-key`` no client could send: :func:`api_key_problem`)."""
    problem = None if args.api_key is None else api_key_problem(args.api_key)
    if problem is not None:
        print(f"pasta-engine: error: --api-key: {problem}", file=sys.stderr)
        return 2
    try:
        from .openai.api_server import serve
    except ImportError as e:
        print(f"pasta-engine: error: serve needs FastAPI, uvicorn, pydantic and prometheus_client ({e}): pip install "
              "-e '.[serve]'", file=sys.stderr)
        return 2
    return serve(args)
