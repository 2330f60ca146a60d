"""The OpenAI-compatible annotator and judge against our own ``pasta-engine serve`` (issue 30
items 3 and 5: plumbing only). The server runs a tiny random-weight model, so what it writes is
noise: the annotator must discard it (its text is not the answer), the judge must report an
unusable reply as an error naming the endpoint, and the CLI must carry the flags, the key and
the errors through."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("openai", reason="the openai client is not installed (pip install -e '.[test]')")

from pasta_engine.lang.tags import strip_tags  # noqa: E402
from pasta_engine.tools.endpoint import ChatEndpoint, EndpointError  # noqa: E402

ANSWER = "Two tips:\n1. Sleep at the same time every day of the week.\n2. Keep the bedroom dark and quiet at night."


def _endpoint(server, key=None) -> ChatEndpoint:
    return ChatEndpoint(server.url + "/v1", server.model, api_key=key or server.api_key, max_retries=0)


def test_clients_round_trip_through_serve(server):
    from pasta_engine.tools.annotate_endpoint import annotate_with_endpoint
    from pasta_engine.tools.judge import JudgeReplyError, Verdict, judge_pair

    ep = _endpoint(server)
    reply = ep.complete([{"role": "user", "content": "Say hi."}], max_tokens=8)
    assert isinstance(reply, str) and reply.strip()
    a = annotate_with_endpoint(ep, "How do I sleep better?", ANSWER, max_tokens=16)
    assert strip_tags(a.annotated) == ANSWER  # whatever the model wrote, the answer is intact
    assert a.promises > 0 or a.note.startswith(f"endpoint annotation discarded ({server.model} at {server.url}/v1)")
    try:
        v = judge_pair(ep, "Name a colour.", "Blue.", "Banana.", max_tokens=16)
        assert isinstance(v, Verdict) and v.verdict in ("A", "B", "tie")
    except JudgeReplyError as e:  # noise is not a verdict: an error naming the endpoint, not a crash
        assert str(e).startswith(f"{server.model} at {server.url}/v1: ")
    with pytest.raises(EndpointError, match="HTTP 401"):
        _endpoint(server, key="wrong-key").complete([{"role": "user", "content": "hi"}], max_tokens=4)


def test_bench_annotate_endpoint_cli(server, tmp_path, monkeypatch, capsys):
    from pasta_engine.entrypoints.cli import main

    responses = tmp_path / "r.json"
    responses.write_text(json.dumps([{"instruction": "How do I sleep better?", "output": ANSWER}]))
    out = tmp_path / "t.jsonl"
    monkeypatch.setenv("PASTA_ENDPOINT_API_KEY", server.api_key)
    flags = ["--endpoint-url", server.url + "/v1", "--endpoint-model", server.model]
    assert main(["bench", "annotate", "--annotator", "endpoint", *flags, "--responses", str(responses),
                 "--out", str(out), "--tokenizer", "approx"]) == 0
    row = json.loads(out.read_text().splitlines()[0])
    assert row["annotator"] == "endpoint" and strip_tags(row["annotated_response"]) == ANSWER
    assert row.get("promises", 0) > 0 or "annotation discarded" in row["note"]
    capsys.readouterr()
    # the flags go together, and a key the server refuses is one line naming the endpoint
    assert main(["bench", "annotate", "--annotator", "endpoint", "--responses", str(responses), "--out", str(out)]) == 2
    assert "--annotator endpoint goes with --endpoint-url" in capsys.readouterr().err
    assert main(["bench", "annotate", "--annotator", "sot", "--endpoint-url", server.url + "/v1", "--responses",
                 str(responses), "--out", str(out)]) == 2
    assert "--endpoint-model is missing" in capsys.readouterr().err
    monkeypatch.setenv("PASTA_ENDPOINT_API_KEY", "wrong-key")
    assert main(["bench", "annotate", "--annotator", "endpoint", *flags, "--responses", str(responses),
                 "--out", str(out), "--tokenizer", "approx"]) == 2
    err = capsys.readouterr().err
    assert f"{server.model} at {server.url}/v1: HTTP 401" in err and "Traceback" not in err


def test_train_bonbon_judge_flags_are_checked_before_anything_loads(tmp_path, capsys):
    from pasta_engine.entrypoints.cli import main

    prompts = tmp_path / "p.json"
    prompts.write_text(json.dumps([{"instruction": "Q one?", "dataset": "koala"}]))
    refs = tmp_path / "refs.json"
    refs.write_text(json.dumps([{"instruction": "Other?", "output": "x"}]))
    adapter = tmp_path / "a"
    adapter.mkdir()
    base = ["train", "bonbon", "--prompts", str(prompts), "--out", str(tmp_path / "o"), "--adapter", str(adapter)]
    assert main([*base, "--judge-url", "http://127.0.0.1:9/v1", "--judge-model", "j"]) == 2
    assert "--judge-reference is missing" in capsys.readouterr().err
    assert main([*base, "--judge-url", "http://127.0.0.1:9/v1", "--judge-model", "j", "--judge-reference",
                 str(refs)]) == 2
    assert "has no answer to 1 of the 1 sampled prompts" in capsys.readouterr().err
    assert main([*base, "--judge-url", "127.0.0.1:9", "--judge-model", "j", "--judge-reference", str(refs)]) == 2
    assert "--judge-url" in capsys.readouterr().err
