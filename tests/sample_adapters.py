"""Small adapters several test files load (importable from any test: pytest puts this folder,
the top conftest.py's, on ``sys.path``)."""

from __future__ import annotations

import json
from pathlib import Path


def tiny_adapter(tmp_path: Path) -> Path:
    """A rank-4 LoRA (peft format) on tiny-llama's first q_proj, fixed random weights, written
    to ``tmp_path/adapter``; returns that folder."""
    import torch
    from safetensors.torch import save_file

    d = tmp_path / "adapter"
    d.mkdir()
    (d / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 4, "lora_alpha": 8,
                                                       "target_modules": ["q_proj"], "bias": "none"}))
    g = torch.Generator().manual_seed(0)
    save_file({"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": torch.randn(4, 64, generator=g),
               "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight": torch.randn(64, 4, generator=g)},
              str(d / "adapter_model.safetensors"))
    return d
