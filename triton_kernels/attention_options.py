"""The per-layer attention options both attention kernels take, and their host-side checks.

* Sliding window (Mistral, Phi-3, Gemma 2's alternate layers): a query at logical position
  ``p`` sees only keys whose logical position is ``> p - window``. Positions are logical
  (docs/DESIGN.md section 2), so the kernels read each query's position and each cache slot's
  position (a ``[num_pages, page_size]`` int32 table the caller keeps beside the KV cache)
  and mask per (query, key); pages are not skipped yet.
* Attention-logit soft-capping (Gemma 2): scores ``s`` (after the softmax scale) become
  ``cap * tanh(s / cap)`` before the softmax. Triton's interpreter has no ``libdevice``
  (docs/DESIGN.md section 5), so :func:`tanh` is written with one ``exp`` of a non-positive
  argument: ``tanh(x) = sign(x) (1 - e) / (1 + e)`` with ``e = exp(-2|x|)``, which never
  overflows (absolute error ~1e-7).
"""

from __future__ import annotations

import torch

from . import INTERPRET  # noqa: F401  (the package sets TRITON_INTERPRET on CPU before triton.jit runs)

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

__all__ = ["tanh", "check_window", "check_softcap"]


@triton.jit
def tanh(x):
    """Elementwise ``tanh`` of a float32 tensor."""
    e = tl.exp(-2.0 * tl.abs(x))
    t = (1.0 - e) / (1.0 + e)
    return tl.where(x >= 0, t, -t)


def check_window(sliding_window: int | None, q_positions: torch.Tensor | None, key_positions: torch.Tensor | None,
                 rows: int, k_cache: torch.Tensor, fn: str) -> int:
    """The window to pass to a kernel (0: none). Raises ValueError naming ``sliding_window``
    when it is not a positive int or its position inputs are missing or malformed:
    ``q_positions`` ``[rows]`` int32/int64 (unit stride) and ``key_positions`` ``[num_pages, page_size]`` int32
    (unit last stride), both on the cache's device."""
    if sliding_window is None:
        return 0
    if isinstance(sliding_window, bool) or not isinstance(sliding_window, int) or sliding_window < 1:
        raise ValueError(f"{fn}: sliding_window must be a positive int (tokens) or None, got {sliding_window!r}")
    if q_positions is None or key_positions is None:
        raise ValueError(f"{fn}: sliding_window={sliding_window} needs q_positions and key_positions")
    if (q_positions.dim() != 1 or q_positions.shape[0] < rows or q_positions.dtype not in (torch.int32, torch.int64)
            or (q_positions.shape[0] > 1 and q_positions.stride(0) != 1)):
        raise ValueError(f"{fn}: sliding_window needs q_positions [{rows}] int32/int64 with a unit stride (the "
                         f"kernels read it as contiguous: pass .contiguous()), got {tuple(q_positions.shape)} "
                         f"{q_positions.dtype}, stride {tuple(q_positions.stride())}")
    if (tuple(key_positions.shape) != tuple(k_cache.shape[:2]) or key_positions.dtype != torch.int32
            or key_positions.stride(-1) != 1):
        raise ValueError(f"{fn}: sliding_window needs key_positions [{k_cache.shape[0]}, {k_cache.shape[1]}] int32 "
                         f"with a unit last stride, got {tuple(key_positions.shape)} {key_positions.dtype}")
    if q_positions.device != k_cache.device or key_positions.device != k_cache.device:
        raise ValueError(f"{fn}: sliding_window's q_positions/key_positions are not on {k_cache.device}")
    return sliding_window


def check_softcap(logit_softcap: float | None, fn: str) -> float:
    """The cap to pass to a kernel (0.0: none). Raises ValueError naming ``logit_softcap``
    unless it is None or a positive finite number."""
    if logit_softcap is None:
        return 0.0
    cap = float(logit_softcap)
    if not (0.0 < cap < float("inf")):
        raise ValueError(f"{fn}: logit_softcap must be a positive number or None, got {logit_softcap!r}")
    return cap
