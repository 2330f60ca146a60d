"""One step's forward inputs and the one forward recipe (issue 32: written once, used by the
model runner's eager steps, by CUDA-graph capture and by every tensor-parallel rank).

:class:`StepInputs` is what :meth:`~pasta_engine.worker.model_runner.ModelRunner.prepare`
makes of a scheduled batch: host lists only (picklable: tensor parallelism broadcasts it, and
every rank's runner executes the same inputs). :func:`forward_step` is the recipe's device
half: record the new tokens' logical positions in the KV cache, then forward.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..layers.attention import AttentionBackend, AttentionMetadata
from ..layers.kv_cache import KVCache
from ..layers.utils import to_device
from ..models.protocol import CausalLM

__all__ = ["StepInputs", "forward_step"]


@dataclass
class StepInputs:
    """One step's forward, host-side: ``T`` tokens of ``B`` sequences (one per scheduled thread).

    Attributes:
        meta: the step's :class:`~pasta_engine.layers.attention.AttentionMetadata` (``q_lens``,
            the views as runs, the ``T`` KV slots in ``meta.slots``, the step counter).
        input_ids: the ``T`` token ids; positions: their ``T`` logical positions.
        logits_indices: the token indices whose logits are sampled (each sampling thread's last
            token), ascending."""

    meta: AttentionMetadata
    input_ids: list[int]
    positions: list[int]
    logits_indices: list[int]

    @property
    def all_sample(self) -> bool:
        """Whether every token's logits are sampled (no row to select)."""
        return len(self.logits_indices) == len(self.input_ids)

    def upload(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Token ids, positions and KV slots as three int64 ``[T]`` tensors on ``device``, in one
        host-to-device transfer (rows of one ``[3, T]`` tensor; asynchronous on CUDA)."""
        ids, positions, slots = to_device(self.input_ids + self.positions + self.meta.slots, torch.long,
                                          device).view(3, -1).unbind(0)
        return ids, positions, slots

    def logits_rows(self, device: torch.device) -> torch.Tensor | None:
        """``logits_indices`` as an int64 tensor on ``device``, or None when every token samples."""
        return None if self.all_sample else to_device(self.logits_indices, torch.long, device)


def forward_step(model: CausalLM, kv_cache: KVCache, backend: AttentionBackend, input_ids: torch.Tensor,
                 positions: torch.Tensor, slots: torch.Tensor, logits_indices: torch.Tensor | None) -> torch.Tensor:
    """Record each new token's logical position at its KV slot (``kv_cache.record_positions``,
    read by windowed layers), then run ``model.forward`` over the step.

    Args: ``input_ids``, ``positions``, ``slots``: int64 ``[T]`` on the model's device (slot -1:
    a padding row, written nowhere); ``backend``: planned for this step; ``logits_indices``:
    int64 ``[S]`` rows to compute logits for (None: every row).

    Returns float32 logits ``[S, vocab]`` (``[T, vocab]`` when ``logits_indices`` is None).
    Raises what the model's forward raises."""
    kv_cache.record_positions(slots, positions)
    return model.forward(input_ids, positions, slots, kv_cache, backend, logits_indices)
