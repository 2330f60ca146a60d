"""The adapter shipped for the embedded SmolLM2 (pasta_engine/adapters/smollm2-135m-pasta):
it loads by default, its manifest matches the base model file, and it forks on evaluation
prompts the model never trained on."""

from __future__ import annotations

import json

import pytest

from pasta_engine import Engine, SamplingParams
from pasta_engine.models.adapter import file_sha256, read_manifest, shipped_adapter
from pasta_engine.models.loader import embedded_gguf_path

# three prompts of AlpacaEval's vicuna subset (the evaluation split, never trained on)
EVAL_PROMPTS = [
    "How can I improve my time management skills?",
    "What are the most effective ways to deal with stress?",
    "What are the main differences between Python and JavaScript programming languages?",
]


@pytest.fixture(scope="module")
def adapter_dir(smollm2_dir):
    path = shipped_adapter()
    assert path is not None, "the package ships pasta_engine/adapters/smollm2-135m-pasta"
    return path


def test_the_shipped_adapter_is_small_and_names_its_base_model(adapter_dir):
    manifest = read_manifest(adapter_dir)
    assert manifest["base_model_sha256"] == file_sha256(embedded_gguf_path())
    assert (adapter_dir / "adapter_model.safetensors").stat().st_size <= 20 * 2**20
    assert "vicuna" in manifest["data"]["split"]  # "every dataset but vicuna"
    assert manifest["eval"]["prompts"] == 80 and manifest["stages"]
    assert json.loads((adapter_dir / "adapter_config.json").read_text())["r"] > 0


@pytest.mark.slow
def test_the_embedded_model_forks_on_evaluation_prompts_with_the_shipped_adapter(adapter_dir):
    engine = Engine.from_pretrained(None, kv_cache_bytes=256 * 2**20)
    assert engine.adapter == adapter_dir  # the default for the embedded model
    results = engine.generate(EVAL_PROMPTS, SamplingParams(max_new_tokens=160), mode="pasta")
    forked = [r for r in results if r.stats.threads > 1]
    assert forked, [r.annotated_text[:200] for r in results]
    assert all(r.stats.finish_reason in ("stop", "length") for r in results)

