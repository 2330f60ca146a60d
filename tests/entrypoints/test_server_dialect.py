"""A dialect per request in the OpenAI server (issue 23, item 5): ``pasta.dialect`` is in the
schema, accepted, passed to the engine and reported; a bad one is a 400 naming it before the
request takes any resource; requests in several dialects decode together, each as it would
alone. The page's dialect selector is tested in test_page.py."""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest

from pasta_engine.lang import dialect as dialect_mod
from pasta_engine.lang.dialect import DIALECT_NAMES, get_dialect

from server_helpers import auth, settled_stats  # tests/server_helpers.py

ANNOTATED = ('Two tips: <promise topic="sleep" tokens="10"/><async>Sleep early, every day.</async> and '
             '<promise topic="walk" tokens="10"/><async>Walk after lunch.</async><sync/> That is all.')

# A short answer in each dialect's syntax, to replay (forced decoding). Only the engine reads
# them: the assertions below compare with what the dialect itself makes of its trace
# (clean_text, split_threads), so they hold whatever the exact syntax is.
TRACES = {
    "pasta": ANNOTATED,
    "apar": ("Two tips:\n1. Sleep[Fork][Child] early, every day.[/Child]\n2. Walk[Fork][Child] after lunch.[/Child]\n"
             "That is all."),
    "multiverse": ("Two tips:\n<Parallel>\n<Goal>\n<Outline>1: sleep</Outline>\n<Outline>2: walk</Outline>\n</Goal>\n"
                   "<Path>\n1: Sleep early, every day.\n</Path>\n<Path>\n2: Walk after lunch.\n</Path>\n"
                   "<Conclusion>\nThat is all.\n</Conclusion>\n</Parallel>"),
}
# forks each trace makes in its dialect
TRACE_FORKS = {"pasta": 2, "apar": 2, "multiverse": 2}
# the stats of a choice that do not depend on what else the engine ran (not wall_s, the prefix
# cache's cached_tokens, preemptions, or decode_steps, which the batch's token budget may spread)
SAME_STATS = ("content_tokens", "tokens_decoded", "tag_tokens", "threads", "forks", "critical_path", "finish_reason")



@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=server.api_key, max_retries=0, timeout=120)


def chat_body(server, dialect: str | None, replay: bool, **extra) -> dict:
    pasta = {} if dialect is None else {"dialect": dialect}
    if replay:
        pasta["annotated_response"] = TRACES[dialect or "pasta"]
    body = {"model": server.model, "messages": [{"role": "user", "content": "Give me two tips."}],
            "temperature": 0, "max_tokens": 256 if replay else 16, "logprobs": True, "pasta": pasta}
    body.update(extra)
    return body


def summary(resp: dict) -> dict:
    """What must not change when a request runs beside others: its text, annotated text, tokens,
    structure and dialect."""
    c = resp["choices"][0]
    p = c["pasta"]
    return {"text": c["message"]["content"], "finish_reason": c["finish_reason"],
            "tokens": [t["token"] for t in c["logprobs"]["content"]], "annotated_text": p["annotated_text"],
            "dialect": p["dialect"], "mode": p["mode"], **{k: p["stats"][k] for k in SAME_STATS}}


def test_openapi_documents_the_dialect_field(server):
    doc = httpx.get(server.url + "/openapi.json", headers=auth(server)).json()
    field = doc["components"]["schemas"]["PastaOptions"]["properties"]["dialect"]
    assert field["enum"] == list(DIALECT_NAMES) and field["default"] == "pasta"
    assert "PASTA-LANG" in field["description"]


@pytest.mark.parametrize("name", DIALECT_NAMES)
def test_the_field_is_accepted_and_reported(server, client, name):
    msgs = [{"role": "user", "content": "Give me two tips."}]
    full = client.chat.completions.create(model=server.model, messages=msgs, temperature=0, max_tokens=8,
                                          extra_body={"pasta": {"dialect": name}})
    assert full.choices[0].model_extra["pasta"]["dialect"] == name
    # streamed: the last chunk's pasta object reports it too
    pasta = [c.model_extra["pasta"] for ch in client.chat.completions.create(
        model=server.model, messages=msgs, temperature=0, max_tokens=8, stream=True,
        extra_body={"pasta": {"dialect": name}}) for c in ch.choices if c.finish_reason]
    assert [p["dialect"] for p in pasta] == [name]
    # text completions take it as well
    comp = client.completions.create(model=server.model, prompt="Once upon a time", temperature=0, max_tokens=4,
                                     extra_body={"pasta": {"dialect": name}})
    assert comp.choices[0].model_extra["pasta"]["dialect"] == name


def test_the_default_is_pasta_and_equals_asking_for_it(server, client):
    msgs = [{"role": "user", "content": "Name three colors."}]
    default = client.chat.completions.create(model=server.model, messages=msgs, temperature=0, max_tokens=10)
    named = client.chat.completions.create(model=server.model, messages=msgs, temperature=0, max_tokens=10,
                                           extra_body={"pasta": {"dialect": "pasta", "mode": "pasta"}})
    nulled = client.chat.completions.create(model=server.model, messages=msgs, temperature=0, max_tokens=10,
                                            extra_body={"pasta": {"dialect": None}})  # null: left out
    for r in (default, named, nulled):
        assert r.choices[0].model_extra["pasta"]["dialect"] == "pasta"
    assert default.choices[0].message.content == named.choices[0].message.content == nulled.choices[0].message.content


@pytest.mark.parametrize("value", ["klingon", "PASTA", "", 3, ["apar"]])
def test_a_bad_dialect_is_a_400_naming_it_and_the_next_request_is_served(server, value):
    body = chat_body(server, None, replay=False)
    body["pasta"] = {"dialect": value}
    with httpx.Client(base_url=server.url, headers=auth(server), timeout=60) as h:
        for stream in (False, True):
            r = h.post("/v1/chat/completions", json={**body, "stream": stream})
            assert r.status_code == 400
            err = r.json()["error"]
            assert err["param"] == "pasta.dialect" and err["type"] == "invalid_request_error"
            assert repr(value) in err["message"] and "'multiverse'" in err["message"]  # the value, the choices
        stats = settled_stats(server)
        assert stats["kv_pages_free"] == stats["kv_pages_total"] and stats["open"] == 0  # it took nothing
        ok = h.post("/v1/chat/completions", json=chat_body(server, "pasta", replay=True))
        assert ok.status_code == 200 and ok.json()["choices"][0]["pasta"]["dialect"] == "pasta"


def test_an_unavailable_dialect_module_fails_alone(tiny_llama, monkeypatch):
    """In-process over ASGI: a dialect whose module is not installed is a 400 naming
    ``pasta.dialect`` (code ``dialect_unavailable``), one whose module is there but fails to load
    a 500; neither takes a resource, and the engine serves the next request."""
    from pasta_engine import AsyncEngine, Engine
    from pasta_engine.entrypoints.openai.api_server import build_app

    monkeypatch.setattr(dialect_mod, "_MODULES", {"apar": ("no_such_dialect_module", "APAR"),
                                                  "multiverse": ("tags", "NO_SUCH_DIALECT")})
    aengine = AsyncEngine(Engine.from_pretrained(tiny_llama, kv_cache_bytes=8 * 2**20))
    app = build_app(aengine, "tiny")
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "temperature": 0}

    async def main():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as h:
            missing = await h.post("/v1/chat/completions", json={**body, "pasta": {"dialect": "apar"}})
            broken = await h.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 4,
                                                            "pasta": {"dialect": "multiverse"}})
            stats = (await h.get("/v1/pasta/stats")).json()
            ok = await h.post("/v1/chat/completions", json={**body, "pasta": {"dialect": "pasta"}})
            return missing, broken, stats, ok

    try:
        missing, broken, stats, ok = asyncio.run(main())
    finally:
        aengine.shutdown()
    err = missing.json()["error"]
    assert missing.status_code == 400 and err["param"] == "pasta.dialect" and err["code"] == "dialect_unavailable"
    assert "'apar'" in err["message"] and "pasta_engine.lang.no_such_dialect_module" in err["message"]
    err = broken.json()["error"]
    assert broken.status_code == 500 and err["type"] == "server_error" and err["param"] == "pasta.dialect"
    assert "'multiverse'" in err["message"] and "NO_SUCH_DIALECT" in err["message"]
    assert stats["steps"] == 0 and stats["open"] == 0 and stats["kv_pages_free"] == stats["kv_pages_total"]
    assert ok.status_code == 200 and ok.json()["choices"][0]["pasta"]["dialect"] == "pasta"


def test_requests_in_several_dialects_decode_together_as_they_would_alone(server):
    """Replays of an annotated response and greedy generations, in every dialect of this tree
    (pasta, apar and multiverse), sent at once: each choice is
    what the same request gives alone (text, tokens, annotated text, structure), and a replay's
    text and forks are what its dialect reads in its trace."""
    names = list(DIALECT_NAMES)
    assert names[0] == "pasta"
    bodies = [chat_body(server, d, replay) for d in names for replay in (True, False)]
    with httpx.Client(base_url=server.url, headers=auth(server), timeout=120) as h:
        alone = []
        steps0 = settled_stats(server)["steps"]
        for b in bodies:
            r = h.post("/v1/chat/completions", json=b)
            assert r.status_code == 200, r.text
            alone.append(summary(r.json()))
        steps1 = settled_stats(server)["steps"]

    async def together() -> list[dict]:
        async with httpx.AsyncClient(base_url=server.url, headers=auth(server), timeout=120) as h:
            rs = await asyncio.gather(*(h.post("/v1/chat/completions", json=b) for b in bodies))
        for r in rs:
            assert r.status_code == 200, r.text
        return [summary(r.json()) for r in rs]

    mixed = asyncio.run(together())
    steps2 = settled_stats(server)["steps"]
    assert steps2 - steps1 < steps1 - steps0  # they decoded together: fewer engine steps than one by one
    for b, one, both in zip(bodies, alone, mixed):
        assert both == one, (b["pasta"], one, both)
    assert sum("annotated_response" in b["pasta"] for b in bodies) == len(names)  # a replay per dialect
    for b, one in zip(bodies, alone):
        name = b["pasta"]["dialect"]
        assert one["dialect"] == name
        if "annotated_response" in b["pasta"]:
            lang, trace = get_dialect(name), b["pasta"]["annotated_response"]
            assert one["text"] == lang.clean_text(trace)
            assert one["forks"] == len(lang.split_threads(trace).chunks) and one["threads"] == one["forks"] + 1
            assert one["forks"] == TRACE_FORKS.get(name, one["forks"])
            assert one["critical_path"] < one["tokens_decoded"] or not one["forks"]  # threads ran side by side
    stats = settled_stats(server)
    assert stats["kv_pages_free"] == stats["kv_pages_total"]


def test_a_chat_prompt_gets_its_dialects_system_prompt(server, client, tiny_llama):
    """The server formats a pasta-mode chat prompt with the request's dialect's prompt (usage's
    prompt_tokens is its length), never PASTA-LANG's for APAR or Multiverse."""
    from transformers import AutoTokenizer

    from pasta_engine.lang.dialect import dialect_prompt
    from pasta_engine.lang.prompts import DEFAULT_PASTA_PROMPT
    from pasta_engine.lang.tokenization import encode_prompt

    tok = AutoTokenizer.from_pretrained(tiny_llama)
    seen = {}
    for name in DIALECT_NAMES:
        r = client.chat.completions.create(model=server.model, messages=[{"role": "user", "content": "Hi."}],
                                           temperature=0, max_tokens=2, extra_body={"pasta": {"dialect": name}})
        want = encode_prompt(tok, dialect_prompt(get_dialect(name), DEFAULT_PASTA_PROMPT).messages("Hi."))
        assert r.usage.prompt_tokens == len(want), name
        seen[name] = r.usage.prompt_tokens
    assert len(set(seen.values())) == len(DIALECT_NAMES)


def test_max_fork_depth_is_a_request_field(server):
    """``pasta.max_fork_depth``: a nested Multiverse replay forks its inner block only under a
    depth cap of 2 (the default); 0 is a 400 naming the field."""
    from sample_traces import NESTED_MULTIVERSE as NESTED  # tests/sample_traces.py

    def forks(**pasta):
        body = {"model": server.model, "messages": [{"role": "user", "content": "Two things?"}], "temperature": 0,
                "pasta": {"dialect": "multiverse", "annotated_response": NESTED, **pasta}}  # a replay: no max_tokens
        r = httpx.post(server.url + "/v1/chat/completions", json=body, headers=auth(server), timeout=120)
        return r.status_code, r.json()

    code, shallow = forks(max_fork_depth=1, max_threads=0)
    assert code == 200 and shallow["choices"][0]["pasta"]["stats"]["forks"] == 2
    code, deep = forks(max_threads=0)
    assert code == 200 and deep["choices"][0]["pasta"]["stats"]["forks"] == 4
    code, err = forks(max_fork_depth=0)
    assert code == 400 and err["error"]["param"] == "pasta.max_fork_depth"


def test_fork_threshold_is_a_request_field_refused_where_it_cannot_apply(server):
    """``pasta.fork_threshold`` is in the schema; out of (0, 1] it is a 400 naming it, and so is
    a model whose tokenizer lacks the tag pieces (this server's), a sequential request or a replay:
    refused before the request takes any resource, and the server serves the next call."""
    doc = httpx.get(server.url + "/openapi.json", headers=auth(server)).json()
    assert "fork_threshold" in doc["components"]["schemas"]["PastaOptions"]["properties"]

    def post(**pasta):
        body = {"model": server.model, "messages": [{"role": "user", "content": "Hi."}], "temperature": 0,
                "max_tokens": 4, "pasta": pasta}
        r = httpx.post(server.url + "/v1/chat/completions", json=body, headers=auth(server), timeout=120)
        return r.status_code, r.json()

    for pasta in ({"fork_threshold": 0}, {"fork_threshold": 1.5}, {"fork_threshold": 0.5},
                  {"fork_threshold": 0.5, "mode": "sequential"}):
        code, err = post(**pasta)
        assert code == 400 and err["error"]["param"] == "pasta.fork_threshold", (pasta, err)
    code, ok = post()
    assert code == 200 and ok["choices"][0]["message"]["content"] is not None


@pytest.mark.parametrize("field, cases", [
    ("independent_topics", ((True, 400), ("maybe", 400), (False, 200))),
    ("fork_headroom_tokens", ((64, 400), (-1, 400), ("many", 400), (None, 200))),
])
def test_a_grammar_knob_is_a_request_field_refused_where_it_cannot_apply(server, field, cases):
    """``pasta.independent_topics`` and ``pasta.fork_headroom_tokens`` are in the schema; set on
    this server's model (no tag pieces as tokens) each is a 400 naming it, so is a value of the
    wrong kind; off (false, or null) is served."""
    doc = httpx.get(server.url + "/openapi.json", headers=auth(server)).json()
    assert field in doc["components"]["schemas"]["PastaOptions"]["properties"]
    for value, want in cases:
        body = {"model": server.model, "messages": [{"role": "user", "content": "Hi."}], "temperature": 0,
                "max_tokens": 4, "pasta": {field: value}}
        r = httpx.post(server.url + "/v1/chat/completions", json=body, headers=auth(server), timeout=120)
        assert r.status_code == want, (value, r.text)
        if want == 400:
            assert r.json()["error"]["param"] == f"pasta.{field}", r.text


def test_length_cut_is_a_request_field(server):
    """``pasta.length_cut`` (issue 31 item 9) is in the schema, ``prefix`` or ``keep``; anything
    else is a 400 naming it."""
    doc = httpx.get(server.url + "/openapi.json", headers=auth(server)).json()
    assert "length_cut" in doc["components"]["schemas"]["PastaOptions"]["properties"]
    for value, want in (("keep", 200), ("prefix", 200), ("holes", 400)):
        body = {"model": server.model, "messages": [{"role": "user", "content": "Hi."}], "temperature": 0,
                "max_tokens": 4, "pasta": {"length_cut": value}}
        r = httpx.post(server.url + "/v1/chat/completions", json=body, headers=auth(server), timeout=120)
        assert r.status_code == want, (value, r.text)
        if want == 400:
            assert r.json()["error"]["param"] == "pasta.length_cut"


def test_each_pasta_limit_field_reaches_the_request_limits():
    """Every ``pasta`` field that is a ``Limits`` field replaces the engine's value when given,
    and only then; ``max_threads`` 0 is unlimited (None)."""
    from pasta_engine.config import Limits
    from pasta_engine.entrypoints.openai.schema import PastaOptions
    from pasta_engine.entrypoints.openai.serving import PASTA_LIMITS, request_limits

    base = Limits(max_threads=4)
    assert request_limits(PastaOptions(), base) is None
    changed = {"max_threads": 0, "max_forks": 3, "max_fork_depth": 1, "fork_threshold": 0.25, "length_cut": "keep",
               "distinct_topics": False, "chunk_clean_end": False, "independent_topics": True,
               "fork_headroom_tokens": 64}
    assert set(changed) == set(PASTA_LIMITS)
    for name, value in changed.items():
        got = request_limits(PastaOptions(**{name: value}), base)
        want = None if name == "max_threads" else value
        assert getattr(got, name) == want != getattr(base, name), name
        assert all(getattr(got, o) == getattr(base, o) for o in PASTA_LIMITS if o != name), name


@pytest.mark.parametrize("pasta", [
    {"mode": "sequential", "position_policy": "oracle"}, {"mode": "sequential", "position_policy": "predicted"},
    {"mode": "sequential", "max_threads": 3}, {"mode": "sequential", "max_forks": 2},
    {"mode": "sequential", "length_cut": "keep"}, {"mode": "sequential", "max_fork_depth": 2},
    {"mode": "sequential", "distinct_topics": False}, {"mode": "sequential", "chunk_clean_end": True},
    {"mode": "inline", "max_threads": 0}, {"mode": "inline", "length_cut": "prefix"},
    {"mode": "inline", "position_policy": "constant:3"},
    {"dialect": "pasta", "max_fork_depth": 5}, {"dialect": "apar", "max_fork_depth": 1},
    {"annotated_response": ANNOTATED, "distinct_topics": True},
])
def test_a_pasta_field_without_effect_in_the_mode_or_dialect_is_refused(server, pasta):
    """A ``pasta`` field that cannot act in the request's mode or dialect was accepted and
    ignored (only fork_threshold was refused): the position policy, the width and the length
    cut act only on pasta mode's forks, max_forks on promises (none in sequential mode),
    max_fork_depth only in a dialect that nests forks, distinct_topics and chunk_clean_end only
    where the sampler enforces the grammar. Each is a 400 naming ``pasta.<field>``."""
    body = {"model": server.model, "messages": [{"role": "user", "content": "Hi."}], "temperature": 0, "pasta": pasta}
    r = httpx.post(server.url + "/v1/chat/completions", json=body, headers=auth(server), timeout=120)
    field = next(k for k in pasta if k not in ("mode", "dialect", "annotated_response"))
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == f"pasta.{field}" and "has no effect" in err["message"], err


@pytest.mark.parametrize("pasta", [
    {"mode": "pasta", "position_policy": "none", "max_threads": 2, "max_forks": 1, "length_cut": "keep",
     "distinct_topics": False, "chunk_clean_end": False},
    {"mode": "inline", "max_forks": 1, "distinct_topics": True},
    {"mode": "pasta", "dialect": "multiverse", "max_fork_depth": 1},
    {"mode": "sequential", "events": True, "dialect": "apar"},
])
def test_a_pasta_field_with_effect_is_still_served(server, pasta):
    body = {"model": server.model, "messages": [{"role": "user", "content": "Hi."}], "temperature": 0,
            "max_tokens": 4, "stream": True, "pasta": pasta}
    r = httpx.post(server.url + "/v1/chat/completions", json=body, headers=auth(server), timeout=120)
    assert r.status_code == 200 and r.text.endswith("data: [DONE]\n\n") and '"error"' not in r.text, r.text[-500:]
