"""Files: the one prompts reader (AlpacaEval JSON, lists of strings, text files) and trace files."""

from __future__ import annotations

import json

import pytest

from pasta_engine.tools.annotate import annotate_sot
from pasta_engine.tools.traces import PromptRow, TraceFileError, TraceRow, read_prompts, read_traces, write_traces

NUMBERED = "Tips:\n1. Sleep early, every single night of the week.\n2. Walk daily for at least half an hour.\n" \
           "3. Eat well: vegetables, fruit and whole grains."


def test_trace_files_round_trip_and_bad_lines_are_located(tmp_path):
    rows = [TraceRow("p1", annotate_sot(NUMBERED).annotated, "sot", response=NUMBERED, promises=3, index=0),
            TraceRow("p2", "plain", "apar", note="apar: nothing to fork")]
    path = tmp_path / "t.jsonl"
    assert write_traces(path, rows) == 2
    back = read_traces(path)
    assert back == rows
    path.write_text(path.read_text() + "\n" + '{"prompt": "x"}\n')
    with pytest.raises(TraceFileError, match=r"t\.jsonl:4: needs string fields"):
        read_traces(path)
    path.write_text("{not json\n")
    with pytest.raises(TraceFileError, match=r"t\.jsonl:1: not a JSON object"):
        read_traces(path)
    with pytest.raises(TraceFileError, match="cannot read trace file"):
        read_traces(tmp_path / "missing.jsonl")
    path.write_text("\n\n")
    with pytest.raises(TraceFileError, match="holds no trace"):
        read_traces(path)


def test_prompts_files_of_every_kind(tmp_path):
    alpaca = tmp_path / "a.json"
    alpaca.write_text(json.dumps([{"instruction": "a", "output": "b", "dataset": "koala"}, {"instruction": "c"}]))
    assert read_prompts(alpaca) == [PromptRow("a", "b", "koala"), PromptRow("c")]
    strings = tmp_path / "s.json"
    strings.write_text(json.dumps(["x", "y"]))
    assert [r.instruction for r in read_prompts(strings)] == ["x", "y"]
    text = tmp_path / "p.txt"
    text.write_text("first\n\n  \nsecond\n")
    assert [r.instruction for r in read_prompts(text)] == ["first", "second"]


def test_prompts_file_errors_name_the_file_and_row(tmp_path):
    bad = tmp_path / "r.json"
    bad.write_text(json.dumps([{"instruction": "a", "output": "b"}, {"output": "no instruction"}]))
    with pytest.raises(TraceFileError, match=r"r\.json: row 1"):
        read_prompts(bad)
    bad.write_text("[")
    with pytest.raises(TraceFileError, match=r"r\.json is not JSON"):
        read_prompts(bad)
    bad.write_text(json.dumps({"a": "an object's keys are not prompts"}))
    with pytest.raises(TraceFileError, match=r"r\.json holds a JSON dict, not a list of prompts"):
        read_prompts(bad)
    bad.write_text(json.dumps([{"instruction": "a"}]))
    with pytest.raises(TraceFileError, match=r"row 0 has no string 'output' to annotate"):
        read_prompts(bad, need_output=True)
    bad.write_text(json.dumps([]))
    with pytest.raises(TraceFileError, match="holds no prompt"):
        read_prompts(bad)
    # an empty prompt was taken (and answered) where the command line refuses one
    bad.write_text(json.dumps([{"instruction": "a"}, {"instruction": " \n"}]))
    with pytest.raises(TraceFileError, match=r"r\.json: row 1 has an empty 'instruction'"):
        read_prompts(bad)
    bad.write_text(json.dumps(["a", "", "c"]))
    with pytest.raises(TraceFileError, match=r"r\.json: row 1 is an empty prompt"):
        read_prompts(bad)
    with pytest.raises(TraceFileError, match="cannot read prompts file"):
        read_prompts(tmp_path / "missing.json")
