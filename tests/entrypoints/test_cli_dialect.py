"""``--dialect`` on ``pasta-engine replay`` and ``pasta-engine bench speedup``: the APAR dialect's
traces replay in both modes and the results record the dialect; bad combinations are usage errors."""

from __future__ import annotations

import json

import pytest

from pasta_engine.entrypoints.cli import main
from pasta_engine.lang.apar import APAR, FORK
from pasta_engine.tools.annotate_apar import apar_trace
from pasta_engine.tools.traces import read_traces

from sample_traces import NESTED_MULTIVERSE  # tests/sample_traces.py

ANSWERS = [
    {"instruction": "Two sleep tips?",
     "output": "Sure:\n1. **Sleep early**: go to bed at the same time every night, even on weekends.\n"
               "2. **No screens**: put the phone away an hour before bed, and read instead.\nGood night."},
    {"instruction": "Say hi.", "output": "Hi there, nice to meet you."},
]


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("PASTA_ENGINE_CACHE", str(tmp_path / "cache"))


@pytest.fixture
def responses(tmp_path):
    path = tmp_path / "responses.json"
    path.write_text(json.dumps(ANSWERS))
    return path


def test_bench_speedup_in_the_apar_dialect(responses, cache, tmp_path, capsys):
    out = tmp_path / "run"
    rc = main(["bench", "speedup", "--dialect", "apar", "--responses", str(responses), "--preset", "tiny-llama",
               "--kv-cache-mb", "16", "--max-threads", "0", "--out", str(out)])
    _, err = capsys.readouterr()
    assert rc == 0, err
    assert "bench speedup (dialect apar)" in err
    summary = json.loads((out / "summary.json").read_text())
    assert summary["settings"]["dialect"] == "apar" and summary["summary"]["dialect"] == "apar"
    assert summary["settings"]["annotators"] == ["dialect:apar"]
    assert summary["summary"]["forked_responses"] == 1 and summary["summary"]["text_mismatches"] == 0
    rows = [json.loads(line) for line in (out / "prompts.jsonl").read_text().splitlines()]
    assert [r["dialect"] for r in rows] == ["apar", "apar"] and [r["forks"] for r in rows] == [2, 0]
    assert rows[0]["content_speedup"] > 1 and rows[0]["decode_steps"] == rows[0]["critical_path"]
    assert rows[0]["realized_over_theoretical"] == pytest.approx(
        rows[0]["realized_content_speedup"] / rows[0]["content_speedup"])
    assert (out / "speedup.png").read_bytes().startswith(b"\x89PNG")
    traces = read_traces(out / "traces.jsonl")
    assert [t.annotated_response for t in traces] == [apar_trace(a["output"]) for a in ANSWERS]
    assert [APAR.clean_text(t.annotated_response) for t in traces] == [a["output"] for a in ANSWERS]
    assert [t.promises for t in traces] == [2, 0]


def test_replay_in_the_apar_dialect(responses, cache, tmp_path, capsys):
    traces = tmp_path / "traces.jsonl"
    traces.write_text("".join(json.dumps({"prompt": a["instruction"], "annotated_response": apar_trace(a["output"])})
                              + "\n" for a in ANSWERS))
    rc = main(["replay", "--traces", str(traces), "--dialect", "apar", "--mode", "both", "--json", "--preset",
               "tiny-llama", "--kv-cache-mb", "16", "--max-threads", "0", "--repeats", "1", "--no-progress"])
    out, err = capsys.readouterr()
    assert rc == 0, err
    rows = [json.loads(line) for line in out.splitlines()]
    assert [r["dialect"] for r in rows] == ["apar", "apar"]
    assert [r["pasta"]["text"] for r in rows] == [a["output"] for a in ANSWERS]
    assert [r["sequential"]["text"] for r in rows] == [a["output"] for a in ANSWERS]
    assert rows[0]["pasta"]["stats"]["forks"] == 2 and rows[0]["content_speedup"] > 1
    summary = json.loads(err.split("summary: ", 1)[1].splitlines()[0])
    assert summary["dialect"] == "apar" and summary["geomean_content_speedup"] > 1
    # read as PASTA-LANG (the default), the same traces do not fork and show their markers
    rc = main(["replay", "--traces", str(traces), "--json", "--preset", "tiny-llama", "--kv-cache-mb", "16",
               "--limit", "1", "--no-progress"])
    out, _ = capsys.readouterr()
    row = json.loads(out.splitlines()[0])
    assert rc == 0 and row["dialect"] == "pasta" and row["pasta"]["stats"]["forks"] == 0 and FORK in row["pasta"]["text"]


def test_dialect_usage_errors(responses, cache, tmp_path, capsys, monkeypatch):
    with pytest.raises(SystemExit) as e:
        main(["replay", "--traces", "t.jsonl", "--dialect", "klingon"])
    assert e.value.code == 2 and "'klingon'" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        main(["bench", "speedup", "--dialect", "klingon", "--responses", str(responses), "--out", str(tmp_path)])
    assert e.value.code == 2 and "'klingon'" in capsys.readouterr().err
    common = ["bench", "speedup", "--responses", str(responses), "--preset", "tiny-llama", "--out", str(tmp_path / "o")]
    assert main([*common, "--dialect", "apar", "--annotator", "sot"]) == 2
    assert "--annotator sot writes PASTA-LANG; --dialect apar" in capsys.readouterr().err
    assert main([*common]) == 2  # pasta needs --annotator (or --traces)
    assert "give --traces FILE, or --annotator NAME" in capsys.readouterr().err
    # the Multiverse annotator's module missing: one line naming --dialect multiverse
    import builtins

    real_import = builtins.__import__

    def no_multiverse(name, *args, **kw):
        if name.endswith("annotate_multiverse") or (args and args[2] and "annotate_multiverse" in args[2]):
            raise ImportError("No module named 'pasta_engine.tools.annotate_multiverse'")
        return real_import(name, *args, **kw)

    monkeypatch.setattr(builtins, "__import__", no_multiverse)
    assert main([*common, "--dialect", "multiverse"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("pasta-engine: error: --dialect multiverse needs")


NESTED = NESTED_MULTIVERSE  # tests/sample_traces.py


@pytest.mark.parametrize("depth,forks", [(1, 2), (2, 4)])
def test_max_fork_depth_caps_a_nested_multiverse_replay(cache, tmp_path, capsys, depth, forks):
    """``--max-fork-depth 1``: the nested block decodes inline in its path (2 threads forked,
    the outer paths); 2 (the default): it forks too (4). The clean text is the same either way."""
    traces = tmp_path / "traces.jsonl"
    traces.write_text(json.dumps({"prompt": "Two things?", "annotated_response": NESTED}) + "\n")
    rc = main(["replay", "--traces", str(traces), "--dialect", "multiverse", "--json", "--preset", "tiny-llama",
               "--kv-cache-mb", "16", "--max-threads", "0", "--max-fork-depth", str(depth),
               "--no-progress"])
    out, err = capsys.readouterr()
    assert rc == 0, err
    row = json.loads(out.splitlines()[0])
    from pasta_engine.lang.multiverse import MULTIVERSE

    assert row["pasta"]["stats"]["forks"] == forks and row["pasta"]["text"] == MULTIVERSE.clean_text(NESTED)
    assert any("fork depth cap 1 reached" in d for d in row["pasta"]["diagnostics"]) == (depth == 1)
    with pytest.raises(SystemExit) as e:
        main(["replay", "--traces", str(traces), "--max-fork-depth", "0"])
    assert e.value.code == 2 and "--max-fork-depth" in capsys.readouterr().err
