"""Attention backends over the paged KV cache.

A decode step's batch is a list of *sequences*: each is one thread's new tokens (1 for a
decode row, several for a prefill chunk or an inserted tag) and its KV view (pages with
per-page visible lengths, see :mod:`pasta_engine.kv_cache`). The new tokens' K/V are written
into the cache first, every layer, and then each query attends over its thread's whole view:
the view's last ``q_len`` tokens are the sequence's own new tokens, masked causally among
themselves, and everything before them is visible.

A backend implements two operations per layer (:class:`AttentionBackend`):

* ``rope_and_write(q, k, v, cos, sin, k_cache, v_cache, meta)``: rotate q and k by RoPE at the
  logical positions, write k and v into their slots, return the rotated q;
* ``attend(q, k_cache, v_cache, meta)``: the attention output for every query row.

and ``plan(meta)`` once per step to build whatever index tensors it needs (shared by all
layers). :class:`TorchAttention` is the reference: gathers each sequence's view into a padded
dense tensor and calls ``scaled_dot_product_attention``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

__all__ = ["AttentionMetadata", "AttentionBackend", "TorchAttention", "apply_rope", "get_backend", "to_device"]


def to_device(values, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """A host list (or CPU tensor) as a tensor on ``device`` without a host-device sync: on
    CUDA it is staged in pinned memory (torch's caching host allocator keeps the block until
    the copy is done) and copied asynchronously; copies from pageable memory may wait for the
    stream, which would stall the decode loop."""
    device = torch.device(device)
    if device.type != "cuda":
        return torch.as_tensor(values, dtype=dtype)
    host = torch.empty(len(values), dtype=dtype, pin_memory=True)
    host.copy_(torch.as_tensor(values, dtype=dtype))
    return host.to(device, non_blocking=True)


Run = tuple[int, list[int], list[int]]  # (segment id, pages, used slots of each page)


@dataclass
class AttentionMetadata:
    """What one step's attention needs, built by the scheduler.

    Host-side, one entry per sequence ``b`` of ``B``:
        q_lens[b]: new tokens of the sequence (query rows, consecutive in the batch).
        runs[b]: its KV view as ``(segment id, pages, used slots of each page)`` runs, in view
            order. A run is shared (the same lists, not a copy) by every sequence whose view
            holds that segment id (see :mod:`pasta_engine.kv_cache`); the scheduler does no
            per-page work to build this, so backends that group by segment never flatten.
    Device tensors (set before an eager forward; a CUDA-graph replay uses its own buffers):
        positions: ``[T]`` int64 logical position of every new token.
        slot_mapping: ``[T]`` int64 cache slot (``page * page_size + offset``) of every new token.
    ``plan`` holds the backend's per-step index tensors (set by :meth:`AttentionBackend.plan`).
    """

    page_size: int
    q_lens: list[int]
    runs: list[list[Run]]
    positions: torch.Tensor | None = None
    slot_mapping: torch.Tensor | None = None
    plan: Any = None
    extra: dict = field(default_factory=dict)

    @classmethod
    def from_pages(
        cls, page_size: int, q_lens: list[int], pages: list[list[int]], page_lens: list[list[int]], **kw: Any
    ) -> "AttentionMetadata":
        """Metadata whose every sequence is one private run (tests, benchmarks)."""
        runs = [[(-1 - b, list(p), list(n))] for b, (p, n) in enumerate(zip(pages, page_lens))]
        return cls(page_size=page_size, q_lens=list(q_lens), runs=runs, **kw)

    def pages(self, b: int) -> list[int]:
        """Pages of sequence ``b``'s view, in view order."""
        return [p for _, ps, _ in self.runs[b] for p in ps]

    def page_lens(self, b: int) -> list[int]:
        """Used slots of each page of :meth:`pages`."""
        return [n for _, _, ns in self.runs[b] for n in ns]

    def kv_len(self, b: int) -> int:
        """Tokens in sequence ``b``'s view, its new tokens included."""
        return sum(sum(ns) for _, _, ns in self.runs[b])

    @property
    def num_tokens(self) -> int:
        return int(sum(self.q_lens))


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` ``[T, H, D]`` by RoPE with ``cos``/``sin`` ``[T, D]`` (the "rotate half"
    convention of HF Llama; Su et al. 2021, RoFormer, section 3.4.2)."""
    d = x.shape[-1] // 2
    rot = torch.cat((-x[..., d:], x[..., :d]), dim=-1)
    return x * cos[:, None, :] + rot * sin[:, None, :]


class AttentionBackend:
    """Interface of an attention backend; see the module docstring."""

    name = "abstract"

    def configure(self, num_heads: int, num_kv_heads: int) -> None:
        """Learn the model's head counts (called once by the engine)."""

    def plan(self, meta: AttentionMetadata, device: torch.device) -> None:
        """Build this step's index tensors on ``device`` into ``meta.plan`` (once per step,
        shared by all layers; must not read the views after the forward starts)."""
        raise NotImplementedError

    def rope_and_write(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """q ``[T, Hq, D]``, k/v ``[T, Hkv, D]``, cos/sin ``[T, D]``, caches
        ``[num_pages, page_size, Hkv, D]``. Writes rotated k and v at ``meta.slot_mapping``;
        returns rotated q ``[T, Hq, D]``. Default: torch ops."""
        q = apply_rope(q, cos, sin)
        k = apply_rope(k, cos, sin)
        hkv, d = k.shape[1], k.shape[2]
        k_cache.view(-1, hkv, d).index_copy_(0, meta.slot_mapping, k.to(k_cache.dtype))
        v_cache.view(-1, hkv, d).index_copy_(0, meta.slot_mapping, v.to(v_cache.dtype))
        return q

    def attend(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata, scale: float
    ) -> torch.Tensor:
        """q ``[T, Hq, D]`` -> output ``[T, Hq, D]`` (softmax(q k^T * scale) v over each
        row's visible keys)."""
        raise NotImplementedError


def _slots(pages: list[int], lens: list[int], page_size: int) -> torch.Tensor:
    """Slot ids ``[sum(lens)]`` of the used part of each page, in view order."""
    p = torch.tensor(pages, dtype=torch.long)
    n = torch.tensor(lens, dtype=torch.long)
    starts = torch.repeat_interleave(p * page_size, n)
    return starts + torch.arange(int(n.sum())) - torch.repeat_interleave(torch.cumsum(n, 0) - n, n)


@dataclass
class _TorchPlan:
    # single-token rows: attend over the union of their views' tokens, each KV token gathered once
    dec_rows: torch.Tensor | None = None  # [R] rows of T
    dec_gather: torch.Tensor | None = None  # [N] slot ids of the distinct tokens
    dec_mask: torch.Tensor | None = None  # [1, 1, R, N] bool: row r sees token n
    # multi-token rows: each sequence's view padded to a dense tensor, causal inside the chunk
    gather: torch.Tensor | None = None  # [B, Lmax] slot ids (padded with 0)
    mask: torch.Tensor | None = None  # [B, 1, Qmax, Lmax] bool
    q_index: torch.Tensor | None = None  # [B, Qmax] row of T (padded with 0)
    q_valid: torch.Tensor | None = None  # [B, Qmax] bool


class TorchAttention(AttentionBackend):
    """Reference backend built on ``torch.nn.functional.scaled_dot_product_attention`` with
    explicit masks.

    Single-token rows (decode steps) attend over the union of their views: every distinct KV
    token of the step is gathered once and a row-by-token visibility mask (from the views'
    shared segments) selects each row's keys, so threads sharing a prompt do not re-gather it.
    Multi-token rows (prefill chunks, inserted tags) gather their view into a padded dense
    tensor, with the chunk's tokens masked causally."""

    name = "torch"

    def plan(self, meta: AttentionMetadata, device: torch.device) -> None:
        pl = _TorchPlan()
        starts, t = [], 0
        for n in meta.q_lens:
            starts.append(t)
            t += n
        dec = [b for b, n in enumerate(meta.q_lens) if n == 1]
        ext = [b for b, n in enumerate(meta.q_lens) if n > 1]
        ps = meta.page_size
        if dec:
            seg_index: dict[int, int] = {}
            seg_slots: list[torch.Tensor] = []
            row_segs: list[list[int]] = []
            for b in dec:
                mine = []
                for sid, pages, lens in meta.runs[b]:
                    if sid not in seg_index:
                        seg_index[sid] = len(seg_slots)
                        seg_slots.append(_slots(pages, lens, ps))
                    mine.append(seg_index[sid])
                row_segs.append(mine)
            sees = torch.zeros(len(dec), len(seg_slots), dtype=torch.bool)
            for r, mine in enumerate(row_segs):
                sees[r, mine] = True
            token_seg = torch.repeat_interleave(torch.arange(len(seg_slots)), torch.tensor([len(x) for x in seg_slots]))
            pl.dec_rows = to_device([starts[b] for b in dec], torch.long, device)
            pl.dec_gather = to_device(torch.cat(seg_slots), torch.long, device)
            pl.dec_mask = sees[:, token_seg][None, None].to(device)
        if ext:
            q_len = torch.tensor([meta.q_lens[b] for b in ext])
            kv_len = torch.tensor([meta.kv_len(b) for b in ext])
            qmax, lmax = int(q_len.max()), int(kv_len.max())
            gather = torch.zeros(len(ext), lmax, dtype=torch.long)
            for i, b in enumerate(ext):
                gather[i, : int(kv_len[i])] = _slots(meta.pages(b), meta.page_lens(b), ps)
            qi, kj = torch.arange(qmax), torch.arange(lmax)
            # query i of a sequence sees key j iff j <= kv_len - q_len + i
            limit = (kv_len - q_len)[:, None] + qi[None, :]
            q_valid = qi[None, :] < q_len[:, None]
            mask = (kj[None, None, :] <= limit[:, :, None]) & q_valid[:, :, None]
            mask[:, :, 0] |= ~q_valid  # padded rows attend to one key (discarded) to avoid NaN
            first = torch.tensor([starts[b] for b in ext])
            q_index = torch.where(q_valid, first[:, None] + qi[None, :], torch.zeros_like(qi)[None, :])
            pl.gather, pl.mask = gather.to(device), mask[:, None].to(device)
            pl.q_index, pl.q_valid = q_index.to(device), q_valid.to(device)
        meta.plan = pl

    def attend(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata, scale: float
    ) -> torch.Tensor:
        pl: _TorchPlan = meta.plan
        t, hq, d = q.shape
        hkv = k_cache.shape[2]
        kf, vf = k_cache.view(-1, hkv, d), v_cache.view(-1, hkv, d)
        res = torch.empty_like(q)
        if pl.dec_rows is not None:
            k = kf[pl.dec_gather].transpose(0, 1)[None].to(q.dtype)  # [1, Hkv, N, D]
            v = vf[pl.dec_gather].transpose(0, 1)[None].to(q.dtype)
            qd = q[pl.dec_rows].transpose(0, 1)[None]  # [1, Hq, R, D]
            out = F.scaled_dot_product_attention(qd, k, v, attn_mask=pl.dec_mask, scale=scale, enable_gqa=hq != hkv)
            res[pl.dec_rows] = out[0].transpose(0, 1)
        if pl.gather is not None:
            k = kf[pl.gather].transpose(1, 2).to(q.dtype)  # [B, Hkv, L, D]
            v = vf[pl.gather].transpose(1, 2).to(q.dtype)
            qd = q[pl.q_index].transpose(1, 2)  # [B, Hq, Qmax, D]
            out = F.scaled_dot_product_attention(qd, k, v, attn_mask=pl.mask, scale=scale,
                                                 enable_gqa=hq != hkv).transpose(1, 2)
            res[pl.q_index[pl.q_valid]] = out[pl.q_valid]
        return res


_BACKENDS: dict[str, type[AttentionBackend]] = {"torch": TorchAttention}


def register_backend(name: str, cls: type[AttentionBackend]) -> None:
    """Make ``cls`` available as ``attention_backend=name``."""
    _BACKENDS[name] = cls


def get_backend(name: str | AttentionBackend) -> AttentionBackend:
    """An attention backend by name: ``"torch"`` (reference) or ``"triton"`` (the kernels of
    :mod:`pasta_engine.triton_kernels`; under Triton's interpreter on a CPU).

    Raises ValueError naming the known backends."""
    if isinstance(name, AttentionBackend):
        return name
    if name == "triton" and name not in _BACKENDS:
        from .attention_triton import TritonAttention

        register_backend("triton", TritonAttention)
    if name not in _BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}: known {sorted({*_BACKENDS, 'triton'})}")
    return _BACKENDS[name]()
