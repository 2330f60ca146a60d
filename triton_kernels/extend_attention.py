"""Extend (prefill) attention over the paged KV cache: several new tokens per sequence.

Used for prompt prefill (one sequence, ``q_len`` up to a few thousand) and for the tags the
interpreter inserts into forked threads (``q_len`` 2-5 for each of several sequences per step).

Layout (per sequence ``b`` of ``B``; all index tensors int32 on the device):

* query rows ``q[q_indptr[b]:q_indptr[b+1]]``;
* KV view: pages ``kv_pages[kv_page_indptr[b]:kv_page_indptr[b+1]]`` in view order, page ``i``
  of the list showing its first ``kv_page_lens[i]`` slots (1..page_size; ANY page may be
  partial, not only the last: a sealed fork point or a spliced child's last page, see
  the engine's block manager); ``kv_lens[b]`` = the view's total visible tokens;
* the sequence's ``q_len`` new tokens are the LAST ``q_len`` tokens of the view, causal among
  themselves: query ``i`` sees view tokens ``j <= kv_len - q_len + i``;
* GQA: query head ``h`` reads KV head ``h // (Hq // Hkv)``.

Kernel (FlashAttention-2, Dao 2023, algorithm 1: online softmax with a running max and sum,
rescaled accumulator, one normalization at the end; base-2 exponentials with the scale folded
into ``log2(e)``, as in the Triton fused-attention tutorial and FlashInfer):

* grid ``(cdiv(max_q_len * G, BLOCK_M), Hkv, B)`` with ``G = Hq / Hkv`` (the GQA group size);
  program ``(m, kvh, b)`` takes the query rows ``m*BLOCK_M ..`` of sequence ``b``, flattened as
  (token, query head of KV head ``kvh``'s GQA group) pairs so the ``G`` query heads that share a
  KV head share every K/V tile it loads
  (the row packing FlashInfer uses for GQA decode/prefill). Programs past a sequence's
  ``q_len * G`` rows exit at once, so the grid depends only on shapes and the caller's upper
  bound ``max_q_len``, never on lengths read from the device (CUDA-graph friendly).
* the K/V loop walks the page list ``BLOCK_N // PAGE_BLOCK`` pages at a time (``PAGE_BLOCK`` =
  page_size rounded up to a power of two); a tile lane (offset ``tile_off`` in one of the tile's
  pages) is a key iff that offset is below its page's length, and its view position is the
  running count of keys before it
  (a prefix sum over the tile), so partial pages anywhere in the view cost only masked lanes.
  A short pre-scan over the page lengths finds how many pages hold a key visible to the block
  (causal cut-off), so the main loop is a plain counted loop (software-pipelinable).
* per-layer options (:mod:`.attention_options`): a sliding window over logical positions
  (masked per (row, key) from the rows' positions and the KV slots' positions) and an
  attention-logit soft-cap, constexpr switches with runtime values.
"""

from __future__ import annotations

import torch

from . import FLOAT_DTYPES, register_compile_spec, upload_int32  # the package sets TRITON_INTERPRET on CPU first
from .attention_options import check_softcap, check_window, tanh

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

__all__ = ["extend_attention", "extend_attention_reference", "extend_indices"]

_LOG2E = 1.4426950408889634


@triton.jit
def _extend_attn_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, o_ptr,
    q_indptr_ptr, kv_page_indptr_ptr, kv_pages_ptr, kv_page_lens_ptr, kv_lens_ptr,
    qk_scale,  # softmax scale * log2(e), fp32
    stride_qt, stride_qh, stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh,
    stride_ot, stride_oh,
    q_pos_ptr, k_pos_ptr, stride_kpos_p,  # logical positions of the query rows / cache slots (WINDOW)
    window,  # sliding window in tokens (WINDOW)
    cap_log2,  # logit soft-cap * log2(e), fp32 (SOFTCAP)
    GROUP: tl.constexpr,  # query heads per KV head
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,  # next power of two of HEAD_DIM
    BLOCK_M: tl.constexpr,  # flattened (query token, head in group) rows per program
    BLOCK_N: tl.constexpr,  # cache slots per K/V tile (a multiple of PAGE_BLOCK)
    PAGE_BLOCK: tl.constexpr,  # page_size rounded up to a power of two
    SCAN: tl.constexpr,  # page lengths read per pre-scan iteration
    IEEE: tl.constexpr,  # float32 inputs: exact fp32 dot instead of TF32
    WINDOW: tl.constexpr,  # keys at positions <= q_pos - window are masked
    SOFTCAP: tl.constexpr,  # scores -> cap * tanh(scores / cap)
):
    pid_m = tl.program_id(0)
    kvh = tl.program_id(1)
    b = tl.program_id(2)
    q_start = tl.load(q_indptr_ptr + b)
    q_len = tl.load(q_indptr_ptr + b + 1) - q_start
    n_rows = q_len * GROUP
    row0 = pid_m * BLOCK_M
    if row0 < n_rows:
        kv_len = tl.load(kv_lens_ptr + b)
        p_begin = tl.load(kv_page_indptr_ptr + b)
        n_pages = tl.load(kv_page_indptr_ptr + b + 1) - p_begin
        prefix = kv_len - q_len  # view tokens visible to every query of the sequence

        offs_m = row0 + tl.arange(0, BLOCK_M)
        m_ok = offs_m < n_rows
        qi = offs_m // GROUP
        head = kvh * GROUP + offs_m % GROUP
        offs_d = tl.arange(0, BLOCK_D)
        d_ok = offs_d < HEAD_DIM
        q_rows = (q_start + qi).to(tl.int64) * stride_qt + head * stride_qh
        q = tl.load(q_ptr + q_rows[:, None] + offs_d[None, :], mask=m_ok[:, None] & d_ok[None, :], other=0.0)
        limit = prefix + qi  # last visible view position of each row
        if WINDOW:
            q_lo = tl.load(q_pos_ptr + q_start + qi, mask=m_ok, other=0).to(tl.int64) - window
        last_row = tl.minimum(row0 + BLOCK_M, n_rows) - 1
        limit_max = prefix + last_row // GROUP

        # pre-scan: pages whose first token's view position is <= limit_max
        offs_s = tl.arange(0, SCAN)
        need = p_begin * 0
        start = p_begin * 0
        for s0 in range(0, n_pages, SCAN):
            lens = tl.load(kv_page_lens_ptr + p_begin + s0 + offs_s, mask=s0 + offs_s < n_pages, other=0)
            starts = start + tl.cumsum(lens, 0) - lens
            need += tl.sum(((starts <= limit_max) & (s0 + offs_s < n_pages)).to(tl.int32), 0)
            start += tl.sum(lens, 0)

        offs_n = tl.arange(0, BLOCK_N)
        tile_page = offs_n // PAGE_BLOCK
        tile_off = offs_n % PAGE_BLOCK
        m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
        base = p_begin * 0  # view position of the tile's first key
        for p0 in range(0, need, BLOCK_N // PAGE_BLOCK):  # whole pages per K/V tile
            pidx = p0 + tile_page
            p_ok = pidx < need
            page = tl.load(kv_pages_ptr + p_begin + pidx, mask=p_ok, other=0)
            plen = tl.load(kv_page_lens_ptr + p_begin + pidx, mask=p_ok, other=0)
            is_key = tile_off < plen
            key_i32 = is_key.to(tl.int32)
            vpos = base + tl.cumsum(key_i32, 0) - 1
            base += tl.sum(key_i32, 0)

            if BLOCK_D == HEAD_DIM:
                kv_mask = is_key[:, None]
            else:
                kv_mask = is_key[:, None] & d_ok[None, :]
            slot_off_k = page.to(tl.int64) * stride_kp + tile_off * stride_ks + kvh * stride_kh
            k = tl.load(k_cache_ptr + slot_off_k[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
            kt = tl.trans(k.to(q.dtype))  # [BLOCK_D, BLOCK_N]
            if IEEE:
                qk = tl.dot(q, kt, input_precision="ieee")
            else:
                qk = tl.dot(q, kt)
            visible = is_key[None, :] & (vpos[None, :] <= limit[:, None])
            if WINDOW:
                k_pos = tl.load(k_pos_ptr + page.to(tl.int64) * stride_kpos_p + tile_off, mask=is_key,
                                other=0).to(tl.int64)
                visible = visible & (k_pos[None, :] > q_lo[:, None])
            if SOFTCAP:
                qk = cap_log2 * tanh(qk * (qk_scale / cap_log2))
            else:
                qk = qk * qk_scale
            qk = tl.where(visible, qk, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(qk, 1))
            alpha = tl.math.exp2(m_i - m_new)
            p = tl.math.exp2(qk - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)

            slot_off_v = page.to(tl.int64) * stride_vp + tile_off * stride_vs + kvh * stride_vh
            v = tl.load(v_cache_ptr + slot_off_v[:, None] + offs_d[None, :], mask=kv_mask, other=0.0).to(q.dtype)
            if IEEE:
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
            else:
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m_i = m_new

        l_safe = tl.where(l_i > 0.0, l_i, 1.0)
        out = acc / l_safe[:, None]
        o_rows = (q_start + qi).to(tl.int64) * stride_ot + head * stride_oh
        tl.store(o_ptr + o_rows[:, None] + offs_d[None, :], out.to(o_ptr.dtype.element_ty),
                 mask=m_ok[:, None] & d_ok[None, :])


def _tile_config(block_d: int, rows: int, dtype: torch.dtype) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps) for ``rows = max_q_len * group`` flattened query rows.

    Chosen from ptxas register reports for sm_90 (Triton 3.9 and 3.6, bf16): the largest
    row tile that compiles without register spills (BLOCK_M 128 at D=128 spills with this
    kernel's page gathers), small tiles for inserted tags (a few rows). Not yet timed on a GPU.
    """
    if dtype == torch.float32:  # exact IEEE fp32 dot (FMA path): a correctness path, small tiles
        return (16 if rows <= 16 else 32), 32, 4
    if block_d <= 64:
        for bound, cfg in ((16, (16, 32, 4)), (32, (32, 32, 4)), (64, (64, 32, 4))):
            if rows <= bound:
                return cfg
        return 128, 32, 8
    if block_d <= 128:
        return (16, 32, 4) if rows <= 16 else (32, 32, 4) if rows <= 32 else (64, 32, 4)
    return (16, 32, 4) if rows <= 16 else (32, 16, 4)


def _check(cond: bool, fn: str, msg: str) -> None:
    if not cond:
        raise ValueError(f"{fn}: {msg}")


def _validate(fn, q, k_cache, v_cache, q_indptr, kv_page_indptr, kv_pages, kv_page_lens, kv_lens, out):
    for name, x, nd in (("q", q, 3), ("k_cache", k_cache, 4), ("v_cache", v_cache, 4), ("q_indptr", q_indptr, 1),
                        ("kv_page_indptr", kv_page_indptr, 1), ("kv_pages", kv_pages, 1),
                        ("kv_page_lens", kv_page_lens, 1), ("kv_lens", kv_lens, 1)):
        _check(isinstance(x, torch.Tensor), fn, f"{name} must be a torch.Tensor, got {type(x).__name__}")
        _check(x.dim() == nd, fn, f"{name} must have {nd} dims, got shape {tuple(x.shape)}")
        _check(x.device == q.device, fn, f"{name} is on {x.device} but q is on {q.device}")
    t, hq, d = q.shape
    _check(q.dtype in FLOAT_DTYPES, fn, f"q dtype must be float16, bfloat16 or float32, got {q.dtype}")
    _check(k_cache.dtype in FLOAT_DTYPES, fn, f"k_cache dtype must be float16, bfloat16 or float32, got {k_cache.dtype}")
    _check(v_cache.dtype == k_cache.dtype, fn, f"v_cache dtype {v_cache.dtype} != k_cache dtype {k_cache.dtype}")
    _check(tuple(v_cache.shape) == tuple(k_cache.shape), fn,
           f"v_cache shape {tuple(v_cache.shape)} != k_cache shape {tuple(k_cache.shape)}")
    hkv = k_cache.shape[2]
    _check(k_cache.shape[3] == d, fn, f"cache head_dim {k_cache.shape[3]} != q head_dim {d} "
                                      f"(caches are [num_pages, page_size, Hkv, D])")
    _check(hkv >= 1 and hq % hkv == 0, fn, f"Hq={hq} must be a positive multiple of Hkv={hkv}")
    for name, x in (("q_indptr", q_indptr), ("kv_page_indptr", kv_page_indptr), ("kv_pages", kv_pages),
                    ("kv_page_lens", kv_page_lens), ("kv_lens", kv_lens)):
        _check(x.dtype == torch.int32, fn, f"{name} must be int32, got {x.dtype}")
    nb = kv_lens.shape[0]
    _check(q_indptr.shape[0] == nb + 1, fn, f"q_indptr has {q_indptr.shape[0]} entries, need B+1={nb + 1} (B from kv_lens)")
    _check(kv_page_indptr.shape[0] == nb + 1, fn,
           f"kv_page_indptr has {kv_page_indptr.shape[0]} entries, need B+1={nb + 1} (B from kv_lens)")
    _check(kv_page_lens.shape[0] == kv_pages.shape[0], fn,
           f"kv_page_lens has {kv_page_lens.shape[0]} entries but kv_pages has {kv_pages.shape[0]}")
    if out is not None:
        _check(isinstance(out, torch.Tensor) and tuple(out.shape) == (t, hq, d) and out.dtype == q.dtype
               and out.device == q.device, fn, f"out must be a [{t}, {hq}, {d}] {q.dtype} tensor on {q.device}")
    for name, x in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)) + ((("out", out),) if out is not None else ()):
        _check(x.stride(-1) == 1, fn, f"{name} must have a unit stride in its last dim, got strides {x.stride()}")


def extend_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    q_indptr: torch.Tensor,
    kv_page_indptr: torch.Tensor,
    kv_pages: torch.Tensor,
    kv_page_lens: torch.Tensor,
    kv_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
    *,
    max_q_len: int | None = None,
    block_m: int | None = None,
    block_n: int | None = None,
    sliding_window: int | None = None,
    logit_softcap: float | None = None,
    q_positions: torch.Tensor | None = None,
    key_positions: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of each sequence's new tokens over its paged KV view (module docstring).

    Args:
        q: ``[Tq, Hq, D]`` float16/bfloat16/float32 (rotated queries), unit last stride; the
            rows of sequence ``b`` are ``q_indptr[b]:q_indptr[b+1]``.
        k_cache, v_cache: ``[num_pages, page_size, Hkv, D]`` ("NHD", one layer), same dtype as
            each other (cast to q's dtype in the kernel), unit last stride; ``Hq % Hkv == 0``.
        q_indptr: ``[B+1]`` int32, non-decreasing, ``q_indptr[B] <= Tq``.
        kv_page_indptr: ``[B+1]`` int32 offsets into ``kv_pages``/``kv_page_lens``.
        kv_pages: ``[N]`` int32 page ids, each sequence's pages in view order.
        kv_page_lens: ``[N]`` int32 visible slots of each listed page, 1..page_size.
        kv_lens: ``[B]`` int32, ``kv_lens[b] = sum`` of the sequence's page lengths,
            ``>= q_len``.
        scale: softmax scale (usually ``D ** -0.5``).
        out: optional ``[Tq, Hq, D]`` output of q's dtype, unit last stride.
        max_q_len: upper bound on every sequence's ``q_len`` (sizes the grid; default ``Tq``,
            which needs no host sync). Pass a fixed bound when capturing CUDA graphs.
        block_m, block_n: tile sizes override (powers of two >= 16; tests and tuning).
        sliding_window: query row ``t`` sees only the keys whose logical position is
            ``> q_positions[t] - sliding_window`` (tokens); None: no window.
        logit_softcap: scores ``s = q k^T * scale`` become ``cap * tanh(s / cap)`` before the
            softmax (Gemma 2); None: no cap.
        q_positions: ``[Tq]`` int64/int32 logical position of each query row (with ``sliding_window``).
        key_positions: ``[num_pages, page_size]`` int32 logical position of every cache slot,
            unit last stride (with ``sliding_window``).

    Returns:
        ``[Tq, Hq, D]`` in q's dtype: ``softmax(q k^T * scale) v`` over each row's visible
        keys, accumulated in float32 (FlashAttention-2 online softmax, base-2 exponentials).
        Rows not covered by ``q_indptr`` are left untouched.

    Raises:
        ValueError: a shape, dtype, stride or device mismatch, named in the message (missing or
        malformed inputs of ``sliding_window``/``logit_softcap`` name the option). Index
        VALUES are not checked (that would sync with the host); see
        :func:`extend_attention_reference` for a checked host-side version.
    """
    fn = "extend_attention"
    _validate(fn, q, k_cache, v_cache, q_indptr, kv_page_indptr, kv_pages, kv_page_lens, kv_lens, out)
    t, hq, d = q.shape
    hkv = k_cache.shape[2]
    group = hq // hkv
    nb = kv_lens.shape[0]
    if out is None:
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
    if max_q_len is None:
        max_q_len = t
    _check(isinstance(max_q_len, int) and max_q_len >= 0, fn, f"max_q_len must be an int >= 0, got {max_q_len!r}")
    window = check_window(sliding_window, q_positions, key_positions, t, k_cache, fn)
    cap_log2 = check_softcap(logit_softcap, fn) * _LOG2E
    if t == 0 or nb == 0 or max_q_len == 0:
        return out
    block_d = max(16, triton.next_power_of_2(d))
    page_block = triton.next_power_of_2(k_cache.shape[1])
    rows = max_q_len * group
    auto_m, auto_n, num_warps = _tile_config(block_d, rows, q.dtype)
    block_m = block_m or auto_m
    block_n = max(block_n or auto_n, page_block)
    for name, x in (("block_m", block_m), ("block_n", block_n)):
        _check(x >= 16 and x & (x - 1) == 0, fn, f"{name} must be a power of two >= 16, got {x}")
    grid = (triton.cdiv(rows, block_m), hkv, nb)
    _check(grid[2] <= 65535, fn, f"B={nb} sequences exceed the grid limit 65535")
    _extend_attn_kernel[grid](
        q, k_cache, v_cache, out,
        q_indptr, kv_page_indptr, kv_pages, kv_page_lens, kv_lens,
        float(scale) * _LOG2E,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        out.stride(0), out.stride(1),
        q_positions if window else q_indptr, key_positions if window else q_indptr,
        key_positions.stride(0) if window else 0, window, cap_log2,
        GROUP=group, HEAD_DIM=d, BLOCK_D=block_d, BLOCK_M=block_m, BLOCK_N=block_n, PAGE_BLOCK=page_block,
        SCAN=128, IEEE=q.dtype == torch.float32, WINDOW=bool(window), SOFTCAP=bool(cap_log2),
        num_warps=num_warps if block_m == auto_m else 4, num_stages=2,
    )
    return out


def extend_attention_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    q_indptr: torch.Tensor,
    kv_page_indptr: torch.Tensor,
    kv_pages: torch.Tensor,
    kv_page_lens: torch.Tensor,
    kv_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Pure-torch reference for :func:`extend_attention` (same arguments, same result).

    Per sequence: gathers the view's keys/values densely (page order, then slot order), builds
    the causal mask ``j <= kv_len - q_len + i``, and computes softmax attention in float32;
    GQA by repeating KV heads. Host loop; for tests only.

    Raises:
        ValueError: the shape/dtype/device errors of :func:`extend_attention`, and also
        inconsistent index values (page lengths outside 1..page_size, ``kv_lens`` not the sum
        of the page lengths, ``q_len > kv_len``, out-of-range indices).
    """
    fn = "extend_attention_reference"
    _validate(fn, q, k_cache, v_cache, q_indptr, kv_page_indptr, kv_pages, kv_page_lens, kv_lens, out)
    t, hq, d = q.shape
    num_pages, page_size, hkv, _ = k_cache.shape
    group = hq // hkv
    qp, pp = q_indptr.tolist(), kv_page_indptr.tolist()
    pages, plens, klens = kv_pages.tolist(), kv_page_lens.tolist(), kv_lens.tolist()
    if out is None:
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
    kf = k_cache.reshape(-1, hkv, d)
    vf = v_cache.reshape(-1, hkv, d)
    for b in range(len(klens)):
        q0, q1, p0, p1 = qp[b], qp[b + 1], pp[b], pp[b + 1]
        _check(0 <= q0 <= q1 <= t, fn, f"sequence {b}: q rows {q0}:{q1} outside 0..{t}")
        _check(0 <= p0 <= p1 <= len(pages), fn, f"sequence {b}: page list {p0}:{p1} outside 0..{len(pages)}")
        slots: list[int] = []
        for pg, n in zip(pages[p0:p1], plens[p0:p1]):
            _check(0 <= pg < num_pages, fn, f"sequence {b}: page id {pg} outside 0..{num_pages - 1}")
            _check(1 <= n <= page_size, fn, f"sequence {b}: page {pg} length {n} outside 1..{page_size}")
            slots += range(pg * page_size, pg * page_size + n)
        qn, kn = q1 - q0, klens[b]
        _check(kn == len(slots), fn, f"sequence {b}: kv_lens={kn} but its pages hold {len(slots)} tokens")
        _check(qn <= kn, fn, f"sequence {b}: q_len={qn} > kv_len={kn}")
        if qn == 0:
            continue
        idx = torch.tensor(slots, dtype=torch.long, device=q.device)
        k = kf[idx].float().repeat_interleave(group, dim=1)  # [L, Hq, D]
        v = vf[idx].float().repeat_interleave(group, dim=1)
        s = torch.einsum("qhd,khd->hqk", q[q0:q1].float(), k) * scale
        mask = torch.arange(kn, device=q.device)[None, :] <= (kn - qn + torch.arange(qn, device=q.device))[:, None]
        s = s.masked_fill(~mask[None], float("-inf"))
        out[q0:q1] = torch.einsum("hqk,khd->qhd", torch.softmax(s, dim=-1), v).to(out.dtype)
    return out


def extend_indices(
    q_lens: list[int], pages: list[list[int]], page_lens: list[list[int]], device: torch.device | str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The int32 index tensors of :func:`extend_attention` from per-sequence host lists (the
    fields of the engine's attention metadata).

    Returns ``(q_indptr [B+1], kv_page_indptr [B+1], kv_pages [N], kv_page_lens [N], kv_lens [B])``
    on ``device``. Raises ValueError if the lists disagree in length."""
    if not (len(q_lens) == len(pages) == len(page_lens)):
        raise ValueError(f"extend_indices: {len(q_lens)} q_lens, {len(pages)} page lists, {len(page_lens)} length lists")
    for b, (p, n) in enumerate(zip(pages, page_lens)):
        if len(p) != len(n):
            raise ValueError(f"extend_indices: sequence {b} has {len(p)} pages but {len(n)} page lengths")
    q_indptr = [0]
    for n in q_lens:
        q_indptr.append(q_indptr[-1] + n)
    p_indptr = [0]
    for p in pages:
        p_indptr.append(p_indptr[-1] + len(p))

    def i32(x):
        return upload_int32(x, device)

    return (i32(q_indptr), i32(p_indptr), i32([x for p in pages for x in p]),
            i32([x for n in page_lens for x in n]), i32([sum(n) for n in page_lens]))


def _register() -> None:
    sig = {
        "q_ptr": "*bf16", "k_cache_ptr": "*bf16", "v_cache_ptr": "*bf16", "o_ptr": "*bf16",
        "q_indptr_ptr": "*i32", "kv_page_indptr_ptr": "*i32", "kv_pages_ptr": "*i32",
        "kv_page_lens_ptr": "*i32", "kv_lens_ptr": "*i32", "qk_scale": "fp32",
        **{n: "i32" for n in ("stride_qt", "stride_qh", "stride_kp", "stride_ks", "stride_kh", "stride_vp",
                              "stride_vs", "stride_vh", "stride_ot", "stride_oh")},
        "q_pos_ptr": "*i64", "k_pos_ptr": "*i32", "stride_kpos_p": "i32", "window": "i32", "cap_log2": "fp32",
        **{n: "constexpr" for n in ("GROUP", "HEAD_DIM", "BLOCK_D", "BLOCK_M", "BLOCK_N", "PAGE_BLOCK", "SCAN", "IEEE",
                                    "WINDOW", "SOFTCAP")},
    }
    # the tiles extend_attention picks for a prompt prefill (thousands of rows) and an inserted
    # tag (a few rows), page_size 16: Llama-3-8B and Qwen3-8B (D=128, group 4), SmolLM2-135M
    # (D=64, group 3), Gemma-7B (D=256, group 1), Gemma-2-9B's sliding layers (D=256, group 2,
    # window and soft-cap), Phi-3-mini (D=96 in a 128-wide tile, group 1, window), and the test
    # suite's tiny models (D=4 in a 16-wide tile: tl.dot needs K >= 16)
    for d, group, window, softcap in ((128, 4, False, False), (64, 3, False, False), (256, 1, False, False),
                                      (256, 2, True, True), (96, 1, True, False), (4, 2, False, False)):
        block_d = max(16, triton.next_power_of_2(d))
        for rows in (4096, 12):
            bm, bn, _ = _tile_config(block_d, rows, torch.bfloat16)
            options = " window" * window + " softcap" * softcap
            register_compile_spec(
                f"extend_attn bf16 D={d} group={group} BLOCK_M={bm} BLOCK_N={bn}{options}", _extend_attn_kernel, sig,
                {"GROUP": group, "HEAD_DIM": d, "BLOCK_D": block_d, "BLOCK_M": bm, "BLOCK_N": bn, "PAGE_BLOCK": 16,
                 "SCAN": 128, "IEEE": False, "WINDOW": window, "SOFTCAP": softcap},
            )


_register()
