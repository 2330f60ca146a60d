"""Attention over the paged KV cache: the step's metadata, the backend interface, the torch
reference backend.

A step's batch is a list of *sequences*: each is one thread's new tokens (1 for a decode
thread, several for a prompt prefill or an inserted tag) and its KV view (segments of pages
with per-page visible lengths, see :mod:`pasta_engine.engine.block_manager`). The new tokens'
K/V are written into the cache first, every layer, and then each query attends over its
thread's whole view: the view's last ``q_len`` tokens are the sequence's own new tokens,
masked causally among themselves, and everything before them is visible.

A backend owns its plan (FlashInfer's plan-once / run-per-layer): the model runner calls
:meth:`AttentionBackend.plan` once per step with the host-side :class:`AttentionMetadata`;
every layer then calls :meth:`AttentionBackend.rope_and_write` and
:meth:`AttentionBackend.attend`, which read the plan the backend keeps. A backend that can run
inside CUDA graphs hands out graph-mode instances (:meth:`AttentionBackend.for_cuda_graph`)
that own static buffers sized for a bucket and whose ``plan`` copies into them.

:class:`TorchAttention` is the reference: it gathers each sequence's view into a dense tensor
and calls ``scaled_dot_product_attention`` with explicit masks.

Per-layer options are arguments of :meth:`AttentionBackend.attend` (the plan is per step and
shared by all layers; a layer's options are constants, so graph-mode launches capture them):
the softmax ``scale``, a ``sliding_window`` and an attention-logit ``logit_softcap``. A window
is counted in logical positions (DESIGN.md section 2): a query at position ``p`` sees the keys
of its view at positions ``> p - window``, which is ``transformers``' ``q - k < window`` on a
sequential response, and for a PASTA thread keeps the keys that are near in the positions the
model was trained on. The model passes each query row's position and a table of every cache
slot's position (``key_positions``, written when the slot's key is: see
:meth:`pasta_engine.models.llama.LlamaModel.key_positions`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .rotary import apply_rope
from .utils import to_device

__all__ = ["AttentionMetadata", "AttentionBackend", "TorchAttention", "Run", "check_attention_options"]

Run = tuple[int, list[int], list[int]]  # (segment id, pages, used slots of each page)


@dataclass
class AttentionMetadata:
    """What one step's attention needs, host-side, one entry per sequence ``b`` of ``B``.

    Attributes:
        page_size: slots per KV page.
        q_lens: ``q_lens[b]`` new tokens of sequence ``b`` (query rows, consecutive in the batch).
        runs: ``runs[b]``: its KV view as ``(segment id, pages, used slots of each page)`` runs,
            in view order. A run is shared (the same lists, not a copy) by every sequence whose
            view holds that segment id, so backends that group by segment never flatten."""

    page_size: int
    q_lens: list[int]
    runs: list[list[Run]]

    @classmethod
    def from_pages(cls, page_size: int, q_lens: list[int], pages: list[list[int]], page_lens: list[list[int]]
                   ) -> "AttentionMetadata":
        """Metadata whose every sequence is one private run (tests, benchmarks)."""
        runs = [[(-1 - b, list(p), list(n))] for b, (p, n) in enumerate(zip(pages, page_lens))]
        return cls(page_size=page_size, q_lens=list(q_lens), runs=runs)

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
        """New tokens of the step (query rows)."""
        return int(sum(self.q_lens))

    def q_starts(self) -> list[int]:
        """First query row of each sequence."""
        starts, t = [], 0
        for n in self.q_lens:
            starts.append(t)
            t += n
        return starts


class AttentionBackend:
    """Interface of an attention backend; see the module docstring.

    Attributes:
        name: the name ``attention_backend=`` takes.
        supports_cuda_graphs: whether :meth:`for_cuda_graph` works."""

    name = "abstract"
    supports_cuda_graphs = False

    def configure(self, num_heads: int, num_kv_heads: int, device: torch.device, head_dim: int = 0) -> None:
        """Learn the model's head counts, head size and device (called once by the model
        runner, before the first :meth:`plan`)."""
        self.num_heads, self.num_kv_heads, self.device = num_heads, num_kv_heads, torch.device(device)
        self.head_dim = head_dim

    def plan(self, meta: AttentionMetadata) -> bool:
        """Build this step's index tensors from ``meta`` (once per step, shared by all layers;
        the views must not change until the forward is done). Returns False when a graph-mode
        instance cannot hold this step (the caller then runs eagerly)."""
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
        slot_mapping: torch.Tensor,
    ) -> torch.Tensor:
        """Rotate q and k by RoPE and write k and v into the cache.

        Args:
            q: ``[T, Hq, D]``; k, v: ``[T, Hkv, D]`` (model dtype).
            cos, sin: ``[T, D]`` at each token's logical position.
            k_cache, v_cache: ``[num_pages, page_size, Hkv, D]`` (one layer).
            slot_mapping: ``[T]`` int64 cache slot (``page * page_size + offset``) per token.

        Returns rotated q ``[T, Hq, D]``. Default: torch ops."""
        q = apply_rope(q, cos, sin)
        k = apply_rope(k, cos, sin)
        hkv, d = k.shape[1], k.shape[2]
        k_cache.view(-1, hkv, d).index_copy_(0, slot_mapping, k.to(k_cache.dtype))
        v_cache.view(-1, hkv, d).index_copy_(0, slot_mapping, v.to(v_cache.dtype))
        return q

    def attend(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        scale: float,
        *,
        sliding_window: int | None = None,
        logit_softcap: float | None = None,
        positions: torch.Tensor | None = None,
        key_positions: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """q ``[T, Hq, D]`` -> output ``[T, Hq, D]``: softmax(q k^T * scale) v over each query
        row's visible keys, under the plan of the last :meth:`plan` call.

        Args:
            q: ``[T, Hq, D]`` rotated queries (model dtype), the step's rows in order.
            k_cache, v_cache: ``[num_pages, page_size, Hkv, D]`` (one layer).
            scale: softmax scale (``head_dim ** -0.5``; Gemma 2: ``query_pre_attn_scalar ** -0.5``).
            sliding_window: row ``t`` sees only keys at logical positions
                ``> positions[t] - sliding_window`` (tokens); None: every visible key.
            logit_softcap: scores ``s = q k^T * scale`` become ``cap * tanh(s / cap)`` before the
                softmax (Gemma 2); None: no cap.
            positions: ``[T]`` int64 logical position of each row (needed with a window).
            key_positions: ``[num_pages, page_size]`` int32 logical position of every cache slot
                (needed with a window; slots no row sees may hold anything).

        Raises ValueError naming ``sliding_window`` or ``logit_softcap`` when the option is
        invalid or its inputs are missing (:func:`check_attention_options`); a backend that
        cannot apply an option raises NotImplementedError naming it."""
        raise NotImplementedError

    def for_cuda_graph(self, max_rows: int, num_pages: int) -> "AttentionBackend":
        """A graph-mode instance of this backend for steps of at most ``max_rows`` single-token
        sequences: it owns static buffers (sized from ``num_pages`` KV pages) that a captured
        launch reads, and its :meth:`plan` copies a step's plan into them.

        Raises NotImplementedError when the backend cannot run inside CUDA graphs."""
        raise NotImplementedError(f"attention backend {self.name!r} cannot run inside CUDA graphs")


def check_attention_options(sliding_window: int | None, logit_softcap: float | None, positions: torch.Tensor | None,
                            key_positions: torch.Tensor | None, q: torch.Tensor, k_cache: torch.Tensor) -> None:
    """Check :meth:`AttentionBackend.attend`'s per-layer options. Raises ValueError naming the
    option: a window that is not a positive int or comes without ``positions [T]`` and
    ``key_positions [num_pages, page_size]`` int32; a soft-cap that is not a positive number."""
    if sliding_window is not None:
        if isinstance(sliding_window, bool) or not isinstance(sliding_window, int) or sliding_window < 1:
            raise ValueError(f"sliding_window must be a positive int (tokens) or None, got {sliding_window!r}")
        if positions is None or key_positions is None:
            raise ValueError(f"sliding_window={sliding_window} needs positions [T] and key_positions "
                             "[num_pages, page_size]")
        if tuple(positions.shape) != (q.shape[0],) or tuple(key_positions.shape) != tuple(k_cache.shape[:2]) \
                or key_positions.dtype != torch.int32:
            raise ValueError(f"sliding_window needs positions [{q.shape[0]}] and key_positions "
                             f"[{k_cache.shape[0]}, {k_cache.shape[1]}] int32, got {tuple(positions.shape)} and "
                             f"{tuple(key_positions.shape)} {key_positions.dtype}")
    if logit_softcap is not None and not (0.0 < float(logit_softcap) < float("inf")):
        raise ValueError(f"logit_softcap must be a positive number or None, got {logit_softcap!r}")


def _attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float,
               logit_softcap: float | None) -> torch.Tensor:
    """Masked attention ``[..., Hq, Q, D]`` over ``k, v`` ``[..., Hkv, L, D]`` with a bool
    ``mask`` broadcastable to ``[..., Hq, Q, L]``: ``scaled_dot_product_attention``, or with a
    soft-cap the same math written out (scores and softmax in float32, as ``transformers``'
    eager Gemma 2 attention takes its softmax)."""
    hq, hkv = q.shape[-3], k.shape[-3]
    if logit_softcap is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=hq != hkv)
    if hq != hkv:
        k = k.repeat_interleave(hq // hkv, dim=-3)
        v = v.repeat_interleave(hq // hkv, dim=-3)
    s = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    s = torch.tanh(s / logit_softcap) * logit_softcap
    p = torch.softmax(s.masked_fill(~mask, float("-inf")), dim=-1)
    return torch.matmul(p, v.float()).to(q.dtype)


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

    def __init__(self) -> None:
        self.device = torch.device("cpu")  # until configure() says otherwise
        self._plan: _TorchPlan | None = None

    def plan(self, meta: AttentionMetadata) -> bool:
        device = self.device
        pl = _TorchPlan()
        starts = meta.q_starts()
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
        self._plan = pl
        return True

    def attend(self, q, k_cache, v_cache, scale, *, sliding_window=None, logit_softcap=None, positions=None,
               key_positions=None):
        pl = self._plan
        if pl is None:
            raise RuntimeError("TorchAttention.attend before plan()")
        check_attention_options(sliding_window, logit_softcap, positions, key_positions, q, k_cache)
        t, hq, d = q.shape
        hkv = k_cache.shape[2]
        kf, vf = k_cache.view(-1, hkv, d), v_cache.view(-1, hkv, d)
        kpos = key_positions.reshape(-1) if sliding_window is not None else None
        res = torch.empty_like(q)
        if pl.dec_rows is not None:
            k = kf[pl.dec_gather].transpose(0, 1)[None].to(q.dtype)  # [1, Hkv, N, D]
            v = vf[pl.dec_gather].transpose(0, 1)[None].to(q.dtype)
            qd = q[pl.dec_rows].transpose(0, 1)[None]  # [1, Hq, R, D]
            mask = pl.dec_mask
            if kpos is not None:  # [R, N]: key position inside the row's window
                mask = mask & (kpos[pl.dec_gather][None, :] > positions[pl.dec_rows][:, None] - sliding_window)
            out = _attention(qd, k, v, mask, scale, logit_softcap)
            res[pl.dec_rows] = out[0].transpose(0, 1)
        if pl.gather is not None:
            k = kf[pl.gather].transpose(1, 2).to(q.dtype)  # [B, Hkv, L, D]
            v = vf[pl.gather].transpose(1, 2).to(q.dtype)
            qd = q[pl.q_index].transpose(1, 2)  # [B, Hq, Qmax, D]
            mask = pl.mask
            if kpos is not None:  # [B, 1, Qmax, L]; padded rows keep their one key
                inside = kpos[pl.gather][:, None, :] > positions[pl.q_index][:, :, None] - sliding_window
                mask = mask & (inside | ~pl.q_valid[:, :, None])[:, None]
            out = _attention(qd, k, v, mask, scale, logit_softcap).transpose(1, 2)
            res[pl.q_index[pl.q_valid]] = out[pl.q_valid]
        return res
