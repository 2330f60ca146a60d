"""LoRA adapters in peft's format, merged into a checkpoint's weights at load.

A LoRA adapter (Hu et al. 2021, "LoRA: Low-Rank Adaptation of Large Language Models",
section 4.1) adds ``(alpha / r) * B @ A`` to a linear layer's weight ``W [out, in]``, with
``A [r, in]`` and ``B [out, r]``. peft saves it as ``adapter_config.json`` plus
``adapter_model.safetensors`` whose tensors are named
``base_model.model.<module>.lora_A.weight`` / ``.lora_B.weight``. Merging once at load costs
nothing per step: the engine then runs the merged weights like any checkpoint.

The project's shipped adapters (``pasta_engine/adapters/<name>/``) carry a ``manifest.json``:
the base model file's SHA-256, the data split, annotator, commands, commit and evaluation
figures, and the short system prompt the adapter was trained with.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import torch

from ..errors import ParameterError, UnsupportedModelError

__all__ = ["merge_lora", "read_manifest", "file_sha256", "SHIPPED_ADAPTERS", "shipped_adapter"]

#: Folder of the adapters shipped in the package.
SHIPPED_ADAPTERS = Path(__file__).resolve().parents[1] / "adapters"


def file_sha256(path: str | Path, chunk_bytes: int = 1 << 22) -> str:
    """Hex SHA-256 of a file (read in 4 MiB chunks)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while True:
            block = f.read(chunk_bytes)
            if not block:
                return h.hexdigest()
            h.update(block)


def shipped_adapter(name: str = "smollm2-135m-pasta") -> Path | None:
    """The folder of a shipped adapter, or None when the package carries none by that name."""
    path = SHIPPED_ADAPTERS / name
    return path if (path / "adapter_config.json").exists() else None


def read_manifest(adapter_dir: str | Path) -> dict[str, Any] | None:
    """The adapter's ``manifest.json`` (None when it has none)."""
    p = Path(adapter_dir) / "manifest.json"
    return json.loads(p.read_text()) if p.exists() else None


def _adapter_tensors(adapter_dir: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    st = adapter_dir / "adapter_model.safetensors"
    if st.exists():
        return load_file(st)
    binf = adapter_dir / "adapter_model.bin"
    if binf.exists():
        return torch.load(binf, map_location="cpu", weights_only=True)
    raise FileNotFoundError(f"{adapter_dir} has no adapter_model.safetensors (a peft LoRA adapter folder)")


def merge_lora(weights: dict[str, torch.Tensor], adapter_dir: str | Path) -> list[str]:
    """Merge a peft LoRA adapter into ``weights`` (a ``transformers`` state dict), in place.

    Args:
        weights: ``name -> tensor`` of the base checkpoint (``model.layers.0.self_attn.q_proj.weight``, ...).
        adapter_dir: a folder with peft's ``adapter_config.json`` and ``adapter_model.safetensors``.

    Returns the names of the merged weights. The sum is computed in float32 and cast back to
    the weight's dtype.

    Raises FileNotFoundError for a folder that is no adapter, UnsupportedModelError for a peft
    option this merge does not implement (DoRA, biases, fan-in-fan-out, extra modules to save),
    ParameterError when a LoRA pair names a weight the checkpoint does not have or shapes disagree."""
    adapter_dir = Path(adapter_dir)
    cfg_path = adapter_dir / "adapter_config.json"
    if not cfg_path.exists():
        raise FileNotFoundError(f"{adapter_dir} is not a LoRA adapter folder (no adapter_config.json)")
    cfg = json.loads(cfg_path.read_text())
    if cfg.get("peft_type", "LORA") != "LORA":
        raise UnsupportedModelError(f"adapter type {cfg.get('peft_type')!r} is not supported (LoRA only)")
    for opt, bad in (("use_dora", True), ("fan_in_fan_out", True)):
        if cfg.get(opt) == bad:
            raise UnsupportedModelError(f"LoRA option {opt}={bad} is not supported")
    if cfg.get("bias", "none") != "none" or cfg.get("modules_to_save"):
        raise UnsupportedModelError("LoRA adapters with trained biases or modules_to_save are not supported")
    r = int(cfg["r"])
    alpha = float(cfg.get("lora_alpha", r))
    scale = alpha / (r**0.5) if cfg.get("use_rslora") else alpha / r
    tensors = _adapter_tensors(adapter_dir)
    merged = []
    for name, a in tensors.items():
        if ".lora_A." not in name:
            continue
        module = name.split(".lora_A.")[0]
        b = tensors.get(name.replace(".lora_A.", ".lora_B."))
        if b is None:
            raise ParameterError("adapter", str(adapter_dir), message=f"{name} has no lora_B partner")
        base = module.removeprefix("base_model.model.") + ".weight"
        if base not in weights:
            raise ParameterError("adapter", str(adapter_dir),
                                 message=f"the adapter adapts {base!r}, which the checkpoint does not have")
        w = weights[base]
        delta = b.float() @ a.float()
        if delta.shape != w.shape:
            raise ParameterError("adapter", str(adapter_dir),
                                 message=f"LoRA delta {tuple(delta.shape)} does not fit {base} {tuple(w.shape)}")
        weights[base] = (w.float() + scale * delta).to(w.dtype)
        merged.append(base)
    if not merged:
        raise ParameterError("adapter", str(adapter_dir), message=f"{adapter_dir} holds no LoRA weights")
    return merged

