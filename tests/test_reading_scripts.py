"""The scripts that read blind pairwise readings: bench/proxy_agreement.py joins each verdict to
its answers through the question of its id, not by position; it and bench/frontier.py say what is
missing in one line instead of a traceback."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "bench"
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, env=ENV, timeout=300)


def _reading(tmp_path: Path) -> Path:
    """4 prompts: the candidate is longer on q0 and q1, where the reader prefers it, and
    shorter on q2 and q3, where the reader prefers the baseline (both orders)."""
    cand = [{"instruction": f"q{i}", "output": "one two three four five six seven" if i < 2 else "one"}
            for i in range(4)]
    (tmp_path / "c.json").write_text(json.dumps(cand))
    (tmp_path / "b.json").write_text(json.dumps([{"instruction": f"q{i}", "output": "one two three"}
                                                 for i in range(4)]))
    judge = tmp_path / "judge"
    made = _run(str(BENCH / "judge_pairs.py"), "make", "--candidate", str(tmp_path / "c.json"), "--baseline",
                str(tmp_path / "b.json"), "--out", str(judge))
    assert made.returncode == 0, made.stderr
    return judge


def _verdicts(judge: Path) -> None:
    key = {k["id"]: k for k in json.loads((judge / "key.json").read_text())["rows"]}
    for name, side in (("verdicts.jsonl", "candidate_in_pairs"), ("verdicts_reversed.jsonl",
                                                                  "candidate_in_pairs_reversed")):
        rows = []
        for i in range(4):
            c = key[i][side]
            rows.append(json.dumps({"id": i, "verdict": c if i < 2 else {"A": "B", "B": "A"}[c]}) + "\n")
        (judge / name).write_text("".join(rows))


def test_verdicts_meet_their_own_answers_whatever_the_files_order(tmp_path):
    """The candidate file's rows were zipped with the summary's by position: the same answers
    in another order after the reading gave length agreement 0.0 instead of 1.0, and an extra
    row silently dropped the last prompt."""
    judge = _reading(tmp_path)
    _verdicts(judge)
    assert _run(str(BENCH / "judge_pairs.py"), "join", "--out", str(judge)).returncode == 0
    cand = json.loads((tmp_path / "c.json").read_text())
    for rows in (cand, cand[::-1], [{"instruction": "q9", "output": "x"}] + cand):
        (tmp_path / "c.json").write_text(json.dumps(rows))
        run = _run(str(BENCH / "proxy_agreement.py"), "--judge", str(judge))
        assert run.returncode == 0, run.stderr
        out = json.loads(run.stdout)
        assert out["prompts"] == 4 and out["proxies"]["length_words"] == {
            "agreement": 1.0, "decided": 4, "reader_even": 0, "proxy_even": 0}
    (tmp_path / "c.json").write_text(json.dumps(cand[1:]))  # q0's answer gone: not this reading's file
    run = _run(str(BENCH / "proxy_agreement.py"), "--judge", str(judge))
    assert run.returncode == 1 and "has no answer to pairs.jsonl row" in run.stderr and "Traceback" not in run.stderr


def test_a_reading_without_verdicts_or_files_is_named_not_a_traceback(tmp_path):
    judge = _reading(tmp_path)
    assert _run(str(BENCH / "judge_pairs.py"), "join", "--out", str(judge)).returncode == 0  # no verdict yet
    run = _run(str(BENCH / "proxy_agreement.py"), "--judge", str(judge))
    assert run.returncode == 1 and "joins no verdict" in run.stderr and "Traceback" not in run.stderr
    (tmp_path / "b.json").unlink()
    run = _run(str(BENCH / "proxy_agreement.py"), "--judge", str(judge))
    assert run.returncode == 1 and "cannot read" in run.stderr and "b.json" in run.stderr


def test_frontier_names_a_missing_file_or_a_partial_reading_in_one_line(tmp_path):
    """bench/frontier.py printed its own named errors (and a missing folder's) as tracebacks."""
    (tmp_path / "points.json").write_text(json.dumps([{"label": "p", "screen": "nowhere", "judge": "nowhere"}]))
    run = _run(str(BENCH / "frontier.py"), "--points", str(tmp_path / "points.json"), "--out", str(tmp_path / "o"),
               "--base", str(tmp_path))
    assert run.returncode == 1 and "Traceback" not in run.stderr
    assert run.stderr.startswith("frontier: cannot read") and "nowhere" in run.stderr
    run = _run(str(BENCH / "frontier.py"), "--points", str(tmp_path / "missing.json"), "--out", str(tmp_path / "o"))
    assert run.returncode == 1 and "missing.json" in run.stderr and "Traceback" not in run.stderr
