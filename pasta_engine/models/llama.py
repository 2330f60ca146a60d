"""Our own forward for the Llama family over the paged KV cache.

One decoder serves every supported architecture (:data:`~pasta_engine.models.config.ARCHITECTURES`:
``llama`` (Llama 2/3, SmolLM2), ``mistral``, ``qwen2``, ``qwen3``, ``gemma``, ``gemma2``,
``phi3``): they are all pre-norm blocks of RMSNorm, attention with RoPE at explicit logical
position ids, and a gated MLP, and differ only by the options of
:class:`~pasta_engine.models.config.ModelConfig`:

* RMSNorm by ``w`` after the cast (Llama) or by ``1 + w`` in float32 (Gemma), on the block
  inputs, on each q/k head before RoPE (Qwen3), and on the attention/MLP outputs (Gemma 2);
* the gate activation (SiLU: SwiGLU; tanh-approximated GELU: GeGLU), embeddings scaled by
  ``sqrt(hidden_size)`` (Gemma);
* per-layer attention options handed to the backend: the softmax scale, a sliding window
  (Mistral, Phi-3, Qwen2/3 when enabled, Gemma 2's alternate layers) and an attention-logit
  soft-cap (Gemma 2); a final-logit soft-cap (Gemma 2).

The math follows the ``transformers`` implementations (norms in float32, RoPE "rotate half",
GQA, tied or untied LM head), so logits match within float tolerance.

Weights come from :func:`pasta_engine.models.loader.load_model` and are re-packed here: q/k/v
and gate/up projections are concatenated (Phi-3's checkpoints already hold them fused), so a
layer is four GEMMs.

One :meth:`LlamaModel.forward` handles a mixed batch: the new tokens of every sequence
(prompt prefill chunks, inserted tags, single decode tokens) concatenated into ``[T]``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..errors import UnsupportedModelError
from ..layers.attention import AttentionBackend
from ..layers.kv_cache import KVCache
from ..layers.linear import linear_for
from ..layers.rotary import RotaryEmbedding
from .config import ModelConfig

__all__ = ["LlamaModel"]

_ACTIVATIONS = {"silu": F.silu, "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh")}


class LlamaModel:
    """Llama-family decoder over a paged KV cache (see the module docstring for the options).

    Args:
        config: :class:`ModelConfig`.
        weights: ``transformers`` state dict (``model.layers.{i}.self_attn.q_proj.weight`` ...).
            Consumed: each tensor is removed from the dict once packed, so a checkpoint is
            never held twice (a 7B model in bfloat16 fits a 24 GiB machine).
        rotary: the checkpoint's RoPE (:func:`pasta_engine.layers.rotary.rotary_embedding`), on
            ``device`` in ``dtype``.
        device, dtype: where and in what precision to run.

    Raises UnsupportedModelError naming a tensor the checkpoint lacks.
    """

    def __init__(
        self,
        config: ModelConfig,
        weights: dict[str, torch.Tensor],
        rotary: RotaryEmbedding,
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
            return weights.pop(name).to(device=device, dtype=dtype)

        def norm(name: str) -> torch.Tensor:
            # Gemma's (1 + w) is precomputed in float32, as its RMSNorm multiplies
            return 1.0 + w(name).float() if c.norm_unit_offset else w(name)

        def packed(names: list[str], fused: str) -> torch.Tensor:
            return w(fused) if fused in weights else torch.cat([w(n) for n in names])

        def bias(names: list[str]) -> torch.Tensor | None:
            have = [n for n in names if n in weights]
            if not have:
                return None
            if len(have) != len(names):
                raise UnsupportedModelError(f"checkpoint has biases {have} but not {sorted(set(names) - set(have))}")
            return torch.cat([w(n) for n in names])

        tied = c.tie_word_embeddings or "lm_head.weight" not in weights
        self.embed = w("model.embed_tokens.weight")
        self.lm_head = self.embed if tied else w("lm_head.weight")
        weights.pop("lm_head.weight", None)
        self.layers: list[dict[str, torch.Tensor | None]] = []
        for i in range(c.num_layers):
            p = f"model.layers.{i}."
            a, m = p + "self_attn.", p + "mlp."
            qkv = [a + "q_proj", a + "k_proj", a + "v_proj"]
            layer = {
                "in_norm": norm(p + "input_layernorm.weight"),
                "qkv": packed([n + ".weight" for n in qkv], a + "qkv_proj.weight"),
                "qkv_bias": bias([n + ".bias" for n in qkv]),
                "q_norm": norm(a + "q_norm.weight") if c.qk_norm else None,
                "k_norm": norm(a + "k_norm.weight") if c.qk_norm else None,
                "o": w(a + "o_proj.weight"),
                "o_bias": bias([a + "o_proj.bias"]),
                # Gemma 2 names the norm of the attention output post_attention_layernorm and the
                # MLP's input norm pre_feedforward_layernorm; Llama's post_attention_layernorm is
                # the MLP's input norm
                "attn_out_norm": norm(p + "post_attention_layernorm.weight") if c.sandwich_norms else None,
                "mlp_norm": norm(p + ("pre_feedforward_layernorm.weight" if c.sandwich_norms
                                      else "post_attention_layernorm.weight")),
                "mlp_out_norm": norm(p + "post_feedforward_layernorm.weight") if c.sandwich_norms else None,
                "gate_up": packed([m + "gate_proj.weight", m + "up_proj.weight"], m + "gate_up_proj.weight"),
                "gate_up_bias": bias([m + "gate_proj.bias", m + "up_proj.bias"]),
                "down": w(m + "down_proj.weight"),
                "down_bias": bias([m + "down_proj.bias"]),
            }
            self.layers.append(layer)
        self.norm = norm("model.norm.weight")
        self.rotary = rotary
        self.act = _ACTIVATIONS[c.hidden_act]
        self.embed_scale = (torch.tensor(c.embedding_scale, dtype=dtype, device=device)
                            if c.scale_embeddings else None)
        self.windowed = any(win is not None for win in c.sliding_windows)
        self._linear = linear_for(self.projection_weights(), self.device)  # CPU: per-shape GEMM orientation
        self._fused_norm = (self.device.type == "cpu" and dtype == torch.float32
                            and self.norm.dtype == torch.float32 and hasattr(torch, "rms_norm"))

    @property
    def weight_bytes(self) -> int:
        """Bytes of all weights read by one forward (the LM head once, even when tied)."""
        tensors = [self.embed, self.norm, self.lm_head] if self.lm_head is not self.embed else [self.embed, self.norm]
        for layer in self.layers:
            tensors += [t for t in layer.values() if t is not None]
        return sum(t.numel() * t.element_size() for t in tensors)

    def projection_weights(self) -> list[torch.Tensor]:
        """The weights :func:`~pasta_engine.layers.linear.linear` multiplies in a forward:
        every layer's q/k/v, output, gate/up and down projections ``[out, in]``, then the LM
        head ``[vocab, hidden]``."""
        return [layer[k] for layer in self.layers for k in ("qkv", "o", "gate_up", "down")] + [self.lm_head]

    def _rms_norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """RMSNorm over the last dim of ``x`` (any leading shape), in float32.

        A float32 model on a CPU calls ``torch.rms_norm`` (one dispatch instead of eight):
        there it computes the same ops in the same order, bitwise equal to the written-out
        norm for both weight conventions (tests/layers/test_forward_fast_paths.py). Elsewhere
        (half precision multiplies the weight after the cast; CUDA's fused kernel reduces in
        another order) the written-out norm runs."""
        if self._fused_norm and x.dtype == torch.float32:
            return torch.rms_norm(x, (x.shape[-1],), weight, self.config.rms_norm_eps)
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.config.rms_norm_eps)
        if self.config.norm_unit_offset:
            return (xf * weight).to(x.dtype)  # weight holds 1 + w in float32 (Gemma)
        return weight * xf.to(x.dtype)

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        slot_mapping: torch.Tensor,
        kv_cache: KVCache,
        backend: AttentionBackend,
        logits_indices: torch.Tensor | None,
    ) -> torch.Tensor:
        """Run all layers over a mixed batch.

        Args:
            input_ids: ``[T]`` int64, every sequence's new tokens concatenated.
            positions: ``[T]`` int64 logical position of every token (RoPE, sliding windows).
            slot_mapping: ``[T]`` int64 KV-cache slot of every token (negative: write nothing).
            kv_cache: the paged :class:`~pasta_engine.layers.kv_cache.KVCache`; the new tokens'
                K/V are written into it. A sliding-window layer reads ``kv_cache.key_positions``,
                where the caller has recorded the new tokens' positions
                (:meth:`~pasta_engine.layers.kv_cache.KVCache.record_positions`).
            backend: the attention backend, already planned for this step.
            logits_indices: ``[S]`` int64 rows of ``T`` whose next-token logits are wanted, or
                None for every row (``S = T``).

        Returns float32 logits ``[S, vocab_size]``.
        """
        c = self.config
        t = input_ids.shape[0]
        h = self.embed.index_select(0, input_ids)
        if self.embed_scale is not None:
            h = h * self.embed_scale
        cos, sin = self.rotary(positions)
        nq, nkv, d = c.num_heads, c.num_kv_heads, c.head_dim
        window_inputs: dict[str, torch.Tensor] = {}
        if self.windowed:
            if kv_cache.key_positions is None:
                raise ValueError("a model with sliding windows needs a KVCache with track_positions=True")
            window_inputs = {"positions": positions, "key_positions": kv_cache.key_positions}
        for i, layer in enumerate(self.layers):
            x = self._rms_norm(h, layer["in_norm"])
            qkv = self._linear(x, layer["qkv"], layer["qkv_bias"])
            k_cache, v_cache = kv_cache.layer(i)
            if c.qk_norm:
                q, k, v = qkv.split([nq * d, nkv * d, nkv * d], dim=-1)
                q, k, v = q.view(t, nq, d), k.view(t, nkv, d), v.view(t, nkv, d)
                q, k = self._rms_norm(q, layer["q_norm"]), self._rms_norm(k, layer["k_norm"])
                q = backend.rope_and_write(q, k, v, cos, sin, k_cache, v_cache, slot_mapping)
            else:
                q = backend.rope_and_write_qkv(qkv, nq, cos, sin, k_cache, v_cache, slot_mapping)
            window = c.sliding_windows[i]
            o = backend.attend(q, k_cache, v_cache, c.attention_scale, sliding_window=window,
                               logit_softcap=c.attn_logit_softcap, **(window_inputs if window is not None else {}))
            o = self._linear(o.reshape(t, nq * d), layer["o"], layer["o_bias"])
            if c.sandwich_norms:
                o = self._rms_norm(o, layer["attn_out_norm"])
            h = h + o
            x = self._rms_norm(h, layer["mlp_norm"])
            g, u = self._linear(x, layer["gate_up"], layer["gate_up_bias"]).chunk(2, dim=-1)
            x = self._linear(self.act(g) * u, layer["down"], layer["down_bias"])
            if c.sandwich_norms:
                x = self._rms_norm(x, layer["mlp_out_norm"])
            h = h + x
        h = self._rms_norm(h if logits_indices is None else h[logits_indices], self.norm)
        logits = self._linear(h, self.lm_head)
        if c.final_logit_softcap is not None:  # in the model dtype, as transformers does
            logits = torch.tanh(logits / c.final_logit_softcap) * c.final_logit_softcap
        return logits.float()
