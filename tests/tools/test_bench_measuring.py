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


# ---------------------------------------------------------------- what the figures are compared with, and over


def stepped(steps: int, per_step: float = 0.01, tokens=(1, 2, 3)):
    """A result whose wall time is exactly ``steps`` x ``per_step`` (an ideal engine)."""
    return SimpleNamespace(stats=SimpleNamespace(wall_s=steps * per_step, decode_steps=steps), token_ids=list(tokens))


@pytest.mark.parametrize("content, critical_path", [(21, 22), (42, 28)])
def test_a_perfectly_timed_run_is_not_flagged_its_ideal_is_the_step_speedup(content, critical_path):
    """The sequential side decodes content + 1 steps (its end-of-sequence), so an engine whose
    steps all cost the same realizes the step speedup, (content + 1) / critical path, a little
    above the theoretical content / critical path: that is no disturbed timing."""
    from pasta_engine.tools.bench import realized_beyond_theoretical, timing_record, timing_summary

    theoretical = content / critical_path
    runs = {"pasta": [stepped(critical_path)] * 3, "clean_text_sequential": [stepped(content + 1)] * 3}
    _, rec = timing_record(runs, theoretical)
    assert rec["realized_content_speedup_runs"][0] == pytest.approx((content + 1) / critical_path)
    assert (content + 1) / critical_path > theoretical
    assert rec["warnings"] == []
    assert rec["step_speedup"] == pytest.approx((content + 1) / critical_path)
    # beyond the step speedup (the sequential runs slowed down by other load), it is flagged
    slow = {"pasta": [stepped(critical_path)] * 3, "clean_text_sequential": [stepped(content + 1, 0.012)] * 3}
    _, bad = timing_record(slow, theoretical)
    assert len(bad["warnings"]) == 1 and "exceeds its ideal" in bad["warnings"][0]
    assert "step speedup" in bad["warnings"][0] and "disturbed" in bad["warnings"][0]
    assert timing_summary([{"index": 3, "timing": bad}, {"index": 4, "timing": rec}])["realized_beyond_theoretical"] == [3]
    assert realized_beyond_theoretical(1.0, 21 / 22, [1.0], ideal=1.0) is None
    assert realized_beyond_theoretical(1.06, 21 / 22, [1.06], ideal=1.0) is not None


def test_every_side_runs_once_untimed_before_the_timed_runs():
    """With prefix caching on, a prompt's first run prefills it and the runs after it read it
    from the cache: without an untimed run first, the first pasta run alone paid the prefill."""
    from pasta_engine.tools.bench import timed_runs

    calls: list[str] = []

    def side(name):
        return lambda *_: calls.append(name) or name

    runs = timed_runs(2, side("pasta"), side("clean"), side("sequential"), side("replay"))
    assert calls == ["pasta", "replay", "clean", "sequential"] * 3  # one untimed round, then two timed
    assert {k: len(v) for k, v in runs.items()} == {"pasta": 2, "pasta_replay": 2, "clean_text_sequential": 2,
                                                   "sequential": 2}
    calls.clear()
    runs = timed_runs(1, side("pasta"), side("clean"), prime=side("prime"))
    assert calls == ["prime", "pasta", "clean"] and runs["pasta"] == ["pasta"]


def test_bench_speedup_times_every_run_with_the_prompt_cached_alike(tiny_llama, tmp_path):
    """A prompt no warm-up replayed: every timed run of either side reads the same prompt
    tokens from the prefix cache (the first pasta run used to prefill them all)."""
    from pasta_engine import Engine, Limits
    from pasta_engine.tools.bench import run_speedup
    from pasta_engine.tools.traces import TraceRow

    engine = Engine.from_pretrained(tiny_llama, kv_cache_bytes=16 * 2**20, limits=Limits(max_threads=None),
                                    max_running_requests=1)
    prompt = "Please explain, in detail, " + " ".join(f"point{i}" for i in range(60)) + "?"
    traces = [TraceRow("short", PLAIN, "hand"), TraceRow(prompt, FORKED, "hand")]
    run_speedup(engine, traces, tmp_path, {}, warmup=1, repeats=2, progress=False)
    rows = [json.loads(line) for line in (tmp_path / "prompts.jsonl").read_text().splitlines()]
    t = rows[1]["timing"]
    cached = [n for side in ("pasta", "clean_text_sequential") for n in t["cached_tokens"][side]]
    assert len(cached) == 4 and len(set(cached)) == 1 and cached[0] > 100  # all alike, the long prompt cached
    assert len(set(t["prefill_tokens"]["pasta"])) == 1 and len(set(t["prefill_tokens"]["clean_text_sequential"])) == 1
    assert rows[1]["cached_tokens"] == rows[1]["cached_tokens_sequential"] == cached[0]


def _srow(cs, rs, content, forks):
    spread = {"min": rs, "median": rs, "max": rs}
    return {"forks": forks, "threads": forks + 1, "content_speedup": cs, "realized_content_speedup": rs,
            "realized_over_theoretical": rs / cs if cs else None, "step_speedup": 1.0, "token_parallelism": 1.0,
            "tag_tokens": 0, "tokens_decoded": content + 1, "wall_s": 1.0, "wall_s_sequential": rs,
            "content_tokens": content, "same_text": True,
            "timing": {"runs": 3, "wall_s_spread": {"pasta": {"min": 1, "median": 1, "max": 1}},
                       "realized_content_speedup_spread": spread, "warnings": []}}


def test_the_spreads_fork_counts_and_warnings_of_bench_speedup_are_over_the_headlines_answers():
    """An empty answer (content speedup 0) is left out of the headline means, and so out of the
    spread, the forked count, the forked-only figures and the fork warning beside them."""
    from pasta_engine.tools.bench import summarize_speedup

    s = summarize_speedup([_srow(2.0, 2.0, 100, forks=1), _srow(0.0, 0.25, 0, forks=1)])
    assert s["geomean_realized_content_speedup"] == 2.0 and s["empty_answers"] == 1
    assert s["timing"]["geomean_realized_content_speedup_spread"] == {"min": 2.0, "median": 2.0, "max": 2.0}
    assert s["forked_responses"] == 1 and s["forked_only"]["geomean_realized_content_speedup"] == 2.0
    assert s["warnings"] == []
    # two unforked answers with content and a forked empty one: none of the headline's answers forked
    s = summarize_speedup([_srow(0.95, 1.0, 20, forks=0), _srow(0.95, 1.0, 20, forks=0), _srow(0.0, 3.0, 0, forks=1)])
    assert s["forked_responses"] == 0 and s["forked_only"] is None
    assert len(s["warnings"]) == 1 and s["warnings"][0].startswith("none of the 2 answers forked")


def _prow(e2e, ratio, cont_p, cont_s, forks=1):
    return {"content_speedup": 1.2 if cont_p else 0.0, "realized_content_speedup": 1.1, "end_to_end_speedup": e2e,
            "length_ratio": ratio, "content_tokens_sequential": cont_s, "content_tokens_pasta": cont_p,
            "throughput_ratio": e2e * ratio if ratio is not None else None, "tokens_pasta": cont_p + 5,
            "tag_tokens": 5, "token_parallelism": 1.2, "step_speedup": 1.2, "forks": forks, "threads": forks + 1,
            "capped_chunks": 0, "cut_off_chunks": 0, "malformed_tags": 0, "finish_reason_sequential": "stop",
            "finish_reason": "stop", "wall_s": 1.0, "wall_s_sequential": e2e,
            "timing": {"runs": 3, "wall_s_spread": {"pasta": {"min": 1, "median": 1, "max": 1}},
                       "realized_content_speedup_spread": {"min": 1.1, "median": 1.1, "max": 1.1}, "warnings": []}}


def test_bench_pareto_takes_the_end_to_end_means_over_prompts_where_both_answers_have_content():
    """An empty pasta answer (EOS at once: 50x 'faster', length ratio 0) used to stay in the
    end-to-end geomean (3.05x) while its length ratio dropped out of the one beside it (1.0)."""
    from pasta_engine.tools.bench import summarize_pareto

    rows = [_prow(1.2, 1.0, 100, 100), _prow(1.2, 1.0, 100, 100), _prow(1.2, 1.0, 100, 100),
            _prow(50.0, 0.0, 0, 100, forks=1), _prow(9.0, None, 100, 0, forks=1)]
    s = summarize_pareto(rows)
    assert s["geomean_end_to_end_speedup"] == pytest.approx(1.2)
    assert s["geomean_length_ratio"] == pytest.approx(1.0) and s["geomean_throughput_ratio"] == pytest.approx(1.2)
    assert (s["end_to_end_prompts"], s["end_to_end_left_out"]) == (3, 2)
    assert s["empty_answers"] == {"sequential": 1, "pasta": 1}
    f = s["forked_only"]  # the four with a pasta answer with content; the one whose baseline is empty left out
    assert f["prompts"] == 4 == s["forked_responses"] and f["end_to_end_left_out"] == 1
    assert f["geomean_end_to_end_speedup"] == pytest.approx(1.2) and f["geomean_length_ratio"] == pytest.approx(1.0)
    assert s["timing"]["geomean_realized_content_speedup_spread"]["min"] == pytest.approx(1.1)


def test_bench_pareto_step_speedup_is_over_the_same_text_on_both_sides():
    """The row's ``step_speedup`` (a content figure of the summary) divided the sequential
    generation's steps (another answer, 201 steps) by the pasta run's (40): 5.0x. It is now the
    pasta answer's clean text replayed sequentially (51 steps) over the pasta replay (40), and
    the ratio of the two generations is ``end_to_end_step_speedup``, averaged with the other
    end-to-end figures."""
    from types import SimpleNamespace as NS

    from pasta_engine.tools.bench import pareto_row, summarize_pareto

    def res(content, steps, wall, forks=1):
        st = NS(content_tokens=content, content_speedup=content / steps, wall_s=wall, tokens_decoded=steps,
                tag_tokens=0, token_parallelism=1.0, decode_steps=steps, critical_path=steps, forks=forks,
                threads=forks + 1, finish_reason="stop")
        return NS(stats=st, text="p" * content, annotated_text="p" * content, diagnostics=[])

    pasta, seq, clean_seq, replay = res(50, 40, 1.0), res(200, 201, 5.0, 0), res(50, 51, 1.3, 0), res(50, 40, 1.0)
    row = pareto_row(seq, pasta, clean_seq, replay)
    assert row["step_speedup"] == pytest.approx(51 / 40) and row["end_to_end_step_speedup"] == pytest.approx(201 / 40)
    assert pareto_row(seq, pasta)["step_speedup"] is None  # no replay of the same text: no content figure
    s = summarize_pareto([row])
    assert s["geomean_step_speedup"] == pytest.approx(51 / 40)
    assert s["geomean_end_to_end_step_speedup"] == pytest.approx(201 / 40)


def test_the_plot_writes_the_summarys_geomeans(tmp_path, monkeypatch):
    """The geomeans drawn on speedup.png are the summary's, over the answers with content (an
    empty answer's 0.25x 'realized speedup' used to pull the drawn one down to 0.71x)."""
    pytest.importorskip("matplotlib")
    from matplotlib.axes import Axes

    from pasta_engine.tools.bench import plot_speedup, summarize_speedup

    drawn: list[str] = []
    real = Axes.text
    monkeypatch.setattr(Axes, "text", lambda self, x, y, s, *a, **kw: drawn.append(s) or real(self, x, y, s, *a, **kw))
    rows = [_srow(2.0, 2.0, 100, forks=1), _srow(0.0, 0.25, 0, forks=1)]
    plot_speedup(rows, tmp_path / "p.png")
    s = summarize_speedup(rows)
    (text,) = [t for t in drawn if t.startswith("geomean")]
    assert (f"theoretical {s['geomean_content_speedup']:.2f}x, realized {s['geomean_realized_content_speedup']:.2f}x"
            in text)
    assert "1 prompts (1 empty answers left out)" in text


# ---------------------------------------------------------------- what a row was measured from


def test_resume_refuses_rows_measured_from_other_inputs(tiny_llama, tmp_path):
    """Each row records its annotated response's hash, its annotator and dialect; --resume
    keeps only rows of the same inputs (it used to check the prompt alone) and refuses rows
    that do not record them."""
    from pasta_engine import Engine, Limits
    from pasta_engine.tools.bench import BenchError, run_speedup
    from pasta_engine.tools.traces import TraceRow

    engine = Engine.from_pretrained(tiny_llama, kv_cache_bytes=16 * 2**20, limits=Limits(max_threads=None),
                                    max_running_requests=1)
    out = tmp_path / "run"
    run_speedup(engine, [TraceRow("tips", FORKED, "sot")], out, {}, warmup=0, repeats=1, progress=False)
    row = json.loads((out / "prompts.jsonl").read_text())
    plain = "Tips: Sleep. Walk. Done."
    for traces, dialect, what in (
            ([TraceRow("tips", plain, "sot"), TraceRow("more", plain, "sot")], "pasta", "annotated_sha256"),
            ([TraceRow("tips", FORKED, "none"), TraceRow("more", plain, "none")], "pasta", "annotator 'sot' there"),
            ([TraceRow("tips", FORKED, "sot"), TraceRow("more", plain, "sot")], "apar", "dialect 'pasta' there")):
        with pytest.raises(BenchError) as e:
            run_speedup(engine, traces, out, {}, warmup=0, repeats=1, resume=True, progress=False, dialect=dialect)
        msg = str(e.value)
        assert f"{out / 'prompts.jsonl'} row 1 was measured with other inputs" in msg and what in msg
        assert "remove" in msg and "resume with the same traces, annotator and --dialect" in msg
    res = run_speedup(engine, [TraceRow("tips", FORKED, "sot"), TraceRow("more", plain, "sot")], out, {}, warmup=0,
                      repeats=1, resume=True, progress=False)
    assert res["settings"]["resumed_rows"] == 1 and res["summary"]["prompts"] == 2
    from pasta_engine.tools.bench import trace_sha256

    assert row["annotated_sha256"] == trace_sha256(FORKED) and (row["annotator"], row["dialect"]) == ("sot", "pasta")
    del row["annotated_sha256"]  # a row of an older version
    (out / "prompts.jsonl").write_text(json.dumps(row) + "\n")
    with pytest.raises(BenchError, match="older pasta-engine that did not record its inputs"):
        run_speedup(engine, [TraceRow("tips", FORKED, "sot")], out, {}, warmup=0, repeats=1, resume=True,
                    progress=False)


def test_resume_of_bench_pareto_refuses_rows_of_other_sampling_settings(tmp_path):
    from pasta_engine.config import SamplingParams
    from pasta_engine.tools.bench import BenchError, resumed_rows, sampling_record

    greedy, warm = sampling_record(SamplingParams(max_new_tokens=8)), sampling_record(SamplingParams(
        max_new_tokens=8, temperature=0.7))
    (tmp_path / "prompts.jsonl").write_text(json.dumps({"instruction": "a", "content_speedup": 1.0,
                                                        "sampling": greedy}) + "\n")
    assert len(resumed_rows(tmp_path, ["a", "b"], True, need="content_speedup", inputs=[{"sampling": greedy}] * 2)) == 1
    with pytest.raises(BenchError, match=r"sampling: temperature 0\.0 there, 0\.7 here.*same sampling flags"):
        resumed_rows(tmp_path, ["a", "b"], True, need="content_speedup", inputs=[{"sampling": warm}] * 2)
    (tmp_path / "prompts.jsonl").write_text(json.dumps({"instruction": "a", "content_speedup": 1.0}) + "\n")
    with pytest.raises(BenchError, match="did not record its inputs"):
        resumed_rows(tmp_path, ["a"], True, need="content_speedup", inputs=[{"sampling": greedy}])


def test_multiverse_traces_count_the_forks_a_replay_forks(tiny_llama):
    """A Multiverse block forks one thread per path, nested blocks too; the traces' 'promises'
    (their forks) counted blocks, so the warm-up picked the first trace, not the widest."""
    from pasta_engine import Engine, Limits
    from pasta_engine.core.replay import replay_script
    from pasta_engine.lang.dialect import get_dialect
    from pasta_engine.lang.multiverse import path_header
    from pasta_engine.tools.bench import annotate_rows_in_dialect, warmup_traces
    from pasta_engine.tools.traces import PromptRow

    ans2 = "Two things:\n1. Rest.\n2. Read.\nEnd."
    ans4 = "Tips:\n- Sleep well at night.\n- Walk every day.\n- Drink water often.\n- Eat some greens.\nDone."
    rows = annotate_rows_in_dialect([PromptRow("two", ans2), PromptRow("four", ans4)], "multiverse")
    engine = Engine.from_pretrained(tiny_llama, kv_cache_bytes=16 * 2**20, limits=Limits(max_threads=None))
    forks = [engine.replay([r.prompt], [r.annotated_response], mode="pasta", dialect="multiverse")[0].stats.forks
             for r in rows]
    assert [r.promises for r in rows] == forks == [2, 4]
    assert [t.prompt for t in warmup_traces(rows, "multiverse")] == ["two", "four"]

    def block(paths):
        outlines = "".join(f"<Outline>{i}: x</Outline>" for i in range(1, len(paths) + 1))
        return (f"<Parallel><Goal>{outlines}</Goal>" + "".join(f"{path_header(i)}{p}</Path>" for i, p in
                                                              enumerate(paths, 1)) + "<Conclusion>ok</Conclusion></Parallel>")

    from pasta_engine.tools.bench import trace_forks

    nested = "Intro " + block(["p1 " + block(["deep one", "deep two"]) + " after", "p2 short"]) + " tail"
    mv = get_dialect("multiverse")
    script = replay_script(engine.tokenizer, nested, engine.eos_ids[0], mv)
    assert trace_forks(nested, "multiverse") == len(script.structure.forks) == 4
    assert trace_forks(FORKED) == 2 and trace_forks(PLAIN) == 0
    assert trace_forks('A <promise topic="a" tokens="3"/> no chunk, B') == 0  # a promise without its chunk forks none


def test_bench_pareto_times_every_run_with_the_prompt_cached_alike(tiny_llama, tmp_path, capsys):
    """bench pareto primes each prompt with short untimed answers of both modes: every timed
    run of every side (generations and replays) reads the prompt from the cache alike."""
    prompts = tmp_path / "p.txt"
    prompts.write_text("Please explain, in detail, " + " ".join(f"point{i}" for i in range(40)) + "?\n")
    out = tmp_path / "pareto"
    assert main(["bench", "pareto", "--prompts", str(prompts), "--model", str(tiny_llama), "--max-new-tokens", "6",
                 "--kv-cache-mb", "8", "--warmup", "0", "--repeats", "2", "--no-progress", "--out", str(out)]) == 0
    capsys.readouterr()
    row = json.loads((out / "prompts.jsonl").read_text())
    cached, prefill = row["timing"]["cached_tokens"], row["timing"]["prefill_tokens"]
    assert set(cached) == {"pasta", "pasta_replay", "clean_text_sequential", "sequential"}
    for side, runs in cached.items():
        assert len(runs) == 2 and runs[0] == runs[1] > 0, (side, cached)
        assert prefill[side][0] == prefill[side][1], (side, prefill)
    assert row["sampling"]["max_new_tokens"] == 6
