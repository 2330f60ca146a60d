"""Every option is validated where it is built, naming the field and the value."""

from __future__ import annotations

import math

import pytest

from pasta_engine import EngineConfig, Limits, ParameterError, PositionPolicy, SamplingParams
from pasta_engine.config import GREEDY_TEMPERATURE, MAX_SEED


@pytest.mark.parametrize(
    "field, value",
    [
        ("max_new_tokens", True),  # a bool is not a count
        ("max_new_tokens", 0),
        ("max_new_tokens", 2.0),
        ("max_new_tokens", "8"),
        ("temperature", -1.0),
        ("temperature", math.nan),
        ("temperature", math.inf),
        ("temperature", "0.5"),
        ("temperature", None),
        ("temperature", 10**400),  # beyond float range: it raised OverflowError (issue 31 item 10)
        ("repetition_penalty", -(10**400)),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("top_p", True),
        ("top_k", True),
        ("top_k", -1),
        ("top_k", 3.0),
        ("seed", 2**70),
        ("seed", MAX_SEED + 1),
        ("seed", -1),
        ("seed", 1.5),
        ("seed", False),
        ("return_logprobs", "no"),
        ("return_logprobs", 1),
        ("return_logprobs", None),
    ],
)
def test_sampling_params_reject_bad_values_naming_the_field(field, value):
    with pytest.raises(ParameterError, match=f"invalid {field}=") as e:
        SamplingParams(**{field: value})
    assert e.value.param == field
    assert isinstance(e.value, ValueError)  # callers that catch ValueError keep working


def test_sampling_params_accept_the_edges():
    assert SamplingParams(seed=MAX_SEED).seed == MAX_SEED
    assert SamplingParams(top_p=1.0, top_k=0, temperature=0).greedy
    assert SamplingParams(temperature=1e-45).greedy  # below 1e-5: greedy, as vLLM, never a NaN softmax
    assert SamplingParams(temperature=GREEDY_TEMPERATURE * 2).greedy is False
    assert SamplingParams(temperature=1).temperature == 1  # an int temperature is a number
    # with both lengths given, a bad max_new_tokens is named, not the max_tokens it "disagrees" with
    with pytest.raises(ParameterError, match="invalid max_new_tokens='5'"):
        SamplingParams(max_new_tokens="5", max_tokens=5)
    # a numpy integer seed is an int to the sampler (torch's generator refused it mid-request)
    np = pytest.importorskip("numpy")
    seed = SamplingParams(seed=np.int64(7)).seed
    assert type(seed) is int and seed == 7
    assert Limits(cap_factor=1e6, max_promise_tokens=2**31 - 1).chunk_cap(10) == 10**7


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"max_threads": 0}, "max_threads"),
        ({"max_threads": True}, "max_threads"),
        ({"max_forks": -1}, "max_forks"),
        ({"async_min_cap": 0}, "async_min_cap"),
        ({"cap_factor": math.nan}, "cap_factor"),
        ({"cap_factor": 0}, "cap_factor"),
        ({"max_promise_tokens": -3}, "max_promise_tokens"),
        ({"cap_factor": 10**400}, "cap_factor"),
        ({"fork_threshold": 10**400}, "fork_threshold"),
        # accepted before, then overflowed in chunk_cap inside a step, failing every request in it
        ({"cap_factor": 1e308}, "cap_factor"),
        ({"max_promise_tokens": 10**400}, "max_promise_tokens"),
    ],
)
def test_limits_reject_bad_values(kwargs, field):
    with pytest.raises(ParameterError, match=f"invalid {field}="):
        Limits(**kwargs)


@pytest.mark.parametrize("spec", ["constant:x", "constant:-1", "fast", 3, None, "constant:", "constant:\u00b2",
                                  "constant:" + "9" * 5000])
def test_position_policy_names_the_bad_spec(spec):
    with pytest.raises(ParameterError, match="position_policy"):
        PositionPolicy.parse(spec)


def test_a_position_policy_refuses_a_constant_it_would_ignore_or_not_parse_back():
    with pytest.raises(ParameterError, match="takes no constant"):
        PositionPolicy("predicted", constant=500)  # behaved as constant=0
    with pytest.raises(ParameterError, match="position_policy constant"):
        PositionPolicy("constant", 10**12)  # str() gave "constant:1000000000000", which parse refuses
    assert PositionPolicy.parse(str(PositionPolicy("constant", 10**9 - 1))).constant == 10**9 - 1


def test_position_policy_parses_every_kind():
    assert str(PositionPolicy.parse(" Constant:7 ")) == "constant:7"
    assert PositionPolicy.parse("oracle").kind == "oracle"
    p = PositionPolicy.parse("none")
    assert PositionPolicy.parse(p) is p


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"max_running_requests": 0}, "max_running_requests"),
        ({"max_running_requests": True}, "max_running_requests"),
        ({"page_size": 0}, "page_size"),
        ({"page_size": 4096}, "page_size"),
        ({"kv_cache_bytes": 0}, "kv_cache_bytes"),
        ({"kv_cache_bytes": 1.5}, "kv_cache_bytes"),
        ({"limits": {"max_threads": 4}}, "limits"),
        ({"position_policy": "sideways"}, "position_policy"),
        ({"cuda_graphs": "yes"}, "cuda_graphs"),
        ({"prompt_special_tokens": "maybe"}, "prompt_special_tokens"),
        ({"attention_backend": ""}, "attention_backend"),
    ],
)
def test_engine_config_rejects_bad_settings_at_construction(kwargs, field):
    with pytest.raises(ParameterError, match=field) as e:
        EngineConfig(**kwargs)
    assert e.value.param == field


def test_unknown_engine_options_are_named():
    with pytest.raises(ParameterError, match="unknown engine option 'page_sise'"):
        EngineConfig.from_kwargs(page_sise=4)
    assert EngineConfig.from_kwargs(page_size=4).page_size == 4
    assert EngineConfig(position_policy="constant:3").position_policy == PositionPolicy("constant", 3)


def test_grammar_knobs_are_the_fields_set_away_from_off():
    from pasta_engine.config import Limits

    assert Limits().grammar_knobs() == {}
    assert Limits(fork_threshold=0.3).grammar_knobs() == {"fork_threshold": 0.3}
    assert Limits(fork_threshold=0.3, independent_topics=True).grammar_knobs() == {"fork_threshold": 0.3,
                                                                                   "independent_topics": True}
    # each knob's off value is its field's default, and the table cannot be changed at run time
    assert all(getattr(Limits(), name) == off for name, off in Limits.GRAMMAR_KNOBS.items())
    with pytest.raises(TypeError):
        Limits.GRAMMAR_KNOBS["fork_threshold"] = 0.5  # type: ignore[index]


@pytest.mark.parametrize("value", ["nope", 5, object(), "Torch"])
def test_an_unknown_attention_backend_is_refused_by_the_check_before_loading(value):
    """``check_attention_backend`` (which ``Engine.from_pretrained`` calls before any weight
    loads; it was refused only by the model runner, after the load) refuses what no backend
    registry entry or instance is, naming the known backends."""
    from pasta_engine.worker.model_runner import check_attention_backend

    with pytest.raises(ParameterError, match=r"attention_backend=.*'torch', 'triton', 'flex'.*backend instance") as e:
        check_attention_backend(value)
    assert e.value.param == "attention_backend"


def test_a_known_attention_backend_name_or_instance_is_taken():
    from pasta_engine.layers.reference_attention import TorchAttention

    from pasta_engine.worker.model_runner import check_attention_backend

    for name in ("torch", "triton", "flex"):  # checked by name: no backend module is imported for it
        check_attention_backend(name)
        assert EngineConfig(attention_backend=name).attention_backend == name
    inst = TorchAttention()
    check_attention_backend(inst)
    assert EngineConfig(attention_backend=inst).attention_backend is inst


@pytest.mark.parametrize("spec", ["constant:1000000000", "constant:-1", "sideways", 7])
def test_a_bad_position_policy_states_the_range_of_k(spec):
    with pytest.raises(ParameterError, match=r"'constant:K' with K an integer in \[0, 999999999\]"):
        PositionPolicy.parse(spec)
    assert PositionPolicy.parse("constant:999999999").constant == 999999999
