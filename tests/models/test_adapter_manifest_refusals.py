"""An adapter whose tensors, ``adapter_config.json`` or ``manifest.json`` hold what the merge and
the engine cannot honour is refused at load with a CheckpointError naming the adapter and the
field (docs/DESIGN.md's failure model), never merged in part, merged into the wrong row, or left
to fail as a raw traceback in a later request."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

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
