"""Attention over the paged KV cache: the step's metadata and the backend interface (the torch
reference backend is :mod:`pasta_engine.layers.reference_attention`).

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

The backends (:mod:`pasta_engine.layers.backends` names them): the reference
:class:`~pasta_engine.layers.reference_attention.TorchAttention` gathers each sequence's view
into a dense tensor and calls ``scaled_dot_product_attention`` with explicit masks;
:mod:`~pasta_engine.layers.triton_attention` and :mod:`~pasta_engine.layers.flex_attention`
are the fast ones.

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

from .rotary import apply_rope

__all__ = ["AttentionMetadata", "AttentionBackend", "Run", "StepKind", "PlanHistory", "check_attention_options",
           "same_view", "view_slots", "write_kv"]

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
