"""Linear layers for small decode batches on a CPU.

A decode step multiplies a few rows (one per running thread) by each weight matrix, so on a CPU
its cost is reading the weights once, whatever the row count. ``F.linear`` computes
``x @ W^T`` as a GEMM with the activations as the small left operand; some BLAS builds run
that shape far below the memory bound for 2 to ~6 rows, and run one row (GEMV) slower than two.
Measured with torch 2.13 (MKL) on the 2-core AMD EPYC this project develops on, one thread,
SmolLM2-135M's gate/up weight ``[3072, 576]``: 651 us for one row, 1,131 us for two, 1,367 us
for three, where ``(W @ x^T)^T`` takes 448 us (two rows; one row padded to two), 429 us and
627 us. Left as is, every thread added to a step would cost PASTA more than decoding it
serially, which is the opposite of what the hardware does.

:func:`linear` therefore picks, once per process for each (weight shape, dtype, row count),
the faster of the two orientations by timing both on copies of the real weight read from
memory (the way cuBLAS and Triton pick GEMM kernels by shape), and keeps ``F.linear`` unless the other is clearly faster
(:data:`MIN_GAIN`). Only CPU float tensors with at most :data:`MAX_ROWS` rows and weights of at
least :data:`MIN_WEIGHT_ELEMENTS` elements take part: small weights (the tests' tiny models, the
host-overhead benchmark) always run ``F.linear``, so their results stay bitwise those of
``F.linear``. The two orientations sum in different orders, so their outputs differ by float
rounding (about 1e-6 relative); within one process a shape's choice never changes.
"""

from __future__ import annotations

import time
from typing import Callable

import torch
import torch.nn.functional as F

__all__ = ["linear", "linear_for", "prepare", "MAX_ROWS", "MIN_WEIGHT_ELEMENTS", "MIN_GAIN", "COLD_BYTES", "gemm_choices"]

#: row counts above this always run ``F.linear`` (the GEMM is then efficient either way)
MAX_ROWS = 8
#: weights smaller than this (elements) always run ``F.linear`` (dispatch costs dominate)
MIN_WEIGHT_ELEMENTS = 1 << 18
#: the transposed product is used only when it is at least this many times faster
MIN_GAIN = 1.15
#: bytes of weight copies each timing pass reads (more than a server CPU's last-level cache)
COLD_BYTES = 64 << 20

# (weight shape, dtype, rows) -> True: transposed product; False: F.linear
_choices: dict[tuple[tuple[int, int], torch.dtype, int], bool] = {}


def gemm_choices() -> dict[str, str]:
    """The choices made so far in this process, for benchmark records:
    ``"OUTxIN dtype rows" -> "W@x^T" | "F.linear"``."""
    return {f"{s[0]}x{s[1]} {str(d).removeprefix('torch.')} {r}": ("W@x^T" if c else "F.linear")
            for (s, d, r), c in sorted(_choices.items(), key=lambda kv: (kv[0][0], kv[0][2]))}


def _transposed(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x @ weight^T`` as ``(weight @ x^T)^T`` (one row is padded to two: the GEMV the BLAS
    would otherwise run is the slow case), contiguous ``[R, out]``."""
    rows = x.shape[0]
    xin = x if rows > 1 else x.repeat(2, 1)
    return torch.mm(weight, xin.t()).t()[:rows].contiguous()


def _best_of(fn, weights: list[torch.Tensor], x: torch.Tensor, repeats: int = 3) -> float:
    """Fastest of ``repeats`` passes of ``fn(x, w)`` over every tensor of ``weights``."""
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        for w in weights:
            fn(x, w)
        best = min(best, time.perf_counter() - t)
    return best


def _choose(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Time both orientations on copies of ``weight`` that together pass :data:`COLD_BYTES`,
    so each product reads its weight from memory as a forward does (a forward touches every
    layer's weights once; timing one weight again and again would time the cache instead, where
    ``F.linear`` is as fast)."""
    nbytes = weight.numel() * weight.element_size()
    weights = [weight] + [weight.clone() for _ in range(max(0, -(-COLD_BYTES // nbytes) - 1))]
    _transposed(x, weight)  # first touches (allocations, BLAS dispatch) outside the timing
    F.linear(x, weight)
    t_linear = _best_of(F.linear, weights, x)
    t_transposed = _best_of(_transposed, weights, x)
    return t_transposed * MIN_GAIN < t_linear


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for ``x`` ``[R, in]`` and ``weight`` ``[out, in]`` (same
    float dtype), returning ``[R, out]``; on a CPU with ``R <= MAX_ROWS`` and a large weight it
    may compute ``(weight @ x^T)^T`` instead, whichever was faster for this shape (see the
    module docstring). Any other input (CUDA, more rows, other ranks) goes to ``F.linear``,
    which raises as usual for mismatched shapes or dtypes. The first call for a new (shape,
    dtype, rows) times both orientations (tens of milliseconds for a large weight; see
    :func:`prepare` to do it ahead)."""
    rows = x.shape[0] if x.dim() == 2 else 0
    if (x.device.type != "cpu" or not 0 < rows <= MAX_ROWS or weight.numel() < MIN_WEIGHT_ELEMENTS
            or not x.dtype.is_floating_point or x.dtype != weight.dtype):
        return F.linear(x, weight, bias)
    key = (tuple(weight.shape), weight.dtype, rows)
    use = _choices.get(key)
    if use is None:
        use = _choices[key] = _choose(x, weight)
    if not use:
        return F.linear(x, weight, bias)
    y = _transposed(x, weight)
    return y if bias is None else y + bias


def linear_for(weights, device: torch.device) -> Callable[..., torch.Tensor]:
    """The linear function a model with these projection ``weights`` (2-D ``[out, in]``) on
    ``device`` should call: :func:`linear` when one of them can take part in the choice (a CPU
    and a weight of at least :data:`MIN_WEIGHT_ELEMENTS` elements), else ``F.linear`` itself,
    so small models do not even pay :func:`linear`'s checks (about 1 us a call)."""
    if torch.device(device).type == "cpu" and any(w.numel() >= MIN_WEIGHT_ELEMENTS for w in weights):
        return linear
    return F.linear


def prepare(weights, max_rows: int = MAX_ROWS) -> int:
    """Make the choice of :func:`linear` now for every distinct (shape, dtype) among
    ``weights`` (2-D CPU float tensors) and every row count ``1..max_rows``, so that no timed
    step pays for it (a benchmark's warm-up; about 2 s for SmolLM2-135M on one CPU thread).
    Returns the number of choices made."""
    made = 0
    seen: set[tuple[tuple[int, ...], torch.dtype]] = set()
    for w in weights:
        key = (tuple(w.shape), w.dtype)
        if (w.dim() != 2 or key in seen or w.device.type != "cpu" or not w.dtype.is_floating_point
                or w.numel() < MIN_WEIGHT_ELEMENTS):
            continue
        seen.add(key)
        for rows in range(1, min(max_rows, MAX_ROWS) + 1):
            if (key[0], key[1], rows) not in _choices:
                linear(torch.zeros(rows, w.shape[1], dtype=w.dtype), w)
                made += 1
    return made
