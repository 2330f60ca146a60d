"""vLLM's sampling fields through the server (issue 20): passed to SamplingParams, which
validates them (one set of rules with the Python API) and the engine honours; a bad value is a
400 naming the field. A real ``pasta-engine serve`` process (the ``server`` fixture) and, for
the tokens to expect, the Python API over the same checkpoint."""

from __future__ import annotations

import httpx
import pytest

PROMPT = [5, 6, 7, 5, 6, 7, 8]
BASE = {"prompt": PROMPT, "temperature": 0, "pasta": {"mode": "sequential"}}


def _post(server, body, path="/v1/completions"):
    return httpx.post(server.url + path, json=body, headers={"Authorization": f"Bearer {server.api_key}"},
                      timeout=120)


def _ok(server, **kw):
    r = _post(server, {**BASE, **kw})
    assert r.status_code == 200, r.text
    return r.json()


@pytest.fixture(scope="module")
def greedy_ids(tiny_llama):
    """The greedy response's token ids for PROMPT (EOS masked), from the Python API."""
    from pasta_engine import Engine, SamplingParams

    engine = Engine.from_pretrained(tiny_llama, kv_cache_bytes=8 * 2**20)
    [res] = engine.generate([PROMPT], SamplingParams(max_new_tokens=16, ignore_eos=True), mode="sequential")
    return res.token_ids


def test_ignore_eos_with_max_tokens_gives_exactly_max_tokens_tokens(server):
    for n in (1, 7, 20):
        out = _ok(server, max_tokens=n, ignore_eos=True)
        assert out["usage"]["completion_tokens"] == n and out["choices"][0]["finish_reason"] == "length"


def test_stop_token_ids_end_the_response(server, greedy_ids):
    i = next(k for k in range(2, len(greedy_ids)) if greedy_ids[k] not in greedy_ids[:k])
    out = _ok(server, max_tokens=16, stop_token_ids=[greedy_ids[i]])
    assert out["choices"][0]["finish_reason"] == "stop"
    assert out["usage"]["completion_tokens"] == i + 1  # the stop token is sampled (and left out of the text)
    full = _ok(server, max_tokens=16, ignore_eos=True)["choices"][0]["text"]
    assert full.startswith(out["choices"][0]["text"])
    # min_tokens holds it back
    held = _ok(server, max_tokens=16, stop_token_ids=[greedy_ids[i]], min_tokens=i + 2)
    assert held["usage"]["completion_tokens"] >= i + 2


def test_penalties_and_min_p_change_or_keep_greedy_output_as_they_should(server):
    plain = _ok(server, max_tokens=20, ignore_eos=True)["choices"][0]["text"]
    for field, value in (("presence_penalty", 2.0), ("frequency_penalty", 2.0), ("repetition_penalty", 2.0)):
        got = _ok(server, max_tokens=20, ignore_eos=True, **{field: value})["choices"][0]["text"]
        assert got != plain, field
    # min_p=1 keeps only the top token: sampling equals greedy
    top = _ok(server, max_tokens=20, ignore_eos=True, temperature=1.0, min_p=1.0, seed=3)["choices"][0]["text"]
    assert top == plain


@pytest.mark.parametrize("body, param", [
    ({"min_tokens": 30, "max_tokens": 5}, "min_tokens"),  # SamplingParams' rule
    ({"stop_token_ids": [2**30]}, "stop_token_ids"),  # outside the vocabulary (the engine's check)
    ({"stop_token_ids": [-1]}, "stop_token_ids"),
    ({"min_p": 1.5}, "min_p"),
    ({"presence_penalty": -2.5}, "presence_penalty"),
    ({"frequency_penalty": "1"}, "frequency_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"ignore_eos": "yes"}, "ignore_eos"),
    ({"min_tokens": -1}, "min_tokens"),
])
def test_a_bad_sampling_value_is_a_400_naming_the_field(server, body, param):
    for path, extra in (("/v1/completions", {}), ("/v1/chat/completions", {"messages": [{"role": "user",
                                                                                          "content": "Hi"}]})):
        req = {**BASE, **body, **extra}
        if extra:
            del req["prompt"]
        r = _post(server, req, path)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == param and err["type"] == "invalid_request_error", err


REPLAY = {"prompt": PROMPT, "pasta": {"annotated_response": 'A <promise topic="t" tokens="10"/><async>b c</async> d'}}


@pytest.mark.parametrize("body, param", [
    ({"temperature": 0.8}, "temperature"), ({"top_p": 0.5}, "top_p"), ({"top_k": 3}, "top_k"),
    ({"min_p": 0.1}, "min_p"), ({"repetition_penalty": 1.3}, "repetition_penalty"),
    ({"presence_penalty": 1.0}, "presence_penalty"), ({"ignore_eos": True}, "ignore_eos"),
    ({"min_tokens": 5}, "min_tokens"), ({"stop_token_ids": [7]}, "stop_token_ids"), ({"seed": 5}, "seed"),
])
def test_a_sampling_field_with_a_replay_is_refused_not_ignored(server, body, param):
    """A replay's tokens are forced: a field that acts only where tokens are sampled (a seed
    too: it only draws samples) would be ignored there, so it is a 400 naming it; the values
    that ask for nothing (greedy, no filter, no penalty) are fine."""
    r = _post(server, {**REPLAY, **body})
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    assert "cannot apply to a replay" in r.json()["error"]["message"]
    ok = _post(server, {**REPLAY, "temperature": 0, "top_p": 1, "top_k": -1, "repetition_penalty": 1})
    assert ok.status_code == 200 and ok.json()["choices"][0]["text"] == "A b c d", ok.text


def test_events_and_a_negative_seed_are_refused_where_they_cannot_act(server):
    r = _post(server, {**BASE, "pasta": {"mode": "sequential", "events": True}})  # events stream: stream=true only
    assert r.status_code == 400 and r.json()["error"]["param"] == "pasta.events", r.text
    r = _post(server, {**BASE, "seed": -5})
    assert r.status_code == 400 and r.json()["error"]["param"] == "seed", r.text


def test_openapi_describes_the_honoured_fields(server):
    doc = httpx.get(server.url + "/openapi.json", headers={"Authorization": f"Bearer {server.api_key}"}).json()
    props = doc["components"]["schemas"]["ChatCompletionRequest"]["properties"]
    for name in ("min_p", "presence_penalty", "frequency_penalty", "repetition_penalty", "min_tokens", "ignore_eos",
                 "stop_token_ids"):
        assert "does not implement" not in props[name]["description"], name
    assert "does not implement" in props["include_stop_str_in_output"]["description"]


def test_a_replay_refuses_a_max_tokens_below_its_length(server):
    """A replay forces its whole response (the engine raises a smaller budget to its length):
    ``max_tokens`` (or ``max_completion_tokens``) below it was ignored (200, the whole text); now
    a 400 naming the field, streamed or not, before anything is queued. A budget that covers
    the replay, or none, is served."""
    before = _post(server, {**REPLAY})
    assert before.status_code == 200, before.text
    need = before.json()["usage"]["completion_tokens"]
    chat = {"messages": [{"role": "user", "content": "Hi"}], "pasta": REPLAY["pasta"]}
    for path, body, param in (("/v1/completions", {**REPLAY, "max_tokens": 2}, "max_tokens"),
                              ("/v1/completions", {**REPLAY, "max_tokens": 2, "stream": True}, "max_tokens"),
                              ("/v1/chat/completions", {**chat, "max_completion_tokens": 3}, "max_completion_tokens")):
        r = _post(server, body, path)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == param and "below the replay's length" in err["message"], err
    ok = _post(server, {**REPLAY, "max_tokens": 4 * need + 8})
    assert ok.status_code == 200 and ok.json()["choices"][0]["text"] == "A b c d", ok.text


def test_a_replay_takes_a_max_tokens_at_its_length(server):
    """The bar is the tokens the replay samples (``usage.completion_tokens``): a ``max_tokens``
    at it or a little above is served whole (the bar was the reading-order stream plus one, so a
    replay of 46 tokens refused 46 to 48); one below is refused, naming the field and value."""
    need = _post(server, {**REPLAY}).json()["usage"]["completion_tokens"]
    for value in (need, need + 1, need + 2):
        r = _post(server, {**REPLAY, "max_tokens": value})
        assert r.status_code == 200, (value, r.text)
        c = r.json()["choices"][0]
        assert (c["text"], c["finish_reason"], r.json()["usage"]["completion_tokens"]) == ("A b c d", "stop", need)
    r = _post(server, {**REPLAY, "max_tokens": need - 1})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "max_tokens" and f"max_tokens={need - 1} is below" in err["message"], err
    assert f"at least {need}" in err["message"], err


def test_stop_reason_is_always_there_and_names_a_stop_token(server, greedy_ids):
    """vLLM's ``stop_reason``: the id of the ``stop_token_ids`` token that ended the response
    (it was missing), the stop string that ended it, or null (the key is always there),
    streamed and not."""
    import json

    i = next(k for k in range(2, len(greedy_ids)) if greedy_ids[k] not in greedy_ids[:k])
    stop_id = greedy_ids[i]
    for body, reason in (({"max_tokens": 16, "stop_token_ids": [stop_id]}, stop_id),
                         ({"max_tokens": 3, "ignore_eos": True}, None)):
        c = _ok(server, **body)["choices"][0]
        assert "stop_reason" in c and c["stop_reason"] == reason, c
        r = _post(server, {**BASE, **body, "stream": True})
        chunks = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
        assert all("stop_reason" in ch for e in chunks for ch in e["choices"])
        assert [ch["stop_reason"] for e in chunks for ch in e["choices"] if ch["finish_reason"]] == [reason]
    text = _ok(server, max_tokens=16, ignore_eos=True)["choices"][0]["text"]
    stop = text[2:5]
    c = _ok(server, max_tokens=16, ignore_eos=True, stop=[stop])["choices"][0]
    assert c["finish_reason"] == "stop" and c["stop_reason"] == stop, c
