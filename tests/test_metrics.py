"""Critical path, content speedup and the tag-inclusive figures on hand-built structures (values
worked out by hand), and the content figures of a real replay (docs/DESIGN.md section 3)."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pasta_engine.lang.tokenization import encode_text
from pasta_engine.metrics import (
    ResponseStructure,
    content_speedup,
    critical_path,
    cut_fraction,
    geomean,
    geomean_positive,
    length_ratio,
    realized_over_theoretical,
    realized_speedup,
    simulate_steps,
    tag_token_fraction,
    tag_tokens,
    theoretical_speedup_vs_baseline,
    token_parallelism,
)


def test_no_fork_is_sequential():
    # 9 content tokens then EOS: the EOS step is not content
    s = ResponseStructure(main_tokens=10)
    assert critical_path(s) == 10
    assert content_speedup(9, critical_path(s)) == 0.9
    assert token_parallelism(s) == 1.0
    assert tag_tokens(tokens_decoded=10, content_tokens=9, eos_tokens=1) == 0


def test_fork_then_sync_waits_for_the_child():
    # main: content, promise tag (1 token; fork after it), content, <sync/> (1 token), content,
    # EOS; the child: 4 content tokens then </async> (1 token); 3 <async> tokens inserted.
    # main tokens at steps 1,2,3,4; the child samples its 5 tokens at steps 3..7; the sync
    # completed by token 4 -> token 5 at max(4, 7) + 1 = 8, EOS at 9.
    s = ResponseStructure(main_tokens=6, forks=[(2, 5)], syncs=[4], inserted=3)
    cp = critical_path(s)
    assert cp == 9
    assert s.tokens == 11 and s.spliced_tokens == 14  # 11 sampled + 3 inserted
    content = 3 + 4  # main's content + the child's; no tag token, no EOS
    assert content_speedup(content, cp) == pytest.approx(7 / 9)  # below 1: the tags ate the gain
    assert token_parallelism(s) == pytest.approx(11 / 9)  # tags included: parallel, not sooner
    tags = tag_tokens(s.tokens, content, eos_tokens=1)
    assert tags == 3  # promise, sync, </async>; the inserted <async> tokens are not sampled
    assert tag_token_fraction(tags, s.tokens) == pytest.approx(3 / 11)
    assert theoretical_speedup_vs_baseline(s, baseline_tokens=18) == pytest.approx(2.0)


def test_content_speedup_counts_content_only():
    # two chunks of 20 content tokens each forked from a main thread of 10 tokens (2 content,
    # two 3-token promises, <sync/> of 1, EOS): main steps 1..10, children end at 3+21=24 and
    # 6+21=27 (content + </async>), so the sync at token 9 holds EOS until step 28
    s = ResponseStructure(main_tokens=10, forks=[(3, 21), (6, 21)], syncs=[9], inserted=2)
    cp = critical_path(s)
    assert cp == 28
    content = 2 + 20 + 20
    assert content_speedup(content, cp) == pytest.approx(42 / 28)
    assert tag_tokens(s.tokens, content, eos_tokens=1) == 3 + 3 + 1 + 1 + 1  # promises, sync, two </async>
    assert token_parallelism(s, cp) == pytest.approx(52 / 28)
    assert content_speedup(0, cp) == 0.0
    with pytest.raises(ValueError, match="critical path"):
        content_speedup(5, 0)
    with pytest.raises(ValueError, match=">= 0"):
        content_speedup(-1, 3)


def test_end_to_end_companions():
    assert length_ratio(74, 100) == pytest.approx(0.74)
    assert cut_fraction(["stop", "length", "stop", "length"]) == 0.5
    assert realized_over_theoretical(1.2, 1.5) == pytest.approx(0.8)
    assert tag_token_fraction(0, 0) == 0.0
    with pytest.raises(ValueError):
        length_ratio(3, 0)
    with pytest.raises(ValueError):
        cut_fraction([])
    assert tag_tokens(tokens_decoded=5, content_tokens=9, eos_tokens=1) == 0  # never negative


def test_request_stats_count_the_clean_text(tiny_engine):
    """A replay on the tiny model: content tokens are the clean text's canonical tokenization
    and the content speedup divides them by the critical path; tags are the rest."""
    annotated = ('Tips:\n1. <promise topic="sleep" tokens="10"/><async>Go to bed early.</async>\n2. '
                 '<promise topic="walk" tokens="10"/><async>Walk daily.</async>\n<sync/>\nDone.')
    [r] = tiny_engine.replay(["Give me tips."], [annotated])
    s = r.stats
    assert s.forks == 2
    assert s.content_tokens == len(encode_text(tiny_engine.tokenizer, r.text)) > 0
    assert s.content_speedup == pytest.approx(s.content_tokens / s.critical_path)
    assert s.token_parallelism == pytest.approx(s.tokens_decoded / s.critical_path)
    assert s.tag_tokens == s.tokens_decoded - 1 - s.content_tokens > 0  # one EOS
    [seq] = tiny_engine.replay(["Give me tips."], [r.text], mode="sequential")  # the clean text, no tags
    assert seq.text == r.text
    assert seq.stats.content_tokens == s.content_tokens == seq.stats.decode_steps - 1  # + its EOS
    assert seq.stats.tag_tokens == 0 and seq.stats.critical_path == seq.stats.decode_steps


def test_sync_after_the_child_ended_costs_nothing():
    # child forked at 1 with 2 tokens ends at step 3; sync at token 5 -> no wait
    s = ResponseStructure(main_tokens=8, forks=[(1, 2)], syncs=[5])
    assert critical_path(s) == 8


def test_implicit_sync_at_the_end_waits_for_the_longest_child():
    # forks after tokens 1 and 2 with 10 and 3 tokens end at steps 11 and 5; main ends at 4
    s = ResponseStructure(main_tokens=4, forks=[(1, 10), (2, 3)])
    assert critical_path(s) == 11


def test_two_syncs():
    # token1@1 fork A(4) ends 5; token2@2 sync -> token3@6 fork B(2) ends 8; token4@7 sync -> token5@9
    s = ResponseStructure(main_tokens=5, forks=[(1, 4), (3, 2)], syncs=[2, 4])
    assert critical_path(s) == 9


def test_bad_indices_are_rejected():
    with pytest.raises(ValueError, match="outside"):
        critical_path(ResponseStructure(main_tokens=3, forks=[(4, 1)]))
    with pytest.raises(ValueError, match="outside"):
        critical_path(ResponseStructure(main_tokens=3, syncs=[0]))


@st.composite
def structures(draw):
    m = draw(st.integers(1, 30))
    forks = draw(st.lists(st.tuples(st.integers(1, m), st.integers(1, 20)), max_size=6))
    forks.sort(key=lambda f: f[0])
    syncs = sorted(set(draw(st.lists(st.integers(1, m), max_size=3))))
    return ResponseStructure(main_tokens=m, forks=forks, syncs=syncs)


@settings(max_examples=300, deadline=None)
@given(structures(), st.integers(1, 8))
def test_width_bounds(s, width):
    cp = critical_path(s)
    assert simulate_steps(s, None) == cp
    assert simulate_steps(s, 1) == s.tokens
    steps = simulate_steps(s, width)
    assert cp <= steps <= s.tokens
    assert simulate_steps(s, len(s.forks) + 1) == cp


def test_aggregates():
    assert geomean([1.0, 4.0]) == pytest.approx(2.0)
    assert geomean_positive([1.0, 0.0, None, 4.0]) == pytest.approx(2.0)  # no content: left out
    assert geomean_positive([0.0]) is None
    assert realized_speedup(3.0, 2.0) == 1.5
    with pytest.raises(ValueError):
        geomean([])
    with pytest.raises(ValueError):
        realized_speedup(1.0, 0.0)
    assert math.isclose(geomean([2.0] * 5), 2.0)


def test_content_tokens_never_exceed_what_the_run_sampled():
    """A tiny model wrote ``hDo\ufffd`` in 4 tokens that re-tokenize to 5: counted as 5, an answer that
    never forked reported a content speedup of 1.25x. The count is capped at the non-EOS tokens sampled."""
    from pasta_engine.metrics import content_token_count

    assert content_token_count(5, 4, 0) == 4
    assert content_token_count(5, 6, 1) == 5
    assert content_token_count(30, 40, 2) == 30  # tags sampled: fewer content tokens than sampled
    assert content_token_count(3, 0, 0) == 0
    with pytest.raises(ValueError):
        content_token_count(-1, 4, 0)


@pytest.mark.parametrize("text, declines", [
    ("I'm sorry for any misunderstanding, but as an AI designed to assist with sewing, I can't help.", True),
    ("Sure, I'd be happy to help. However, I don't have the ability to browse the web.", True),
    ("I’m unable to provide medical advice.", True),
    ("I apologize for the confusion.", True),
    ("Here are five tips for better sleep:\n1. Keep a schedule.", False),
    ("Sorrow is a theme of the poem.", False),
    ("The villain sneered. " * 20 + "\"I'm sorry,\" she said at last.", False),  # past the opening
])
def test_opens_with_refusal(text, declines):
    from pasta_engine.metrics import opens_with_refusal

    assert opens_with_refusal(text) is declines


def test_opens_with_refusal_refuses_an_empty_window():
    from pasta_engine.metrics import opens_with_refusal

    with pytest.raises(ValueError, match="window_chars"):
        opens_with_refusal("I'm sorry", 0)
