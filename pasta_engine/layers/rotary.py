"""Rotary position embedding (RoPE) at explicit logical positions.

PASTA positions are logical and decoupled from KV storage (docs/DESIGN.md section 2): a forked
thread's tokens take positions right after its promise while the main thread skips a reserved
range, so every token carries its own position id and RoPE is applied with it when its key is
written to the cache (a key is never re-rotated).
"""

from __future__ import annotations

from typing import Any

import torch

from ..errors import UnsupportedModelError

__all__ = ["apply_rope", "rope_inv_freq", "rope_long_inv_freq", "rotary_embedding", "RotaryEmbedding"]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` ``[T, H, D]`` by RoPE with ``cos``/``sin`` ``[T, D]`` (the "rotate half"
    convention of HF Llama; Su et al. 2021, RoFormer, section 3.4.2). Returns ``[T, H, D]``."""
    d = x.shape[-1] // 2
    rot = torch.cat((x.narrow(-1, d, d).neg(), x.narrow(-1, 0, d)), dim=-1)
    return x * cos.unsqueeze(1) + rot * sin.unsqueeze(1)


def rope_inv_freq(hf_config: Any, head_dim: int) -> tuple[torch.Tensor, float]:
    """Inverse frequencies ``[head_dim/2]`` float32 and the cos/sin scaling (attention factor)
    of a checkpoint's RoPE (default, linear, llama3, yarn, ...), computed by ``transformers``'
    own RoPE helpers so they match its forward exactly. For LongRoPE these are the short
    factors (:func:`rope_long_inv_freq` gives the long ones).

    Raises UnsupportedModelError for a RoPE type that depends on the sequence length
    (``dynamic``) or that transformers does not know."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = getattr(hf_config, "rope_parameters", None) or {}
    if not params:  # transformers < 5 keeps rope_theta / rope_scaling as attributes
        scaling = getattr(hf_config, "rope_scaling", None) or {}
        params = {"rope_type": scaling.get("rope_type", scaling.get("type", "default")),
                  "rope_theta": getattr(hf_config, "rope_theta", 10000.0)}
    rope_type = params.get("rope_type", "default")
    if rope_type == "default":
        base = params.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
        inv = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
        return inv, 1.0
    if rope_type not in ROPE_INIT_FUNCTIONS or rope_type == "dynamic":
        raise UnsupportedModelError(f"RoPE type {rope_type!r} is not supported")
    inv, scale = ROPE_INIT_FUNCTIONS[rope_type](hf_config, torch.device("cpu"))
    return inv.float(), float(scale)


def rope_long_inv_freq(hf_config: Any, head_dim: int) -> tuple[torch.Tensor, int] | None:
    """LongRoPE (Phi-3): the long-context inverse frequencies ``[head_dim/2]`` float32 and the
    position from which they apply (``original_max_position_embeddings``), or None for any
    other RoPE type.

    ``transformers`` picks the short or the long factors for a whole forward by its largest
    position; with a KV cache that is a per-token choice (a decode step past the original
    context uses the long factors, keys already cached keep theirs), which is what the engine
    does for every token (as vLLM does). The two agree exactly while a prompt fits the original
    context."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = getattr(hf_config, "rope_parameters", None) or {}
    if params.get("rope_type") != "longrope":
        return None
    original = params.get("original_max_position_embeddings") or getattr(hf_config, "original_max_position_embeddings")
    inv, _ = ROPE_INIT_FUNCTIONS["longrope"](hf_config, torch.device("cpu"), seq_len=int(original) + 1)
    return inv.float(), int(original)


def rotary_embedding(hf_config: Any, head_dim: int, device: torch.device | str, dtype: torch.dtype
                     ) -> "RotaryEmbedding":
    """The :class:`RotaryEmbedding` of a checkpoint (:func:`rope_inv_freq`, plus the long
    factors of :func:`rope_long_inv_freq`). Raises what :func:`rope_inv_freq` raises."""
    inv, scale = rope_inv_freq(hf_config, head_dim)
    long = rope_long_inv_freq(hf_config, head_dim)
    return RotaryEmbedding(inv, scale, torch.device(device), dtype, *(long or (None, None)))


class RotaryEmbedding:
    """cos/sin tables for logical positions.

    Args:
        inv_freq: ``[head_dim/2]`` inverse frequencies; scale: cos/sin multiplier.
        device, dtype: where the tables live and their dtype (the model's).
        long_inv_freq, long_from: LongRoPE's second set of inverse frequencies ``[head_dim/2]``
            and the first position (tokens) that uses them, or None (one set for all positions)."""

    def __init__(self, inv_freq: torch.Tensor, scale: float, device: torch.device, dtype: torch.dtype,
                 long_inv_freq: torch.Tensor | None = None, long_from: int | None = None):
        self.inv_freq = inv_freq.to(device=device, dtype=torch.float32)
        self.scale = scale
        self.dtype = dtype
        self.long_inv_freq = None if long_inv_freq is None else long_inv_freq.to(device=device, dtype=torch.float32)
        self.long_from = long_from
        self._table: torch.Tensor | None = None  # CPU: [positions, 2, head_dim] cos/sin rows

    def __call__(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin ``[T, head_dim]`` (model dtype) for int64 ``positions`` ``[T]`` (computed in
        float32 as HF does).

        On a CPU they are rows of a table of every position below a power of two above the
        largest seen so far (at least 4,096 positions; ``8 * head_dim`` bytes per position in
        float32): one ``index_select`` per step instead of seven small ops. Each row is
        computed by the same elementwise ops as the direct way (:meth:`compute`), so the values
        are bitwise equal (tests/layers/test_forward_fast_paths.py); the two returned views
        share one ``[T, 2, head_dim]`` tensor. On other devices (where a table bound would need
        a device sync) they are computed directly."""
        if positions.device.type != "cpu" or positions.shape[0] == 0:
            return self.compute(positions)
        rows = None
        if self._table is not None:
            try:
                rows = self._table.index_select(0, positions)
            except IndexError:  # a position past the table (no bound check on the common path)
                pass
        if rows is None:
            if int(positions.min()) < 0:  # no row for it in the table
                return self.compute(positions)
            hi = int(positions.max())
            n = max(4096, 1 << (hi + 1).bit_length())  # a power of two above hi
            cos, sin = self.compute(torch.arange(n, device=positions.device))
            self._table = torch.stack((cos, sin), dim=1)  # [n, 2, head_dim]
            rows = self._table.index_select(0, positions)
        return rows[:, 0], rows[:, 1]

    def compute(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin ``[T, head_dim]`` (model dtype) for int64 ``positions`` ``[T]``, computed
        directly (float32 frequencies, LongRoPE's long factors from ``long_from`` on)."""
        pos = positions.float()[:, None]
        freqs = pos * self.inv_freq[None, :]
        if self.long_inv_freq is not None:
            freqs = torch.where((positions >= self.long_from)[:, None], pos * self.long_inv_freq[None, :], freqs)
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * self.scale).to(self.dtype), (emb.sin() * self.scale).to(self.dtype)
