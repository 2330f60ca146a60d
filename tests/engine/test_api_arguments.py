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
