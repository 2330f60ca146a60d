"""Attention over the paged KV cache: the step's metadata, the backend interface, the torch
reference backend.

A step's batch is a list of *sequences*: each is one thread's new tokens (1 for a decode
thread, several for a prompt prefill or an inserted tag) and its KV view (segments of pages
with per-page visible lengths, see :mod:`pasta_engine.core.block_manager`). The new tokens'
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
is counted in logical positions (docs/DESIGN.md section 2): a query at position ``p`` sees the keys
of its view at positions ``> p - window``, which is ``transformers``' ``q - k < window`` on a
sequential response, and for a PASTA thread keeps the keys that are near in the positions the
model was trained on. The model passes each query row's position and a table of every KV
slot's position (``key_positions``, written when the slot's key is: see
:attr:`pasta_engine.layers.kv_cache.KVCache.key_positions`).

Names on the attention path (one per concept; docs/glossary.md has the full list): a *KV
slot* is one cache position ``page * page_size + offset``; a :data:`Run` is one KV segment of
a view as ``(segment id, pages, page lens)``; a *GQA group* is the query heads that share a KV
head; the Triton decode plan's *row sets* and *split-KV partials* are its own.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Literal

import torch
import torch.nn.functional as F

from .rotary import apply_rope
from .utils import to_device

__all__ = ["AttentionMetadata", "AttentionBackend", "TorchAttention", "Run", "StepKind", "PlanHistory",
           "check_attention_options", "same_view", "view_slots", "write_kv"]

#: One KV segment of a view as attention metadata: ``(segment id, pages, page lens)``, the
#: page lens being the used slots of each page (the block manager's ``Run``; segment ids are
#: never reused, so runs with the same id hold the same pages).
Run = tuple[int, list[int], list[int]]

#: A step's shape (:attr:`AttentionMetadata.kind`): ``"decode"``: every sequence has exactly
#: one new token (query rows are the sequences, in order; the steps CUDA graphs replay);
#: ``"extend"``: no sequence has exactly one (prompt prefill, inserted tags); ``"mixed"``: both.
StepKind = Literal["decode", "extend", "mixed"]


@dataclass
class AttentionMetadata:
    """What one step's attention needs, host-side, one entry per sequence ``b`` of ``B``.

    Attributes:
        page_size: slots per KV page.
        q_lens: ``q_lens[b]`` new tokens of sequence ``b`` (query rows, consecutive in the batch).
        runs: ``runs[b]``: its KV view as :data:`Run` tuples ``(segment id, pages, page lens)``,
            in view order. A run is shared (the same lists, not a copy) by every sequence whose
            view holds that segment id, so backends that sort pages by segment never flatten.
        slots: KV slot (``page * page_size + offset``) of every query row, in row order (the
            view of sequence ``b`` ends with its rows' slots); None: read from ``runs``.
        step: the caller's step counter, or None. When a plan is made for step ``n`` right
            after one for step ``n - 1``, a backend may *update* the previous plan instead of
            building it again (see :func:`same_view`): the block manager's invariant makes that
            exact, and the tests hold the updated plan equal to a fresh one.

    The step's shape is classified here, once (:attr:`kind`, :attr:`decode_seqs`,
    :attr:`extend_seqs`, :attr:`decode_rows`); backends and the CUDA-graph runner read it.
    (Computed on first read: the lists above must not change after that.)"""

    page_size: int
    q_lens: list[int]
    runs: list[list[Run]]
    slots: list[int] | None = None
    step: int | None = None

    @classmethod
    def from_pages(cls, page_size: int, q_lens: list[int], pages: list[list[int]], page_lens: list[list[int]]
                   ) -> "AttentionMetadata":
        """Metadata whose every sequence is one private run (tests, benchmarks)."""
        runs = [[(-1 - b, list(p), list(n))] for b, (p, n) in enumerate(zip(pages, page_lens))]
        return cls(page_size=page_size, q_lens=list(q_lens), runs=runs)

    @cached_property
    def decode_seqs(self) -> list[int]:
        """Sequences with exactly one new token (decode rows), in batch order."""
        return [b for b, n in enumerate(self.q_lens) if n == 1]

    @cached_property
    def extend_seqs(self) -> list[int]:
        """Sequences with several new tokens (prompt prefill chunks, inserted tags), in batch order."""
        return [b for b, n in enumerate(self.q_lens) if n > 1]

    @cached_property
    def kind(self) -> StepKind:
        """The step's shape (see :data:`StepKind`)."""
        if len(self.decode_seqs) == len(self.q_lens):
            return "decode"
        return "mixed" if self.decode_seqs else "extend"

    @property
    def is_decode(self) -> bool:
        """Whether :attr:`kind` is ``"decode"`` (query row ``b`` is sequence ``b``'s one token)."""
        return self.kind == "decode"

    @cached_property
    def decode_rows(self) -> list[int]:
        """The query row of each of :attr:`decode_seqs` (``range(B)`` in a decode step)."""
        if self.is_decode:
            return list(range(len(self.q_lens)))
        starts = self.q_starts()
        return [starts[b] for b in self.decode_seqs]

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

    def view_key(self, b: int) -> tuple[int, int]:
        """``(segment id of the last run, number of runs)`` of sequence ``b``: see :func:`same_view`."""
        r = self.runs[b]
        return (r[-1][0], len(r))

    def row_slots(self) -> list[int]:
        """:attr:`slots`, or each query row's slot read from the end of its view."""
        if self.slots is not None:
            return self.slots
        out: list[int] = []
        for q, r in zip(self.q_lens, self.runs):
            out += view_slots(r, self.page_size)[-q:] if q else []
        return out


def same_view(prev_key: tuple[int, int], key: tuple[int, int]) -> bool:
    """Whether a sequence with :meth:`AttentionMetadata.view_key` ``key`` at step ``n`` holds
    the view it had at step ``n - 1`` (key ``prev_key``) plus step ``n``'s new tokens, appended
    to its last run.

    Exact under the block manager's invariants (:mod:`pasta_engine.core.block_manager`): a
    segment id is never reused; a sealed run never changes; the last run of a view at
    plan time is the thread's own open run, which only its appends grow (one step's new tokens
    per step); a fork makes each thread's next token start a new run (a new last id); a join
    inserts runs (a new count) or appends them (a new last segment id)."""
    return prev_key == key


class PlanHistory:
    """The one incremental-plan rule of the backends: which rows of a step hold the view they
    had at the last planned step plus this step's new tokens (:func:`same_view`), so that a
    backend may update the plan it kept instead of building it again.

    A backend records each planned step with :meth:`advance` (``meta.step`` and one key per
    row: :meth:`AttentionMetadata.view_key`, to which a backend may add what else must not
    change for its update to hold, as the Triton backend adds the row's last page) and
    :meth:`forget` after a step it planned without rows to keep. A step whose number does not
    follow the recorded one (no number; a step that ran without planning, as a CUDA graph
    replay) keeps no row.

    Attributes:
        step: the step last recorded (None: none, or forgotten).
        keys: its rows' keys."""

    def __init__(self) -> None:
        self.step: int | None = None
        self.keys: list = []
        self._prev: list | None = None  # the keys before the last advance(), when it followed them

    def advance(self, meta: AttentionMetadata, keys: list) -> bool:
        """Record ``meta``'s step with its rows' ``keys``; True when it follows the step recorded
        before with the same keys on every row (every row kept its view: update the plan)."""
        follows = meta.step is not None and self.step is not None and meta.step == self.step + 1
        self._prev = self.keys if follows else None
        self.step, self.keys = meta.step, keys
        return follows and keys == self._prev

    def kept(self, r: int) -> bool:
        """Whether row ``r`` of the step last recorded holds row ``r``'s view of the step before
        plus its new tokens."""
        prev = self._prev
        return prev is not None and r < len(prev) and same_view(prev[r], self.keys[r])

    def forget(self, step: int | None = None) -> None:
        """Record a step (number ``step``) whose plan keeps no row for the next one."""
        self.step, self.keys, self._prev = step, [], None


def view_slots(runs: list[Run], page_size: int) -> list[int]:
    """The KV slot (``page * page_size + offset``) of every used slot of a view given as
    :data:`Run` tuples, in view order: one int per token of the view (``page_size`` in tokens)."""
    return [p * page_size + i for _, ps, ns in runs for p, n in zip(ps, ns) for i in range(n)]


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
        write_kv(apply_rope(k, cos, sin), v, k_cache, v_cache, slot_mapping)
        return apply_rope(q, cos, sin)

    def rope_and_write_qkv(
        self,
        qkv: torch.Tensor,
        num_heads: int,
        cos: torch.Tensor,
        sin: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> torch.Tensor:
        """:meth:`rope_and_write` on a packed projection.

        Args:
            qkv: ``[T, (Hq + 2 * Hkv) * D]``: each row's q heads, then k heads, then v heads
                (the fused q/k/v GEMM's output, model dtype).
            num_heads: ``Hq`` (``Hkv`` and ``D`` are read from ``k_cache``).
            cos, sin, k_cache, v_cache, slot_mapping: as :meth:`rope_and_write`.

        Returns rotated q ``[T, Hq, D]`` (a view into a ``[T, Hq + Hkv, D]`` tensor). A backend
        that overrides :meth:`rope_and_write` gets it called on the split heads; otherwise q
        and k are rotated by one :func:`apply_rope` over their adjacent heads (the same
        elementwise ops as two calls, so bitwise the same values, with half the launches)."""
        t = qkv.shape[0]
        hkv, d = k_cache.shape[2], k_cache.shape[3]
        heads = qkv.view(t, num_heads + 2 * hkv, d)
        if type(self).rope_and_write is not AttentionBackend.rope_and_write:
            return self.rope_and_write(heads[:, :num_heads], heads[:, num_heads : num_heads + hkv],
                                       heads[:, num_heads + hkv :], cos, sin, k_cache, v_cache, slot_mapping)
        qk = apply_rope(heads[:, : num_heads + hkv], cos, sin)
        write_kv(qk[:, num_heads:], heads[:, num_heads + hkv :], k_cache, v_cache, slot_mapping)
        return qk[:, :num_heads]

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


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Write rotated ``k`` and raw ``v`` ``[T, Hkv, D]`` into one layer's cache ``k_cache``,
    ``v_cache`` (``[num_pages, page_size, Hkv, D]`` or ``[num_slots, Hkv, D]``; cast to the
    cache dtype) at int64 ``slot_mapping`` ``[T]`` (``page * page_size + offset``), in place.
    Raises what ``index_copy_`` raises for a slot outside the cache."""
    hkv, d = k.shape[1], k.shape[2]
    k_cache.view(-1, hkv, d).index_copy_(0, slot_mapping, k.to(k_cache.dtype))
    v_cache.view(-1, hkv, d).index_copy_(0, slot_mapping, v.to(v_cache.dtype))


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
    """Masked attention ``[..., Hq, Q, D]`` over ``k, v`` ``[..., Hkv, L, D]`` with a ``mask``
    broadcastable to ``[..., Hq, Q, L]``: bool (True: visible) or additive float (0 or -inf, in
    q's dtype). ``scaled_dot_product_attention``, or with a soft-cap the same math written out
    (scores and softmax in float32, as ``transformers``' eager Gemma 2 attention takes its
    softmax)."""
    hq, hkv = q.shape[-3], k.shape[-3]
    if logit_softcap is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=hq != hkv)
    if hq != hkv:
        k = k.repeat_interleave(hq // hkv, dim=-3)
        v = v.repeat_interleave(hq // hkv, dim=-3)
    s = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    s = torch.tanh(s / logit_softcap) * logit_softcap
    s = s.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else s + mask.float()
    p = torch.softmax(s, dim=-1)
    return torch.matmul(p, v.float()).to(q.dtype)


class DecodeTable:
    """The torch backend's decode plan, kept across steps: one table row per decode sequence
    with the slot ids of its whole view (padded) and an additive mask (0 where a slot is used,
    -inf in the padding).

    Tensors (on the backend's device): ``slots`` ``[rows_cap, len_cap]`` int64, ``mask``
    ``[rows_cap, len_cap]`` float32, ``next`` ``[rows_cap]`` int64 (flat index of each row's
    first unused entry). Host side: ``history`` (the :class:`PlanHistory` of the rows' views:
    ``keys[r]``, :meth:`AttentionMetadata.view_key` of the sequence in row ``r``, and ``step``,
    the step of the last update), ``lens[r]`` (used entries), ``longest`` and ``bumped`` (the
    last update's new slot of each row when every row only grew by it, else None).

    :meth:`update` makes row ``r`` hold sequence ``r`` of the step: a row whose sequence is the
    one it held at the previous step (:func:`same_view`) only gets its new slot appended (one
    vectorized write for all such rows); any other row is filled again from its runs (forks,
    joins, threads that start or end, after a step that did not plan). Capacities double when
    exceeded."""

    def __init__(self, device: torch.device):
        self.device = device
        self.slots = torch.zeros(0, 0, dtype=torch.long, device=device)
        self.mask = torch.zeros(0, 0, dtype=torch.float32, device=device)
        self._set_next(torch.zeros(0, dtype=torch.long, device=device))
        self.history = PlanHistory()
        self.lens: list[int] = []
        self.longest = 0
        self.bumped: list[int] | None = None  # the last update's new slots when it only appended

    @property
    def step(self) -> int | None:
        """The step of the last update (or of the last step planned without decode rows)."""
        return self.history.step

    @property
    def keys(self) -> list[tuple[int, int]]:
        """The view key of the sequence in each row."""
        return self.history.keys

    def _grow(self, rows: int, length: int) -> None:
        r_cap, l_cap = self.slots.shape
        if rows <= r_cap and length <= l_cap:
            return
        r_new = max(rows, 2 * r_cap, 16) if rows > r_cap else r_cap
        l_new = max(length, 2 * l_cap, 64) if length > l_cap else l_cap
        slots = torch.zeros(r_new, l_new, dtype=torch.long, device=self.device)
        mask = torch.full((r_new, l_new), float("-inf"), dtype=torch.float32, device=self.device)
        slots[:r_cap, :l_cap] = self.slots
        mask[:r_cap, :l_cap] = self.mask
        self.slots, self.mask = slots, mask
        self.lens += [0] * (r_new - r_cap)
        self._set_next(torch.arange(r_new, device=self.device) * l_new + to_device(self.lens, torch.long, self.device))

    def _set_next(self, nxt: torch.Tensor) -> None:
        self.next = nxt
        # on a CPU the per-step bump writes through numpy views (a few microseconds, where
        # each torch op costs as much as the whole write)
        self._np = (self.slots.numpy().reshape(-1), self.mask.numpy().reshape(-1), nxt.numpy()) \
            if self.device.type == "cpu" else None

    def update(self, meta: AttentionMetadata, seqs: list[int], new_slots: list[int]) -> int:
        """Make rows ``0..len(seqs)-1`` hold the views of ``meta``'s sequences ``seqs`` (single
        -token ones) whose new tokens go to ``new_slots`` (one KV slot each); returns the longest
        row's length in tokens. Raises nothing of its own (tensor errors propagate)."""
        n = len(seqs)
        runs = meta.runs
        keys = [(runs[b][-1][0], len(runs[b])) for b in seqs]  # meta.view_key(b), inlined (per step)
        history = self.history
        self.bumped = None
        lens = self.lens
        dev = self.device
        if history.advance(meta, keys):  # the common step: every row grows by one slot
            if self.longest + 1 > self.slots.shape[1]:
                self._grow(n, self.longest + 1)
                lens = self.lens
            if self._np is not None:
                slots_np, mask_np, next_np = self._np
                at = next_np[:n]
                slots_np[at] = new_slots
                mask_np[at] = 0.0
            else:
                at = self.next[:n]
                self.slots.view(-1).index_copy_(0, at, to_device(new_slots, torch.long, dev))
                self.mask.view(-1).index_fill_(0, at, 0.0)
            at += 1
            lens[:n] = [x + 1 for x in lens[:n]]
            self.longest += 1
            self.bumped = new_slots
            return self.longest
        bump, fill = [], []
        for r in range(n):
            (bump if history.kept(r) else fill).append(r)
        fill_slots = [view_slots(runs[seqs[r]], meta.page_size) for r in fill]
        self._grow(n, max([lens[r] + 1 for r in bump] + [len(x) for x in fill_slots]))
        lens = self.lens
        cap = self.slots.shape[1]
        if bump:
            at = self.next[to_device(bump, torch.long, dev)]
            self.slots.view(-1).index_copy_(0, at, to_device([new_slots[r] for r in bump], torch.long, dev))
            self.mask.view(-1).index_fill_(0, at, 0.0)
            for r in bump:
                lens[r] += 1
        if fill:
            width = max(len(x) for x in fill_slots)
            padded = [s for x in fill_slots for s in x + [0] * (width - len(x))]
            rows = to_device(fill, torch.long, dev)
            fl = to_device([len(x) for x in fill_slots], torch.long, dev)
            self.slots[rows, :width] = to_device(padded, torch.long, dev).view(len(fill), width)
            used = torch.arange(cap, device=dev)[None, :] < fl[:, None]
            self.mask[rows] = torch.where(used, 0.0, float("-inf"))
            for r, x in zip(fill, fill_slots):
                lens[r] = len(x)
        self._set_next(torch.arange(len(lens), device=dev) * cap + to_device(lens, torch.long, dev))
        self.longest = max(lens[:n])
        return self.longest


@dataclass
class _TorchPlan:
    # single-token sequences: rows [0, R) of the decode table, padded to the longest view
    dec_rows: torch.Tensor | None = None  # [R] query rows of T (None: all rows, in order)
    dec_n: int = 0  # R
    dec_len: int = 0  # the longest view (L)
    dec_flat: torch.Tensor | None = None  # [R * L] int64 the rows' slots (set by the first attend)
    dec_mask: torch.Tensor | None = None  # [R, 1, 1, L] additive mask in q's dtype (idem)
    dec_bump: tuple[torch.Tensor, torch.Tensor] | None = None  # mirror positions, slots [R] (idem)
    # multi-token rows: each sequence's view padded to a dense tensor, causal inside the chunk
    gather: torch.Tensor | None = None  # [B, Lmax] slot ids (padded with 0)
    mask: torch.Tensor | None = None  # [B, 1, Qmax, Lmax] bool
    q_index: torch.Tensor | None = None  # [B, Qmax] row of T (padded with 0)
    q_valid: torch.Tensor | None = None  # [B, Qmax] bool


@dataclass
class _Mirror:
    # one layer's copy of the decode rows' K/V: [rows_cap, len_cap, Hkv, D] each (the decode
    # table's capacities), valid for the table as it was at plan step `synced`
    k: torch.Tensor
    v: torch.Tensor
    synced: int | None = None

    @property
    def nbytes(self) -> int:
        return 2 * self.k.numel() * self.k.element_size()


class TorchAttention(AttentionBackend):
    """Reference backend built on ``torch.nn.functional.scaled_dot_product_attention`` with
    explicit masks.

    Single-token rows (decode steps) attend over their own views, gathered from the
    :class:`DecodeTable` the backend keeps across steps (a row's slots are appended to, not
    rebuilt, while its view only grows): one batched attention over ``[R, L]`` padded keys,
    read from a per-layer copy of the rows' K/V that a plain decode step appends ``R`` tokens
    to (:meth:`_mirrored`; up to :attr:`mirror_bytes`, else gathered from the cache). (Gathering the union of the views once and masking every row against it reads shared
    pages once but computes ``R x union`` scores, which on a CPU costs more than the repeated
    gathers.) Multi-token rows (prefill chunks, inserted tags) gather their view into a padded
    dense tensor, with the chunk's tokens masked causally, planned every step."""

    name = "torch"
    #: bytes all layers' K/V mirrors may take together (see :meth:`_mirrored`); past it the
    #: rows are gathered from the cache every step
    mirror_bytes = 64 * 2**20

    def __init__(self) -> None:
        self.device = torch.device("cpu")  # until configure() says otherwise
        self._plan: _TorchPlan | None = None
        self._table: DecodeTable | None = None
        self._mirrors: dict[tuple, _Mirror] = {}  # per layer's cache: (data_ptr, shape, dtype) -> mirror

    def plan(self, meta: AttentionMetadata) -> bool:
        device = self.device
        pl = _TorchPlan()
        dec, ext = meta.decode_seqs, meta.extend_seqs
        slots = meta.row_slots()
        dec_slots = slots if meta.is_decode else [slots[r] for r in meta.decode_rows]
        ps = meta.page_size
        if self._table is None or self._table.device != device:
            self._table = DecodeTable(device)
        if dec:
            pl.dec_len = self._table.update(meta, dec, dec_slots)
            pl.dec_n = len(dec)
            if ext:
                pl.dec_rows = to_device(meta.decode_rows, torch.long, device)
        else:
            self._table.history.forget(meta.step)
            self._table.bumped = None
        if ext:
            starts = meta.q_starts()
            q_len = torch.tensor([meta.q_lens[b] for b in ext])
            kv_len = torch.tensor([meta.kv_len(b) for b in ext])
            qmax, lmax = int(q_len.max()), int(kv_len.max())
            gather = torch.zeros(len(ext), lmax, dtype=torch.long)
            for i, b in enumerate(ext):
                gather[i, : int(kv_len[i])] = torch.tensor(view_slots(meta.runs[b], ps), dtype=torch.long)
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

    def decode_views(self) -> list[list[int]]:
        """The current plan's decode rows as slot lists (tests: compare with a fresh plan)."""
        pl, t = self._plan, self._table
        if pl is None or not pl.dec_n:
            return []
        return [t.slots[r, : t.lens[r]].tolist() for r in range(pl.dec_n)]

    def _dec_flat(self, pl: _TorchPlan) -> torch.Tensor:
        """The decode rows' slots ``[R * L]`` int64 (padding: slot 0), made once per step."""
        if pl.dec_flat is None:
            pl.dec_flat = self._table.slots[: pl.dec_n, : pl.dec_len].reshape(-1)
        return pl.dec_flat

    def _mirrored(self, pl: _TorchPlan, k_cache: torch.Tensor, kf: torch.Tensor, vf: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The decode rows' keys and values ``[R, L, Hkv, D]`` (views of this layer's
        :class:`_Mirror`), or None when the mirrors would pass :attr:`mirror_bytes`.

        The mirror holds, for each decode-table row, a copy of its view's K/V. After a step in
        which every row only grew by its new token (:attr:`DecodeTable.bumped`) it takes just
        those ``R`` tokens from the cache (written by this step's :meth:`rope_and_write`);
        after any other step (forks, joins, new threads, a grown table, a step without a plan
        number) it is gathered again from the cache. The values are the gathered ones, so the
        attention is bitwise the same (padding holds finite stale values, masked to -inf as
        before)."""
        table, n, length = self._table, pl.dec_n, pl.dec_len
        key = (k_cache.data_ptr(), tuple(k_cache.shape), k_cache.dtype)
        m = self._mirrors.get(key)
        cap = tuple(table.slots.shape)
        if m is None or tuple(m.k.shape[:2]) != cap:
            nbytes = 2 * cap[0] * cap[1] * kf[0].numel() * kf.element_size()
            others = sum(x.nbytes for k2, x in self._mirrors.items() if k2 != key)
            if others + nbytes > self.mirror_bytes:
                self._mirrors.pop(key, None)
                return None
            shape = (*cap, *kf.shape[1:])
            m = _Mirror(torch.zeros(shape, dtype=kf.dtype, device=kf.device),
                        torch.zeros(shape, dtype=vf.dtype, device=vf.device))
            self._mirrors[key] = m
        step = table.step
        if step is None or m.synced != step:
            if step is not None and m.synced == step - 1 and table.bumped is not None:
                if pl.dec_bump is None:  # once per step: flat mirror positions of the new tokens, their slots
                    pl.dec_bump = (table.next[:n] - 1, to_device(table.bumped, torch.long, table.device))
                at, new = pl.dec_bump
                m.k.view(-1, *kf.shape[1:]).index_copy_(0, at, kf.index_select(0, new))
                m.v.view(-1, *vf.shape[1:]).index_copy_(0, at, vf.index_select(0, new))
            else:
                flat = self._dec_flat(pl)
                m.k[:n, :length] = kf.index_select(0, flat).view(n, length, *kf.shape[1:])
                m.v[:n, :length] = vf.index_select(0, flat).view(n, length, *vf.shape[1:])
            m.synced = step
        return m.k[:n, :length], m.v[:n, :length]

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
        if pl.dec_n:
            n, length = pl.dec_n, pl.dec_len
            table = self._table
            kv = self._mirrored(pl, k_cache, kf, vf)
            if kv is None:
                flat = self._dec_flat(pl)
                kv = kf.index_select(0, flat).view(n, length, hkv, d), vf.index_select(0, flat).view(n, length, hkv, d)
            k, v = kv[0].transpose(1, 2), kv[1].transpose(1, 2)  # [R, Hkv, L, D]
            if k.dtype != q.dtype:
                k, v = k.to(q.dtype), v.to(q.dtype)
            rows = pl.dec_rows
            qd = (q if rows is None else q.index_select(0, rows)).unsqueeze(2)  # [R, Hq, 1, D]
            if kpos is not None:  # key position inside the row's window
                row_pos = positions if rows is None else positions[rows]
                mask = table.mask[:n, :length].masked_fill(
                    kpos[self._dec_flat(pl)].view(n, length) <= row_pos[:, None] - sliding_window, float("-inf"))
                mask = mask.view(n, 1, 1, length).to(q.dtype)
            else:
                if pl.dec_mask is None or pl.dec_mask.dtype != q.dtype:  # [R, 1, 1, L], once per step
                    pl.dec_mask = table.mask[:n, :length].view(n, 1, 1, length).to(q.dtype)
                mask = pl.dec_mask
            out = _attention(qd, k, v, mask, scale, logit_softcap).select(2, 0)
            if rows is None and pl.gather is None:
                return out
        res = torch.empty_like(q)
        if pl.dec_n:
            res[pl.dec_rows] = out
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
