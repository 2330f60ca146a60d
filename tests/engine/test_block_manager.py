"""Block manager: shared pages, sealing at fork, join without copies, refcounts, exhaustion."""

from __future__ import annotations

import pytest

from pasta_engine import KVCacheExhausted
from pasta_engine.engine.block_manager import BlockManager, KVView


def make(pages=8, page_size=4):
    return BlockManager(pages, page_size)


def test_the_pool_needs_a_page():
    bm = make(pages=8, page_size=4)
    assert bm.num_pages == bm.num_free == 8
    with pytest.raises(ValueError, match="num_pages >= 1"):
        BlockManager(0, 4)


def test_append_fills_pages_and_returns_slots():
    bm = make()
    v = KVView()
    s = bm.append(v, 6)
    p0, p1 = v.pages
    assert s == [p0 * 4 + i for i in range(4)] + [p1 * 4, p1 * 4 + 1]
    assert v.lens == [4, 2]
    assert bm.append(v, 1) == [p1 * 4 + 2]


def test_fork_shares_and_seals_join_splices_release_frees():
    bm = make()
    main = KVView()
    bm.append(main, 6)  # pages A(4) B(2)
    a, b = main.pages
    child = bm.fork(main)
    assert child.pages == [a, b] and child.lens == [4, 2]
    assert bm.pool.refcount[a] == bm.pool.refcount[b] == 2
    # both tails sealed: the next token of each goes to a fresh page, B stays at 2 for the child
    bm.append(main, 1)
    bm.append(child, 3)
    assert main.lens == [4, 2, 1] and child.lens == [4, 2, 3]
    c_own = child.pages[2]
    shared = main.segments[0]
    assert child.segments[0] is shared and len(child.segments) == len(main.segments) == 2
    bm.join(main, [child])
    # the child's own segment goes before the main thread's open segment (its newest tokens)
    assert main.pages == [a, b, c_own, main.pages[-1]]
    assert main.lens == [4, 2, 3, 1]
    assert main.segments[1] is child.segments[1]
    bm.release(child)
    assert bm.pool.refcount[c_own] == 1 and bm.pool.refcount[a] == 1
    bm.release(main)
    assert all(r == 0 for r in bm.pool.refcount)
    assert bm.pool.num_free == bm.num_pages


def test_exhaustion_is_a_clear_error_and_leaves_the_view_intact():
    bm = make(pages=2, page_size=4)
    v = KVView()
    bm.append(v, 8)
    with pytest.raises(KVCacheExhausted, match=r"2 pages x 4 tokens"):
        bm.append(v, 1)
    assert v.lens == [4, 4]


def test_double_release_is_caught():
    bm = make()
    v = KVView()
    bm.append(v, 2)
    pages = list(v.pages)
    bm.release(v)
    with pytest.raises(RuntimeError, match="released more times"):
        bm.pool.decref(pages)
