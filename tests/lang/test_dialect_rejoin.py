"""No marker text reaches APAR's or Multiverse's clean text (docs/DESIGN.md section 2), also when a
marker is cut short by another marker or a lone opener stands right before one: the guarantee
PASTA-LANG's clean text has (``<pro<sync/>mise``, ``<<sync/>sync/>``: tests/lang/test_tags.py),
for every dialect, in ``Dialect.clean_text`` and in the engine's streamed and rendered text.

A partial marker that an opener cuts short goes with what that opener starts when it is a marker
or tag-like (``[Fo[Fork]rk]`` shows ``rk]``, not ``[Fork]``); a lone opener is the model's text
and stays, and the text after the left-out marker that would complete it into one is left out
instead (``[[Fork]Fork]`` shows ``[``, ``<</Parallel>Parallel>`` shows ``<``)."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pasta_engine.config import Limits, SamplingParams
from pasta_engine.core import render
from pasta_engine.core.block_manager import BlockManager
from pasta_engine.core.interpreter import Interpreter
from pasta_engine.core.request import Request
from pasta_engine.core.scheduler import SampledTokens, Scheduler
from pasta_engine.lang.apar import APAR, APAR_REJOIN, AparParser
from pasta_engine.lang.dialect import Text
from pasta_engine.lang.multiverse import MULTIVERSE, MULTIVERSE_REJOIN, MultiverseParser
from pasta_engine.lang.tags import PASTA_REJOIN, TagParser, clean_text, drop_empty_items

from clean_stream import streamed_cleans as stream_cleans  # noqa: E402  (tests/clean_stream.py)

DIALECTS = {"apar": (APAR, AparParser, APAR_REJOIN), "multiverse": (MULTIVERSE, MultiverseParser, MULTIVERSE_REJOIN)}


def markers(dialect, text: str) -> list:
    """What ``dialect``'s parser finds in ``text`` besides text a reader sees: markers, tag-like
    text, diagnostics (none may be found in a clean text)."""
    return [e for e in dialect.parse(text) if type(e) is not Text]


def shown(dialect, annotated: str) -> str:
    """The dialect's strip/keep rule alone: the text its parser keeps for a reader, every such
    character (before empty list items and rejoined marker text go)."""
    return "".join(e.text for e in dialect.parse(annotated) if type(e) is Text)


def is_subsequence(small: str, big: str) -> bool:
    it = iter(big)
    return all(c in it for c in small)


def streamed_cleans(dialect, parser_cls, rejoin, pieces):
    """tests/clean_stream.py's harness with ``parser_cls``'s parser and ``rejoin``."""
    return stream_cleans(parser_cls(), pieces, rejoin)


# --------------------------------------------------------------------------- the reviewer's cases


@pytest.mark.parametrize("annotated, clean, dropped", [
    ("[[Fork]Fork]", "[", "Fork]"),  # a lone '[' stays, what would complete it into [Fork] goes
    ("x [[Fork]Fork] y", "x [ y", "Fork]"),
    ("[Fo[Fork]rk]", "rk]", "[Fo"),  # a partial marker the marker cut short goes with it
    ("[/Chi[Fork]ld]", "ld]", "[/Chi"),
    ("1. Sleep[[Fork][Child]Fork] rest[/Child]", "1. Sleep[ rest", "Fork]"),
    ("[[Fork]Fork]Fork]", "[", "Fork]Fork]"),  # the '[' stands before what was left out: again
    ("[[Fork]Fo[Fork]rk]", "[rk]", "Fo"),
    ("x [[Fork]Fork ]", "x [", "Fork ]"),  # tag-like through the next ']'
    ("[Fo[[Fork]Fork]", "[Fo[", "Fork]"),  # what a lone '[' cut short stays with it
])
def test_apar_marker_text_never_rejoins_in_the_clean_text(annotated, clean, dropped):
    got = APAR.clean_text(annotated)
    assert got == clean
    assert markers(APAR, got) == [], got  # re-parsed: no marker, no tag-like text
    # nothing but marker text is lost: the parser's shown text less exactly the rejoined text
    assert shown(APAR, annotated).replace(dropped, "", 1) == clean or shown(APAR, annotated) == clean
    assert is_subsequence(clean, shown(APAR, annotated))
    for pieces in ([annotated], list(annotated)):  # as a stream: never taken back, ends equal
        steps, final = streamed_cleans(APAR, AparParser, APAR_REJOIN, pieces)
        assert final == clean and all(clean.startswith(s) for s in steps), (pieces, steps)


@pytest.mark.parametrize("annotated, clean", [
    ("<</Parallel>Parallel>", "<"),
    ("a <</Path>Path> b", "a < b"),  # '</Path>' with no path open is tag-like: left out, and so is 'Path>'
    ("a <</Goal>Goal> b", "a < b"),  # '<Goal>' is tag text wherever a reader sees it
    ("a <</Parallel>/Parallel> b", "a < b"),
    ("a <</Parallel>Pa</Parallel>th> b", "a <th> b"),  # a partial tag a tag cuts short goes with it
    ("a <</Parallel>Pa", "a <"),  # a partial tag at the end is tag-like
])
def test_multiverse_tag_text_never_rejoins_in_the_clean_text(annotated, clean):
    got = MULTIVERSE.clean_text(annotated)
    assert got == clean
    assert markers(MULTIVERSE, got) == [], got
    assert is_subsequence(clean, shown(MULTIVERSE, annotated))
    for pieces in ([annotated], list(annotated)):
        steps, final = streamed_cleans(MULTIVERSE, MultiverseParser, MULTIVERSE_REJOIN, pieces)
        assert final == clean and all(clean.startswith(s) for s in steps), (pieces, steps)


@pytest.mark.parametrize("dialect, annotated, clean", [
    # another dialect's '<' is text: PASTA-LANG's rule must not cut what follows it
    (APAR, "a <[Fork]sync/> b", "a <sync/> b"),
    (APAR, "a <[Fork]promise b", "a <promise b"),
    (MULTIVERSE, "a <</Parallel>sync/> b", "a <sync/> b"),
    # a lone opener before a marker, then text that forms none: all of it stays
    (APAR, "a [[Fork] b", "a [ b"),
    (APAR, "a [[Fork]Forklift] b", "a [Forklift] b"),
    (APAR, "[a[Fork]b]", "[ab]"),
    (MULTIVERSE, "a <</Parallel> b", "a < b"),
    (MULTIVERSE, "a <</Parallel>Pathway> b", "a <Pathway> b"),
    (MULTIVERSE, "x << 2 and <</Goal>b", "x << 2 and <b"),
])
def test_text_that_forms_no_marker_is_kept(dialect, annotated, clean):
    got = dialect.clean_text(annotated)
    assert got == clean == shown(dialect, annotated)
    assert markers(dialect, got) == []


def test_pasta_keeps_its_behaviour():
    """PASTA-LANG's rule is unchanged: the default of every function that takes a rejoin."""
    assert clean_text("x <<sync/>sync/> y") == "x < y" and clean_text("<pro<sync/>mise") == "mise"
    assert drop_empty_items("a <sync/>", [3]) == drop_empty_items("a <sync/>", [3], rejoin=PASTA_REJOIN) == "a <"
    assert PASTA_REJOIN.parser is TagParser and PASTA_REJOIN.opener == "<"
    # the other dialects' openers: PASTA-LANG's '<' means nothing to APAR, '[' nothing to PASTA-LANG
    assert drop_empty_items("a [Fork]", [3]) == "a [Fork]"
    assert drop_empty_items("a <sync/>", [3], rejoin=APAR_REJOIN) == "a <sync/>"


# --------------------------------------------------------------------------- properties: the text


APAR_PIECES = st.sampled_from(["[", "[", "[[", "]", "Fork]", "Fork", "Fo", "rk]", "Child]", "/Child]", "[/Chi", "ld]",
                               "[Fo", "[/", "a", " ", "\n", "- ", "1. ", "lift]", "[Fork]", "[Fork]", "[Child]",
                               "[/Child]", "<", "sync/>"])
MV_PIECES = st.sampled_from(["<", "<", "<<", ">", "/", "Parallel>", "/Parallel>", "Path>", "/Path>", "Goal>", "Pa",
                             "th>", "Outline>", "Conclusion>", "\n1:", "1:", "a", " ", "\n", "- ", "<Parallel>",
                             "</Parallel>", "<Goal>", "</Goal>", "<Outline>", "</Outline>", "<Path>", "</Path>",
                             "<Conclusion>", "</Conclusion>", "way>", "sync/>"])


def check_text_property(name: str, pieces: list[str]) -> None:
    dialect, parser_cls, rejoin = DIALECTS[name]
    annotated = "".join(pieces)
    clean = dialect.clean_text(annotated)
    assert markers(dialect, clean) == [], (annotated, clean)  # no marker text reaches a reader
    assert is_subsequence(clean, shown(dialect, annotated)), (annotated, clean)  # nothing invented
    # every lone opener the parser kept as text stays
    assert clean.count(rejoin.opener) >= sum(1 for e in dialect.parse(annotated)
                                             if type(e) is Text and e.text.endswith(rejoin.opener))
    steps, final = streamed_cleans(dialect, parser_cls, rejoin, pieces)
    assert final == clean
    assert all(clean.startswith(s) for s in steps), (pieces, steps)  # never taken back


@settings(max_examples=400, deadline=None)
@given(st.lists(APAR_PIECES, max_size=14))
def test_apar_clean_text_never_holds_marker_text(pieces):
    check_text_property("apar", pieces)


@settings(max_examples=400, deadline=None)
@given(st.lists(MV_PIECES, max_size=14))
def test_multiverse_clean_text_never_holds_tag_text(pieces):
    check_text_property("multiverse", pieces)


# --------------------------------------------------------------------------- properties: the engine


#: A whole Multiverse plan as one token, so random text forks (one path per outline).
PLAN = "<Parallel><Goal><Outline>1: x</Outline><Outline>2: y</Outline></Goal>"
PLAN2 = "<Parallel>\n<Goal><Outline>1: z</Outline></Goal>"
#: Token vocabularies of the scripted model: each dialect's markers, whole and in pieces.
VOCABS = {
    "apar": ["a", "b", " ", "\n", "[", "]", "/", "Fork", "Fo", "rk", "Child", "Chi", "ld", "Fork]", "[Fork]", "[Fork]",
             "[Child]", "[/Child]", "[/", "[Fo", "- ", "1. ", "<", "sync/>", "<EOS>"],
    "multiverse": ["a", "b", " ", "\n", "<", "<", ">", "/", ":", "Parallel", "Path", "Goal", "Outline", "Conclusion",
                   "Pa", "th>", "Parallel>", "<Parallel>", "</Parallel>", "<Goal>", "</Goal>", "<Outline>",
                   "</Outline>", "<Path>", "</Path>", "<Conclusion>", "</Conclusion>", "</", "- ", "sync/>",
                   *"0123456789", PLAN, PLAN2, "<EOS>"],
}


def scripted(name: str):
    vocab = VOCABS[name]
    eos = vocab.index("<EOS>")

    def decode(ids):
        return "".join(vocab[i] for i in ids if i != eos)

    def encode(text):  # greedy longest match (the inserted tags: open, close, path headers, join)
        out, i = [], 0
        while i < len(text):
            best = max((j for j, p in enumerate(vocab) if j != eos and text.startswith(p, i)),
                       key=lambda j: len(vocab[j]))
            out.append(best)
            i += len(vocab[best])
        return out

    return vocab, eos, decode, encode


def run_dialect(name: str, seed: int, max_new: int, width, max_forks: int, mode: str, on_step) -> list[Request]:
    """Decode two scripted requests in dialect ``name`` (random tokens of its vocabulary, weighted
    towards its openers and markers) through interpreter, scheduler and block manager;
    ``on_step(reqs)`` after every step."""
    dialect = DIALECTS[name][0]
    vocab, eos, decode, encode = scripted(name)
    weights = [0.15 if i == eos else 4.0 if v in ("[", "<", "[Fork]", "</Parallel>", "</Path>", "Fork]", "Parallel>")
               else 3.0 if v in (PLAN, PLAN2) else 1.0 for i, v in enumerate(vocab)]
    rng = random.Random(seed)
    bm = BlockManager(512, 4)
    sched = Scheduler(bm, max_running_requests=2)
    limits = Limits(max_threads=width, async_min_cap=4, cap_factor=0.1, max_forks=max_forks)
    reqs = []
    for i in range(2):
        def make():
            return Interpreter([1, 2], decode=decode, eos_ids=[eos], open_ids=encode(dialect.open_tag),
                               close_len=len(encode(dialect.close_tag)), limits=limits, max_new_tokens=max_new,
                               mode=mode, encode=encode, dialect=dialect)

        r = Request(request_id=str(i), index=i, mode=mode, params=SamplingParams(max_new_tokens=max_new),
                    make_interpreter=make)
        sched.add(r)
        reqs.append(r)
    for _ in range(5_000):
        if not sched.has_unfinished():
            break
        batch = sched.schedule()
        if batch:
            toks = [s.step.forced if s.step.forced is not None else rng.choices(range(len(vocab)), weights)[0]
                    for s in batch.sampling]
            sched.postprocess(batch, SampledTokens(toks, [0.0] * len(toks)))
        on_step(reqs)
    assert not sched.has_unfinished()
    return reqs


@settings(max_examples=60, deadline=None)
@given(name=st.sampled_from(sorted(DIALECTS)), seed=st.integers(0, 2**32 - 1), max_new=st.integers(1, 120),
       width=st.sampled_from([None, 1, 2]), max_forks=st.integers(0, 4),
       mode=st.sampled_from(["pasta", "pasta", "sequential"]))
def test_the_engines_streamed_text_never_holds_marker_text(name, seed, max_new, width, max_forks, mode):
    """Random APAR or Multiverse, a lone opener before a marker often: the reading-order stream
    never takes text back, each thread's deltas build its own text, the stream, the interpreter's
    clean text and the result end as the dialect's clean text of the annotated text, and none of
    them holds a marker or tag-like text."""
    dialect = DIALECTS[name][0]
    runs: dict[str, tuple[render.OutputRenderer, dict[int, str], list[str]]] = {}

    def on_step(reqs):
        for r in reqs:
            if r.preemptions or r.interp is None:
                continue
            renderer, texts, prefixes = runs.setdefault(r.request_id, (render.OutputRenderer(), {}, []))
            if renderer._finished:
                continue
            step = renderer.update(r.interp, finish_reason=r.finish_reason if r.finished else None)
            for d in step.thread_deltas:
                texts[d.thread] = texts.get(d.thread, "") + d.text
            if not r.finished:
                prefixes.append(render.reading_order_prefix(r.interp))

    reqs = run_dialect(name, seed, max_new, width, max_forks, mode, on_step)
    for r in reqs:
        it = r.interp
        final = r.result().text
        assert final == render.final_text(it)
        if not (r.finish_reason == "length" and any(c.finish in ("length", "not_run") for c in it.threads[1:])):
            assert final == dialect.clean_text(it.annotated_text()) == it.clean_text()
        texts_shown = [final, it.clean_text()]
        if not r.preemptions and r.request_id in runs:
            renderer, texts, prefixes = runs[r.request_id]
            assert renderer.text == final  # the deltas build the final text
            for a, b in zip(prefixes, prefixes[1:] + [final]):
                assert b.startswith(a), (a, b)  # never taken back
            for t in it.threads:
                assert texts.get(t.tid, "") == render._thread_view(t, True, dialect.rejoin)[0], t.tid
            texts_shown += prefixes + list(texts.values())
        bad = [(s, markers(dialect, s)) for s in texts_shown if markers(dialect, s)]
        assert not bad, (it.annotated_text(), bad)


@pytest.mark.parametrize("name, trace, want", [
    # a chunk's text after a fork that follows a lone '[': the spliced text reads it after the '['
    ("apar", "1. Sleep[[Fork][Child]Fork] rest[/Child]\n2. B", "1. Sleep[ rest\n2. B"),
    ("apar", "x [[Fork]Fork] y", "x [ y"),
    ("multiverse", "<</Parallel>Parallel>", "<"),
])
def test_a_replay_renders_the_dialects_clean_text(tiny_engine, name, trace, want):
    """The engine's result and stream for such a trace (replayed: forced tokens, forks acted on)."""
    dialect = DIALECTS[name][0]
    assert dialect.clean_text(trace) == want
    [res] = tiny_engine.replay(["Hi."], [trace], dialect=name)
    assert res.text == want and markers(dialect, res.text) == []
