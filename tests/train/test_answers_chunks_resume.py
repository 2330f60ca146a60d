"""Resuming ``train answers`` into the same --out after a kill cut a row of answers.jsonl off."""

from __future__ import annotations

import json


def _main(argv, capsys):
    from pasta_engine.entrypoints.cli import main

    capsys.readouterr()
    rc = main(argv)
    return rc, capsys.readouterr().err


def _rows(path):
    return [json.loads(x) for x in path.read_text(encoding="utf-8").splitlines() if x.strip()]


def test_train_answers_resumes_after_a_kill_left_half_a_row(tiny_llama, tmp_path, capsys, monkeypatch):
    """A kill mid-write left answers.jsonl ending in half a row: every rerun failed, after the
    model loaded, with a bare JSON error naming neither the file nor the fix."""
    prompts = tmp_path / "p.json"
    prompts.write_text(json.dumps([{"instruction": f"How to sleep better {k}?", "dataset": "koala"} for k in range(3)]))
    out = tmp_path / "a"
    cmd = ["train", "answers", "--prompts", str(prompts), "--model", str(tiny_llama), "--out", str(out),
           "--max-new-tokens", "4", "--batch", "2", "--device", "cpu"]
    assert _main(cmd + ["--limit", "2"], capsys)[0] == 0
    log = out / "answers.jsonl"
    whole = log.read_bytes()
    log.write_bytes(whole[: len(whole) - 25])  # the last row cut part-way, as a kill mid-write leaves it
    rc, err = _main(cmd, capsys)
    assert rc == 0, err
    rows = _rows(log)  # the cut-off row answered again, the new rows on lines of their own
    assert sorted(r["instruction"] for r in rows) == [f"How to sleep better {k}?" for k in range(3)]
    assert [a["instruction"] for a in json.loads((out / "answers.json").read_text())] == [
        f"How to sleep better {k}?" for k in range(3)]
    # a bad line that is not the last is no interrupted write: refused before the model loads, naming file and line
    from pasta_engine.engine.llm_engine import Engine

    def no_load(*a, **k):
        raise AssertionError("the model loaded")

    monkeypatch.setattr(Engine, "from_pretrained", no_load)
    log.write_text("{oops\n" + log.read_text(encoding="utf-8"), encoding="utf-8")
    rc, err = _main(cmd, capsys)
    assert rc == 2 and f"{log}: line 1 is not a JSON row" in err and "delete that line" in err, err
