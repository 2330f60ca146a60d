"""The shape of a checkpoint, read from its ``transformers`` config (no weights)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..errors import UnsupportedModelError

__all__ = ["ModelConfig", "SUPPORTED_ARCHITECTURES"]

SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2")


@dataclass(frozen=True)
class ModelConfig:
    """The shape of a Llama-family model (all sizes in elements; ``max_position_embeddings``,
    the context length in tokens, None when the checkpoint does not say)."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    tie_word_embeddings: bool
    attention_bias: bool
    max_position_embeddings: int | None = None

    @classmethod
    def from_hf(cls, cfg: Any) -> "ModelConfig":
        """From a ``transformers`` config. Raises UnsupportedModelError naming the
        architecture or option that is not implemented."""
        mt = getattr(cfg, "model_type", None)
        if mt not in SUPPORTED_ARCHITECTURES:
            raise UnsupportedModelError(
                f"unsupported architecture {mt!r}: pasta-engine runs {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        sw = getattr(cfg, "sliding_window", None)
        active = mt != "qwen2" or getattr(cfg, "use_sliding_window", False)
        if sw is not None and active and sw < getattr(cfg, "max_position_embeddings", sw + 1):
            raise UnsupportedModelError(f"{mt} with an active sliding window ({sw} tokens) is not supported")
        if getattr(cfg, "hidden_act", "silu") != "silu":
            raise UnsupportedModelError(f"activation {cfg.hidden_act!r} is not supported (silu only)")
        heads = cfg.num_attention_heads
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
        kv = getattr(cfg, "num_key_value_heads", None) or heads
        if heads % kv:
            raise UnsupportedModelError(f"{heads} query heads are not a multiple of {kv} KV heads")
        return cls(
            model_type=mt,
            vocab_size=cfg.vocab_size,
            hidden_size=cfg.hidden_size,
            intermediate_size=cfg.intermediate_size,
            num_layers=cfg.num_hidden_layers,
            num_heads=heads,
            num_kv_heads=kv,
            head_dim=head_dim,
            rms_norm_eps=cfg.rms_norm_eps,
            tie_word_embeddings=bool(getattr(cfg, "tie_word_embeddings", False)),
            attention_bias=mt == "qwen2" or bool(getattr(cfg, "attention_bias", False)),
            max_position_embeddings=getattr(cfg, "max_position_embeddings", None),
        )

    @property
    def group_size(self) -> int:
        """Query heads per KV head (the GQA group)."""
        return self.num_heads // self.num_kv_heads
