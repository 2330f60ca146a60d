"""A checkpoint or adapter holding what its config.json or manifest does not honour is refused at
load with a CheckpointError naming the field and the tensor (docs/DESIGN.md's failure model),
never loaded with that part silently dropped, and never left to a raw traceback; what is
consistent but written another way (an lm_head equal to the embedding under a tied config,
stored RoPE frequencies, a manifest's keys in another order) still loads."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoConfig

from pasta_engine import Engine
from pasta_engine.errors import CheckpointError
from pasta_engine.models.loader import _check_tensor_names, load_model

A0 = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
B0 = "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"
ROWS = "base_model.model.model.embed_tokens.token_adapter.trainable_tokens_delta"


def _copy(src, dst, weights=None, **config):
    """A copy of checkpoint ``src`` with ``config`` fields changed and, when given, ``weights(w)``
    applied to its state dict."""
    shutil.copytree(src, dst)
    if config:
        cfg = json.loads((dst / "config.json").read_text())
        cfg.update(config)
        (dst / "config.json").write_text(json.dumps(cfg))
    if weights is not None:
        w = load_file(dst / "model.safetensors")
        weights(w)
        save_file(w, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def _adapter(tmp_path, name, cfg=None, tensors=None, manifest=None):
    """A rank-4 LoRA on tiny-llama's first q_proj (plus ``cfg`` and ``tensors``), with ``manifest``."""
    d = tmp_path / name
    d.mkdir()
    (d / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 4, "lora_alpha": 8, "bias": "none",
                                                       "target_modules": ["q_proj"], **(cfg or {})}))
    g = torch.Generator().manual_seed(0)
    save_file({A0: torch.randn(4, 64, generator=g), B0: torch.randn(64, 4, generator=g), **(tensors or {})},
              str(d / "adapter_model.safetensors"))
    if manifest is not None:
        (d / "manifest.json").write_text(json.dumps(manifest))
    return d


def test_layers_past_num_hidden_layers_are_refused_not_dropped(tiny_llama, tmp_path):
    """num_hidden_layers: 1 over a 2-layer file loaded a 1-layer model: layer 1's 9 tensors dropped."""
    d = _copy(tiny_llama, tmp_path / "ck", num_hidden_layers=1)
    with pytest.raises(CheckpointError, match=r"model\.layers\.1\.input_layernorm\.weight \(and 8 more\), which "
                                              "its config does not use") as e:
        load_model(d)
    assert e.value.param == "model"


def test_qwen3_norms_under_a_llama_config_are_refused_not_dropped(tiny_qwen3, tmp_path):
    """A Qwen3 file relabelled model_type: llama loaded without its q/k norm weights."""
    d = _copy(tiny_qwen3, tmp_path / "ck", model_type="llama", architectures=["LlamaForCausalLM"])
    with pytest.raises(CheckpointError, match=r"self_attn\.k_norm\.weight \(and 3 more\), which its config does "
                                              "not use"):
        Engine.from_pretrained(d, kv_cache_bytes=2**20)


def test_a_tensor_parallel_shard_refuses_unused_weights_but_not_stored_rope_buffers(tiny_llama, tiny_qwen3):
    """The shard path (read without transformers) refused only unused biases."""
    cfg = AutoConfig.from_pretrained(tiny_llama)
    w = load_file(tiny_llama / "model.safetensors")
    _check_tensor_names(cfg, {**w, "model.layers.0.self_attn.rotary_emb.inv_freq": torch.ones(8)}, tiny_llama)
    one = AutoConfig.from_pretrained(tiny_llama)
    one.num_hidden_layers = 1
    with pytest.raises(CheckpointError, match=r"hold model\.layers\.1\.input_layernorm\.weight \(and 8 more\)"):
        _check_tensor_names(one, w, tiny_llama)
    q3 = load_file(tiny_qwen3 / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"hold model\.layers\.0\.self_attn\.k_norm\.weight \(and 3 more\)"):
        _check_tensor_names(cfg, q3, tiny_llama)


def test_a_tensor_parallel_shard_of_a_tied_model_may_store_its_head(tiny_qwen2):
    """A tied model's file that also stores lm_head (equal to the embedding) is not an unused
    tensor: the head is compared with the embedding when the weights are adapted."""
    cfg = AutoConfig.from_pretrained(tiny_qwen2)
    w = load_file(tiny_qwen2 / "model.safetensors")
    _check_tensor_names(cfg, {**w, "lm_head.weight": w["model.embed_tokens.weight"].clone()}, tiny_qwen2)


def test_a_tied_config_over_a_files_own_head_is_refused_not_dropped(tiny_llama, tmp_path):
    """tie_word_embeddings: true over a file whose lm_head differs from its embedding: the
    file's head was dropped and the embedding used as the head."""
    d = _copy(tiny_llama, tmp_path / "ck", tie_word_embeddings=True)
    with pytest.raises(CheckpointError, match=r"tie_word_embeddings=true .* its own lm_head\.weight") as e:
        load_model(d)
    assert e.value.param == "model"


def test_a_tied_config_over_a_head_equal_to_the_embedding_loads(tiny_llama, tmp_path):
    def same_head(w):
        w["lm_head.weight"] = w["model.embed_tokens.weight"].clone()

    d = _copy(tiny_llama, tmp_path / "ck", weights=same_head, tie_word_embeddings=True)
    m, _, _ = load_model(d)
    assert m.weights.lm_head is m.weights.embed


def test_a_tied_model_grown_by_an_adapters_tokens_keeps_its_head_tied(tiny_qwen2, tmp_path):
    """The tied head (the embedding) is not a separate head the merge grows with zero rows."""
    d = _adapter(tmp_path, "rows", cfg={"trainable_token_indices": [320, 321]},
                 tensors={ROWS: torch.randn(2, 64, generator=torch.Generator().manual_seed(1))},
                 manifest={"added_tokens": {"<sync/>": 320, "<async>": 321}})
    m, tok, _ = load_model(tiny_qwen2, adapter=d)
    assert m.config.vocab_size == 322 and m.weights.lm_head is m.weights.embed
    assert tok.convert_tokens_to_ids(["<sync/>", "<async>"]) == [320, 321]


def test_added_tokens_in_another_key_order_load_at_their_ids(tiny_llama, tmp_path):
    """A manifest rewritten with sorted keys ({'<async>': 321, '<sync/>': 320}) was refused as
    trained with another tokenizer: the tokens were added in key order."""
    d = _adapter(tmp_path, "sorted", cfg={"trainable_token_indices": [320, 321]},
                 tensors={ROWS: torch.randn(2, 64, generator=torch.Generator().manual_seed(1))},
                 manifest={"added_tokens": {"<async>": 321, "<sync/>": 320}})
    e = Engine.from_pretrained(tiny_llama, adapter=d, kv_cache_bytes=2**21)
    assert e.tokenizer.convert_tokens_to_ids(["<sync/>", "<async>"]) == [320, 321]


@pytest.mark.parametrize("named", [5, ["model.safetensors"]])
def test_a_base_model_file_that_is_not_a_string_is_refused(tiny_llama, tmp_path, named):
    """base_model_file: 5 gave a raw TypeError from pathlib."""
    d = _adapter(tmp_path, "file", manifest={"base_model_file": named, "base_model_sha256": "ab" * 32})
    with pytest.raises(CheckpointError, match="base_model_file") as e:
        Engine.from_pretrained(tiny_llama, adapter=d, kv_cache_bytes=2**20)
    assert e.value.param == "adapter" and "file" in str(e.value)


@pytest.mark.parametrize("manifest", [None, {"added_tokens": {"<sync/>": 320, "<async>": 322}}])
def test_embedding_rows_the_manifest_does_not_name_are_refused(tiny_llama, tmp_path, manifest):
    """An adapter growing the embedding 320 -> 326 whose manifest names none (or some) of the new
    rows loaded: the model then sampled ids the tokenizer decodes to ''."""
    d = _adapter(tmp_path, "rows", cfg={"trainable_token_indices": list(range(320, 326))},
                 tensors={ROWS: torch.randn(6, 64, generator=torch.Generator().manual_seed(1))}, manifest=manifest)
    unnamed = "320, 321, 322, 323, 324, 325" if manifest is None else "321, 323, 324, 325"
    with pytest.raises(CheckpointError, match=f"adds embedding rows {unnamed} past") as e:
        Engine.from_pretrained(tiny_llama, adapter=d, kv_cache_bytes=2**21)
    assert e.value.param == "adapter" and "rows" in str(e.value)
