"""An adapter whose tensors, ``adapter_config.json`` or ``manifest.json`` hold what the merge and
the engine cannot honour is refused at load with a CheckpointError naming the adapter and the
field (docs/DESIGN.md's failure model), never merged in part, merged into the wrong row, or left
to fail as a raw traceback in a later request."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from pasta_engine import Engine
from pasta_engine.errors import CheckpointError
from pasta_engine.models.adapter import merge_lora

A0 = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
B0 = "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"
B1 = "base_model.model.model.layers.1.self_attn.q_proj.lora_B.weight"
ROWS = "base_model.model.model.embed_tokens.token_adapter.trainable_tokens_delta"


def _adapter(tmp_path, tensors, **cfg):
    """A peft LoRA folder with ``tensors`` and ``cfg`` over a rank-2 config."""
    d = tmp_path / "adapter"
    d.mkdir()
    (d / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 2, "lora_alpha": 4, "bias": "none",
                                                       "target_modules": ["q_proj"], **cfg}))
    save_file(tensors, str(d / "adapter_model.safetensors"))
    return d


def _weights():
    return {f"model.layers.{i}.self_attn.q_proj.weight": torch.ones(4, 3) for i in range(2)} | {
        "model.embed_tokens.weight": torch.zeros(5, 3)}


def test_a_lora_b_without_its_lora_a_is_refused_not_skipped(tmp_path):
    """Layer 1's lora_A is lost (a partial adapter): its lora_B was dropped silently and the
    adapter merged into layer 0 only."""
    d = _adapter(tmp_path, {A0: torch.ones(2, 3), B0: torch.ones(4, 2), B1: torch.ones(4, 2)})
    w = _weights()
    with pytest.raises(CheckpointError, match="lora_B.weight has no lora_A partner") as e:
        merge_lora(w, d)
    assert e.value.param == "adapter" and str(d) in str(e.value)
    assert torch.equal(w["model.layers.0.self_attn.q_proj.weight"], torch.ones(4, 3))  # nothing merged


@pytest.mark.parametrize("indices", [["abc"], [1.7], [True], 5, {"embed_tokens": 5}, {"embed_tokens": [2.0]},
                                     [[1]], "1"])
def test_trainable_token_indices_that_are_not_integer_rows_are_refused(tmp_path, indices):
    """``["abc"]`` and ``{"embed_tokens": 5}`` raised a raw ValueError/TypeError from ``int()``;
    ``[1.7]`` and ``[True]`` were truncated to row 1 and overwrote it."""
    d = _adapter(tmp_path, {A0: torch.zeros(2, 3), B0: torch.zeros(4, 2), ROWS: torch.full((1, 3), 7.0)},
                 trainable_token_indices=indices)
    w = _weights()
    with pytest.raises(CheckpointError, match="trainable_token_indices") as e:
        merge_lora(w, d)
    assert e.value.param == "adapter" and str(d) in str(e.value)
    assert torch.equal(w["model.embed_tokens.weight"], torch.zeros(5, 3))  # no row written


@pytest.mark.parametrize("indices", [[1], {"embed_tokens": [1]}])
def test_trainable_token_indices_of_integer_rows_still_merge(tmp_path, indices):
    d = _adapter(tmp_path, {A0: torch.zeros(2, 3), B0: torch.zeros(4, 2), ROWS: torch.full((1, 3), 7.0)},
                 trainable_token_indices=indices)
    w = _weights()
    merge_lora(w, d)
    assert torch.equal(w["model.embed_tokens.weight"][1], torch.full((3,), 7.0))


@pytest.mark.parametrize("prompt, why", [
    ("Write promises.", "pasta_prompt is a str"),
    ({"system": "s", "examples": [["only a question"]]}, r"pasta_prompt examples\[0\] is \['only a question'\]"),
    ({"system": 5}, "pasta_prompt system is 5, not a string"),
    ({"system": "s", "examples": "q a"}, "pasta_prompt examples is 'q a', not a list"),
    ({"system": "s", "examples": [["q", 1]]}, r"pasta_prompt examples\[0\]"),
    ({"sytem": "s"}, "pasta_prompt has the key 'sytem'"),
    ("", "pasta_prompt is a str"),
])
def test_a_manifest_pasta_prompt_of_another_shape_is_refused_at_load(tiny_llama, tmp_path, prompt, why):
    """A string made from_pretrained fail with a raw AttributeError; a one-element example and a
    system prompt of 5 loaded, and then every pasta-mode request failed with a raw
    ValueError/TypeError."""
    from sample_adapters import tiny_adapter

    d = tiny_adapter(tmp_path)
    (d / "manifest.json").write_text(json.dumps({"pasta_prompt": prompt}))
    with pytest.raises(CheckpointError, match=why) as e:
        Engine.from_pretrained(tiny_llama, adapter=d, kv_cache_bytes=2**20, threads=1)
    assert e.value.param == "adapter" and str(d) in str(e.value) and "manifest.json" in str(e.value)
    # a pasta_prompt given to the engine does not let the adapter's broken one through
    from pasta_engine.lang.prompts import NO_PROMPT

    with pytest.raises(CheckpointError, match=why):
        Engine.from_pretrained(tiny_llama, adapter=d, kv_cache_bytes=2**20, threads=1, pasta_prompt=NO_PROMPT)


def test_a_manifest_pasta_prompt_of_the_expected_shape_is_the_engines(tiny_llama, tmp_path):
    from sample_adapters import tiny_adapter

    from pasta_engine.lang.prompts import DEFAULT_PASTA_PROMPT, PastaPrompt

    d = tiny_adapter(tmp_path)
    (d / "manifest.json").write_text(json.dumps({"pasta_prompt": {"system": "s", "examples": [["q", "a"]]}}))
    engine = Engine.from_pretrained(tiny_llama, adapter=d, kv_cache_bytes=2**20, threads=1)
    assert engine.config.pasta_prompt == PastaPrompt(system="s", examples=(("q", "a"),))
    (d / "manifest.json").write_text(json.dumps({"pasta_prompt": {}}))  # none set: the engine's default
    engine = Engine.from_pretrained(tiny_llama, adapter=d, kv_cache_bytes=2**20, threads=1)
    assert engine.config.pasta_prompt == DEFAULT_PASTA_PROMPT
