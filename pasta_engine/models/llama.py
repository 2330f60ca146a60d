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

Weights arrive adapted at the load boundary (:mod:`pasta_engine.models.weights`: q/k/v and
gate/up fused, as Phi-3's checkpoints already hold them), so a layer is four GEMMs and the
forward never looks a tensor up by name.

One :meth:`LlamaModel.forward` handles a mixed batch: the new tokens of every sequence
(prompt prefill chunks, inserted tags, single decode tokens) concatenated into ``[T]``.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from ..layers.attention import AttentionBackend
from ..layers.kv_cache import KVCache
from ..layers.linear import linear_for
from ..layers.rotary import RotaryEmbedding
from .config import ModelConfig
from .weights import DecoderWeights, adapt_checkpoint

__all__ = ["LlamaModel"]

_ACTIVATIONS = {"silu": F.silu, "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh")}


class LlamaModel:
    """Llama-family decoder over a paged KV cache (see the module docstring for the options);
    a :class:`~pasta_engine.models.protocol.CausalLM`.

    Args:
        config: :class:`ModelConfig`.
        weights: the checkpoint adapted at load (:func:`~pasta_engine.models.weights.adapt_checkpoint`:
            fused q/k/v and gate/up), on the device and in the dtype the model runs in.
        rotary: the checkpoint's RoPE (:func:`pasta_engine.layers.rotary.rotary_embedding`), on
            the same device in the same dtype.

    Attributes:
        config, weights, rotary: as given; device, dtype: the embedding's.
        row_parallel_reduce: tensor parallelism (:mod:`pasta_engine.distributed`): None, or a
            function summing a row-parallel projection's partial output ``[T, hidden]`` across
            the ranks in place (an all-reduce), called after the o and down projections of
            every layer (two calls per layer, in layer order) when the weights are one rank's
            shard (:func:`~pasta_engine.models.weights.shard_checkpoint`).
    """

    def __init__(self, config: ModelConfig, weights: DecoderWeights, rotary: RotaryEmbedding):
        c = config
        self.config = config
        self.weights = weights
        self.device = weights.embed.device
        self.dtype = weights.embed.dtype
        self.rotary = rotary
        self.act = _ACTIVATIONS[c.hidden_act]
        self.embed_scale = (torch.tensor(c.embedding_scale, dtype=self.dtype, device=self.device)
                            if c.scale_embeddings else None)
        self.windowed = any(win is not None for win in c.sliding_windows)
        self._linear = linear_for(self.projection_weights(), self.device)  # CPU: per-shape GEMM orientation
        self._fused_norm = (self.device.type == "cpu" and self.dtype == torch.float32
                            and weights.norm.dtype == torch.float32 and hasattr(torch, "rms_norm"))
        self.row_parallel_reduce: Callable[[torch.Tensor], torch.Tensor] | None = None

    @classmethod
    def from_checkpoint(cls, config: ModelConfig, state: dict[str, torch.Tensor], rotary: RotaryEmbedding,
                        device: torch.device | str, dtype: torch.dtype) -> "LlamaModel":
        """Build from a ``transformers`` state dict (consumed), adapted at the load boundary by
        :func:`~pasta_engine.models.weights.adapt_checkpoint` (which says what it raises)."""
        return cls(config, adapt_checkpoint(state, config, device, dtype), rotary)

    @property
    def weight_bytes(self) -> int:
        """Bytes of all weights read by one forward (the LM head once, even when tied)."""
        return self.weights.nbytes

    def projection_weights(self) -> list[torch.Tensor]:
        """The weights :func:`~pasta_engine.layers.linear.linear` multiplies in a forward:
        every layer's q/k/v, output, gate/up and down projections ``[out, in]``, then the LM
        head ``[vocab, hidden]``."""
        w = self.weights
        return [t for layer in w.layers for t in (layer.qkv, layer.o, layer.gate_up, layer.down)] + [w.lm_head]

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
        w = self.weights
        h = w.embed.index_select(0, input_ids)
        if self.embed_scale is not None:
            h = h * self.embed_scale
        cos, sin = self.rotary(positions)
        nq, nkv, d = c.num_heads, c.num_kv_heads, c.head_dim
        window_inputs: dict[str, torch.Tensor] = {}
        if self.windowed:
            if kv_cache.key_positions is None:
                raise ValueError("a model with sliding windows needs a KVCache with track_positions=True")
            window_inputs = {"positions": positions, "key_positions": kv_cache.key_positions}
        for i, layer in enumerate(w.layers):
            x = self._rms_norm(h, layer.in_norm)
            qkv = self._linear(x, layer.qkv, layer.qkv_bias)
            k_cache, v_cache = kv_cache.layer(i)
            if c.qk_norm:
                q, k, v = qkv.split([nq * d, nkv * d, nkv * d], dim=-1)
                q, k, v = q.view(t, nq, d), k.view(t, nkv, d), v.view(t, nkv, d)
                q, k = self._rms_norm(q, layer.q_norm), self._rms_norm(k, layer.k_norm)
                q = backend.rope_and_write(q, k, v, cos, sin, k_cache, v_cache, slot_mapping)
            else:
                q = backend.rope_and_write_qkv(qkv, nq, cos, sin, k_cache, v_cache, slot_mapping)
            window = c.sliding_windows[i]
            o = backend.attend(q, k_cache, v_cache, c.attention_scale, sliding_window=window,
                               logit_softcap=c.attn_logit_softcap, **(window_inputs if window is not None else {}))
            o = self._linear(o.reshape(t, nq * d), layer.o, layer.o_bias)
            if self.row_parallel_reduce is not None:
                o = self.row_parallel_reduce(o)
            if c.sandwich_norms:
                o = self._rms_norm(o, layer.attn_out_norm)
            h = h + o
            x = self._rms_norm(h, layer.mlp_norm)
            g, u = self._linear(x, layer.gate_up, layer.gate_up_bias).chunk(2, dim=-1)
            x = self._linear(self.act(g) * u, layer.down, layer.down_bias)
            if self.row_parallel_reduce is not None:
                x = self.row_parallel_reduce(x)
            if c.sandwich_norms:
                x = self._rms_norm(x, layer.mlp_out_norm)
            h = h + x
        h = self._rms_norm(h if logits_indices is None else h[logits_indices], w.norm)
        logits = self._linear(h, w.lm_head)
        if c.final_logit_softcap is not None:  # in the model dtype, as transformers does
            logits = torch.tanh(logits / c.final_logit_softcap) * c.final_logit_softcap
        return logits.float()
