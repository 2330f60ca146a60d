"""The pasta-engine command line on a tiny checkpoint."""

from __future__ import annotations

import json

from pasta_engine.entrypoints.cli import main

ANNOTATED = 'Tips: <promise topic="a" tokens="10"/><async>Sleep.</async> <promise topic="b" tokens="10"/><async>Walk.</async><sync/> Done.'


def test_generate_both_modes_as_json(tiny_llama, capsys):
    rc = main(["generate", "Give tips", "--model", str(tiny_llama), "--mode", "both", "--json",
               "--max-new-tokens", "12", "--kv-cache-mb", "8"])
    out, err = capsys.readouterr()
    assert rc == 0
    row = json.loads(out.strip().splitlines()[-1])
    assert set(row) >= {"prompt", "sequential", "pasta", "realized_speedup"}
    assert row["pasta"]["stats"]["tokens_decoded"] <= 12
    assert row["realized_speedup"] > 0
    assert "summary:" in err and "geomean_realized_speedup" in err


def test_prompts_file_and_human_output(tiny_llama, tmp_path, capsys):
    f = tmp_path / "prompts.json"
    f.write_text(json.dumps([{"instruction": "one"}, {"instruction": "two"}, {"instruction": "three"}]))
    rc = main(["generate", "--prompts-file", str(f), "--limit", "2", "--model", str(tiny_llama),
               "--max-new-tokens", "6", "--kv-cache-mb", "8"])
    out, err = capsys.readouterr()
    assert rc == 0
    assert "prompt 0 pasta" in out and "prompt 1 pasta" in out and "prompt 2" not in out
    assert "decode steps" in out
    assert '"prompts": 2' in err


def test_replay_traces(tiny_llama, tmp_path, capsys):
    traces = tmp_path / "t.jsonl"
    traces.write_text(json.dumps({"prompt": "tips", "annotated_response": ANNOTATED, "annotator": "hand"}) + "\n")
    rc = main(["replay", "--traces", str(traces), "--model", str(tiny_llama), "--json", "--mode", "both",
               "--kv-cache-mb", "8"])
    out, _ = capsys.readouterr()
    assert rc == 0
    row = json.loads(out)
    assert row["pasta"]["annotated_text"] == ANNOTATED
    assert row["pasta"]["stats"]["decode_steps"] == row["pasta"]["stats"]["critical_path"]
    assert row["sequential"]["token_ids"] == row["pasta"]["token_ids"]


def test_errors_are_one_line_not_tracebacks(tmp_path, capsys):
    rc = main(["generate", "x", "--model", str(tmp_path / "missing")])
    _, err = capsys.readouterr()
    assert rc == 2 and "pasta-engine: error:" in err and "missing" in err
    bad = tmp_path / "bad.jsonl"
    bad.write_text("not json\n")
    rc = main(["replay", "--traces", str(bad)])
    _, err = capsys.readouterr()
    assert rc == 2 and "bad.jsonl:1" in err and "Traceback" not in err
