"""Load benchmark of a running ``pasta-engine serve``, in the field's form (vLLM's
``benchmarks/benchmark_serving.py``, SGLang's ``bench_serving``): streamed chat requests from a
prompts file at fixed concurrency levels or at a Poisson request rate; per load point the
latencies (TTFT, ITL, TPOT, end-to-end: mean, p50, p90, p99), content tokens per second,
requests per second and goodput under a latency objective; one JSON file per run and a plot of
latency against throughput.

    # the server (its flags are the run's: mode per request, the thread policy per server)
    pasta-engine serve --port 8000 --max-running-requests 16 --max-num-batched-tokens 64 \\
        --thread-policy critical_first
    # the load: pasta mode, then sequential mode with the same weights, plotted together
    python bench/bench_serving.py --url http://127.0.0.1:8000 --mode pasta --concurrency 1 2 4 8 16 \\
        --num-prompts 32 --slo-e2e-s 60 --label "pasta, critical_first" --out bench/results/serving_pasta.json
    python bench/bench_serving.py --url http://127.0.0.1:8000 --mode sequential --concurrency 1 2 4 8 16 \\
        --num-prompts 32 --slo-e2e-s 60 --label sequential --out bench/results/serving_sequential.json \\
        --compare bench/results/serving_pasta.json

Each request is ``POST /v1/chat/completions`` with ``stream=true``,
``stream_options.include_usage`` and the ``pasta`` extension ``{"mode": MODE, ...}``
(``--pasta-json`` adds fields, e.g. ``{"max_threads": 4}``), greedy unless ``--temperature``.
The run is resumable: a load point already in ``--out`` (same settings) is skipped, so an
interrupted run goes on where it stopped (``--overwrite`` starts again). Before and after each
point the engine's counters (``GET /v1/pasta/stats``, once no request is running) give the
steps, preemptions and KV pages still held when idle (0 unless pages leak).

Definitions (after vLLM's ``benchmark_serving.py``, ``calculate_metrics``; times in seconds,
measured at the client):

* TTFT: from sending the request to the first chunk that carries content;
* ITL (inter-token latency): the gap between consecutive content chunks of a stream, all
  streams' gaps together. PASTA streams in reading order, so one chunk may carry several
  tokens (a chunk's text released once what comes before it is out): ITL is per chunk;
* TPOT (time per output token): ``(e2e - TTFT) / (content tokens - 1)`` per request (requests
  with at least two content tokens);
* end-to-end latency (e2e): from sending the request to the stream's end (``data: [DONE]``);
* duration: from the first request sent to the last stream's end;
* content tokens: ``pasta.stats.content_tokens`` of the final chunk (the clean text's tokens,
  tags left out: docs/DESIGN.md section 3), else ``usage.completion_tokens``; content throughput
  = content tokens of completed requests / duration; request throughput = completed requests /
  duration;
* goodput (DistServe, Zhong et al., OSDI 2024; vLLM's ``--goodput``): completed requests that
  meet every objective given (``--slo-ttft-s``, ``--slo-tpot-s``, ``--slo-e2e-s``) / duration;
* percentiles: ``numpy.percentile`` (linear interpolation), as vLLM reports them.

The arithmetic (:func:`percentiles`, :func:`tpot_s`, :func:`meets_slo`, :func:`summarize`,
:func:`poisson_arrivals`) works on the per-request records the JSON holds, so a recorded run can
be summarized again. No figure is claimed until measured.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import platform
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

import numpy as np

from pasta_engine.entrypoints.args import nonneg_int, positive_int  # the CLI's argparse types

ROOT = Path(__file__).resolve().parents[1]
#: The example prompts: AlpacaEval's instructions in the shared data (``$PASTA_SHARED_DATA``).
DEFAULT_PROMPTS = Path(os.environ.get("PASTA_SHARED_DATA", ROOT.parent / "shared" / "data")) / "alpaca_eval" / \
    "instructions.json"
PERCENTILES = (50, 90, 99)
#: The server's ``pasta.mode``s (inline: tags acted on, each chunk decoded in place in the same
#: thread: the same-weights sequential baseline of a PASTA-LANG model).
MODES = ("pasta", "sequential", "inline")


# --------------------------------------------------------------------------- records and arithmetic


@dataclass
class RequestRecord:
    """What one streamed request saw (times in seconds, from the load point's start for
    ``sent_s``, from sending the request for the others).

    ``ttft_s``: to the first content chunk (None without content); ``e2e_s``: to the stream's
    end; ``itl_s``: gaps between consecutive content chunks; ``text``: the content deltas
    concatenated; ``completion_tokens``: the usage chunk's (tokens sampled by all threads, tags
    and EOS included); ``content_tokens``/``decode_steps``/``forks``: the final chunk's
    ``pasta.stats`` (None when the server sends none); ``error``: why it failed (None: it
    completed)."""

    index: int
    prompt_index: int
    sent_s: float = 0.0
    ttft_s: float | None = None
    e2e_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    text: str = ""
    chunks: int = 0
    completion_tokens: int | None = None
    content_tokens: int | None = None
    decode_steps: int | None = None
    forks: int | None = None
    finish_reason: str | None = None
    error: str | None = None


@dataclass(frozen=True)
class Slo:
    """A latency objective (seconds; None: not part of it): a request meets it when each given
    bound holds (TTFT, TPOT, end-to-end latency)."""

    ttft_s: float | None = None
    tpot_s: float | None = None
    e2e_s: float | None = None

    def __post_init__(self) -> None:
        for name in ("ttft_s", "tpot_s", "e2e_s"):
            v = getattr(self, name)
            if v is not None and not (isinstance(v, (int, float)) and not isinstance(v, bool) and 0 < v < math.inf):
                raise ValueError(f"slo {name}={v!r}: expected a finite number of seconds > 0, or None")

    @property
    def given(self) -> bool:
        """Whether any bound is set (goodput is computed only then)."""
        return any(v is not None for v in (self.ttft_s, self.tpot_s, self.e2e_s))


def completed(rec: Mapping[str, Any]) -> bool:
    """Whether a record's request completed: no error, a finish reason and an end-to-end time."""
    return rec.get("error") is None and rec.get("finish_reason") is not None and rec.get("e2e_s") is not None


def output_tokens(rec: Mapping[str, Any]) -> int:
    """A record's content tokens (``pasta.stats.content_tokens``), else its completion tokens
    (``usage``), else 0."""
    for key in ("content_tokens", "completion_tokens"):
        v = rec.get(key)
        if v is not None:
            return int(v)
    return 0


def tpot_s(rec: Mapping[str, Any]) -> float | None:
    """Time per output token in seconds: ``(e2e - TTFT) / (tokens - 1)`` with the record's
    content tokens (vLLM's TPOT, which excludes the first token); None when the request has
    fewer than two tokens or no TTFT."""
    n = output_tokens(rec)
    if n < 2 or rec.get("ttft_s") is None or rec.get("e2e_s") is None:
        return None
    return (rec["e2e_s"] - rec["ttft_s"]) / (n - 1)


def percentiles(values: Iterable[float], qs: Sequence[float] = PERCENTILES) -> dict[str, float | None]:
    """``{"n", "mean", "p50", "p90", "p99"}`` of ``values`` (``numpy.percentile``, linear
    interpolation, as vLLM's benchmark_serving); the statistics are None when there is no
    value. Raises ValueError for a q outside [0, 100]."""
    v = np.asarray(list(values), dtype=float)
    out: dict[str, float | None] = {"n": int(v.size), "mean": float(v.mean()) if v.size else None}
    for q in qs:
        if not 0 <= q <= 100:
            raise ValueError(f"percentile q={q!r}: expected 0 to 100")
        out[f"p{q:g}"] = float(np.percentile(v, q)) if v.size else None
    return out


def meets_slo(rec: Mapping[str, Any], slo: Slo) -> bool:
    """Whether a completed request meets every bound of ``slo`` (a failed one never does; a
    TPOT bound is met by a request too short to have a TPOT)."""
    if not completed(rec):
        return False
    if slo.ttft_s is not None and (rec.get("ttft_s") is None or rec["ttft_s"] > slo.ttft_s):
        return False
    tp = tpot_s(rec)
    if slo.tpot_s is not None and tp is not None and tp > slo.tpot_s:
        return False
    return slo.e2e_s is None or rec["e2e_s"] <= slo.e2e_s


def summarize(records: Sequence[Mapping[str, Any]], duration_s: float, slo: Slo | None = None) -> dict[str, Any]:
    """One load point's figures from its per-request records (see the module's definitions).

    Args:
        records: :class:`RequestRecord` fields as a mapping (``asdict``, or read from the JSON).
        duration_s: seconds from the first request sent to the last stream's end.
        slo: the latency objective of goodput (None, or no bound set: goodput is None).

    Returns requests, completed, failed, duration_s, request_throughput_rps, content_tokens,
    content_throughput_tps (tokens/s), completion_tokens, completion_throughput_tps,
    percentiles of ttft_s, itl_s, tpot_s and e2e_s, forked (completed requests whose answer
    forked), and slo, good_requests, goodput_rps and slo_attainment (good / all requests).

    Raises ValueError for a duration that is not a finite number > 0."""
    if not (isinstance(duration_s, (int, float)) and 0 < duration_s < math.inf):
        raise ValueError(f"duration_s={duration_s!r}: expected a finite number of seconds > 0")
    done = [r for r in records if completed(r)]
    content = sum(output_tokens(r) for r in done)
    completion = sum(int(r.get("completion_tokens") or 0) for r in done)
    tpots = [t for t in (tpot_s(r) for r in done) if t is not None]
    good = None
    if slo is not None and slo.given:
        good = sum(1 for r in done if meets_slo(r, slo))
    return {
        "requests": len(records),
        "completed": len(done),
        "failed": len(records) - len(done),
        "duration_s": float(duration_s),
        "request_throughput_rps": len(done) / duration_s,
        "content_tokens": content,
        "content_throughput_tps": content / duration_s,
        "completion_tokens": completion,
        "completion_throughput_tps": completion / duration_s,
        "ttft_s": percentiles(r["ttft_s"] for r in done if r.get("ttft_s") is not None),
        "itl_s": percentiles(g for r in done for g in r.get("itl_s") or ()),
        "tpot_s": percentiles(tpots),
        "e2e_s": percentiles(r["e2e_s"] for r in done),
        "forked": sum(1 for r in done if (r.get("forks") or 0) > 0),
        "slo": None if slo is None or not slo.given else asdict(slo),
        "good_requests": good,
        "goodput_rps": None if good is None else good / duration_s,
        "slo_attainment": None if good is None or not records else good / len(records),
    }


def poisson_arrivals(n: int, rate: float, seed: int = 0) -> list[float]:
    """Send times in seconds of ``n`` requests arriving as a Poisson process of ``rate``
    requests per second: the first at 0, then exponential gaps of mean ``1 / rate`` (vLLM's
    ``get_request``), seeded by ``seed``; ``rate`` infinite: all at 0.

    Raises ValueError for ``n < 0`` or a rate that is not > 0."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ValueError(f"n={n!r}: expected an integer >= 0")
    if not (isinstance(rate, (int, float)) and not isinstance(rate, bool) and rate > 0):
        raise ValueError(f"request rate {rate!r}: expected a number of requests per second > 0 (inf: all at once)")
    if math.isinf(rate):
        return [0.0] * n
    gaps = np.random.default_rng(seed).exponential(1.0 / rate, size=max(0, n - 1))
    return [0.0] * min(n, 1) + [float(t) for t in np.cumsum(gaps)]


def load_prompts(path: Path, n: int) -> list[str]:
    """The first ``n`` instructions of an AlpacaEval-style JSON file (a list of objects with a
    non-empty string ``instruction``).

    Raises ValueError naming the file and what is wrong (unreadable, not such a list, an entry
    without an instruction, fewer than ``n`` entries)."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: cannot read a JSON prompts file ({type(e).__name__}: {e})") from None
    if not isinstance(data, list):
        raise ValueError(f"{path}: expected a JSON list of objects with an 'instruction', got {type(data).__name__}")
    out = []
    for i, row in enumerate(data[:n]):
        text = row.get("instruction") if isinstance(row, dict) else None
        if not isinstance(text, str) or not text.strip():
            raise ValueError(f"{path}: entry {i} has no non-empty string 'instruction'")
        out.append(text)
    if len(out) < n:
        raise ValueError(f"{path}: {len(out)} prompts, fewer than the {n} asked for (--num-prompts)")
    return out


# --------------------------------------------------------------------------- the client


def load_key(kind: str, value: float) -> str:
    """The name of a load point: ``concurrency=4`` or ``rate=0.5`` (``rate=inf``)."""
    return f"{kind}={value:g}"


async def send_request(client: Any, model: str, prompt: str, *, index: int, prompt_index: int, mode: str,
                       max_tokens: int, temperature: float, pasta: Mapping[str, Any] | None = None,
                       t0: float | None = None) -> RequestRecord:
    """Send one streamed chat completion and time it (see :class:`RequestRecord`); an HTTP
    error, an error event or a broken stream is recorded in ``error``, never raised.

    Args:
        client: an ``httpx.AsyncClient`` whose base URL is the server's root (its headers carry
            the API key).
        model: the served model name; prompt: the user message; mode: ``pasta`` | ``sequential`` | ``inline``.
        max_tokens: tokens the answer may hold (all threads together); temperature: 0 is greedy.
        pasta: more fields of the ``pasta`` extension (e.g. ``max_threads``).
        t0: the load point's start (``time.perf_counter``), for ``sent_s``."""
    import httpx

    rec = RequestRecord(index=index, prompt_index=prompt_index)
    body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": temperature, "stream": True, "stream_options": {"include_usage": True},
            "pasta": {"mode": mode, **(pasta or {})}}
    if body["pasta"].get("annotated_response") is not None:
        del body["max_tokens"]  # a replay runs to its end: a max_tokens below its length is refused
    start = time.perf_counter()
    rec.sent_s = start - (start if t0 is None else t0)
    last: float | None = None
    try:
        async with client.stream("POST", "/v1/chat/completions", json=body) as resp:
            if resp.status_code != 200:
                text = (await resp.aread()).decode("utf-8", "replace")
                try:
                    text = json.loads(text)["error"]["message"]
                except (ValueError, KeyError, TypeError):
                    pass
                rec.error = f"HTTP {resp.status_code}: {str(text)[:500]}"
            else:
                async for line in resp.aiter_lines():
                    if not line.startswith("data: "):
                        continue
                    data = line[6:].strip()
                    if data == "[DONE]":
                        rec.e2e_s = time.perf_counter() - start
                        break
                    obj = json.loads(data)
                    if "error" in obj:
                        rec.error = f"error event: {obj['error'].get('message', obj['error'])}"
                        continue
                    if obj.get("usage"):
                        rec.completion_tokens = int(obj["usage"]["completion_tokens"])
                    for c in obj.get("choices") or ():
                        content = (c.get("delta") or {}).get("content")
                        if content:
                            now = time.perf_counter()
                            if last is None:
                                rec.ttft_s = now - start
                            else:
                                rec.itl_s.append(now - last)
                            last = now
                            rec.text += content
                            rec.chunks += 1
                        if c.get("finish_reason"):
                            rec.finish_reason = c["finish_reason"]
                        stats = (c.get("pasta") or {}).get("stats")
                        if stats:
                            rec.content_tokens = stats.get("content_tokens")
                            rec.decode_steps = stats.get("decode_steps")
                            rec.forks = stats.get("forks")
        if rec.error is None and rec.e2e_s is None:
            rec.error = "the stream ended without data: [DONE]"
    except (httpx.HTTPError, ValueError, KeyError, TypeError) as e:
        rec.error = f"{type(e).__name__}: {e}"
    if rec.error is not None:
        rec.e2e_s = rec.e2e_s if rec.e2e_s is not None else time.perf_counter() - start
    return rec


async def run_load_point(client: Any, model: str, prompts: Sequence[str], *, concurrency: int | None = None,
                         request_rate: float | None = None, seed: int = 0, mode: str = "pasta",
                         max_tokens: int = 256, temperature: float = 0.0, pasta: Mapping[str, Any] | None = None,
                         progress: bool = True, desc: str = "") -> tuple[list[dict[str, Any]], float]:
    """Send one request per prompt, at most ``concurrency`` at a time (a closed loop: the next
    starts when one ends) or arriving at ``request_rate`` requests per second
    (:func:`poisson_arrivals`; with ``concurrency`` too, capped by it), and wait for all.

    Returns the records (:class:`RequestRecord` as dicts, in prompt order) and the duration in
    seconds (first request sent to the last stream's end). Raises ValueError when neither or a
    bad value is given."""
    from tqdm import tqdm

    if concurrency is None and request_rate is None:
        raise ValueError("give concurrency or request_rate")
    if concurrency is not None and (isinstance(concurrency, bool) or not isinstance(concurrency, int)
                                    or concurrency < 1):
        raise ValueError(f"concurrency={concurrency!r}: expected an integer >= 1")
    arrivals = poisson_arrivals(len(prompts), request_rate, seed) if request_rate is not None else [0.0] * len(prompts)
    sem = asyncio.Semaphore(concurrency) if concurrency is not None else None
    bar = tqdm(total=len(prompts), desc=desc or "requests", unit="req", disable=not progress, file=sys.stderr,
               leave=False)
    t0 = time.perf_counter()

    async def one(i: int) -> RequestRecord:
        delay = arrivals[i] - (time.perf_counter() - t0)
        if delay > 0:
            await asyncio.sleep(delay)
        kw = dict(index=i, prompt_index=i, mode=mode, max_tokens=max_tokens, temperature=temperature, pasta=pasta,
                  t0=t0)
        if sem is None:
            rec = await send_request(client, model, prompts[i], **kw)
        else:
            async with sem:
                rec = await send_request(client, model, prompts[i], **kw)
        bar.update(1)
        return rec

    try:
        records = await asyncio.gather(*(one(i) for i in range(len(prompts))))
    finally:
        bar.close()
    duration = time.perf_counter() - t0
    return [asdict(r) for r in records], duration


async def engine_stats(client: Any, settle_s: float = 600.0) -> dict[str, Any] | None:
    """The engine's counters (``GET /v1/pasta/stats``) once no request is running, waiting or
    open (polled every 0.05 s for at most ``settle_s`` seconds); None when the server has no
    such route (not a pasta-engine server)."""
    deadline = time.monotonic() + settle_s
    while True:
        r = await client.get("/v1/pasta/stats")
        if r.status_code != 200:
            return None
        s = r.json()
        if (s.get("running", 0) == s.get("waiting", 0) == s.get("open", 0) == 0) or time.monotonic() > deadline:
            return s
        await asyncio.sleep(0.05)


def engine_delta(before: Mapping[str, Any] | None, after: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """What a load point did to the engine: ``steps`` and ``preemptions`` (differences of the
    counters) and ``kv_pages_leaked`` (pages not free once idle, after; 0 unless pages leak)."""
    if before is None or after is None:
        return None
    return {"steps": after["steps"] - before["steps"], "preemptions": after["preemptions"] - before["preemptions"],
            "kv_pages_leaked": after["kv_pages_total"] - after["kv_pages_free"],
            "kv_pages_total": after["kv_pages_total"]}


# --------------------------------------------------------------------------- a run


def load_points(concurrency: Sequence[int] = (), rates: Sequence[float] = ()) -> list[tuple[str, float]]:
    """The run's load points, ``("concurrency", c)`` then ``("rate", r)``, each once, in the
    order given."""
    out: list[tuple[str, float]] = []
    for p in [("concurrency", c) for c in concurrency] + [("rate", r) for r in rates]:
        if p not in out:
            out.append(p)
    return out


def read_result(path: Path) -> dict[str, Any]:
    """A result file this script wrote. Raises ValueError naming the file when it is not one."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: cannot read a bench_serving result ({type(e).__name__}: {e})") from None
    if not isinstance(data, dict) or not isinstance(data.get("points"), list) or "settings" not in data:
        raise ValueError(f"{path}: not a bench_serving result (no 'settings' and 'points')")
    return data


def _write(path: Path, data: Mapping[str, Any]) -> None:
    """Write JSON atomically (a killed run leaves the previous file whole)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=1))
    tmp.replace(path)


async def run_benchmark(client: Any, *, model: str, prompts: Sequence[str], points: Sequence[tuple[str, float]],
                        out: Path, settings: Mapping[str, Any], meta: Mapping[str, Any] | None = None,
                        slo: Slo | None = None, mode: str = "pasta", max_tokens: int = 256, temperature: float = 0.0,
                        pasta: Mapping[str, Any] | None = None, seed: int = 0, warmup: int = 1,
                        overwrite: bool = False, progress: bool = True) -> dict[str, Any]:
    """Run the load points not yet in ``out`` and write ``out`` after each one.

    ``settings`` (what makes two runs comparable: server, model, mode, prompts, sampling, SLO)
    are checked against the file's: resuming into a file with other settings raises ValueError
    naming the first difference (unless ``overwrite``, which starts the file again). ``meta``
    (command, URL, device, host) is recorded as given (when resuming, its command, start and URL
    are added to the file's ``resumed`` list). ``warmup`` requests are sent first, untimed,
    when a point is left to run. Returns the result (what ``out`` holds)."""
    result: dict[str, Any]
    if out.exists() and not overwrite:
        result = read_result(out)
        old = result["settings"]
        for k in sorted(set(old) | set(settings)):
            if old.get(k) != settings.get(k):
                raise ValueError(f"--out {out} holds a run with other settings ({k}: {old.get(k)!r} there, "
                                 f"{settings.get(k)!r} here): give another --out, or --overwrite to start it again")
        if meta:  # who resumed it, and when
            result.setdefault("resumed", []).append({k: meta[k] for k in ("command", "started", "url") if k in meta})
    else:
        result = {"benchmark": "bench/bench_serving.py", **(meta or {}), "settings": dict(settings), "points": []}
    done = {p["key"] for p in result["points"]}
    todo = [(k, v) for k, v in points if load_key(k, v) not in done]
    for k, v in points:
        if load_key(k, v) in done:
            print(f"{load_key(k, v)}: in {out} already, skipped", file=sys.stderr)
    if todo and warmup:
        for i in range(warmup):
            await send_request(client, model, prompts[i % len(prompts)], index=i, prompt_index=i % len(prompts),
                               mode=mode, max_tokens=max_tokens, temperature=temperature, pasta=pasta)
    for kind, value in todo:
        key = load_key(kind, value)
        before = await engine_stats(client)
        records, duration = await run_load_point(
            client, model, prompts, concurrency=int(value) if kind == "concurrency" else None,
            request_rate=value if kind == "rate" else None, seed=seed, mode=mode, max_tokens=max_tokens,
            temperature=temperature, pasta=pasta, progress=progress, desc=key)
        after = await engine_stats(client)
        summary = summarize(records, duration, slo)
        shown = value if math.isfinite(value) else "inf"  # (JSON has no infinity)
        result["points"].append({"key": key, "load": {"kind": kind, "value": shown}, "time": time.strftime(
            "%Y-%m-%d %H:%M:%S"), "summary": summary, "engine": engine_delta(before, after), "records": records})
        result["updated"] = time.strftime("%Y-%m-%d %H:%M:%S")
        _write(out, result)
        e2e, ttft = summary["e2e_s"]["p50"], summary["ttft_s"]["p50"]
        print(f"{key}: {summary['completed']}/{summary['requests']} completed, "
              f"{summary['content_throughput_tps']:.2f} content tok/s, {summary['request_throughput_rps']:.3f} req/s, "
              f"e2e p50 {_s(e2e)}, TTFT p50 {_s(ttft)}"
              + ("" if summary["goodput_rps"] is None else f", goodput {summary['goodput_rps']:.3f} req/s"),
              file=sys.stderr)
    return result


def _s(v: float | None) -> str:
    return "-" if v is None else f"{v:.3f} s"


def plot_curves(results: Sequence[Mapping[str, Any]], path: Path) -> Path:
    """Latency against throughput, one line per result (its ``--label``, else its mode): p50
    and p90 end-to-end latency and p50 TTFT (seconds) against content tokens per second, each
    point marked with its load. Writes a PNG at ``path`` and returns it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.8))
    for j, res in enumerate(results):
        name = res["settings"].get("label") or res["settings"].get("mode", "?")
        color = f"C{j % 10}"
        pts = sorted(res["points"], key=lambda p: p["summary"]["content_throughput_tps"])
        x = [p["summary"]["content_throughput_tps"] for p in pts]
        for ax, metric, q, style in ((axes[0], "e2e_s", "p50", "-o"), (axes[0], "e2e_s", "p90", ":"),
                                     (axes[1], "ttft_s", "p50", "-o")):
            y = [p["summary"][metric][q] for p in pts]
            ax.plot(x, [float("nan") if v is None else v for v in y], style, color=color, label=f"{name} ({q})")
            if q == "p50":
                for xi, yi, p in zip(x, y, pts):
                    if yi is not None:
                        ax.annotate(p["key"].replace("concurrency=", "c=").replace("rate=", "r="), (xi, yi),
                                    textcoords="offset points", xytext=(4, 4), fontsize=7, color=color)
    for ax, title in ((axes[0], "end-to-end latency"), (axes[1], "time to first token")):
        ax.set_xlabel("content tokens per second (all requests)")
        ax.set_ylabel(f"{title} (s)")
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path


# --------------------------------------------------------------------------- command line


def _rate(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected requests per second > 0 or inf, got {text!r}") from None
    if not v > 0:  # NaN too
        raise argparse.ArgumentTypeError(f"expected requests per second > 0 or inf, got {text!r}")
    return v


def _seconds(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a finite number of seconds > 0, got {text!r}") from None
    if not 0 < v < math.inf:
        raise argparse.ArgumentTypeError(f"expected a finite number of seconds > 0, got {text!r}")
    return v


def _temperature(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number in [0, 2], got {text!r}") from None
    if not 0 <= v <= 2:
        raise argparse.ArgumentTypeError(f"expected a number in [0, 2], got {text!r}")
    return v


def build_parser() -> argparse.ArgumentParser:
    """The command's flags (every value checked by argparse before any work)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    s = ap.add_argument_group("server")
    s.add_argument("--url", default="http://127.0.0.1:8000", help="root URL of a running pasta-engine serve")
    s.add_argument("--api-key", default=os.environ.get("PASTA_API_KEY"),
                   help="the server's --api-key (default: $PASTA_API_KEY, else none)")
    s.add_argument("--model", default=None, help="served model name (default: the first of GET /v1/models)")
    s.add_argument("--request-timeout-s", type=_seconds, default=600.0, help="limit of one request (default 600)")
    w = ap.add_argument_group("workload")
    w.add_argument("--prompts", type=Path, default=DEFAULT_PROMPTS,
                   help="AlpacaEval-style JSON: a list of objects with 'instruction' (default, the example: "
                   f"{DEFAULT_PROMPTS})")
    w.add_argument("--num-prompts", type=positive_int, default=32,
                   help="requests per load point: the file's first N instructions, the same at every point "
                   "(default 32)")
    w.add_argument("--concurrency", type=positive_int, nargs="+", default=None, metavar="C",
                   help="closed-loop load points: at most C requests in flight (default, without --request-rate: "
                   "1 2 4 8 16)")
    w.add_argument("--request-rate", type=_rate, nargs="+", default=None, metavar="R",
                   help="open-loop load points: Poisson arrivals at R requests/s (inf: all at once)")
    w.add_argument("--seed", type=nonneg_int, default=0, help="seed of the Poisson arrivals (default 0)")
    w.add_argument("--mode", choices=MODES, default="pasta", help="the requests' pasta.mode (default pasta)")
    w.add_argument("--pasta-json", default=None, metavar="JSON",
                   help="more fields of the requests' pasta object, e.g. '{\"max_threads\": 4}' (not mode)")
    w.add_argument("--max-tokens", type=positive_int, default=256, help="max_tokens of each request (default 256)")
    w.add_argument("--temperature", type=_temperature, default=0.0, help="0 (default) is greedy")
    w.add_argument("--warmup", type=nonneg_int, default=1, help="untimed requests before the first point (default 1)")
    o = ap.add_argument_group("objective")
    o.add_argument("--slo-ttft-s", type=_seconds, default=None, help="goodput's bound on TTFT (seconds)")
    o.add_argument("--slo-tpot-s", type=_seconds, default=None, help="goodput's bound on TPOT (seconds per token)")
    o.add_argument("--slo-e2e-s", type=_seconds, default=None, help="goodput's bound on end-to-end latency (seconds)")
    r = ap.add_argument_group("output")
    r.add_argument("--out", type=Path, required=True,
                   help="result JSON (one per run); load points already in it are skipped (resume)")
    r.add_argument("--label", default=None, help="the curve's name and a note of what the server ran (recorded)")
    r.add_argument("--plot", type=Path, default=None, help="latency-vs-throughput PNG (default: --out with .png)")
    r.add_argument("--compare", type=Path, nargs="+", default=[], metavar="FILE",
                   help="other result files drawn on the same plot (e.g. sequential beside pasta)")
    r.add_argument("--overwrite", action="store_true", help="start --out again instead of resuming it")
    r.add_argument("--no-progress", action="store_true", help="no progress bar")
    return ap


def parse_args(argv: Sequence[str] | None = None) -> tuple[argparse.Namespace, list[str], dict[str, Any], Slo,
                                                           list[dict[str, Any]]]:
    """The flags, checked before any work: returns ``(args, prompts, pasta fields, slo,
    compared results)``. A bad one exits with status 2 and a message naming it and its value."""
    ap = build_parser()
    args = ap.parse_args(argv)
    if not args.url.startswith(("http://", "https://")):
        ap.error(f"--url {args.url!r}: expected an http:// or https:// URL")
    try:
        prompts = load_prompts(args.prompts, args.num_prompts)
    except ValueError as e:
        ap.error(f"--prompts {str(args.prompts)!r}: {e}")
    pasta: dict[str, Any] = {}
    if args.pasta_json is not None:
        try:
            pasta = json.loads(args.pasta_json)
        except json.JSONDecodeError as e:
            ap.error(f"--pasta-json {args.pasta_json!r}: not JSON ({e})")
        if not isinstance(pasta, dict) or "mode" in pasta:
            ap.error(f"--pasta-json {args.pasta_json!r}: expected a JSON object without 'mode' (that is --mode)")
    compare = []
    for p in args.compare:
        try:
            compare.append(read_result(p))
        except ValueError as e:
            ap.error(f"--compare {str(p)!r}: {e}")
    if args.out.exists() and not args.overwrite:
        try:
            read_result(args.out)
        except ValueError as e:
            ap.error(f"--out {str(args.out)!r}: {e} (give another --out, or --overwrite)")
    if args.concurrency is None and args.request_rate is None:
        args.concurrency = [1, 2, 4, 8, 16]
    slo = Slo(args.slo_ttft_s, args.slo_tpot_s, args.slo_e2e_s)
    return args, prompts, pasta, slo, compare


def run_settings(args: argparse.Namespace, model: str, pasta: Mapping[str, Any], slo: Slo) -> dict[str, Any]:
    """What makes two runs comparable (checked when resuming; the URL is not: a server started
    again with the same flags may listen on another port)."""
    return {"model": model, "mode": args.mode, "pasta": dict(pasta), "prompts": str(args.prompts),
            "num_prompts": args.num_prompts, "max_tokens": args.max_tokens, "temperature": args.temperature,
            "seed": args.seed, "slo": asdict(slo), "label": args.label}


def device_meta() -> dict[str, Any]:
    """The command line, and the machine the benchmark ran on (bench/common.py's device facts:
    the server's too when ``--url`` is a loopback address)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from common import device_info

    return {"command": " ".join([Path(sys.executable).name] + sys.argv), "started": time.strftime("%Y-%m-%d %H:%M:%S"),
            "device": device_info(), "cpu_count": os.cpu_count(), "platform": platform.platform(),
            "load_average_1m": os.getloadavg()[0] if hasattr(os, "getloadavg") else None}


def main(argv: Sequence[str] | None = None) -> int:
    args, prompts, pasta, slo, compare = parse_args(argv)
    import httpx

    points = load_points(args.concurrency or (), args.request_rate or ())
    most = max([int(v) for k, v in points if k == "concurrency"] + [args.num_prompts if args.request_rate else 1])
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}

    async def go() -> dict[str, Any]:
        async with httpx.AsyncClient(base_url=args.url, headers=headers, timeout=args.request_timeout_s,
                                     limits=httpx.Limits(max_connections=most + 8)) as client:
            try:
                models = await client.get("/v1/models")
            except httpx.HTTPError as e:
                raise SystemExit(f"bench_serving: error: --url {args.url}: no server answers ({e})") from None
            if models.status_code != 200:
                raise SystemExit(f"bench_serving: error: --url {args.url}: GET /v1/models is {models.status_code} "
                                 f"({models.text[:200]}); is --api-key right?")
            model = args.model or models.json()["data"][0]["id"]
            return await run_benchmark(
                client, model=model, prompts=prompts, points=points, out=args.out,
                settings=run_settings(args, model, pasta, slo), meta={"url": args.url, **device_meta()}, slo=slo,
                mode=args.mode,
                max_tokens=args.max_tokens, temperature=args.temperature, pasta=pasta, seed=args.seed,
                warmup=args.warmup, overwrite=args.overwrite, progress=not args.no_progress)

    try:
        result = asyncio.run(go())
    except ValueError as e:
        print(f"bench_serving: error: {e}", file=sys.stderr)
        return 2
    png = plot_curves([result, *compare], args.plot or args.out.with_suffix(".png"))
    print(f"wrote {args.out} and {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
