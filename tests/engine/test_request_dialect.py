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


def test_each_dialect_brings_its_own_prompt(tiny_engine):
    """A string prompt in pasta mode gets the request's dialect's system prompt and example (a
    prompt teaching PASTA-LANG's tags would teach APAR or Multiverse the wrong language); the
    engine's configured prompt stays PASTA-LANG's; sequential mode has none in any dialect."""
    from pasta_engine.engine.async_engine import format_chat

    shown = {n: tiny_engine.decode(tiny_engine.format_prompt("Name two fruits.", "pasta", dialect=n))
             for n in DIALECT_NAMES}
    assert "<promise" in shown["pasta"] and "[Fork]" not in shown["pasta"]
    assert "[Fork]" in shown["apar"] and "<promise" not in shown["apar"] and "PASTA-LANG" not in shown["apar"]
    assert "<Outline>" in shown["multiverse"] and "<promise" not in shown["multiverse"]
    assert tiny_engine.format_prompt("Name two fruits.", "pasta") == tiny_engine.format_prompt(
        "Name two fruits.", "pasta", dialect=PASTA)
    seq = {tuple(tiny_engine.format_prompt("Name two fruits.", "sequential", dialect=n)) for n in DIALECT_NAMES}
    assert len(seq) == 1
    msgs = [{"role": "user", "content": "Name two fruits."}]
    for n in DIALECT_NAMES:  # chat messages go through the same prompt
        assert format_chat(tiny_engine, msgs, "pasta", n) == tiny_engine.format_prompt("Name two fruits.", "pasta",
                                                                                         dialect=n)
    with pytest.raises(ParameterError, match="dialect"):
        tiny_engine.format_prompt("hi", "pasta", dialect="klingon")


def test_a_request_and_its_replay_are_formatted_with_their_dialects_prompt(tiny_engine):
    from pasta_engine.lang.dialect import dialect_prompt
    from pasta_engine.lang.tokenization import encode_prompt

    trace = "Two tips:\n1. Sleep[Fork][Child] early.[/Child]\n2. Walk[Fork][Child] daily.[/Child]\nDone."
    [res] = tiny_engine.replay(["Give me two tips."], [trace], dialect="apar")
    want = encode_prompt(tiny_engine.tokenizer, dialect_prompt(get_dialect("apar"), tiny_engine.config.pasta_prompt)
                         .messages("Give me two tips."), tiny_engine.config.prompt_special_tokens)
    assert res.prompt_ids == want != tiny_engine.format_prompt("Give me two tips.", "pasta")
    assert res.stats.forks == 2


def test_a_dialect_that_raises_mid_decode_fails_its_request_alone(tiny_engine):
    """A request's own Dialect object whose parser raises: the exception escaped the step (every
    running request failed with it), and ending the request called the parser again, which
    raised again and left it running with its pages for good. Now only that request ends,
    with an error, and the other decodes on."""
    from pasta_engine.lang import tags
    from pasta_engine.lang.pasta import PastaDialect

    class BadParser(tags.TagParser):
        fed = 0

        def feed(self, piece):
            BadParser.fed += 1
            if BadParser.fed > 3:
                raise ValueError("this dialect's parser has a bug")
            return super().feed(piece)

        def feed_plain(self, piece):
            return False  # every piece through feed

    class BadDialect(PastaDialect):
        name = "bad"

        def parser(self):
            return BadParser()

    eng = tiny_engine
    free = eng.block_manager.num_free
    eng.add_request([7, 8, 9], SamplingParams(max_new_tokens=12, ignore_eos=True), mode="sequential",
                    request_id="good")
    eng.add_request([7, 8, 9], SamplingParams(max_new_tokens=12, ignore_eos=True), dialect=BadDialect(),
                    request_id="bad")
    ended = {}
    for _ in range(40):
        for o in eng.step():
            if o.finished:
                ended[o.request_id] = o
        if not eng.has_unfinished_requests():
            break
    assert ended["bad"].finish_reason == "error" and "parser has a bug" in ended["bad"].result.error
    assert ended["good"].finish_reason == "length" and len(ended["good"].result.token_ids) == 12
    assert eng.block_manager.num_free == free and not eng.abort("bad")
