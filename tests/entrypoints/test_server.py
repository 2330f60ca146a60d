"""The OpenAI-compatible server, as a real process on a loopback port, driven by the real
``openai`` client (and httpx for what the client hides: disconnects, raw SSE, errors); the
dead-engine answers in-process over ASGI."""

from __future__ import annotations

import asyncio
import json

import httpx
import openai
import pytest

from pasta_engine.lang.tags import strip_tags

from server_helpers import auth, settled_stats  # tests/server_helpers.py

ANNOTATED = ('Two tips: <promise topic="sleep" tokens="10"/><async>Sleep early, every day.</async> and '
             '<promise topic="walk" tokens="10"/><async>Walk.</async><sync/> That is all.')


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=server.api_key, max_retries=0, timeout=120)



def stream_chat(client, **kw):
    """Content, finish reason, the final choice's pasta object, usage and chunk ids of a streamed chat."""
    text, finish, pasta, usage, ids = [], None, None, None, set()
    for chunk in client.chat.completions.create(stream=True, **kw):
        ids.add(chunk.id)
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            if c.delta.content:
                text.append(c.delta.content)
            if c.finish_reason:
                finish, pasta = c.finish_reason, c.model_extra.get("pasta")
    return "".join(text), finish, pasta, usage, ids


def test_streamed_and_non_streamed_greedy_outputs_are_identical(server, client):
    msgs = [{"role": "user", "content": "Name three colors."}]
    for extra in ({}, {"pasta": {"mode": "sequential"}}, {"pasta": {"annotated_response": ANNOTATED}}):
        # a replay runs to its end: a max_tokens below its length is refused
        budget = {} if extra.get("pasta", {}).get("annotated_response") else {"max_tokens": 20}
        full = client.chat.completions.create(model=server.model, messages=msgs, temperature=0, extra_body=extra,
                                              **budget)
        text, finish, pasta, usage, ids = stream_chat(client, model=server.model, messages=msgs, temperature=0,
                                                      extra_body=extra, stream_options={"include_usage": True},
                                                      **budget)
        choice = full.choices[0]
        assert text == choice.message.content and finish == choice.finish_reason
        assert len(ids) == 1 and full.id not in ids
        assert pasta["annotated_text"] == choice.model_extra["pasta"]["annotated_text"]
        assert usage.model_dump() == full.usage.model_dump()
        stats = pasta["stats"]
        # usage adds up: every sampled token counts (all threads, EOS included), the prompt once
        assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
        assert usage.completion_tokens == stats["tokens_decoded"] and usage.prompt_tokens > 0
        if "pasta" in extra:
            mode = extra["pasta"].get("mode", "pasta")
            assert choice.model_extra["pasta"]["mode"] == mode
        if extra.get("pasta", {}).get("annotated_response"):
            assert text == strip_tags(ANNOTATED)
            assert stats["threads"] == 3 and stats["decode_steps"] == stats["critical_path"]
            assert stats["decode_steps"] < stats["tokens_decoded"]  # fewer steps than sequential decoding
    comp = client.completions.create(model=server.model, prompt="Once upon a time", temperature=0, max_tokens=12)
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=server.model, prompt="Once upon a time", temperature=0, max_tokens=12, stream=True))
    assert streamed == comp.choices[0].text and comp.usage.completion_tokens == 12


def test_n_choices_and_seeds(server, client):
    msgs = [{"role": "user", "content": "Say something."}]
    r = client.chat.completions.create(model=server.model, messages=msgs, n=3, temperature=1.0, seed=7, max_tokens=10)
    again = client.chat.completions.create(model=server.model, messages=msgs, n=3, temperature=1.0, seed=7,
                                           max_tokens=10)
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert [c.message.content for c in r.choices] == [c.message.content for c in again.choices]  # same seed
    assert len({c.message.content for c in r.choices}) > 1  # each choice its own seed
    one = client.chat.completions.create(model=server.model, messages=msgs, max_tokens=10)
    assert r.usage.prompt_tokens == one.usage.prompt_tokens  # the prompt counts once
    assert r.usage.completion_tokens == sum(c.model_extra["pasta"]["stats"]["tokens_decoded"] for c in r.choices)


def test_logprobs_and_stop(server, client):
    r = client.chat.completions.create(model=server.model, messages=[{"role": "user", "content": "Hi"}],
                                       logprobs=True, max_tokens=8, extra_body={"pasta": {"mode": "sequential"}})
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens and all(t.logprob <= 0 for t in content)
    c = client.completions.create(model=server.model, prompt="abc", logprobs=0, max_tokens=6)
    assert len(c.choices[0].logprobs.token_logprobs) == c.usage.completion_tokens
    # a token's bytes are its own: joined they rebuild the text where a character spans tokens
    text = "Caf\u00e9 \u2615 ok."
    u = client.chat.completions.create(model=server.model, messages=[{"role": "user", "content": "Hi"}], logprobs=True,
                                       extra_body={"pasta": {"annotated_response": text, "mode": "sequential"}})
    assert u.choices[0].message.content == text
    joined = b"".join(bytes(t.bytes) for t in u.choices[0].logprobs.content[:-1])  # the last token is EOS
    assert joined.decode("utf-8") == text
    s = client.chat.completions.create(model=server.model, messages=[{"role": "user", "content": "Hi"}],
                                       stop=["is all"], extra_body={"pasta": {"annotated_response": ANNOTATED}})
    assert s.choices[0].message.content == strip_tags(ANNOTATED).split("is all")[0]
    assert s.choices[0].finish_reason == "stop" and s.choices[0].model_extra["stop_reason"] == "is all"
    stats = settled_stats(server)
    assert stats["kv_pages_free"] == stats["kv_pages_total"]


def test_streamed_logprobs_come_with_their_chunks(server, client):
    """A stream sends each chunk's logprobs with its tokens (OpenAI's and vLLM's shape), not all
    in the last chunk: the entries are spread over the chunks, the tokens so far write the text
    so far, and their concatenation is the non-streamed response's logprobs."""
    msgs = [{"role": "user", "content": "Hi"}]
    for extra, budget in (({"pasta": {"annotated_response": ANNOTATED}}, {}),
                          ({"pasta": {"mode": "sequential"}}, {"max_tokens": 12, "temperature": 0})):
        full = client.chat.completions.create(model=server.model, messages=msgs, logprobs=True, extra_body=extra,
                                              **budget)
        want = full.choices[0].logprobs.content
        per_chunk, text, tokens, texts = [], "", "", 0
        for chunk in client.chat.completions.create(model=server.model, messages=msgs, logprobs=True, stream=True,
                                                    extra_body=extra, **budget):
            c = chunk.choices[0]
            entries = c.logprobs.content if c.logprobs is not None else []
            per_chunk.append(entries)
            text += c.delta.content or ""
            texts += bool(c.delta.content)
            tokens += "".join(e.token for e in entries)
            if "annotated_response" in extra["pasta"]:  # the chunk's text is in the tokens sent so far
                assert strip_tags(tokens).startswith(text), (tokens, text)
        got = [e for entries in per_chunk for e in entries]
        assert [(e.token, e.bytes) for e in got] == [(e.token, e.bytes) for e in want]
        assert [e.logprob for e in got] == pytest.approx([e.logprob for e in want], abs=1e-4)
        # with their chunks, not all at once (a loaded machine may send the whole text in one chunk)
        assert sum(1 for entries in per_chunk if entries) >= min(texts, 2), (extra, texts)
        assert text == full.choices[0].message.content
    kw = dict(model=server.model, prompt="Once upon a time", temperature=0, max_tokens=12, logprobs=0)
    full = client.completions.create(**kw).choices[0].logprobs
    chunks = [c.choices[0] for c in client.completions.create(stream=True, **kw)]
    parts = [c.logprobs for c in chunks if c.logprobs is not None]
    assert len(parts) >= min(sum(bool(c.text) for c in chunks), 2)  # with their chunks, not all at once
    assert sum((p.tokens for p in parts), []) == full.tokens
    assert sum((p.text_offset for p in parts), []) == full.text_offset  # offsets count from the first token
    assert sum((p.token_logprobs for p in parts), []) == pytest.approx(full.token_logprobs, abs=1e-4)


@pytest.mark.parametrize("kw, status, param", [
    (dict(max_tokens=-1), 400, "max_tokens"),
    (dict(max_completion_tokens=0), 400, "max_completion_tokens"),
    (dict(model="gpt-4o"), 404, "model"),
    (dict(temperature=3.0), 400, "temperature"),
    (dict(top_p=0), 400, "top_p"),
    (dict(n=0), 400, "n"),
    (dict(stop=[""]), 400, "stop"),
    (dict(top_logprobs=2, logprobs=True), 400, "top_logprobs"),
    (dict(messages=[{"role": "user", "content": "word " * 5000}]), 400, "messages"),
    (dict(messages=[{"role": "tool", "content": "x"}]), 400, "messages"),
    (dict(extra_body={"pasta": {"max_threads": -1}}), 400, "pasta.max_threads"),
    (dict(extra_body={"pasta": {"position_policy": "sideways"}}), 400, "pasta.position_policy"),
    (dict(extra_body={"pasta": {"turbo": True}}), 400, "pasta.turbo"),
])
def test_bad_requests_name_the_parameter(server, client, kw, status, param):
    args = dict(model=server.model, messages=[{"role": "user", "content": "Hi"}], max_tokens=4)
    args.update(kw)
    with pytest.raises(openai.APIStatusError) as e:
        client.chat.completions.create(**args)
    assert e.value.status_code == status
    err = e.value.response.json()["error"]
    assert err["param"] == param and err["message"]
    if param == "messages" and "word" in json.dumps(kw):
        assert err["code"] == "context_length_exceeded"


def test_api_key_models_health_and_page(server):
    bad = openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    good = openai.OpenAI(base_url=server.url + "/v1", api_key=server.api_key, max_retries=0)
    assert [m.id for m in good.models.list().data] == [server.model]
    assert httpx.get(server.url + "/health").status_code == 200
    page = httpx.get(server.url + "/")
    assert page.status_code == 200 and "text/html" in page.headers["content-type"] and 'id="threads"' in page.text


def test_a_client_that_disconnects_leaves_no_pages_held(server):
    """A replay of ~2,100 tokens cannot end early (it ends only at its trace's end); a client
    leaving after a few chunks must stop it within a few steps and free its pages."""
    long = "Sleep early. " * 300
    body = {"model": server.model, "messages": [{"role": "user", "content": "Go on."}], "stream": True,
            "pasta": {"mode": "sequential", "annotated_response": long}}
    with httpx.Client(base_url=server.url, headers=auth(server), timeout=60) as h:
        with h.stream("POST", "/v1/chat/completions", json=body) as resp:
            assert resp.status_code == 200
            n = 0
            for line in resp.iter_lines():
                n += line.startswith("data: ")
                if n >= 4:
                    break  # leave mid-stream
        left_at = h.get("/v1/pasta/stats").json()["steps"]
    stats = settled_stats(server)
    assert stats["steps"] - left_at < 200  # stopped, not decoded to the end
    assert stats["kv_pages_free"] == stats["kv_pages_total"]
    # a non-streamed request whose client gives up
    before = stats["steps"]
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/chat/completions", json={**body, "stream": False}, headers=auth(server),
                   timeout=0.5)
    stats = settled_stats(server)
    assert 0 < stats["steps"] - before < 2000
    assert stats["kv_pages_free"] == stats["kv_pages_total"]


def test_thread_events_inline_and_by_id(server, client):
    chunks = list(client.chat.completions.create(
        model=server.model, messages=[{"role": "user", "content": "Tips?"}], stream=True,
        extra_body={"pasta": {"annotated_response": ANNOTATED, "events": True}}))
    inline = [e for c in chunks for ch in c.choices for e in (ch.model_extra.get("pasta") or {}).get("events", [])]
    cid = chunks[0].id
    with httpx.Client(base_url=server.url, headers=auth(server), timeout=60) as h:
        records = [json.loads(line[6:]) for line in h.get(f"/v1/pasta/events/{cid}").text.splitlines()
                   if line.startswith("data: ") and line != "data: [DONE]"]
        assert h.get("/v1/pasta/events/chatcmpl-nope").status_code == 404
    by_id = [{k: v for k, v in r.items() if k != "index"} for r in records if r["kind"] != "progress"]
    assert by_id == inline  # the same events, from the start, by id
    forks = [e for e in inline if e["kind"] == "fork"]
    assert [(f["thread"], f["topic"]) for f in forks] == [(1, "sleep"), (2, "walk")]
    for tid, text in ((1, "Sleep early, every day."), (2, "Walk.")):
        assert "".join(e["text"] for e in inline if e["kind"] == "text" and e["thread"] == tid) == text
        assert {"kind": "join", "thread": tid, "parent": 0} in inline
    assert inline[-1] == {"kind": "finish", "thread": 0, "reason": "stop"}


def test_dead_engine_is_503_and_an_error_mid_stream_is_a_last_event(tiny_llama):
    """In-process over ASGI: an engine whose step fails mid-stream, then is dead."""
    from pasta_engine import AsyncEngine, Engine
    from pasta_engine.entrypoints.openai.api_server import build_app

    eng = Engine.from_pretrained(tiny_llama, kv_cache_bytes=8 * 2**20)
    real, calls = eng.model_runner.run, []

    def run(batch):
        calls.append(1)
        if len(calls) > 3:
            raise RuntimeError("device lost")
        return real(batch)

    eng.model_runner.run = run
    aengine = AsyncEngine(eng)
    app = build_app(aengine, "tiny")

    async def main():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as h:
            health = (await h.get("/health")).status_code
            body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 50, "stream": True,
                    "pasta": {"mode": "sequential"}}
            streamed = (await h.post("/v1/chat/completions", json=body)).text
            after = await h.post("/v1/chat/completions", json={**body, "stream": False})
            return health, streamed, after, (await h.get("/health")).status_code

    health, streamed, after, health_after = asyncio.run(main())
    aengine.shutdown()
    events = [line for line in streamed.splitlines() if line.startswith("data: ")]
    assert health == 200 and health_after == 503
    assert events[-1] == "data: [DONE]"
    err = json.loads(events[-2][6:])["error"]
    assert err["code"] == "engine_dead" and "device lost" in err["message"]
    assert after.status_code == 503 and after.json()["error"]["code"] == "engine_dead"
