"""bench/bench_serving.py, the load benchmark (issue 33): its arithmetic on a recorded list of
per-request records (percentiles, TPOT, throughput, goodput under an objective, Poisson
arrivals), its flags (a bad one fails before any work, naming itself), and a short run against
a live tiny-model server in-process (the app over an AsyncEngine, a token budget that binds and
the critical_first policy) that loses no request, duplicates no token (each stream's deltas are
the non-streamed answer's text) and leaks no KV page; the run resumes (points already in the
file are skipped) and draws its plot."""

from __future__ import annotations

import asyncio
import json
import math
from pathlib import Path

import pytest

from bench_loader import load_bench  # noqa: E402  (tests/bench_loader.py)



@pytest.fixture(scope="module")
def bench():
    return load_bench("bench_serving.py")


#: A recorded load point: three completed requests and one that failed (times in seconds).
RECORDS = [
    {"index": 0, "prompt_index": 0, "sent_s": 0.0, "ttft_s": 0.5, "e2e_s": 2.5, "itl_s": [0.5, 0.5, 1.0],
     "text": "abc", "chunks": 4, "completion_tokens": 25, "content_tokens": 21, "decode_steps": 12, "forks": 1,
     "finish_reason": "stop", "error": None},
    {"index": 1, "prompt_index": 1, "sent_s": 0.0, "ttft_s": 1.0, "e2e_s": 5.0, "itl_s": [2.0, 2.0],
     "text": "de", "chunks": 3, "completion_tokens": 9, "content_tokens": 9, "decode_steps": 9, "forks": 0,
     "finish_reason": "length", "error": None},
    {"index": 2, "prompt_index": 2, "sent_s": 1.0, "ttft_s": 2.0, "e2e_s": 3.0, "itl_s": [],
     "text": "f", "chunks": 1, "completion_tokens": 1, "content_tokens": 1, "decode_steps": 1, "forks": 0,
     "finish_reason": "stop", "error": None},
    {"index": 3, "prompt_index": 3, "sent_s": 1.5, "ttft_s": None, "e2e_s": 0.1, "itl_s": [],
     "text": "", "chunks": 0, "completion_tokens": None, "content_tokens": None, "decode_steps": None, "forks": None,
     "finish_reason": None, "error": "HTTP 500: boom"},
]


# --------------------------------------------------------------------------- arithmetic


def test_percentiles_interpolate_linearly_as_numpy(bench):
    p = bench.percentiles([10, 1, 2, 3, 4, 5, 6, 7, 8, 9])
    assert p == pytest.approx({"n": 10, "mean": 5.5, "p50": 5.5, "p90": 9.1, "p99": 9.91})
    assert bench.percentiles([]) == {"n": 0, "mean": None, "p50": None, "p90": None, "p99": None}
    assert bench.percentiles([3.0], qs=(0, 100)) == {"n": 1, "mean": 3.0, "p0": 3.0, "p100": 3.0}
    with pytest.raises(ValueError, match="q=101"):
        bench.percentiles([1.0], qs=(101,))


def test_the_summary_of_a_recorded_trace(bench):
    s = bench.summarize(RECORDS, 10.0)
    assert (s["requests"], s["completed"], s["failed"]) == (4, 3, 1)
    assert s["request_throughput_rps"] == pytest.approx(0.3)
    assert s["content_tokens"] == 31 and s["content_throughput_tps"] == pytest.approx(3.1)
    assert s["completion_tokens"] == 35 and s["completion_throughput_tps"] == pytest.approx(3.5)
    assert s["ttft_s"] == pytest.approx({"n": 3, "mean": 3.5 / 3, "p50": 1.0, "p90": 1.8, "p99": 1.98})
    assert s["e2e_s"] == pytest.approx({"n": 3, "mean": 10.5 / 3, "p50": 3.0, "p90": 4.6, "p99": 4.96})
    assert s["itl_s"] == pytest.approx({"n": 5, "mean": 1.2, "p50": 1.0, "p90": 2.0, "p99": 2.0})
    # TPOT = (e2e - TTFT) / (content tokens - 1): 2.0 / 20 and 4.0 / 8; one token has none
    assert s["tpot_s"] == pytest.approx({"n": 2, "mean": 0.3, "p50": 0.3, "p90": 0.46, "p99": 0.496})
    assert bench.tpot_s(RECORDS[2]) is None and bench.tpot_s(RECORDS[0]) == pytest.approx(0.1)
    assert s["forked"] == 1
    assert s["goodput_rps"] is None and s["slo"] is None  # no objective given
    assert bench.summarize(json.loads(json.dumps(RECORDS)), 10.0) == s  # from the JSON as well


def test_goodput_counts_the_completed_requests_that_meet_every_bound(bench):
    e2e = bench.summarize(RECORDS, 10.0, bench.Slo(e2e_s=3.0))  # requests 0 and 2 (the failed one never counts)
    assert e2e["good_requests"] == 2 and e2e["goodput_rps"] == pytest.approx(0.2)
    assert e2e["slo_attainment"] == pytest.approx(0.5) and e2e["slo"] == {"ttft_s": None, "tpot_s": None, "e2e_s": 3.0}
    both = bench.summarize(RECORDS, 10.0, bench.Slo(ttft_s=1.0, tpot_s=0.2))  # request 1's TPOT is 0.5, 2's TTFT 2.0
    assert both["good_requests"] == 1 and both["goodput_rps"] == pytest.approx(0.1)
    assert bench.meets_slo(RECORDS[2], bench.Slo(tpot_s=0.01))  # a one-token answer has no TPOT to miss
    assert not bench.meets_slo(RECORDS[3], bench.Slo(e2e_s=100.0))
    for bad in (0, -1.0, math.inf, math.nan, "1", True):
        with pytest.raises(ValueError, match="e2e_s"):
            bench.Slo(e2e_s=bad)
    for bad in (0, -1.0, math.inf, math.nan):
        with pytest.raises(ValueError, match="duration_s"):
            bench.summarize(RECORDS, bad)


def test_content_tokens_fall_back_to_the_usage_count(bench):
    rec = {**RECORDS[0], "content_tokens": None}
    assert bench.output_tokens(rec) == 25
    assert bench.summarize([rec], 5.0)["content_throughput_tps"] == pytest.approx(5.0)


def test_poisson_arrivals(bench):
    a = bench.poisson_arrivals(4000, 2.0, seed=7)
    assert a == bench.poisson_arrivals(4000, 2.0, seed=7) and a != bench.poisson_arrivals(4000, 2.0, seed=8)
    assert a[0] == 0.0 and all(x <= y for x, y in zip(a, a[1:]))
    assert a[-1] / (len(a) - 1) == pytest.approx(0.5, rel=0.05)  # mean gap 1 / rate (seeded: deterministic)
    assert bench.poisson_arrivals(3, math.inf) == [0.0, 0.0, 0.0] and bench.poisson_arrivals(0, 1.0) == []
    for rate in (0, -1.0, math.nan):
        with pytest.raises(ValueError, match="request rate"):
            bench.poisson_arrivals(3, rate)
    with pytest.raises(ValueError, match="n=-1"):
        bench.poisson_arrivals(-1, 1.0)


def test_load_points_are_kept_once_in_order(bench):
    assert bench.load_points([4, 1, 4], [0.5, math.inf]) == [("concurrency", 4), ("concurrency", 1), ("rate", 0.5),
                                                             ("rate", math.inf)]
    assert bench.load_key("rate", math.inf) == "rate=inf" and bench.load_key("concurrency", 8) == "concurrency=8"


# --------------------------------------------------------------------------- flags


@pytest.fixture
def prompts_file(tmp_path) -> Path:
    p = tmp_path / "prompts.json"
    p.write_text(json.dumps([{"instruction": f"Name {i + 2} colours of the sea."} for i in range(5)]))
    return p


def test_the_prompts_file_is_a_flag_and_the_shared_data_only_its_default(bench, prompts_file, tmp_path):
    assert bench.DEFAULT_PROMPTS.parts[-2:] == ("alpaca_eval", "instructions.json")
    args, prompts, pasta, slo, compare = bench.parse_args(["--prompts", str(prompts_file), "--num-prompts", "3",
                                                           "--out", str(tmp_path / "r.json"), "--slo-e2e-s", "9"])
    assert prompts == [f"Name {i + 2} colours of the sea." for i in range(3)]
    assert args.concurrency == [1, 2, 4, 8, 16] and pasta == {} and slo == bench.Slo(e2e_s=9.0) and compare == []


@pytest.mark.parametrize("flags, named", [
    (["--concurrency", "0"], "--concurrency"),
    (["--concurrency", "2", "x"], "--concurrency"),
    (["--request-rate", "0"], "--request-rate"),
    (["--request-rate", "nan"], "--request-rate"),
    (["--num-prompts", "6"], "--prompts"),  # the file holds 5
    (["--slo-e2e-s", "-1"], "--slo-e2e-s"),
    (["--slo-ttft-s", "inf"], "--slo-ttft-s"),
    (["--temperature", "3"], "--temperature"),
    (["--mode", "fast"], "--mode"),
    (["--url", "127.0.0.1:8000"], "--url"),
    (["--pasta-json", '{"mode": "pasta"}'], "--pasta-json"),
    (["--pasta-json", "[1]"], "--pasta-json"),
    (["--compare", "/no/such/result.json"], "--compare"),
])
def test_a_bad_flag_fails_before_any_work_naming_itself(bench, prompts_file, tmp_path, capsys, flags, named):
    with pytest.raises(SystemExit) as e:
        # (no server answers at that URL: a flag checked late would show as another error)
        bench.main(["--prompts", str(prompts_file), "--num-prompts", "5", "--out", str(tmp_path / "r.json"),
                    "--url", "http://127.0.0.1:9", *flags])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert named in err and flags[-1] in err
    assert not (tmp_path / "r.json").exists()


def test_a_missing_or_malformed_prompts_file_is_named(bench, tmp_path, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps([{"instruction": "ok"}, {"output": "no instruction"}]))
    for path in (tmp_path / "missing.json", bad):
        with pytest.raises(SystemExit):
            bench.main(["--prompts", str(path), "--num-prompts", "2", "--out", str(tmp_path / "r.json")])
        err = capsys.readouterr().err
        assert "--prompts" in err and str(path) in err
    with pytest.raises(ValueError, match="entry 1 has no non-empty string 'instruction'"):
        bench.load_prompts(bad, 2)


# --------------------------------------------------------------------------- a live server

TRACE = ('Tips: <promise topic="rest" tokens="6"/><async>Sleep early, every day.</async> '
         '<promise topic="walk" tokens="4"/><async>Walk more.</async><sync/> Done.')


@pytest.fixture(scope="module")
def app(tiny_llama):
    """The server's app in-process over a tiny engine whose token budget binds (6 tokens a step
    for up to 4 requests and their threads) under the critical_first policy."""
    from pasta_engine import AsyncEngine, Engine
    from pasta_engine.entrypoints.openai.api_server import build_app

    engine = Engine.from_pretrained(tiny_llama, kv_cache_bytes=16 * 2**20, page_size=4, max_running_requests=4,
                                    max_num_batched_tokens=6, thread_policy="critical_first")
    aengine = AsyncEngine(engine)
    yield build_app(aengine, "tiny")
    aengine.shutdown()


def _run(app, coro_fn):
    import httpx

    async def main():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test",
                                     timeout=120) as client:
            return await coro_fn(client)

    return asyncio.run(main())


def test_a_live_run_loses_nothing_duplicates_nothing_and_leaks_no_page(bench, app, prompts_file, tmp_path):
    prompts = bench.load_prompts(prompts_file, 5)
    out = tmp_path / "serving.json"
    settings = {"mode": "pasta", "label": "tiny"}
    kw = dict(model="tiny", prompts=prompts, out=out, settings=settings, meta={"command": "test"}, mode="pasta",
              max_tokens=12, slo=bench.Slo(e2e_s=600.0), pasta={"annotated_response": TRACE}, warmup=1,
              progress=False)

    async def first(client):
        res = await bench.run_benchmark(client, points=[("concurrency", 1), ("concurrency", 4)], **kw)
        plain, _ = await bench.run_load_point(client, "tiny", prompts, request_rate=math.inf, mode="sequential",
                                              max_tokens=12, progress=False)
        again = []  # the same requests without streaming: the text a stream must concatenate to
        for i, p in enumerate(prompts):
            for mode, extra in (("pasta", {"annotated_response": TRACE}), ("sequential", {})):
                budget = {} if extra else {"max_tokens": 12}  # a replay runs to its end: no max_tokens
                r = await client.post("/v1/chat/completions", json={
                    "model": "tiny", "messages": [{"role": "user", "content": p}], **budget,
                    "temperature": 0.0, "pasta": {"mode": mode, **extra}})
                again.append((i, mode, r.json()["choices"][0]["message"]["content"]))
        stats = await bench.engine_stats(client)
        return res, plain, again, stats

    res, plain, again, stats = _run(app, first)
    assert [p["key"] for p in res["points"]] == ["concurrency=1", "concurrency=4"]
    assert json.loads(out.read_text()) == res and res["command"] == "test"
    full = {(i, mode): text for i, mode, text in again}
    for point in res["points"]:
        recs, s = point["records"], point["summary"]
        assert [r["prompt_index"] for r in recs] == list(range(5))  # no request lost
        assert all(r["error"] is None and r["finish_reason"] for r in recs)
        assert s["completed"] == 5 and s["failed"] == 0 and s["good_requests"] == 5
        assert all(r["text"] == full[(r["prompt_index"], "pasta")] for r in recs)  # no token lost or duplicated
        assert all(r["forks"] == 2 and r["content_tokens"] > 0 for r in recs) and s["forked"] == 5
        assert s["content_throughput_tps"] > 0 and s["ttft_s"]["n"] == 5
        assert point["engine"]["kv_pages_leaked"] == 0 and point["engine"]["steps"] > 0
    assert all(r["error"] is None and r["text"] == full[(r["prompt_index"], "sequential")] for r in plain)
    assert stats["running"] == stats["waiting"] == 0 and stats["kv_pages_free"] == stats["kv_pages_total"]

    # resumed: the points already in the file are kept as they are, the new one runs
    async def resumed(client):
        return await bench.run_benchmark(client, points=[("concurrency", 1), ("concurrency", 2), ("concurrency", 4)],
                                         **kw)

    res2 = _run(app, resumed)
    assert [p["key"] for p in res2["points"]] == ["concurrency=1", "concurrency=4", "concurrency=2"]
    assert res2["points"][:2] == res["points"] and res2["resumed"] == [{"command": "test"}]
    assert res2["points"][2]["summary"]["completed"] == 5

    # another run's settings are refused, not mixed in
    async def other(client):
        return await bench.run_benchmark(client, points=[("concurrency", 8)], **{**kw, "settings": {
            **settings, "mode": "sequential"}})

    with pytest.raises(ValueError, match="other settings"):
        _run(app, other)

    png = bench.plot_curves([res2, {**res2, "settings": {"label": "again"}}], tmp_path / "serving.png")
    assert png.read_bytes().startswith(b"\x89PNG")
