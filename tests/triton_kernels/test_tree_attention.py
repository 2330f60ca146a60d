"""Tree decode attention under the Triton interpreter vs the torch reference, on random forests.

Forests are built with the real KV cache manager: several requests, each a main thread that
prefills a prompt, forks 0-8 children at random points (the main thread keeps appending between
forks), joins some of them at a sync and decodes on; every live thread is one query row. Page
sizes 4 and 16 put page boundaries (and the sealed partial pages of forks and joins) at every
offset."""

from __future__ import annotations

import random

import pytest
import torch

from pasta_engine.core.block_manager import BlockManager, KVView
from pasta_engine.layers.attention import AttentionMetadata
from pasta_engine.layers.reference_attention import TorchAttention
from pasta_engine.triton_kernels.tree_attention import (
    DecodeWorkspace,
    build_plan,
    choose_mode,
    tree_decode_attention,
)


class Forest:
    """Pages from the block manager plus one layer's K and V caches."""

    def __init__(self, page_size, hkv, d, dtype, pages=4096 // 4):
        self.bm = BlockManager(pages, page_size)
        self.page_size = page_size
        self.k = torch.randn(pages, page_size, hkv, d).to(dtype)
        self.v = torch.randn(pages, page_size, hkv, d).to(dtype)

    def append(self, view, n):
        return self.bm.append(view, n)

    def fork(self, view):
        return self.bm.fork(view)

    def join(self, view, children):
        return self.bm.join(view, children)

    def layer(self, i):
        return self.k, self.v


def random_forest(rng: random.Random, n_requests: int, page_size: int, hkv: int, d: int, dtype):
    kv = Forest(page_size, hkv, d, dtype)
    views: list[KVView] = []
    for _ in range(n_requests):
        main = KVView()
        kv.append(main, rng.randint(1, 70))
        children = []
        for _ in range(rng.randint(0, 8)):
            kv.append(main, rng.randint(1, 9))
            c = kv.fork(main)
            kv.append(c, rng.randint(1, 25))
            children.append(c)
        if children and rng.random() < 0.6:  # a sync: some children end and join
            done = children[: rng.randint(1, len(children))]
            kv.append(main, 1)
            kv.join(main, done)
            children = children[len(done):]
            kv.append(main, rng.randint(0, 12))
            for _ in range(rng.randint(0, 2)):  # a fork after the join sees the joined chunks
                c = kv.fork(main)
                kv.append(c, rng.randint(1, 9))
                children.append(c)
        kv.append(main, 1)
        views += [main] + children
    return kv, views


def reference(q, kv, views, scale):
    meta = AttentionMetadata.from_pages(kv.page_size, [1] * len(views), [v.pages for v in views],
                                        [v.lens for v in views])
    backend = TorchAttention()
    backend.plan(meta)
    k, v = kv.layer(0)
    return backend.attend(q.float(), k.float(), v.float(), scale)


def plan_views(views):
    return [[(s.id, s.pages, s.lens) for s in v.segments] for v in views]


CASES = [
    # (hq, hkv, d, page_size, dtype, seed)
    (2, 2, 64, 4, torch.float32, 0),
    (6, 2, 64, 16, torch.float16, 1),
    (8, 2, 128, 4, torch.float16, 2),
    (8, 1, 64, 16, torch.float32, 3),
    (9, 3, 64, 4, torch.float16, 4),
    (4, 1, 128, 16, torch.float32, 5),
    (4, 4, 96, 4, torch.float32, 8),  # Phi-3-mini: head_dim 96 in a 128-wide tile (head_dim 256: test_attention_options)
]


@pytest.mark.parametrize("hq,hkv,d,page_size,dtype,seed", CASES)
def test_tree_plain_and_merges_match_the_reference(hq, hkv, d, page_size, dtype, seed):
    rng = random.Random(seed)
    kv, views = random_forest(rng, n_requests=rng.randint(1, 3), page_size=page_size, hkv=hkv, d=d, dtype=dtype)
    q = torch.randn(len(views), hq, d, dtype=dtype)
    scale = d**-0.5
    want = reference(q, kv, views, scale)
    k, v = kv.layer(0)
    tol = dict(rtol=2e-3, atol=2e-3) if dtype == torch.float16 else dict(rtol=1e-4, atol=1e-4)
    pv = plan_views(views)
    for mode, merge, target in [("tree", "inline", 1), ("tree", "inline", 7), ("tree", "separate", 5),
                                ("plain", "inline", 3), ("auto", "inline", 64)]:
        plan = build_plan(pv, group=hq // hkv, num_kv_heads=hkv, device="cpu", mode=mode, target_work=target,
                          max_rows_per_item=4)
        got = tree_decode_attention(q, k, v, plan, scale, merge=merge, block_n=32)
        torch.testing.assert_close(got.float(), want, **tol, msg=f"{mode}/{merge}/{target}")


def test_row_sets_read_shared_pages_once():
    rng = random.Random(11)
    kv, views = random_forest(rng, 1, 4, 1, 16, torch.float32)
    main = KVView()
    kv.append(main, 64)
    kids = [kv.fork(main) for _ in range(5)]
    for c in kids:
        kv.append(c, 3)
    kv.append(main, 1)
    pv = plan_views([main] + kids)
    tree = build_plan(pv, group=1, num_kv_heads=1, device="cpu", mode="tree")
    plain = build_plan(pv, group=1, num_kv_heads=1, device="cpu", mode="plain")
    assert tree.pages_read == 16 + 6  # the shared 16 pages once, then one private page per thread
    assert plain.pages_read == 6 * 16 + 6
    assert choose_mode(pv) == "tree"
    # no sharing: plain is chosen
    assert choose_mode([[(1, [0], [4])], [(2, [1], [4])]]) == "plain"


def test_counters_are_left_at_zero_for_the_next_launch():
    rng = random.Random(3)
    kv, views = random_forest(rng, 2, 4, 2, 64, torch.float32)
    q = torch.randn(len(views), 4, 64)
    plan = build_plan(plan_views(views), group=2, num_kv_heads=2, device="cpu", mode="tree", target_work=9)
    assert plan.partials
    k, v = kv.layer(0)
    ws = DecodeWorkspace()  # scratch memory the caller owns, reused across launches
    first = tree_decode_attention(q, k, v, plan, 0.125, workspace=ws)
    assert ws.counters is not None and int(ws.counters.abs().sum()) == 0
    second = tree_decode_attention(q, k, v, plan, 0.125, workspace=ws)
    torch.testing.assert_close(first, second)


def test_an_external_merge_gets_every_rows_partials():
    """merge=callable: the kernel writes every row's partials and the caller merges them (what
    the CUDA extension's lse_merge does); the torch reference merge gives the same output."""
    from pasta_engine.layers.csrc_ops import lse_merge_reference

    rng = random.Random(4)
    kv, views = random_forest(rng, 2, 4, 2, 64, torch.float32)
    q = torch.randn(len(views), 4, 64)
    plan = build_plan(plan_views(views), group=2, num_kv_heads=2, device="cpu", mode="tree", target_work=9)
    k, v = kv.layer(0)
    calls = []

    def merge(part_o, part_lse, indptr, row_parts, out):
        calls.append(int(indptr[-1]))
        lse_merge_reference(part_o, part_lse, indptr, row_parts, out)

    got = tree_decode_attention(q, k, v, plan, 0.125, merge=merge)
    assert calls and calls[0] == plan.n_parts
    torch.testing.assert_close(got, reference(q, kv, views, 0.125), rtol=1e-4, atol=1e-4)


def test_bad_inputs_are_named():
    k = torch.zeros(4, 4, 2, 64)
    plan = build_plan([[(1, [0], [2])]], group=2, num_kv_heads=2, device="cpu")
    with pytest.raises(ValueError, match="dtype"):
        tree_decode_attention(torch.zeros(1, 4, 64, dtype=torch.float16), k, k, plan, 1.0)
    with pytest.raises(ValueError, match="KV heads"):
        tree_decode_attention(torch.zeros(1, 3, 64), k, k, plan, 1.0)
    with pytest.raises(ValueError, match="empty KV view"):
        build_plan([[(1, [], [])]], group=1, num_kv_heads=1, device="cpu")
    with pytest.raises(ValueError, match="mode must be"):
        build_plan([[(1, [0], [1])]], group=1, num_kv_heads=1, device="cpu", mode="later")
    with pytest.raises(ValueError, match="merge must be"):
        tree_decode_attention(torch.zeros(1, 2, 64), k[:, :, :1], k[:, :, :1], plan, 1.0, merge="later")


def test_plan_and_call_arguments_that_computed_garbage_are_refused_by_name():
    """Each was accepted: group 0 made a plan whose call answered garbage (the capacity-plan
    marker skipped the group check), target_work / max_rows_per_item 0 died in arithmetic, a run
    with more pages than page lengths read past them, a float16 V under float32 K answered at
    float16 precision, and block_n 48 died inside Triton."""
    v1 = [[(1, [0, 1], [4, 4])]]
    for kw, name in [(dict(group=0), "group"), (dict(num_kv_heads=0), "num_kv_heads"),
                     (dict(target_work=0), "target_work"), (dict(max_rows_per_item=0), "max_rows_per_item")]:
        args = dict(group=2, num_kv_heads=2, device="cpu") | kw
        with pytest.raises(ValueError, match=f"{name} must be an int >= 1, got 0"):
            build_plan(v1, **args)
    with pytest.raises(ValueError, match="segment 1: 2 pages but 1 page lengths"):
        build_plan([[(1, [0, 1], [4])]], group=2, num_kv_heads=2, device="cpu")
    k = torch.zeros(4, 4, 2, 64)
    plan = build_plan([[(1, [0], [2])]], group=2, num_kv_heads=2, device="cpu")
    with pytest.raises(ValueError, match="v_cache dtype torch.float16"):
        tree_decode_attention(torch.zeros(1, 4, 64), k, k.half(), plan, 1.0)
    for bn in (48, 20, 0, 8):  # 8: below the 16-wide tl.dot tile (was silently raised to 16)
        with pytest.raises(ValueError, match=f"block_n must be a power of two >= 16 .*got {bn}"):
            tree_decode_attention(torch.zeros(1, 4, 64), k, k, plan, 1.0, block_n=bn)


def test_only_a_capacity_plan_skips_the_rows_and_group_checks():
    """A capacity plan (CUDA graphs) is marked by ``rows``/``group`` None; a step's plan whose
    group reads 0 (or whose rows read 0) is still checked against the call (0 was the marker, so
    such a plan bypassed the GQA-group check and answered garbage)."""
    from pasta_engine.triton_kernels.tree_attention import StaticDecodePlan, plan_lists, upload_plan

    static = StaticDecodePlan(4, 4, 8, 8, 16, "cpu")
    assert static.plan.group is None and static.plan.rows is None
    k = torch.zeros(4, 4, 2, 64)
    arrays, info = plan_lists([[(1, [0], [2])]], group=2, num_kv_heads=2, device="cpu")
    assert info["group"] == 2 and info["rows"] == 1
    with pytest.raises(ValueError, match="GQA group 0, the call's is 2"):
        tree_decode_attention(torch.zeros(1, 4, 64), k, k, upload_plan(arrays, info | {"group": 0}, "cpu"), 1.0)
    with pytest.raises(ValueError, match="covers 3 query rows but q has 1"):
        tree_decode_attention(torch.zeros(1, 4, 64), k, k, upload_plan(arrays, info | {"rows": 3}, "cpu"), 1.0)
    # more rows than the step's plan: the extra rows came back as uninitialized memory
    with pytest.raises(ValueError, match="covers 1 query rows but q has 3"):
        tree_decode_attention(torch.zeros(3, 4, 64), k, k, upload_plan(arrays, info, "cpu"), 1.0)


def test_a_dtype_the_kernel_cannot_take_or_no_kv_head_is_refused_by_name():
    """int8 q/k/v were accepted and answered int8 garbage (the softmax weights cast to int8
    before P.V, off by 13 against float attention), int32 died inside Triton, and a cache with
    no KV head raised ZeroDivisionError; each is now a ValueError saying what is wrong."""
    plan = build_plan([[(1, [0], [2])]], group=2, num_kv_heads=2, device="cpu")
    for dtype in (torch.int8, torch.int32, torch.float64):
        k = torch.zeros(4, 4, 2, 64, dtype=dtype)
        with pytest.raises(ValueError, match=f"q dtype must be float16, bfloat16 or float32, got {dtype}"):
            tree_decode_attention(torch.zeros(1, 4, 64, dtype=dtype), k, k, plan, 1.0)
    k = torch.zeros(4, 4, 0, 64)
    with pytest.raises(ValueError, match="do not fit the cache's 0 KV heads"):
        tree_decode_attention(torch.zeros(1, 4, 64), k, k, plan, 1.0)


class _LaunchSpy:
    """Stands in for ``_tree_decode_kernel``: records each launch's constexprs, runs nothing."""

    def __init__(self):
        self.launches = []

    def __getitem__(self, grid):
        return lambda *args, **kw: self.launches.append(kw)


@pytest.mark.parametrize("dtype,ieee", [(torch.float32, True), (torch.float16, False), (torch.bfloat16, False)])
def test_float32_launches_exact_ieee_dots_and_half_precision_does_not(monkeypatch, dtype, ieee):
    """On a GPU a float32 ``tl.dot`` without ``input_precision`` runs in TF32 (10-bit mantissa);
    the extend kernel passes IEEE for float32, and the tree decode kernel now does too."""
    from pasta_engine.triton_kernels import tree_attention

    spy = _LaunchSpy()
    monkeypatch.setattr(tree_attention, "_tree_decode_kernel", spy)
    k = torch.zeros(4, 4, 2, 64, dtype=dtype)
    plan = build_plan([[(1, [0], [2])]], group=2, num_kv_heads=2, device="cpu")
    tree_decode_attention(torch.zeros(1, 4, 64, dtype=dtype), k, k, plan, 1.0)
    assert [kw["IEEE"] for kw in spy.launches] == [ieee]


def test_the_ieee_switch_is_in_the_kernel_and_its_compile_specs():
    """The float32 switch reaches the GPU compile check: every tree-decode spec sets IEEE, and a
    float32 spec compiles the IEEE branch."""
    import pasta_engine.triton_kernels as pkg
    from pasta_engine.triton_kernels import tree_attention

    specs = [s for s in pkg.COMPILE_SPECS if s.fn is tree_attention._tree_decode_kernel]
    assert specs and all("IEEE" in s.constexprs and s.signature.get("IEEE") == "constexpr" for s in specs)
    assert any(s.constexprs["IEEE"] and s.signature["Q"] == "*fp32" for s in specs)


def test_a_call_that_does_not_fit_its_plan_or_out_is_refused():
    """Each of these was accepted and answered with garbage (or wrote past ``out``, or left the
    workspace's merge counters set so the next correct call merged unwritten partials)."""
    rng = random.Random(5)
    kv, views = random_forest(rng, 2, 4, 2, 16, torch.float32)
    k, v = kv.layer(0)
    n = len(views)
    q = torch.randn(n, 4, 16)
    plan = build_plan(plan_views(views), group=2, num_kv_heads=2, device="cpu", mode="tree", target_work=9)
    assert plan.n_work > 1 and plan.rows == n
    for bad, match in [
        (dict(out=torch.empty(n, 4, 32)[..., ::2]), "contiguous last"),  # strided last dim
        (dict(out=torch.empty(n, 4, 8)), "out must be"),  # too small: wrote past its end
        (dict(out=torch.empty(n, 4, 16, dtype=torch.float64)), "out must be"),
        (dict(grid_work=1), "grid_work=1 is below"),
    ]:
        with pytest.raises(ValueError, match=match):
            tree_decode_attention(q, k, v, plan, 0.25, **bad)
    with pytest.raises(ValueError, match=f"covers {n} query rows but q has {n - 1}"):
        tree_decode_attention(q[: n - 1], k, v, plan, 0.25)
    small = build_plan(plan_views(views), group=1, num_kv_heads=2, device="cpu", mode="tree", target_work=9)
    with pytest.raises(ValueError, match="GQA group 1, the call's is 2"):
        tree_decode_attention(q, k, v, small, 0.25)
    ws = DecodeWorkspace()  # a refused call leaves the workspace as it was: the next call is right
    with pytest.raises(ValueError):
        tree_decode_attention(q, k, v, plan, 0.25, grid_work=1, workspace=ws)
    got = tree_decode_attention(q, k, v, plan, 0.25, workspace=ws, grid_work=plan.n_work + 3)
    torch.testing.assert_close(got, reference(q, kv, views, 0.25), rtol=1e-4, atol=1e-4)


@pytest.mark.gpu
@pytest.mark.parametrize("hq,hkv,d", [(32, 8, 128), (9, 3, 64), (8, 1, 64)])
@pytest.mark.parametrize("merge", ["inline", "separate"])
def test_tree_attention_bf16_matches_the_reference(hq, hkv, d, merge):
    for seed in range(3):
        rng = random.Random(seed)
        kv, views = random_forest(rng, 3, 16, hkv, d, torch.bfloat16)
        q = torch.randn(len(views), hq, d, dtype=torch.bfloat16)
        want = reference(q, kv, views, d**-0.5).cuda()
        kc, vc = (x.cuda() for x in kv.layer(0))
        for mode in ("tree", "plain"):
            plan = build_plan(plan_views(views), group=hq // hkv, num_kv_heads=hkv, device="cuda", mode=mode,
                              target_work=11)
            got = tree_decode_attention(q.cuda(), kc, vc, plan, d**-0.5, merge=merge)
            torch.testing.assert_close(got.float(), want, rtol=2e-2, atol=2e-2)


def test_a_static_plan_rewrites_its_pinned_buffers_only_after_the_last_copies(monkeypatch):
    """CUDA graphs: :meth:`StaticDecodePlan.load` copies each step's plan asynchronously from
    pinned host buffers it reuses; the next load waits for the last one's copies (an event
    recorded after them) before rewriting them. CPU: the ordering, with a fake event that checks
    the buffers are unchanged until it is waited for."""
    from pasta_engine.triton_kernels.tree_attention import StaticDecodePlan

    log = []

    class Event:
        def record(self):
            self.seen = {k: t.clone() for k, t in static.host.items()}
            log.append("record")

        def synchronize(self):
            assert all(torch.equal(static.host[k], t) for k, t in self.seen.items()), "rewritten before copied"
            log.append("synchronize")

    monkeypatch.setattr(torch.cuda, "Event", Event)
    static = StaticDecodePlan(4, 4, 8, 8, 16, "cpu")
    static._cuda = True  # as on a GPU, where the copies are asynchronous
    for step in range(3):
        assert static.load({"pages": [step, 5], "page_lens": [4, 1 + step], "num_work": [1]},
                           {"block_m": 16, "pages_read": 2})
        assert static.tensors["page_lens"][:2].tolist() == [4, 1 + step]
    assert log == ["record", "synchronize", "record", "synchronize", "record"]
    assert not static.load({"pages": list(range(9))}, {"block_m": 16, "pages_read": 9})  # over capacity
    assert log[-1] == "record"  # nothing copied, nothing waited for
