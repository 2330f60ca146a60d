"""``bench speedup`` and ``bench pareto`` as measurements a user can trust (issue 20, Measuring):
three interleaved repeats by default with their spread, warnings for a realized speedup above the
theoretical one beyond that spread and for geomeans over answers that never forked, the same
weights on both sides unless ``--baseline base``."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from pasta_engine.entrypoints.cli import main

from sample_adapters import tiny_adapter  # noqa: E402  (tests/sample_adapters.py)

FORKED = ('Tips: <promise topic="a" tokens="10"/><async>Sleep.</async> <promise topic="b" tokens="10"/>'
          '<async>Walk.</async><sync/> Done.')
PLAIN = "Just rest and drink water."


def fake(wall: float, tokens=(1, 2, 3)):
    return SimpleNamespace(stats=SimpleNamespace(wall_s=wall), token_ids=list(tokens))


def test_timing_record_takes_the_fastest_and_warns_beyond_the_spread():
    from pasta_engine.tools.bench import realized_beyond_theoretical, timing_record, timing_summary

    runs = {"pasta": [fake(1.1), fake(1.0), fake(1.05)], "clean_text_sequential": [fake(2.1), fake(2.0), fake(2.05)]}
    fastest, rec = timing_record(runs, 1.5)  # realized 2.0 over theoretical 1.5, runs within 1.91x-1.95x
    assert fastest["pasta"] is runs["pasta"][1] and fastest["clean_text_sequential"] is runs["clean_text_sequential"][1]
    assert rec["runs"] == 3 and rec["wall_s"]["pasta"] == [1.1, 1.0, 1.05]
    assert rec["wall_s_spread"]["pasta"] == {"min": 1.0, "median": 1.05, "max": 1.1}
    assert rec["realized_content_speedup_runs"] == pytest.approx([2.1 / 1.1, 2.0, 2.05 / 1.05])
    assert rec["same_tokens"] and len(rec["warnings"]) == 1
    assert "exceeds the theoretical 1.50x by more than the measured spread" in rec["warnings"][0]
    _, ok = timing_record(runs, 1.95)  # within the spread: no warning
    assert ok["warnings"] == []
    assert realized_beyond_theoretical(2.03, 1.53, [2.03]) is not None  # one run: any excess is beyond it
    assert realized_beyond_theoretical(1.2, 1.53, [1.2]) is None
    runs["pasta"][2] = fake(1.05, tokens=(1,))
    _, differ = timing_record(runs, 3.0)
    assert not differ["same_tokens"] and "different tokens" in differ["warnings"][0]
    assert timing_summary([{"index": 7, "timing": rec}, {"index": 8, "timing": ok}])["realized_beyond_theoretical"] == [7]


def test_every_speedup_mean_is_over_the_answers_with_content():
    """An answer without content (content speedup 0) is left out of the theoretical mean, so the
    realized and ratio means and the fork warning leave it out too: all cover the same answers."""
    from pasta_engine.tools.bench import summarize_speedup

    def row(cs, rs, content, forks=1):
        return {"forks": forks, "threads": forks + 1, "content_speedup": cs, "realized_content_speedup": rs,
                "realized_over_theoretical": rs / cs if cs else None, "step_speedup": 1.0, "token_parallelism": 1.0,
                "tag_tokens": 0, "tokens_decoded": content + 1, "wall_s": 1.0, "wall_s_sequential": rs,
                "content_tokens": content, "same_text": True}

    s = summarize_speedup([row(2.0, 2.0, 100), row(0.0, 0.25, 0, forks=0)])
    assert s["empty_answers"] == 1
    assert s["geomean_content_speedup"] == s["geomean_realized_content_speedup"] == 2.0
    assert s["geomean_realized_over_theoretical"] == 1.0 and s["warnings"] == []


def test_fork_warnings():
    from pasta_engine.tools.bench import fork_warnings

    assert "none of the 3 answers forked" in fork_warnings(3, 0, 1.2, None)[0]
    (w,) = fork_warnings(3, 1, 1.2, 1.5)
    assert w.startswith("2 of 3 answers never forked") and "1.50x" in w
    assert fork_warnings(3, 3, 1.2, 1.2) == [] and fork_warnings(0, 0, None, None) == []


@pytest.fixture
def traces(tmp_path):
    path = tmp_path / "traces.jsonl"
    path.write_text("".join(json.dumps({"prompt": p, "annotated_response": a, "annotator": "hand"}) + "\n"
                            for p, a in (("tips", FORKED), ("rest", PLAIN))))
    return path


def test_bench_speedup_repeats_three_times_by_default_and_reports_spread_and_warnings(tiny_llama, traces, tmp_path,
                                                                                      capsys):
    out = tmp_path / "run"
    rc = main(["bench", "speedup", "--traces", str(traces), "--model", str(tiny_llama), "--kv-cache-mb", "8",
               "--out", str(out)])
    _, err = capsys.readouterr()
    assert rc == 0, err
    result = json.loads((out / "summary.json").read_text())
    s, settings = result["summary"], result["settings"]
    assert settings["repeats"] == 3 and settings["timing_statistic"].startswith("fastest")
    assert settings["cpu_threads"] >= 1
    rows = [json.loads(line) for line in (out / "prompts.jsonl").read_text().splitlines()]
    for r in rows:
        t = r["timing"]
        assert t["runs"] == 3 and r["wall_s"] == min(t["wall_s"]["pasta"])
        assert r["wall_s_sequential"] == min(t["wall_s"]["clean_text_sequential"])
        assert set(t["realized_content_speedup_spread"]) == {"min", "median", "max"}
    assert s["timing"]["runs_per_side"] == 3 and s["forked_responses"] == 1
    assert s["forked_only"]["geomean_realized_content_speedup"] == pytest.approx(rows[0]["realized_content_speedup"])
    assert any(w.startswith("1 of 2 answers never forked") for w in s["warnings"])
    assert "pasta-engine: warning: 1 of 2 answers never forked" in err
    assert "min / median / max" in err and "forked answers only" in err


def test_bench_pareto_same_weights_by_default_and_the_base_model_as_an_option(tiny_llama, tmp_path, capsys):
    prompts = tmp_path / "p.txt"
    prompts.write_text("Give me tips.\n")
    d = tiny_adapter(tmp_path)
    common = ["bench", "pareto", "--prompts", str(prompts), "--model", str(tiny_llama), "--adapter", str(d),
              "--max-new-tokens", "6", "--kv-cache-mb", "8", "--warmup", "0", "--no-progress"]
    assert main([*common, "--out", str(tmp_path / "same")]) == 0
    same = json.loads((tmp_path / "same" / "summary.json").read_text())
    assert same["settings"]["baseline"] == "same" and same["settings"]["sequential_adapter"] == str(d)
    assert same["settings"]["repeats"] == 3
    row = json.loads((tmp_path / "same" / "prompts.jsonl").read_text())
    assert row["timing"]["runs"] == 3 and set(row["timing"]["wall_s"]) == {"pasta", "pasta_replay",
                                                                          "clean_text_sequential", "sequential"}
    assert set(row["timing"]["end_to_end_speedup_spread"]) == {"min", "median", "max"}
    assert main([*common, "--baseline", "base", "--repeats", "1", "--out", str(tmp_path / "base")]) == 0
    _, err = capsys.readouterr()
    base = json.loads((tmp_path / "base" / "summary.json").read_text())
    assert base["settings"]["baseline"] == "base" and base["settings"]["sequential_adapter"] is None
    assert base["settings"]["adapter"] == str(d)
    assert {"geomean_end_to_end_speedup", "geomean_length_ratio", "cut_fraction_sequential"} <= set(base["summary"])
    assert "vs the base model's sequential answers" in err
