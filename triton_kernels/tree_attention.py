"""Tree decode attention: every single-token query of a step over its paged KV view, one launch.

The forked threads of a PASTA request share KV segments (the prompt, the main thread up to each
fork, joined chunks) and own private ones. The host sorts the step's pages by *which query
rows see them* (:func:`build_plan`): a *row set* is a list of pages and the query rows that all
see them (at most ``max_rows_per_item`` rows; not to be confused with a *GQA group*, the query
heads that share one KV head). A *work item* is a row set and a range of its pages. One program
per (work item, KV head) then

* loads the queries of the row set's rows for that KV head's GQA group as one tile
  (rows = threads x query heads of the GQA group, padded to a power of two >= 16),
* streams the work item's pages once (``BLOCK_N`` tokens per iteration, gathered through the
  page list, masked by each page's used length; pages in the middle of a list may be partial)
  and multiplies each K/V tile with all those queries at once (tensor-core ``tl.dot``; float32
  inputs use exact IEEE fp32 dots, the ``IEEE`` constexpr, not TF32, as the extend kernel),
* keeps a FlashAttention-2 online softmax in fp32 with ``exp2`` (Dao 2023, section 3.1), and
* writes a *split-KV partial* (output and natural-log log-sum-exp) per (row, head).

Work is split along the KV length too (FlashDecoding's split-KV, Dao et al. 2023): a row set's
pages are cut into chunks so that a batch-1 request still fills the GPU. Partials of a row are
folded in the same launch: after storing its partials a program increments a per-(row, KV head)
counter; the program that brings it to the row's partial count merges them by the log-sum-exp
rule (as FlashInfer's ``merge_state``), writes the output and resets the counter to zero for
the next launch. Rows with a single partial are written directly. The ``MERGE_*`` constants
below name these cases. ``merge="separate"`` instead
runs a second small kernel for the merge, and a callable ``merge`` (the CUDA extension's
``lse_merge``, say) is handed every row's partials (both kept to measure which is cheapest on
the GPU). The partial buffers and counters are scratch memory the caller owns
(:class:`DecodeWorkspace`), as SGLang's decode kernel takes them.

The same kernel is the *plain* path: with ``mode="plain"`` every row is its own row set over its
whole view, which is FlashDecoding-style per-thread paged attention. ``mode="auto"`` picks
tree or plain with a bytes-read cost model (:func:`choose_mode`).

CUDA graphs: the grid is ``(max_work, num_kv_heads)`` from an upper bound; programs past the
device-side work count exit at once, and ``split`` is a runtime value, so a captured launch
serves any context length up to its capacity.

Per-layer options (:mod:`.attention_options`): a sliding window over logical positions (each
row of a row set has its own position, so the mask is per (row, key)) and an attention-logit
soft-cap, both constexpr switches with runtime values. Any ``head_dim`` runs in a
power-of-two tile (``BLOCK_D``, masked: 96 for Phi-3-mini), any GQA group including 1.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch

from . import FLOAT_DTYPES, INTERPRET, register_compile_spec, upload_int32  # noqa: F401  (INTERPRET: the mode the kernels run in)
from .attention_options import check_softcap, check_window, tanh

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

__all__ = [
    "DecodePlan",
    "StaticDecodePlan",
    "DecodeWorkspace",
    "build_plan",
    "upload_plan",
    "plan_lists",
    "choose_mode",
    "tree_decode_attention",
]

LN2 = math.log(2.0)
LOG2E = 1.0 / LN2

# How a launch merges each row's split-KV partials (the kernels' ``MERGE`` constexpr; the
# launcher passes ``.value``). A partial is a row's softmax-normalized output and natural-log
# log-sum-exp over one work item's pages; the partials of a row are folded by the log-sum-exp
# rule ``o = sum_i exp(lse_i - m) o_i / sum_i exp(lse_i - m)``, ``m = max_i lse_i``
# (FlashDecoding's split-KV reduction, Dao et al. 2023; FlashInfer's ``merge_state``).
#: every row has one partial: written straight to the output, no partial buffer traffic
MERGE_NONE = tl.constexpr(0)
#: in the same launch: the last program to deliver a row's partial merges them (``merge="inline"``)
MERGE_INLINE = tl.constexpr(1)
#: partials of multi-partial rows are stored and :func:`_merge_kernel` merges them (``merge="separate"``)
MERGE_SEPARATE = tl.constexpr(2)
#: every row's partials are stored, single ones too, for a callable ``merge`` (the CUDA extension's ``lse_merge``)
MERGE_EXTERNAL = tl.constexpr(3)


@triton.jit
def _merge_row(
    O, stride_ot, stride_oh, PART_O, PART_LSE, ROW_PART_START, ROW_PARTS, r, nparts, h,
    HQ: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """Fold the ``nparts`` partials of query row ``r`` for KV head ``h``'s query heads."""
    offs_g = tl.arange(0, GROUP_PAD)
    offs_d = tl.arange(0, BLOCK_D)
    dval = offs_d < D
    gval = offs_g < GROUP
    qh = h * GROUP + offs_g
    p0 = tl.load(ROW_PART_START + r)
    m = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    for i in range(0, nparts):
        part = tl.load(ROW_PARTS + p0 + i).to(tl.int64)
        lse = tl.load(PART_LSE + part * HQ + qh, mask=gval, other=float("-inf"), cache_modifier=".cg")
        m = tl.maximum(m, lse)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    den = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, BLOCK_D], tl.float32)
    for i in range(0, nparts):
        part = tl.load(ROW_PARTS + p0 + i).to(tl.int64)
        lse = tl.load(PART_LSE + part * HQ + qh, mask=gval, other=float("-inf"), cache_modifier=".cg")
        w = tl.exp(lse - m_safe)
        o = tl.load(PART_O + (part * HQ + qh[:, None]) * D + offs_d[None, :], mask=gval[:, None] & dval[None, :],
                    other=0.0, cache_modifier=".cg")
        acc += w[:, None] * o
        den += w
    out = acc / tl.where(den == 0.0, 1.0, den)[:, None]
    rr = r.to(tl.int64)
    tl.store(O + rr * stride_ot + qh[:, None] * stride_oh + offs_d[None, :], out.to(O.dtype.element_ty),
             mask=gval[:, None] & dval[None, :])


@triton.jit
def _tree_decode_kernel(
    Q, K, V, O,
    stride_qt, stride_qh, stride_kp, stride_ks, stride_kh, stride_ot, stride_oh,
    WORK_ROWSET, WORK_LO, WORK_HI, WORK_PART, NUM_WORK,
    ROWSET_ROW_START, ROWSET_NROWS, ROWSET_ROWS,
    PAGES, PAGE_LENS,
    ROW_NPARTS, ROW_PART_START, ROW_PARTS,
    PART_O, PART_LSE, COUNTERS,
    Q_POS, K_POS, stride_kpos_p,
    sm_scale_log2, window, cap_log2,
    HKV: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
    PAGE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, MERGE: tl.constexpr,
    WINDOW: tl.constexpr, SOFTCAP: tl.constexpr,
    IEEE: tl.constexpr,  # float32 inputs: exact fp32 dots instead of TF32 (as the extend kernel)
):
    w = tl.program_id(0)
    h = tl.program_id(1)
    if w < tl.load(NUM_WORK):
        HQ: tl.constexpr = HKV * GROUP
        rs = tl.load(WORK_ROWSET + w)
        lo = tl.load(WORK_LO + w)
        hi = tl.load(WORK_HI + w)
        part0 = tl.load(WORK_PART + w)
        rstart = tl.load(ROWSET_ROW_START + rs)
        nrows = tl.load(ROWSET_NROWS + rs)

        offs_m = tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, BLOCK_D)
        dval = offs_d < D
        offs_n = tl.arange(0, BLOCK_N)
        j = offs_m // GROUP_PAD
        g = offs_m % GROUP_PAD
        mval = (j < nrows) & (g < GROUP)
        row = tl.load(ROWSET_ROWS + rstart + j, mask=mval, other=0).to(tl.int64)
        qh = h * GROUP + g
        q = tl.load(Q + row[:, None] * stride_qt + qh[:, None] * stride_qh + offs_d[None, :],
                    mask=mval[:, None] & dval[None, :], other=0.0)
        if WINDOW:
            # keys at logical positions <= q_pos - window are outside the row's window
            q_lo = tl.load(Q_POS + row, mask=mval, other=0).to(tl.int64) - window

        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        ntok = (hi - lo) * PAGE
        for start in range(0, ntok, BLOCK_N):
            t = start + offs_n
            pi = lo + t // PAGE
            off = t % PAGE
            inr = pi < hi
            page = tl.load(PAGES + pi, mask=inr, other=0).to(tl.int64)
            plen = tl.load(PAGE_LENS + pi, mask=inr, other=0)
            valid = inr & (off < plen)
            kv_off = page * stride_kp + off * stride_ks + h * stride_kh
            k = tl.load(K + kv_off[:, None] + offs_d[None, :], mask=valid[:, None] & dval[None, :], other=0.0)
            if IEEE:
                s = tl.dot(q, tl.trans(k), input_precision="ieee")
            else:
                s = tl.dot(q, tl.trans(k))
            if SOFTCAP:
                s = cap_log2 * tanh(s * (sm_scale_log2 / cap_log2))
            else:
                s = s * sm_scale_log2
            if WINDOW:
                k_pos = tl.load(K_POS + page * stride_kpos_p + off, mask=valid, other=0).to(tl.int64)
                s = tl.where(valid[None, :] & (k_pos[None, :] > q_lo[:, None]), s, float("-inf"))
            else:
                s = tl.where(valid[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp2(m_i - m_safe)
            p = tl.exp2(s - m_safe[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(V + kv_off[:, None] + offs_d[None, :], mask=valid[:, None] & dval[None, :], other=0.0)
            if IEEE:
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
            else:
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m_i = m_new

        l_safe = tl.where(l_i == 0.0, 1.0, l_i)
        o = acc / l_safe[:, None]
        nparts = tl.load(ROW_NPARTS + row, mask=mval, other=1)
        direct = mval & (nparts == 1) & (MERGE != MERGE_EXTERNAL)
        tl.store(O + row[:, None] * stride_ot + qh[:, None] * stride_oh + offs_d[None, :],
                 o.to(O.dtype.element_ty), mask=direct[:, None] & dval[None, :])
        if MERGE != MERGE_NONE:
            lse = tl.where(l_i == 0.0, float("-inf"), (m_i + tl.log2(l_safe)) * 0.6931471805599453)
            part = (part0 + j).to(tl.int64)
            pm = mval & ((nparts > 1) | (MERGE == MERGE_EXTERNAL))
            tl.store(PART_O + (part[:, None] * HQ + qh[:, None]) * D + offs_d[None, :], o, mask=pm[:, None] & dval[None, :])
            tl.store(PART_LSE + part * HQ + qh, lse, mask=pm)
            if MERGE == MERGE_INLINE:
                # In-launch merge: the last program to deliver a partial of a row folds them.
                tl.debug_barrier()
                for jj in range(0, nrows):
                    r = tl.load(ROWSET_ROWS + rstart + jj)
                    np_r = tl.load(ROW_NPARTS + r)
                    if np_r > 1:
                        cnt = tl.atomic_add(COUNTERS + r * HKV + h, 1, sem="acq_rel")
                        if cnt == np_r - 1:
                            _merge_row(O, stride_ot, stride_oh, PART_O, PART_LSE, ROW_PART_START, ROW_PARTS,
                                       r, np_r, h, HQ, GROUP, GROUP_PAD, D, BLOCK_D)
                            tl.atomic_xchg(COUNTERS + r * HKV + h, 0, sem="relaxed")


@triton.jit
def _merge_kernel(
    O, stride_ot, stride_oh, PART_O, PART_LSE, ROW_NPARTS, ROW_PART_START, ROW_PARTS, NUM_ROWS,
    HKV: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
):
    r = tl.program_id(0)
    h = tl.program_id(1)
    if r < tl.load(NUM_ROWS):
        np_r = tl.load(ROW_NPARTS + r)
        if np_r > 1:
            _merge_row(O, stride_ot, stride_oh, PART_O, PART_LSE, ROW_PART_START, ROW_PARTS, r, np_r, h,
                       HKV * GROUP, GROUP, GROUP_PAD, D, BLOCK_D)


# --------------------------------------------------------------------------- host side

#: One KV segment of a row's view: ``(segment id, pages, page lens)`` (the same tuple as
#: :data:`pasta_engine.layers.attention.Run`; this package is a leaf and imports no engine code).
Run = tuple[int, list[int], list[int]]
View = list[Run]  # a query row's KV view: its runs, in view order


@dataclass
class DecodePlan:
    """Device-side description of one step's decode attention (built by :func:`build_plan`).

    Work items ``w``: row set ``work_rowset[w]``, pages ``pages[work_lo[w]:work_hi[w]]``,
    index of its first split-KV partial ``work_part[w]`` (its rows' partials are
    ``work_part[w] + j``, ``j`` the row's place in the row set). Row sets ``s``: rows
    ``rowset_rows[rowset_row_start[s] : + rowset_nrows[s]]`` (indices into the query tensor).
    Per query row ``r``: ``row_nparts[r]`` partials, at the partial indices
    ``row_parts[row_part_start[r] : + row_nparts[r]]`` (``row_indptr``: the same starts with
    the end appended, CSR style). All int32 on the device;
    ``num_work``/``num_rows`` are 1-element device tensors. ``partials`` is False when every
    row has one partial (no partial buffer traffic at all). ``rows``/``group``: the query rows
    and GQA group a step's plan was built for (checked by :func:`tree_decode_attention`); None
    marks a capacity plan (:class:`StaticDecodePlan`), whose loads check them instead."""

    work_rowset: torch.Tensor
    work_lo: torch.Tensor
    work_hi: torch.Tensor
    work_part: torch.Tensor
    num_work: torch.Tensor
    rowset_row_start: torch.Tensor
    rowset_nrows: torch.Tensor
    rowset_rows: torch.Tensor
    pages: torch.Tensor
    page_lens: torch.Tensor
    row_nparts: torch.Tensor
    row_part_start: torch.Tensor
    row_parts: torch.Tensor
    row_indptr: torch.Tensor
    num_rows: torch.Tensor
    n_work: int  # host copies (the grid uses capacities when captured)
    n_parts: int
    block_m: int
    mode: str
    partials: bool
    pages_read: int  # pages streamed per KV head (for bytes-read accounting)
    grid_work: int | None = None  # programs to launch along work items (a capacity when captured)
    rows: int | None = None  # query rows the plan was built for (None: a capacity plan, checked by its load)
    group: int | None = None  # the GQA group it was built for (None: a capacity plan)


PLAN_ARRAYS = (
    "work_rowset", "work_lo", "work_hi", "work_part", "num_work", "rowset_row_start", "rowset_nrows", "rowset_rows",
    "pages", "page_lens", "row_nparts", "row_part_start", "row_parts", "row_indptr", "num_rows",
)


def _next_pow2(x: int) -> int:
    return 1 << max(0, (x - 1).bit_length())


def _rowsets(views: list[View], mode: str) -> list[tuple[list[int], list[int], list[int]]]:
    """(rows, pages, page lens) per row set: the pages seen by exactly the same rows (tree) or
    each row's whole view (plain); not yet cut to ``max_rows_per_item`` rows."""
    if mode == "plain":
        return [([r], [p for _, ps, _ in v for p in ps], [n for _, _, ns in v for n in ns]) for r, v in enumerate(views)]
    seen: dict[int, list[int]] = {}
    data: dict[int, tuple[list[int], list[int]]] = {}
    for r, v in enumerate(views):
        for sid, ps, ns in v:
            seen.setdefault(sid, []).append(r)
            data[sid] = (ps, ns)
    by_rows: dict[tuple[int, ...], tuple[list[int], list[int]]] = {}
    for sid, rows in seen.items():
        ps, ns = data[sid]
        acc = by_rows.setdefault(tuple(rows), ([], []))
        acc[0].extend(ps)
        acc[1].extend(ns)
    return [(list(rows), ps, ns) for rows, (ps, ns) in by_rows.items() if ps]


def choose_mode(views: list[View]) -> str:
    """``tree`` when sharing pages among row sets saves at least a fifth of the KV pages read,
    else ``plain``.

    Cost model: decode attention is bandwidth-bound, so its cost is the pages streamed; the
    tree path reads a shared page once instead of once per row, and pays partial results and a
    merge per row and row set, which pays off only with real sharing (a long shared prefix)."""
    plain = sum(len(ps) for v in views for _, ps, _ in v)
    tree = sum(len(ps) for _, ps, _ in _rowsets(views, "tree"))
    return "tree" if tree <= 0.8 * plain else "plain"


def build_plan(views: list[View], *, device: torch.device | str, **options) -> DecodePlan:
    """Describe a step's decode attention for :func:`tree_decode_attention`: the lists of
    :func:`plan_lists` (same arguments) as int32 tensors on ``device``, copied without a
    host-device sync. Raises what :func:`plan_lists` raises."""
    arrays, info = plan_lists(views, device=device, **options)
    return upload_plan(arrays, info, device)


def upload_plan(arrays: dict[str, list[int]], info: dict, device: torch.device | str) -> DecodePlan:
    """The :class:`DecodePlan` of :func:`plan_lists`' result: each list as an int32 tensor on
    ``device`` (an empty list as ``[0]``), copied without a host-device sync."""
    dev = torch.device(device)
    return DecodePlan(**{k: upload_int32(v if v else [0], dev) for k, v in arrays.items()}, **info)


def plan_lists(
    views: list[View],
    *,
    group: int,
    num_kv_heads: int,
    device: torch.device | str,
    mode: str = "auto",
    target_work: int | None = None,
    max_rows_per_item: int = 16,
    block_m: int | None = None,
) -> tuple[dict[str, list[int]], dict]:
    """Host-side plan of a step's decode attention: int lists named as :data:`PLAN_ARRAYS`
    (work items, row sets, pages, per-row split-KV partials) and the scalar fields of
    :class:`DecodePlan`.

    Args:
        views: per query row, its KV view as :data:`Run` tuples ``(segment id, pages, page
            lens)``; runs with the same segment id are the same pages (shared by those rows).
        group: query heads per KV head (GQA group); num_kv_heads: KV heads.
        device: where the kernel will run (sets the default ``target_work``).
        mode: ``tree`` (row sets: pages by the rows that see them), ``plain`` (each row alone), or
            ``auto`` (:func:`choose_mode`).
        target_work: work items to aim for (default: 4 per SM / KV head on a GPU, 4 on CPU);
            a row set's pages are split into chunks of equal size to reach it (split-KV).
        max_rows_per_item: rows of one row set (more rows sharing pages make several row sets).
        block_m: query-tile rows to use (at least what the largest row set needs; a CUDA
            graph fixes it per bucket).

    Raises ValueError for an empty batch, a row with no page, a run with more or fewer pages
    than page lengths, a too small ``block_m``, an unknown mode, or a ``group``,
    ``num_kv_heads``, ``max_rows_per_item`` or ``target_work`` that is not an int >= 1 (the
    error names it)."""
    if not views:
        raise ValueError("no decode rows")
    for name, val in (("group", group), ("num_kv_heads", num_kv_heads), ("max_rows_per_item", max_rows_per_item),
                      ("target_work", 1 if target_work is None else target_work)):
        if isinstance(val, bool) or not isinstance(val, int) or val < 1:
            raise ValueError(f"{name} must be an int >= 1, got {val!r}")
    for r, v in enumerate(views):  # host lists, one pass: no device sync
        for sid, ps, ns in v:
            if len(ps) != len(ns):
                raise ValueError(f"decode row {r}, segment {sid}: {len(ps)} pages but {len(ns)} page lengths "
                                 "(one length per page)")
        if not any(ps for _, ps, _ in v):
            raise ValueError(f"decode row {r} has an empty KV view")
    if mode == "auto":
        mode = choose_mode(views)
    if mode not in ("tree", "plain"):
        raise ValueError(f"mode must be 'tree', 'plain' or 'auto', got {mode!r}")
    dev = torch.device(device)
    if target_work is None:
        if dev.type == "cuda":
            sms = torch.cuda.get_device_properties(dev).multi_processor_count
            target_work = max(1, 4 * sms // num_kv_heads)
        else:
            target_work = 4
    rowsets = []
    for rows, ps, ns in _rowsets(views, mode):
        for i in range(0, len(rows), max_rows_per_item):
            rowsets.append((rows[i : i + max_rows_per_item], ps, ns))
    total = sum(len(ps) for _, ps, _ in rowsets)
    split = max(1, math.ceil(total / target_work))

    pages: list[int] = []
    lens: list[int] = []
    rs_row_start, rs_nrows, rs_rows = [], [], []
    w_rowset, w_lo, w_hi, w_part = [], [], [], []
    row_items: list[list[int]] = [[] for _ in views]  # partial indices per row
    n_parts = 0
    for si, (rows, ps, ns) in enumerate(rowsets):
        base = len(pages)
        pages += ps
        lens += ns
        rs_row_start.append(len(rs_rows))
        rs_nrows.append(len(rows))
        rs_rows += rows
        for lo in range(0, len(ps), split):
            w_rowset.append(si)
            w_lo.append(base + lo)
            w_hi.append(base + min(lo + split, len(ps)))
            w_part.append(n_parts)
            for j, r in enumerate(rows):
                row_items[r].append(n_parts + j)
            n_parts += len(rows)
    row_nparts = [len(x) for x in row_items]
    row_part_start = [0]
    for x in row_items[:-1]:
        row_part_start.append(row_part_start[-1] + len(x))
    row_parts = [s for x in row_items for s in x]
    need_m = max(16, _next_pow2(max(rs_nrows) * _next_pow2(group)))
    if block_m is not None and block_m < need_m:
        raise ValueError(f"block_m={block_m} is smaller than the {need_m} query rows a work item needs")
    arrays = dict(
        work_rowset=w_rowset, work_lo=w_lo, work_hi=w_hi, work_part=w_part, num_work=[len(w_rowset)],
        rowset_row_start=rs_row_start, rowset_nrows=rs_nrows, rowset_rows=rs_rows, pages=pages, page_lens=lens,
        row_nparts=row_nparts, row_part_start=row_part_start, row_parts=row_parts,
        row_indptr=row_part_start + [len(row_parts)], num_rows=[len(views)],
    )
    info = dict(n_work=len(w_rowset), n_parts=n_parts, block_m=block_m or need_m, mode=mode,
                partials=any(n > 1 for n in row_nparts), pages_read=total, rows=len(views), group=group)
    return arrays, info


class StaticDecodePlan:
    """Fixed-size device buffers for plans, for CUDA graphs: a captured launch reads them, and
    each step :meth:`load` copies the step's plan in (no allocation; on CUDA from pinned host
    buffers, which a load rewrites only after the previous load's copies out of them are done).

    Args:
        max_rows: query rows (the largest bucket); max_work, max_parts, max_pages: capacities;
        block_m: the query tile of the captured kernel; device: CUDA device."""

    def __init__(self, max_rows: int, max_work: int, max_parts: int, max_pages: int, block_m: int, device):
        sizes = dict(work_rowset=max_work, work_lo=max_work, work_hi=max_work, work_part=max_work, num_work=1,
                     rowset_row_start=max_work, rowset_nrows=max_work, rowset_rows=max_work * 16, pages=max_pages,
                     page_lens=max_pages, row_nparts=max_rows, row_part_start=max_rows, row_parts=max_parts,
                     row_indptr=max_rows + 1, num_rows=1)
        self.sizes = sizes
        self._cuda = torch.device(device).type == "cuda"
        self.tensors = {k: torch.zeros(n, dtype=torch.int32, device=device) for k, n in sizes.items()}
        self.host = {k: torch.zeros(n, dtype=torch.int32, pin_memory=self._cuda) for k, n in sizes.items()}
        # recorded after the last load's copies out of self.host (CUDA): the next load waits for it
        # before rewriting them (a step that syncs nothing else would not order them)
        self._copied = None
        self.plan = DecodePlan(**self.tensors, n_work=max_work, n_parts=max_parts, block_m=block_m, mode="static",
                               partials=True, pages_read=0, grid_work=max_work)

    def load(self, arrays: dict[str, list[int]], info: dict) -> bool:
        """Copy a step's plan in; False (nothing copied) when it exceeds a capacity or needs a
        bigger query tile. On CUDA the copies are asynchronous: the host buffers are rewritten
        only once the previous load's copies are done (an event; done already when a step since
        synced with the device)."""
        if info["block_m"] > self.plan.block_m or any(len(v) > self.sizes[k] for k, v in arrays.items()):
            return False
        if self._copied is not None:
            self._copied.synchronize()  # the previous load's copies have read self.host
        for k, v in arrays.items():
            if v:
                self.host[k][: len(v)] = torch.tensor(v, dtype=torch.int32)
                self.tensors[k][: len(v)].copy_(self.host[k][: len(v)], non_blocking=True)
        if self._cuda:
            self._copied = torch.cuda.Event()
            self._copied.record()
        self.plan.pages_read = info["pages_read"]
        return True


class DecodeWorkspace:
    """Scratch memory of :func:`tree_decode_attention`: split-KV partial results (float32
    outputs ``[parts, Hq, D]`` and natural-log LSEs ``[parts, Hq]``, indexed by partial index)
    and per-(row, KV head) merge counters ``[rows, Hkv]`` int32. Owned by the caller and reused
    across launches (grown on demand; a CUDA graph sizes it to capacity before capture). The
    counters are left at zero by every in-launch merge."""

    def __init__(self) -> None:
        self.part_o: torch.Tensor | None = None
        self.part_lse: torch.Tensor | None = None
        self.counters: torch.Tensor | None = None

    def get(self, n_parts: int, n_rows: int, hq: int, hkv: int, d: int, device: torch.device):
        """The buffers, grown to ``n_parts`` partials and ``n_rows`` rows when smaller."""
        if self.part_o is None or self.part_o.shape[0] < n_parts or self.part_o.shape[1:] != (hq, d) \
                or self.part_o.device != device:
            self.part_o = torch.empty((max(n_parts, 1), hq, d), dtype=torch.float32, device=device)
            self.part_lse = torch.empty((max(n_parts, 1), hq), dtype=torch.float32, device=device)
        if self.counters is None or self.counters.shape[0] < n_rows or self.counters.shape[1] != hkv \
                or self.counters.device != device:
            self.counters = torch.zeros((max(n_rows, 1), hkv), dtype=torch.int32, device=device)
        return self.part_o, self.part_lse, self.counters



def tree_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    plan: DecodePlan,
    scale: float,
    out: torch.Tensor | None = None,
    merge: str | Callable = "inline",
    block_n: int = 64,
    grid_work: int | None = None,
    workspace: DecodeWorkspace | None = None,
    *,
    sliding_window: int | None = None,
    logit_softcap: float | None = None,
    q_positions: torch.Tensor | None = None,
    key_positions: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of single-token queries over their paged KV views, in one launch.

    Args:
        q: ``[R, Hq, D]`` (fp16/bf16/fp32; row r is the query whose view is the plan's row r;
            strided rows allowed, last dim contiguous).
        k_cache, v_cache: ``[num_pages, page_size, Hkv, D]`` of q's dtype, with the same strides.
        plan: :func:`build_plan` for these rows.
        scale: softmax scale (``head_dim ** -0.5`` for Llama).
        out: ``[R, Hq, D]`` output of q's dtype and device, last dim contiguous (allocated when
            None).
        merge: ``inline``, ``separate``, or a callable
            ``merge(part_o, part_lse, row_indptr, row_parts, out)`` given every row's partials
            (see the module docstring).
        block_n: KV tokens per inner iteration: a power of two >= 16 (``tl.arange`` and
            ``tl.dot`` tiles).
        grid_work: launch this many work programs (a capacity for CUDA graphs; default the plan's;
            at least the plan's work items).
        workspace: scratch buffers (:class:`DecodeWorkspace`); None allocates them for this call.
        sliding_window: row r sees only the keys whose logical position is
            ``> q_positions[r] - sliding_window`` (tokens); None: no window.
        logit_softcap: scores ``s = q k^T * scale`` become ``cap * tanh(s / cap)`` before the
            softmax (Gemma 2); None: no cap.
        q_positions: ``[R]`` int64/int32 logical position of each row (with ``sliding_window``).
        key_positions: ``[num_pages, page_size]`` int32 logical position of every cache slot, unit
            last stride (with ``sliding_window``).

    Returns ``out``: softmax(q k^T * scale) v per row and head (float32 inputs: IEEE fp32 dots,
    no TF32). Raises ValueError on shape or dtype mismatches (``out`` included; a ``v_cache``
    dtype other than ``k_cache``'s; a dtype other than float16, bfloat16 or float32; no KV
    head), on a ``block_n`` that is not a power of two >= 16, on a step plan built for another
    number of rows or another GQA group than the call's (a capacity plan, ``rows`` None, takes
    padded rows), on a ``grid_work`` below the
    plan's work items, naming
    ``sliding_window``/``logit_softcap`` when their inputs are missing or invalid.

    Example (two threads over a shared 8-token prefix of pages 0-1 and a private page each; runs
    on a GPU, or on the CPU under ``TRITON_INTERPRET=1`` in float16/float32)::

        import torch
        from pasta_engine.triton_kernels.tree_attention import build_plan, tree_decode_attention

        dev = "cuda" if torch.cuda.is_available() else "cpu"
        k = torch.randn(4, 4, 2, 16, dtype=torch.float16, device=dev)  # [pages, page_size, Hkv, D]
        v = torch.randn_like(k)
        q = torch.randn(2, 4, 16, dtype=torch.float16, device=dev)  # [rows, Hq, D]: GQA group 2
        views = [[(0, [0, 1], [4, 4]), (1, [2], [3])],  # row 0: the prefix (segment 0), then its page 2
                 [(0, [0, 1], [4, 4]), (2, [3], [2])]]  # row 1: the same prefix, then its page 3
        plan = build_plan(views, group=2, num_kv_heads=2, device=dev)  # once per step
        out = tree_decode_attention(q, k, v, plan, scale=16 ** -0.5)  # per layer: [2, 4, 16]
    """
    if q.dim() != 3 or k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(f"bad shapes: q {tuple(q.shape)}, k_cache {tuple(k_cache.shape)}, v_cache {tuple(v_cache.shape)}")
    r, hq, d = q.shape
    _, page, hkv, dk = k_cache.shape
    if dk != d or hkv < 1 or hq % hkv:
        raise ValueError(f"q heads {hq} x dim {d} do not fit the cache's {hkv} KV heads x dim {dk}")
    if q.dtype not in FLOAT_DTYPES:
        raise ValueError(f"q dtype must be float16, bfloat16 or float32, got {q.dtype}")
    if q.dtype != k_cache.dtype or v_cache.dtype != k_cache.dtype or k_cache.stride() != v_cache.stride():
        raise ValueError(f"q dtype {q.dtype}, k_cache dtype {k_cache.dtype} and v_cache dtype {v_cache.dtype} must "
                         "be one dtype, and K and V must have the same strides")
    if isinstance(block_n, bool) or not isinstance(block_n, int) or block_n < 16 or block_n & (block_n - 1):
        raise ValueError(f"tree_decode_attention: block_n must be a power of two >= 16 (16, 32, 64, ...), "
                         f"got {block_n!r}")
    if q.stride(-1) != 1 or k_cache.stride(-1) != 1:
        raise ValueError("the last (head_dim) dimension of q and the caches must be contiguous")
    if d < 1:
        raise ValueError(f"head_dim must be >= 1, got {d}")
    window = check_window(sliding_window, q_positions, key_positions, r, k_cache, "tree_decode_attention")
    cap_log2 = check_softcap(logit_softcap, "tree_decode_attention") * LOG2E
    if not (merge in ("inline", "separate") or callable(merge)):
        raise ValueError(f"merge must be 'inline', 'separate' or a callable, got {merge!r}")
    group = hq // hkv
    if plan.rows is not None and r != plan.rows:
        raise ValueError(f"the plan covers {plan.rows} query rows but q has {r}: build the plan for these rows")
    if plan.group is not None and plan.group != group:
        raise ValueError(f"the plan was built for GQA group {plan.group}, the call's is {group} "
                         f"({hq} query heads / {hkv} KV heads): pass group={group} to build_plan")
    if grid_work is not None and grid_work < plan.n_work:
        raise ValueError(f"grid_work={grid_work} is below the plan's {plan.n_work} work items (rows would go "
                         f"unwritten and the merge counters stay set): pass at least {plan.n_work}, or None")
    if out is None:
        out = torch.empty((r, hq, d), dtype=q.dtype, device=q.device)
    elif tuple(out.shape) != (r, hq, d) or out.dtype != q.dtype or out.device != q.device or out.stride(-1) != 1:
        raise ValueError(f"out must be a [{r}, {hq}, {d}] {q.dtype} tensor on {q.device} with a contiguous last "
                         f"dim, got {tuple(out.shape)} {out.dtype} on {out.device}, strides {tuple(out.stride())}")
    group_pad = _next_pow2(group)
    block_d = max(16, _next_pow2(d))
    part_o, part_lse, counters = (workspace or DecodeWorkspace()).get(plan.n_parts, r, hq, hkv, d, q.device)
    if callable(merge):
        merge_mode = MERGE_EXTERNAL
    elif not plan.partials:
        merge_mode = MERGE_NONE
    else:
        merge_mode = MERGE_INLINE if merge == "inline" else MERGE_SEPARATE
    grid = (grid_work or plan.grid_work or plan.n_work, hkv)
    _tree_decode_kernel[grid](
        q, k_cache, v_cache, out,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), out.stride(0), out.stride(1),
        plan.work_rowset, plan.work_lo, plan.work_hi, plan.work_part, plan.num_work,
        plan.rowset_row_start, plan.rowset_nrows, plan.rowset_rows,
        plan.pages, plan.page_lens,
        plan.row_nparts, plan.row_part_start, plan.row_parts,
        part_o, part_lse, counters,
        q_positions if window else plan.num_rows, key_positions if window else plan.num_rows,
        key_positions.stride(0) if window else 0,
        scale * LOG2E, window, cap_log2,
        HKV=hkv, GROUP=group, GROUP_PAD=group_pad, D=d, BLOCK_D=block_d, PAGE=page, BLOCK_M=plan.block_m, BLOCK_N=block_n,
        MERGE=merge_mode.value, WINDOW=bool(window), SOFTCAP=bool(cap_log2), IEEE=q.dtype == torch.float32,
    )
    if merge_mode is MERGE_SEPARATE:
        _merge_kernel[(r, hkv)](
            out, out.stride(0), out.stride(1), part_o, part_lse, plan.row_nparts, plan.row_part_start,
            plan.row_parts, plan.num_rows, HKV=hkv, GROUP=group, GROUP_PAD=group_pad, D=d, BLOCK_D=block_d,
        )
    elif merge_mode is MERGE_EXTERNAL:
        merge(part_o, part_lse, plan.row_indptr, plan.row_parts, out)
    return out


def _register() -> None:
    common = {
        "Q": "*bf16", "K": "*bf16", "V": "*bf16", "O": "*bf16",
        "stride_qt": "i32", "stride_qh": "i32", "stride_kp": "i32", "stride_ks": "i32", "stride_kh": "i32",
        "stride_ot": "i32", "stride_oh": "i32",
        "WORK_ROWSET": "*i32", "WORK_LO": "*i32", "WORK_HI": "*i32", "WORK_PART": "*i32", "NUM_WORK": "*i32",
        "ROWSET_ROW_START": "*i32", "ROWSET_NROWS": "*i32", "ROWSET_ROWS": "*i32",
        "PAGES": "*i32", "PAGE_LENS": "*i32",
        "ROW_NPARTS": "*i32", "ROW_PART_START": "*i32", "ROW_PARTS": "*i32",
        "PART_O": "*fp32", "PART_LSE": "*fp32", "COUNTERS": "*i32",
        "Q_POS": "*i64", "K_POS": "*i32", "stride_kpos_p": "i32",
        "sm_scale_log2": "fp32", "window": "i32", "cap_log2": "fp32",
        "HKV": "constexpr", "GROUP": "constexpr", "GROUP_PAD": "constexpr", "D": "constexpr", "BLOCK_D": "constexpr",
        "PAGE": "constexpr", "BLOCK_M": "constexpr", "BLOCK_N": "constexpr", "MERGE": "constexpr",
        "WINDOW": "constexpr", "SOFTCAP": "constexpr", "IEEE": "constexpr",
    }
    _ALL_MERGES = (MERGE_INLINE, MERGE_SEPARATE, MERGE_EXTERNAL)
    # (name, KV heads, GQA group, head_dim, query tile, window, soft-cap, merges): Llama-3-8B and
    # Qwen3-8B share a specialization (D=128, group 4; Qwen3's q/k norms run before the kernels)
    shapes = (
        ("llama3-8b", 8, 4, 128, 64, False, False, _ALL_MERGES),
        ("smollm2", 3, 3, 64, 64, False, False, _ALL_MERGES),
        ("gemma-7b", 16, 1, 256, 16, False, False, _ALL_MERGES),  # multi-head attention, head_dim 256
        ("gemma-2-9b", 8, 2, 256, 32, True, True, (MERGE_INLINE,)),  # its sliding layers (full layers: WINDOW off)
        ("gemma-2-9b-full", 8, 2, 256, 32, False, True, (MERGE_INLINE,)),
        ("phi-3-mini", 32, 1, 96, 16, True, False, (MERGE_INLINE,)),  # head_dim 96 in a 128-wide tile
    )
    for name, hkv, group, d, bm, window, softcap, merges in shapes:
        block_d = max(16, _next_pow2(d))
        for merge in merges:
            register_compile_spec(
                f"tree_decode[{name},merge={merge.value}]", _tree_decode_kernel, common,
                {"HKV": hkv, "GROUP": group, "GROUP_PAD": _next_pow2(group), "D": d, "BLOCK_D": block_d, "PAGE": 16,
                 "BLOCK_M": bm, "BLOCK_N": 64, "MERGE": merge.value, "WINDOW": window, "SOFTCAP": softcap,
                 "IEEE": False},
            )
        if MERGE_SEPARATE in merges:
            register_compile_spec(
                f"tree_merge[{name}]", _merge_kernel,
                {"O": "*bf16", "stride_ot": "i32", "stride_oh": "i32", "PART_O": "*fp32", "PART_LSE": "*fp32",
                 "ROW_NPARTS": "*i32", "ROW_PART_START": "*i32", "ROW_PARTS": "*i32", "NUM_ROWS": "*i32",
                 "HKV": "constexpr", "GROUP": "constexpr", "GROUP_PAD": "constexpr", "D": "constexpr",
                 "BLOCK_D": "constexpr"},
                {"HKV": hkv, "GROUP": group, "GROUP_PAD": _next_pow2(group), "D": d, "BLOCK_D": block_d},
            )
    # float32 models (tests, a correctness path): exact IEEE fp32 dots, as the wrapper launches them
    register_compile_spec(
        "tree_decode[smollm2-fp32,merge=1]", _tree_decode_kernel,
        {k: v.replace("bf16", "fp32") for k, v in common.items()},
        {"HKV": 3, "GROUP": 3, "GROUP_PAD": 4, "D": 64, "BLOCK_D": 64, "PAGE": 16, "BLOCK_M": 64, "BLOCK_N": 64,
         "MERGE": MERGE_INLINE.value, "WINDOW": False, "SOFTCAP": False, "IEEE": True},
    )


_register()
