"""The APAR dialect (pasta_engine/lang/apar.py) on the engine: replay text == its clean text in
both modes, decode steps == the critical path, the training forward == the replay's logprobs,
malformed markers are text, the fork cap; and its annotator (pasta_engine/tools/annotate_apar.py)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from transformers import AutoModelForCausalLM

from pasta_engine import Engine, SamplingParams
from pasta_engine.config import Limits, PositionPolicy
from pasta_engine.core.replay import replay_script
from pasta_engine.lang.apar import APAR, CHILD, CHILD_CLOSE, FORK, AparDialect, AparParser
from pasta_engine.lang.dialect import Dialect, TextParser, get_dialect
from pasta_engine.lang.tags import AsyncClose, AsyncOpen, Malformed, Promise, TagText, Text
from pasta_engine.lang.tokenization import replay_eos_id
from pasta_engine.metrics import critical_path
from pasta_engine.tools.annotate_apar import apar_trace
from pasta_engine.train import pasta_logprobs

TRACE = (f"Tips:\n1. **Sleep**{FORK}{CHILD}: go to bed early, every day.{CHILD_CLOSE}\n"
         f"2. **Walk**{FORK}{CHILD}: thirty minutes, outside.{CHILD_CLOSE}\nThat is all.")
CLEAN = "Tips:\n1. **Sleep**: go to bed early, every day.\n2. **Walk**: thirty minutes, outside.\nThat is all."
PROMPT = "Give me two tips."


def replay(engine, annotated, mode, dialect="apar"):
    [res] = engine.replay([PROMPT], [annotated], mode=mode, dialect=dialect)
    return res


# --------------------------------------------------------------------------- the dialect alone


def test_apar_is_a_registered_dialect():
    assert get_dialect("apar") is APAR
    assert isinstance(APAR, Dialect) and isinstance(APAR.parser(), TextParser)
    assert (APAR.name, APAR.open_tag, APAR.close_tag, APAR.nesting) == ("apar", "[Child]", "[/Child]", False)
    with pytest.raises(ValueError, match="reserve must be an int >= 0"):
        AparDialect(reserve=-1)


def test_markers_are_events_wherever_the_pieces_split():
    want = [Text("1. a"), Promise("", 0, FORK), AsyncOpen(CHILD), Text(" b"), AsyncClose(CHILD_CLOSE)]
    text = "1. a[Fork][Child] b[/Child]"
    assert APAR.parse(text) == want
    for cut in range(1, len(text)):
        p = AparParser()
        got = p.feed(text[:cut]) + p.feed(text[cut:]) + p.finish()
        merged = [e for e in APAR.parse("".join(e.text if isinstance(e, Text) else e.raw for e in got))]
        assert merged == want
        fork = next(e for e in got if isinstance(e, Promise))
        assert fork.end == len("1. a[Fork]")  # offset just past the marker, whatever the cut


def test_malformed_and_partial_markers_are_text_the_reader_never_sees():
    items = APAR.parse("a [Fork ] b [Forklift] c [1] [Child}x\n[/Chi")
    assert [e.raw for e in items if isinstance(e, Malformed)] == ["[Fork ", "[Child}"]
    assert [e.text for e in items if isinstance(e, TagText)] == ["[Fork ]", "[Child}x"]
    assert APAR.clean_text("a [Fork ] b [Forklift] c [1] [Child}x\n[/Chi") == "a  b [Forklift] c [1] \n[/Chi"
    # a partial marker at the end (a length cut) is tag-like once it got as far as a head
    assert APAR.clean_text("x[/Child") == "x" and APAR.clean_text("x[Fo") == "x[Fo"
    assert [type(e) for e in APAR.parse("x[Fork")] == [Text, Malformed, TagText]


def test_split_and_splice_round_trip_and_stray_markers_are_text():
    th = APAR.split_threads(TRACE)
    assert th.main == f"Tips:\n1. **Sleep**{FORK}\n2. **Walk**{FORK}\nThat is all."
    assert [(c.topic, c.tokens, c.content, c.closed) for c in th.chunks] == [
        ("", 0, ": go to bed early, every day.", True), ("", 0, ": thirty minutes, outside.", True)]
    assert APAR.splice(th.main, th.chunks) == TRACE
    assert APAR.clean_text(TRACE) == CLEAN
    stray = APAR.split_threads(f"a{CHILD}b{FORK}{CHILD}c{FORK}d{CHILD_CLOSE}")
    assert stray.main == f"a{CHILD}b{FORK}" and stray.chunks[0].content == f"c{FORK}d"
    assert len(stray.diagnostics) == 2
    with pytest.raises(ValueError, match="1 \\[Fork\\] markers but 2 chunks"):
        APAR.splice(f"x{FORK}", ["a", "b"])


def test_positions_follow_the_policy_with_a_fixed_reserve():
    f = Promise("", 0, FORK)
    lim = Limits()
    assert APAR.reserved_positions(f, PositionPolicy.parse("predicted"), lim, 3, 4, None) == (3 + 4 + 64, None)
    assert AparDialect(reserve=5).reserved_positions(f, PositionPolicy.parse("predicted"), lim, 3, 4, None)[0] == 12
    assert APAR.reserved_positions(f, PositionPolicy.parse("constant:7"), lim, 3, 4, None) == (14, None)
    assert APAR.reserved_positions(f, PositionPolicy.parse("none"), lim, 3, 4, None) == (0, None)
    assert APAR.reserved_positions(f, PositionPolicy.parse("oracle"), lim, 3, 4, 20) == (23, None)
    assert APAR.child_cap(lim, f) == lim.chunk_cap(lim.max_promise_tokens)


# --------------------------------------------------------------------------- on the tiny model


def test_a_trace_replays_with_a_child_per_item(tiny_engine):
    pasta, seq = replay(tiny_engine, TRACE, "pasta"), replay(tiny_engine, TRACE, "sequential")
    assert pasta.text == seq.text == CLEAN
    assert pasta.annotated_text == TRACE and pasta.stats.forks == 2 and pasta.token_ids == seq.token_ids
    assert pasta.stats.decode_steps < seq.stats.decode_steps
    # read as PASTA-LANG, the same text has no fork and shows its markers
    as_pasta = replay(tiny_engine, TRACE, "pasta", dialect="pasta")
    assert as_pasta.stats.forks == 0 and FORK in as_pasta.text


def test_steps_equal_the_critical_path_at_unlimited_width(tiny_llama):
    engine = Engine.from_pretrained(tiny_llama, kv_cache_bytes=16 * 2**20, limits=Limits(max_threads=None))
    res = replay(engine, TRACE, "pasta")
    tok = engine.tokenizer
    script = replay_script(tok, TRACE, replay_eos_id(tok, [tok.eos_token_id]), APAR)
    assert res.stats.decode_steps == res.stats.critical_path == critical_path(script.structure)
    assert len(script.structure.forks) == 2 and script.structure.syncs == []


def test_the_fork_cap_decodes_a_body_inline(tiny_llama):
    engine = Engine.from_pretrained(tiny_llama, kv_cache_bytes=16 * 2**20, limits=Limits(max_forks=1))
    res = replay(engine, TRACE, "pasta")
    assert res.stats.forks == 1 and res.text == CLEAN and res.annotated_text == TRACE
    assert any("fork cap 1 reached" in d and "decoded inline" in d for d in res.diagnostics)


@pytest.mark.parametrize("policy", ["predicted", "none"])
def test_the_training_forward_equals_the_replay(tiny_llama, policy):
    engine = Engine.from_pretrained(tiny_llama, kv_cache_bytes=16 * 2**20, page_size=4, position_policy=policy)
    [res] = engine.replay([PROMPT], [TRACE], dialect="apar", params=SamplingParams(return_logprobs=True))
    assert res.stats.forks == 2
    hf = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32)
    ids, lps = pasta_logprobs(hf, engine.tokenizer, PROMPT, TRACE, policy, dialect=APAR)
    assert ids == res.token_ids
    assert [x is None for x in lps] == [x is None for x in res.logprobs]
    got = torch.tensor([x for x in lps if x is not None])
    want = torch.tensor([x for x in res.logprobs if x is not None])
    torch.testing.assert_close(got, want, rtol=0, atol=1e-4)


_text = st.text(st.sampled_from(list("ab ,.\n-*:[]/1Fork")), max_size=8)


@st.composite
def apar_traces(draw):
    """Lists of items (header, optional body, closed or not), stray or broken markers between.

    A body left unclosed runs to the end of the trace, which then ends with "x." (else its last
    line may be a bare list marker, which the interpreter's inserted close empties in pasta mode
    only: an engine rule for every dialect, PASTA-LANG's too; a bare "." is not enough, as a body
    ending "\n1" then ends "\n1.", a bare marker)."""
    parts = [draw(_text)]
    for i in range(draw(st.integers(0, 4))):
        parts.append(f"\n{i + 1}. " + draw(_text))
        kind = draw(st.sampled_from(["fork", "fork", "plain", "stray"]))
        if kind == "fork":
            parts.append(FORK + CHILD + draw(_text))
            parts.append(draw(st.sampled_from([CHILD_CLOSE, CHILD_CLOSE, "", "[/Chi"])))
        elif kind == "stray":
            parts.append(draw(st.sampled_from([CHILD, CHILD_CLOSE, "[Fork ]", "[Fork", FORK, "[Forks]"])))
    text = "".join(parts) + draw(_text)
    return text + "x." if any(not c.closed for c in APAR.split_threads(text).chunks) else text


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(annotated=apar_traces())
@example(annotated="\n1. " + FORK + CHILD + "\n1x.")  # an unclosed body whose last line is "1x." (once a bare "1.")
def test_any_apar_trace_round_trips_on_the_tiny_model(tiny_engine, annotated):
    want = APAR.clean_text(annotated)
    pasta, seq = replay(tiny_engine, annotated, "pasta"), replay(tiny_engine, annotated, "sequential")
    assert pasta.text == want, (pasta.text, want)
    assert seq.text == want, (seq.text, want)
    assert pasta.token_ids == seq.token_ids
    assert pasta.stats.decode_steps <= seq.stats.decode_steps


# --------------------------------------------------------------------------- the annotator

ANSWERS = [
    ("Here are some tips:\n\n1. **Track Your Usage:** Use the built-in tools on your phone to see how much time "
     "you spend on each app every day.\n2. **Set Goals:** Decide how much screen time is reasonable for you and "
     "stick to a daily limit.\n   - Start small\n   - Adjust weekly\n3. **Short:** Ok.\n\nGood luck!"),
    ("Materials:\n\n- Wood/Timber: renewable, easy to work with, and warm; used for frames and floors in many "
     "homes.\n- Stone: durable and fire-resistant, used for walls and foundations for centuries.\n"),
    ("Steps:\n1. Preheat your oven to 180 degrees and line a tray with baking paper so nothing sticks.\n"
     "2. Score the rind of the pork with a sharp knife, then rub salt into the cuts evenly.\n"
     "```\ncode [stays] here\n```\n"),
    "A plain paragraph with no list at all, which stays as it is.",
    "1. Only one item in this list, long enough to fork but alone, so nothing runs beside it.",
    "Odd text [Fork] already:\n1. **A**: one two three four five six seven eight nine ten.\n2. **B**: x y z w v u t s r q.",
]


@pytest.mark.parametrize("answer", ANSWERS)
def test_the_annotators_clean_text_is_its_input(answer):
    annotated = apar_trace(answer, len)  # count_tokens: characters here
    assert APAR.clean_text(annotated) == answer or annotated == answer
    assert APAR.clean_text(apar_trace(answer)) == APAR.clean_text(answer)


def test_the_annotator_forks_after_each_items_header():
    a = apar_trace(ANSWERS[0])
    assert a.count(FORK) == 2  # "Short: Ok." is too short to fork
    assert f"1. **Track Your Usage:**{FORK}{CHILD} Use the built-in" in a
    assert f"stick to a daily limit.\n   - Start small\n   - Adjust weekly{CHILD_CLOSE}\n3." in a
    assert APAR.clean_text(a) == ANSWERS[0]
    b = apar_trace(ANSWERS[1])
    assert f"- Wood/Timber:{FORK}{CHILD} renewable" in b and f"- Stone:{FORK}{CHILD} durable" in b
    c = apar_trace(ANSWERS[2])
    assert f"1. Preheat your oven{FORK}{CHILD} to 180" in c and c.count(FORK) == 2
    for unannotated in ANSWERS[3:]:  # no list, a single item, marker text of its own
        assert apar_trace(unannotated) == unannotated
    with pytest.raises(TypeError, match="text must be a string"):
        apar_trace(None)


def test_annotated_answers_replay_to_the_answer(tiny_engine):
    for answer in ANSWERS[:3]:
        annotated = apar_trace(answer)
        res = replay(tiny_engine, annotated, "pasta")
        assert res.text == answer and res.stats.forks == annotated.count(FORK) > 0
