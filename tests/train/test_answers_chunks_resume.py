"""Resuming ``train answers`` and ``train chunks`` into the same --out: a row cut off by a kill
(answers.jsonl), and a rerun with other annotation flags (examples.jsonl)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from pasta_engine.errors import ParameterError
from pasta_engine.train.data import TrainExample
from pasta_engine.train.thread_chunks import check_chunks_resume, rewrite_chunks

from sample_traces import SLEEP_PROMPT, SLEEP_TIPS  # noqa: E402  (tests/sample_traces.py)

LISTED = "Tips:\n1. Go to bed early, and get up at the same time every day.\n2. Avoid screens at night.\n"


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


def test_train_chunks_rerun_with_another_annotator_never_mixes_two_runs_rows(tiny_llama, tmp_path, capsys):
    """A rerun into the same --out with another --annotator / --max-response-tokens kept the first
    run's rows: examples.jsonl held each prompt twice (4 rows for 2 answers) and `train sft
    --examples` trained on both runs."""
    prompts = tmp_path / "p.json"
    prompts.write_text(json.dumps([{"instruction": f"How to sleep better {k}?", "dataset": "koala", "output": LISTED}
                                   for k in range(2)]))
    out = tmp_path / "c"
    cmd = ["train", "chunks", "--prompts", str(prompts), "--model", str(tiny_llama), "--out", str(out),
           "--max-chunk-tokens", "8", "--device", "cpu"]
    assert _main(cmd + ["--annotator", "sot"], capsys)[0] == 0
    first = _rows(out / "examples.jsonl")
    assert sorted(r["annotator"] for r in first) == ["sot+thread-rewrite"] * 2
    for extra, flag in ((["--annotator", "apar"], "--annotator"),
                        (["--annotator", "sot", "--max-response-tokens", "20"], "--max-response-tokens")):
        rc, err = _main(cmd + extra, capsys)
        # refused up front, naming the flag: the rows stay the first run's
        assert rc == 2 and flag in err and _rows(out / "examples.jsonl") == first, err


@pytest.mark.parametrize("kw, flag", [({"annotator": "apar"}, "--annotator"),
                                      ({"max_response_tokens": 20}, "--max-response-tokens")])
def test_chunks_resume_records_the_annotation_flags_and_drops_rows_of_other_answers(tmp_path, kw, flag):
    """sampling.json kept only --max-chunk-tokens / --repetition-penalty / the model, and rows made
    from other answers stayed in examples.jsonl."""

    class Engine:
        def format_prompt(self, prompt, mode):
            return [1]

        def encode(self, text):
            return [2]

        def generate(self, prompts, params, mode):
            return [SimpleNamespace(text=" rewritten.", stats=SimpleNamespace(finish_reason="stop")) for _ in prompts]

    words = lambda s: len(s.split())  # noqa: E731
    made = {"annotator": "sot", "max_response_tokens": 448}
    sot = TrainExample(SLEEP_PROMPT, SLEEP_TIPS, "koala", "sot", 3, 30)
    rewrite_chunks(Engine(), [sot], tmp_path, count_tokens=words, progress=False, **made)
    assert json.loads((tmp_path / "sampling.json").read_text())["annotator"] == "sot"
    with pytest.raises(ParameterError, match=f"{flag} .* then, .* now.*new --out") as e:
        check_chunks_resume(tmp_path, **{**made, **kw})
    assert e.value.param == flag
    with pytest.raises(ParameterError):
        rewrite_chunks(Engine(), [sot], tmp_path, count_tokens=words, progress=False, **{**made, **kw})
    check_chunks_resume(tmp_path, **made)  # the same flags resume
    # rows made from other answers (here: the same answer annotated by another annotator) are dropped
    other = TrainExample(SLEEP_PROMPT, "Tips: no forks.", "koala", "none", 0, 3)
    got, counts = rewrite_chunks(Engine(), [other], tmp_path, count_tokens=words, progress=False)
    assert [r["annotator"] for r in _rows(tmp_path / "examples.jsonl")] == ["none+thread-rewrite"]
    assert counts["answers"] == 1 and got[0].annotated == "Tips: no forks."


def test_train_chunks_limit_weighs_topic_words_over_every_training_answer(tiny_llama, tmp_path, capsys, monkeypatch):
    """The topics' word weights (idf) came from the --limit rows only, so a trial run on a few
    answers wrote other topics than the full run writes for the same answers."""
    import pasta_engine.train.thread_chunks as tc
    from pasta_engine.tools.annotate_independent import document_frequencies

    answers = [LISTED, "Drink water.\n\nWalk every day, outside if you can.", "Read a book before bed."]
    prompts = tmp_path / "p.json"
    prompts.write_text(json.dumps([{"instruction": f"How to sleep better {k}?", "dataset": "koala", "output": a}
                                   for k, a in enumerate(answers)]))
    seen = {}

    def fake_rewrite(engine, examples, out, **kw):
        seen.update(kw, examples=len(examples))
        out.mkdir(parents=True, exist_ok=True)
        return [], {"answers": len(examples), "stop": 0, "cut": 0, "original": 0}

    monkeypatch.setattr(tc, "rewrite_chunks", fake_rewrite)
    cmd = ["train", "chunks", "--prompts", str(prompts), "--model", str(tiny_llama), "--out", str(tmp_path / "c"),
           "--max-chunk-tokens", "8", "--device", "cpu", "--limit", "1"]
    rc, err = _main(cmd, capsys)
    assert rc == 0, err
    assert seen["examples"] == 1
    assert seen["idf"] == document_frequencies(answers) != document_frequencies(answers[:1])
