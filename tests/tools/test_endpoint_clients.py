"""The OpenAI-compatible clients of issue 30 items 3 and 5: the ``endpoint`` annotator and the
pairwise judge, on an in-process endpoint (httpx's MockTransport behind the real ``openai``
client) that answers what each test sets. The same clients against a live ``pasta-engine serve``
are in tests/entrypoints/test_endpoint_plumbing.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

httpx = pytest.importorskip("httpx", reason="httpx is not installed (pip install -e '.[test]')")
openai = pytest.importorskip("openai", reason="the openai client is not installed (pip install -e '.[test]')")

from pasta_engine.errors import ParameterError  # noqa: E402
from pasta_engine.lang.tags import Promise, parse, strip_tags  # noqa: E402
from pasta_engine.tools.annotate_endpoint import ANNOTATION_PROMPT, annotate_with_endpoint, unfence  # noqa: E402
from pasta_engine.tools.endpoint import ChatEndpoint, EndpointError  # noqa: E402
from pasta_engine.tools.judge import JudgeQuality, JudgeReplyError, judge_pair, parse_verdict  # noqa: E402

ANSWER = ("Here are two ways to sleep better:\n"
          "1. Keep a regular schedule, going to bed and waking up at the same time every day.\n"
          "2. Keep the bedroom dark and cool, and leave phones and screens outside it.\n"
          "Both help within a week.")


def fake_endpoint(replies, seen=None, status=200):
    """A ChatEndpoint whose server answers each chat completion with the next of ``replies``
    (strings), recording each request body in ``seen``."""
    it = iter(replies)

    def handler(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        if seen is not None:
            seen.append(body)
        if status != 200:
            return httpx.Response(status, json={"error": {"message": "model not found", "type": "invalid_request_error"}})
        return httpx.Response(200, json={
            "id": "x", "object": "chat.completion", "created": 0, "model": body["model"],
            "choices": [{"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": next(it)}}],
        })

    client = openai.OpenAI(base_url="http://judge.test/v1", api_key="k", max_retries=0,
                           http_client=httpx.Client(transport=httpx.MockTransport(handler)))
    return ChatEndpoint("http://judge.test/v1", "big-model", client=client)


def _tagged(answer: str) -> str:
    one = "Keep a regular schedule, going to bed and waking up at the same time every day."
    two = "Keep the bedroom dark and cool, and leave phones and screens outside it."
    return (answer.replace(one, f'<promise topic="a regular sleep schedule every night of the week" tokens="3"/><async>{one}</async>')
            .replace(two, f'<promise topic="bedroom" tokens="999"/><async>{two}</async>')
            .replace("Both help", "<sync/>Both help"))


def test_endpoint_annotation_is_kept_with_measured_lengths_and_capped_topics():
    seen: list = []
    ep = fake_endpoint(["```text\n" + _tagged(ANSWER) + "\n```"], seen)
    a = annotate_with_endpoint(ep, "How do I sleep better?", ANSWER, count_tokens=lambda s: len(s.split()))
    assert strip_tags(a.annotated) == ANSWER and a.promises == 2 and a.syncs == 1 and a.annotator == "endpoint"
    promises = [e for e in parse(a.annotated) if isinstance(e, Promise)]
    # lengths measured (16 and 14 words -> Pred-10x), not the model's 3 and 999
    assert [p.tokens for p in promises] == [20, 10]
    assert promises[0].topic == "a regular sleep schedule every" and len(promises[0].topic.encode()) <= 32
    # the request: the annotation prompt as the system turn, the question and answer as the user's
    msgs = seen[0]["messages"]
    assert msgs[0] == {"role": "system", "content": ANNOTATION_PROMPT} and ANSWER in msgs[1]["content"]
    assert seen[0]["model"] == "big-model" and seen[0]["temperature"] == 0


def test_endpoint_annotation_keeps_malformed_tag_text_of_the_answer_once():
    """An answer that holds tag-like text (``<promise topic="x">`` with no closing ``/``) comes
    back exactly: the parser reports it and gives its characters as text, counted once."""
    answer = ANSWER.replace("Both help", 'Use <promise topic="x"> as text. Both help')
    ep = fake_endpoint([_tagged(answer)])
    a = annotate_with_endpoint(ep, "How do I sleep better?", answer, count_tokens=lambda s: len(s.split()))
    assert strip_tags(a.annotated) == answer and a.promises == 2


@pytest.mark.parametrize("reply, why", [
    (_tagged(ANSWER).replace("Keep a regular", "Keep a steady"), "stripping the tags"),  # reworded
    (_tagged(ANSWER).replace("</async>\n2.", "\n2.", 1), "chunk"),  # a chunk never closed
    ("Sure! " + _tagged(ANSWER), "stripping the tags"),  # a preface
])
def test_endpoint_annotation_that_is_not_the_answer_is_discarded(reply, why):
    a = annotate_with_endpoint(fake_endpoint([reply]), "How do I sleep better?", ANSWER)
    assert a.annotated == ANSWER and a.promises == 0 and a.annotator is None
    assert a.note.startswith("endpoint annotation discarded (big-model at http://judge.test/v1)") and why in a.note


def test_unfence_only_strips_one_fence_around_everything():
    assert unfence("```\nabc\n```") == "abc"
    assert unfence("```markdown\na\n```\n") == "a"
    assert unfence("text ```x``` more") == "text ```x``` more"


def test_endpoint_failures_name_the_endpoint():
    with pytest.raises(EndpointError, match=r"big-model at http://judge.test/v1: HTTP 404: .*model not found"):
        fake_endpoint([], status=404).complete([{"role": "user", "content": "hi"}], max_tokens=4)
    with pytest.raises(EndpointError, match="big-model at http://judge.test/v1: the reply holds no text"):
        fake_endpoint(["  "]).complete([{"role": "user", "content": "hi"}], max_tokens=4)
    with pytest.raises(ParameterError, match="base_url"):
        ChatEndpoint("localhost:8000", "m")
    with pytest.raises(ParameterError, match="model"):
        ChatEndpoint("http://localhost:8000/v1", " ")


def test_connection_refused_is_an_endpoint_error_naming_the_url():
    import socket

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # nothing listens there now
    ep = ChatEndpoint(f"http://127.0.0.1:{port}/v1", "m", max_retries=0, timeout_s=5)
    with pytest.raises(EndpointError, match=rf"m at http://127.0.0.1:{port}/v1: APIConnectionError"):
        ep.complete([{"role": "user", "content": "hi"}], max_tokens=4)


def test_parse_verdict_reads_json_and_refuses_what_is_not_a_verdict():
    v = parse_verdict('Here: ```json\n{"verdict": "b", "confidence": "high", "score_a": 3, "score_b": 8, '
                      '"reason": "B answers."}\n```')
    assert (v.verdict, v.confidence, v.score_a, v.score_b) == ("B", "high", 3.0, 8.0)
    assert parse_verdict('{"verdict": "Tie"}').verdict == "tie"
    # the first object only: a brace in the words after it is not part of it
    assert parse_verdict('{"verdict": "A"} (I weighed {clarity} most)').verdict == "A"
    for bad, msg in [("A is better.", "no JSON object"), ('{"verdict": "C"}', "'verdict' must be"),
                     ('{"verdict": "A", "score_a": 11}', "'score_a' must be a number from 1 to 10"),
                     ("{verdict: A}", "does not parse"), ("[1]", "no JSON object")]:
        with pytest.raises(JudgeReplyError, match=msg) as e:
            parse_verdict(bad, "judge-x at http://h/v1")
        assert str(e.value).startswith("judge-x at http://h/v1: ")


def test_judge_quality_judges_both_orders_and_averages_the_win():
    seen: list = []
    # first call: the sample is A and wins; second: the sample is B and the judge says tie
    ep = fake_endpoint(['{"verdict": "A", "score_a": 8, "score_b": 4}', '{"verdict": "tie"}'], seen)
    q = JudgeQuality(ep, {"Q?": "reference answer"})
    assert q("Q?", "sample answer") == pytest.approx(0.75)
    users = [b["messages"][1]["content"] for b in seen]
    assert users[0].index("sample answer") < users[0].index("reference answer")
    assert users[1].index("reference answer") < users[1].index("sample answer")
    assert q.verdicts == [{"prompt": "Q?", "as_a": "A", "as_b": "tie", "win": 0.75}]
    with pytest.raises(KeyError, match="no reference answer"):
        q("Other?", "x")
    with pytest.raises(JudgeReplyError, match="big-model at http://judge.test/v1"):
        judge_pair(fake_endpoint(["I prefer the first."]), "Q?", "a", "b")


def test_build_examples_with_an_endpoint_keeps_only_checked_annotations():
    from pasta_engine.tools.annotate_endpoint import endpoint_annotator
    from pasta_engine.tools.traces import PromptRow
    from pasta_engine.train.data import build_examples

    rows = [PromptRow("How do I sleep better?", ANSWER, "koala", "stop"),
            PromptRow("Again?", ANSWER, "koala", "length")]
    ep = fake_endpoint([_tagged(ANSWER), _tagged(ANSWER).replace("Both", "All")])
    ex, counts = build_examples(rows, lambda s: len(s.split()), annotator="endpoint",
                                annotate_fn=endpoint_annotator(ep, lambda s: len(s.split())))
    assert counts["kept"] == 1 and counts["filtered"] == 1 and counts["ended"] == 1
    assert ex[0].annotator == "endpoint" and ex[0].promises == 2 and ex[0].ended
    with pytest.raises(ValueError, match="annotate_fn"):
        build_examples(rows, len, annotator="endpoint")


def test_the_docs_carry_the_annotation_prompt_verbatim():
    doc = (Path(__file__).resolve().parents[2] / "docs" / "annotation_prompt.md").read_text()
    indented = "\n".join(("    " + line) if line else "" for line in ANNOTATION_PROMPT.rstrip("\n").split("\n"))
    assert indented in doc


@pytest.mark.parametrize("topics, why", [
    (("'the \"schedule\"'", "'lights'"), "holds a quote"),  # single-quoted: parses, but no promise_tag renders it
    (('""', '"lights"'), "an empty topic"),
    (('"8 hours"', '"lights"'), "does not open with a letter"),  # the grammar's first topic token holds a letter
    (('"sleep habit"', '"Sleep habit!"'), "was promised before"),  # topic_key: the grammar's TOPIC_TAKEN
])
def test_endpoint_annotation_with_a_topic_the_grammar_refuses_is_discarded(topics, why):
    """A reply whose topics a model could not write under the grammar is discarded with a note
    naming the endpoint, as any other bad reply; a '"' in a single-quoted topic once passed the
    checks and crashed with a bare ValueError in promise_tag."""
    one = "Keep a regular schedule, going to bed and waking up at the same time every day."
    two = "Keep the bedroom dark and cool, and leave phones and screens outside it."
    reply = (ANSWER.replace(one, f"<promise topic={topics[0]} tokens='10'/><async>{one}</async>")
             .replace(two, f"<promise topic={topics[1]} tokens='10'/><async>{two}</async>"))
    a = annotate_with_endpoint(fake_endpoint([reply]), "How do I sleep better?", ANSWER)
    assert a.annotated == ANSWER and a.promises == 0 and a.annotator is None
    assert a.note.startswith("endpoint annotation discarded (big-model at http://judge.test/v1)") and why in a.note


def test_a_body_that_is_not_json_is_an_endpoint_error():
    """A 200 whose body claims application/json and is not JSON: the openai client raises
    json.JSONDecodeError, which once escaped the judge uncaught; now an EndpointError naming the
    endpoint."""
    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, headers={"content-type": "application/json"}, content=b"not json at all")

    client = openai.OpenAI(base_url="http://judge.test/v1", api_key="k", max_retries=0,
                           http_client=httpx.Client(transport=httpx.MockTransport(handler)))
    ep = ChatEndpoint("http://judge.test/v1", "big-model", client=client)
    with pytest.raises(EndpointError, match=r"big-model at http://judge.test/v1: the reply does not parse"):
        judge_pair(ep, "Q?", "a", "b")
