"""Tensor-parallel shards of a checkpoint, cut at the load boundary (Megatron-style).

Each rank of ``tensor_parallel_size`` ranks holds: the columns of the column-parallel projections
(rows of their ``[out, in]`` weights: q/k/v by whole KV heads with the query heads of their GQA
groups, gate/up), the matching rows of the row-parallel ones (columns of o and down, whose
partial outputs the ranks sum with one all-reduce each), and a replicated copy of everything
else (embedding, LM head, norms). :func:`shard_config` is the per-rank shape the decoder, the
attention backend and the KV cache shard are sized by; :func:`shard_spec` says which slice of a
checkpoint tensor a rank reads (the loader reads only that slice from a safetensors file).
The names are ``transformers``' (before :func:`~pasta_engine.models.weights.adapt_checkpoint`
fuses them), so this module knows no weight type.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from ..errors import ParameterError
from .config import ModelConfig

__all__ = ["ShardSpec", "shard_config", "shard_spec", "shard_tensor", "shard_checkpoint"]


#: How a checkpoint tensor is split across tensor-parallel ranks: ``(dim, ranges)`` (the rank's
#: slice is the concatenation of ``ranges`` along ``dim``); ``"zero"`` (rank 0 keeps it, the
#: others hold zeros: a row-parallel bias, added once by the all-reduce); None (replicated).
ShardSpec = tuple[int, list[tuple[int, int]]] | str | None


def shard_config(config: ModelConfig, size: int) -> ModelConfig:
    """The per-rank :class:`ModelConfig` of Megatron-style tensor parallelism over ``size``
    ranks: ``num_heads``, ``num_kv_heads`` and ``intermediate_size`` divided by ``size``
    (``head_dim`` and the softmax scale kept), so a rank's decoder, attention backend and KV
    cache shard are sized by it as a whole model would be. ``size == 1``: ``config`` itself.

    Raises ParameterError naming ``tensor_parallel_size`` and the head counts when ``size`` does
    not divide the KV heads (GQA groups stay whole on one rank) or the intermediate size."""
    if size == 1:
        return config
    nq, nkv, inter = config.num_heads, config.num_kv_heads, config.intermediate_size
    if nkv % size or nq % size:
        raise ParameterError("tensor_parallel_size", size, message=(
            f"tensor_parallel_size={size} does not divide the model's {nkv} KV heads ({nq} query heads, "
            f"GQA groups of {config.group_size}): each rank must hold whole KV heads with their query heads; "
            f"use a size that divides {nkv}"))
    if inter % size:
        raise ParameterError("tensor_parallel_size", size, message=(
            f"tensor_parallel_size={size} does not divide the model's intermediate_size={inter}"))
    return replace(config, num_heads=nq // size, num_kv_heads=nkv // size, intermediate_size=inter // size)


def shard_spec(name: str, config: ModelConfig, rank: int, size: int) -> ShardSpec:
    """Which part of checkpoint tensor ``name`` (a ``transformers`` name) rank ``rank`` of
    ``size`` holds (:data:`ShardSpec`; ``config`` is the whole model's). Column-parallel (rows of
    ``[out, in]`` split): q/k/v (query heads and their KV heads: rank ``r`` holds KV heads
    ``r * Hkv/size ..`` and the query heads of their GQA groups) and gate/up, fused checkpoints
    (``qkv_proj``, ``gate_up_proj``) split part by part; row-parallel (columns split): o and
    down, their biases on rank 0 only. Everything else (embedding, LM head, norms) is replicated."""
    if size == 1:
        return None
    d, nq, nkv, inter = config.head_dim, config.num_heads, config.num_kv_heads, config.intermediate_size
    q_l, kv_l, i_l = nq // size * d, nkv // size * d, inter // size

    def part(start: int, n: int) -> tuple[int, int]:
        return start + rank * n, start + (rank + 1) * n

    leaf = name.rsplit(".", 2)
    if len(leaf) < 3:
        return None
    module, kind = leaf[1], leaf[2]
    if module == "q_proj":
        return 0, [part(0, q_l)]
    if module in ("k_proj", "v_proj"):
        return 0, [part(0, kv_l)]
    if module == "qkv_proj":
        return 0, [part(0, q_l), part(nq * d, kv_l), part(nq * d + nkv * d, kv_l)]
    if module in ("gate_proj", "up_proj"):
        return 0, [part(0, i_l)]
    if module == "gate_up_proj":
        return 0, [part(0, i_l), part(inter, i_l)]
    if module in ("o_proj", "down_proj"):
        if kind == "bias":
            return None if rank == 0 else "zero"
        return 1, [part(0, q_l if module == "o_proj" else i_l)]
    return None


def shard_tensor(t: torch.Tensor, spec: ShardSpec) -> torch.Tensor:
    """``t``'s slice under ``spec`` (:func:`shard_spec`): a new contiguous tensor (a replicated
    one is ``t`` itself)."""
    if spec is None:
        return t
    if spec == "zero":
        return torch.zeros_like(t)
    dim, ranges = spec
    return torch.cat([t.narrow(dim, a, b - a) for a, b in ranges], dim=dim).contiguous()


def shard_checkpoint(state: dict[str, torch.Tensor], config: ModelConfig, rank: int,
                     size: int) -> dict[str, torch.Tensor]:
    """Rank ``rank``'s part of a whole ``transformers`` state dict, in place (each split tensor
    replaced by its slice, so the whole one can be freed);
    :func:`~pasta_engine.models.weights.adapt_checkpoint` then adapts
    it against :func:`shard_config`'s config. Returns ``state``."""
    for name in list(state):
        spec = shard_spec(name, config, rank, size)
        if spec is not None:
            state[name] = shard_tensor(state[name], spec)
    return state
