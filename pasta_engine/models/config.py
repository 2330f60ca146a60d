"""The shape of a checkpoint and its architecture's options, read from its ``transformers``
config (no weights).

Every architecture trait lives in one table, :data:`ARCHITECTURES` (gpt-fast's
``transformer_configs``): ``model_type`` -> an :class:`Architecture` saying which decoder module
runs it, how its checkpoint is laid out and which options it has. :meth:`ModelConfig.from_hf`
reads the table once at load and the per-checkpoint numbers (sizes, windows, soft-caps, scale)
from the config, refusing any option the forward does not implement with an
:class:`~pasta_engine.errors.UnsupportedModelError` that names it. Nothing else in the package
branches on ``model_type``.

Adding an architecture whose math is Llama's with known options is one entry here; one whose
math differs is an entry naming a new decoder module (``decoder="mymodel:MyModel"``, a class
with :class:`~pasta_engine.models.protocol.CausalLM`'s methods); see docs/DESIGN.md, "Adding an
architecture".
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal

from ..errors import CheckpointError, UnsupportedModelError

__all__ = ["ModelConfig", "Architecture", "check_sizes", "SUPPORTED_ARCHITECTURES", "ARCHITECTURES", "ACTIVATIONS"]


@dataclass(frozen=True)
class Architecture:
    """The fixed traits of one architecture (one ``model_type``): an entry of :data:`ARCHITECTURES`.

    Attributes:
        decoder: the forward that runs it, ``"module:Class"`` under :mod:`pasta_engine.models`
            (a :class:`~pasta_engine.models.protocol.CausalLM`); every supported one runs
            :class:`~pasta_engine.models.llama.LlamaModel`.
        windows: which layers honour ``config.sliding_window``: ``"none"`` (the architecture
            has no window), ``"all"`` (every layer: Mistral, Phi-3) or ``"layer_types"`` (the
            layers ``config.layer_types`` marks ``"sliding_attention"``: Qwen2/3 above
            ``max_window_layers``, Gemma 2's alternate layers).
        fused_checkpoint: the checkpoint stores q/k/v as one ``qkv_proj`` and gate/up as one
            ``gate_up_proj`` (Phi-3); otherwise they are separate and fused at load
            (:func:`pasta_engine.models.weights.adapt_checkpoint`).
        attention_bias: q/k/v projections always have biases (Qwen2), whatever the config says.
        qk_norm: RMSNorm over ``head_dim`` on every query and key head before RoPE (Qwen3).
        norm_unit_offset: RMSNorm scales by ``1 + w`` in float32 (Gemma).
        scale_embeddings: embeddings are multiplied by ``sqrt(hidden_size)`` (Gemma).
        sandwich_norms: RMSNorm also on the attention and MLP outputs (Gemma 2).
        activation_field: the config field naming the MLP gate activation (Gemma 2:
            ``hidden_activation``).
        attention_scale_field: the config field ``f`` whose ``f ** -0.5`` is the softmax scale
            (Gemma 2: ``query_pre_attn_scalar``), or None for ``head_dim ** -0.5``.
        softcaps: reads ``attn_logit_softcapping`` and ``final_logit_softcapping`` (Gemma 2).
    """

    decoder: str = "llama:LlamaModel"
    windows: Literal["none", "all", "layer_types"] = "none"
    fused_checkpoint: bool = False
    attention_bias: bool = False
    qk_norm: bool = False
    norm_unit_offset: bool = False
    scale_embeddings: bool = False
    sandwich_norms: bool = False
    activation_field: str = "hidden_act"
    attention_scale_field: str | None = None
    softcaps: bool = False


#: ``model_type`` -> its :class:`Architecture`: every architecture trait, in one place.
ARCHITECTURES: dict[str, Architecture] = {
    "llama": Architecture(),
    "mistral": Architecture(windows="all"),
    "qwen2": Architecture(windows="layer_types", attention_bias=True),
    "qwen3": Architecture(windows="layer_types", qk_norm=True),
    "gemma": Architecture(norm_unit_offset=True, scale_embeddings=True),
    "gemma2": Architecture(windows="layer_types", norm_unit_offset=True, scale_embeddings=True, sandwich_norms=True,
                           activation_field="hidden_activation", attention_scale_field="query_pre_attn_scalar",
                           softcaps=True),
    "phi3": Architecture(windows="all", fused_checkpoint=True),
}
SUPPORTED_ARCHITECTURES = tuple(ARCHITECTURES)
#: MLP gate activations (``transformers`` names): SwiGLU's and GeGLU's with tanh-approximated GELU.
ACTIVATIONS = ("silu", "gelu_pytorch_tanh")


@dataclass(frozen=True)
class ModelConfig:
    """The shape and options of a Llama-family decoder. Sizes are in elements,
    ``max_position_embeddings`` (the context length) and windows in tokens.

    Attributes:
        model_type: the ``transformers`` architecture name (a key of :data:`ARCHITECTURES`).
        attention_bias: q/k/v projections have biases (Qwen2, or a config's ``attention_bias``);
            the loader refuses a checkpoint whose biases disagree with the config (missing, or
            present where the config uses none), so those it applies are the config's.
        max_position_embeddings: the context length, None when the checkpoint does not say.
        hidden_act: MLP gate activation, one of :data:`ACTIVATIONS`.
        norm_unit_offset: RMSNorm scales by ``1 + w`` in float32 and then casts (Gemma), instead
            of casting first and scaling by ``w`` in the model dtype (Llama).
        scale_embeddings: embeddings are multiplied by ``sqrt(hidden_size)`` rounded to the
            model dtype (Gemma).
        sandwich_norms: RMSNorm also on the attention and MLP outputs before each residual add
            (Gemma 2: ``post_attention_layernorm``, ``pre_feedforward_layernorm``,
            ``post_feedforward_layernorm``).
        qk_norm: RMSNorm over ``head_dim`` on every query and key head before RoPE (Qwen3).
        attention_scale: softmax scale of the attention scores (``head_dim ** -0.5``, also when
            given as 0; Gemma 2: ``query_pre_attn_scalar ** -0.5``).
        attn_logit_softcap: scores become ``cap * tanh(scores / cap)`` before the softmax
            (Gemma 2), or None.
        final_logit_softcap: logits become ``cap * tanh(logits / cap)`` (Gemma 2), or None.
        sliding_windows: per layer, the window in tokens of logical position (a query at
            position ``p`` sees keys at positions ``> p - window``), or None for full attention.
            A window at least the context length never bites and is stored as None; an empty
            tuple means no window on any layer.
    """

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
    hidden_act: str = "silu"
    norm_unit_offset: bool = False
    scale_embeddings: bool = False
    sandwich_norms: bool = False
    qk_norm: bool = False
    attention_scale: float = 0.0
    attn_logit_softcap: float | None = None
    final_logit_softcap: float | None = None
    sliding_windows: tuple[int | None, ...] = ()

    def __post_init__(self) -> None:
        if not self.attention_scale:
            object.__setattr__(self, "attention_scale", self.head_dim**-0.5)
        if not self.sliding_windows:
            object.__setattr__(self, "sliding_windows", (None,) * self.num_layers)
        if len(self.sliding_windows) != self.num_layers:
            raise ValueError(f"sliding_windows has {len(self.sliding_windows)} entries for {self.num_layers} layers")

    @classmethod
    def from_hf(cls, cfg: Any) -> "ModelConfig":
        """From a ``transformers`` config. Raises UnsupportedModelError naming the
        architecture or option that is not implemented, CheckpointError naming a size that is
        not an integer >= 1 (``num_attention_heads: 0``) or an attention scale field or soft-cap
        that is not a finite number > 0 (Gemma 2's ``query_pre_attn_scalar``, its soft-caps)."""
        mt = getattr(cfg, "model_type", None)
        if mt not in ARCHITECTURES:
            raise UnsupportedModelError(
                f"unsupported architecture {mt!r}: pasta-engine runs {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        arch = ARCHITECTURES[mt]
        act = getattr(cfg, arch.activation_field, None) or "silu"
        if act not in ACTIVATIONS:
            raise UnsupportedModelError(f"{mt} with {arch.activation_field}={act!r} is not supported "
                                        f"(one of {', '.join(ACTIVATIONS)})")
        if getattr(cfg, "use_bidirectional_attention", None):
            raise UnsupportedModelError(f"{mt} with use_bidirectional_attention=True is not supported (causal only)")
        rope = getattr(cfg, "rope_parameters", None) or {}
        partial = rope.get("partial_rotary_factor", getattr(cfg, "partial_rotary_factor", 1.0))
        if partial not in (None, 1, 1.0):
            raise UnsupportedModelError(f"{mt} with partial_rotary_factor={partial} is not supported (RoPE over the "
                                        "whole head only)")
        check_sizes(cfg)
        heads = cfg.num_attention_heads
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
        kv = getattr(cfg, "num_key_value_heads", None) or heads
        if heads % kv:
            raise UnsupportedModelError(f"{heads} query heads are not a multiple of {kv} KV heads")
        max_pos = getattr(cfg, "max_position_embeddings", None)
        scale_from = arch.attention_scale_field
        # each would pass the load and fail inside a step (a complex or infinite softmax scale, a
        # soft-cap the kernels refuse) or make every logit 0 or NaN
        fields = ([scale_from] if scale_from else []) + (
            ["attn_logit_softcapping", "final_logit_softcapping"] if arch.softcaps else [])
        for name in fields:
            v = getattr(cfg, name, None)
            if v is None and name != scale_from:
                continue
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
                raise CheckpointError("model", None, message=f"config.json: {name}={v!r} is not usable (expected a "
                                      "finite number > 0" + ("" if name == scale_from else ", or null for none") + ")")
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
            attention_bias=arch.attention_bias or bool(getattr(cfg, "attention_bias", False)),
            max_position_embeddings=max_pos,
            hidden_act=act,
            norm_unit_offset=arch.norm_unit_offset,
            scale_embeddings=arch.scale_embeddings,
            sandwich_norms=arch.sandwich_norms,
            qk_norm=arch.qk_norm,
            attention_scale=float(getattr(cfg, scale_from)) ** -0.5 if scale_from else head_dim**-0.5,
            attn_logit_softcap=getattr(cfg, "attn_logit_softcapping", None) if arch.softcaps else None,
            final_logit_softcap=getattr(cfg, "final_logit_softcapping", None) if arch.softcaps else None,
            sliding_windows=_sliding_windows(cfg, mt, arch.windows, max_pos),
        )

    @property
    def architecture(self) -> Architecture:
        """This model type's entry of :data:`ARCHITECTURES`."""
        return ARCHITECTURES[self.model_type]

    @property
    def group_size(self) -> int:
        """Query heads per KV head (the GQA group)."""
        return self.num_heads // self.num_kv_heads

    @property
    def embedding_scale(self) -> float:
        """What embeddings are multiplied by (``sqrt(hidden_size)`` with ``scale_embeddings``, else 1)."""
        return math.sqrt(self.hidden_size) if self.scale_embeddings else 1.0


def check_sizes(cfg: Any) -> None:
    """Check the sizes of a config (a ``transformers`` config, or ``config.json`` read as a
    namespace, before ``transformers`` divides by them): each an integer >= 1 where given, and
    ``hidden_size`` a multiple of ``num_attention_heads`` when there is no ``head_dim``.

    Raises CheckpointError naming the field and its value."""
    for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                 "num_key_value_heads", "head_dim", "max_position_embeddings"):
        v = getattr(cfg, name, None)
        if v is None and name in ("num_key_value_heads", "head_dim", "max_position_embeddings"):
            continue
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise CheckpointError("model", None, message=f"config.json: {name}={v!r} is not a size (expected an "
                                  "integer >= 1)")
    hidden, heads = cfg.hidden_size, cfg.num_attention_heads
    if getattr(cfg, "head_dim", None) is None and hidden % heads:
        raise CheckpointError("model", None, message=f"config.json: hidden_size={hidden} is not a multiple of "
                              f"num_attention_heads={heads} (and no head_dim is given)")


def _sliding_windows(cfg: Any, mt: str, windows_from: str, max_pos: int | None) -> tuple[int | None, ...]:
    """Each layer's active window (see :data:`ARCHITECTURES`); raises UnsupportedModelError for
    a layer type other than full or sliding attention."""
    n = cfg.num_hidden_layers
    window = getattr(cfg, "sliding_window", None)
    types = list(getattr(cfg, "layer_types", None) or ["full_attention"] * n)
    if windows_from == "layer_types":
        unknown = sorted(set(types) - {"full_attention", "sliding_attention"})
        if unknown:
            raise UnsupportedModelError(f"{mt} with layer_types {unknown} is not supported "
                                        "(full_attention and sliding_attention only)")
    if windows_from == "none" or window is None:
        return (None,) * n
    marked = [True] * n if windows_from == "all" else [t == "sliding_attention" for t in types]
    window = int(window)
    if window < 1:
        raise UnsupportedModelError(f"{mt} with sliding_window={window} is not supported (a window of >= 1 token)")
    if max_pos is not None and window >= max_pos:
        return (None,) * n  # never bites: positions stay below the context length
    return tuple(window if m else None for m in marked)
