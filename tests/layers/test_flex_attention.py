"""The FlexAttention backend's plan: the tree mask row by row, and the block mask built from the
runs, against each row's visible slots computed independently (the torch reference's rule: a
row sees its view up to its own token). On a CPU the eager ``flex_attention`` reads only the
``mask_mod``, so the blocks (what the compiled kernel visits) are checked here directly."""

from __future__ import annotations

import pytest
import torch
from attention_cases import HKV, HQ, NUM_PAGES, SCENARIOS, D, reference, scenario

from pasta_engine.layers.attention import AttentionMetadata, view_slots
from pasta_engine.layers.flex_attention import FlexAttention, build_flex_plan


def visible_grid(meta: AttentionMetadata, union: list[int]) -> torch.Tensor:
    """``[T, L]`` bool: row ``t`` sees union key ``j``."""
    where = {s: j for j, s in enumerate(union)}
    grid = torch.zeros(meta.num_tokens, len(union), dtype=torch.bool)
    t = 0
    for q, runs in zip(meta.q_lens, meta.runs):
        view = view_slots(runs, meta.page_size)
        for i in range(q):
            for s in view[: len(view) - q + i + 1]:
                grid[t, where[s]] = True
            t += 1
    return grid


def block_grids(plan) -> tuple[torch.Tensor, torch.Tensor]:
    """The block mask's partial and full blocks as ``[nq, nk]`` bool."""
    bm = plan.block_mask
    out = []
    for num, idx in ((bm.kv_num_blocks, bm.kv_indices), (bm.full_kv_num_blocks, bm.full_kv_indices)):
        nq, nk = idx.shape[-2:]
        g = torch.zeros(nq, nk, dtype=torch.bool)
        for i in range(nq):
            g[i, idx[0, 0, i, : int(num[0, 0, i])].long()] = True
        out.append(g)
    return out[0], out[1]


@pytest.mark.parametrize("block", [(4, 4), (2, 8), (16, 4), (128, 128)])
@pytest.mark.parametrize("name", SCENARIOS)
def test_the_tree_mask_and_its_blocks_hold_exactly_the_visible_keys(name, block):
    _, meta, _ = scenario(name, 4, seed=len(name) + 1)
    plan = build_flex_plan(meta, block_size=block)
    t, n = plan.num_rows, plan.num_keys
    want = visible_grid(meta, plan.union.tolist())
    assert sorted(plan.union.tolist()) == sorted(set(plan.union.tolist()))  # every slot once (shared pages too)
    # the tree mask_mod (what the compiled kernel evaluates) over the whole padded grid
    tp, lp = plan.row_seq.shape[0], plan.key_run.shape[0]
    grid = plan.block_mask.mask_mod(None, None, torch.arange(tp)[:, None], torch.arange(lp)[None, :])
    assert torch.equal(grid[:t, :n], want)
    assert not grid[:t, n:].any()  # padding keys are seen by no row
    dense = build_flex_plan(meta, block_size=block, dense=True)
    assert torch.equal(dense.dense, grid)
    # blocks: every visible key lies in a listed block; a full block is all visible
    partial, full = block_grids(plan)
    bq, bk = block
    assert not (partial & full).any()
    padded = torch.zeros(tp, lp, dtype=torch.bool)
    padded[:t, :n] = want
    tiles = padded.view(tp // bq, bq, lp // bk, bk)
    needed, listed = tiles.any(3).any(1), partial | full
    assert not (needed & ~listed).any()
    assert not (full & ~tiles.all(3).all(1)).any()
    if meta.is_decode:  # no chunk: no block listed in vain
        assert torch.equal(listed, needed)
    if block == (2, 8) and name == "forks":
        assert full.any() and (~(partial | full)).any()  # the shared prompt is full, private pages skipped


def test_the_table_mask_mod_attends_like_the_reference():
    """The ``mask_mod`` the compiled path uses, run by the eager path."""
    _, meta, _ = scenario("mixed", 4, seed=2)
    gen = torch.Generator().manual_seed(0)
    kc = torch.randn(NUM_PAGES, 4, HKV, D, generator=gen)
    vc = torch.randn(NUM_PAGES, 4, HKV, D, generator=gen)
    q = torch.randn(meta.num_tokens, HQ, D, generator=gen)
    b = FlexAttention(block_size=8)
    b.configure(HQ, HKV, "cpu", D)
    b._plan = build_flex_plan(meta, block_size=(8, 8), dense=False)
    torch.testing.assert_close(b.attend(q, kc, vc, D**-0.5), reference(meta, q, kc, vc, D**-0.5),
                               rtol=1e-4, atol=1e-4)


def test_bad_options_and_order_are_named():
    with pytest.raises(ValueError, match="block_size"):
        FlexAttention(block_size=0)
    with pytest.raises(ValueError, match="block_size"):
        FlexAttention(block_size=(16, 8, 4))
    b = FlexAttention()
    b.configure(2, 2, "cpu", 16)
    with pytest.raises(RuntimeError, match="before plan"):
        b.attend(torch.zeros(1, 2, 16), torch.zeros(4, 4, 2, 16), torch.zeros(4, 4, 2, 16), 1.0)
    b.plan(AttentionMetadata.from_pages(4, [1], [[0]], [[2]]))
    with pytest.raises(ValueError, match="sliding_window=8 needs positions"):
        b.attend(torch.zeros(1, 2, 16), torch.zeros(4, 4, 2, 16), torch.zeros(4, 4, 2, 16), 1.0, sliding_window=8)
    with pytest.raises(ValueError, match="fewer tokens"):
        build_flex_plan(AttentionMetadata.from_pages(4, [3], [[0]], [[2]]))
