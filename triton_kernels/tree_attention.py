"""Tree decode attention: every single-token query of a step over its paged KV view, one launch.

The forked threads of a PASTA request share KV segments (the prompt, the main thread up to each
fork, joined chunks) and own private ones. The host groups the step's pages by *which query
rows see them* (:func:`build_plan`): a group is a run of pages and the rows that all see it.
One program per (work item, KV head) then

* loads the queries of the group's rows for that KV head's GQA group as one tile
  (rows = threads x query heads of the group, padded to a power of two >= 16),
* streams the work item's pages once (``BLOCK_N`` tokens per iteration, gathered through the
  page list, masked by each page's used length; pages in the middle of a list may be partial)
  and multiplies each K/V tile with all those queries at once (tensor-core ``tl.dot``),
* keeps a FlashAttention-2 online softmax in fp32 with ``exp2`` (Dao 2023, section 3.1), and
* writes a partial result (output and natural-log log-sum-exp) per (row, head).

Work is split along the KV length too (FlashDecoding's split-KV, Dao et al. 2023): a group's
pages are cut into chunks so that a batch-1 request still fills the GPU. Partials of a row are
folded in the same launch: after storing its partials a program increments a per-(row, KV head)
counter; the program that brings it to the row's partial count merges them by the log-sum-exp
rule (as FlashInfer's ``merge_state``), writes the output and resets the counter to zero for
the next launch. Rows with a single partial are written directly. ``merge="separate"`` instead
runs a second small kernel for the merge, and a callable ``merge`` (the CUDA extension's
``lse_merge``, say) is handed every row's partials (both kept to measure which is cheapest on
the GPU). The partial buffers and counters are scratch memory the caller owns
(:class:`DecodeWorkspace`), as SGLang's decode kernel takes them.

The same kernel is the *plain* path: with ``mode="plain"`` every row is its own group over its
whole view, which is FlashDecoding-style per-thread paged attention. ``mode="auto"`` picks
tree or plain with a bytes-read cost model (:func:`choose_mode`).

CUDA graphs: the grid is ``(max_work, num_kv_heads)`` from an upper bound; programs past the
device-side work count exit at once, and ``split`` is a runtime value, so a captured launch
serves any context length up to its capacity.

Per-layer options (:mod:`.attention_options`): a sliding window over logical positions (each
row of a group has its own position, so the mask is per (row, key)) and an attention-logit
soft-cap, both constexpr switches with runtime values. Any ``head_dim`` runs in a
power-of-two tile (``BLOCK_D``, masked: 96 for Phi-3-mini), any GQA group including 1.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch

from . import INTERPRET, register_compile_spec, upload_int32  # noqa: F401  (INTERPRET: the mode the kernels run in)
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


@triton.jit
def _merge_row(
    O, stride_ot, stride_oh, PART_O, PART_LSE, ROW_SLOT_START, ROW_SLOTS, r, nparts, h,
    HQ: tl.constexpr, GROUP: tl.constexpr, GROUP_P2: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """Fold the ``nparts`` partials of query row ``r`` for KV head ``h``'s query heads."""
    offs_g = tl.arange(0, GROUP_P2)
    offs_d = tl.arange(0, BLOCK_D)
    dval = offs_d < D
    gval = offs_g < GROUP
    qh = h * GROUP + offs_g
    s0 = tl.load(ROW_SLOT_START + r)
    m = tl.full([GROUP_P2], float("-inf"), tl.float32)
    for i in range(0, nparts):
        sl = tl.load(ROW_SLOTS + s0 + i).to(tl.int64)
        lse = tl.load(PART_LSE + sl * HQ + qh, mask=gval, other=float("-inf"), cache_modifier=".cg")
        m = tl.maximum(m, lse)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    den = tl.zeros([GROUP_P2], tl.float32)
    acc = tl.zeros([GROUP_P2, BLOCK_D], tl.float32)
    for i in range(0, nparts):
        sl = tl.load(ROW_SLOTS + s0 + i).to(tl.int64)
        lse = tl.load(PART_LSE + sl * HQ + qh, mask=gval, other=float("-inf"), cache_modifier=".cg")
        w = tl.exp(lse - m_safe)
        o = tl.load(PART_O + (sl * HQ + qh[:, None]) * D + offs_d[None, :], mask=gval[:, None] & dval[None, :],
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
    WORK_GROUP, WORK_LO, WORK_HI, WORK_SLOT, NUM_WORK,
    GROUP_ROW_START, GROUP_NROWS, GROUP_ROWS,
    PAGES, PAGE_LENS,
    ROW_NPARTS, ROW_SLOT_START, ROW_SLOTS,
    PART_O, PART_LSE, COUNTERS,
    Q_POS, K_POS, stride_kpos_p,
    sm_scale_log2, window, cap_log2,
    HKV: tl.constexpr, GROUP: tl.constexpr, GROUP_P2: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
    PAGE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, MERGE: tl.constexpr,
    WINDOW: tl.constexpr, SOFTCAP: tl.constexpr,
):
    w = tl.program_id(0)
    h = tl.program_id(1)
    if w < tl.load(NUM_WORK):
        HQ: tl.constexpr = HKV * GROUP
        grp = tl.load(WORK_GROUP + w)
        lo = tl.load(WORK_LO + w)
        hi = tl.load(WORK_HI + w)
        slot0 = tl.load(WORK_SLOT + w)
        rstart = tl.load(GROUP_ROW_START + grp)
        nrows = tl.load(GROUP_NROWS + grp)

        offs_m = tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, BLOCK_D)
        dval = offs_d < D
        offs_n = tl.arange(0, BLOCK_N)
        j = offs_m // GROUP_P2
        g = offs_m % GROUP_P2
        mval = (j < nrows) & (g < GROUP)
        row = tl.load(GROUP_ROWS + rstart + j, mask=mval, other=0).to(tl.int64)
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
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m_i = m_new

        l_safe = tl.where(l_i == 0.0, 1.0, l_i)
        o = acc / l_safe[:, None]
        nparts = tl.load(ROW_NPARTS + row, mask=mval, other=1)
        direct = mval & (nparts == 1) & (MERGE != 3)
        tl.store(O + row[:, None] * stride_ot + qh[:, None] * stride_oh + offs_d[None, :],
                 o.to(O.dtype.element_ty), mask=direct[:, None] & dval[None, :])
        if MERGE > 0:
            lse = tl.where(l_i == 0.0, float("-inf"), (m_i + tl.log2(l_safe)) * 0.6931471805599453)
            slot = (slot0 + j).to(tl.int64)
            pm = mval & ((nparts > 1) | (MERGE == 3))
            tl.store(PART_O + (slot[:, None] * HQ + qh[:, None]) * D + offs_d[None, :], o, mask=pm[:, None] & dval[None, :])
            tl.store(PART_LSE + slot * HQ + qh, lse, mask=pm)
            if MERGE == 1:
                # In-launch merge: the last program to deliver a partial of a row folds them.
                tl.debug_barrier()
                for jj in range(0, nrows):
                    r = tl.load(GROUP_ROWS + rstart + jj)
                    np_r = tl.load(ROW_NPARTS + r)
                    if np_r > 1:
                        cnt = tl.atomic_add(COUNTERS + r * HKV + h, 1, sem="acq_rel")
                        if cnt == np_r - 1:
                            _merge_row(O, stride_ot, stride_oh, PART_O, PART_LSE, ROW_SLOT_START, ROW_SLOTS,
                                       r, np_r, h, HQ, GROUP, GROUP_P2, D, BLOCK_D)
                            tl.atomic_xchg(COUNTERS + r * HKV + h, 0, sem="relaxed")


@triton.jit
def _merge_kernel(
    O, stride_ot, stride_oh, PART_O, PART_LSE, ROW_NPARTS, ROW_SLOT_START, ROW_SLOTS, NUM_ROWS,
    HKV: tl.constexpr, GROUP: tl.constexpr, GROUP_P2: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
):
    r = tl.program_id(0)
    h = tl.program_id(1)
    if r < tl.load(NUM_ROWS):
        np_r = tl.load(ROW_NPARTS + r)
        if np_r > 1:
            _merge_row(O, stride_ot, stride_oh, PART_O, PART_LSE, ROW_SLOT_START, ROW_SLOTS, r, np_r, h,
                       HKV * GROUP, GROUP, GROUP_P2, D, BLOCK_D)


# --------------------------------------------------------------------------- host side

View = list[tuple[int, list[int], list[int]]]  # (segment id, pages, used slots per page)


@dataclass
class DecodePlan:
    """Device-side description of one step's decode attention (built by :func:`build_plan`).

    Work items ``w``: row group ``work_group[w]``, pages ``pages[work_lo[w]:work_hi[w]]``,
    first partial slot ``work_slot[w]``. Row groups ``g``: rows
    ``group_rows[group_row_start[g] : + group_nrows[g]]`` (indices into the query tensor).
    Per query row ``r``: ``row_nparts[r]`` partials in slots
    ``row_slots[row_slot_start[r] : + row_nparts[r]]``. All int32 on the device;
    ``num_work``/``num_rows`` are 1-element device tensors. ``partials`` is False when every
    row has one partial (no partial buffer traffic at all)."""

    work_group: torch.Tensor
    work_lo: torch.Tensor
    work_hi: torch.Tensor
    work_slot: torch.Tensor
    num_work: torch.Tensor
    group_row_start: torch.Tensor
    group_nrows: torch.Tensor
    group_rows: torch.Tensor
    pages: torch.Tensor
    page_lens: torch.Tensor
    row_nparts: torch.Tensor
    row_slot_start: torch.Tensor
    row_slots: torch.Tensor
    row_indptr: torch.Tensor
    num_rows: torch.Tensor
    n_work: int  # host copies (the grid uses capacities when captured)
    n_slots: int
    block_m: int
    mode: str
    partials: bool
    pages_read: int  # pages streamed per KV head (for bytes-read accounting)
    grid_work: int | None = None  # programs to launch along work items (a capacity when captured)


PLAN_ARRAYS = (
    "work_group", "work_lo", "work_hi", "work_slot", "num_work", "group_row_start", "group_nrows", "group_rows",
    "pages", "page_lens", "row_nparts", "row_slot_start", "row_slots", "row_indptr", "num_rows",
)


def _next_pow2(x: int) -> int:
    return 1 << max(0, (x - 1).bit_length())


def _groups(views: list[View], mode: str) -> list[tuple[list[int], list[int], list[int]]]:
    """(rows, pages, lens) per group: pages seen by exactly the same rows (tree) or each
    row's whole view (plain)."""
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
    """``tree`` when grouping saves at least a fifth of the KV pages read, else ``plain``.

    Cost model: decode attention is bandwidth-bound, so its cost is the pages streamed; the
    tree path reads a shared page once instead of once per row, and pays partial results and a
    merge per row and group, which pays off only with real sharing (a long shared prefix)."""
    plain = sum(len(ps) for v in views for _, ps, _ in v)
    tree = sum(len(ps) for _, ps, _ in _groups(views, "tree"))
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
    (work items, row groups, pages, per-row partial slots) and the scalar fields of
    :class:`DecodePlan`.

    Args:
        views: per query row, its KV view as ``(segment id, pages, used slots per page)``
            runs; runs with the same id are the same pages (shared by those rows).
        group: query heads per KV head (GQA group); num_kv_heads: KV heads.
        device: where the kernel will run (sets the default ``target_work``).
        mode: ``tree`` (group pages by the rows that see them), ``plain`` (each row alone), or
            ``auto`` (:func:`choose_mode`).
        target_work: work items to aim for (default: 4 per SM / KV head on a GPU, 4 on CPU);
            a group's pages are split into chunks of equal size to reach it (split-KV).
        max_rows_per_item: rows of one work item (larger groups are cut into row chunks).
        block_m: query-tile rows to use (at least what the largest row group needs; a CUDA
            graph fixes it per bucket).

    Raises ValueError for an empty batch, a row with no page, a too small ``block_m`` or an
    unknown mode."""
    if not views:
        raise ValueError("no decode rows")
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
    groups = []
    for rows, ps, ns in _groups(views, mode):
        for i in range(0, len(rows), max_rows_per_item):
            groups.append((rows[i : i + max_rows_per_item], ps, ns))
    for r, v in enumerate(views):
        if not any(ps for _, ps, _ in v):
            raise ValueError(f"decode row {r} has an empty KV view")
    total = sum(len(ps) for _, ps, _ in groups)
    split = max(1, math.ceil(total / target_work))

    pages: list[int] = []
    lens: list[int] = []
    g_row_start, g_nrows, g_rows = [], [], []
    w_group, w_lo, w_hi, w_slot = [], [], [], []
    row_items: list[list[int]] = [[] for _ in views]  # partial slots per row
    n_slots = 0
    for gi, (rows, ps, ns) in enumerate(groups):
        base = len(pages)
        pages += ps
        lens += ns
        g_row_start.append(len(g_rows))
        g_nrows.append(len(rows))
        g_rows += rows
        for lo in range(0, len(ps), split):
            w_group.append(gi)
            w_lo.append(base + lo)
            w_hi.append(base + min(lo + split, len(ps)))
            w_slot.append(n_slots)
            for j, r in enumerate(rows):
                row_items[r].append(n_slots + j)
            n_slots += len(rows)
    row_nparts = [len(x) for x in row_items]
    row_slot_start = [0]
    for x in row_items[:-1]:
        row_slot_start.append(row_slot_start[-1] + len(x))
    row_slots = [s for x in row_items for s in x]
    need_m = max(16, _next_pow2(max(g_nrows) * _next_pow2(group)))
    if block_m is not None and block_m < need_m:
        raise ValueError(f"block_m={block_m} is smaller than the {need_m} query rows a work item needs")
    arrays = dict(
        work_group=w_group, work_lo=w_lo, work_hi=w_hi, work_slot=w_slot, num_work=[len(w_group)],
        group_row_start=g_row_start, group_nrows=g_nrows, group_rows=g_rows, pages=pages, page_lens=lens,
        row_nparts=row_nparts, row_slot_start=row_slot_start, row_slots=row_slots,
        row_indptr=row_slot_start + [len(row_slots)], num_rows=[len(views)],
    )
    info = dict(n_work=len(w_group), n_slots=n_slots, block_m=block_m or need_m, mode=mode,
                partials=any(n > 1 for n in row_nparts), pages_read=total)
    return arrays, info


class StaticDecodePlan:
    """Fixed-size device buffers for plans, for CUDA graphs: a captured launch reads them, and
    each step :meth:`load` copies the step's plan in (no allocation, no host sync).

    Args:
        max_rows: query rows (the largest bucket); max_work, max_slots, max_pages: capacities;
        block_m: the query tile of the captured kernel; device: CUDA device."""

    def __init__(self, max_rows: int, max_work: int, max_slots: int, max_pages: int, block_m: int, device):
        sizes = dict(work_group=max_work, work_lo=max_work, work_hi=max_work, work_slot=max_work, num_work=1,
                     group_row_start=max_work, group_nrows=max_work, group_rows=max_work * 16, pages=max_pages,
                     page_lens=max_pages, row_nparts=max_rows, row_slot_start=max_rows, row_slots=max_slots,
                     row_indptr=max_rows + 1, num_rows=1)
        self.sizes = sizes
        self.tensors = {k: torch.zeros(n, dtype=torch.int32, device=device) for k, n in sizes.items()}
        self.host = {k: torch.zeros(n, dtype=torch.int32, pin_memory=torch.device(device).type == "cuda")
                     for k, n in sizes.items()}
        self.plan = DecodePlan(**self.tensors, n_work=max_work, n_slots=max_slots, block_m=block_m, mode="static",
                               partials=True, pages_read=0, grid_work=max_work)

    def load(self, arrays: dict[str, list[int]], info: dict) -> bool:
        """Copy a step's plan in; False (nothing copied) when it exceeds a capacity or needs a
        bigger query tile."""
        if info["block_m"] > self.plan.block_m or any(len(v) > self.sizes[k] for k, v in arrays.items()):
            return False
        for k, v in arrays.items():
            if v:
                self.host[k][: len(v)] = torch.tensor(v, dtype=torch.int32)
                self.tensors[k][: len(v)].copy_(self.host[k][: len(v)], non_blocking=True)
        self.plan.pages_read = info["pages_read"]
        return True


class DecodeWorkspace:
    """Scratch memory of :func:`tree_decode_attention`: split-KV partial results (float32
    outputs ``[slots, Hq, D]`` and natural-log LSEs ``[slots, Hq]``) and per-(row, KV head)
    merge counters ``[rows, Hkv]`` int32. Owned by the caller and reused across launches (grown
    on demand; a CUDA graph sizes it to capacity before capture). The counters are left at zero
    by every in-launch merge."""

    def __init__(self) -> None:
        self.part_o: torch.Tensor | None = None
        self.part_lse: torch.Tensor | None = None
        self.counters: torch.Tensor | None = None

    def get(self, n_slots: int, n_rows: int, hq: int, hkv: int, d: int, device: torch.device):
        """The buffers, grown to ``n_slots`` partials and ``n_rows`` rows when smaller."""
        if self.part_o is None or self.part_o.shape[0] < n_slots or self.part_o.shape[1:] != (hq, d) \
                or self.part_o.device != device:
            self.part_o = torch.empty((max(n_slots, 1), hq, d), dtype=torch.float32, device=device)
            self.part_lse = torch.empty((max(n_slots, 1), hq), dtype=torch.float32, device=device)
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
        k_cache, v_cache: ``[num_pages, page_size, Hkv, D]``, same dtype and strides as q's dtype.
        plan: :func:`build_plan` for these rows.
        scale: softmax scale (``head_dim ** -0.5`` for Llama).
        out: ``[R, Hq, D]`` output (allocated when None).
        merge: ``inline``, ``separate``, or a callable
            ``merge(part_o, part_lse, row_indptr, row_slots, out)`` given every row's partials
            (see the module docstring).
        block_n: KV tokens per inner iteration (a multiple of 16 and of the page size or a divisor).
        grid_work: launch this many work programs (a capacity for CUDA graphs; default the plan's).
        workspace: scratch buffers (:class:`DecodeWorkspace`); None allocates them for this call.
        sliding_window: row r sees only the keys whose logical position is
            ``> q_positions[r] - sliding_window`` (tokens); None: no window.
        logit_softcap: scores ``s = q k^T * scale`` become ``cap * tanh(s / cap)`` before the
            softmax (Gemma 2); None: no cap.
        q_positions: ``[R]`` int64/int32 logical position of each row (with ``sliding_window``).
        key_positions: ``[num_pages, page_size]`` int32 logical position of every cache slot, unit
            last stride (with ``sliding_window``).

    Returns ``out``: softmax(q k^T * scale) v per row and head. Raises ValueError on shape or
    dtype mismatches, naming ``sliding_window``/``logit_softcap`` when their inputs are missing
    or invalid."""
    if q.dim() != 3 or k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(f"bad shapes: q {tuple(q.shape)}, k_cache {tuple(k_cache.shape)}, v_cache {tuple(v_cache.shape)}")
    r, hq, d = q.shape
    _, page, hkv, dk = k_cache.shape
    if dk != d or hq % hkv:
        raise ValueError(f"q heads {hq} x dim {d} do not fit the cache's {hkv} KV heads x dim {dk}")
    if q.dtype != k_cache.dtype or k_cache.stride() != v_cache.stride():
        raise ValueError(f"q dtype {q.dtype} / cache dtype {k_cache.dtype} differ, or K and V strides differ")
    if q.stride(-1) != 1 or k_cache.stride(-1) != 1:
        raise ValueError("the last (head_dim) dimension of q and the caches must be contiguous")
    if d < 1:
        raise ValueError(f"head_dim must be >= 1, got {d}")
    window = check_window(sliding_window, q_positions, key_positions, r, k_cache, "tree_decode_attention")
    cap_log2 = check_softcap(logit_softcap, "tree_decode_attention") * LOG2E
    if not (merge in ("inline", "separate") or callable(merge)):
        raise ValueError(f"merge must be 'inline', 'separate' or a callable, got {merge!r}")
    if out is None:
        out = torch.empty((r, hq, d), dtype=q.dtype, device=q.device)
    group = hq // hkv
    gp2 = _next_pow2(group)
    block_d = max(16, _next_pow2(d))
    part_o, part_lse, counters = (workspace or DecodeWorkspace()).get(plan.n_slots, r, hq, hkv, d, q.device)
    if callable(merge):
        merge_code = 3
    else:
        merge_code = 0 if not plan.partials else (1 if merge == "inline" else 2)
    block_n = max(16, block_n)
    grid = (grid_work or plan.grid_work or plan.n_work, hkv)
    _tree_decode_kernel[grid](
        q, k_cache, v_cache, out,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), out.stride(0), out.stride(1),
        plan.work_group, plan.work_lo, plan.work_hi, plan.work_slot, plan.num_work,
        plan.group_row_start, plan.group_nrows, plan.group_rows,
        plan.pages, plan.page_lens,
        plan.row_nparts, plan.row_slot_start, plan.row_slots,
        part_o, part_lse, counters,
        q_positions if window else plan.num_rows, key_positions if window else plan.num_rows,
        key_positions.stride(0) if window else 0,
        scale * LOG2E, window, cap_log2,
        HKV=hkv, GROUP=group, GROUP_P2=gp2, D=d, BLOCK_D=block_d, PAGE=page, BLOCK_M=plan.block_m, BLOCK_N=block_n,
        MERGE=merge_code, WINDOW=bool(window), SOFTCAP=bool(cap_log2),
    )
    if merge_code == 2:
        _merge_kernel[(r, hkv)](
            out, out.stride(0), out.stride(1), part_o, part_lse, plan.row_nparts, plan.row_slot_start,
            plan.row_slots, plan.num_rows, HKV=hkv, GROUP=group, GROUP_P2=gp2, D=d, BLOCK_D=block_d,
        )
    elif merge_code == 3:
        merge(part_o, part_lse, plan.row_indptr, plan.row_slots, out)
    return out


def _register() -> None:
    common = {
        "Q": "*bf16", "K": "*bf16", "V": "*bf16", "O": "*bf16",
        "stride_qt": "i32", "stride_qh": "i32", "stride_kp": "i32", "stride_ks": "i32", "stride_kh": "i32",
        "stride_ot": "i32", "stride_oh": "i32",
        "WORK_GROUP": "*i32", "WORK_LO": "*i32", "WORK_HI": "*i32", "WORK_SLOT": "*i32", "NUM_WORK": "*i32",
        "GROUP_ROW_START": "*i32", "GROUP_NROWS": "*i32", "GROUP_ROWS": "*i32",
        "PAGES": "*i32", "PAGE_LENS": "*i32",
        "ROW_NPARTS": "*i32", "ROW_SLOT_START": "*i32", "ROW_SLOTS": "*i32",
        "PART_O": "*fp32", "PART_LSE": "*fp32", "COUNTERS": "*i32",
        "Q_POS": "*i64", "K_POS": "*i32", "stride_kpos_p": "i32",
        "sm_scale_log2": "fp32", "window": "i32", "cap_log2": "fp32",
        "HKV": "constexpr", "GROUP": "constexpr", "GROUP_P2": "constexpr", "D": "constexpr", "BLOCK_D": "constexpr",
        "PAGE": "constexpr", "BLOCK_M": "constexpr", "BLOCK_N": "constexpr", "MERGE": "constexpr",
        "WINDOW": "constexpr", "SOFTCAP": "constexpr",
    }
    # (name, KV heads, GQA group, head_dim, query tile, window, soft-cap, merges): Llama-3-8B and
    # Qwen3-8B share a specialization (D=128, group 4; Qwen3's q/k norms run before the kernels)
    shapes = (
        ("llama3-8b", 8, 4, 128, 64, False, False, (1, 2, 3)),
        ("smollm2", 3, 3, 64, 64, False, False, (1, 2, 3)),
        ("gemma-7b", 16, 1, 256, 16, False, False, (1, 2, 3)),  # multi-head attention, head_dim 256
        ("gemma-2-9b", 8, 2, 256, 32, True, True, (1,)),  # its sliding layers (full layers: WINDOW off)
        ("gemma-2-9b-full", 8, 2, 256, 32, False, True, (1,)),
        ("phi-3-mini", 32, 1, 96, 16, True, False, (1,)),  # head_dim 96 in a 128-wide tile
    )
    for name, hkv, group, d, bm, window, softcap, merges in shapes:
        block_d = max(16, _next_pow2(d))
        for merge in merges:
            register_compile_spec(
                f"tree_decode[{name},merge={merge}]", _tree_decode_kernel, common,
                {"HKV": hkv, "GROUP": group, "GROUP_P2": _next_pow2(group), "D": d, "BLOCK_D": block_d, "PAGE": 16,
                 "BLOCK_M": bm, "BLOCK_N": 64, "MERGE": merge, "WINDOW": window, "SOFTCAP": softcap},
            )
        if 2 in merges:
            register_compile_spec(
                f"tree_merge[{name}]", _merge_kernel,
                {"O": "*bf16", "stride_ot": "i32", "stride_oh": "i32", "PART_O": "*fp32", "PART_LSE": "*fp32",
                 "ROW_NPARTS": "*i32", "ROW_SLOT_START": "*i32", "ROW_SLOTS": "*i32", "NUM_ROWS": "*i32",
                 "HKV": "constexpr", "GROUP": "constexpr", "GROUP_P2": "constexpr", "D": "constexpr",
                 "BLOCK_D": "constexpr"},
                {"HKV": hkv, "GROUP": group, "GROUP_P2": _next_pow2(group), "D": d, "BLOCK_D": block_d},
            )


_register()
