"""A bounded load test of the real server process (loopback only; every phase has a time
limit): 64 concurrent streaming chat requests from the ``openai`` client, 8 of them cancelled
mid-stream and 8 invalid. Nothing is lost or duplicated, no KV page leaks, and every valid
stream's text equals its non-streamed text. The driver is bench/bench_server_load.py's
``run_load`` (the benchmark measures latencies with the same code on the embedded model)."""

from __future__ import annotations

import asyncio

import pytest

from bench_loader import load_bench  # noqa: E402  (tests/bench_loader.py)

REPLAYS = [
    'Plan: <promise topic="pack" tokens="10"/><async>Pack light.</async> then '
    '<promise topic="route" tokens="10"/><async>Check the route twice.</async><sync/> Go.',
    'Two: <promise topic="a" tokens="10"/><async>First thing, done slowly.</async> '
    '<promise topic="b" tokens="10"/><async>Second.</async> End.',
]
#: Cancelled requests replay a long trace: they cannot finish before the client leaves.
LONG = {"extra_body": {"pasta": {"mode": "sequential", "annotated_response": "Keep going. " * 200}}}


def _bench():
    return load_bench("bench_server_load.py")


def test_64_concurrent_streams_8_cancelled_8_invalid(server):
    bench = _bench()
    res = asyncio.run(bench.run_load(server.url, server.model, server.api_key, requests=64, cancelled=8, invalid=8,
                                     max_tokens=24, cancel_body=LONG, replays=REPLAYS, timeout_s=240))
    assert res["valid"] == 48 and res["errors"] == []
    assert res["lost"] == 0
    assert res["duplicated"] == 0
    assert res["mismatched"] == 0, res["mismatched_indexes"]  # streamed text == non-streamed text
    assert res["invalid_rejected_as_expected"] == 8, res["invalid_unexpected"]
    assert res["cancelled_mid_stream"] == 8
    assert res["pages_leaked"] == 0
    assert res["completion_tokens"] > 0 and res["ttft_s"]["p50"] is not None
