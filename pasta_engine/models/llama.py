"""Our own forward for the Llama family over the paged KV cache.

Supported architectures (``config.model_type``): ``llama`` (Llama 2/3, SmolLM2), ``mistral``
(without an active sliding window) and ``qwen2`` (q/k/v biases). The math follows the HF
implementations (RMSNorm in float32, RoPE "rotate half" at explicit logical position ids, GQA,
SwiGLU MLP, tied or untied LM head), so logits match ``transformers`` within float tolerance.

Weights come from :func:`pasta_engine.models.loader.load_model` and are re-packed here: q/k/v
and gate/up projections are concatenated so a layer is four GEMMs.

One :meth:`LlamaModel.forward` handles a mixed batch: the new tokens of every sequence
(prompt prefill chunks, inserted tags, single decode tokens) concatenated into ``[T]``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..errors import UnsupportedModelError
from ..layers.attention import AttentionBackend
from ..layers.rotary import RotaryEmbedding
from .config import ModelConfig

__all__ = ["LlamaModel"]


class LlamaModel:
    """Llama-family decoder over a paged KV cache.

    Args:
        config: :class:`ModelConfig`.
        weights: ``transformers`` state dict (``model.layers.{i}.self_attn.q_proj.weight`` ...).
        inv_freq, rope_scale: RoPE inverse frequencies ``[head_dim/2]`` and cos/sin scale
            (:func:`pasta_engine.layers.rotary.rope_inv_freq`).
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
        self.rotary = RotaryEmbedding(inv_freq, rope_scale, device, dtype)
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

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        slot_mapping: torch.Tensor,
        kv_cache: torch.Tensor,
        backend: AttentionBackend,
        logits_indices: torch.Tensor,
    ) -> torch.Tensor:
        """Run all layers over a mixed batch.

        Args:
            input_ids: ``[T]`` int64, every sequence's new tokens concatenated.
            positions: ``[T]`` int64 logical position of every token (RoPE).
            slot_mapping: ``[T]`` int64 KV-cache slot of every token (negative: write nothing).
            kv_cache: ``[num_layers, 2, num_pages, page_size, Hkv, D]``; the new tokens' K/V
                are written into it.
            backend: the attention backend, already planned for this step.
            logits_indices: ``[S]`` int64 rows of ``T`` whose next-token logits are wanted.

        Returns float32 logits ``[S, vocab_size]``.
        """
        c = self.config
        t = input_ids.shape[0]
        h = self.embed[input_ids]
        cos, sin = self.rotary(positions)
        nq, nkv, d = c.num_heads, c.num_kv_heads, c.head_dim
        for i, layer in enumerate(self.layers):
            x = self._rms_norm(h, layer["in_norm"])
            qkv = F.linear(x, layer["qkv"], layer["qkv_bias"])
            q, k, v = qkv.split([nq * d, nkv * d, nkv * d], dim=-1)
            k_cache, v_cache = kv_cache[i, 0], kv_cache[i, 1]
            q = backend.rope_and_write(
                q.view(t, nq, d), k.view(t, nkv, d), v.view(t, nkv, d), cos, sin, k_cache, v_cache, slot_mapping
            )
            o = backend.attend(q, k_cache, v_cache, self.scale)
            h = h + F.linear(o.reshape(t, nq * d), layer["o"])
            x = self._rms_norm(h, layer["post_norm"])
            g, u = F.linear(x, layer["gate_up"]).chunk(2, dim=-1)
            h = h + F.linear(F.silu(g) * u, layer["down"])
        h = self._rms_norm(h[logits_indices], self.norm)
        return F.linear(h, self.lm_head).float()
