"""A request's dialect: the name or object reaches the interpreter; a bad one fails alone, before
any resource, naming the parameter and value; the default is PASTA-LANG (issue 23, item 5)."""

import pytest

from pasta_engine import ParameterError, SamplingParams
from pasta_engine.lang.dialect import DIALECT_NAMES, PASTA, get_dialect




def test_registry_names_and_errors():
    assert get_dialect("pasta") is PASTA
    assert "pasta" in DIALECT_NAMES
    with pytest.raises(ValueError, match="'klingon'"):
        get_dialect("klingon")


def test_a_bad_dialect_fails_alone_before_taking_a_page(tiny_engine):
    free = tiny_engine.block_manager.num_free
    with pytest.raises(ParameterError, match="dialect.*klingon"):
        tiny_engine.add_request("hi", SamplingParams(max_new_tokens=2), dialect="klingon")
    with pytest.raises(ParameterError, match="dialect"):
        tiny_engine.generate(["hi"], SamplingParams(max_new_tokens=2), dialect=3)
    assert tiny_engine.block_manager.num_free == free
    assert not tiny_engine.has_unfinished_requests()
    out = tiny_engine.generate(["hi"], SamplingParams(max_new_tokens=2))  # the engine serves the next call
    assert len(out) == 1


def test_pasta_by_name_equals_the_default(tiny_engine):
    a = tiny_engine.generate(["hello"], SamplingParams(max_new_tokens=6))[0]
    b = tiny_engine.generate(["hello"], SamplingParams(max_new_tokens=6), dialect="pasta")[0]
    c = tiny_engine.generate(["hello"], SamplingParams(max_new_tokens=6), dialect=PASTA)[0]
    assert a.token_ids == b.token_ids == c.token_ids
