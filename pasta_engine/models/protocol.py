"""The model seam: what the model runner and the CUDA-graph runner need of a model.

:class:`CausalLM` is the whole contract between the engine and a decoder: its config (the
shapes the KV cache is allocated with), where it runs, its weights' size, the projection
weights the CPU GEMM chooser warms up, and one :meth:`CausalLM.forward` over a mixed batch of
new tokens against the paged KV cache. The engine imports models only through this module and
:func:`pasta_engine.models.loader.load_model` (an import-linter contract holds it), so a new
decoder module plugs in without touching the engine. Every supported architecture is served by
:class:`~pasta_engine.models.llama.LlamaModel`; :data:`~pasta_engine.models.config.ARCHITECTURES`
names the decoder of each.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch

from ..layers.attention import AttentionBackend
from ..layers.kv_cache import KVCache
from .config import ModelConfig

__all__ = ["CausalLM"]


@runtime_checkable
class CausalLM(Protocol):
    """A decoder-only language model over a paged KV cache.

    Attributes:
        config: the checkpoint's :class:`~pasta_engine.models.config.ModelConfig` (layers, KV
            heads, head_dim and sliding windows size the KV cache; ``vocab_size`` is the LM
            head's row count, the adapter's added tokens included).
        device: where the weights live; dtype: their floating-point type (the KV cache's too).
    """

    config: ModelConfig
    device: torch.device
    dtype: torch.dtype

    @property
    def weight_bytes(self) -> int:
        """Bytes of all weights one forward reads (a tied LM head counted once)."""
        ...

    def projection_weights(self) -> list[torch.Tensor]:
        """The ``[out, in]`` matrices the forward multiplies by (the CPU GEMM chooser
        :func:`pasta_engine.layers.linear.prepare` warms up each shape)."""
        ...

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor,
                kv_cache: KVCache, backend: AttentionBackend, logits_indices: torch.Tensor | None) -> torch.Tensor:
        """Run the model over a mixed batch (prefill chunks, inserted tags, decode tokens).

        Args:
            input_ids: ``[T]`` int64, every sequence's new tokens concatenated.
            positions: ``[T]`` int64 logical position of every token (RoPE, sliding windows).
            slot_mapping: ``[T]`` int64 KV slot of every token (negative: write nothing).
            kv_cache: the :class:`~pasta_engine.layers.kv_cache.KVCache`; the new tokens' K/V
                are written into it. Their positions are already in ``kv_cache.key_positions``
                (the caller records them first: :meth:`KVCache.record_positions`).
            backend: the attention backend, already planned for this step.
            logits_indices: ``[S]`` int64 rows of ``T`` whose next-token logits are wanted, or
                None for every row (``S = T``).

        Returns float32 logits ``[S, config.vocab_size]``. Must not sync with the host (it is
        captured in CUDA graphs)."""
        ...
