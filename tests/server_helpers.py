"""Helpers the server tests share (importable from any test: pytest puts this folder, the top
conftest.py's, on ``sys.path``)."""

from __future__ import annotations

import time

import httpx


def auth(server) -> dict[str, str]:
    """The Authorization header of ``server``'s API key."""
    return {"Authorization": f"Bearer {server.api_key}"}


def settled_stats(server, tries: int = 400) -> dict:
    """The engine's counters once no request is running, waiting or open (aborts are applied
    between steps; bounded polling, 0.05 s apart)."""
    s = {}
    for _ in range(tries):
        s = httpx.get(server.url + "/v1/pasta/stats", headers=auth(server)).json()
        if s["running"] == 0 and s["waiting"] == 0 and s["open"] == 0:
            return s
        time.sleep(0.05)
    return s
