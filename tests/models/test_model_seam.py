"""The model seam (issue 21 item 3): every architecture's traits in one table, checkpoint shapes
adapted at the load boundary, the table naming the decoder, and a new architecture that shares
Llama's math added by a table entry alone."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from pasta_engine import Engine, SamplingParams
from pasta_engine.errors import CheckpointError, UnsupportedModelError
from pasta_engine.layers.rotary import rotary_embedding
from pasta_engine.models import config as config_module
from pasta_engine.models.config import ARCHITECTURES, Architecture, ModelConfig
from pasta_engine.models.llama import LlamaModel
from pasta_engine.models.loader import build_model, decoder_class, load_model
from pasta_engine.models.protocol import CausalLM
from pasta_engine.models.weights import adapt_checkpoint

PROMPT = [1, 40, 41, 42, 43, 44, 45, 46, 47]


def _state(path) -> dict[str, torch.Tensor]:
    return dict(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).state_dict())


def _config(path) -> ModelConfig:
    return ModelConfig.from_hf(AutoConfig.from_pretrained(path))


def test_every_table_entry_names_a_decoder_that_is_a_causal_lm():
    for mt, arch in ARCHITECTURES.items():
        assert isinstance(arch, Architecture), mt
        cls = decoder_class(SimpleNamespace(architecture=arch))
        assert cls is LlamaModel
    assert set(ARCHITECTURES) == {"llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "phi3"}


@pytest.mark.parametrize("ckpt", ["tiny_llama", "tiny_qwen2", "tiny_phi3"])
def test_the_loaded_model_is_a_causal_lm_with_fused_weights(ckpt, request):
    model, _, _ = load_model(request.getfixturevalue(ckpt), with_tokenizer=False)
    c = model.config
    assert isinstance(model, CausalLM)
    layer = model.weights.layers[0]
    assert layer.qkv.shape == ((c.num_heads + 2 * c.num_kv_heads) * c.head_dim, c.hidden_size)
    assert layer.gate_up.shape == (2 * c.intermediate_size, c.hidden_size)
    assert (layer.qkv_bias is not None) == (ckpt == "tiny_qwen2")
    assert model.weight_bytes == sum(t.numel() * t.element_size() for t in model.weights.tensors())
    assert len(model.projection_weights()) == 4 * c.num_layers + 1


def test_adapting_fuses_q_k_v_and_gate_up_in_order_and_consumes_the_state(tiny_llama):
    state = _state(tiny_llama)
    want_q = state["model.layers.1.self_attn.q_proj.weight"].clone()
    want_v = state["model.layers.1.self_attn.v_proj.weight"].clone()
    want_up = state["model.layers.1.mlp.up_proj.weight"].clone()
    w = adapt_checkpoint(state, _config(tiny_llama), "cpu", torch.float32)
    qkv = w.layers[1].qkv
    assert torch.equal(qkv[: want_q.shape[0]], want_q) and torch.equal(qkv[-want_v.shape[0]:], want_v)
    assert torch.equal(w.layers[1].gate_up[-want_up.shape[0]:], want_up)
    assert not state  # every tensor taken: the checkpoint is never held twice


def test_a_fused_checkpoint_passes_through(tiny_phi3):
    state = _state(tiny_phi3)
    assert "model.layers.0.self_attn.qkv_proj.weight" in state  # the table's fused_checkpoint is right
    want = state["model.layers.0.self_attn.qkv_proj.weight"].clone()
    w = adapt_checkpoint(state, _config(tiny_phi3), "cpu", torch.float32)
    assert torch.equal(w.layers[0].qkv, want)


def test_gemma_norm_weights_are_adapted_to_one_plus_w(tiny_gemma):
    state = _state(tiny_gemma)
    raw = state["model.norm.weight"].clone()
    w = adapt_checkpoint(state, _config(tiny_gemma), "cpu", torch.float32)
    assert torch.equal(w.norm, 1.0 + raw.float())


def test_bad_checkpoints_are_named_at_the_load_boundary(tiny_llama, tiny_qwen2):
    cfg = _config(tiny_llama)
    state = _state(tiny_llama)
    del state["model.layers.1.mlp.down_proj.weight"]
    with pytest.raises(UnsupportedModelError, match="model.layers.1.mlp.down_proj.weight"):
        adapt_checkpoint(state, cfg, "cpu", torch.float32)
    with pytest.raises(CheckpointError, match=r"model.embed_tokens.weight is \(320, 64\) but the config makes it "
                                              r"\(321, 64\)"):
        adapt_checkpoint(_state(tiny_llama), dataclasses.replace(cfg, vocab_size=321), "cpu", torch.float32)
    state = _state(tiny_qwen2)
    del state["model.layers.0.self_attn.k_proj.bias"]
    with pytest.raises(UnsupportedModelError, match="has biases"):
        adapt_checkpoint(state, _config(tiny_qwen2), "cpu", torch.float32)


def test_a_new_architecture_with_llamas_math_is_one_table_entry(tiny_llama, monkeypatch):
    """A made-up ``model_type`` whose traits are in the table (here: the window on every layer, as
    Mistral's) loads and runs with no other change, and equals the architecture it copies."""
    hf = AutoConfig.from_pretrained(tiny_llama)
    monkeypatch.setitem(ARCHITECTURES, "my-llama", Architecture(windows="all"))
    assert config_module.ARCHITECTURES["my-llama"].windows == "all"
    mine = SimpleNamespace(**{**hf.to_dict(), "model_type": "my-llama", "sliding_window": 6,
                              "max_position_embeddings": hf.max_position_embeddings})
    cfg = ModelConfig.from_hf(mine)
    assert cfg.model_type == "my-llama" and cfg.sliding_windows == (6,) * cfg.num_layers
    _, tok, _ = load_model(tiny_llama)
    rotary = rotary_embedding(hf, cfg.head_dim, "cpu", torch.float32)
    model = build_model(cfg, _state(tiny_llama), rotary, "cpu", torch.float32)
    same = build_model(dataclasses.replace(cfg, model_type="mistral"), _state(tiny_llama), rotary, "cpu",
                       torch.float32)

    def run(m):
        engine = Engine(m, tok, kv_cache_bytes=4 * 2**20, page_size=4)
        seen = []
        engine.logits_hook = lambda req, tid, row: seen.append(row.clone())
        [res] = engine.generate([PROMPT], SamplingParams(max_new_tokens=8), mode="sequential")
        assert engine.model_runner.kv_cache.key_positions is not None  # windows: the cache tracks positions
        return res.token_ids, torch.stack(seen)

    plain = build_model(_config(tiny_llama), _state(tiny_llama), rotary, "cpu", torch.float32)
    got, want = run(model), run(same)
    assert got[0] == want[0]
    torch.testing.assert_close(got[1], want[1], rtol=0, atol=0)
    engine = Engine(plain, tok, kv_cache_bytes=4 * 2**20, page_size=4)
    seen = []
    engine.logits_hook = lambda req, tid, row: seen.append(row.clone())
    engine.generate([PROMPT], SamplingParams(max_new_tokens=8), mode="sequential")
    assert engine.model_runner.kv_cache.key_positions is None  # no window: no table
    assert (torch.stack(seen)[-1] - got[1][-1]).abs().max() > 1e-3  # the entry's window bites
