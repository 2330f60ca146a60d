"""``lora_scale``: how much of an adapter's low-rank deltas the merge adds (issue 30's
speed-quality knob): exact sums on hand-built tensors, the token rows left as trained, the
manifest's default, the engine's and the CLI's refusals."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from pasta_engine import Engine
from pasta_engine.errors import CheckpointError, ParameterError
from pasta_engine.models.adapter import check_lora_scale, manifest_lora_scale, merge_lora


def _adapter_with_token_rows(tmp_path):
    """A rank-2 LoRA on one 4x3 weight (alpha 4: scale 2) plus two trainable token rows."""
    d = tmp_path / "adapter"
    d.mkdir()
    (d / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": 2, "lora_alpha": 4, "bias": "none", "target_modules": ["q_proj"],
        "trainable_token_indices": [5, 6]}))
    a = torch.arange(6, dtype=torch.float32).reshape(2, 3) / 10
    b = torch.arange(8, dtype=torch.float32).reshape(4, 2) / 10
    rows = torch.full((2, 3), 7.0)
    save_file({"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": a,
               "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight": b,
               "base_model.model.model.embed_tokens.token_adapter.trainable_tokens_delta": rows},
              str(d / "adapter_model.safetensors"))
    return d, a, b, rows


def _weights():
    return {"model.layers.0.self_attn.q_proj.weight": torch.ones(4, 3),
            "model.embed_tokens.weight": torch.zeros(5, 3)}


@pytest.mark.parametrize("s", [0.0, 0.5, 1.0])
def test_the_merge_adds_the_scaled_delta_and_the_token_rows_as_trained(tmp_path, s):
    d, a, b, rows = _adapter_with_token_rows(tmp_path)
    w = _weights()
    merge_lora(w, d, lora_scale=s)
    expected = torch.ones(4, 3) + s * 2.0 * (b @ a)
    torch.testing.assert_close(w["model.layers.0.self_attn.q_proj.weight"], expected, rtol=0, atol=1e-6)
    emb = w["model.embed_tokens.weight"]
    assert emb.shape == (7, 3)  # grown to hold rows 5 and 6
    torch.testing.assert_close(emb[5:], rows)  # whatever the scale
    torch.testing.assert_close(emb[:5], torch.zeros(5, 3))


def test_the_default_scale_is_the_adapter_as_trained(tmp_path):
    d, *_ = _adapter_with_token_rows(tmp_path)
    w1, w2 = _weights(), _weights()
    merge_lora(w1, d)
    merge_lora(w2, d, lora_scale=1.0)
    for k in w1:
        assert torch.equal(w1[k], w2[k])


@pytest.mark.parametrize("bad", [-0.1, 1.5, float("nan"), True, "0.5", None])
def test_a_scale_outside_zero_to_one_is_refused_naming_lora_scale(tmp_path, bad):
    d, *_ = _adapter_with_token_rows(tmp_path)
    w = _weights()
    with pytest.raises(ParameterError) as e:
        merge_lora(w, d, lora_scale=bad)
    assert e.value.param == "lora_scale" and "[0, 1]" in str(e.value)
    assert torch.equal(w["model.layers.0.self_attn.q_proj.weight"], torch.ones(4, 3))  # nothing merged


def test_the_manifest_sets_the_default_and_a_bad_one_names_the_adapter(tmp_path):
    assert manifest_lora_scale(None) == 1.0
    assert manifest_lora_scale({"lora_scale": 0.8}) == 0.8
    assert check_lora_scale(1) == 1.0
    with pytest.raises(CheckpointError, match="lora_scale=2"):
        manifest_lora_scale({"lora_scale": 2}, tmp_path / "ad")


def test_the_engine_merges_the_scale_it_is_given_or_the_manifests(tiny_llama, tmp_path):
    from sample_adapters import tiny_adapter

    d = tiny_adapter(tmp_path)
    base = Engine.from_pretrained(tiny_llama, adapter=None, kv_cache_bytes=2**20)
    full = Engine.from_pretrained(tiny_llama, adapter=d, kv_cache_bytes=2**20)
    half = Engine.from_pretrained(tiny_llama, adapter=d, lora_scale=0.5, kv_cache_bytes=2**20)
    assert (full.lora_scale, half.lora_scale) == (1.0, 0.5)
    wb, wf, wh = (_q(e) for e in (base, full, half))
    torch.testing.assert_close(wh, (wb + wf) / 2, rtol=0, atol=1e-5)  # linear in the scale
    assert not torch.allclose(wf, wb)
    (d / "manifest.json").write_text(json.dumps({"lora_scale": 0.25}))
    quarter = Engine.from_pretrained(tiny_llama, adapter=d, kv_cache_bytes=2**20)
    assert quarter.lora_scale == 0.25
    torch.testing.assert_close(_q(quarter), wb + (wf - wb) / 4, rtol=0, atol=1e-5)
    explicit = Engine.from_pretrained(tiny_llama, adapter=d, lora_scale=1.0, kv_cache_bytes=2**20)
    assert explicit.lora_scale == 1.0  # the caller's value wins over the manifest's


def _q(engine) -> torch.Tensor:
    """Layer 0's packed q/k/v projection weight (the tiny adapter adapts q_proj)."""
    return engine.model.weights.layers[0].qkv.detach().float().clone()


def test_the_engine_refuses_a_scale_without_an_adapter(tiny_llama):
    with pytest.raises(ParameterError) as e:
        Engine.from_pretrained(tiny_llama, adapter=None, lora_scale=0.5, kv_cache_bytes=2**20)
    assert e.value.param == "lora_scale" and "adapter" in str(e.value)
    with pytest.raises(ParameterError) as e:
        Engine.from_pretrained(tiny_llama, adapter=None, lora_scale=3.0, kv_cache_bytes=2**20)
    assert e.value.param == "lora_scale"


def test_the_cli_refuses_lora_scale_with_no_adapter(tiny_llama, capsys):
    from pasta_engine.entrypoints.cli import main

    rc = main(["generate", "hi", "--model", str(tiny_llama), "--no-adapter", "--lora-scale", "0.5",
               "--max-new-tokens", "2", "--kv-cache-mb", "1"])
    _, err = capsys.readouterr()
    assert rc == 2 and "--lora-scale" in err and "--no-adapter" in err


# ---- per-module rank and alpha (peft's rank_pattern and alpha_pattern)


def _adapter_two_modules(tmp_path, **cfg):
    """Rank-2 LoRA pairs on a q_proj and an mlp down_proj (4x3 each), config fields ``cfg`` added."""
    d = tmp_path / "adapter"
    d.mkdir()
    (d / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": 2, "lora_alpha": 4, "bias": "none", "target_modules": ["q_proj", "down_proj"], **cfg}))
    a = torch.arange(6, dtype=torch.float32).reshape(2, 3) / 10
    b = torch.arange(8, dtype=torch.float32).reshape(4, 2) / 10
    save_file({f"base_model.model.model.layers.0.{m}.lora_{x}.weight": t.clone()
               for m in ("self_attn.q_proj", "mlp.down_proj") for x, t in (("A", a), ("B", b))},
              str(d / "adapter_model.safetensors"))
    return d, b @ a


def _two_weights():
    return {"model.layers.0.self_attn.q_proj.weight": torch.ones(4, 3),
            "model.layers.0.mlp.down_proj.weight": torch.ones(4, 3)}


@pytest.mark.parametrize("s", [0.5, 1.0])
def test_alpha_pattern_sets_one_modules_scale_apart(tmp_path, s):
    # alpha 4 / r 2 = 2 everywhere, but the attention projections' alpha is 1: scale 0.5 there
    d, delta = _adapter_two_modules(tmp_path, alpha_pattern={r"self_attn\.[qkvo]_proj": 1})
    w = _two_weights()
    merge_lora(w, d, lora_scale=s)
    torch.testing.assert_close(w["model.layers.0.self_attn.q_proj.weight"], 1 + s * 0.5 * delta, rtol=0, atol=1e-6)
    torch.testing.assert_close(w["model.layers.0.mlp.down_proj.weight"], 1 + s * 2.0 * delta, rtol=0, atol=1e-6)


def test_a_pattern_matches_the_end_of_the_module_name_as_peft_does(tmp_path):
    # "proj" alone matches neither module's last part in full ("q_proj", "down_proj"): no override
    d, delta = _adapter_two_modules(tmp_path, alpha_pattern={"proj": 100})
    w = _two_weights()
    merge_lora(w, d)
    torch.testing.assert_close(w["model.layers.0.mlp.down_proj.weight"], 1 + 2.0 * delta, rtol=0, atol=1e-6)


def test_rank_pattern_must_agree_with_the_tensors(tmp_path):
    d, _ = _adapter_two_modules(tmp_path, rank_pattern={"down_proj": 4})
    with pytest.raises(CheckpointError, match=r"rank 2 but adapter_config.json gives model.layers.0.mlp.down_proj r=4"):
        merge_lora(_two_weights(), d)


@pytest.mark.parametrize("field, value, says", [
    ("alpha_pattern", {"q_proj": 0}, "not a positive number"),
    ("alpha_pattern", {"q_proj": "2"}, "not a positive number"),
    ("alpha_pattern", {"(": 2}, "not a regular expression"),
    ("alpha_pattern", ["q_proj"], "not an object"),
    ("rank_pattern", {"q_proj": 1.5}, "not a whole rank"),
])
def test_a_bad_pattern_is_refused_naming_the_field(tmp_path, field, value, says):
    d, _ = _adapter_two_modules(tmp_path, **{field: value})
    with pytest.raises(CheckpointError, match=f"{field}: .*{says}"):
        merge_lora(_two_weights(), d)


def test_the_merge_equals_peft_with_patterns(tiny_llama, tmp_path):
    """peft's own merge of an adapter with rank_pattern and alpha_pattern is ours."""
    peft = pytest.importorskip("peft", reason="needs peft (the test extra)")
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(tiny_llama, torch_dtype=torch.float32)
    base = {k: v.clone() for k, v in load_file(str(next(tiny_llama.glob("*.safetensors")))).items()}
    cfg = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"], init_lora_weights=False,
                          rank_pattern={"down_proj": 2}, alpha_pattern={r"self_attn\.v_proj": 3})
    pm = peft.get_peft_model(model, cfg)
    pm.save_pretrained(tmp_path / "adapter")
    merged = pm.merge_and_unload().state_dict()
    names = merge_lora(base, tmp_path / "adapter")
    assert any("down_proj" in n for n in names) and any("v_proj" in n for n in names)
    for n in names:
        torch.testing.assert_close(base[n], merged[n], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("extra, cfg, match", [
    ({"base_model.model.model.embed_tokens.lora_embedding_A": torch.ones(2, 5),
      "base_model.model.model.embed_tokens.lora_embedding_B": torch.ones(3, 2)}, {}, "lora_embedding_A is not supported"),
    ({"base_model.model.model.layers.0.self_attn.q_proj.lora_B.bias": torch.ones(4)}, {}, "is not supported"),
    ({}, {"lora_bias": True}, "lora_bias"),
    # KaSA's singular values, aLoRA's invocation, base-rewriting inits: each merged as plain LoRA
    # gave another model than peft's (up to 0.4 off in a weight of about 0.02), or one peft
    # itself cannot merge
    ({"base_model.model.model.layers.0.self_attn.q_proj.lora_diag": torch.ones(2)}, {}, "lora_diag is not supported"),
    ({}, {"kasa_config": {"beta": 1e-4}}, "kasa_config"),
    ({}, {"alora_invocation_tokens": [5, 6]}, "alora_invocation_tokens"),
    ({}, {"init_lora_weights": "pissa_niter_4"}, "rewrites the base weights"),
    ({}, {"init_lora_weights": "olora"}, "rewrites the base weights"),
])
def test_tensors_the_merge_has_no_rule_for_are_refused_not_dropped(tmp_path, extra, cfg, match):
    """peft's LoRA on an embedding and its LoRA biases were skipped without a word (the merged
    model then differed from peft's); they are refused."""
    from pasta_engine.errors import UnsupportedModelError

    d = tmp_path / "adapter"
    d.mkdir()
    (d / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 2, "lora_alpha": 4, "bias": "none",
                                                       "target_modules": ["q_proj"], **cfg}))
    save_file({"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": torch.ones(2, 3),
               "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight": torch.ones(4, 2), **extra},
              str(d / "adapter_model.safetensors"))
    with pytest.raises(UnsupportedModelError, match=match):
        merge_lora(_weights(), d)


def test_a_lora_on_a_tied_lm_head_is_refused(tmp_path):
    """With the head tied to the embedding, a merged copy of lm_head is dropped at load, and its
    delta with it: the merge refuses such an adapter (an untied head merges)."""
    from pasta_engine.errors import UnsupportedModelError

    d = tmp_path / "adapter"
    d.mkdir()
    (d / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 2, "lora_alpha": 4, "bias": "none",
                                                       "target_modules": ["lm_head"]}))
    save_file({"base_model.model.lm_head.lora_A.weight": torch.ones(2, 3),
               "base_model.model.lm_head.lora_B.weight": torch.ones(5, 2)}, str(d / "adapter_model.safetensors"))
    with pytest.raises(UnsupportedModelError, match="adapts lm_head, which the model ties"):
        merge_lora({**_weights(), "lm_head.weight": torch.zeros(5, 3)}, d, tied_head=True)
    w = {**_weights(), "lm_head.weight": torch.zeros(5, 3)}
    assert merge_lora(w, d) == ["lm_head.weight"] and w["lm_head.weight"].abs().sum() > 0


@pytest.mark.parametrize("key", ["embed_tokens", "model.embed_tokens"])
def test_trainable_token_indices_as_a_dict_matches_a_module_name_suffix_as_peft_does(tmp_path, key):
    d = tmp_path / "adapter"
    d.mkdir()
    (d / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 2, "lora_alpha": 4, "bias": "none",
                                                       "target_modules": ["q_proj"],
                                                       "trainable_token_indices": {key: [5]}}))
    save_file({"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": torch.ones(2, 3),
               "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight": torch.ones(4, 2),
               "base_model.model.model.embed_tokens.token_adapter.trainable_tokens_delta": torch.full((1, 3), 7.0)},
              str(d / "adapter_model.safetensors"))
    w = _weights()
    merge_lora(w, d)
    torch.testing.assert_close(w["model.embed_tokens.weight"][5], torch.full((3,), 7.0))
