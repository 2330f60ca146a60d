"""Measurements a user can trust (issue 20, Measuring): ``generate``/``replay --mode both`` warm
up, repeat, report the spread and warn; both modes use the same weights unless ``--baseline
base``; the progress bar with tokens/s."""

from __future__ import annotations

import argparse
import json

import pytest

from pasta_engine.entrypoints.args import adapter_choice
from pasta_engine.entrypoints.cli import main

from sample_adapters import tiny_adapter  # noqa: E402  (tests/sample_adapters.py)

FORKED = ('Tips: <promise topic="a" tokens="10"/><async>Sleep.</async> <promise topic="b" tokens="10"/>'
          '<async>Walk.</async><sync/> Done.')
PLAIN = "Just rest and drink water."


def summary_of(err: str) -> dict:
    return json.loads(err.split("summary: ", 1)[1].splitlines()[0])


@pytest.fixture
def warm_ups(monkeypatch):
    """The engines whose ``ModelRunner.warm_up`` ran (the CPU GEMM choices before timing)."""
    from pasta_engine.worker.model_runner import ModelRunner

    calls: list = []
    real = ModelRunner.warm_up
    monkeypatch.setattr(ModelRunner, "warm_up", lambda self: calls.append(self) or real(self))
    return calls


def test_generate_both_warms_up_repeats_three_times_and_reports_the_spread(tiny_llama, warm_ups, built, capsys):
    rc = main(["generate", "Give tips", "--model", str(tiny_llama), "--mode", "both", "--json",
               "--max-new-tokens", "8", "--kv-cache-mb", "8"])
    out, err = capsys.readouterr()
    assert rc == 0, err
    assert len(built) == 1 and warm_ups == [built[0][0].model_runner]  # one engine, warmed up before timing
    row = json.loads(out.strip().splitlines()[-1])
    t = row["timing"]
    # issue 31 item 3: the content speedup sets a pasta replay against a sequential replay (both
    # forced: the same work); the end-to-end speedup sets generation against generation
    assert t["runs"] == 3 and set(t["wall_s"]) == {"pasta", "pasta_replay", "clean_text_sequential", "sequential"}
    for side, walls in t["wall_s"].items():
        assert len(walls) == 3
        assert t["wall_s_spread"][side] == {"min": min(walls), "median": sorted(walls)[1], "max": max(walls)}
    # the fastest run of each side counts; the per-run ratios are the spread of the realized speedup
    assert row["pasta"]["stats"]["wall_s"] == min(t["wall_s"]["pasta"])  # the generation the user got
    assert row["pasta_replay_wall_s"] == min(t["wall_s"]["pasta_replay"])
    assert row["sequential"]["stats"]["wall_s"] == min(t["wall_s"]["sequential"])
    assert row["end_to_end_speedup"] == pytest.approx(min(t["wall_s"]["sequential"]) / min(t["wall_s"]["pasta"]))
    assert row["realized_content_speedup"] == pytest.approx(min(t["wall_s"]["clean_text_sequential"])
                                                            / min(t["wall_s"]["pasta_replay"]))
    assert t["realized_content_speedup_runs"] == pytest.approx(
        [c / p for c, p in zip(t["wall_s"]["clean_text_sequential"], t["wall_s"]["pasta_replay"])])
    assert t["same_tokens"] and row["baseline"] == "same"
    s = summary_of(err)
    assert s["timing"]["runs_per_side"] == 3
    assert set(s["timing"]["geomean_realized_content_speedup_spread"]) == {"min", "median", "max"}
    if row["pasta"]["stats"]["forks"] == 0:  # random weights rarely fork: the summary says so
        assert any("none of the 1 answers forked" in w for w in s["warnings"])
        assert "pasta-engine: warning: none of the 1 answers forked" in err


def test_warmup_zero_and_repeats_one_are_honoured(tiny_llama, warm_ups, capsys):
    rc = main(["generate", "Give tips", "--model", str(tiny_llama), "--mode", "both", "--warmup", "0",
               "--repeats", "1", "--max-new-tokens", "4", "--kv-cache-mb", "8"])
    out, err = capsys.readouterr()
    assert rc == 0 and warm_ups == []
    assert "fastest of 1 runs each; per run" in out and "min / median / max" in out
    assert summary_of(err)["timing"]["runs_per_side"] == 1


def test_replay_both_repeats_reports_forked_only_figures_and_warns_about_unforked_answers(tiny_llama, tmp_path,
                                                                                         warm_ups, capsys):
    traces = tmp_path / "t.jsonl"
    traces.write_text("".join(json.dumps({"prompt": p, "annotated_response": a}) + "\n"
                              for p, a in (("tips", FORKED), ("rest", PLAIN))))
    rc = main(["replay", "--traces", str(traces), "--model", str(tiny_llama), "--json", "--mode", "both",
               "--kv-cache-mb", "8"])
    out, err = capsys.readouterr()
    assert rc == 0, err
    assert len(warm_ups) == 1
    rows = [json.loads(line) for line in out.strip().splitlines()]
    assert [r["pasta"]["stats"]["forks"] > 0 for r in rows] == [True, False]
    for r in rows:
        t = r["timing"]
        assert t["runs"] == 3 and set(t["wall_s"]) == {"pasta", "clean_text_sequential"}
        assert r["sequential"]["text"] == r["pasta"]["text"]  # the sequential side is the clean text
        assert r["realized_content_speedup"] == pytest.approx(
            r["sequential"]["stats"]["wall_s"] / r["pasta"]["stats"]["wall_s"])
        assert r["sequential"]["stats"]["wall_s"] == min(t["wall_s"]["clean_text_sequential"])
    s = summary_of(err)
    assert s["forked_only"]["prompts"] == 1
    assert s["forked_only"]["geomean_realized_content_speedup"] == pytest.approx(rows[0]["realized_content_speedup"])
    assert any(w.startswith("1 of 2 answers never forked") for w in s["warnings"])
    assert "pasta-engine: warning: 1 of 2 answers never forked" in err
    assert "tok_s=" in err  # the progress bar (two prompts) shows tokens per second


def test_no_progress_turns_the_bar_off(tiny_llama, tmp_path, capsys):
    prompts = tmp_path / "p.txt"
    prompts.write_text("one\ntwo\n")
    rc = main(["generate", "--prompts-file", str(prompts), "--model", str(tiny_llama), "--max-new-tokens", "3",
               "--kv-cache-mb", "8", "--no-progress"])
    _, err = capsys.readouterr()
    assert rc == 0 and "tok_s" not in err and "prompt/s" not in err and "s/prompt" not in err


def test_both_modes_use_the_same_weights_unless_baseline_base(tiny_llama, tmp_path, built, capsys):
    same = argparse.Namespace(no_adapter=False, adapter=None, baseline="same")
    assert adapter_choice(same, "sequential") == adapter_choice(same, "pasta") == "auto"  # as the server's mode
    assert adapter_choice(argparse.Namespace(no_adapter=False, adapter=None, baseline="base"), "sequential") is None
    rc = main(["generate", "x", "--model", str(tiny_llama), "--mode", "both", "--json", "--max-new-tokens", "4",
               "--kv-cache-mb", "8", "--repeats", "1", "--warmup", "0"])
    assert rc == 0 and len(built) == 1  # one engine answers in both modes
    capsys.readouterr()
    built.clear()
    d = tiny_adapter(tmp_path)
    rc = main(["generate", "x", "--model", str(tiny_llama), "--adapter", str(d), "--baseline", "base", "--mode",
               "both", "--json", "--max-new-tokens", "4", "--kv-cache-mb", "8", "--repeats", "1", "--warmup", "0"])
    out, err = capsys.readouterr()
    assert rc == 0, err
    assert [e.adapter for e, _ in built] == [d, None]  # pasta: the adapter; sequential: the base model's weights
    row = json.loads(out.strip().splitlines()[-1])
    assert row["baseline"] == "base" and "length_ratio" in row and set(row["finish_reasons"]) == {"sequential", "pasta"}
    s = summary_of(err)
    assert {"geomean_end_to_end_speedup", "geomean_length_ratio", "cut_fraction_sequential", "cut_fraction_pasta"} <= set(s)


def test_the_mode_both_summary_counts_forks_and_realized_means_over_answers_with_content():
    """An empty answer that forked counted as a forked response, and its realized speedup (its
    timing is noise) went into the geomean beside means that leave it out."""
    from pasta_engine.entrypoints.cli import _summary

    def row(content, forks, realized):
        stats = {"content_speedup": 1.5 if content else 0.0, "content_tokens": content, "forks": forks, "threads": 1 + forks,
                 "token_parallelism": 1.0, "tag_tokens": 0, "tokens_decoded": content + 1, "wall_s": 1.0}
        return {"pasta": {"stats": stats}, "realized_content_speedup": realized}

    out = _summary([row(20, 0, 1.0), row(0, 2, 9.0)])
    assert out["forked_responses"] == 0
    assert out["geomean_realized_content_speedup"] == 1.0
