"""Load test of ``pasta-engine serve``: concurrent streaming chat requests from the real
``openai`` client over loopback, some cancelled mid-stream and some invalid.

    python bench/bench_server_load.py                      # embedded SmolLM2-135M, 64 requests
    python bench/bench_server_load.py --requests 16 --max-tokens 32 --url http://127.0.0.1:8000 --api-key KEY

It starts the server itself (``pasta-engine serve --port 0``, embedded model) unless ``--url``
is given, sends every request at once, then sends the valid ones again without streaming to
check the streamed text, waits until the engine is idle and reads its KV pages. Reported (and
written to ``bench/results/server_load_<device>.json``, or a new ``-2`` file beside it): requests and
concurrency, wall time of the streaming phase, completion tokens/s, time to first token (first non-empty content chunk)
and inter-token latency (gap between consecutive content chunks of a stream; PASTA streams in
reading order, so a chunk may hold several tokens, e.g. main text flushed when a chunk ends) as
p50/p99, and the counts that must be 0: lost, duplicated, mismatched streams and leaked pages.

:func:`run_load` is also what the test suite's bounded load test runs (tests/entrypoints).
Only loopback addresses are used; every phase has a time limit.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import queue
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from itertools import zip_longest
from pathlib import Path
from typing import Any

PROMPTS = [
    "What are different drawers I should have for clothes?",
    "Give me three tips for a job interview.",
    "How do I keep a sourdough starter alive?",
    "List some ways to save water at home.",
    "What should I pack for a weekend hiking trip?",
    "Name a few good habits for studying.",
    "How can I make my mornings less stressful?",
    "What are the benefits of learning a second language?",
]

#: Invalid requests, cycled: (overrides, expected HTTP status, expected error param).
INVALID = [
    (dict(max_tokens=-1), 400, "max_tokens"),
    (dict(temperature=5.0), 400, "temperature"),
    (dict(n=0), 400, "n"),
    (dict(top_logprobs=3, logprobs=True), 400, "top_logprobs"),
    (dict(extra_body={"pasta": {"max_threads": -2}}), 400, "pasta.max_threads"),
    (dict(model="no-such-model"), 404, "model"),
    (dict(stop=[""]), 400, "stop"),
    (dict(messages=[{"role": "tool", "content": "x"}]), 400, "messages"),
]


@dataclass
class Stream:
    """What one streamed request saw (times in seconds from ``time.perf_counter``)."""

    index: int
    kind: str  # valid | cancel | invalid
    start: float = 0.0
    end: float = 0.0
    chunk_times: list[float] = field(default_factory=list)  # non-empty content chunks
    text: str = ""
    ids: set = field(default_factory=set)
    finish_reason: str | None = None
    usage: Any = None
    status: int | None = None  # invalid: the error's HTTP status
    param: str | None = None  # invalid: the error's param
    error: str | None = None
    request: dict = field(default_factory=dict)


def percentile(values: list[float], q: float) -> float | None:
    """Nearest-rank percentile (q in [0, 100]) of ``values``; None when empty."""
    if not values:
        return None
    v = sorted(values)
    k = max(0, min(len(v) - 1, int(round(q / 100 * len(v) + 0.5)) - 1))
    return v[k]


def plan(requests: int, cancelled: int, invalid: int) -> list[str]:
    """Which requests are ``valid``, ``cancel`` or ``invalid``: the special ones alternate and
    are spread evenly over the batch. Raises ValueError when they outnumber the requests."""
    if cancelled + invalid > requests:
        raise ValueError(f"{cancelled} cancelled + {invalid} invalid > {requests} requests")
    special = [k for pair in zip_longest(["cancel"] * cancelled, ["invalid"] * invalid) for k in pair if k]
    kinds = ["valid"] * requests
    for j, k in enumerate(special):
        kinds[int(j * requests / len(special))] = k
    return kinds


async def run_load(url: str, model: str, api_key: str = "none", *, requests: int = 64, cancelled: int = 8,
                   invalid: int = 8, max_tokens: int = 64, cancel_body: dict | None = None,
                   replays: list[str] | None = None, timeout_s: float = 600.0) -> dict[str, Any]:
    """Send ``requests`` streaming chat requests at once and check them.

    Args:
        url: the server's base URL (loopback).
        model, api_key: what the server serves and expects.
        requests, cancelled, invalid: how many in all, closed after their first content
            chunk, and invalid (each must get its 400/404 naming the parameter).
        max_tokens: of the valid requests (greedy, or seeded sampling: both reproducible).
        cancel_body: extra body of the cancelled requests (make them long, so they are
            cancelled mid-flight); default ``max_tokens=1000``.
        replays: annotated responses some valid requests replay (``pasta.annotated_response``,
            so threads fork even with random weights).
        timeout_s: limit of each phase in seconds (asyncio.TimeoutError past it).

    Returns the measurements and the checks' counts (see the module docstring)."""
    import httpx
    import openai

    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key=api_key, max_retries=0, timeout=timeout_s,
                                http_client=httpx.AsyncClient(limits=httpx.Limits(max_connections=requests + 16)))
    kinds = plan(requests, cancelled, invalid)

    def body(i: int, kind: str) -> dict[str, Any]:
        b: dict[str, Any] = dict(model=model, messages=[{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}],
                                 max_tokens=max_tokens)
        if i % 2:
            b.update(temperature=0.8, seed=1000 + i)
        else:
            b.update(temperature=0.0)
        pasta: dict[str, Any] = {}
        if i % 4 == 1:
            pasta["mode"] = "sequential"
        if replays and i % 3 == 0:
            pasta["annotated_response"] = replays[i % len(replays)]
        if pasta:
            b["extra_body"] = {"pasta": pasta}
        if kind == "cancel":
            b.update(cancel_body or {"max_tokens": 1000})
        if "annotated_response" in b.get("extra_body", {}).get("pasta", {}):
            b.update(temperature=0.0)  # a replay samples nothing: a sampling temperature is refused,
            b.pop("seed", None)  # and so is a seed;
            b.pop("max_tokens", None)  # it runs to its end: a max_tokens below its length is refused
        if kind == "invalid":
            over, _, _ = INVALID[i % len(INVALID)]
            b.update(over)
        return b

    async def one(i: int, kind: str) -> Stream:
        s = Stream(index=i, kind=kind, request=body(i, kind))
        s.start = time.perf_counter()
        try:
            stream = await client.chat.completions.create(stream=True, stream_options={"include_usage": True},
                                                          **s.request)
            async for chunk in stream:
                s.ids.add(chunk.id)
                if chunk.usage is not None:
                    s.usage = chunk.usage
                for c in chunk.choices:
                    if c.delta.content:
                        s.chunk_times.append(time.perf_counter())
                        s.text += c.delta.content
                    if c.finish_reason:
                        s.finish_reason = c.finish_reason
                if kind == "cancel" and s.chunk_times:
                    await stream.close()  # the client goes away mid-stream
                    break
        except openai.APIStatusError as e:
            s.status = e.status_code
            s.param = e.response.json().get("error", {}).get("param")
        except openai.APIError as e:
            s.error = f"{type(e).__name__}: {e}"
        s.end = time.perf_counter()
        return s

    t0 = time.perf_counter()
    streams = await asyncio.wait_for(asyncio.gather(*(one(i, k) for i, k in enumerate(kinds))), timeout_s)
    wall = max(s.end for s in streams) - t0

    valid = [s for s in streams if s.kind == "valid"]

    async def again(s: Stream) -> Any:
        return await client.chat.completions.create(**s.request)

    fulls = await asyncio.wait_for(asyncio.gather(*(again(s) for s in valid)), timeout_s)
    stats: dict[str, Any] = {}
    async with httpx.AsyncClient(base_url=url, headers={"Authorization": f"Bearer {api_key}"}) as h:
        for _ in range(int(timeout_s / 0.05)):
            stats = (await h.get("/v1/pasta/stats")).json()
            if stats["running"] == stats["waiting"] == stats["open"] == 0:
                break
            await asyncio.sleep(0.05)
    await client.close()

    all_ids = [i for s in streams for i in s.ids]
    lost = sum(1 for s in valid if s.finish_reason is None or s.usage is None or s.error)
    lost += sum(1 for s in streams if s.kind == "cancel" and s.error)
    duplicated = sum(1 for s in valid if len(s.ids) != 1) + (len(all_ids) - len(set(all_ids)))
    mismatched = [s.index for s, f in zip(valid, fulls)
                  if s.text != f.choices[0].message.content or s.finish_reason != f.choices[0].finish_reason]
    bad_answers = [(s.index, s.status, s.param) for s in streams if s.kind == "invalid"
                   and (s.status, s.param) != INVALID[s.index % len(INVALID)][1:]]
    cancelled_mid = sum(1 for s in streams if s.kind == "cancel" and s.chunk_times and s.finish_reason is None)
    ttft = [s.chunk_times[0] - s.start for s in valid if s.chunk_times]
    itl = [b - a for s in valid for a, b in zip(s.chunk_times, s.chunk_times[1:])]
    tokens = sum(s.usage.completion_tokens for s in valid if s.usage is not None)
    pasta_stats = [f.choices[0].model_extra["pasta"]["stats"] for f in fulls]
    return {
        "requests": requests,
        "concurrency": requests,
        "valid": len(valid),
        "cancelled": cancelled,
        "cancelled_mid_stream": cancelled_mid,
        "invalid": invalid,
        "invalid_rejected_as_expected": invalid - len(bad_answers),
        "invalid_unexpected": bad_answers,
        "lost": lost,
        "duplicated": duplicated,
        "mismatched": len(mismatched),
        "mismatched_indexes": mismatched,
        "errors": [s.error for s in streams if s.error],
        "wall_s": wall,
        "completion_tokens": tokens,
        "tokens_per_s": tokens / wall if wall > 0 else None,
        "ttft_s": {"p50": percentile(ttft, 50), "p99": percentile(ttft, 99), "max": max(ttft, default=None)},
        "itl_s": {"p50": percentile(itl, 50), "p99": percentile(itl, 99), "gaps": len(itl)},
        "forked_responses": sum(1 for p in pasta_stats if p["forks"] > 0),
        "mean_threads": sum(p["threads"] for p in pasta_stats) / max(1, len(pasta_stats)),
        "pages_leaked": stats.get("kv_pages_total", 0) - stats.get("kv_pages_free", 0),
        "kv_pages_total": stats.get("kv_pages_total"),
        "engine_steps": stats.get("steps"),
        # prefill tokens the prefix cache saved (hit) of those looked up, when the server has one
        "prefill_tokens_saved": stats.get("prefix_cache_hit_tokens"),
        "prefill_tokens_computed": (stats["prefix_cache_query_tokens"] - stats["prefix_cache_hit_tokens"]
                                    if "prefix_cache_hit_tokens" in stats else None),
        "engine_stats_after": stats,
    }


def start_server(args: list[str], log: Path, timeout_s: float = 600.0) -> tuple[subprocess.Popen, str]:
    """``pasta-engine serve --port 0 ARGS`` and its URL (from its "serving ... at URL" line)."""
    cmd = [sys.executable, "-m", "pasta_engine.entrypoints.cli", "serve", "--host", "127.0.0.1", "--port", "0", *args]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=open(log, "w"), text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [lines.put(x) for x in proc.stdout], daemon=True).start()
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            line = lines.get(timeout=1.0)
        except queue.Empty:
            continue
        if " at http://" in line:
            return proc, line.split(" at ", 1)[1].split()[0]
    proc.kill()
    raise RuntimeError(f"the server did not start:\n{log.read_text()[-3000:]}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--cancelled", type=int, default=8)
    ap.add_argument("--invalid", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=64, help="of each valid request")
    ap.add_argument("--max-running-requests", type=int, default=16, help="the server's (when this script starts it)")
    ap.add_argument("--url", default=None, help="an already running server (loopback); default: start one")
    ap.add_argument("--model", default=None, help="with --url: the served model name (default: the first listed)")
    ap.add_argument("--api-key", default="bench-key")
    ap.add_argument("--server-args", default="", help="more flags for pasta-engine serve (when started here)")
    ap.add_argument("--out", type=Path, default=None,
                    help="JSON path (default: bench/results/server_load_<device>.json; an existing file is kept and the "
                    "result goes to a new -2, -3, ... file beside it unless --overwrite)")
    ap.add_argument("--overwrite", action="store_true", help="replace the output file when it exists")
    args = ap.parse_args()

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from common import RESULTS, device_info, new_path

    proc = None
    settings: dict[str, Any] = {}
    if args.url is None:
        log = Path(tempfile.gettempdir()) / "pasta_engine_server_load.log"  # the server's stderr
        serve_args = ["--api-key", args.api_key, "--max-running-requests", str(args.max_running_requests),
                      "--log-level", "warning", *args.server_args.split()]
        proc, url = start_server(serve_args, log)
        settings["serve_args"] = serve_args
    else:
        url = args.url
    try:
        import httpx

        models = httpx.get(url + "/v1/models", headers={"Authorization": f"Bearer {args.api_key}"}).json()
        model = args.model or models["data"][0]["id"]
        res = asyncio.run(run_load(url, model, args.api_key, requests=args.requests, cancelled=args.cancelled,
                                   invalid=args.invalid, max_tokens=args.max_tokens,
                                   cancel_body={"max_tokens": 4 * args.max_tokens}))
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(60)
    info = device_info()
    out = new_path(args.out or RESULTS / f"server_load_{info.get('device', 'cpu').replace(' ', '_')}.json",
                   args.overwrite)
    payload = {"command": " ".join([Path(sys.executable).name] + sys.argv), "time": time.strftime("%Y-%m-%d %H:%M:%S"),
               "model": model, "max_tokens": args.max_tokens, "max_running_requests": args.max_running_requests,
               "cpu_count": os.cpu_count(), "load_average_1m": os.getloadavg()[0], **info, **settings, **res}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(payload, indent=1))
    print(json.dumps({k: payload[k] for k in ("requests", "concurrency", "wall_s", "tokens_per_s", "ttft_s", "itl_s",
                                              "lost", "duplicated", "mismatched", "pages_leaked")}, indent=1))
    print(f"wrote {out}")
    return 0 if res["lost"] == res["duplicated"] == res["mismatched"] == res["pages_leaked"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
