"""Checkpoint shapes adapted at the load boundary: a ``transformers`` state dict becomes typed,
fused weights, so the forward never looks a tensor up by name.

The decoder multiplies four matrices per layer: q/k/v fused into one ``qkv`` (rows: the query
heads, then the KV heads of K, then of V), the output projection, gate/up fused into one
``gate_up`` (gate rows first) and the down projection. Checkpoints store q/k/v and gate/up
separately (Llama, Mistral, Qwen, Gemma) or already fused (Phi-3's ``qkv_proj`` and
``gate_up_proj``: the table's ``fused_checkpoint``); :func:`adapt_checkpoint` does the one and
checks the other, and precomputes the norm weights as the forward multiplies them (Gemma's
``1 + w`` in float32). Biases are those the config declares (Qwen2's q/k/v; the loader refuses a
checkpoint whose biases disagree with its config).
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from ..errors import CheckpointError, UnsupportedModelError
from .config import ModelConfig
from .tensors import same_tensor

__all__ = ["LayerWeights", "DecoderWeights", "adapt_checkpoint"]


@dataclass
class LayerWeights:
    """One decoder layer's weights, on the model's device in its dtype (norm weights of a
    ``norm_unit_offset`` model: ``1 + w`` in float32). ``Hq``/``Hkv``: query/KV heads, ``D``:
    head_dim, ``I``: intermediate size; every projection is ``[out, in]``.

    Attributes:
        in_norm: ``[hidden]`` RMSNorm before attention.
        qkv: ``[(Hq + 2 * Hkv) * D, hidden]``; qkv_bias: ``[(Hq + 2 * Hkv) * D]`` or None.
        q_norm, k_norm: ``[D]`` RMSNorm of each query / key head (Qwen3), or None.
        o: ``[hidden, Hq * D]``; o_bias: ``[hidden]`` or None.
        attn_out_norm: ``[hidden]`` RMSNorm of the attention output (Gemma 2), or None.
        mlp_norm: ``[hidden]`` RMSNorm before the MLP.
        mlp_out_norm: ``[hidden]`` RMSNorm of the MLP output (Gemma 2), or None.
        gate_up: ``[2 * I, hidden]`` (gate rows, then up rows); gate_up_bias: ``[2 * I]`` or None.
        down: ``[hidden, I]``; down_bias: ``[hidden]`` or None.
    """

    in_norm: torch.Tensor
    qkv: torch.Tensor
    qkv_bias: torch.Tensor | None
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    o: torch.Tensor
    o_bias: torch.Tensor | None
    attn_out_norm: torch.Tensor | None
    mlp_norm: torch.Tensor
    mlp_out_norm: torch.Tensor | None
    gate_up: torch.Tensor
    gate_up_bias: torch.Tensor | None
    down: torch.Tensor
    down_bias: torch.Tensor | None

    def tensors(self) -> list[torch.Tensor]:
        """Every weight this layer holds (None fields left out)."""
        return [t for t in (getattr(self, f.name) for f in fields(self)) if t is not None]


@dataclass
class DecoderWeights:
    """A whole decoder's weights.

    Attributes:
        embed: ``[vocab_size, hidden]`` token embedding.
        lm_head: ``[vocab_size, hidden]``; the very same tensor as ``embed`` when tied.
        norm: ``[hidden]`` final RMSNorm.
        layers: one :class:`LayerWeights` per layer.
    """

    embed: torch.Tensor
    lm_head: torch.Tensor
    norm: torch.Tensor
    layers: list[LayerWeights]

    def tensors(self) -> list[torch.Tensor]:
        """Every distinct weight (a tied LM head once)."""
        head = [] if self.lm_head is self.embed else [self.lm_head]
        return [self.embed, self.norm, *head] + [t for layer in self.layers for t in layer.tensors()]

    @property
    def nbytes(self) -> int:
        """Bytes of :meth:`tensors`."""
        return sum(t.numel() * t.element_size() for t in self.tensors())


def adapt_checkpoint(state: dict[str, torch.Tensor], config: ModelConfig, device: torch.device | str,
                     dtype: torch.dtype) -> DecoderWeights:
    """Turn a ``transformers`` state dict (``model.layers.{i}.self_attn.q_proj.weight`` ...) into
    :class:`DecoderWeights` on ``device`` in ``dtype``: q/k/v and gate/up fused unless the
    architecture's checkpoint already fuses them (``config.architecture.fused_checkpoint``),
    norm weights precomputed for ``config.norm_unit_offset``, the LM head tied to the embedding
    when the config says so or the checkpoint has none.

    ``state`` is consumed: each tensor is removed once moved, so a checkpoint is never held twice
    (a 7B model in bfloat16 fits a 24 GiB machine).

    Raises UnsupportedModelError naming a tensor the checkpoint lacks, or biases on only some of
    q/k/v (gate/up); CheckpointError naming a tensor whose shape disagrees with the config (an
    adapter's added rows included: ``config.vocab_size`` must count them), or naming
    ``tie_word_embeddings`` and ``lm_head.weight`` when the config ties the head but the
    checkpoint holds its own head unlike the embedding (it would be dropped)."""
    c = config
    ck = _Checkpoint(state, torch.device(device), dtype, c.norm_unit_offset, c.architecture.fused_checkpoint)
    if c.tie_word_embeddings and "lm_head.weight" in state and not same_tensor(state["lm_head.weight"],
                                                                               state.get("model.embed_tokens.weight")):
        raise CheckpointError("model", None, message="the config sets tie_word_embeddings=true but the checkpoint "
                              "holds its own lm_head.weight, unlike model.embed_tokens.weight: it would be dropped "
                              "(set tie_word_embeddings to false in config.json if the model has its own head)")
    tied = c.tie_word_embeddings or "lm_head.weight" not in state
    embed = ck.take("model.embed_tokens.weight")
    lm_head = embed if tied else ck.take("lm_head.weight")
    state.pop("lm_head.weight", None)
    _check("model.embed_tokens.weight", embed, c.vocab_size, c.hidden_size)
    _check("lm_head.weight", lm_head, c.vocab_size, c.hidden_size)
    layers = [_adapt_layer(ck, c, i) for i in range(c.num_layers)]
    return DecoderWeights(embed=embed, lm_head=lm_head, norm=ck.norm("model.norm.weight"), layers=layers)


class _Checkpoint:
    """Takes tensors out of a state dict by name, onto the device in the dtype."""

    def __init__(self, state: dict[str, torch.Tensor], device: torch.device, dtype: torch.dtype,
                 unit_offset: bool, fused: bool):
        self.state, self.device, self.dtype = state, device, dtype
        self.unit_offset, self.fused = unit_offset, fused

    def take(self, name: str) -> torch.Tensor:
        """Tensor ``name``, removed from the state; UnsupportedModelError when it is missing."""
        if name not in self.state:
            raise UnsupportedModelError(f"checkpoint has no tensor {name!r}")
        return self.state.pop(name).to(device=self.device, dtype=self.dtype)

    def norm(self, name: str) -> torch.Tensor:
        """An RMSNorm weight as the forward multiplies it (Gemma: ``1 + w`` in float32)."""
        return 1.0 + self.take(name).float() if self.unit_offset else self.take(name)

    def joined(self, names: list[str], fused_name: str) -> torch.Tensor:
        """``names`` concatenated along the output rows, or ``fused_name`` for a fused checkpoint."""
        return self.take(fused_name) if self.fused else torch.cat([self.take(n) for n in names])

    def bias(self, names: list[str]) -> torch.Tensor | None:
        """The biases ``names`` concatenated, None when the checkpoint has none of them;
        UnsupportedModelError when it has only some."""
        have = [n for n in names if n in self.state]
        if not have:
            return None
        if len(have) != len(names):
            raise UnsupportedModelError(f"checkpoint has biases {have} but not {sorted(set(names) - set(have))}")
        return torch.cat([self.take(n) for n in names])


def _check(name: str, t: torch.Tensor | None, *shape: int) -> None:
    """CheckpointError naming ``name`` when ``t`` is not ``shape``."""
    if t is not None and tuple(t.shape) != shape:
        raise CheckpointError("model", None, message=f"{name} is {tuple(t.shape)} but the config makes it {shape}")


def _adapt_layer(ck: _Checkpoint, c: ModelConfig, i: int) -> LayerWeights:
    """Layer ``i``'s :class:`LayerWeights`, its projection shapes checked against ``c``."""
    p = f"model.layers.{i}."
    a, m = p + "self_attn.", p + "mlp."
    qkv = [a + "q_proj", a + "k_proj", a + "v_proj"]
    layer = LayerWeights(
        in_norm=ck.norm(p + "input_layernorm.weight"),
        qkv=ck.joined([n + ".weight" for n in qkv], a + "qkv_proj.weight"),
        qkv_bias=ck.bias([n + ".bias" for n in qkv]),
        q_norm=ck.norm(a + "q_norm.weight") if c.qk_norm else None,
        k_norm=ck.norm(a + "k_norm.weight") if c.qk_norm else None,
        o=ck.take(a + "o_proj.weight"),
        o_bias=ck.bias([a + "o_proj.bias"]),
        # Gemma 2 names the norm of the attention output post_attention_layernorm and the MLP's
        # input norm pre_feedforward_layernorm; Llama's post_attention_layernorm is the MLP's input norm
        attn_out_norm=ck.norm(p + "post_attention_layernorm.weight") if c.sandwich_norms else None,
        mlp_norm=ck.norm(p + ("pre_feedforward_layernorm.weight" if c.sandwich_norms
                              else "post_attention_layernorm.weight")),
        mlp_out_norm=ck.norm(p + "post_feedforward_layernorm.weight") if c.sandwich_norms else None,
        gate_up=ck.joined([m + "gate_proj.weight", m + "up_proj.weight"], m + "gate_up_proj.weight"),
        gate_up_bias=ck.bias([m + "gate_proj.bias", m + "up_proj.bias"]),
        down=ck.take(m + "down_proj.weight"),
        down_bias=ck.bias([m + "down_proj.bias"]),
    )
    hidden, d, inter = c.hidden_size, c.head_dim, c.intermediate_size
    qkv_rows = (c.num_heads + 2 * c.num_kv_heads) * d
    _check(a + "qkv", layer.qkv, qkv_rows, hidden)
    _check(a + "qkv bias", layer.qkv_bias, qkv_rows)
    _check(a + "o_proj.weight", layer.o, hidden, c.num_heads * d)
    _check(m + "gate_up", layer.gate_up, 2 * inter, hidden)
    _check(m + "down_proj.weight", layer.down, hidden, inter)
    return layer
