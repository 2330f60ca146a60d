"""The architecture options beyond Llama (Mistral, Qwen3, Gemma, Gemma 2, Phi-3) on tiny random
checkpoints: each option changes the logits (so the parity tests against transformers in
test_llama.py check it), active sliding windows in pasta mode equal a dense forward with the
PASTA mask and the window, the Triton backend under the interpreter equals transformers and the
torch reference, LongRoPE past the original context equals transformers' generate, and options
the forward does not implement are refused by name."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from pasta_engine import Engine, SamplingParams, UnsupportedModelError
from pasta_engine.layers.rotary import rotary_embedding
from pasta_engine.layers.triton_attention import TritonAttention
from pasta_engine.models.config import ModelConfig
from pasta_engine.models.loader import build_model, load_model
from pasta_engine.models.protocol import CausalLM

PROMPT = [1, 40, 41, 42, 43, 44, 45, 46, 47, 60, 61, 62, 63]
from sample_traces import ANNOTATED  # noqa: E402  (tests/sample_traces.py)


def engine_model(path, **changes) -> tuple[CausalLM, object]:
    """The engine's model of a checkpoint with some :class:`ModelConfig` fields changed, and the
    tokenizer."""
    hf_cfg = AutoConfig.from_pretrained(path)
    cfg = dataclasses.replace(ModelConfig.from_hf(hf_cfg), **changes)
    weights = dict(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).state_dict())
    rotary = rotary_embedding(hf_cfg, cfg.head_dim, "cpu", torch.float32)
    _, tok, _ = load_model(path)
    return build_model(cfg, weights, rotary, "cpu", torch.float32), tok


def step_logits(model, tokenizer, n=12, **options) -> torch.Tensor:
    """Sampled rows' logits ``[steps, vocab]`` of a sequential greedy generation."""
    engine = Engine(model, tokenizer, kv_cache_bytes=8 * 2**20, page_size=4, **options)
    seen = []
    engine.logits_hook = lambda req, tid, row: seen.append(row.clone())
    engine.generate([PROMPT], SamplingParams(max_new_tokens=n), mode="sequential")
    return torch.stack(seen)


@pytest.mark.parametrize("ckpt,changes", [
    ("tiny_gemma2", {"attn_logit_softcap": None}),
    ("tiny_gemma2", {"final_logit_softcap": None}),
    ("tiny_gemma2", {"sliding_windows": (None, None)}),
    ("tiny_gemma2", {"attention_scale": 16**-0.5}),
    ("tiny_gemma2", {"sandwich_norms": False}),
    ("tiny_gemma", {"norm_unit_offset": False}),
    ("tiny_gemma", {"scale_embeddings": False}),
    ("tiny_gemma", {"hidden_act": "silu"}),
    ("tiny_qwen3", {"qk_norm": False}),
    ("tiny_mistral", {"sliding_windows": (None, None)}),
])
def test_every_option_changes_the_logits(ckpt, changes, request):
    """Without the option the model is another model: the parity tests would notice a missing one."""
    path = request.getfixturevalue(ckpt)
    base = step_logits(*engine_model(path), n=6)
    other = step_logits(*engine_model(path, **changes), n=6)
    assert (base[:1] - other[:1]).abs().max() > 1e-3


@pytest.mark.parametrize("ckpt", ["tiny_mistral", "tiny_gemma2"])
def test_pasta_replay_with_an_active_window_equals_a_dense_forward(ckpt, request):
    """Windows are counted in logical positions: the dense reference is the engine's PASTA layout
    (pasta_engine.train) masked to keys at positions > q - window on the windowed layers."""
    from pasta_engine.train.forward import layout_for

    path = request.getfixturevalue(ckpt)
    engine = Engine.from_pretrained(path, kv_cache_bytes=16 * 2**20, page_size=4)
    window = max(w for w in engine.model.config.sliding_windows if w)
    [res] = engine.replay(["Give me sleep tips."], [ANNOTATED], params=SamplingParams(return_logprobs=True))
    assert res.stats.forks == 3
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    layout = layout_for(hf, engine.tokenizer, "Give me sleep tips.", ANNOTATED)
    assert layout.token_ids == res.token_ids
    pos = torch.tensor(layout.position_ids)
    full = layout.mask()
    windowed = full & (pos[None, :] > pos[:, None] - window)
    assert (windowed != full).any(), "the window never bites: the test would prove nothing"

    def additive(m):
        return torch.zeros(m.shape).masked_fill(~m, float("-inf"))[None, None]

    masks = {"full_attention": additive(full), "sliding_attention": additive(windowed)}
    with torch.no_grad():
        out = hf(torch.tensor([layout.input_ids]), position_ids=pos[None],
                 attention_mask=masks if ckpt == "tiny_gemma2" else masks["sliding_attention"])
    qs, toks = layout.sampled()
    want = torch.log_softmax(out.logits[0, qs].float(), -1).gather(1, torch.tensor(toks)[:, None]).squeeze(1)
    got = torch.tensor([lp for lp, q in zip(res.logprobs, layout.target_index) if q is not None])
    torch.testing.assert_close(got, want, rtol=2e-4, atol=2e-4)


@pytest.mark.parametrize("ckpt", ["tiny_gemma", "tiny_gemma2", "tiny_mistral"])
def test_triton_backend_equals_transformers_and_the_torch_reference(ckpt, request):
    """Multi-head attention (Gemma), windows and soft-caps (Gemma 2, Mistral) in the Triton
    kernels, under the interpreter (float32)."""
    path = request.getfixturevalue(ckpt)
    engine = Engine.from_pretrained(path, kv_cache_bytes=8 * 2**20, page_size=4, attention_backend="triton")
    seen = []
    engine.logits_hook = lambda req, tid, row: seen.append(row.clone())
    [res] = engine.generate([PROMPT], SamplingParams(max_new_tokens=12), mode="sequential")
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    ids = torch.tensor([PROMPT])
    ref = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False,
                      pad_token_id=hf.config.eos_token_id)[0, len(PROMPT):].tolist()
    assert res.token_ids == ref
    torch.testing.assert_close(torch.stack(seen), step_logits(*load_model(path)[:2], n=12), rtol=1e-4, atol=1e-4)


def test_triton_pasta_replay_with_windows_and_softcaps_equals_the_torch_reference(tiny_gemma2):
    """Forked threads share pages: the tree kernel masks each row's window by its own position."""
    annotated = ('Two: <promise topic="a" tokens="10"/><async>Sleep.</async> '
                 '<promise topic="b" tokens="10"/><async>Walk.</async><sync/> Done.')

    def replay_logits(backend):
        engine = Engine.from_pretrained(tiny_gemma2, kv_cache_bytes=16 * 2**20, page_size=4,
                                        attention_backend=TritonAttention(decode_mode="tree") if backend == "triton"
                                        else backend)
        rows = []
        engine.logits_hook = lambda req, tid, row: rows.append((tid, row.clone()))
        [res] = engine.replay([PROMPT], [annotated])
        return res, rows

    res_t, rows_t = replay_logits("torch")
    res_k, rows_k = replay_logits("triton")
    assert res_k.token_ids == res_t.token_ids and res_k.stats.forks == 2
    assert [t for t, _ in rows_k] == [t for t, _ in rows_t]
    torch.testing.assert_close(torch.stack([r for _, r in rows_k]), torch.stack([r for _, r in rows_t]),
                               rtol=1e-4, atol=1e-4)


def test_longrope_past_the_original_context_equals_transformers_generate(tmp_path):
    """Phi-3's LongRoPE: decode steps past original_max_position_embeddings use the long factors
    (per token, as transformers' generate does once its forward's positions pass it)."""
    from pasta_engine.tools.presets import build_checkpoint

    path = build_checkpoint("tiny-phi3", tmp_path / "phi3", overrides={"original_max_position_embeddings": 20})
    engine = Engine.from_pretrained(path, kv_cache_bytes=8 * 2**20, page_size=4)
    assert engine.model.rotary.long_from == 20
    [res] = engine.generate([PROMPT], SamplingParams(max_new_tokens=24), mode="sequential")
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    ids = torch.tensor([PROMPT])
    ref = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=24, do_sample=False,
                      pad_token_id=hf.config.eos_token_id)[0, len(PROMPT):].tolist()
    assert res.token_ids == ref


@pytest.mark.parametrize("field,value,named", [
    ("partial_rotary_factor", 0.5, "partial_rotary_factor"),
    ("hidden_act", "relu", "hidden_act='relu'"),
    ("use_bidirectional_attention", True, "use_bidirectional_attention"),
    ("layer_types", ["chunked_attention", "full_attention"], "chunked_attention"),
])
def test_unimplemented_options_are_named(tmp_path, tiny_qwen3, field, value, named):
    cfg = json.loads((tiny_qwen3 / "config.json").read_text())
    cfg[field] = value
    if field == "partial_rotary_factor":
        cfg.setdefault("rope_parameters", {})["partial_rotary_factor"] = value
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedModelError, match=named.replace("[", r"\[")):
        load_model(tmp_path)


def test_windows_follow_each_architectures_layers(tiny_gemma2, tiny_mistral, tiny_qwen3):
    def windows(path, **fields):
        cfg = AutoConfig.from_pretrained(path)
        for k, v in fields.items():
            setattr(cfg, k, v)
        return ModelConfig.from_hf(cfg).sliding_windows

    assert windows(tiny_gemma2) == (8, None)  # Gemma 2 alternates, sliding first
    assert windows(tiny_mistral) == (8, 8)  # every layer
    assert windows(tiny_mistral, sliding_window=4096) == (None, None)  # never bites below 4096 positions
    assert windows(tiny_qwen3) == (None, None)  # use_sliding_window off
    assert windows(tiny_qwen3, sliding_window=8, layer_types=["full_attention", "sliding_attention"]) == (None, 8)


@pytest.mark.gpu
@pytest.mark.parametrize("ckpt", ["tiny_gemma", "tiny_gemma2", "tiny_mistral"])
def test_triton_eager_and_cuda_graphs_match_the_torch_reference_on_cuda(ckpt, request):
    """Group 1, windows and soft-caps in captured decode steps (bfloat16; run with -m gpu)."""
    path = request.getfixturevalue(ckpt)

    def replay(**kw):
        engine = Engine.from_pretrained(path, device="cuda", dtype=torch.bfloat16, kv_cache_bytes=64 * 2**20, **kw)
        [r] = engine.replay([PROMPT * 3], [ANNOTATED], params=SamplingParams(return_logprobs=True))
        return engine, r

    _, ref = replay(attention_backend="torch")
    _, eager = replay(attention_backend="triton", cuda_graphs=False)
    engine, graphed = replay(attention_backend="triton", cuda_graphs=True)
    assert engine.model_runner.cuda_graphs.replays > 0
    for got in (eager, graphed):
        assert got.token_ids == ref.token_ids
        assert max(abs(a - b) for a, b in zip(ref.logprobs, got.logprobs) if a is not None) < 0.05
