"""The Triton attention backend: fused RoPE + paged KV write, tree decode attention for
single-token rows, extend attention for multi-token rows (prompt prefill, inserted tags).

Importing this module imports :mod:`pasta_engine.triton_kernels`, which switches Triton to its
interpreter on machines without a CUDA GPU (slow, for tests).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .attention import AttentionBackend, AttentionMetadata, to_device
from .triton_kernels.extend_attention import extend_attention, extend_indices
from .triton_kernels.kv_write import rope_and_write as _rope_and_write
from .triton_kernels.tree_attention import DecodePlan, _Buffers, build_plan, tree_decode_attention

__all__ = ["TritonAttention"]


@dataclass
class _Plan:
    decode: DecodePlan | None = None
    dec_rows: torch.Tensor | None = None  # token rows of the decode sequences (None: all rows, in order)
    ext_rows: torch.Tensor | None = None
    ext_index: tuple | None = None
    ext_max_q: int = 0
    buffers: _Buffers | None = None  # partial-result buffers (a CUDA graph owns its own)


class TritonAttention(AttentionBackend):
    """Triton kernels for every attention operation of a step.

    Args:
        decode_mode: ``auto`` (tree when sharing saves reads, else plain per-thread), ``tree``
            or ``plain`` (see :func:`~pasta_engine.triton_kernels.tree_attention.build_plan`).
        merge: ``inline`` (fold split-KV partials in the same launch), ``separate`` (a second
            Triton kernel) or ``csrc`` (the CUDA extension's ``lse_merge``).
        kv_write: ``triton`` (fused RoPE + paged KV write kernel), ``csrc`` (the CUDA
            extension's op) or ``torch`` (the reference ops).

    Raises ValueError for an unknown option, RuntimeError when ``csrc`` is asked for and the
    extension is not built."""

    name = "triton"

    def __init__(self, decode_mode: str = "auto", merge: str = "inline", kv_write: str = "triton"):
        if decode_mode not in ("auto", "tree", "plain"):
            raise ValueError(f"decode_mode must be 'auto', 'tree' or 'plain', got {decode_mode!r}")
        if merge not in ("inline", "separate", "csrc"):
            raise ValueError(f"merge must be 'inline', 'separate' or 'csrc', got {merge!r}")
        if kv_write not in ("triton", "csrc", "torch"):
            raise ValueError(f"kv_write must be 'triton', 'csrc' or 'torch', got {kv_write!r}")
        if "csrc" in (merge, kv_write):
            from . import csrc_ops

            if not csrc_ops.available():
                raise RuntimeError(f"the CUDA extension is not available ({csrc_ops.unavailable_reason()}); "
                                   f"build it with: {csrc_ops.BUILD_COMMAND}")
        self.decode_mode = decode_mode
        self.merge = merge
        self.kv_write = kv_write
        self.num_kv_heads = 0
        self.group = 0

    def configure(self, num_heads: int, num_kv_heads: int) -> None:
        """Model shape (called by the engine before the first step)."""
        self.num_kv_heads = num_kv_heads
        self.group = num_heads // num_kv_heads

    def plan(self, meta: AttentionMetadata, device: torch.device) -> None:
        if not self.num_kv_heads:
            raise RuntimeError("TritonAttention.configure(num_heads, num_kv_heads) was not called")
        p = _Plan()
        starts, t = [], 0
        for n in meta.q_lens:
            starts.append(t)
            t += n
        dec = [b for b, n in enumerate(meta.q_lens) if n == 1]
        ext = [b for b, n in enumerate(meta.q_lens) if n > 1]
        if dec:
            p.decode = build_plan([meta.runs[b] for b in dec], group=self.group, num_kv_heads=self.num_kv_heads, device=device,
                                  mode=self.decode_mode)
            if len(dec) != len(meta.q_lens):
                p.dec_rows = to_device([starts[b] for b in dec], torch.long, device)
        if ext:
            rows = [r for b in ext for r in range(starts[b], starts[b] + meta.q_lens[b])]
            p.ext_rows = to_device(rows, torch.long, device)
            p.ext_index = extend_indices([meta.q_lens[b] for b in ext], [meta.pages(b) for b in ext],
                                         [meta.page_lens(b) for b in ext], device)
            p.ext_max_q = max(meta.q_lens[b] for b in ext)
        meta.plan = p

    def rope_and_write(self, q, k, v, cos, sin, k_cache, v_cache, meta):
        if self.kv_write == "triton":
            return _rope_and_write(q, k, v, cos, sin, k_cache, v_cache, meta.slot_mapping)
        if self.kv_write == "csrc":
            from . import csrc_ops

            return csrc_ops.rope_kv_write(q, k, v, cos, sin, k_cache, v_cache, meta.slot_mapping)
        return super().rope_and_write(q, k, v, cos, sin, k_cache, v_cache, meta)

    def attend(self, q, k_cache, v_cache, meta, scale):
        p: _Plan = meta.plan
        if p.decode is not None and p.dec_rows is None:
            return tree_decode_attention(q, k_cache, v_cache, p.decode, scale, merge=self.merge, buffers=p.buffers)
        out = torch.empty_like(q)
        if p.decode is not None:
            out[p.dec_rows] = tree_decode_attention(q[p.dec_rows], k_cache, v_cache, p.decode, scale,
                                                    merge=self.merge, buffers=p.buffers)
        if p.ext_rows is not None:
            out[p.ext_rows] = extend_attention(q[p.ext_rows], k_cache, v_cache, *p.ext_index, scale,
                                               max_q_len=p.ext_max_q)
        return out
