"""Per-layer attention options in the Triton backend under the interpreter vs the torch
reference: sliding windows over logical positions, attention-logit soft-caps, head_dim 256
and 96 (a padded tile), GQA group 1 (multi-head attention), on PASTA forests (shared pages,
forks, joins) with decode rows (tree kernel) and multi-token rows (extend kernel) in one step.

The torch reference itself is checked against transformers in tests/models."""

from __future__ import annotations

import random

import pytest
import torch

from pasta_engine.core.block_manager import BlockManager, KVView
from pasta_engine.layers.attention import AttentionMetadata
from pasta_engine.layers.reference_attention import TorchAttention
from pasta_engine.layers.triton_attention import TritonAttention
from pasta_engine.triton_kernels.extend_attention import extend_attention, extend_indices
from pasta_engine.triton_kernels.tree_attention import build_plan, tree_decode_attention


def forest(rng: random.Random, page_size: int):
    """Views of two requests (a main thread forking children, some joined back) and every cache
    slot's logical position: a thread's positions follow its view with random gaps (reserved
    ranges), so windows cut views at different places for different rows."""
    bm = BlockManager(512, page_size)
    views: list[KVView] = []
    for _ in range(2):
        main = KVView()
        bm.append(main, rng.randint(5, 40))
        kids = []
        for _ in range(rng.randint(1, 4)):
            bm.append(main, rng.randint(1, 6))
            kid = bm.fork(main)
            bm.append(kid, rng.randint(2, 12))
            kids.append(kid)
        if rng.random() < 0.7:
            bm.append(main, 1)
            bm.join(main, kids[:1])
            kids = kids[1:]
        bm.append(main, rng.randint(2, 6))
        views += [main] + kids
    pos = torch.zeros(512, page_size, dtype=torch.int32)
    last: dict[int, int] = {}  # segment id -> position of its last token
    for v in views:
        cur = 0
        for seg in v.segments:
            if seg.id in last:
                cur = last[seg.id] + 1
                continue
            for p, n in zip(seg.pages, seg.lens):
                for o in range(n):
                    pos[p, o] = cur
                    cur += 1 + (rng.random() < 0.2) * rng.randint(1, 5)
            last[seg.id] = cur - 1
    return views, pos


def step(views, pos, rng, page_size):
    """A step's metadata: most rows decode one token, some take the last 2-3 tokens of their
    view as a chunk; the rows' positions."""
    q_lens = [rng.choice([1, 1, 2, 3]) for _ in views]
    runs = [[(s.id, s.pages, s.lens) for s in v.segments] for v in views]
    meta = AttentionMetadata(page_size=page_size, q_lens=q_lens, runs=runs)
    rows = []
    for b, v in enumerate(views):
        slots = [p * page_size + o for p, n in zip(v.pages, v.lens) for o in range(n)]
        rows += slots[-q_lens[b]:]
    return meta, pos.view(-1)[torch.tensor(rows)].long()


CASES = [
    # (Hq, Hkv, D, page_size, dtype)
    (4, 4, 256, 16, torch.float32),  # Gemma-7B's heads: group 1, head_dim 256
    (4, 4, 256, 4, torch.float16),
    (4, 2, 256, 4, torch.float32),  # Gemma 2's: group 2, head_dim 256
    (4, 4, 96, 4, torch.float32),  # Phi-3-mini's: head_dim 96 (a 128-wide tile), group 1
    (6, 2, 64, 16, torch.float16),
]


@pytest.mark.parametrize("window,softcap", [(None, None), (7, None), (None, 0.8), (5, 0.8)])
@pytest.mark.parametrize("hq,hkv,d,page_size,dtype", CASES)
def test_triton_backend_matches_the_torch_reference(hq, hkv, d, page_size, dtype, window, softcap):
    rng = random.Random(hq * 1000 + d + page_size + (window or 0))
    views, pos = forest(rng, page_size)
    meta, q_pos = step(views, pos, rng, page_size)
    gen = torch.Generator().manual_seed(rng.randint(0, 999))
    kc = torch.randn(512, page_size, hkv, d, generator=gen).to(dtype)
    vc = torch.randn(512, page_size, hkv, d, generator=gen).to(dtype)
    q = torch.randn(meta.num_tokens, hq, d, generator=gen).to(dtype)
    opts = dict(sliding_window=window, logit_softcap=softcap, positions=q_pos, key_positions=pos)
    outs = []
    for backend in (TorchAttention(), TritonAttention(decode_mode="tree"), TritonAttention(decode_mode="plain")):
        backend.configure(hq, hkv, "cpu", d)
        backend.plan(meta)
        outs.append(backend.attend(q, kc, vc, d**-0.5 * 4, **opts).float())
    tol = dict(rtol=2e-3, atol=2e-3) if dtype == torch.float16 else dict(rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(outs[1], outs[0], **tol)
    torch.testing.assert_close(outs[2], outs[0], **tol)
    if window or softcap:  # the option changed the answer: the comparison above is not vacuous
        plain = TorchAttention()
        plain.configure(hq, hkv, "cpu", d)
        plain.plan(meta)
        assert (plain.attend(q, kc, vc, d**-0.5 * 4).float() - outs[0]).abs().max() > 1e-2


def test_missing_or_bad_options_are_named():
    k = torch.zeros(4, 4, 2, 64)
    q = torch.zeros(1, 2, 64)
    pos = torch.zeros(4, 4, dtype=torch.int32)
    plan = build_plan([[(1, [0], [2])]], group=1, num_kv_heads=2, device="cpu")
    with pytest.raises(ValueError, match="sliding_window=8 needs q_positions"):
        tree_decode_attention(q, k, k, plan, 1.0, sliding_window=8)
    with pytest.raises(ValueError, match="sliding_window must be a positive int"):
        tree_decode_attention(q, k, k, plan, 1.0, sliding_window=0, q_positions=torch.zeros(1, dtype=torch.long),
                              key_positions=pos)
    with pytest.raises(ValueError, match="sliding_window needs key_positions"):
        tree_decode_attention(q, k, k, plan, 1.0, sliding_window=8, q_positions=torch.zeros(1, dtype=torch.long),
                              key_positions=pos.long())
    with pytest.raises(ValueError, match="logit_softcap must be a positive number"):
        tree_decode_attention(q, k, k, plan, 1.0, logit_softcap=-1.0)
    with pytest.raises(ValueError, match="unit stride"):  # read as contiguous: the window fell elsewhere
        tree_decode_attention(q, k, k, plan, 1.0, sliding_window=8, q_positions=torch.arange(4)[::2], key_positions=pos)
    idx = extend_indices([1], [[0]], [[2]], "cpu")
    with pytest.raises(ValueError, match="sliding_window=8 needs q_positions"):
        extend_attention(q, k, k, *idx, 1.0, sliding_window=8)
    with pytest.raises(ValueError, match="logit_softcap"):
        extend_attention(q, k, k, *idx, 1.0, logit_softcap=float("inf"))
    for backend in (TorchAttention(), TritonAttention()):
        backend.configure(2, 2, "cpu", 64)
        backend.plan(AttentionMetadata.from_pages(4, [1], [[0]], [[2]]))
        with pytest.raises(ValueError, match="sliding_window=8 needs positions"):
            backend.attend(q, k, k, 1.0, sliding_window=8)
        with pytest.raises(ValueError, match="logit_softcap"):
            backend.attend(q, k, k, 1.0, logit_softcap=0.0)
