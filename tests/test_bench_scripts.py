"""The benchmark scripts in bench/ (issue 20, Measuring): a rerun writes a new result file unless
told to overwrite, and bench/plot.py draws the CPU results as well as the GPU ones."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from bench_loader import load_bench  # noqa: E402  (tests/bench_loader.py)

BENCH = Path(__file__).resolve().parents[1] / "bench"
RESULTS = BENCH / "results"
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def load_common():
    return load_bench("common.py")


def test_new_path_keeps_an_existing_file(tmp_path):
    common = load_common()
    p = tmp_path / "r.json"
    assert common.new_path(p) == p  # nothing there yet
    p.write_text("{}")
    assert common.new_path(p) == tmp_path / "r-2.json"
    (tmp_path / "r-2.json").write_text("{}")
    assert common.new_path(p) == tmp_path / "r-3.json"
    assert common.new_path(p, overwrite=True) == p
    written = common.write_json("ignored", {"x": 1}, out=p)
    assert written == tmp_path / "r-3.json" and p.read_text() == "{}"
    assert common.write_json("ignored", {"x": 2}, out=p, overwrite=True) == p and json.loads(p.read_text())["x"] == 2


@pytest.mark.parametrize("script", ["bench_host.py", "bench_cpu_rows.py", "bench_server_load.py", "bench_csrc_ops.py",
                                    "bench_decode_step.py", "bench_tree_attention.py", "bench_threads.py"])
def test_every_result_writing_script_has_overwrite(script):
    out = subprocess.run([sys.executable, str(BENCH / script), "--help"], capture_output=True, text=True, env=ENV,
                         timeout=300)
    assert out.returncode == 0, out.stderr
    assert "--overwrite" in out.stdout


def test_bench_host_writes_a_new_file_unless_told_to_overwrite(tmp_path):
    out = tmp_path / "host.json"
    cmd = [sys.executable, str(BENCH / "bench_host.py"), "--threads", "1", "--repeats", "1", "--tail", "2",
           "--model-dir", str(tmp_path / "model"), "--out", str(out)]
    for _ in range(2):
        run = subprocess.run(cmd, capture_output=True, text=True, env=ENV, timeout=600)
        assert run.returncode == 0, run.stderr
    assert sorted(p.name for p in tmp_path.glob("*.json")) == ["host-2.json", "host.json"]
    run = subprocess.run([*cmd, "--overwrite"], capture_output=True, text=True, env=ENV, timeout=600)
    assert run.returncode == 0, run.stderr
    assert sorted(p.name for p in tmp_path.glob("*.json")) == ["host-2.json", "host.json"]
    assert json.loads(out.read_text())["results"][0]["threads"] == 1


def test_plot_draws_the_stored_results(tmp_path):
    # the CPU results and the first GPU run's tree-attention result (H200, bench/run_gpu.sh tree)
    names = ["cpu_rows.json", "host_step_cpu.json", "host_step_cpu_before.json", "server_load_cpu.json",
             "cpu_micro_host.json", "cpu_alpaca20_generate_both.json", "cpu_threads.json",
             "tree_attention_NVIDIA_H200.json"]
    cpu = [RESULTS / n for n in names]
    for p in cpu:
        shutil.copy(p, tmp_path / p.name)
    run = subprocess.run([sys.executable, str(BENCH / "plot.py"), *sorted(str(tmp_path / p.name) for p in cpu)],
                         capture_output=True, text=True, env=ENV, timeout=300)
    assert run.returncode == 0, run.stderr
    assert "skip" not in run.stdout
    for p in cpu:
        png = (tmp_path / p.name).with_suffix(".png")
        assert png.read_bytes().startswith(b"\x89PNG"), p.name


def test_bench_dialects_compares_the_three_dialects_on_the_same_answers(tmp_path):
    """bench_dialects.py on two list answers and a tiny preset: every dialect forks both, its
    theoretical figure is content tokens / critical path of each row, and the realized run on the
    first answer is recorded with its command."""
    answers = [{"instruction": f"q{i}", "dataset": "koala", "output": "Tips:\n" + "".join(
        f"{k}. **Item {k}**: do this well, every day, and write it down in a notebook.\n" for k in range(1, 4))}
        for i in range(2)]
    responses = tmp_path / "answers.json"
    responses.write_text(json.dumps(answers))
    out = tmp_path / "d.json"
    cmd = [sys.executable, str(BENCH / "bench_dialects.py"), "--responses", str(responses), "--limit", "2",
           "--realized", "1", "--preset", "tiny-llama", "--jobs", "2", "--out", str(out), "--", "--repeats", "1"]
    run = subprocess.run(cmd, capture_output=True, text=True, env=ENV, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(out.read_text())
    assert set(result["dialects"]) == {"pasta", "apar", "multiverse"}
    for name, d in result["dialects"].items():
        assert d["forked_answers"] == 2, name
        assert all(r["content_speedup"] == r["content_tokens"] / r["critical_path"] for r in d["rows"])
        assert len(d["realized_rows"]) == 1 and d["realized"] > 0 and "--dialect " + name in d["realized_run"]["command"]
    assert out.with_suffix(".png").read_bytes().startswith(b"\x89PNG")
    again = subprocess.run([*cmd[:-3], "--realized", "0"], capture_output=True, text=True, env=ENV, timeout=600)
    assert again.returncode == 0 and (tmp_path / "d-2.json").exists()  # a rerun never replaces a result


def test_judge_pairs_round_trip_counts_wins_from_the_candidates_side(tmp_path):
    """bench/judge_pairs.py: make hides which side is the candidate; join, given verdicts that
    always pick the candidate in the first order and always the baseline in the reversed one
    (and a tie), counts wins, losses and ties from the candidate's side in each order."""
    cand = [{"instruction": f"q{i}", "output": f"cand {i}"} for i in range(6)]
    base = [{"instruction": f"q{i}", "output": f"base {i}"} for i in range(6)]
    (tmp_path / "c.json").write_text(json.dumps(cand))
    (tmp_path / "b.json").write_text(json.dumps(base))
    out = tmp_path / "judge"
    run = subprocess.run([sys.executable, str(BENCH / "judge_pairs.py"), "make", "--candidate", str(tmp_path / "c.json"),
                          "--baseline", str(tmp_path / "b.json"), "--out", str(out), "--seed", "3"],
                         capture_output=True, text=True, env=ENV, timeout=120)
    assert run.returncode == 0, run.stderr
    pairs = [json.loads(x) for x in (out / "pairs.jsonl").read_text().splitlines()]
    rev = [json.loads(x) for x in (out / "pairs_reversed.jsonl").read_text().splitlines()]
    assert {p["answer_a"][:4] for p in pairs} == {"cand", "base"}  # both orders occur
    assert all(p["answer_a"] == r["answer_b"] for p, r in zip(pairs, rev))
    fwd = [{"id": p["id"], "verdict": "A" if p["answer_a"].startswith("cand") else "B"} for p in pairs]
    back = [{"id": r["id"], "verdict": "A" if r["answer_a"].startswith("base") else "B"} for r in rev]
    back[0]["verdict"] = "tie"
    (out / "verdicts.jsonl").write_text("".join(json.dumps(v) + "\n" for v in fwd))
    (out / "verdicts_reversed.jsonl").write_text("".join(json.dumps(v) + "\n" for v in back))
    run = subprocess.run([sys.executable, str(BENCH / "judge_pairs.py"), "join", "--out", str(out)],
                         capture_output=True, text=True, env=ENV, timeout=120)
    assert run.returncode == 0, run.stderr
    s = json.loads((out / "summary.json").read_text())
    assert (s["first_order"]["wins"], s["first_order"]["win_rate"]) == (6, 1.0)
    assert (s["reversed_order"]["losses"], s["reversed_order"]["ties"]) == (5, 1)
    assert s["reversed_order"]["win_rate"] == 0.5 / 6 and s["orders_agree"] == 0
    # rows are paired by instruction: a file that repeats one is refused, not paired wrongly
    (tmp_path / "b.json").write_text(json.dumps(base + [{"instruction": "q0", "output": "base again"}]))
    run = subprocess.run([sys.executable, str(BENCH / "judge_pairs.py"), "make", "--candidate", str(tmp_path / "c.json"),
                          "--baseline", str(tmp_path / "b.json"), "--out", str(tmp_path / "j2"), "--seed", "3"],
                         capture_output=True, text=True, env=ENV, timeout=120)
    assert run.returncode != 0 and "holds the instruction 'q0' twice" in run.stderr


def test_judge_pairs_refuses_a_folder_with_a_reading_and_bad_outputs_files(tmp_path):
    """``make`` over a folder that holds verdicts wrote new pairs and a new key beside the old
    verdicts, and ``join`` then read the old A/B letters against the new key (exit 0, a wrong
    win rate); it is refused now, naming the files. An outputs file that is not a list of
    ``{instruction, output}`` strings, or a ``join`` before any ``make``, is an error naming the
    problem instead of a traceback (or, for a null output, pairs holding null)."""
    def judge_pairs(*args):
        return subprocess.run([sys.executable, str(BENCH / "judge_pairs.py"), *args], capture_output=True, text=True,
                              env=ENV, timeout=120)

    rows = [{"instruction": f"q{i}", "output": f"x {i}"} for i in range(3)]
    (tmp_path / "c.json").write_text(json.dumps(rows))
    (tmp_path / "b.json").write_text(json.dumps(rows))
    out = tmp_path / "judge"
    make = ["make", "--candidate", str(tmp_path / "c.json"), "--baseline", str(tmp_path / "b.json"), "--out", str(out)]
    assert judge_pairs(*make).returncode == 0
    assert judge_pairs(*make, "--seed", "1").returncode == 0  # pairs made again before any verdict: fine
    (out / "verdicts.jsonl").write_text('{"id": 0, "verdict": "A"}\n')
    run = judge_pairs(*make, "--seed", "2")
    assert run.returncode != 0 and "already holds a reading (verdicts.jsonl)" in run.stderr, run.stderr
    for bad, says in [({"instruction": "q0"}, "row 0 has no string 'output'"),
                      ({"instruction": None, "output": "x"}, "row 0 has no string 'instruction'"),
                      ({"instruction": "q0", "output": None}, "row 0 has no string 'output'")]:
        (tmp_path / "b.json").write_text(json.dumps([bad]))
        run = judge_pairs(*make[:-1], str(tmp_path / "j2"))
        assert run.returncode != 0 and says in run.stderr and "Traceback" not in run.stderr, run.stderr
    (tmp_path / "b.json").write_text(json.dumps({"q0": "x"}))
    run = judge_pairs(*make[:-1], str(tmp_path / "j2"))
    assert run.returncode != 0 and "must hold a JSON list" in run.stderr and "Traceback" not in run.stderr
    run = judge_pairs("join", "--out", str(tmp_path / "nothing"))
    assert run.returncode != 0 and "key.json" in run.stderr and "Traceback" not in run.stderr, run.stderr


def test_frontier_writes_its_table_and_plot_from_stored_rows(tmp_path):
    """bench/frontier.py: from stored screen and judge summaries (no model run), a row per
    operating point with the win rate over both orders and its bootstrap interval, and a plot."""
    points = []
    for k, (speed, outcomes) in enumerate([(1.2, ["win", "tie", "loss", "win"]), (1.8, ["loss", "loss", "tie", "win"])]):
        screen, judge = tmp_path / f"s{k}", tmp_path / f"j{k}"
        screen.mkdir()
        judge.mkdir()
        (screen / "summary.json").write_text(json.dumps({"geomean_content_speedup": speed, "fork_rate": 0.5,
                                                         "mean_threads": 2.0}))
        rows = [{"id": i, "first_order": o, "reversed_order": o} for i, o in enumerate(outcomes)]
        tally = {"wins": 2 * outcomes.count("win"), "losses": 2 * outcomes.count("loss"), "ties": 2 * outcomes.count("tie")}
        rate = (outcomes.count("win") + 0.5 * outcomes.count("tie")) / len(outcomes)
        (judge / "summary.json").write_text(json.dumps({
            "rows": rows, "first_order": {"win_rate": rate, **{k2: v // 2 for k2, v in tally.items()}},
            "reversed_order": {"win_rate": rate, **{k2: v // 2 for k2, v in tally.items()}}}))
        points.append({"label": f"p{k}", "screen": f"s{k}", "judge": f"j{k}"})
    (tmp_path / "points.json").write_text(json.dumps(points))
    out = tmp_path / "out"
    run = subprocess.run([sys.executable, str(BENCH / "frontier.py"), "--points", str(tmp_path / "points.json"),
                          "--out", str(out), "--base", str(tmp_path)], capture_output=True, text=True, env=ENV,
                         timeout=300)
    assert run.returncode == 0, run.stderr
    got = json.loads((out / "frontier.json").read_text())["points"]
    assert [p["win_rate"] for p in got] == [0.625, 0.375]
    assert all(p["win_rate_ci95"][0] <= p["win_rate"] <= p["win_rate_ci95"][1] for p in got)
    assert "| p1 | 1.80x |" in (out / "frontier.md").read_text()
    assert (out / "frontier.png").read_bytes()[:4] == b"\x89PNG"
    # a point whose second reader has not judged yet is a row with "-" for that order
    j = json.loads((tmp_path / "j0" / "summary.json").read_text())
    j["reversed_order"]["win_rate"] = None
    for r in j["rows"]:
        r["reversed_order"] = None
    (tmp_path / "j0" / "summary.json").write_text(json.dumps(j))
    run = subprocess.run([sys.executable, str(BENCH / "frontier.py"), "--points", str(tmp_path / "points.json"),
                          "--out", str(out), "--base", str(tmp_path)], capture_output=True, text=True, env=ENV,
                         timeout=300)
    assert run.returncode == 0, run.stderr
    assert "62.5% / - |" in (out / "frontier.md").read_text()
    # a timed `bench speedup` summary gives the realized figure with its spread over the repeats
    # (read from the wrong level before: always null); a screen whose answers were all empty
    # (no theoretical speedup) is a row with "-", left off the plot
    (tmp_path / "t.json").write_text(json.dumps({"geomean_realized_content_speedup": 1.38, "geomean_content_speedup": 1.5,
                                                 "prompts": 40, "timing": {"geomean_realized_content_speedup_spread":
                                                                           {"min": 1.31, "median": 1.38, "max": 1.42}}}))
    points[0]["timed"] = "t.json"
    (tmp_path / "points.json").write_text(json.dumps(points))
    s1 = json.loads((tmp_path / "s1" / "summary.json").read_text())
    (tmp_path / "s1" / "summary.json").write_text(json.dumps({**s1, "geomean_content_speedup": None}))
    run = subprocess.run([sys.executable, str(BENCH / "frontier.py"), "--points", str(tmp_path / "points.json"),
                          "--out", str(out), "--base", str(tmp_path)], capture_output=True, text=True, env=ENV,
                         timeout=300)
    assert run.returncode == 0, run.stderr
    got = json.loads((out / "frontier.json").read_text())["points"]
    assert got[0]["realized"] == 1.38 and got[0]["realized_spread_over_repeats"] == {"min": 1.31, "median": 1.38,
                                                                                      "max": 1.42}
    assert "| p1 | - | - |" in (out / "frontier.md").read_text()
    # timed on a subset whose theoretical speedup is not the screen's: the cell says so
    assert "| p0 | 1.20x | 1.38x (1.50x theoretical on the 40 timed) |" in (out / "frontier.md").read_text()
    # a point read twice (a second reading of the same answers): every prompt's four verdicts
    # pooled; the table shows each reading's two orders
    j2 = tmp_path / "j0b"
    j2.mkdir()
    rows = [{"id": i, "first_order": "win", "reversed_order": "loss"} for i in range(4)]
    (j2 / "summary.json").write_text(json.dumps({"rows": rows, "first_order": {"win_rate": 1.0, "wins": 4, "losses": 0,
                                                                               "ties": 0},
                                                 "reversed_order": {"win_rate": 0.0, "wins": 0, "losses": 4, "ties": 0}}))
    j = json.loads((tmp_path / "j0" / "summary.json").read_text())
    j["rows"] = [{"id": i, "first_order": o, "reversed_order": o} for i, o in enumerate(["win", "tie", "loss", "win"])]
    j["reversed_order"]["win_rate"] = 0.625
    (tmp_path / "j0" / "summary.json").write_text(json.dumps(j))
    points[0]["judge"] = ["j0", "j0b"]
    (tmp_path / "points.json").write_text(json.dumps(points))
    run = subprocess.run([sys.executable, str(BENCH / "frontier.py"), "--points", str(tmp_path / "points.json"),
                          "--out", str(out), "--base", str(tmp_path)], capture_output=True, text=True, env=ENV,
                         timeout=300)
    assert run.returncode == 0, run.stderr
    got = json.loads((out / "frontier.json").read_text())["points"][0]
    # per prompt (w, w, W, L), (t, t, W, L), (l, l, W, L), (w, w, W, L): 0.75, 0.5, 0.25, 0.75
    assert got["win_rate"] == 0.5625 and got["wins_losses_ties"] == [8, 6, 2]
    assert "62.5% / 62.5%; 100.0% / 0.0% |" in (out / "frontier.md").read_text()
    rows.pop()  # readings of other prompts are refused, naming the files
    (j2 / "summary.json").write_text(json.dumps({**json.loads((j2 / "summary.json").read_text()), "rows": rows}))
    run = subprocess.run([sys.executable, str(BENCH / "frontier.py"), "--points", str(tmp_path / "points.json"),
                          "--out", str(out), "--base", str(tmp_path)], capture_output=True, text=True, env=ENV,
                         timeout=300)
    assert run.returncode != 0 and "must judge the same prompts" in run.stderr and "Traceback" not in run.stderr


def test_run_gpu_fails_without_a_gpu_and_when_a_stage_fails(tmp_path):
    """bench/run_gpu.sh: no CUDA GPU is one line and exit 2 before anything is installed; a stage
    that fails makes the script exit 1 naming it (it once ended with a bare ``exit 0``)."""
    script = str(BENCH / "run_gpu.sh")
    # stand-in interpreters, so the test says the same on a machine with a GPU and one without
    blind = tmp_path / "blind"
    blind.mkdir()
    (blind / "python").write_text('#!/usr/bin/env bash\ncase "$1" in -c) exit 1;; *) exit 0;; esac\n')
    (blind / "python").chmod(0o755)
    run = subprocess.run(["bash", script, "tests"], capture_output=True, text=True, timeout=300,
                         env={**ENV, "PYTHON": str(blind / "python")})
    assert run.returncode == 2, run.stdout + run.stderr
    assert [line for line in run.stderr.splitlines() if line.strip()] == [
        f"run_gpu.sh: no CUDA GPU visible to {blind / 'python'} (torch.cuda.is_available() is false): run it on the "
        "GPU machine"]
    assert run.stdout == ""  # nothing installed, built or run
    # a stand-in interpreter: it sees a GPU and installs fine, and every benchmark it runs fails
    fake = tmp_path / "python"
    fake.write_text("#!/usr/bin/env bash\n"
                    'case "$1 $2" in "-c "*|"-m pip") exit 0;; *bench_decode_step*) exit 3;; *) exit 0;; esac\n')
    fake.chmod(0o755)
    run = subprocess.run(["bash", script, "decode"], capture_output=True, text=True, timeout=300,
                         env={**ENV, "PYTHON": str(fake), "OUT": str(tmp_path / "out")})
    assert run.returncode == 1, run.stdout + run.stderr
    assert "run_gpu.sh: failed stage: decode step" in run.stderr


def test_bench_host_measures_a_given_worktree_with_the_sampler(tmp_path):
    """Issue 32's step host time, old engine against new: ``--worktree`` imports the engine from
    that checkout (recorded in the result), ``--logprobs`` makes every step run the sampler."""
    root = BENCH.parent
    out = tmp_path / "host.json"
    cmd = [sys.executable, str(BENCH / "bench_host.py"), "--threads", "1", "--repeats", "1", "--tail", "2",
           "--model-dir", str(tmp_path / "model"), "--out", str(out), "--worktree", str(root), "--logprobs"]
    run = subprocess.run(cmd, capture_output=True, text=True, env=ENV, timeout=600, cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    res = json.loads(out.read_text())
    assert res["engine_path"] == str(root.resolve()) and res["return_logprobs"] is True
    assert res["results"][0]["threads"] == 1


def test_screen_adapter_counts_an_empty_answer_instead_of_crashing(tmp_path, monkeypatch):
    """bench/screen_adapter.py: an answer with no content (the model ended at once: content
    speedup 0) is left out of the geometric means and counted, and the summary is written."""
    import runpy
    from types import SimpleNamespace as NS

    import pasta_engine

    class FakeEngine:
        lora_scale = 1.0

        @classmethod
        def from_pretrained(cls, *a, **k):
            return cls()

        def generate(self, prompts, params, mode, progress):
            def res(text, content):
                st = NS(forks=0, content_tokens=content, critical_path=content + 1, tag_tokens=0,
                        content_speedup=content / (content + 1) if content else 0.0, tokens_decoded=content + 1,
                        finish_reason="stop")
                return NS(stats=st, text=text, annotated_text=text, error=None)

            return [res("Hello there.", 3), res("", 0)]

    monkeypatch.setattr(pasta_engine, "Engine", FakeEngine)
    prompts = tmp_path / "p.json"
    prompts.write_text(json.dumps([{"instruction": "a", "dataset": "vicuna"}, {"instruction": "b", "dataset": "vicuna"}]))
    monkeypatch.setattr(sys, "argv", ["screen_adapter.py", "--prompts", str(prompts), "--out", str(tmp_path / "out"),
                                      "--adapter", "none"])
    runpy.run_path(str(BENCH / "screen_adapter.py"), run_name="__main__")
    s = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert s["empty_answers"] == 1 and s["geomean_content_speedup"] == 0.75
    # no vicuna row to screen (or --limit 0): an error naming it, before the model loads or a file is written
    for argv in (["--limit", "0"], ["--prompts", str(tmp_path / "none.json")]):
        (tmp_path / "none.json").write_text(json.dumps([{"instruction": "a", "dataset": "koala"}]))
        monkeypatch.setattr(sys, "argv", ["screen_adapter.py", "--prompts", str(prompts), "--out",
                                          str(tmp_path / "out2"), "--adapter", "none", *argv])
        with pytest.raises(SystemExit, match="--split 'vicuna'.* has no row with that dataset"):
            runpy.run_path(str(BENCH / "screen_adapter.py"), run_name="__main__")
        assert not (tmp_path / "out2").exists()


def _reading(out: Path, first: dict[int, str], reversed_: dict[int, str] | None, n: int = 4, meta: dict | None = None):
    """A blind reading of ``n`` rows in ``out``: the verdict files hold ``first`` and ``reversed_``
    (row id -> "win"/"loss"/"tie" from the candidate's side; None: no reversed file)."""
    from pasta_engine.tools.judge import write_blind_pairs

    write_blind_pairs([f"q{i}" for i in range(n)], [f"c{i}" for i in range(n)], [f"b{i}" for i in range(n)], out, 0,
                      {"label": "x", "candidate": "c", "baseline": "b"} if meta is None else meta)
    key = {k["id"]: k for k in json.loads((out / "key.json").read_text())["rows"]}

    def verdict(outcome: str, cand: str) -> str:
        return "tie" if outcome == "tie" else cand if outcome == "win" else {"A": "B", "B": "A"}[cand]

    for name, got, side in (("verdicts.jsonl", first, "candidate_in_pairs"),
                            ("verdicts_reversed.jsonl", reversed_, "candidate_in_pairs_reversed")):
        if got is not None:
            (out / name).write_text("".join(json.dumps({"id": i, "verdict": verdict(o, key[i][side])}) + "\n"
                                            for i, o in got.items()))


def test_judge_pairs_join_refuses_a_verdict_file_that_misses_rows(tmp_path):
    """A reversed reader who judged 2 of 4 rows: join once averaged the first order over 4 rows
    with the reversed one over 2 (mean 0.75) while frontier.py's per-prompt mean said 0.5. Now it
    stops naming the file and the ids it misses; a file not there yet is still an order nobody
    judged (mean_win_rate None)."""
    judge_pairs = load_bench("judge_pairs.py")
    out = tmp_path / "r"
    _reading(out, {0: "win", 1: "win", 2: "loss", 3: "loss"}, {0: "win", 1: "win"})
    with pytest.raises(ValueError, match=r"verdicts_reversed.jsonl judges 2 of the key's 4 rows: ids 2, 3 have no"):
        judge_pairs.join(out)
    run = subprocess.run([sys.executable, str(BENCH / "judge_pairs.py"), "join", "--out", str(out)],
                         capture_output=True, text=True, env=ENV, timeout=120)
    assert run.returncode != 0 and "ids 2, 3 have no verdict" in run.stderr and "Traceback" not in run.stderr
    (out / "verdicts_reversed.jsonl").unlink()
    s = judge_pairs.join(out)
    assert s["first_order"]["win_rate"] == 0.5 and s["reversed_order"]["judged"] == 0 and s["mean_win_rate"] is None


def test_judge_pairs_joins_a_key_without_a_label(tmp_path):
    """BoNBoN's training readings write keys without label/candidate/baseline fields: join once
    raised KeyError 'label' on them."""
    judge_pairs = load_bench("judge_pairs.py")
    out = tmp_path / "r"
    _reading(out, {0: "win", 1: "tie", 2: "loss", 3: "win"}, {0: "win", 1: "win", 2: "loss", 3: "tie"},
             meta={"candidate": "this round's samples"})
    s = judge_pairs.join(out)
    assert s["label"] is None and s["baseline"] is None and s["candidate"] == "this round's samples"
    assert s["mean_win_rate"] == (0.625 + 0.625) / 2


def test_frontier_win_rate_is_the_summarys_mean_or_refuses():
    """frontier.py's win rate over both orders is the summary's mean_win_rate when each order
    judged every row; rows judged in only one order of a partly judged order are refused (the
    per-prompt mean would be neither figure); an order nobody judged leaves the other's rate."""
    frontier = load_bench("frontier.py")
    rows = [{"id": i, "first_order": f, "reversed_order": r}
            for i, (f, r) in enumerate([("win", "win"), ("win", "tie"), ("loss", "loss"), ("loss", "win")])]
    mean, lo, hi = frontier.win_rate_interval(rows)
    assert mean == pytest.approx((0.5 + 0.625) / 2) and lo <= mean <= hi
    partial = [dict(r, reversed_order=None) if r["id"] >= 2 else r for r in rows]
    with pytest.raises(ValueError, match="reversed_order judged 2 of 4 rows"):
        frontier.win_rate_interval(partial)
    assert frontier.win_rate_interval([dict(r, reversed_order=None) for r in rows])[0] == 0.5
