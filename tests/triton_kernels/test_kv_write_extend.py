"""Triton fused RoPE + paged KV write, and extend (prefill) attention over paged views.

On CPU the kernels run under the Triton interpreter (set by ``pasta_engine.triton_kernels``),
in float16 and float32 only (bfloat16 ``tl.dot`` is wrong under the interpreter); the
``gpu``-marked tests repeat the checks in bfloat16 on CUDA.

References: ``AttentionBackend.rope_and_write`` (torch default) for the KV write;
``extend_attention_reference`` (dense gather + mask + float32 softmax) and
``pasta_engine.layers.reference_attention.TorchAttention`` (fed an ``AttentionMetadata`` built the way
the model runner builds it) for the attention.
"""

from __future__ import annotations

import random

import pytest
import torch

from pasta_engine.layers.attention import AttentionBackend, AttentionMetadata

from pasta_engine.layers.reference_attention import TorchAttention
from pasta_engine.layers.rotary import apply_rope
from pasta_engine.triton_kernels.extend_attention import (
    extend_attention,
    extend_attention_reference,
    extend_indices,
)
from pasta_engine.triton_kernels.kv_write import rope_and_write

GROUPS = [(4, 4), (9, 3), (8, 2), (16, 2)]  # (Hq, Hkv): GQA groups 1, 3, 4, 8

# dtype -> (atol, rtol) of the kernel vs a float32-accumulated reference on the same inputs
ATTN_TOL = {torch.float32: (2e-5, 2e-5), torch.float16: (2e-3, 2e-3), torch.bfloat16: (1.6e-2, 1.6e-2)}


# --------------------------------------------------------------------------- helpers


def rope_table(positions: torch.Tensor, d: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    inv = 1.0 / (10000.0 ** (torch.arange(0, d, 2, dtype=torch.float32, device=positions.device) / d))
    emb = positions.float()[:, None] * inv[None, :]
    emb = torch.cat([emb, emb], dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def fused_qkv(t: int, hq: int, hkv: int, d: int, dtype, device, gen) -> tuple[torch.Tensor, ...]:
    """q/k/v as strided views of one ``[T, (Hq + 2 Hkv) D]`` projection output (as the model
    produces them): non-contiguous along dim 0."""
    qkv = torch.randn(t, (hq + 2 * hkv) * d, generator=gen, dtype=torch.float32).to(dtype).to(device)
    q, k, v = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
    return q.view(t, hq, d), k.view(t, hkv, d), v.view(t, hkv, d)


def make_meta(page_size, q_lens, pages, page_lens, slots, positions, device):
    """AttentionMetadata as the model runner builds it, and the step's device positions and
    slots."""
    meta = AttentionMetadata.from_pages(page_size, q_lens, pages, page_lens)
    return (meta, torch.tensor(positions, dtype=torch.long, device=device),
            torch.tensor(slots, dtype=torch.long, device=device))


def torch_backend(device) -> TorchAttention:
    backend = TorchAttention()
    backend.device = torch.device(device)
    return backend


def view_slots(pages, lens, page_size) -> list[int]:
    return [p * page_size + o for p, n in zip(pages, lens) for o in range(n)]


def random_layout(rng: random.Random, num_seqs: int, page_size: int, max_q: int, num_pages: int):
    """Views that start with shared pages (the last of them sealed part-full, as at a fork),
    continue with private pages of random lengths (partial pages in the middle, as after a
    join), and end with the sequence's new tokens. Returns q_lens, pages, page_lens."""
    num_pages = max(num_pages, 3 + num_seqs * (max_q + 5))  # enough even if every page holds 1 token
    free = list(range(num_pages))
    rng.shuffle(free)
    n_shared = rng.randint(1, 3)
    shared = [free.pop() for _ in range(n_shared)]
    shared_lens = [page_size] * (n_shared - 1) + [rng.randint(1, page_size - 1)]
    q_lens, pages, page_lens = [], [], []
    for _ in range(num_seqs):
        q_len = rng.randint(1, max_q)
        p, n = list(shared), list(shared_lens)
        for _ in range(rng.randint(0, 3)):  # private middle pages, often partial
            p.append(free.pop())
            n.append(rng.choice([page_size, rng.randint(1, page_size)]))
        while sum(n) < sum(shared_lens) + q_len or rng.random() < 0.3:
            p.append(free.pop())
            n.append(rng.choice([page_size, page_size, rng.randint(1, page_size)]))
        q_lens.append(q_len)
        pages.append(p)
        page_lens.append(n)
    return q_lens, pages, page_lens


def new_token_slots(q_lens, pages, page_lens, page_size) -> list[int]:
    """Slots of every sequence's new tokens: the last q_len tokens of its view."""
    out: list[int] = []
    for q_len, p, n in zip(q_lens, pages, page_lens):
        if q_len:
            out += view_slots(p, n, page_size)[-q_len:]
    return out


def assert_untouched(new: torch.Tensor, old: torch.Tensor, written: list[int]) -> None:
    """Every cache slot outside ``written`` is unchanged."""
    ps = new.shape[1]
    keep = torch.ones(new.shape[0] * ps, dtype=torch.bool)
    keep[torch.tensor(written, dtype=torch.long)] = False
    flat_new = new.reshape(-1, *new.shape[2:]).cpu()
    flat_old = old.reshape(-1, *old.shape[2:]).cpu()
    assert torch.equal(flat_new[keep], flat_old[keep])


# --------------------------------------------------------------------------- KV write


def check_kv_write(hq, hkv, d, dtype, device, seed):
    gen = torch.Generator().manual_seed(seed)
    t, page_size, num_pages = 11, 4, 8
    q, k, v = fused_qkv(t, hq, hkv, d, dtype, device, gen)
    assert not q.is_contiguous() and not k.is_contiguous() and not v.is_contiguous()
    positions = torch.randint(0, 4096, (t,), generator=gen).to(device)
    cos, sin = rope_table(positions, d, dtype)
    # distinct random slots, most of them in the middle of pages
    slots = torch.randperm(num_pages * page_size, generator=gen)[:t].to(device)
    k_cache = torch.randn(num_pages, page_size, hkv, d, generator=gen).to(dtype).to(device)
    v_cache = torch.randn(num_pages, page_size, hkv, d, generator=gen).to(dtype).to(device)
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    ref_q = AttentionBackend().rope_and_write(q, k, v, cos, sin, ref_k, ref_v, slots)
    out_k, out_v = k_cache.clone(), v_cache.clone()
    q_rot = rope_and_write(q, k, v, cos, sin, out_k, out_v, slots)

    assert q_rot.shape == (t, hq, d) and q_rot.dtype == dtype and q_rot.is_contiguous()
    written = slots.tolist()
    assert_untouched(out_k, k_cache, written)
    assert_untouched(out_v, v_cache, written)
    flat = lambda c: c.reshape(-1, hkv, d)[slots]  # noqa: E731
    # v is copied bit for bit
    assert torch.equal(flat(out_v), v.contiguous())
    if dtype == torch.float32:
        torch.testing.assert_close(q_rot, ref_q, atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(flat(out_k), flat(ref_k), atol=1e-6, rtol=1e-6)
    else:
        # within one rounding of the exact (float32) rotation, and close to the torch default
        exact_q = apply_rope(q.float(), cos.float(), sin.float())
        exact_k = apply_rope(k.float(), cos.float(), sin.float())
        eps = torch.finfo(dtype).eps
        for got, exact in ((q_rot, exact_q), (flat(out_k), exact_k)):
            err = (got.float() - exact).abs()
            assert bool((err <= eps * exact.abs() + 1e-6).all()), f"max error {err.max().item()}"
        torch.testing.assert_close(q_rot, ref_q, atol=2 * eps * 4, rtol=2 * eps)
        torch.testing.assert_close(flat(out_k), flat(ref_k), atol=2 * eps * 4, rtol=2 * eps)
    # the rotation really happened (not an identity copy)
    assert not torch.allclose(q_rot.float(), q.float(), atol=1e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("d", [64, 96, 128, 256])
@pytest.mark.parametrize("hq,hkv", GROUPS)
def test_kv_write_matches_torch_default(hq, hkv, d, dtype):
    check_kv_write(hq, hkv, d, dtype, "cpu", seed=hq * 1000 + d + (dtype == torch.float16))


def test_kv_write_out_argument_and_padding_slots():
    gen = torch.Generator().manual_seed(7)
    t, hq, hkv, d, ps = 5, 8, 2, 64, 4
    q, k, v = fused_qkv(t, hq, hkv, d, torch.float32, "cpu", gen)
    cos, sin = rope_table(torch.arange(t), d, torch.float32)
    k_cache = torch.randn(4, ps, hkv, d, generator=gen)
    v_cache = torch.randn(4, ps, hkv, d, generator=gen)
    k0, v0 = k_cache.clone(), v_cache.clone()
    slots = torch.tensor([5, -1, 9, -1, 14])  # negative = padding row: rotate q, write nothing
    out = torch.full((t, hq, d), float("nan"))
    res = rope_and_write(q, k, v, cos, sin, k_cache, v_cache, slots, out=out)
    assert res is out
    torch.testing.assert_close(out, apply_rope(q, cos, sin), atol=1e-6, rtol=1e-6)
    assert_untouched(k_cache, k0, [5, 9, 14])
    assert_untouched(v_cache, v0, [5, 9, 14])
    kept = torch.tensor([0, 2, 4])
    torch.testing.assert_close(k_cache.reshape(-1, hkv, d)[[5, 9, 14]], apply_rope(k, cos, sin)[kept],
                               atol=1e-6, rtol=1e-6)
    assert torch.equal(v_cache.reshape(-1, hkv, d)[[5, 9, 14]], v[kept])


def test_kv_write_bad_inputs_are_named():
    t, hq, hkv, d = 3, 4, 2, 64
    q, k, v = torch.randn(t, hq, d), torch.randn(t, hkv, d), torch.randn(t, hkv, d)
    cos, sin = rope_table(torch.arange(t), d, torch.float32)
    kc, vc = torch.zeros(2, 4, hkv, d), torch.zeros(2, 4, hkv, d)
    slots = torch.arange(t)
    with pytest.raises(ValueError, match=r"cos shape \(3, 32\) must be \[T=3, D=64\]"):
        rope_and_write(q, k, v, cos[:, :32], sin, kc, vc, slots)
    with pytest.raises(ValueError, match="k dtype torch.float16 != q dtype torch.float32"):
        rope_and_write(q, k.half(), v, cos, sin, kc, vc, slots)
    with pytest.raises(ValueError, match="cache shape .* must be \\[num_pages, page_size, Hkv=2, D=64\\]"):
        rope_and_write(q, k, v, cos, sin, kc[:, :, :1], vc[:, :, :1], slots)
    with pytest.raises(ValueError, match="slot_mapping has 2 entries for T=3"):
        rope_and_write(q, k, v, cos, sin, kc, vc, slots[:2])


# --------------------------------------------------------------------------- extend attention


def check_extend(q_lens, pages, page_lens, hq, hkv, d, page_size, num_pages, dtype, device, seed, **kw):
    gen = torch.Generator().manual_seed(seed)
    t = sum(q_lens)
    num_pages = max(num_pages, 1 + max((x for p in pages for x in p), default=0))
    q = torch.randn(t, hq, d, generator=gen).to(dtype).to(device)
    k_cache = torch.randn(num_pages, page_size, hkv, d, generator=gen).to(dtype).to(device)
    v_cache = torch.randn(num_pages, page_size, hkv, d, generator=gen).to(dtype).to(device)
    scale = d**-0.5
    idx = extend_indices(q_lens, pages, page_lens, device)
    out = extend_attention(q, k_cache, v_cache, *idx, scale, **kw)
    ref = extend_attention_reference(q, k_cache, v_cache, *idx, scale)
    assert out.shape == q.shape and out.dtype == dtype
    atol, rtol = ATTN_TOL[dtype]
    torch.testing.assert_close(out, ref, atol=atol, rtol=rtol)

    slots = new_token_slots(q_lens, pages, page_lens, page_size)
    meta, _, _ = make_meta(page_size, q_lens, pages, page_lens, slots, list(range(t)), device)
    backend = torch_backend(device)
    backend.plan(meta)
    torch_out = backend.attend(q, k_cache, v_cache, scale)
    torch.testing.assert_close(out, torch_out, atol=2 * atol, rtol=2 * rtol)
    return out, ref


# (Hq, Hkv, D, page_size, block_m/block_n override): every group, head dim and page size in
# both dtypes, one case with small tiles (many K/V tiles, a token's group split across blocks)
EXTEND_CASES = [
    (4, 4, 64, 16, None),
    (9, 3, 64, 4, None),
    (8, 2, 128, 16, None),
    (16, 2, 128, 4, None),
    (9, 3, 128, 16, (16, 16)),
    (16, 2, 64, 16, None),
    (4, 4, 256, 16, None),  # Gemma-7B: head_dim 256, group 1
    (4, 4, 96, 4, None),  # Phi-3-mini: head_dim 96 (a padded tile)
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("hq,hkv,d,page_size,blocks", EXTEND_CASES)
def test_extend_matches_reference_and_torch_backend(hq, hkv, d, page_size, blocks, dtype):
    rng = random.Random(hq * 100 + d + page_size + (dtype == torch.float16))
    q_lens, pages, page_lens = random_layout(rng, num_seqs=3, page_size=page_size, max_q=40 if hq <= 8 else 20,
                                             num_pages=64)
    # at least one prefill-sized chunk and one short tag
    q_lens[0] = max(q_lens[0], 17)
    q_lens[-1] = min(q_lens[-1], 3)
    for b in range(len(q_lens)):  # keep kv_len >= q_len
        while sum(page_lens[b]) < q_lens[b]:
            page_lens[b].append(page_size)
            pages[b].append(max(max(p) for p in pages) + 1)
    kw = {} if blocks is None else {"block_m": blocks[0], "block_n": blocks[1]}
    assert any(0 < n < page_size for lens in page_lens for n in lens[:-1]), "layout lacks a partial middle page"
    check_extend(q_lens, pages, page_lens, hq, hkv, d, page_size, 128, dtype, "cpu", seed=rng.randint(0, 999), **kw)


@pytest.mark.parametrize("page_size", [4, 16])
def test_extend_causal_boundary_at_every_page_offset(page_size):
    """Sequence o's new tokens start at offset o of a page (and end anywhere), so the causal
    cut-off crosses page and tile boundaries at every offset."""
    q_lens, pages, page_lens = [], [], []
    nxt = 0
    for o in range(page_size):
        prefix = 2 * page_size + o
        q_len = 1 + (3 * o) % 7
        n = prefix + q_len
        lens = [page_size] * (n // page_size) + ([n % page_size] if n % page_size else [])
        pages.append(list(range(nxt, nxt + len(lens))))
        nxt += len(lens)
        q_lens.append(q_len)
        page_lens.append(lens)
    check_extend(q_lens, pages, page_lens, 8, 2, 64, page_size, nxt, torch.float32, "cpu", seed=page_size)


def test_extend_grid_upper_bound_padding_sequence_and_full_prefill():
    """A grid sized from a loose ``max_q_len`` bound, a padding sequence (q_len 0, no pages) as
    a CUDA-graph bucket would add, and a one-sequence prefill where q_len = kv_len."""
    q_lens, pages, page_lens = [6, 0, 3], [[3, 0, 5], [], [1, 2]], [[4, 1, 4], [], [4, 2]]
    out, _ = check_extend(q_lens, pages, page_lens, 8, 2, 64, 4, 8, torch.float16, "cpu", seed=3, max_q_len=32)
    assert torch.isfinite(out.float()).all()
    check_extend([23], [[4, 2, 7, 0, 6, 1]], [[4, 4, 4, 4, 4, 3]], 9, 3, 64, 4, 8, torch.float32, "cpu", seed=4)


def test_extend_pipeline_with_kv_write_matches_torch_backend():
    """rope_and_write (Triton) then extend_attention equals the torch backend doing both."""
    gen = torch.Generator().manual_seed(11)
    rng = random.Random(11)
    hq, hkv, d, ps = 8, 2, 64, 4
    q_lens, pages, page_lens = random_layout(rng, num_seqs=3, page_size=ps, max_q=9, num_pages=48)
    t = sum(q_lens)
    slots = new_token_slots(q_lens, pages, page_lens, ps)
    positions = [rng.randint(0, 500) for _ in range(t)]
    meta, pos_t, slot_t = make_meta(ps, q_lens, pages, page_lens, slots, positions, "cpu")
    q, k, v = fused_qkv(t, hq, hkv, d, torch.float32, "cpu", gen)
    cos, sin = rope_table(pos_t, d, torch.float32)
    num_pages = 1 + max(x for p in pages for x in p)
    k_cache = torch.randn(num_pages, ps, hkv, d, generator=gen)
    v_cache = torch.randn(num_pages, ps, hkv, d, generator=gen)
    kc_ref, vc_ref = k_cache.clone(), v_cache.clone()

    backend = torch_backend("cpu")
    backend.plan(meta)
    q_ref = backend.rope_and_write(q, k, v, cos, sin, kc_ref, vc_ref, slot_t)
    o_ref = backend.attend(q_ref, kc_ref, vc_ref, d**-0.5)

    q_rot = rope_and_write(q, k, v, cos, sin, k_cache, v_cache, slot_t)
    o = extend_attention(q_rot, k_cache, v_cache, *extend_indices(q_lens, pages, page_lens, "cpu"), d**-0.5)
    torch.testing.assert_close(k_cache, kc_ref, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(o, o_ref, atol=4e-5, rtol=4e-5)


def test_extend_bad_inputs_are_named():
    q = torch.randn(4, 8, 64)
    kc = vc = torch.zeros(4, 4, 2, 64)
    idx = extend_indices([4], [[0, 1]], [[4, 1]], "cpu")
    with pytest.raises(ValueError, match="extend_attention: kv_pages must be int32, got torch.int64"):
        extend_attention(q, kc, vc, idx[0], idx[1], idx[2].long(), idx[3], idx[4], 0.125)
    with pytest.raises(ValueError, match="Hq=8 must be a positive multiple of Hkv=3"):
        extend_attention(q, torch.zeros(4, 4, 3, 64), torch.zeros(4, 4, 3, 64), *idx, 0.125)
    with pytest.raises(ValueError, match="q_indptr has 3 entries, need B\\+1=2"):
        extend_attention(q, kc, vc, torch.tensor([0, 2, 4], dtype=torch.int32), *idx[1:], 0.125)
    # the host-side reference also checks index values
    with pytest.raises(ValueError, match="kv_lens=6 but its pages hold 5 tokens"):
        extend_attention_reference(q, kc, vc, *idx[:4], torch.tensor([6], dtype=torch.int32), 0.125)


# --------------------------------------------------------------------------- GPU (bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("hq,hkv", GROUPS)
@pytest.mark.parametrize("d", [64, 128])
def test_gpu_kv_write_bf16(hq, hkv, d):
    check_kv_write(hq, hkv, d, torch.bfloat16, "cuda", seed=hq + d)


@pytest.mark.gpu
@pytest.mark.parametrize("hq,hkv,d,page_size,blocks", EXTEND_CASES)
def test_gpu_extend_bf16(hq, hkv, d, page_size, blocks):
    rng = random.Random(hq + d + page_size)
    q_lens, pages, page_lens = random_layout(rng, num_seqs=6, page_size=page_size, max_q=40, num_pages=256)
    kw = {} if blocks is None else {"block_m": blocks[0], "block_n": blocks[1]}
    check_extend(q_lens, pages, page_lens, hq, hkv, d, page_size, 256, torch.bfloat16, "cuda", seed=1, **kw)


@pytest.mark.gpu
@pytest.mark.parametrize("hq,hkv,d", [(32, 8, 128), (9, 3, 64)])
def test_gpu_extend_long_prefill_bf16(hq, hkv, d):
    """A prompt-sized prefill (one sequence, q_len 1500 after a 300-token shared prefix) and
    float32 on the GPU (exact IEEE dot, no TF32)."""
    ps = 16
    n = 1800
    lens = [ps] * (n // ps) + [n % ps]
    pages = [list(torch.randperm(200).tolist()[: len(lens)])]
    check_extend([1500], pages, [lens], hq, hkv, d, ps, 200, torch.bfloat16, "cuda", seed=5)
    check_extend([1500], pages, [lens], hq, hkv, d, ps, 200, torch.float32, "cuda", seed=6)
