"""The pasta-engine command line on a tiny checkpoint."""

from __future__ import annotations

import json

import pytest
import torch

from pasta_engine.entrypoints.cli import main

ANNOTATED = 'Tips: <promise topic="a" tokens="10"/><async>Sleep.</async> <promise topic="b" tokens="10"/><async>Walk.</async><sync/> Done.'


def test_generate_both_modes_as_json(tiny_llama, capsys):
    rc = main(["generate", "Give tips", "--model", str(tiny_llama), "--mode", "both", "--json",
               "--max-new-tokens", "12", "--kv-cache-mb", "8"])
    out, err = capsys.readouterr()
    assert rc == 0
    row = json.loads(out.strip().splitlines()[-1])
    assert set(row) >= {"prompt", "sequential", "pasta", "content_speedup", "realized_content_speedup",
                        "end_to_end_speedup", "length_ratio", "finish_reasons"}
    p, q = row["pasta"]["stats"], row["sequential"]["stats"]
    assert p["tokens_decoded"] <= 12
    assert list(p)[:2] == ["content_tokens", "content_speedup"]  # the content figures first
    assert row["content_speedup"] == p["content_speedup"] == pytest.approx(p["content_tokens"] / p["critical_path"])
    assert row["realized_content_speedup"] > 0
    assert row["end_to_end_speedup"] == pytest.approx(q["wall_s"] / p["wall_s"])
    if q["content_tokens"]:
        assert row["length_ratio"] == pytest.approx(p["content_tokens"] / q["content_tokens"])
    summary = json.loads(err.split("summary: ", 1)[1].splitlines()[0])
    assert list(summary)[1:3] == ["geomean_content_speedup", "geomean_realized_content_speedup"]
    assert {"geomean_end_to_end_speedup", "geomean_length_ratio", "cut_fraction_sequential", "cut_fraction_pasta",
            "tag_token_fraction"} <= set(summary)


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
    # the sequential side decodes the clean text: no tag token, one step per content token + EOS
    assert row["sequential"]["text"] == row["pasta"]["text"]
    assert row["sequential"]["stats"]["decode_steps"] == row["pasta"]["stats"]["content_tokens"] + 1
    assert row["realized_content_speedup"] == pytest.approx(
        row["sequential"]["stats"]["wall_s"] / row["pasta"]["stats"]["wall_s"])


def test_no_prefix_caching_prefills_every_prompt_in_full(tiny_llama, tmp_path, capsys):
    """--mode both warms up and repeats on the same prompt: with prefix caching (the default) the
    timed runs read the prompt's pages from the cache; --no-prefix-caching prefills them all,
    and the answers are the same."""
    traces = tmp_path / "t.jsonl"
    traces.write_text(json.dumps({"prompt": "tips", "annotated_response": ANNOTATED}) + "\n")
    rows = []
    for flags in ([], ["--no-prefix-caching"]):
        rc = main(["replay", "--traces", str(traces), "--model", str(tiny_llama), "--json", "--mode", "both",
                   "--kv-cache-mb", "8", "--page-size", "4", *flags])
        out, _ = capsys.readouterr()
        assert rc == 0
        rows.append(json.loads(out))
    on, off = rows
    assert on["pasta"]["stats"]["cached_tokens"] > 0 and off["pasta"]["stats"]["cached_tokens"] == 0
    assert on["pasta"]["stats"]["prefill_tokens"] < off["pasta"]["stats"]["prefill_tokens"]
    assert on["pasta"]["token_ids"] == off["pasta"]["token_ids"] and on["sequential"]["text"] == off["sequential"]["text"]


def test_errors_are_one_line_not_tracebacks(tmp_path, capsys):
    rc = main(["generate", "x", "--model", str(tmp_path / "missing")])
    _, err = capsys.readouterr()
    assert rc == 2 and "pasta-engine: error:" in err and "missing" in err
    bad = tmp_path / "bad.jsonl"
    bad.write_text("not json\n")
    rc = main(["replay", "--traces", str(bad)])
    _, err = capsys.readouterr()
    assert rc == 2 and "bad.jsonl:1" in err and "Traceback" not in err


@pytest.mark.parametrize(
    "argv, message",
    [
        (["generate", "x", "--kv-cache-mb", "0"], "--kv-cache-mb: expected an integer >= 1, got 0"),
        (["generate", "x", "--limit", "-1"], "--limit: expected an integer >= 1, got -1"),
        (["generate", "x", "--max-new-tokens", "0"], "--max-new-tokens: expected an integer >= 1, got 0"),
        (["generate", "x", "--max-threads", "-2"], "--max-threads: expected an integer >= 0, got -2"),
        (["generate", "x", "--seed", "1.5"], "--seed: expected an integer >= 0, got '1.5'"),
        (["generate", "x", "--threads", "4097"], "--threads: expected auto or an integer from 1 to 4096, got '4097'"),
        (["generate", "x", "--threads", "0"], "--threads: expected auto or an integer from 1 to 4096, got '0'"),
        (["bench", "speedup", "--traces", "t", "--out", "o", "--repeats", "0"], "--repeats: expected an integer >= 1"),
    ],
)
def test_bad_counts_are_usage_errors(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    _, err = capsys.readouterr()
    assert e.value.code == 2 and message in err and "Traceback" not in err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message of a CPU-only torch (this machine has CUDA)")
def test_cuda_without_cuda_is_one_line(tiny_llama, capsys):
    rc = main(["generate", "x", "--model", str(tiny_llama), "--device", "cuda"])
    _, err = capsys.readouterr()
    assert rc == 2 and err.count("\n") == 1 and "sees no CUDA GPU" in err and "--device cpu" in err


def test_device_auto_is_the_default_and_picks_what_torch_sees(monkeypatch, tiny_llama, built, capsys):
    # issue 31 item 5: --device defaulted to cpu on a GPU machine
    from pasta_engine.engine.llm_engine import check_device

    assert check_device("auto").type == ("cuda" if torch.cuda.is_available() else "cpu")
    with monkeypatch.context() as m:
        m.setattr(torch.cuda, "is_available", lambda: True)
        assert check_device("auto").type == "cuda"
    rc = main(["generate", "x", "--model", str(tiny_llama), "--max-new-tokens", "2", "--kv-cache-mb", "8"])
    capsys.readouterr()
    assert rc == 0 and built[0][1]["device"] == ("cuda" if torch.cuda.is_available() else "cpu")
    assert built[0][1]["dtype"] == ("bfloat16" if torch.cuda.is_available() else "float32")


def test_a_json_object_is_not_a_prompts_file(tiny_llama, tmp_path, capsys):
    f = tmp_path / "prompts.json"
    f.write_text(json.dumps({"first prompt": 1, "second prompt": 2}))
    rc = main(["generate", "--prompts-file", str(f), "--model", str(tiny_llama), "--kv-cache-mb", "8"])
    out, err = capsys.readouterr()
    assert rc == 2 and "not a list of prompts" in err and out == ""


def test_bad_sampling_values_name_the_flag_value(tiny_llama, capsys):
    rc = main(["generate", "x", "--model", str(tiny_llama), "--top-p", "0", "--kv-cache-mb", "8"])
    _, err = capsys.readouterr()
    assert rc == 2 and "top_p=0.0" in err and err.count("\n") == 1


def test_generate_samples_with_the_model_cards_settings_and_serve_has_no_penalty_flag():
    """``generate`` defaults to SmolLM2's card settings (temperature 0.2, top-p 0.9) with the
    training answers' repetition penalty 1.1 and the evaluation's 512 tokens, and the flag
    reaches SamplingParams; ``serve``
    takes a penalty per request (vLLM's ``repetition_penalty`` field) and has no server-wide
    default for it, so it has no such flag."""
    from pasta_engine.entrypoints.args import sampling_params
    from pasta_engine.entrypoints.cli import build_parser

    parser = build_parser()
    params = sampling_params(parser.parse_args(["generate"]))
    assert (params.temperature, params.top_p, params.repetition_penalty) == (0.2, 0.9, 1.1)
    assert params.max_new_tokens == 512  # the budget the shipped adapter was evaluated at (its forks pass 256)
    assert sampling_params(parser.parse_args(["generate", "--repetition-penalty", "1.3"])).repetition_penalty == 1.3
    assert sampling_params(parser.parse_args(["generate", "--ignore-eos"])).ignore_eos is True
    assert sampling_params(parser.parse_args(["generate"])).ignore_eos is False
    assert sampling_params(parser.parse_args(["bench", "learned", "--prompts", "p.json", "--out", "o"])).temperature == 0.0
    for flag in (["--repetition-penalty", "1.1"], ["--ignore-eos"]):
        with pytest.raises(SystemExit):
            parser.parse_args(["serve", *flag])


def test_serve_takes_pasta_defaults_that_requests_use():
    """``serve``'s PASTA flags are the defaults of requests that each choose their own mode,
    dialect and replay: ``serve --no-distinct-topics`` was refused as having "no effect in a
    replay", and ``--max-fork-depth 3`` as having none in the 'pasta' dialect, though a
    request may ask for multiverse. They are taken now; ``generate`` still refuses what its own
    mode cannot use."""
    from pasta_engine.entrypoints.cli import _refuse_unused_limits, build_parser
    from pasta_engine.errors import ParameterError

    parser = build_parser()
    for flags in (["--no-distinct-topics"], ["--no-chunk-clean-end"], ["--max-fork-depth", "3"]):
        _refuse_unused_limits(parser.parse_args(["serve", *flags]))
    with pytest.raises(ParameterError) as e:
        _refuse_unused_limits(parser.parse_args(["generate", "--mode", "sequential", "--no-distinct-topics"]))
    assert e.value.param == "--no-distinct-topics"
