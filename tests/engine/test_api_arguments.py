"""Every bad argument of the Python API is a ParameterError (a ValueError naming the parameter
and its value) raised before anything runs, and the step API keeps one output per request id
(issue 20)."""

from __future__ import annotations

import pytest

from pasta_engine import Engine, ParameterError, SamplingParams
from pasta_engine.errors import CheckpointError


@pytest.mark.parametrize("kwargs, param", [
    (dict(model=5), "model"),
    (dict(adapter=5), "adapter"),
    (dict(tokenizer="/nonexistent"), "tokenizer"),
    (dict(tokenizer=5), "tokenizer"),
    (dict(kv_cache_bytes=2**62), "kv_cache_bytes"),
    (dict(threads=2**31), "threads"),  # past a C int: torch.set_num_threads would fail, naming nothing
    (dict(threads=4097), "threads"),
])
def test_from_pretrained_names_a_bad_argument(tiny_llama, kwargs, param):
    kwargs = {"model": tiny_llama, **kwargs}
    with pytest.raises(ParameterError) as e:
        Engine.from_pretrained(**kwargs)
    assert isinstance(e.value, ValueError) and e.value.param == param
    assert str(kwargs[param]) in str(e.value) or param == "kv_cache_bytes"


def test_a_tokenizer_path_without_a_tokenizer_is_named(tiny_llama, tmp_path):
    with pytest.raises(CheckpointError, match="cannot read the tokenizer at") as e:
        Engine.from_pretrained(tiny_llama, tokenizer=tmp_path)  # a folder with no tokenizer in it
    assert e.value.param == "tokenizer"
    engine = Engine.from_pretrained(tiny_llama, tokenizer=tiny_llama, kv_cache_bytes=2**20)  # a good path works
    assert engine.encode("hi")


def test_a_kv_cache_larger_than_the_machine_is_refused_before_it_is_allocated(tiny_engine):
    with pytest.raises(ParameterError, match="is more than this machine's memory") as e:
        Engine(tiny_engine.model, tiny_engine.tokenizer, tiny_engine.hf_config, kv_cache_bytes=99999999 * 2**20)
    assert "--kv-cache-mb" in str(e.value)


@pytest.mark.parametrize("responses", [[None], [5], None, b"abc"])
def test_replay_refuses_a_response_that_is_not_text(tiny_engine, responses):
    steps = tiny_engine.stats()["steps"]
    with pytest.raises(ParameterError) as e:
        tiny_engine.replay(["a"], responses)
    assert e.value.param == "annotated_responses"
    assert tiny_engine.stats()["steps"] == steps and not tiny_engine.has_unfinished_requests()


@pytest.mark.parametrize("call", ["generate", "replay"])
@pytest.mark.parametrize("progress", ["no", 1, None])
def test_progress_that_is_not_a_bool_is_refused(tiny_engine, call, progress):
    """``generate(progress="no")`` drew a bar (any non-empty string is truthy): it is refused."""
    steps = tiny_engine.stats()["steps"]
    args = (["a"],) if call == "generate" else (["a"], ["b"])
    with pytest.raises(ParameterError) as e:
        getattr(tiny_engine, call)(*args, progress=progress)
    assert e.value.param == "progress" and repr(progress) in str(e.value)
    assert tiny_engine.stats()["steps"] == steps and not tiny_engine.has_unfinished_requests()


def test_an_aborted_id_is_refused_until_step_reports_the_abort(tiny_llama):
    """vLLM refuses the id of a request it still tracks; an aborted request is tracked until its
    final output is returned, so the id cannot give two outputs in one step."""
    engine = Engine.from_pretrained(tiny_llama, kv_cache_bytes=2**20)
    engine.add_request([5, 6, 7], SamplingParams(max_new_tokens=4), request_id="r")
    assert engine.abort("r")
    with pytest.raises(ParameterError, match="'r' is already in use") as e:
        engine.add_request([8, 9], SamplingParams(max_new_tokens=4), request_id="r")
    assert e.value.param == "request_id"
    outs = engine.step()
    assert [(o.request_id, o.finish_reason) for o in outs] == [("r", "abort")]
    engine.add_request([8, 9], SamplingParams(max_new_tokens=4), request_id="r")  # reported: free again
    finals = []
    while engine.has_unfinished_requests():
        finals += [o for o in engine.step() if o.finished]
    assert [o.request_id for o in finals] == ["r"] and finals[0].finish_reason == "length"
    for bad in (["r"], None, 3):  # a list raised TypeError (unhashable) from inside abort
        with pytest.raises(ParameterError, match="request_id") as e:
            engine.abort(bad)
        assert e.value.param == "request_id"


def test_check_threads_bounds():
    """``threads``: "auto", None or 1 to MAX_THREADS; anything else names ``threads`` and says
    what is allowed (before the engine is built)."""
    from pasta_engine.worker.cpu_threads import MAX_THREADS, check_threads

    for ok in ("auto", None, 1, MAX_THREADS):
        check_threads(ok)
    for bad in (0, -1, MAX_THREADS + 1, 2**31, 2**63, True, 2.0, "4"):
        with pytest.raises(ParameterError, match=f"an integer from 1 to {MAX_THREADS}") as e:
            check_threads(bad)
        assert e.value.param == "threads" and e.value.value == bad


#: Sampling fields a replay cannot honour (its tokens are forced), each set away from its default.
_UNHONOURED_IN_A_REPLAY = [("temperature", 0.8), ("top_p", 0.5), ("top_k", 3), ("min_p", 0.1),
                           ("presence_penalty", 1.0), ("frequency_penalty", -1.0), ("repetition_penalty", 1.3),
                           ("min_tokens", 2), ("ignore_eos", True), ("stop_token_ids", (7,)), ("seed", 5)]


@pytest.mark.parametrize("name, value", _UNHONOURED_IN_A_REPLAY + [("n", 2)])
def test_replay_refuses_a_sampling_field_it_would_ignore(tiny_engine, name, value):
    """A replay forces its tokens, so a field that acts only where a token is sampled was
    silently ignored; it is refused, naming the field and its value and how to fix it, before
    any request is queued or takes a KV page. One per prompt too, naming which."""
    stats = tiny_engine.stats()
    for params in (SamplingParams(**{name: value}), [SamplingParams(), SamplingParams(**{name: value})]):
        prompts = ["a"] if isinstance(params, SamplingParams) else ["a", "b"]
        with pytest.raises(ParameterError) as e:
            tiny_engine.replay(prompts, ["x y"] * len(prompts), params=params)
        shown = repr(list(value) if isinstance(value, tuple) else value)
        assert e.value.param == name and f"{name}={shown} cannot apply to a replay" in str(e.value), str(e.value)
        assert "leave" in str(e.value) and ("params 1" in str(e.value)) == (len(prompts) == 2)
    after = tiny_engine.stats()
    assert (after["steps"], after["kv_pages_free"]) == (stats["steps"], stats["kv_pages_free"])
    assert not tiny_engine.has_unfinished_requests()


def test_replay_takes_the_fields_it_honours_and_the_neutral_values(tiny_engine):
    """What a replay honours (``return_logprobs``/``logprobs=0``, ``stop``, ``max_new_tokens``,
    raised to the replay's length) and every sampling field at a value that asks for nothing."""
    ann = 'A <promise topic="t" tokens="10"/><async>b c</async> d'
    [ref] = tiny_engine.replay(["hi"], [ann])
    neutral = SamplingParams(temperature=0.0, top_p=1.0, top_k=0, min_p=0.0, repetition_penalty=1.0,
                             presence_penalty=0.0, frequency_penalty=0.0, min_tokens=0, ignore_eos=False,
                             stop_token_ids=(), seed=None, n=1, max_new_tokens=1, logprobs=0)
    [r] = tiny_engine.replay(["hi"], [ann], params=neutral)
    assert r.token_ids == ref.token_ids and r.stats.finish_reason == "stop"
    assert r.logprobs is not None and any(lp is not None for lp in r.logprobs)
    [cut] = tiny_engine.replay(["hi"], [ann], params=SamplingParams(stop=("d",)))
    assert cut.stats.finish_reason == "stop" and cut.stop_reason == "d"


def test_the_server_and_replay_refuse_the_same_fields(tiny_engine):
    """One rule (pasta_engine.core.replay.REPLAY_UNUSED_FIELDS) for both APIs: each field the
    server refuses with pasta.annotated_response, Engine.replay refuses too, and the reverse."""
    from pasta_engine.core.replay import REPLAY_UNUSED_FIELDS
    from pasta_engine.entrypoints.openai.schema import CompletionRequest, parse_request

    assert {name for name, _ in _UNHONOURED_IN_A_REPLAY} == set(REPLAY_UNUSED_FIELDS)
    for name, value in _UNHONOURED_IN_A_REPLAY:
        body = {"prompt": [5, 6], "pasta": {"annotated_response": "x y"},
                name: list(value) if isinstance(value, tuple) else value}
        with pytest.raises(ParameterError) as server:
            parse_request(CompletionRequest, body)
        with pytest.raises(ParameterError) as python:
            tiny_engine.replay([[5, 6]], ["x y"], params=SamplingParams(**{name: value}))
        assert server.value.param == python.value.param == name
        assert "cannot apply to a replay (pasta.annotated_response" in str(server.value)
        del body["pasta"]
        parse_request(CompletionRequest, body)  # outside a replay the field is the server's to honour


def test_from_pretrained_reads_the_checkpoint_config_once(tiny_llama, monkeypatch):
    """The KV budget check before the weights load reads config.json, and the load reuses that
    config instead of reading the file again (transformers' own reads inside its model and
    tokenizer loaders are not pasta-engine's, so not counted)."""
    import sys

    from transformers import AutoConfig

    read = AutoConfig.from_pretrained
    calls = []

    def counting(*args, **kwargs):
        if sys._getframe(1).f_globals.get("__name__", "").startswith("pasta_engine."):
            calls.append(args[0] if args else kwargs)
        return read(*args, **kwargs)

    monkeypatch.setattr(AutoConfig, "from_pretrained", counting)
    engine = Engine.from_pretrained(tiny_llama, kv_cache_bytes=2**20)
    assert len(calls) == 1, calls
    assert engine.hf_config.vocab_size == engine.model.config.vocab_size and engine.encode("hi")
