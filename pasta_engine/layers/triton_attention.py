"""The Triton attention backend: fused RoPE + paged KV write, tree decode attention for
single-token sequences, extend attention for multi-token ones (prompt prefill, inserted tags).

Importing this module imports :mod:`pasta_engine.triton_kernels`, which switches Triton to its
interpreter on machines without a CUDA GPU (slow, for tests).

Graph mode (FlashInfer's ``use_cuda_graph`` wrappers): :meth:`TritonAttention.for_cuda_graph`
returns an instance that owns a :class:`~pasta_engine.triton_kernels.tree_attention.StaticDecodePlan`
and a workspace sized to capacity; its :meth:`~TritonAttention.plan` copies the step's plan into
those buffers (no allocation, no host sync) and answers False when the step does not fit (a
multi-token sequence, more rows than the bucket, a plan over capacity).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import ParameterError
from ..triton_kernels.extend_attention import extend_attention, extend_indices
from ..triton_kernels.kv_write import rope_and_write as _rope_and_write
from ..triton_kernels.tree_attention import (
    DecodePlan,
    DecodeWorkspace,
    StaticDecodePlan,
    plan_lists,
    tree_decode_attention,
    upload_plan,
)
from .attention import AttentionBackend, AttentionMetadata, PlanHistory, check_attention_options
from .utils import to_device

__all__ = ["TritonAttention"]

DECODE_MODES = ("auto", "tree", "plain")
MERGES = ("inline", "separate", "csrc")
KV_WRITES = ("triton", "csrc", "torch")


@dataclass
class _Plan:
    decode: DecodePlan | None = None
    dec_rows: torch.Tensor | None = None  # token rows of the decode sequences (None: all rows, in order)
    ext_rows: torch.Tensor | None = None
    ext_index: tuple | None = None
    ext_max_q: int = 0


@dataclass
class _Bump:
    """What lets the next step's decode plan be an update of this one (when the backend's
    :class:`~pasta_engine.layers.attention.PlanHistory`, keyed by each row's ``(segment id of
    its last run, run count, last page)``, says every row kept its view): the entries of the plan's
    ``page_lens`` that hold each row's last page (``index`` ``[R]`` int64 on the device)."""

    index: torch.Tensor
    ones: torch.Tensor
    page_lens: torch.Tensor


def _row_keys(meta: AttentionMetadata) -> list[tuple[int, int, int]]:
    """Each row's :meth:`AttentionMetadata.view_key` plus its last page (a new page ends the bump)."""
    return [(*meta.view_key(b), r[-1][1][-1]) for b, r in enumerate(meta.runs)]


def _bump_index(arrays: dict[str, list[int]], keys: list[tuple[int, int, int]], device: torch.device) -> torch.Tensor:
    """Entries of ``arrays["page_lens"]`` holding each row's last page (a row's last run is its
    own open one, so its pages occur once in the plan)."""
    where = {p: i for i, p in enumerate(arrays["pages"])}
    return to_device([where[k[2]] for k in keys], torch.long, device)


@dataclass
class _GraphState:
    """What a graph-mode instance owns: the static plan and the planning capacities."""

    static: StaticDecodePlan
    max_rows: int
    target_work: int
    rows_per_item: int
    block_m: int


class TritonAttention(AttentionBackend):
    """Triton kernels for every attention operation of a step.

    Args:
        decode_mode: ``auto`` (tree when sharing saves reads, else plain per-thread), ``tree``
            or ``plain`` (see :func:`~pasta_engine.triton_kernels.tree_attention.build_plan`).
        merge: ``inline`` (merge split-KV partials in the same launch), ``separate`` (a second
            Triton kernel) or ``csrc`` (the CUDA extension's ``lse_merge``).
        kv_write: ``triton`` (fused RoPE + paged KV write kernel), ``csrc`` (the CUDA
            extension's op) or ``torch`` (the reference ops).

    Raises ParameterError for an unknown option, RuntimeError when ``csrc`` is asked for and
    the extension is not built."""

    name = "triton"
    supports_cuda_graphs = True

    def __init__(self, decode_mode: str = "auto", merge: str = "inline", kv_write: str = "triton"):
        for param, value, known in (("decode_mode", decode_mode, DECODE_MODES), ("merge", merge, MERGES),
                                    ("kv_write", kv_write, KV_WRITES)):
            if value not in known:
                raise ParameterError(param, value, " or ".join(repr(k) for k in known))
        if "csrc" in (merge, kv_write):
            from . import csrc_ops

            if not csrc_ops.available():
                raise RuntimeError(f"the CUDA extension is not available ({csrc_ops.unavailable_reason()}); "
                                   f"build it with: {csrc_ops.BUILD_COMMAND}")
        self.decode_mode = decode_mode
        self.merge = merge
        self.kv_write = kv_write
        self.num_heads = self.num_kv_heads = self.head_dim = 0
        self.device = torch.device("cpu")
        self._plan: _Plan | None = None
        self._page_size = 0  # the planned step's (AttentionMetadata.page_size), which attend's caches must have
        self._workspace = DecodeWorkspace()
        self._graph: _GraphState | None = None
        self._bump: _Bump | None = None
        self._history = PlanHistory()

    @property
    def group(self) -> int:
        """Query heads per KV head (the GQA group)."""
        return self.num_heads // self.num_kv_heads

    def _merge_fn(self):
        if self.merge == "csrc":
            from . import csrc_ops

            return csrc_ops.lse_merge
        return self.merge

    # ------------------------------------------------------------------ planning

    def _try_bump(self, meta: AttentionMetadata) -> list[tuple[int, int, int]] | None:
        """Update the last decode plan in place when this step only appends one token to each
        row's last page (no fork, join, new thread or page boundary since the last step): every
        row's used length in ``page_lens`` + 1. Returns None when it did, else the rows' keys
        (for :meth:`_remember`)."""
        if meta.step is None or not meta.is_decode:
            self._bump = None
            self._history.forget(meta.step)
            return []
        keys = _row_keys(meta)
        b = self._bump
        if self._history.advance(meta, keys) and b is not None:
            b.page_lens.index_add_(0, b.index, b.ones)
            return None
        return keys

    def _remember(self, meta: AttentionMetadata, keys, arrays: dict[str, list[int]], page_lens: torch.Tensor) -> None:
        if not keys:
            self._bump = None
            return
        index = _bump_index(arrays, keys, self.device)
        self._bump = _Bump(index, torch.ones(len(keys), dtype=torch.int32, device=self.device), page_lens)

    def plan(self, meta: AttentionMetadata) -> bool:
        """Plan the step (see :meth:`AttentionBackend.plan`): a pure decode step that follows
        the last planned one with the same rows and no new page (``meta.step``) only bumps
        the plan's page lengths on the device; anything else plans from ``meta``'s runs."""
        if not self.num_kv_heads:
            raise RuntimeError("TritonAttention.configure(num_heads, num_kv_heads, device) was not called")
        self._page_size = meta.page_size
        if self._graph is not None:
            return self._plan_static(meta)
        keys = self._try_bump(meta)
        if keys is None:
            return True
        device = self.device
        p = _Plan()
        starts = meta.q_starts()
        dec, ext = meta.decode_seqs, meta.extend_seqs
        if dec:
            arrays, info = plan_lists([meta.runs[b] for b in dec], group=self.group, num_kv_heads=self.num_kv_heads,
                                      device=device, mode=self.decode_mode)
            p.decode = upload_plan(arrays, info, device)
            self._remember(meta, keys, arrays, p.decode.page_lens)
            if not meta.is_decode:
                p.dec_rows = to_device(meta.decode_rows, torch.long, device)
        if ext:
            rows = [r for b in ext for r in range(starts[b], starts[b] + meta.q_lens[b])]
            p.ext_rows = to_device(rows, torch.long, device)
            p.ext_index = extend_indices([meta.q_lens[b] for b in ext], [meta.pages(b) for b in ext],
                                         [meta.page_lens(b) for b in ext], device)
            p.ext_max_q = max(meta.q_lens[b] for b in ext)
        self._plan = p
        return True

    def _plan_static(self, meta: AttentionMetadata) -> bool:
        g = self._graph
        if len(meta.q_lens) > g.max_rows or not meta.is_decode:
            self._bump = None
            self._history.forget(meta.step)
            return False
        keys = self._try_bump(meta)
        if keys is None:
            return True
        arrays, info = plan_lists(
            meta.runs, group=self.group, num_kv_heads=self.num_kv_heads, device=self.device,
            mode=self.decode_mode, target_work=g.target_work, max_rows_per_item=g.rows_per_item, block_m=g.block_m,
        )
        if not g.static.load(arrays, info):
            self._bump = None
            return False
        self._remember(meta, keys, arrays, g.static.tensors["page_lens"])
        return True

    def for_cuda_graph(self, max_rows: int, num_pages: int, rows_per_item: int = 16) -> "TritonAttention":
        """A graph-mode instance for up to ``max_rows`` single-token sequences over a cache of
        ``num_pages`` pages (see the module docstring). Needs a CUDA device and a KV write that
        skips padding rows' slot -1 (``kv_write`` ``"triton"`` or ``"csrc"``; the reference
        ``"torch"`` write, ``index_copy_``, does not: ParameterError naming ``kv_write``)."""
        if self.kv_write == "torch":
            raise ParameterError("kv_write", self.kv_write, "'triton' or 'csrc' for CUDA graphs: their padding rows "
                                 "carry slot -1, which only those KV writes skip (or run without CUDA graphs)")
        if self.device.type != "cuda":
            raise RuntimeError("CUDA-graph mode needs the model on a CUDA device")
        inst = TritonAttention(self.decode_mode, self.merge, self.kv_write)
        inst.configure(self.num_heads, self.num_kv_heads, self.device, self.head_dim)
        sms = torch.cuda.get_device_properties(self.device).multi_processor_count
        target_work = max(1, 4 * sms // self.num_kv_heads)
        max_work = target_work + 4 * max_rows
        max_parts = max_work * rows_per_item
        g2 = 1 << max(0, (self.group - 1).bit_length())
        rows = min(max_rows, rows_per_item)
        block_m = max(16, 1 << max(0, (rows * g2 - 1).bit_length()))
        static = StaticDecodePlan(max_rows, max_work, max_parts, 4 * num_pages, block_m, self.device)
        inst._graph = _GraphState(static, max_rows, target_work, rows_per_item, block_m)
        inst._plan = _Plan(decode=static.plan)
        # size the scratch buffers to capacity now: nothing may allocate inside capture
        inst._workspace.get(max_parts, max_rows, self.num_heads, self.num_kv_heads, self.head_dim, self.device)
        return inst

    # ------------------------------------------------------------------ per layer

    def rope_and_write(self, q, k, v, cos, sin, k_cache, v_cache, slot_mapping):
        if self.kv_write == "triton":
            return _rope_and_write(q, k, v, cos, sin, k_cache, v_cache, slot_mapping)
        if self.kv_write == "csrc":
            from . import csrc_ops

            return csrc_ops.rope_kv_write(q, k, v, cos, sin, k_cache, v_cache, slot_mapping)
        return super().rope_and_write(q, k, v, cos, sin, k_cache, v_cache, slot_mapping)

    def attend(self, q, k_cache, v_cache, scale, *, sliding_window=None, logit_softcap=None, positions=None,
               key_positions=None):
        p = self._plan
        if p is None:
            raise RuntimeError("TritonAttention.attend before plan()")
        if k_cache.dim() != 4 or k_cache.shape[1] != self._page_size:
            # the kernels read the page size off the cache: another one would drop or misread slots
            raise ValueError(f"k_cache {tuple(k_cache.shape)} must be [num_pages, page_size={self._page_size}, Hkv, D], "
                             "the page size of the planned step's metadata")
        check_attention_options(sliding_window, logit_softcap, positions, key_positions, q, k_cache)
        merge = self._merge_fn()
        opts = dict(sliding_window=sliding_window, logit_softcap=logit_softcap, key_positions=key_positions)
        if p.decode is not None and p.dec_rows is None:
            return tree_decode_attention(q, k_cache, v_cache, p.decode, scale, merge=merge, workspace=self._workspace,
                                         q_positions=positions, **opts)
        out = torch.empty_like(q)
        if p.decode is not None:
            rows_pos = None if sliding_window is None else positions[p.dec_rows]
            out[p.dec_rows] = tree_decode_attention(q[p.dec_rows], k_cache, v_cache, p.decode, scale, merge=merge,
                                                    workspace=self._workspace, q_positions=rows_pos, **opts)
        if p.ext_rows is not None:
            rows_pos = None if sliding_window is None else positions[p.ext_rows]
            out[p.ext_rows] = extend_attention(q[p.ext_rows], k_cache, v_cache, *p.ext_index, scale,
                                               max_q_len=p.ext_max_q, q_positions=rows_pos, **opts)
        return out
