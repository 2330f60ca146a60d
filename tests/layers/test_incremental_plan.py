"""The attention plan kept across steps equals a plan built from scratch, after every step of
random fork / join / release sequences on the real block manager (both backends).

The backends update their decode plan when a step follows the last planned one
(``AttentionMetadata.step``) with the same rows (the torch backend: per row), and rebuild it at
forks, joins, threads that start, pause or end, multi-token steps, page boundaries (Triton) and
steps they did not plan (a CUDA graph ran instead)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pasta_engine.core.block_manager import BlockManager, KVView
from pasta_engine.layers.attention import AttentionMetadata
from pasta_engine.layers.reference_attention import TorchAttention
from pasta_engine.layers.triton_attention import TritonAttention
from pasta_engine.triton_kernels.tree_attention import PLAN_ARRAYS

HQ, HKV, D = 4, 2, 16

# one step's events: 0 = every thread decodes, 1 = fork, 2 = join, 3 = a thread ends,
# 4 = a thread skips the step, 5 = a multi-token step (an inserted tag), 6 = the plan is skipped
EVENTS = st.lists(st.sampled_from([0, 0, 0, 0, 0, 1, 1, 2, 3, 4, 5, 6]), min_size=1, max_size=60)


def _backends(device="cpu"):
    out = []
    for make in (TorchAttention, TritonAttention):
        inc, fresh = make(), make()
        for b in (inc, fresh):
            b.configure(HQ, HKV, device, D)
        out.append((inc, fresh))
    return out


def _same_plan(inc, fresh) -> None:
    if isinstance(inc, TorchAttention):
        assert inc.decode_views() == fresh.decode_views()
        return
    a, b = inc._plan.decode, fresh._plan.decode
    assert (a is None) == (b is None)
    if a is None:
        return
    for name in PLAN_ARRAYS:
        assert torch.equal(getattr(a, name), getattr(b, name)), name
    assert (a.n_work, a.n_parts, a.block_m, a.mode, a.pages_read) == (b.n_work, b.n_parts, b.block_m, b.mode,
                                                                      b.pages_read)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(events=EVENTS, page_size=st.sampled_from([1, 4, 16]), prompt=st.integers(1, 40), seed=st.integers(0, 2**16))
def test_incremental_plan_equals_a_fresh_plan(events, page_size, prompt, seed):
    rng = torch.Generator().manual_seed(seed)
    bm = BlockManager(4096, page_size)
    main = KVView()
    threads: list[tuple[KVView, int]] = []  # (view, tokens to append at the next step)
    threads.append((main, prompt))
    children: dict[int, list[KVView]] = {}
    backends = _backends()
    k_cache = torch.randn(4096, page_size, HKV, D, generator=rng)
    v_cache = torch.randn(4096, page_size, HKV, D, generator=rng)
    for step, ev in enumerate(events, start=1):
        pick = int(torch.randint(len(threads), (1,), generator=rng))
        if ev == 1 and len(threads) < 12:  # fork: the child's first step is an inserted tag
            parent = threads[pick][0]
            child = bm.fork(parent)
            children.setdefault(id(parent), []).append(child)
            threads.append((child, 3))
        elif ev == 2 and children.get(id(threads[pick][0])):  # join every child of the picked thread
            parent = threads[pick][0]
            kids = children.pop(id(parent))
            bm.join(parent, kids)
            for c in kids:
                bm.release(c)
            threads = [t for t in threads if t[0] not in kids]
            threads = [(v, 2 if v is parent else n) for v, n in threads]
        elif ev == 3 and len(threads) > 1 and pick > 0 and not children.get(id(threads[pick][0])):
            view = threads.pop(pick)[0]
            bm.release(view)
            for kids in children.values():
                if view in kids:
                    kids.remove(view)
        elif ev == 5:
            threads[pick] = (threads[pick][0], 2)
        skip = threads[pick][0] if ev == 4 and len(threads) > 1 else None
        run = [(v, n) for v, n in threads if v is not skip]
        slots: list[int] = []
        for v, n in run:
            slots += bm.append(v, n)
        meta = dict(page_size=page_size, q_lens=[n for _, n in run], runs=[BlockManager.runs(v) for v, _ in run],
                    slots=slots)
        threads = [(v, 1) for v, _ in threads]
        if ev == 6:
            continue  # this step ran without planning (a CUDA graph): the next plan must not bump
        q = torch.randn(len(slots), HQ, D, generator=rng)
        for i, (inc, fresh) in enumerate(backends):
            inc.plan(AttentionMetadata(**meta, step=step))
            fresh.plan(AttentionMetadata(**meta))
            _same_plan(inc, fresh)
            if i == 0:  # the torch plans also attend alike
                # this step's new keys and values (the torch backend's mirrors copy just these)
                k_cache.view(-1, HKV, D)[torch.tensor(slots)] = torch.randn(len(slots), HKV, D, generator=rng)
                v_cache.view(-1, HKV, D)[torch.tensor(slots)] = torch.randn(len(slots), HKV, D, generator=rng)
                a = inc.attend(q, k_cache, v_cache, D**-0.5)
                b = fresh.attend(q, k_cache, v_cache, D**-0.5)
                torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_a_decode_step_updates_the_plan_without_rebuilding_it(monkeypatch):
    """Two decode steps in a row with the same threads: the second fills no row (torch) and
    builds no plan lists (Triton)."""
    import pasta_engine.layers.attention as attention
    import pasta_engine.layers.triton_attention as triton_attention

    bm = BlockManager(64, 16)
    views = [KVView() for _ in range(3)]
    for v in views:
        bm.append(v, 5)
    (torch_inc, _), (triton_inc, _) = _backends()

    def meta(step):
        slots = [s for v in views for s in bm.append(v, 1)]
        return AttentionMetadata(16, [1] * 3, [BlockManager.runs(v) for v in views], slots=slots, step=step)

    m1 = meta(1)
    torch_inc.plan(m1)
    triton_inc.plan(m1)
    calls = []
    monkeypatch.setattr(attention, "view_slots", lambda *a: calls.append("torch") or [])
    monkeypatch.setattr(triton_attention, "plan_lists", lambda *a, **k: calls.append("triton") or ({}, {}))
    m2 = meta(2)
    torch_inc.plan(m2)
    triton_inc.plan(m2)
    assert calls == []
    assert torch_inc.decode_views()[0][-2:] == [m1.slots[0], m2.slots[0]]


@pytest.mark.parametrize("backend", [TorchAttention, TritonAttention])
def test_plans_without_a_step_are_built_from_scratch(backend):
    b = backend()
    b.configure(HQ, HKV, "cpu", D)
    b.plan(AttentionMetadata.from_pages(4, [1], [[0]], [[2]]))
    b.plan(AttentionMetadata.from_pages(4, [1], [[0]], [[3]]))
    if backend is TorchAttention:
        assert b.decode_views() == [[0, 1, 2]]
    else:
        assert b._plan.decode.page_lens.tolist() == [3]
