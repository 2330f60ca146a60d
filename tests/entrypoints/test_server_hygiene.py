"""Issue 20's probe of the server, case by case: hostile bodies get a 400 naming the field (never
a 500 or a reset connection), fields the engine does not honour are refused (never ignored),
and the limits and hygiene of a server a web page can reach (body size, JSON only, Host header,
the key, docs, HEAD, /version, Prometheus /metrics, event logs capped in bytes, prompts
tokenized off the engine thread). Real server processes on loopback ports (``server``: with a
key; ``open_server``: without one, so its Host check is on by default) and, where the test
needs to look inside, the app in-process over ASGI."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import threading
import time

import httpx
import pytest

CHAT = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
ANNOTATED = ('Two tips: <promise topic="sleep" tokens="10"/><async>Sleep early, every day.</async> and '
             '<promise topic="walk" tokens="10"/><async>Walk.</async><sync/> That is all.')
JSON = {"Content-Type": "application/json"}


def auth(server) -> dict[str, str]:
    return {"Authorization": f"Bearer {server.api_key}", **JSON}


@pytest.fixture(scope="module")
def app_srv(tiny_llama):
    """The app in-process over its own engine (small event-log budget), and its state."""
    from pasta_engine import AsyncEngine, Engine
    from pasta_engine.entrypoints.openai.api_server import build_app

    aengine = AsyncEngine(Engine.from_pretrained(tiny_llama, kv_cache_bytes=16 * 2**20, page_size=4))
    app = build_app(aengine, "tiny", event_log_bytes=200_000)
    yield app, app.state.server
    aengine.shutdown()


def asgi(app, *requests):
    """Send ``(method, path, kwargs)`` requests to the app in-process; their responses."""

    async def main():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test",
                                     timeout=120) as h:
            return [await h.request(m, path, **kw) for m, path, kw in requests]

    return asyncio.run(main())


# --------------------------------------------------------------------------- hostile bodies


def _raw(extra: str) -> str:
    return '{"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, ' + extra + "}"


@pytest.mark.parametrize("body, param", [
    (_raw('"n": 1').replace('"max_tokens": 4', '"max_tokens": ' + "9" * 5000), "max_tokens"),  # was 500 + reset
    (_raw('"temperature": ' + "1" * 400), "temperature"),  # was 500
    (_raw('"top_p": ' + "1" * 400), "top_p"),  # was 500
    ('{"messages": ' + "[" * 1000 + "]" * 1000 + "}", None),  # was 500
    ('{"messages": [{"role": "user", "content": "a\\udcffb"}]}', "messages"),  # lone surrogate: was 500
    (_raw('"pasta": {"position_policy": "constant:\u00b2"}'), "pasta.position_policy"),  # was 500
    ('{"messages": [1, 2, 3]}', "messages"),  # was 200: the ints ran as token ids
    (_raw('"temperature": NaN'), "body"),
    (_raw('"seed": 1e999'), "seed"),
    ('{"messages": "Hi"}', "messages"),
    ('{"messages": [{"role": "user", "content": {"a": 1}}]}', "messages"),
    ('{"messages": []}', "messages"),
    ("[1, 2]", "body"),
    ("{not json", "body"),
])
def test_hostile_bodies_are_400_naming_the_field_on_a_live_connection(server, body, param):
    with httpx.Client(base_url=server.url, headers=auth(server), timeout=60) as h:
        r = h.post("/v1/chat/completions", content=body.encode("utf-8", "surrogatepass"))
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["type"] == "invalid_request_error" and err["message"]
        if param is not None:
            assert err["param"] == param, err
        assert h.get("/health").status_code == 200  # the same connection still answers


def test_completions_without_a_prompt_names_prompt(server):
    for body in ({"max_tokens": 3}, {"prompt": [], "max_tokens": 3}, {"prompt": None}, {"prompt": [1, "a"]}):
        r = httpx.post(server.url + "/v1/completions", json=body, headers=auth(server))
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", (body, r.text)
    r = httpx.post(server.url + "/v1/completions", json={"prompt": "", "max_tokens": 3}, headers=auth(server))
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"


def test_a_vanishing_top_p_keeps_the_top_token(server):
    """top_p=1e-300 rounded to 0 in the sampler's float32 and kept nothing ("probability tensor
    contains inf/nan", a 500); it is taken as 1e-6, which keeps only the most likely token."""
    base = {**CHAT, "max_tokens": 8, "pasta": {"mode": "sequential"}}
    tiny = httpx.post(server.url + "/v1/chat/completions", json={**base, "top_p": 1e-300, "temperature": 1, "seed": 3},
                      headers=auth(server), timeout=60)
    greedy = httpx.post(server.url + "/v1/chat/completions", json={**base, "temperature": 0}, headers=auth(server),
                        timeout=60)
    assert tiny.status_code == 200, tiny.text
    c = tiny.json()["choices"][0]
    assert c["finish_reason"] == "length" and c["message"] == greedy.json()["choices"][0]["message"]


# --------------------------------------------------------------------------- nothing ignored


@pytest.mark.parametrize("field, value", [
    ("ignore_eos", True), ("min_tokens", 2), ("min_p", 0.1), ("repetition_penalty", 1.1), ("presence_penalty", 0.5),
    ("frequency_penalty", 0.5), ("stop_token_ids", [3]), ("skip_special_tokens", False),
    ("spaces_between_special_tokens", False), ("include_stop_str_in_output", True), ("logit_bias", {"5": 1.0}),
    ("top_logprobs", 2), ("tools", [{"type": "function"}]), ("response_format", {"type": "json_object"}),
    ("tool_choice", "auto"),
])
def test_a_field_the_engine_does_not_honour_is_refused_with_its_value(server, field, value):
    import dataclasses

    from pasta_engine.config import SamplingParams

    r = httpx.post(server.url + "/v1/chat/completions", json={**CHAT, field: value, "logprobs": True},
                   headers=auth(server), timeout=60)
    if field in {f.name for f in dataclasses.fields(SamplingParams)}:  # the engine implements it: honoured
        assert r.status_code == 200, r.text
        return
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == field and "not supported" in err["message"]
    assert json.dumps(value).strip('"').lower() in err["message"].lower() or repr(value) in err["message"]


@pytest.mark.parametrize("field, value, param", [
    ("foo", 1, "foo"), ("pasta", {"turbo": True}, "pasta.turbo"), ("stream_options", {"x": 1}, "stream_options"),
])
def test_unknown_fields_are_refused(server, field, value, param):
    body = {**CHAT, field: value, **({"stream": True} if field == "stream_options" else {})}
    r = httpx.post(server.url + "/v1/chat/completions", json=body, headers=auth(server))
    assert r.status_code == 400 and r.json()["error"]["param"] == param
    assert "unknown field" in r.json()["error"]["message"]


@pytest.mark.parametrize("body, param", [
    ({"prompt": "a", "logprobs": 2}, "logprobs"), ({"prompt": "a", "echo": True}, "echo"),
    ({"prompt": "a", "best_of": 2}, "best_of"), ({"prompt": "a", "suffix": "b"}, "suffix"),
    ({"prompt": "a", "messages": []}, "messages"),
])
def test_completions_refusals(server, body, param):
    r = httpx.post(server.url + "/v1/completions", json=body, headers=auth(server))
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_default_values_ask_for_nothing_and_vllm_names_work(server):
    body = {**CHAT, "ignore_eos": False, "min_tokens": 0, "min_p": 0.0, "repetition_penalty": 1.0,
            "presence_penalty": 0, "frequency_penalty": 0, "stop_token_ids": [], "skip_special_tokens": True,
            "include_stop_str_in_output": False, "logit_bias": {}, "top_k": -1, "user": "me", "tool_choice": "none",
            "response_format": {"type": "text"}}
    r = httpx.post(server.url + "/v1/chat/completions", json=body, headers=auth(server), timeout=60)
    assert r.status_code == 200, r.text
    nulls = {**CHAT, "n": None, "stream": None, "temperature": None, "seed": None, "stop": None, "pasta": None}
    r = httpx.post(server.url + "/v1/chat/completions", json=nulls, headers=auth(server), timeout=60)
    assert r.status_code == 200, r.text  # null is the default, as OpenAI's clients may send it
    del body["max_tokens"]
    r = httpx.post(server.url + "/v1/chat/completions", json={**body, "max_new_tokens": 3}, headers=auth(server),
                   timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
    r = httpx.post(server.url + "/v1/chat/completions", json={**body, "max_new_tokens": 3, "max_tokens": 5},
                   headers=auth(server))
    assert r.status_code == 400 and "disagrees" in r.json()["error"]["message"]


# --------------------------------------------------------------------------- limits and hygiene


def test_openapi_documents_the_schema_behind_the_key_and_no_docs_page(server):
    assert httpx.get(server.url + "/openapi.json").status_code == 401
    doc = httpx.get(server.url + "/openapi.json", headers=auth(server)).json()
    schemas = doc["components"]["schemas"]
    chat = schemas["ChatCompletionRequest"]["properties"]
    for name in ("messages", "max_tokens", "max_new_tokens", "stop", "n", "seed", "ignore_eos", "min_p", "pasta"):
        assert name in chat
    assert "prompt" in schemas["CompletionRequest"]["properties"]
    ref = doc["paths"]["/v1/chat/completions"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert ref == {"$ref": "#/components/schemas/ChatCompletionRequest"}
    for path in ("/docs", "/redoc"):  # Swagger UI / ReDoc load their scripts from a CDN: not served
        assert httpx.get(server.url + path, headers=auth(server)).status_code == 404
    page = httpx.get(server.url + "/").text
    assert "cdn." not in page and 'src="http' not in page


def test_api_key_scheme_is_case_insensitive_and_compared_in_constant_time(server, app_srv, monkeypatch):
    for header, ok in ((f"bearer {server.api_key}", True), (f"BEARER {server.api_key}", True),
                       (f"Bearer  {server.api_key}", True), (f"Bearer {server.api_key}x", False),
                       (f"Basic {server.api_key}", False), (server.api_key, False), ("", False)):
        r = httpx.get(server.url + "/v1/models", headers={"Authorization": header})
        assert r.status_code == (200 if ok else 401), header
    from pasta_engine.entrypoints.openai import auth as server_module

    calls = []
    real = server_module.hmac.compare_digest
    monkeypatch.setattr(server_module.hmac, "compare_digest", lambda a, b: calls.append(1) or real(a, b))
    srv = app_srv[1]
    monkeypatch.setattr(srv, "api_key", "k")
    (r,) = asgi(app_srv[0], ("GET", "/v1/models", {"headers": {"Authorization": "Bearer k"}}))
    assert r.status_code == 200 and calls


def test_an_empty_api_key_is_refused_at_startup():
    p = subprocess.run([sys.executable, "-m", "pasta_engine.entrypoints.cli", "serve", "--api-key", ""],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and "--api-key" in p.stderr
    assert len(p.stderr.strip().splitlines()) == 1 and "Traceback" not in p.stderr
    from pasta_engine.entrypoints.openai.api_server import build_app
    from pasta_engine.errors import ParameterError

    with pytest.raises(ParameterError, match="empty"):
        build_app(None, "x", api_key="")  # type: ignore[arg-type]
    # issue 31 item 10: a key with surrounding spaces could never be matched (a header value loses them)
    for key in (" k", "k ", "a b", "k\t", "k\x00"):
        with pytest.raises(ParameterError, match="whitespace or control characters"):
            build_app(None, "x", api_key=key)  # type: ignore[arg-type]
    p = subprocess.run([sys.executable, "-m", "pasta_engine.entrypoints.cli", "serve", "--api-key", " secret "],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and "--api-key" in p.stderr and "whitespace" in p.stderr and "secret" not in p.stderr


@pytest.mark.parametrize("ctype, status", [
    ("text/plain", 415), (None, 415), ("application/x-www-form-urlencoded", 415), ("multipart/form-data", 415),
    ("application/json; charset=utf-8", 200), ("Application/JSON", 200),
])
def test_bodies_must_be_json(server, ctype, status):
    headers = {"Authorization": f"Bearer {server.api_key}"}
    if ctype is not None:
        headers["Content-Type"] = ctype
    r = httpx.post(server.url + "/v1/chat/completions", content=json.dumps(CHAT), headers=headers, timeout=60)
    assert r.status_code == status, r.text
    if status == 415:
        assert r.json()["error"]["code"] == "unsupported_media_type"


def test_a_body_over_the_limit_is_413_before_it_is_read(server):
    body = json.dumps({"messages": [{"role": "user", "content": "word " * 400_000}]})  # 2 MB > 1 MiB default
    t = time.monotonic()
    r = httpx.post(server.url + "/v1/chat/completions", content=body, headers=auth(server), timeout=60)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    assert time.monotonic() - t < 10


def test_host_header_checked_for_a_local_keyless_server(open_server, server):
    for host, status in (("evil.example", 400), ("evil.example:80", 400), ("localhost", 200),
                         (f"127.0.0.1:{open_server.url.rsplit(':', 1)[1]}", 200), ("[::1]:8000", 200)):
        r = httpx.get(open_server.url + "/health", headers={"Host": host})
        assert r.status_code == status, host
        if status == 400:
            assert r.json()["error"]["code"] == "host_not_allowed"
    r = httpx.post(open_server.url + "/v1/chat/completions", json=CHAT, headers={"Host": "attacker.test"})
    assert r.status_code == 400
    # a server with a key answers any Host (the key guards it)
    assert httpx.get(server.url + "/health", headers={"Host": "evil.example"}).status_code == 200


def test_default_allowed_hosts():
    from pasta_engine.entrypoints.openai.auth import LOCAL_HOSTS, default_allowed_hosts

    for host in ("127.0.0.1", "localhost", "::1", "[::1]"):
        assert default_allowed_hosts(host, None) == list(LOCAL_HOSTS)
        assert default_allowed_hosts(host, "key") is None
    assert default_allowed_hosts("127.0.0.2", None) == [*LOCAL_HOSTS, "127.0.0.2"]
    assert default_allowed_hosts("127.0.0.2", "key") is None
    assert default_allowed_hosts("0.0.0.0", None) is None


def test_a_server_on_another_loopback_address_answers_its_own_url(app_srv):
    """``serve --host 127.0.0.2`` without a key refused every request to the URL it printed (400
    host_not_allowed): the bind address itself is allowed (an IPv6 one bracketed, as in a URL),
    and a foreign Host is still refused."""
    from pasta_engine.entrypoints.openai.api_server import build_app
    from pasta_engine.entrypoints.openai.auth import LOCAL_HOSTS, default_allowed_hosts

    assert default_allowed_hosts("0:0:0:0:0:0:0:1", None) == [*LOCAL_HOSTS, "[0:0:0:0:0:0:0:1]"]
    assert default_allowed_hosts("::1", None) == list(LOCAL_HOSTS)
    app = build_app(app_srv[1].engine, "tiny", allowed_hosts=default_allowed_hosts("127.0.0.2", None))

    async def main():
        out = []
        for host in ("127.0.0.2:8000", "127.0.0.2", "localhost", "evil.example"):
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test",
                                         headers={"Host": host}, timeout=60) as h:
                out.append((host, await h.get("/health"),
                            await h.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})))
        return out

    for host, health, completion in asyncio.run(main()):
        want = 400 if host == "evil.example" else 200
        assert health.status_code == completion.status_code == want, (host, health.text, completion.text)


def test_head_where_get_and_version(server):
    import pasta_engine

    for path in ("/", "/health", "/version", "/metrics"):
        r = httpx.head(server.url + path)
        assert r.status_code == 200 and r.content == b"", path
    assert httpx.head(server.url + "/v1/models", headers=auth(server)).status_code == 200
    assert httpx.get(server.url + "/version").json() == {"version": pasta_engine.__version__}


def test_head_answers_where_get_does_on_the_events_route(app_srv):
    """``HEAD /v1/pasta/events/{id}`` was a 405 although every GET route answers HEAD: now the
    headers only (a live log is not followed), 404 for an unknown id as GET."""
    app, _ = app_srv
    (r,) = asgi(app, ("POST", "/v1/completions", {"json": {"prompt": "hi", "max_tokens": 2}}))
    cid = r.json()["id"]
    get, head, unknown = asgi(app, ("GET", f"/v1/pasta/events/{cid}", {}), ("HEAD", f"/v1/pasta/events/{cid}", {}),
                              ("HEAD", "/v1/pasta/events/cmpl-nope", {}))
    assert get.status_code == 200 and get.text.endswith("data: [DONE]\n\n")
    assert head.status_code == 200 and head.content == b"", head.text
    assert head.headers["content-type"].startswith("text/event-stream")
    assert unknown.status_code == 404


def test_prometheus_metrics_parse(server):
    from prometheus_client.parser import text_string_to_metric_families

    r = httpx.post(server.url + "/v1/chat/completions", headers=auth(server), timeout=60,
                   json={"messages": CHAT["messages"], "stream": True, "pasta": {"annotated_response": ANNOTATED}})
    assert r.status_code == 200
    scrape = httpx.get(server.url + "/metrics")
    assert scrape.status_code == 200 and scrape.headers["content-type"].startswith("text/plain")
    fams = {f.name: f for f in text_string_to_metric_families(scrape.text)}

    def value(name: str, suffix: str = "") -> float:
        return sum(s.value for s in fams[name].samples if s.name == name + suffix)

    for name in ("pasta:num_requests_running", "pasta:num_requests_waiting", "pasta:kv_cache_usage_perc"):
        assert fams[name].type == "gauge" and 0 <= value(name) <= 16
    assert value("pasta:time_to_first_token_seconds", "_count") >= 1
    assert value("pasta:inter_token_latency_seconds", "_count") >= 1
    assert value("pasta:e2e_request_latency_seconds", "_count") >= 1
    assert value("pasta:generation_tokens", "_total") > 0 and value("pasta:prompt_tokens", "_total") > 0
    assert value("pasta:threads_forked", "_total") >= 2  # the replay forks two threads
    assert value("pasta:request_success", "_total") >= 1
    assert value("pasta:content_speedup", "_count") >= 1


def test_a_20mb_message_does_not_freeze_another_stream(open_server):
    """Old: read whole and tokenized on the engine thread: the 400 came after 27 s and another
    user's stream froze for 9.2 s. Now the text is refused before it is tokenized (it cannot fit
    the context) and tokenization never runs on the engine thread."""
    times: list[float] = []
    started = threading.Event()

    def stream() -> None:
        body = {"messages": [{"role": "user", "content": "Go on."}], "stream": True,
                "pasta": {"mode": "sequential", "annotated_response": "Keep going. " * 300}}
        with httpx.stream("POST", open_server.url + "/v1/chat/completions", json=body, timeout=120) as r:
            for _ in r.iter_lines():
                times.append(time.monotonic())
                if len(times) == 5:
                    started.set()
                if len(times) > 3000:
                    break

    t = threading.Thread(target=stream)
    t.start()
    assert started.wait(60)
    big = json.dumps({"messages": [{"role": "user", "content": "word " * 4_000_000}]})  # 20 MB
    sent = time.monotonic()
    r = httpx.post(open_server.url + "/v1/chat/completions", content=big, headers=JSON, timeout=120)
    answered = time.monotonic()
    t.join(120)
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text[:300]
    assert answered - sent < 10
    during = [b - a for a, b in zip(times, times[1:]) if sent <= b <= answered + 0.5]
    assert during and max(during) < 3.0  # the other stream kept flowing


def test_prompts_are_tokenized_off_the_engine_thread(app_srv, monkeypatch):
    from pasta_engine.engine import input_processor  # where every API turns text into ids

    seen: list[str] = []
    for name in ("encode_prompt", "encode_text"):
        real = getattr(input_processor, name)
        monkeypatch.setattr(input_processor, name, lambda *a, _real=real, **k: (
            seen.append(threading.current_thread().name), _real(*a, **k))[1])
    r1, r2 = asgi(app_srv[0], ("POST", "/v1/chat/completions", {"json": CHAT}),
                  ("POST", "/v1/completions", {"json": {"prompt": ["ab", "cd"], "max_tokens": 2}}))
    assert r1.status_code == 200 and r2.status_code == 200, (r1.text, r2.text)
    assert len(seen) == 3 and all(n.startswith("pasta-tokenize") for n in seen), seen


def test_event_logs_are_capped_in_bytes(app_srv):
    """Old: the last 256 completions' logs were kept whatever their size (~950 bytes per token)."""
    app, srv = app_srv
    long = {"messages": [{"role": "user", "content": "Go"}],  # a replay's max_tokens: at least its length
            "pasta": {"mode": "sequential", "annotated_response": "Keep going on. " * 400}}
    ids = []
    for _ in range(6):
        (r,) = asgi(app, ("POST", "/v1/chat/completions", {"json": long}))
        assert r.status_code == 200
        ids.append(r.json()["id"])
    cap = max(2**16, srv.log_budget // 4)
    assert srv.log_bytes <= srv.log_budget + cap
    last = srv.logs[ids[-1]]
    assert last.truncated and last.records[-1]["kind"] == "truncated" and last.nbytes <= cap + 1000
    first, newest = asgi(app, ("GET", f"/v1/pasta/events/{ids[0]}", {}), ("GET", f"/v1/pasta/events/{ids[-1]}", {}))
    assert first.status_code == 404 and newest.status_code == 200
    assert '"truncated"' in newest.text and newest.text.endswith("data: [DONE]\n\n")


def test_a_sampled_special_token_leaves_no_text_streamed_or_not(app_srv):
    """``skip_special_tokens`` accepts only true ("special tokens are removed"), but a sampled
    ``<|im_start|>`` (not EOS) was in ``text``, streamed and not. Now its text is left out of
    both, as vLLM does by default (the logprobs still name the token)."""
    app, _ = app_srv
    body = {"prompt": [1] * 8, "max_tokens": 3, "temperature": 0, "logprobs": 0, "skip_special_tokens": True}
    full, streamed = asgi(app, ("POST", "/v1/completions", {"json": body}),
                          ("POST", "/v1/completions", {"json": {**body, "stream": True}}))
    assert full.status_code == streamed.status_code == 200, (full.text, streamed.text)
    choice = full.json()["choices"][0]
    assert "<|im_start|>" in choice["logprobs"]["tokens"]  # the tiny model samples it here
    events = [json.loads(line[6:]) for line in streamed.text.splitlines()
              if line.startswith("data: ") and line != "data: [DONE]"]
    assert "".join(c["text"] for e in events for c in e["choices"]) == choice["text"]
    assert "<|im_start|>" not in choice["text"] and "<|im_start|>" not in choice["pasta"]["annotated_text"]


def test_a_request_of_several_prompts_fails_whole_before_any_is_queued(tiny_llama):
    """With several prompts, prompt 0 was queued (and could decode) before prompt 1 failed its
    KV-cache check, and the error did not say which prompt: now every prompt is checked first,
    nothing is queued, and the error names ``prompt 1``."""
    from pasta_engine import AsyncEngine, Engine
    from pasta_engine.entrypoints.openai.api_server import build_app

    engine = Engine.from_pretrained(tiny_llama, kv_cache_bytes=96 * 2**10, enable_prefix_caching=False)
    queued: list = []
    real = engine.add_inputs
    engine.add_inputs = lambda inputs: (queued.append(inputs.request_id), real(inputs))[1]
    aengine = AsyncEngine(engine)
    try:
        app = build_app(aengine, "tiny")
        long = "hello world " * 400  # fits the context (4096), not this cache (12 pages of 16)
        bad, good = asgi(app, ("POST", "/v1/completions", {"json": {"prompt": ["hi there", long], "max_tokens": 4}}),
                         ("POST", "/v1/completions", {"json": {"prompt": ["hi there", "ho"], "max_tokens": 2}}))
        err = bad.json()["error"]
        assert bad.status_code == 400 and err["param"] == "prompt" and err["code"] == "context_length_exceeded", err
        assert err["message"].startswith("prompt 1: ") and "KV pages" in err["message"], err
        assert good.status_code == 200 and len(good.json()["choices"]) == 2, good.text
        assert len(queued) == 2 and all(q.startswith(good.json()["id"]) for q in queued)  # the bad one queued none
        assert engine.stats()["kv_pages_free"] == engine.stats()["kv_pages_total"]
    finally:
        aengine.shutdown()


# --------------------------------------------------------------------------- /tokenize, /detokenize


def test_tokenize_and_detokenize_as_vllm_names_them(app_srv):
    # issue 31 item 5: vLLM's /tokenize and /detokenize, giving the ids the completions endpoints use
    from pasta_engine.lang.tokenization import encode_text

    app, srv = app_srv
    eng = srv.engine.engine
    msgs = [{"role": "user", "content": "Hi there"}]
    t, chat, seq, d, both, none_, bad_id, wrong_model, extra = asgi(
        app,
        ("POST", "/tokenize", {"json": {"prompt": "Hello world"}}),
        ("POST", "/tokenize", {"json": {"messages": msgs}}),
        ("POST", "/tokenize", {"json": {"messages": msgs, "pasta": {"mode": "sequential"}}}),
        ("POST", "/detokenize", {"json": {"tokens": encode_text(eng.tokenizer, "Hello world")}}),
        ("POST", "/tokenize", {"json": {"prompt": "x", "messages": msgs}}),
        ("POST", "/tokenize", {"json": {}}),
        ("POST", "/detokenize", {"json": {"tokens": [10**8]}}),
        ("POST", "/tokenize", {"json": {"prompt": "x", "model": "other"}}),
        ("POST", "/tokenize", {"json": {"prompt": "x", "add_special_tokens": True}}),
    )
    assert t.status_code == 200, t.text
    body = t.json()
    assert body["tokens"] == encode_text(eng.tokenizer, "Hello world") and body["count"] == len(body["tokens"])
    assert body["max_model_len"] == eng.max_positions
    assert chat.json()["tokens"] == eng.format_prompt(msgs[0]["content"], "pasta")  # the chat endpoint's ids
    assert seq.json()["tokens"] == eng.format_prompt(msgs[0]["content"], "sequential")
    assert chat.json()["tokens"] != seq.json()["tokens"]  # pasta mode's system prompt
    assert d.status_code == 200 and d.json() == {"prompt": "Hello world"}
    for r in (both, none_):  # the rule over the whole body, named by its own words, on the prompt
        err = r.json()["error"]
        assert r.status_code == 400 and err["message"] == "give exactly one of prompt and messages", err
        assert err["param"] == "prompt"
    # an unknown pasta field lists the endpoint's own pasta fields (it listed the completions' ones)
    [odd] = asgi(app, ("POST", "/tokenize", {"json": {"prompt": "x", "pasta": {"max_threads": 2}}}))
    assert odd.status_code == 400 and odd.json()["error"]["param"] == "pasta.max_threads"
    assert odd.json()["error"]["message"].endswith("known fields are mode, dialect"), odd.text
    [chat_odd] = asgi(app, ("POST", "/v1/chat/completions",
                            {"json": {"messages": msgs, "pasta": {"bogus": 1}}}))
    assert chat_odd.status_code == 400 and "known fields are mode, dialect, " in chat_odd.text
    assert bad_id.status_code == 400 and bad_id.json()["error"]["param"] == "tokens"
    assert wrong_model.status_code == 404
    assert extra.status_code == 400 and "add_special_tokens" in extra.text  # not honoured: refused, not ignored


def test_stopping_the_server_ends_open_streams_with_an_error_and_done(tiny_llama):
    """Issue 31 item 10: Ctrl-C or SIGTERM with a stream open cut it with no error event and no
    ``[DONE]``. The serve command's uvicorn server shuts the engine down first: the open stream
    ends with a 503 error event and ``data: [DONE]``, and an open non-streamed request gets a 503."""
    import signal
    import socket

    import uvicorn

    from pasta_engine import AsyncEngine, Engine
    from pasta_engine.entrypoints.openai.api_server import build_app, draining_server

    engine = Engine.from_pretrained(tiny_llama, kv_cache_bytes=16 * 2**20, page_size=4)
    engine.logits_hook = lambda req, tid, row: time.sleep(0.02)  # slow steps: the answers are still open
    aengine = AsyncEngine(engine)
    app = build_app(aengine, "tiny")
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = draining_server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=5), aengine)
    th = threading.Thread(target=lambda: asyncio.run(server.serve(sockets=[sock])), daemon=True)
    th.start()
    url = f"http://127.0.0.1:{port}/v1/completions"
    body = {"prompt": "Tell me a long story.", "max_tokens": 400, "ignore_eos": True}
    try:
        for _ in range(200):
            if server.started:
                break
            time.sleep(0.05)
        plain: dict = {}
        t = threading.Thread(target=lambda: plain.update(r=httpx.post(url, json=body, timeout=60)))
        t.start()
        lines = []
        with httpx.stream("POST", url, json={**body, "stream": True}, timeout=60) as r:
            it = r.iter_lines()
            for line in it:
                if line.startswith("data: {"):
                    lines.append(line)
                    break
            server.handle_exit(signal.SIGTERM, None)  # what uvicorn's signal handler calls
            lines += [line for line in it if line]
        t.join(60)
        events = [json.loads(line[6:]) for line in lines if line.startswith("data: {")]
        assert lines[-1] == "data: [DONE]" and "error" in events[-1], lines[-3:]
        assert "shutting down" in events[-1]["error"]["message"], events[-1]
        assert plain["r"].status_code == 503 and "shutting down" in plain["r"].json()["error"]["message"]
    finally:
        server.should_exit = True
        th.join(30)
        aengine.shutdown()
    assert not th.is_alive()
