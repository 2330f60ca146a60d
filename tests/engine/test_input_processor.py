"""One input processor (issue 32 item 3) and ``SamplingParams.n`` (issue 31).

Every API turns a request into what the engine runs through ``engine/input_processor.py``, and
the stop rule is the engine's: a stop string ends the request as ``stop`` in the step whose
reading-order text holds it, with the same text in the step API, ``Engine.generate``/``replay``,
``AsyncEngine`` and the server (before, the step API refused stop strings, and AsyncEngine
aborted the request and reported it a step later)."""

from __future__ import annotations

import asyncio
import dataclasses
import random
import re

import httpx
import pytest

from pasta_engine import AsyncEngine, Engine, ParameterError, SamplingParams
from pasta_engine.config import MAX_SEED
from pasta_engine.engine.input_processor import InputProcessor, RequestInputs, choice_params

PROMPT = [5, 6, 7, 8]
ANNOTATED = ('Tips: <promise topic="a" tokens="10"/><async>Sleep early and often.</async> and '
             '<promise topic="b" tokens="10"/><async>Walk.</async><sync/> Then the rest of it.')


def _engine(tiny_llama) -> Engine:
    return Engine.from_pretrained(tiny_llama, kv_cache_bytes=16 * 2**20, page_size=4)


@pytest.fixture(scope="module")
def engine(tiny_llama):
    return _engine(tiny_llama)


@pytest.fixture(scope="module")
def served(tiny_llama):
    """An AsyncEngine over an engine of its own (same weights), and the server's app over it."""
    from pasta_engine.entrypoints.openai.api_server import build_app

    aengine = AsyncEngine(_engine(tiny_llama))
    yield aengine, build_app(aengine, "tiny")
    aengine.shutdown()


def _all_free(engine: Engine) -> bool:
    s = engine.stats()
    return s["kv_pages_free"] == s["kv_pages_total"] and s["running"] == s["waiting"] == 0


def _step_api(engine: Engine, params: SamplingParams, mode: str, annotated: str | None):
    rid = engine.add_request(PROMPT, params, mode, annotated_response=annotated)
    outs = []
    while engine.has_unfinished_requests():
        outs += [o for o in engine.step() if o.request_id == rid]
    return outs


async def _async_api(aengine: AsyncEngine, params: SamplingParams, mode: str, annotated: str | None):
    deltas = [o async for o in aengine.generate(PROMPT, params, mode, annotated_response=annotated,
                                                output_kind="delta")]
    final = None
    async for final in aengine.generate(PROMPT, params, mode, annotated_response=annotated):
        pass
    return deltas, final


def _server(app, params: SamplingParams, mode: str, annotated: str | None, stream: bool):
    body = {"prompt": PROMPT, "max_tokens": params.max_new_tokens, "temperature": 0, "stop": list(params.stop),
            "ignore_eos": params.ignore_eos, "stream": stream, "pasta": {"mode": mode}}
    if annotated is not None:
        body["pasta"]["annotated_response"] = annotated

    async def main():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test",
                                     timeout=120) as h:
            return await h.post("/v1/completions", json=body)

    r = asyncio.run(main())
    assert r.status_code == 200, r.text
    if not stream:
        (c,) = r.json()["choices"]
        return c["text"], c["finish_reason"], c.get("stop_reason"), c["pasta"]["stats"]["tokens_decoded"]
    import json

    chunks = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
    text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
    last = next(c["choices"][0] for c in reversed(chunks) if c["choices"] and c["choices"][0]["finish_reason"])
    return text, last["finish_reason"], last.get("stop_reason"), last["pasta"]["stats"]["tokens_decoded"]


def _cases(engine: Engine):
    """(name, params, mode, annotated response, the text it must end as, the stop string)."""
    base = SamplingParams(max_new_tokens=40, ignore_eos=True)
    [full] = engine.generate([PROMPT], base, mode="sequential")
    stop = full.text[len(full.text) // 3 : len(full.text) // 3 + 3]
    cut = full.text[: full.text.index(stop)]
    rp = SamplingParams(max_new_tokens=200)
    return [
        ("sequential", dataclasses.replace(base, stop=(stop, "never-in-it")), "sequential", None, cut, stop),
        # in chunk 1: the request ends at once, while the main thread and chunk 2 still decode
        ("first chunk", dataclasses.replace(rp, stop=("often",)), "pasta", ANNOTATED, "Tips: Sleep early and ", "often"),
        # in chunk 2, written while chunk 1 still decodes: it ends when chunk 1 has
        ("later chunk", dataclasses.replace(rp, stop=("Walk",)), "pasta", ANNOTATED,
         "Tips: Sleep early and often. and ", "Walk"),
        ("main thread", dataclasses.replace(rp, stop=("rest",)), "pasta", ANNOTATED,
         "Tips: Sleep early and often. and Walk. Then the ", "rest"),
    ]


def test_stop_strings_end_as_stop_with_the_same_text_in_every_api(engine, served):
    aengine, app = served
    for name, params, mode, annotated, want, stop in _cases(engine):
        if annotated is None:
            [gen] = engine.generate([PROMPT], params, mode=mode)
        else:
            [gen] = engine.replay([PROMPT], [annotated], mode=mode, params=params)
        assert (gen.text, gen.stats.finish_reason, gen.stop_reason) == (want, "stop", stop), name
        assert gen.annotated_text and stop not in gen.text
        decoded = gen.stats.tokens_decoded
        assert _all_free(engine)

        outs = _step_api(engine, params, mode, annotated)  # the step API (it refused stop strings before)
        final = outs[-1]
        assert (final.text, final.finish_reason, final.stop_reason) == (want, "stop", stop), name
        assert "".join(o.delta_text for o in outs) == want and all(not o.finished for o in outs[:-1])
        # ended in the step that sampled the token completing the stop string: that step's output is the last
        assert final.new_token_ids and final.stats.tokens_decoded == decoded, name
        assert final.events[-1].kind == "finish" and final.events[-1].reason == "stop"
        assert all(o.text == want[: len(o.text)] for o in outs)  # never more than the cut text
        assert _all_free(engine)

        deltas, cum = asyncio.run(_async_api(aengine, params, mode, annotated))
        assert (cum.text, cum.finish_reason, cum.stop_reason) == (want, "stop", stop), name
        assert "".join(o.text for o in deltas) == want and deltas[-1].finish_reason == "stop"
        assert cum.result.text == want and cum.stats.tokens_decoded == decoded
        assert cum.outputs[0].text == want and cum.outputs[0].stop_reason == stop

        for stream in (False, True):
            got = _server(app, params, mode, annotated, stream)
            assert got == (want, "stop", stop, decoded), (name, stream)


def test_n_completions_per_prompt_as_vllm_returns_them(engine):
    sampled = SamplingParams(max_new_tokens=8, temperature=1.0, n=3)
    res = engine.generate([PROMPT, [9, 10, 11]], sampled, mode="sequential")
    assert len(res) == 2 and all(len(r.outputs) == 3 for r in res)
    assert [o.index for o in res[0].outputs] == [0, 1, 2]
    assert len({tuple(o.token_ids) for o in res[0].outputs}) > 1  # each its own fresh seed: they differ
    assert res[0].text == res[0].outputs[0].text and res[0].outputs[0].result.stats.tokens_decoded > 0
    # a set seed: completion i has seed + i (reproducible, and each equals a lone request with that seed)
    seeded = engine.generate([PROMPT], dataclasses.replace(sampled, seed=MAX_SEED - 1), mode="sequential")[0]
    alone = [engine.generate([PROMPT], dataclasses.replace(sampled, n=1, seed=s), mode="sequential")[0]
             for s in (MAX_SEED - 1, MAX_SEED, 0)]
    assert [o.token_ids for o in seeded.outputs] == [a.token_ids for a in alone]
    # greedy: n equal completions (vLLM's too); n=1 is the result itself
    greedy = engine.generate([PROMPT], SamplingParams(max_new_tokens=6, n=2), mode="sequential")[0]
    assert greedy.outputs[0].token_ids == greedy.outputs[1].token_ids
    one = engine.generate([PROMPT], SamplingParams(max_new_tokens=6), mode="sequential")[0]
    assert len(one.outputs) == 1 and one.outputs[0].result is one and "choices" not in one.to_dict()
    # to_dict: each completion follows the same rule (its trace fields only with include_trace)
    trace = ("positions", "threads", "prompt_ids", "choices")
    assert all(not any(k in c for k in trace) for c in res[0].to_dict()["choices"])
    assert all("positions" in c for c in res[0].to_dict(include_trace=True)["choices"])
    assert _all_free(engine)


def test_n_is_refused_where_a_request_is_one_completion(engine, served):
    with pytest.raises(ParameterError) as e:
        SamplingParams(n=0)
    assert e.value.param == "n"
    with pytest.raises(ParameterError) as e:
        engine.add_request(PROMPT, SamplingParams(n=2))
    assert e.value.param == "n" and "generate" in str(e.value) and not engine.has_unfinished_requests()

    async def add():
        await served[0].add_request(PROMPT, SamplingParams(n=2))

    with pytest.raises(ParameterError) as e:
        asyncio.run(add())
    assert e.value.param == "n"


@pytest.mark.parametrize("name, value", [("temperature", 0.8), ("seed", 5), ("repetition_penalty", 1.3), ("n", 2)])
def test_every_api_refuses_what_a_replay_cannot_honour(engine, served, name, value):
    """A replay forces its tokens: the step API and AsyncEngine took a sampling field (or ``n``)
    with ``annotated_response`` and ignored it, while Engine.replay and the server refused it.
    All four refuse it now, naming it, before a KV page is taken; the server still serves a
    replay when its own defaults (``serve --temperature``, ...) are not neutral, since those
    are not the request's."""
    from pasta_engine.entrypoints.openai.api_server import build_app

    params = SamplingParams(**{name: value})
    with pytest.raises(ParameterError) as e:
        engine.add_request(PROMPT, params, annotated_response=ANNOTATED)
    assert e.value.param == name and "cannot apply to a replay (annotated_response" in str(e.value), str(e.value)
    assert _all_free(engine) and not engine.has_unfinished_requests()

    async def add():
        await served[0].add_request(PROMPT, params, annotated_response=ANNOTATED)

    with pytest.raises(ParameterError) as e:
        asyncio.run(add())
    assert e.value.param == name

    app = build_app(served[0], "tiny", defaults=SamplingParams(temperature=0.7, top_p=0.9, repetition_penalty=1.1,
                                                               max_new_tokens=32))

    async def post(body):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test",
                                     timeout=120) as h:
            return await h.post("/v1/completions", json=body)

    replay = {"prompt": PROMPT, "pasta": {"annotated_response": ANNOTATED}}
    refused = asyncio.run(post({**replay, name: value}))
    assert refused.status_code == 400 and refused.json()["error"]["param"] == name, refused.text
    ok = asyncio.run(post(replay))
    assert ok.status_code == 200, ok.text
    [choice] = ok.json()["choices"]
    assert choice["text"] == "Tips: Sleep early and often. and Walk. Then the rest of it."


def test_choice_params_seeds():
    p = SamplingParams(n=3, seed=MAX_SEED)
    assert [c.seed for c in choice_params(p)] == [MAX_SEED, 0, 1] and all(c.n == 1 for c in choice_params(p))
    assert [c.seed for c in choice_params(SamplingParams(n=2))] == [None, None]  # the engine draws each
    drawn = [c.seed for c in choice_params(SamplingParams(n=2), random.Random(3))]
    assert drawn[1] == (drawn[0] + 1) % (MAX_SEED + 1)
    one = SamplingParams()
    assert choice_params(one) == [one]


def test_every_api_tokenizes_through_the_one_processor(engine):
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name two fruits."}]
    proc = engine.input_processor
    assert engine.format_prompt(msgs, "pasta") == proc.format_chat(msgs, "pasta")
    assert engine.format_prompt("Name two fruits.", "sequential") == proc.format_chat(msgs[1:], "sequential")
    assert engine.format_prompt("ab", chat_template=False) == engine.encode("ab")
    # chat messages are a prompt of generate and the step API too
    [a] = engine.generate(msgs, SamplingParams(max_new_tokens=3), mode="sequential")
    assert a.prompt_ids == proc.format_chat(msgs, "sequential")
    # a copy over another tokenizer object gives the same ids (the server's workers)
    import copy

    other = InputProcessor(copy.deepcopy(engine.tokenizer), engine.config, vocab_size=engine.model.config.vocab_size,
                           max_positions=engine.max_positions, eos_ids=engine.eos_ids)
    assert other.tokenize(msgs, "pasta") == proc.tokenize(msgs, "pasta")
    assert other.bytes_per_token == proc.bytes_per_token


def test_request_inputs_and_stop_merging_fail_early():
    for kw, param in ((dict(output_kind="all"), "output_kind"), (dict(chat_template="no"), "chat_template"),
                      (dict(request_id=""), "request_id")):
        with pytest.raises(ParameterError) as e:
            RequestInputs(PROMPT, **kw)
        assert e.value.param == param
    assert InputProcessor.merge_stop(None, "x").stop == ("x",)
    assert InputProcessor.merge_stop(SamplingParams(stop="a"), None).stop == ("a",)
    for bad in ([""], [1]):
        with pytest.raises(ParameterError, match="stop"):
            InputProcessor.merge_stop(None, bad)
    with pytest.raises(ParameterError, match="given twice"):
        InputProcessor.merge_stop(SamplingParams(stop="a"), ["b"])


def test_inline_mode_is_pasta_without_forks_through_the_engine(engine):
    """Inline mode: pasta's prompt and tags, each chunk decoded in place in one thread (the same
    weights sequentially); an unknown mode is refused naming all three."""
    proc = engine.input_processor
    assert proc.tokenize("Name two fruits.", "inline") == proc.tokenize("Name two fruits.", "pasta")
    assert proc.tokenize("Name two fruits.", "inline") != proc.tokenize("Name two fruits.", "sequential")
    with pytest.raises(ParameterError, match="'pasta', 'sequential' or 'inline'") as e:
        engine.add_request(PROMPT, SamplingParams(max_new_tokens=2), mode="fast")
    assert e.value.param == "mode"
    with pytest.raises(ParameterError, match="'multiverse' dialect nests or joins") as e:
        engine.add_request(PROMPT, SamplingParams(max_new_tokens=2), mode="inline", dialect="multiverse")
    assert e.value.param == "mode"
    [pas] = engine.replay([PROMPT], [ANNOTATED], mode="pasta")
    [inl] = engine.replay([PROMPT], [ANNOTATED], mode="inline")
    assert pas.stats.forks == 2 and (inl.stats.forks, inl.stats.threads) == (0, 1)
    assert inl.text == pas.text and inl.annotated_text == pas.annotated_text == ANNOTATED
    assert inl.token_ids == pas.token_ids  # the same tokens in reading order
    assert set(inl.threads) == {0} and inl.positions == list(range(len(PROMPT), len(PROMPT) + len(inl.positions)))
    s = inl.stats
    assert s.decode_steps == s.tokens_decoded == s.critical_path > pas.stats.critical_path
    assert _all_free(engine)


def test_merge_stop_refuses_params_that_are_not_sampling_params():
    """merge_stop (AsyncEngine.add_request's first check) names ``params`` for a bad one, as
    process does without ``stop``, instead of an AttributeError on ``params.stop``."""
    for params in ({"max_new_tokens": 3}, "greedy", 5):
        for stop in (["x"], None):
            with pytest.raises(ParameterError, match="SamplingParams") as e:
                InputProcessor.merge_stop(params, stop)
            assert e.value.param == "params" and e.value.value == params
    assert InputProcessor.merge_stop(None, None) is None


@pytest.mark.parametrize("mode", ["bogus", None, 5, "Pasta"])
def test_tokenize_and_format_chat_refuse_an_unknown_mode(engine, mode):
    """An unknown mode is refused where a prompt is formatted too (Engine.format_prompt,
    format_chat), not taken for pasta."""
    from pasta_engine.engine.async_engine import format_chat

    for call in (lambda: engine.format_prompt("hi", mode=mode),
                 lambda: engine.input_processor.tokenize([{"role": "user", "content": "hi"}], mode),
                 lambda: format_chat(engine, [{"role": "user", "content": "hi"}], mode=mode)):
        with pytest.raises(ParameterError, match="'pasta', 'sequential' or 'inline'") as e:
            call()
        assert e.value.param == "mode" and e.value.value == mode


@pytest.mark.parametrize("message, key, where", [
    ({"role": "user", "content": "hi", "name": "bob"}, "name", "messages[1]: key 'name'"),
    ({"role": "user", "content": "hi", "tool_call_id": "t1"}, "tool_call_id", "messages[1]: key 'tool_call_id'"),
    ({"role": "assistant", "content": "hi", "tool_calls": []}, "tool_calls", "messages[1]: key 'tool_calls'"),
    ({"role": "user", "content": [{"type": "text", "text": "hi", "cache_control": {"type": "ephemeral"}}]},
     "cache_control", "messages[1]: content part 0: key 'cache_control'"),
])
def test_format_chat_refuses_message_keys_it_does_not_honour(engine, message, key, where):
    """A chat message has role and content, a text part type and text: any other key is refused
    (naming the message and the key), never dropped from the prompt without a word."""
    messages = [{"role": "system", "content": "Be brief."}, message, {"role": "user", "content": "hi"}]
    for call in (lambda: engine.input_processor.format_chat(messages),
                 lambda: engine.add_request(messages, SamplingParams(max_new_tokens=2))):
        with pytest.raises(ParameterError, match=re.escape(where)) as e:
            call()
        assert e.value.param == "messages" and key in str(e.value)
    assert not engine.has_unfinished_requests()
    plain = [{"role": "user", "content": "hi"}]
    parts = [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]
    assert engine.input_processor.format_chat(parts) == engine.input_processor.format_chat(plain)
