"""Block manager: shared pages, sealing at fork, join without copies, refcounts, exhaustion, and
the prefix cache's pages (which pages are cached, reused, evicted; the engine-level checks are in
test_prefix_caching.py)."""

from __future__ import annotations

import pytest

from pasta_engine import KVCacheExhausted
from pasta_engine.core.block_manager import BlockManager, KVView


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


# --------------------------------------------------------------------------- prefix cache


def test_whole_prompt_pages_are_cached_and_reused_but_never_the_last_token_s_page():
    bm = BlockManager(16, 4, prefix_caching=True)
    prompt = list(range(1, 11))  # 10 tokens: pages [1-4] [5-8] and a partial [9 10]
    v = KVView()
    assert bm.reuse_prefix(v, prompt) == 0
    bm.append(v, len(prompt))
    assert bm.cache_prefix(v, prompt, len(prompt)) == 2  # the partial page is never cached
    assert bm.pool.num_cached == 2 and bm.pool.key_of[v.pages[2]] is None
    bm.release(v)
    assert bm.pool.num_cached_free == 2 and bm.num_free == 16
    # the same prompt: both whole pages (its last token, 10, is on the partial page)
    w = KVView()
    assert bm.reuse_prefix(w, prompt) == 8 and w.lens == [4, 4] and w.open is None
    # a prompt of exactly 8 tokens reuses only the first page: the second holds its last token
    x = KVView()
    assert bm.reuse_prefix(x, prompt[:8]) == 4
    # the same tokens after another prefix are another page: no match
    y = KVView()
    assert bm.reuse_prefix(y, [99, 98, 97, 96] + prompt[4:8] + [1]) == 0
    assert bm.pool.refcount[w.pages[0]] == 2 and bm.prefix_hit_tokens == 12 and bm.prefix_queries == 4
    for view in (w, x, y):
        bm.release(view)
    assert bm.pool.audit() == {"free": 14, "cached_free": 2, "held": 0, "cached": 2}


def test_appends_after_a_reused_prefix_go_to_pages_of_the_view_s_own():
    bm = BlockManager(16, 4, prefix_caching=True)
    prompt = list(range(1, 10))
    v = KVView()
    bm.reuse_prefix(v, prompt)
    bm.append(v, 9)
    bm.cache_prefix(v, prompt, 9)
    w = KVView()
    assert bm.reuse_prefix(w, prompt) == 8
    slots = bm.append(w, 1)  # the last prompt token: a page of w's own, not the cached ones
    assert slots[0] // 4 not in v.pages[:2] and bm.pool.key_of[slots[0] // 4] is None
    child = bm.fork(w)
    for t in (w, child):
        for s in bm.append(t, 5):
            assert bm.pool.key_of[s // 4] is None
    for t in (v, w, child):
        bm.release(t)
    bm.pool.audit()


def test_eviction_takes_never_cached_pages_first_then_the_least_recently_released_tail_first():
    bm = BlockManager(6, 2, prefix_caching=True)
    a, b = [1, 2, 3, 4, 5], [7, 8, 9, 10, 11]
    views = []
    for prompt in (a, b):
        v = KVView()
        bm.append(v, 5)
        bm.cache_prefix(v, prompt, 5)
        views.append(v)
    pa, pb = views[0].pages[:2], views[1].pages[:2]
    for v in views:
        bm.release(v)  # a's pages released first: least recently used
    assert bm.pool.num_cached_free == 4 and bm.num_free == 6
    got = [bm.pool.alloc() for _ in range(4)]
    # the two never-cached pages, then a's tail page before a's head page
    assert got[2:] == [pa[1], pa[0]] and bm.pool.evictions == 2
    va, vb = KVView(), KVView()
    assert bm.reuse_prefix(va, a) == 0 and bm.reuse_prefix(vb, b) == 4  # b is still cached
    bm.release(vb)
    bm.pool.decref(got)
    assert bm.pool.audit() == {"free": 4, "cached_free": 2, "held": 0, "cached": 2}
