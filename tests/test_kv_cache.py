"""Paged KV cache: shared pages, sealing at fork, join without copies, refcounts, exhaustion."""

from __future__ import annotations

import pytest
import torch

from pasta_engine.kv_cache import KVCache, KVCacheExhausted, KVView, kv_bytes_per_token


def make(pages=8, page_size=4):
    per_page = page_size * kv_bytes_per_token(1, 1, 2, torch.float32)
    return KVCache(1, 1, 2, dtype=torch.float32, device="cpu", budget_bytes=pages * per_page, page_size=page_size)


def test_budget_sets_the_page_count_and_tensor_shape():
    kv = make(pages=8, page_size=4)
    assert kv.num_pages == 8
    assert kv.kv.shape == (1, 2, 8, 4, 1, 2)
    with pytest.raises(ValueError, match="holds no page"):
        KVCache(1, 1, 2, dtype=torch.float32, device="cpu", budget_bytes=10, page_size=4)


def test_append_fills_pages_and_returns_slots():
    kv = make()
    v = KVView()
    s = kv.append(v, 6)
    p0, p1 = v.pages
    assert s == [p0 * 4 + i for i in range(4)] + [p1 * 4, p1 * 4 + 1]
    assert v.lens == [4, 2]
    assert kv.append(v, 1) == [p1 * 4 + 2]


def test_fork_shares_and_seals_join_splices_release_frees():
    kv = make()
    main = KVView()
    kv.append(main, 6)  # pages A(4) B(2)
    a, b = main.pages
    child = kv.fork(main)
    assert child.pages == [a, b] and child.lens == [4, 2]
    assert kv.pool.refcount[a] == kv.pool.refcount[b] == 2
    # both tails sealed: the next token of each goes to a fresh page, B stays at 2 for the child
    kv.append(main, 1)
    kv.append(child, 3)
    assert main.lens == [4, 2, 1] and child.lens == [4, 2, 3]
    c_own = child.pages[2]
    shared = main.segments[0]
    assert child.segments[0] is shared and len(child.segments) == len(main.segments) == 2
    kv.join(main, [child])
    # the child's own segment goes before the main thread's open segment (its newest tokens)
    assert main.pages == [a, b, c_own, main.pages[-1]]
    assert main.lens == [4, 2, 3, 1]
    assert main.segments[1] is child.segments[1]
    kv.release(child)
    assert kv.pool.refcount[c_own] == 1 and kv.pool.refcount[a] == 1
    kv.release(main)
    assert all(r == 0 for r in kv.pool.refcount)
    assert kv.pool.num_free == kv.num_pages


def test_exhaustion_is_a_clear_error_and_leaves_the_view_intact():
    kv = make(pages=2, page_size=4)
    v = KVView()
    kv.append(v, 8)
    with pytest.raises(KVCacheExhausted, match=r"2 pages x 4 tokens.*MiB budget"):
        kv.append(v, 1)
    assert v.lens == [4, 4]


def test_double_release_is_caught():
    kv = make()
    v = KVView()
    kv.append(v, 2)
    pages = list(v.pages)
    kv.release(v)
    with pytest.raises(RuntimeError, match="released more times"):
        kv.pool.decref(pages)
