"""Critical path and theoretical speedup on hand-built structures (values worked out by hand)."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pasta_engine.metrics import (
    ResponseStructure,
    critical_path,
    geomean,
    realized_speedup,
    simulate_steps,
    theoretical_parallelism,
    theoretical_speedup,
    theoretical_speedup_vs_baseline,
)


def test_no_fork_is_sequential():
    s = ResponseStructure(main_tokens=10)
    assert critical_path(s) == 10
    assert theoretical_speedup(s) == 1.0


def test_fork_then_sync_waits_for_the_child():
    # main tokens at steps 1,2,3,4; child forked after token 2 samples 5 tokens at steps 3..7;
    # sync completed by token 4 -> token 5 at max(4, 7) + 1 = 8, token 6 at 9.
    s = ResponseStructure(main_tokens=6, forks=[(2, 5)], syncs=[4], inserted=3)
    assert critical_path(s) == 9
    assert s.tokens == 11
    assert theoretical_speedup(s) == pytest.approx(14 / 9)  # 11 sampled + 3 inserted
    assert theoretical_parallelism(s) == pytest.approx(11 / 9)
    assert theoretical_speedup_vs_baseline(s, baseline_tokens=18) == pytest.approx(2.0)


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
    assert realized_speedup(3.0, 2.0) == 1.5
    with pytest.raises(ValueError):
        geomean([])
    with pytest.raises(ValueError):
        realized_speedup(1.0, 0.0)
    assert math.isclose(geomean([2.0] * 5), 2.0)
