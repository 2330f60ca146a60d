"""Bad inputs to the benchmark scripts end as one named error before any expensive work, never as
a traceback or a result that silently ignores them: bench/screen_adapter.py (pasta-only flags in
``--mode sequential``, ``--limit -1``, a bad flag value), bench/bench_decode_step.py
(``--widths``), bench/judge_pairs.py with tools/judge.py (an ``--out`` that is a file, a broken
key.json) and bench/quality_proxies.py (a run without answers). No model runs: the engine is a
stand-in, as in tests/test_bench_scripts.py."""

from __future__ import annotations

import json
import os
import runpy
import subprocess
import sys
from pathlib import Path

import pytest

from bench_loader import load_bench  # noqa: E402  (tests/bench_loader.py)

BENCH = Path(__file__).resolve().parents[1] / "bench"
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


@pytest.fixture
def screen(tmp_path, monkeypatch, capsys):
    """Run bench/screen_adapter.py with extra flags on two vicuna prompts and a stand-in engine:
    ``(exit code or None, stderr, whether the engine loaded)``."""
    from types import SimpleNamespace as NS

    import pasta_engine

    loaded = []

    class FakeEngine:
        lora_scale = 1.0

        @classmethod
        def from_pretrained(cls, *a, **k):
            loaded.append(k)
            return cls()

        def generate(self, prompts, params, mode, progress):
            st = NS(forks=0, content_tokens=3, critical_path=4, tag_tokens=0, content_speedup=0.75,
                    tokens_decoded=4, finish_reason="stop")
            return [NS(stats=st, text="Hi.", annotated_text="Hi.", error=None) for _ in prompts]

    monkeypatch.setattr(pasta_engine, "Engine", FakeEngine)
    prompts = tmp_path / "p.json"
    prompts.write_text(json.dumps([{"instruction": x, "dataset": "vicuna"} for x in "abc"]))

    def run(*extra: str):
        loaded.clear()
        capsys.readouterr()
        monkeypatch.setattr(sys, "argv", ["screen_adapter.py", "--prompts", str(prompts), "--out",
                                          str(tmp_path / "out"), "--adapter", "none", *extra])
        code = None
        try:
            runpy.run_path(str(BENCH / "screen_adapter.py"), run_name="__main__")
        except SystemExit as e:
            code = e.code
        return code, capsys.readouterr().err, bool(loaded)

    run.out = tmp_path / "out"
    return run


def test_screen_adapter_runs_with_good_flags(screen):
    code, err, loaded = screen("--mode", "sequential", "--limit", "2")
    assert code is None and loaded, err
    s = json.loads((screen.out / "summary.json").read_text())
    assert s["prompts"] == 2 and s["settings"]["mode"] == "sequential"


def test_screen_adapter_screens_the_split_asked_for(screen, tmp_path):
    """``--split`` picks the rows of one ``dataset`` (``all``: every row) and keeps each row's
    dataset in model_outputs.json; a split with no row is one error before the model loads."""
    (tmp_path / "p.json").write_text(json.dumps([{"instruction": "a", "dataset": "vicuna"},
                                                 {"instruction": "b", "dataset": "koala"},
                                                 {"instruction": "c", "dataset": "koala"}]))
    for split, want in [("koala", ["b", "c"]), ("all", ["a", "b", "c"]), ("vicuna", ["a"])]:
        code, err, loaded = screen("--split", split)
        assert code is None and loaded, err
        rows = json.loads((screen.out / "model_outputs.json").read_text())
        assert [r["instruction"] for r in rows] == want
        assert [r["dataset"] for r in rows] == ["vicuna" if x == "a" else "koala" for x in want]
        assert json.loads((screen.out / "summary.json").read_text())["settings"]["split"] == split
    # a second --out overrides the fixture's (argparse keeps the last): nothing may be written there
    code, err, loaded = screen("--split", "oasst", "--out", str(tmp_path / "none"))
    assert code and "--split 'oasst'" in str(code) and not loaded, (code, err)
    assert not (tmp_path / "none").exists()


@pytest.mark.parametrize("flags", [["--fork-threshold", "0.2"], ["--max-forks", "0"], ["--independent-topics"],
                                   ["--no-distinct-topics"], ["--no-chunk-clean-end"]])
def test_screen_adapter_refuses_pasta_flags_in_sequential_mode(screen, flags):
    """Sequential mode acts on no tag: these flags were accepted, ignored and recorded in the
    settings as applied. Now one line naming the flag, exit 2, before the model loads."""
    code, err, loaded = screen("--mode", "sequential", *flags)
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and " ".join(flags) in lines[0] and "--mode sequential" in lines[0], err
    assert not loaded and not screen.out.exists()
    code, err, loaded = screen("--mode", "pasta", *flags)  # where they act: accepted
    assert code is None and loaded, err


@pytest.mark.parametrize("limit", ["-1", "-2", "x"])
def test_screen_adapter_refuses_a_negative_limit(screen, limit):
    """``--limit -1`` sliced off the last row (rows[:-1]) and screened the rest, exit 0."""
    code, err, loaded = screen("--limit", limit)
    assert code == 2 and "argument --limit" in err and "Traceback" not in err, err
    assert not loaded and not screen.out.exists()


@pytest.mark.parametrize("flags, named", [(["--fork-threshold", "2"], "--fork-threshold"),
                                          (["--max-forks", "-1"], "--max-forks"),
                                          (["--max-new-tokens", "0"], "--max-new-tokens"),
                                          (["--repetition-penalty", "-1"], "--repetition-penalty"),
                                          (["--max-running-requests", "0"], "--max-running-requests")])
def test_screen_adapter_names_the_flag_of_a_bad_value_before_the_model_loads(screen, flags, named):
    """A ParameterError naming the field (not the flag) was a traceback, for --max-new-tokens and
    --repetition-penalty only after the model had loaded; --max-running-requests 0 went through."""
    code, err, loaded = screen(*flags)
    assert code == 2 and named in err.strip().splitlines()[-1] and "Traceback" not in err, err
    assert not loaded and not screen.out.exists()


def test_screen_adapter_names_the_flag_of_a_parameter_error_from_the_engine(screen, monkeypatch):
    """A ParameterError raised once the model loads (here the adapter's) is one line too."""
    import pasta_engine
    from pasta_engine.errors import CheckpointError

    def refuse(*a, **k):
        raise CheckpointError("adapter", "x", message="adapter x: no adapter_config.json")

    monkeypatch.setattr(pasta_engine.Engine, "from_pretrained", refuse)
    code, err, _ = screen()
    assert code == 2 and err.strip().splitlines() == ["screen_adapter: error: --adapter: adapter x: no adapter_config.json"]


@pytest.mark.parametrize("widths", ["1,x", "0,-3", "", ","])
def test_bench_decode_step_checks_widths_before_any_work(widths):
    """--widths was parsed inside the model loop (after the bandwidth, checkpoint and engine work)
    and 0 / -3 gave a result of empty rows: now an argparse error naming it, before the GPU check."""
    run = subprocess.run([sys.executable, str(BENCH / "bench_decode_step.py"), "--widths", widths],
                         capture_output=True, text=True, env=ENV, timeout=300)
    assert run.returncode == 2 and "argument --widths" in run.stderr and "Traceback" not in run.stderr, run.stderr


def test_bench_decode_step_widths_type():
    decode = load_bench("bench_decode_step.py")
    assert decode.widths_list("1, 2,16") == [1, 2, 16]
    assert decode.widths_list("1,2,4,8,16") == [1, 2, 4, 8, 16]


def _judge_pairs(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(BENCH / "judge_pairs.py"), *args], capture_output=True, text=True,
                          env=ENV, timeout=120)


def test_judge_pairs_make_names_an_out_that_is_a_file(tmp_path):
    rows = [{"instruction": f"q{i}", "output": f"x{i}"} for i in range(2)]
    for n in ("c.json", "b.json"):
        (tmp_path / n).write_text(json.dumps(rows))
    (tmp_path / "afile").write_text("x")
    for out in (tmp_path / "afile", tmp_path / "afile" / "sub"):
        run = _judge_pairs("make", "--candidate", str(tmp_path / "c.json"), "--baseline", str(tmp_path / "b.json"),
                           "--out", str(out))
        assert run.returncode != 0 and "Traceback" not in run.stderr, run.stderr
        assert f"--out {out}" in run.stderr and len(run.stderr.strip().splitlines()) == 1, run.stderr
    assert (tmp_path / "afile").read_text() == "x"


@pytest.mark.parametrize("key, says", [({"label": "x"}, "has no 'rows' list"),
                                       ([], "is a JSON list, not an object"),
                                       ({"rows": [{"id": 0}]}, "row 0 (id 0): 'candidate_in_pairs' must be"),
                                       ({"rows": [{"id": 0, "candidate_in_pairs": "A"}]},
                                        "'candidate_in_pairs_reversed' must be"),
                                       ({"rows": ["x"]}, "row 0 has no int 'id'"),
                                       ({"rows": [{"id": 0, "candidate_in_pairs": "A",
                                                   "candidate_in_pairs_reversed": "B"}] * 2},
                                        "id 0 is on an earlier row already"),
                                       ("{not json", "is not JSON")])
def test_judge_pairs_join_names_a_broken_key(tmp_path, key, says):
    """join on a key without rows, a key that is a list, or a row without its sides raised
    KeyError/TypeError from tools/judge.py (a traceback): now ValueError naming key.json."""
    from pasta_engine.tools.judge import read_blind_sides

    (tmp_path / "key.json").write_text(key if isinstance(key, str) else json.dumps(key))
    (tmp_path / "verdicts.jsonl").write_text('{"id": 0, "verdict": "A"}\n')
    with pytest.raises(ValueError, match="key.json") as e:
        read_blind_sides(tmp_path)
    assert says in str(e.value)
    run = _judge_pairs("join", "--out", str(tmp_path))
    assert run.returncode != 0 and "Traceback" not in run.stderr, run.stderr
    assert str(tmp_path / "key.json") in run.stderr and says in run.stderr, run.stderr


def test_quality_proxies_names_a_run_without_answers(tmp_path):
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "prompts.jsonl").write_text("\n")
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "prompts.jsonl").write_text("[1]\n")
    for run_dir, says in ((tmp_path / "nothere", "not found"), (tmp_path / "empty", "holds no row"),
                          (tmp_path / "bad", "line 1 is not a JSON object")):
        run = subprocess.run([sys.executable, str(BENCH / "quality_proxies.py"), str(run_dir)], capture_output=True,
                             text=True, env=ENV, timeout=120)
        lines = run.stderr.strip().splitlines()
        assert run.returncode == 2 and len(lines) == 1, run.stderr
        assert str(run_dir / "prompts.jsonl") in lines[0] and says in lines[0]
