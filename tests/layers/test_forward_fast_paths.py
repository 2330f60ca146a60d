"""The forward's CPU fast paths give bitwise the values of the written-out ops they replace:
the RoPE table (:class:`~pasta_engine.layers.rotary.RotaryEmbedding`), the packed q/k rotation
(:meth:`~pasta_engine.layers.attention.AttentionBackend.rope_and_write_qkv`) and ``torch.rms_norm``
(:meth:`~pasta_engine.models.llama.LlamaModel._rms_norm`)."""

from __future__ import annotations

import pytest
import torch

from pasta_engine.layers.attention import AttentionBackend

from pasta_engine.layers.reference_attention import TorchAttention
from pasta_engine.layers.rotary import RotaryEmbedding


def _inv_freq(d: int, base: float) -> torch.Tensor:
    return 1.0 / (base ** (torch.arange(0, d, 2).float() / d))


@pytest.mark.parametrize("long", [False, True])
@pytest.mark.parametrize("n", [1, 2, 3, 7, 16, 33])
def test_rope_table_rows_equal_direct_computation(n, long):
    d = 16
    kw = dict(long_inv_freq=_inv_freq(d, 500.0), long_from=3000) if long else {}
    rope = RotaryEmbedding(_inv_freq(d, 10000.0), 0.9 if long else 1.0, torch.device("cpu"), torch.float32, **kw)
    gen = torch.Generator().manual_seed(n)
    for hi in (50, 5000, 20000):  # the table grows past 4096 positions
        pos = torch.randint(0, hi, (n,), generator=gen)
        cos, sin = rope(pos)
        want_cos, want_sin = rope.compute(pos)
        assert torch.equal(cos, want_cos) and torch.equal(sin, want_sin)
    assert rope._table.shape[0] > 4096  # grown


@pytest.mark.parametrize("hq,hkv", [(2, 1), (4, 2), (3, 3)])
def test_packed_rope_and_write_equals_split(hq, hkv):
    t, d, pages, ps = 5, 16, 4, 4
    gen = torch.Generator().manual_seed(hq)
    qkv = torch.randn(t, (hq + 2 * hkv) * d, generator=gen)
    pos = torch.tensor([0, 3, 9, 100, 7])
    cos, sin = RotaryEmbedding(_inv_freq(d, 10000.0), 1.0, torch.device("cpu"), torch.float32).compute(pos)
    slots = torch.tensor([1, 6, 7, 12, 15])
    caches = [torch.zeros(pages, ps, hkv, d) for _ in range(4)]
    backend = TorchAttention()
    q_packed = backend.rope_and_write_qkv(qkv, hq, cos, sin, caches[0], caches[1], slots)
    q, k, v = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
    q_split = AttentionBackend.rope_and_write(backend, q.reshape(t, hq, d), k.reshape(t, hkv, d),
                                              v.reshape(t, hkv, d), cos, sin, caches[2], caches[3], slots)
    assert torch.equal(q_packed, q_split)
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])


class _Overriding(TorchAttention):
    """A backend with its own rope_and_write: the packed call must reach it."""

    def __init__(self):
        super().__init__()
        self.calls = 0

    def rope_and_write(self, q, k, v, cos, sin, k_cache, v_cache, slot_mapping):
        self.calls += 1
        return super().rope_and_write(q, k, v, cos, sin, k_cache, v_cache, slot_mapping)


def test_packed_rope_calls_an_overriding_backend():
    t, hq, hkv, d = 2, 2, 1, 8
    backend = _Overriding()
    cos, sin = torch.ones(t, d), torch.zeros(t, d)
    q = backend.rope_and_write_qkv(torch.randn(t, (hq + 2 * hkv) * d), hq, cos, sin, torch.zeros(2, 2, hkv, d),
                                   torch.zeros(2, 2, hkv, d), torch.tensor([0, 1]))
    assert backend.calls == 1 and q.shape == (t, hq, d)


@pytest.mark.parametrize("dim", [16, 32, 96, 576, 2048])
@pytest.mark.parametrize("shape", [(1,), (17,), (5, 3)])
@pytest.mark.parametrize("unit_offset", [False, True])
def test_cpu_rms_norm_equals_written_out(dim, shape, unit_offset):
    gen = torch.Generator().manual_seed(dim)
    x = 3 * torch.randn(*shape, dim, generator=gen)
    w = torch.randn(dim, generator=gen)
    eps = 1e-6
    xf = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    want = xf * w if unit_offset else w * xf
    assert torch.equal(torch.rms_norm(x, (dim,), w, eps), want)


def test_kv_mirror_equals_gathering_and_respects_its_budget():
    """The torch backend's per-layer K/V mirror (appended to on plain decode steps) attends
    bitwise like gathering the views from the cache, which it falls back to past mirror_bytes."""
    from pasta_engine.layers.attention import AttentionMetadata

    ps, hkv, hq, d = 4, 1, 2, 8
    gen = torch.Generator().manual_seed(0)
    k_cache, v_cache = torch.randn(16, ps, hkv, d, generator=gen), torch.randn(16, ps, hkv, d, generator=gen)
    mirrored, gathered = TorchAttention(), TorchAttention()
    gathered.mirror_bytes = 0
    lens = [3, 6]
    for step in range(1, 8):
        lens = [n + 1 for n in lens]
        pages = [[0, 1, 2, 3][: -(-lens[0] // ps)], [4, 5, 6, 7][: -(-lens[1] // ps)]]
        page_lens = [[min(ps, n - i * ps) for i in range(len(p))] for n, p in zip(lens, pages)]
        meta = AttentionMetadata.from_pages(ps, [1, 1], pages, page_lens)
        runs = [[(b + 1, p, n)] for b, (p, n) in enumerate(zip(pages, page_lens))]  # ids stay: rows only grow
        meta.runs, meta.step = runs, step
        slots = meta.row_slots()
        k_cache.view(-1, hkv, d)[torch.tensor(slots)] = torch.randn(2, hkv, d, generator=gen)
        v_cache.view(-1, hkv, d)[torch.tensor(slots)] = torch.randn(2, hkv, d, generator=gen)
        q = torch.randn(2, hq, d, generator=gen)
        outs = []
        for b in (mirrored, gathered):
            b.plan(AttentionMetadata(ps, [1, 1], runs, step=step))
            outs.append(b.attend(q, k_cache, v_cache, d**-0.5))
        assert torch.equal(outs[0], outs[1])
    assert mirrored._mirrors and not gathered._mirrors
    assert mirrored._table.bumped is not None  # the last steps appended to the mirror
