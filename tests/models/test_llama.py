"""The model runner against transformers, for every supported architecture: logits per step,
greedy tokens, loading errors."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from pasta_engine import Engine, SamplingParams, UnsupportedModelError
from pasta_engine.models.loader import load_model

PROMPT = [1, 40, 41, 42, 43, 44, 45, 46, 47, 60, 61, 62, 63]
#: one tiny random checkpoint per supported architecture (tests/conftest.py)
CHECKPOINTS = ["tiny_llama", "tiny_qwen2", "tiny_mistral", "tiny_qwen3", "tiny_gemma", "tiny_gemma2", "tiny_phi3"]


def hf_greedy(path, prompt, n):
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    ids = torch.tensor([prompt])
    out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                      pad_token_id=hf.config.eos_token_id)
    return hf, out[0, len(prompt):].tolist()


@pytest.mark.parametrize("ckpt", CHECKPOINTS)
def test_sequential_greedy_equals_transformers_generate(ckpt, request):
    path = request.getfixturevalue(ckpt)
    engine = Engine.from_pretrained(path, kv_cache_bytes=8 * 2**20, page_size=4)
    [res] = engine.generate([PROMPT], SamplingParams(max_new_tokens=40), mode="sequential")
    _, ref = hf_greedy(path, PROMPT, 40)
    assert res.token_ids == ref
    assert res.stats.decode_steps == len(ref) == res.stats.critical_path


@pytest.mark.parametrize("ckpt", CHECKPOINTS)
def test_per_step_logits_match_transformers_forward(ckpt, request):
    path = request.getfixturevalue(ckpt)
    engine = Engine.from_pretrained(path, kv_cache_bytes=8 * 2**20, page_size=4)
    seen = []
    engine.logits_hook = lambda req, tid, row: seen.append(row.clone())
    [res] = engine.generate([PROMPT], SamplingParams(max_new_tokens=24, return_logprobs=True), mode="sequential")
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    full = torch.tensor([PROMPT + res.token_ids])
    with torch.no_grad():
        ref = hf(full).logits[0].float()
    n = len(res.token_ids)
    want = ref[len(PROMPT) - 1 : len(PROMPT) - 1 + n]
    got = torch.stack(seen)
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    lp = torch.log_softmax(want, -1).gather(1, torch.tensor(res.token_ids)[:, None]).squeeze(1)
    torch.testing.assert_close(torch.tensor(res.logprobs), lp, rtol=1e-4, atol=1e-4)


@pytest.mark.slow
def test_smollm2_sequential_equals_transformers_for_32_tokens(smollm2_dir):
    engine = Engine.from_pretrained(None, adapter=None)  # the base weights, as transformers loads them
    prompt = engine.format_prompt("Name three colors of the rainbow.", mode="sequential")
    [res] = engine.generate([prompt], SamplingParams(max_new_tokens=32), mode="sequential")
    _, ref = hf_greedy(smollm2_dir, prompt, 32)
    assert res.token_ids == ref
    assert res.text.strip()


def test_reduced_precision_runs_on_cpu(tiny_llama):
    for dtype in (torch.bfloat16, torch.float16):
        engine = Engine.from_pretrained(tiny_llama, dtype=dtype, kv_cache_bytes=4 * 2**20)
        [res] = engine.generate([PROMPT], SamplingParams(max_new_tokens=8), mode="sequential")
        assert engine.model_runner.kv_cache.dtype == dtype
        assert len(res.token_ids) == res.stats.tokens_decoded


def test_unsupported_architecture_is_named(tmp_path, tiny_llama):
    cfg = json.loads((tiny_llama / "config.json").read_text())
    cfg["model_type"] = "gpt2"
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedModelError, match="'gpt2'"):
        load_model(tmp_path)


def test_bad_model_path_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="nowhere"):
        load_model(tmp_path / "nowhere")
