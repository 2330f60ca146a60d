"""What the training commands take: rows that cannot be told from the evaluation split are
refused, and BoNBoN's optimizer flags are checked before a round is sampled."""

from __future__ import annotations

import json

import pytest

from pasta_engine.entrypoints.cli import main

from sample_adapters import tiny_adapter  # noqa: E402  (tests/sample_adapters.py)


def _run(argv, capsys):
    try:
        rc = main(argv)
    except SystemExit as e:
        rc = e.code
    return rc, capsys.readouterr().err


@pytest.mark.parametrize("rows", [["How can I improve my time management skills?"],
                                  [{"instruction": "How can I improve my time management skills?", "output": "x"}]])
def test_training_refuses_rows_without_a_dataset(rows, tiny_llama, tmp_path, capsys):
    """A text file, a list of strings or JSON without 'dataset' trained on every row (the vicuna
    questions too) while it said it never trains on vicuna."""
    prompts = tmp_path / "p.json"
    prompts.write_text(json.dumps(rows))
    sft = ["train", "sft", "--prompts", str(prompts), "--out", str(tmp_path / "sft"), "--model", str(tiny_llama)]
    for argv in ([sft] if isinstance(rows[0], dict) else []) + [  # sft needs answers: a string row has none
                 ["train", "bonbon", "--prompts", str(prompts), "--out", str(tmp_path / "bb"),
                  "--model", str(tiny_llama), "--adapter", str(tiny_adapter(tmp_path))]]:
        rc, err = _run(argv, capsys)
        assert rc == 2 and "has no dataset, so it cannot be told from the evaluation split" in err, err
    assert not (tmp_path / "sft" / "adapter").exists()


def test_bench_learned_without_evaluation_rows_is_one_error(tiny_llama, tmp_path, capsys):
    """It died with IndexError in its warm-up."""
    prompts = tmp_path / "p.json"
    prompts.write_text(json.dumps([{"instruction": "q", "dataset": "koala", "output": "a"}]))
    rc, err = _run(["bench", "learned", "--prompts", str(prompts), "--out", str(tmp_path / "l"),
                    "--model", str(tiny_llama)], capsys)
    assert rc == 2 and "no row of the evaluation split" in err, err


@pytest.mark.parametrize("flag, value", [("--alpha", "1.5"), ("--lr", "-1"), ("--quality-weight", "nan")])
def test_bonbon_checks_its_optimizer_flags_before_sampling(flag, value, tiny_llama, tmp_path, capsys):
    prompts = tmp_path / "p.json"
    prompts.write_text(json.dumps([{"instruction": "q", "dataset": "koala", "output": "a"}]))
    rc, err = _run(["train", "bonbon", "--prompts", str(prompts), "--out", str(tmp_path / "bb"),
                    "--model", str(tiny_llama), "--adapter", str(tiny_adapter(tmp_path)), flag, value], capsys)
    assert rc == 2 and f"error: {flag} " in err and "usage:" not in err, err
    assert not any((tmp_path / "bb").rglob("samples.jsonl"))


@pytest.mark.parametrize("extra, flag", [
    (["--examples", "EX", "--annotator", "sot"], "--annotator"),
    (["--examples", "EX", "--max-response-tokens", "3"], "--max-response-tokens"),
    (["--examples", "EX", "--drop-long"], "--drop-long"),
    (["--adapter", "AD", "--lora-r", "8"], "--lora-r"),
    (["--adapter", "TAGGED", "--tag-tokens"], "--tag-tokens"),
    (["--distill-hard-open", "2"], "--distill-hard-open"),
    (["--tag-tokens", "--tokens-only", "--lora-r", "64"], "--lora-r"),
    (["--tag-tokens", "--tokens-only", "--lora-alpha", "128"], "--lora-alpha"),
    (["--forked-only", "--min-promises", "2"], "--forked-only"),
])
def test_train_sft_refuses_flags_nothing_reads(extra, flag, tiny_llama, tmp_path, capsys):
    """Each was ignored, and the manifest recorded it as if applied."""
    prompts = tmp_path / "p.json"
    prompts.write_text(json.dumps([{"instruction": "q", "dataset": "koala", "output": "a"}]))
    examples = tmp_path / "ex.jsonl"
    examples.write_text("")
    if "TAGGED" in extra:  # an adapter with the pieces as added tokens already
        tagged = tiny_adapter(tmp_path)
        (tagged / "manifest.json").write_text(json.dumps({"added_tokens": {"<async>": 2000}}))
    extra = [str(examples) if x == "EX" else str(tiny_adapter(tmp_path)) if x == "AD"
             else str(tmp_path / "adapter") if x == "TAGGED" else x for x in extra]
    rc, err = _run(["train", "sft", "--prompts", str(prompts), "--out", str(tmp_path / "o"), "--model",
                    str(tiny_llama), *extra], capsys)
    assert rc == 2 and f"error: {flag} " in err and "leave it out" in err, err


@pytest.mark.parametrize("lr", ["0", "-1", "nan", "inf"])
def test_train_sft_refuses_a_learning_rate_that_trains_nothing_before_any_work(lr, tiny_llama, tmp_path, capsys):
    """--lr 0 trained nothing and exited 0 (the adapter was the base model); -1 failed after the
    annotation with an error naming no flag."""
    prompts = tmp_path / "p.json"
    prompts.write_text(json.dumps([{"instruction": "q", "dataset": "koala", "output": "a"}]))
    rc, err = _run(["train", "sft", "--prompts", str(prompts), "--out", str(tmp_path / "o"), "--model",
                    str(tiny_llama), "--lr", lr], capsys)
    assert rc == 2 and "invalid --lr=" in err, err
    assert not (tmp_path / "o").exists() or not any((tmp_path / "o").iterdir())


@pytest.mark.parametrize("extra, says", [
    (["--tag-weight", "inf"], "invalid --tag-weight=inf"),
    (["--min-content-speedup", "inf"], "invalid --min-content-speedup=inf"),
    (["--max-decoded-tokens", "0"], "--max-decoded-tokens"),
    (["--tokens-only"], "--tokens-only trains a fresh adapter's tag-token rows: it needs --tag-tokens"),
    (["--tokens-only", "--tag-tokens", "--adapter", "AD"], "and no --adapter"),
])
def test_train_sft_refuses_values_that_train_garbage_before_any_work(extra, says, tiny_llama, tmp_path, capsys):
    """--tag-weight inf trained every adapter weight to NaN and exited 0 (loss.json held NaN);
    --min-content-speedup inf and --tokens-only without --tag-tokens failed only after the
    annotation, leaving examples.jsonl behind (and the latter named no flag)."""
    prompts = tmp_path / "p.json"
    prompts.write_text(json.dumps([{"instruction": "q", "dataset": "koala", "output": "a"}]))
    extra = [str(tiny_adapter(tmp_path)) if x == "AD" else x for x in extra]
    rc, err = _run(["train", "sft", "--prompts", str(prompts), "--out", str(tmp_path / "o"), "--model",
                    str(tiny_llama), *extra], capsys)
    assert rc == 2 and says in err, err
    assert not (tmp_path / "o").exists() or not any((tmp_path / "o").iterdir())


def test_serve_refuses_a_port_past_65535_while_parsing():
    """--port 70000 passed the parser and failed only after the model loaded."""
    from pasta_engine.entrypoints.cli import build_parser

    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--port", "70000"])
    assert build_parser().parse_args(["serve", "--port", "65535"]).port == 65535


@pytest.mark.parametrize("command, kept, flag", [
    (["answers", "--max-new-tokens", "40"], {"model": "M", "max_new_tokens": 6, "temperature": 0.2, "top_p": 0.9,
                                             "repetition_penalty": 1.0, "seed": 0}, "--max-new-tokens"),
    (["chunks", "--max-chunk-tokens", "256"], {"model": "M", "max_chunk_tokens": 2, "repetition_penalty": 1.1},
     "--max-chunk-tokens"),
])
def test_answers_and_chunks_refuse_to_resume_under_other_flags_before_the_model_loads(command, kept, flag, tmp_path,
                                                                                      capsys, monkeypatch):
    """A rerun into the same --out with other flags reused the first run's rows as if drawn under the new ones."""
    from pasta_engine.engine.llm_engine import Engine

    def no_load(*a, **k):
        raise AssertionError("the model loaded")

    monkeypatch.setattr(Engine, "from_pretrained", no_load)
    prompts = tmp_path / "p.json"
    prompts.write_text(json.dumps([{"instruction": "q", "dataset": "koala", "output": "a"}]))
    out = tmp_path / "o"
    out.mkdir()
    (out / "sampling.json").write_text(json.dumps(kept))
    rc, err = _run(["train", *command[:1], "--prompts", str(prompts), "--out", str(out), "--model", "M", *command[1:]],
                   capsys)
    assert rc == 2 and f"{flag} " in err and "then" in err and "new --out" in err, err
