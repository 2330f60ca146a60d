"""The training forward equals the engine's replay; the losses; LoRA SFT lowers the loss; the
adapter merge equals peft's own forward; the shipped adapter."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from pasta_engine import Engine, SamplingParams
from pasta_engine.lang.prompts import LEARNED_PASTA_PROMPT
from pasta_engine.train import pasta_logprobs
from pasta_engine.train.losses import bonbon_loss, bonbon_target_margin, sft_loss

from sample_traces import SLEEP_PROMPT as PROMPT  # noqa: E402  (tests/sample_traces.py)
from sample_traces import SLEEP_TIPS as ANNOTATED  # noqa: E402


@pytest.mark.parametrize("policy", ["predicted", "constant:7", "none"])
@pytest.mark.parametrize("ckpt", ["tiny_llama", "tiny_qwen2"])
def test_pasta_logprobs_equal_the_engines_replay(ckpt, policy, request):
    path = request.getfixturevalue(ckpt)
    engine = Engine.from_pretrained(path, kv_cache_bytes=16 * 2**20, page_size=4, position_policy=policy)
    [res] = engine.replay([PROMPT], [ANNOTATED], params=SamplingParams(return_logprobs=True))
    assert res.stats.forks == 3
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    ids, lps = pasta_logprobs(hf, engine.tokenizer, PROMPT, ANNOTATED, policy)
    assert ids == res.token_ids
    assert [x is None for x in lps] == [x is None for x in res.logprobs]
    got = torch.tensor([x for x in lps if x is not None])
    want = torch.tensor([x for x in res.logprobs if x is not None])
    torch.testing.assert_close(got, want, rtol=0, atol=1e-4)
    # the visibility really matters: a plain causal forward over the same tokens disagrees
    with torch.no_grad():
        full = torch.tensor([res.prompt_ids + res.token_ids[:-1]])
        causal = torch.log_softmax(hf(full).logits[0].float(), -1)
    p = len(res.prompt_ids)
    plain = torch.tensor([causal[p - 1 + i, t].item() for i, (t, x) in enumerate(zip(res.token_ids, lps)) if x is not None])
    assert (plain - want).abs().max() > 1e-2


def test_pasta_logprobs_follow_the_engines_prompt(tiny_llama):
    engine = Engine.from_pretrained(tiny_llama, kv_cache_bytes=8 * 2**20, pasta_prompt=LEARNED_PASTA_PROMPT)
    [res] = engine.replay([PROMPT], [ANNOTATED], params=SamplingParams(return_logprobs=True))
    hf = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32)
    _, lps = pasta_logprobs(hf, engine.tokenizer, PROMPT, ANNOTATED, pasta_prompt=LEARNED_PASTA_PROMPT)
    diffs = [abs(a - b) for a, b in zip(lps, res.logprobs) if a is not None]
    assert max(diffs) < 1e-4


def test_losses_match_hand_computed_values():
    lp = torch.tensor([-1.0, -2.0, -3.0])
    assert float(sft_loss(lp)) == pytest.approx(2.0)
    # weighted: (1*1 + 3*2 + 1*3) / 5 = 2.0; (2*1 + 1*2 + 1*3) / 4 = 1.75
    assert float(sft_loss(lp, torch.tensor([1.0, 3.0, 1.0]))) == pytest.approx(2.0)
    assert float(sft_loss(lp, torch.tensor([2.0, 1.0, 1.0]))) == pytest.approx(1.75)
    with pytest.raises(ValueError, match="shape"):
        sft_loss(lp, torch.tensor([1.0, 1.0]))
    assert bonbon_target_margin(2) == pytest.approx(1.0)
    assert bonbon_target_margin(4) == pytest.approx(3 * (1 + 1 / 2 + 1 / 3))
    best, worst = torch.tensor([-1.0, -1.0]), torch.tensor([-2.0, -4.0])
    ref_best, ref_worst = torch.tensor([-1.5, -1.5]), torch.tensor([-2.0, -2.0])
    # margin = (-2 - -3) - (-6 - -4) = 1 + 2 = 3; target(n=4) = 5.5; ipo = 6.25; sft = 1.0
    loss, parts = bonbon_loss(best, worst, ref_best, ref_worst, n=4, alpha=0.2)
    assert parts["margin"] == pytest.approx(3.0)
    assert parts["ipo"] == pytest.approx(6.25)
    assert float(loss) == pytest.approx(0.2 * 1.0 + 0.8 * 6.25)
    with pytest.raises(ValueError, match="n >= 2"):
        bonbon_target_margin(1)
    with pytest.raises(ValueError, match="alpha"):
        bonbon_loss(best, worst, ref_best, ref_worst, n=4, alpha=1.5)


def test_a_few_sft_steps_lower_the_loss_and_the_adapter_merges_exactly(tiny_llama, tmp_path):
    from pasta_engine.train.common import LoraSettings
    from pasta_engine.train.data import TrainExample
    from pasta_engine.train.sft import SFTSettings, train_sft

    ex = [TrainExample(PROMPT, ANNOTATED, "koala", "sot", 3, 40)] * 4
    settings = SFTSettings(epochs=4, lr=2e-2, grad_accum=2, warmup=1, save_every=3,
                           lora=LoraSettings(r=8, alpha=16, dropout=0.0))
    summary = train_sft(ex, tmp_path / "run", settings, base=str(tiny_llama), progress=False)
    curve = json.loads((tmp_path / "run" / "loss.json").read_text())
    assert len(curve) == summary["optimizer_steps"] == 8
    # a random-weight model's tiny output layer leaves little to learn; the loss still drops
    first, last = [sum(p["loss"] for p in ps) / 2 for ps in (curve[:2], curve[-2:])]
    assert last < first - 0.1
    assert (tmp_path / "run" / "loss.png").read_bytes().startswith(b"\x89PNG")
    adapter = tmp_path / "run" / "adapter"
    manifest = json.loads((adapter / "manifest.json").read_text())
    assert manifest["pasta_prompt"] == LEARNED_PASTA_PROMPT.to_dict() and manifest["adapter_bytes"] > 0

    # the engine's merged weights give the logits of peft's own (unmerged) forward
    from peft import PeftModel

    base = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32)
    peft = PeftModel.from_pretrained(base, str(adapter)).eval()
    engine = Engine.from_pretrained(tiny_llama, adapter=adapter, kv_cache_bytes=8 * 2**20)
    assert engine.config.pasta_prompt == LEARNED_PASTA_PROMPT  # from the manifest
    seen = []
    engine.logits_hook = lambda req, tid, row: seen.append(row.clone())
    prompt = [5, 6, 7, 8, 9]
    [res] = engine.generate([prompt], SamplingParams(max_new_tokens=6), mode="sequential")
    with torch.no_grad():
        want = peft(torch.tensor([prompt + res.token_ids[:-1]])).logits[0, len(prompt) - 1:].float()
    torch.testing.assert_close(torch.stack(seen), want[: len(seen)], rtol=1e-4, atol=1e-4)
    plain = Engine.from_pretrained(tiny_llama, adapter=None, kv_cache_bytes=8 * 2**20)
    seen2 = []
    plain.logits_hook = lambda req, tid, row: seen2.append(row.clone())
    plain.generate([prompt], SamplingParams(max_new_tokens=1), mode="sequential")
    assert not torch.allclose(seen2[0], seen[0])  # the adapter changed the model

    # resuming from the checkpoint continues, not restarts
    more = SFTSettings(**{**settings.__dict__, "epochs": 5})
    again = train_sft(ex, tmp_path / "run", more, base=str(tiny_llama), resume=True, progress=False)
    assert again["optimizer_steps"] == 10 and len(json.loads((tmp_path / "run" / "loss.json").read_text())) == 10
    # ... but not under other examples or step-shaping settings: its steps would be another order's
    # (examples trained twice or never)
    from pasta_engine.errors import ParameterError

    for other_ex, other in [(ex[:-1], more), (ex, SFTSettings(**{**more.__dict__, "grad_accum": 1})),
                            (ex, SFTSettings(**{**more.__dict__, "lr": 1.0}))]:
        with pytest.raises(ParameterError, match="other training inputs"):
            train_sft(other_ex, tmp_path / "run", SFTSettings(**{**other.__dict__, "epochs": 6}), base=str(tiny_llama),
                      resume=True, progress=False)
    # a checkpoint from before the fingerprint resumes as it did
    ck = tmp_path / "run" / "checkpoint" / "trainer.pt"
    blob = torch.load(ck, weights_only=True)
    assert blob["state"].pop("fingerprint")["settings"]["grad_accum"] == settings.grad_accum
    torch.save(blob, ck)
    old = train_sft(ex, tmp_path / "run", SFTSettings(**{**more.__dict__, "epochs": 6}), base=str(tiny_llama),
                    resume=True, progress=False)
    assert old["optimizer_steps"] == 12


@pytest.mark.parametrize("written", [True, False], ids=["after-the-checkpoint", "before-the-checkpoint"])
def test_a_run_killed_at_a_checkpoint_resumes_with_every_point_of_its_curve(tiny_llama, tmp_path, monkeypatch,
                                                                            written):
    """A run killed at its second checkpoint, once that checkpoint is written (``written``) or
    before it is, resumes with loss.json holding each optimizer step exactly once, in order (the
    checkpoint was written before the curve: a kill between them lost the steps since the
    previous checkpoint from the curve)."""
    from pasta_engine.train import sft as sftmod
    from pasta_engine.train.common import LoraSettings
    from pasta_engine.train.data import TrainExample

    real = sftmod.save_checkpoint
    calls = []

    def killed(*a, **k):
        calls.append(1)
        if len(calls) == 2:
            if written:
                real(*a, **k)
            raise KeyboardInterrupt
        real(*a, **k)

    monkeypatch.setattr(sftmod, "save_checkpoint", killed)
    ex = [TrainExample(PROMPT, ANNOTATED, "koala", "sot", 3, 40)] * 2
    settings = sftmod.SFTSettings(epochs=6, lr=1e-2, grad_accum=1, warmup=1, save_every=2,
                                  lora=LoraSettings(r=2, alpha=4, dropout=0.0))
    with pytest.raises(KeyboardInterrupt):
        sftmod.train_sft(ex, tmp_path / "run", settings, base=str(tiny_llama), progress=False)
    summary = sftmod.train_sft(ex, tmp_path / "run", settings, base=str(tiny_llama), resume=True, progress=False)
    curve = json.loads((tmp_path / "run" / "loss.json").read_text())
    assert summary["optimizer_steps"] == 12 and [p["step"] for p in curve] == list(range(1, 13))


def test_a_resume_from_another_base_model_is_refused_before_the_weights_load(tiny_llama, tiny_qwen2, tmp_path,
                                                                               monkeypatch):
    """``train sft --resume --model OTHER`` trained the later steps on other weights (exit 0,
    a loss curve jumping from 5.8 to 9.6) or, for another shape, died in peft with a size
    mismatch traceback: the checkpoint's fingerprint now names the base model, and a resume
    from another is refused naming it, before any weights load."""
    import shutil

    from pasta_engine.errors import ParameterError
    from pasta_engine.train import sft as sftmod
    from pasta_engine.train.common import LoraSettings
    from pasta_engine.train.data import TrainExample

    ex = [TrainExample(PROMPT, ANNOTATED, "koala", "sot", 3, 40)] * 2
    settings = sftmod.SFTSettings(epochs=1, grad_accum=1, save_every=1, max_steps=1,
                                  lora=LoraSettings(r=2, alpha=4, dropout=0.0))
    sftmod.train_sft(ex, tmp_path / "run", settings, base=str(tiny_llama), progress=False)
    copy = tmp_path / "copy"
    shutil.copytree(tiny_llama, copy)
    longer = sftmod.SFTSettings(**{**settings.__dict__, "max_steps": 2})

    def no_load(*a, **k):
        raise AssertionError("the weights loaded before the refusal")

    with monkeypatch.context() as m:
        m.setattr(sftmod, "load_base", no_load)
        for other in (copy, tiny_qwen2):
            with pytest.raises(ParameterError, match="the base model --model") as e:
                sftmod.train_sft(ex, tmp_path / "run", longer, base=str(other), resume=True, progress=False)
            assert e.value.param == "--resume" and str(Path(other).resolve()) in str(e.value)
    summary = sftmod.train_sft(ex, tmp_path / "run", longer, base=str(tiny_llama), resume=True, progress=False)
    assert summary["optimizer_steps"] == 2  # the same model still resumes


def test_a_longer_resumed_run_takes_the_stretched_schedules_rate_at_once(tiny_llama, tmp_path):
    """A resume with more steps stretches the schedule, but its first step ran at the old
    schedule's last rate (the optimizer state brought it back): every step now logs the rate of
    the schedule it runs under."""
    from pasta_engine.train import sft as sftmod
    from pasta_engine.train.common import LoraSettings, lr_lambda
    from pasta_engine.train.data import TrainExample

    ex = [TrainExample(PROMPT, ANNOTATED, "koala", "sot", 3, 40)] * 4
    short = sftmod.SFTSettings(epochs=1, lr=1e-3, grad_accum=1, warmup=0, save_every=1, max_steps=2,
                               lora=LoraSettings(r=2, alpha=4, dropout=0.0))
    sftmod.train_sft(ex, tmp_path / "run", short, base=str(tiny_llama), progress=False)
    longer = sftmod.SFTSettings(**{**short.__dict__, "max_steps": 4})
    sftmod.train_sft(ex, tmp_path / "run", longer, base=str(tiny_llama), resume=True, progress=False)
    curve = json.loads((tmp_path / "run" / "loss.json").read_text())
    assert [p["step"] for p in curve] == [1, 2, 3, 4]
    assert [p["lr"] for p in curve[2:]] == pytest.approx([1e-3 * lr_lambda(s, 0, 4) for s in (2, 3)])


def test_an_optimizer_step_stays_in_one_epoch_and_logs_its_own_lr(tiny_llama, tmp_path, monkeypatch):
    """7 examples, 4 per step, 3 epochs: 3 steps of 4 different examples, one epoch's shuffle
    each (the epochs ran together: a step held one example twice and the third epoch was never
    used); loss.json's learning rate is the one the step used, not the next step's."""
    import random

    from pasta_engine.train import sft as sftmod
    from pasta_engine.train.common import LoraSettings, lr_lambda
    from pasta_engine.train.data import TrainExample

    seen: list[int] = []
    real = sftmod.layout_for

    def spy(model, tok, prompt, *a, **k):
        seen.append(int(prompt.split()[-1].rstrip(".")))
        return real(model, tok, prompt, *a, **k)

    monkeypatch.setattr(sftmod, "layout_for", spy)
    ex = [TrainExample(f"Give me tips {i}.", ANNOTATED, "m", "s", 3, 40) for i in range(7)]
    settings = sftmod.SFTSettings(epochs=3, grad_accum=4, warmup=2, lr=1e-2, seed=0,
                                  lora=LoraSettings(r=2, alpha=4, dropout=0.0))
    summary = sftmod.train_sft(ex, tmp_path / "run", settings, base=str(tiny_llama), progress=False)
    assert summary["optimizer_steps"] == 3
    steps = [seen[i : i + 4] for i in range(0, 12, 4)]
    for e, step in enumerate(steps):
        order = list(range(7))
        random.Random(settings.seed * 1000 + e).shuffle(order)
        assert step == order[:4]  # epoch e's first four, four different examples
    curve = json.loads((tmp_path / "run" / "loss.json").read_text())
    assert [p["lr"] for p in curve] == pytest.approx([1e-2 * lr_lambda(s, 2, 3) for s in range(3)])


def test_sft_continues_an_adapter_with_the_tag_decisions_weighted(tiny_llama, tmp_path):
    from transformers import AutoTokenizer

    from pasta_engine.lang.tokenization import encode_tag
    from pasta_engine.train.common import LoraSettings
    from pasta_engine.train.data import TrainExample
    from pasta_engine.train.losses import tag_decision_ids, tag_decision_weights
    from pasta_engine.train.sft import SFTSettings, train_sft

    tok = AutoTokenizer.from_pretrained(tiny_llama)
    ids = tag_decision_ids(tok)
    assert encode_tag(tok, "<sync/>")[0] in ids and encode_tag(tok, '<promise topic="x" tokens="5"/>')[0] in ids
    assert encode_tag(tok, "</async>")[0] not in ids or encode_tag(tok, "</async>")[0] == encode_tag(tok, "<sync/>")[0]
    w = tag_decision_weights([encode_tag(tok, "<sync/>")[0], -1], ids, 4.0)
    assert w.tolist() == [4.0, 1.0]
    with pytest.raises(ValueError, match="tag weight"):
        tag_decision_weights([1], ids, 0.0)

    ex = [TrainExample(PROMPT, ANNOTATED, "koala", "sot", 3, 40)] * 2
    lora = LoraSettings(r=8, alpha=16, dropout=0.0)
    first = SFTSettings(epochs=1, lr=2e-2, grad_accum=2, warmup=1, lora=lora)
    train_sft(ex, tmp_path / "a", first, base=str(tiny_llama), progress=False)
    second = SFTSettings(epochs=2, lr=2e-2, grad_accum=2, warmup=1, lora=lora, tag_weight=5.0,
                         init_adapter=str(tmp_path / "a" / "adapter"))
    train_sft(ex, tmp_path / "b", second, base=str(tiny_llama), progress=False)
    stages = json.loads((tmp_path / "b" / "adapter" / "manifest.json").read_text())["stages"]
    assert [s["optimizer_steps"] for s in stages] == [1, 2]
    assert stages[1]["settings"]["tag_weight"] == 5.0

    def logits(adapter):
        engine = Engine.from_pretrained(tiny_llama, adapter=adapter, kv_cache_bytes=8 * 2**20)
        seen = []
        engine.logits_hook = lambda req, tid, row: seen.append(row.clone())
        engine.generate([[5, 6, 7]], SamplingParams(max_new_tokens=1), mode="sequential")
        return seen[0]

    # the second stage started from the first adapter and moved on from it
    assert not torch.allclose(logits(tmp_path / "a" / "adapter"), logits(tmp_path / "b" / "adapter"))


def test_adapter_errors_are_named(tiny_llama, tmp_path):
    from pasta_engine import ParameterError

    with pytest.raises(ParameterError, match="not a LoRA adapter folder"):
        Engine.from_pretrained(tiny_llama, adapter=tmp_path)
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 2, "lora_alpha": 2}))
    from safetensors.torch import save_file

    save_file({"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": torch.zeros(2, 3),
               "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight": torch.zeros(5, 2)},
              bad / "adapter_model.safetensors")
    with pytest.raises(ParameterError, match="does not fit"):
        Engine.from_pretrained(tiny_llama, adapter=bad)


def test_data_split_never_trains_on_vicuna():
    from pasta_engine.tools.traces import PromptRow
    from pasta_engine.train.data import build_examples, cut_response, split_rows

    rows = [PromptRow("q1", "1. a thing to do every morning\n2. another thing to do at night", "koala"),
            PromptRow("q2", "an answer", "vicuna")]
    assert [r.instruction for r in split_rows(rows, "train")] == ["q1"]
    assert [r.instruction for r in split_rows(rows, "eval")] == ["q2"]
    count = lambda t: len(t.split())  # noqa: E731
    text = "line one is here\n```\ncode\nmore code\n```\nline three"
    assert cut_response(text, count, 100) == text
    assert cut_response(text, count, 5) == "line one is here"  # never inside the fence
    assert cut_response("one two three", count, 2) is None
    ex, counts = build_examples(split_rows(rows, "train"), count, annotator="sot")
    assert counts["kept"] == 1 and math.isclose(ex[0].response_tokens, count(rows[0].output))


def test_plain_answers_and_long_ones_left_out():
    """--annotator none keeps an answer as it is (no tag even where sot would fork a list);
    --drop-long leaves out an answer over the budget instead of training its cut."""
    from pasta_engine.tools.traces import PromptRow
    from pasta_engine.train.data import build_examples

    count = lambda t: len(t.split())  # noqa: E731
    listed = ("Two things:\n1. a thing to do every single morning before the sun comes up over the hills\n"
              "2. another thing to do every night after the dishes are washed and put away")
    long = "first line of a long answer\nsecond line of that long answer\n" + "third line of it " * 10
    rows = [PromptRow("q1", listed, "koala"), PromptRow("q2", long, "koala")]
    forked, _ = build_examples(rows[:1], count, annotator="sot")
    assert forked[0].promises >= 1  # the same answer, forked by sot
    plain, counts = build_examples(rows, count, max_response_tokens=40, annotator="none")
    by = {e.prompt: e for e in plain}
    assert by["q1"].annotated == listed and by["q1"].promises == 0 and by["q1"].annotator == "none"
    assert by["q2"].annotated == "first line of a long answer\nsecond line of that long answer"  # cut
    assert not by["q2"].ended and counts["too_long"] == 0
    kept, counts = build_examples(rows, count, max_response_tokens=40, annotator="none", drop_long=True)
    assert [e.prompt for e in kept] == ["q1"] and counts["too_long"] == 1 and counts["kept"] == 1


def test_best_and_worst_pairs():
    from pasta_engine.train.bonbon import best_and_worst

    rows = [
        {"prompt_index": 0, "sample": 0, "annotated": "a", "finish_reason": "stop", "score": 2.0},
        {"prompt_index": 0, "sample": 1, "annotated": "b", "finish_reason": "length", "score": 9.0},  # cut: not best
        {"prompt_index": 0, "sample": 2, "annotated": "c", "finish_reason": "stop", "score": 1.0},
        {"prompt_index": 1, "sample": 0, "annotated": "d", "finish_reason": "length", "score": 1.0},  # none ended
        {"prompt_index": 2, "sample": 0, "annotated": "e", "finish_reason": "stop", "score": 1.0},
        {"prompt_index": 2, "sample": 1, "annotated": "e", "finish_reason": "stop", "score": 1.0},  # a tie
    ]
    pairs = best_and_worst(rows)
    assert [(b["annotated"], w["annotated"]) for b, w in pairs] == [("a", "c")]
    assert [(b["annotated"], w["annotated"]) for b, w in best_and_worst(rows, best_must_finish=False)][0] == ("b", "c")


def test_a_bonbon_round_on_a_tiny_model(tiny_llama, tmp_path):
    """Sample with the engine, rank with a pluggable scorer, train on best vs worst: the round
    writes its samples, pairs, loss curve and an adapter the engine loads."""
    from pasta_engine.train.bonbon import BonbonSettings, train_bonbon
    from pasta_engine.train.common import LoraSettings
    from pasta_engine.train.data import TrainExample
    from pasta_engine.train.sft import SFTSettings, train_sft

    ex = [TrainExample(PROMPT, ANNOTATED, "koala", "sot", 3, 40)] * 2
    train_sft(ex, tmp_path / "sft", SFTSettings(epochs=1, grad_accum=2, lora=LoraSettings(r=4, alpha=8)),
              base=str(tiny_llama), progress=False)
    settings = BonbonSettings(n=3, max_new_tokens=10, temperature=1.0, best_must_finish=False, grad_accum=1, lr=1e-2,
                              kv_cache_mb=16, max_running_requests=4)
    summary = train_bonbon(["tips", "sleep"], tmp_path / "sft" / "adapter", tmp_path / "bb", settings,
                           base=str(tiny_llama), scorer=lambda prompt, text: -len(text) / 100, progress=False)
    [r] = summary["rounds"]
    assert r["samples"] == 6 and r["pairs"] == 2 and r["optimizer_steps"] == 2
    samples = [json.loads(x) for x in (tmp_path / "bb" / "round1" / "samples.jsonl").read_text().splitlines()]
    assert all(s["score"] == pytest.approx(s["content_speedup"] - len(s["text"]) / 100) for s in samples)
    manifest = json.loads((tmp_path / "bb" / "adapter" / "manifest.json").read_text())
    assert [s["stage"] for s in manifest["stages"]] == ["sft", "bonbon"]
    engine = Engine.from_pretrained(tiny_llama, adapter=tmp_path / "bb" / "adapter", kv_cache_bytes=8 * 2**20)
    assert engine.generate(["x"], SamplingParams(max_new_tokens=3))[0].stats.tokens_decoded <= 3
    # resuming with two rounds: round 1 is read back, not sampled or trained again; round 2 starts from its adapter
    round1 = (tmp_path / "bb" / "round1" / "samples.jsonl").read_text()
    settings.rounds = 2
    summary2 = train_bonbon(["tips", "sleep"], tmp_path / "sft" / "adapter", tmp_path / "bb", settings,
                            base=str(tiny_llama), scorer=lambda prompt, text: -len(text) / 100, progress=False)
    assert summary2["rounds"][0] == r and [x["round"] for x in summary2["rounds"]] == [1, 2]
    assert (tmp_path / "bb" / "round1" / "samples.jsonl").read_text() == round1
    manifest = json.loads((tmp_path / "bb" / "adapter" / "manifest.json").read_text())
    assert [s["stage"] for s in manifest["stages"]] == ["sft", "bonbon", "bonbon"]


def test_bonbon_samples_the_policy_as_trained_and_its_adapter_inherits_no_serving_scale(tiny_llama, tmp_path,
                                                                                          monkeypatch):
    """From an adapter served at lora_scale 0.85 (the shipped one's manifest), BoNBoN sampled at
    0.85 while its policy and reference ran at 1.0 (off-policy pairs), and the new adapter's
    manifest inherited the 0.85 measured on the old one (served at 85% of what was trained)."""
    from pasta_engine.engine.llm_engine import Engine as EngineClass
    from pasta_engine.train.bonbon import BonbonSettings, train_bonbon
    from pasta_engine.train.common import LoraSettings
    from pasta_engine.train.data import TrainExample
    from pasta_engine.train.sft import SFTSettings, train_sft

    ex = [TrainExample(PROMPT, ANNOTATED, "koala", "sot", 3, 40)] * 2
    train_sft(ex, tmp_path / "sft", SFTSettings(epochs=1, grad_accum=2, lora=LoraSettings(r=4, alpha=8)),
              base=str(tiny_llama), progress=False)
    mpath = tmp_path / "sft" / "adapter" / "manifest.json"
    manifest = json.loads(mpath.read_text())
    mpath.write_text(json.dumps({**manifest, "lora_scale": 0.85, "lora_scale_note": "measured on this adapter"}))
    scales = []
    orig = EngineClass.from_pretrained.__func__

    def spy(cls, *a, **kw):
        scales.append(kw.get("lora_scale"))
        return orig(cls, *a, **kw)

    monkeypatch.setattr(EngineClass, "from_pretrained", classmethod(spy))
    settings = BonbonSettings(n=2, max_new_tokens=6, temperature=1.0, best_must_finish=False, grad_accum=1, lr=1e-2,
                              kv_cache_mb=16, max_running_requests=4)
    train_bonbon(["tips"], tmp_path / "sft" / "adapter", tmp_path / "bb", settings, base=str(tiny_llama),
                 scorer=lambda prompt, text: -len(text) / 100, progress=False)
    assert scales and all(s == 1.0 for s in scales), scales
    assert json.loads((tmp_path / "bb" / "round1" / "sampling.json").read_text())["lora_scale"] == 1.0
    new = json.loads((tmp_path / "bb" / "adapter" / "manifest.json").read_text())
    assert "lora_scale" not in new and "lora_scale_note" not in new


def test_bench_learned_evaluates_only_the_vicuna_split(tiny_llama, tmp_path, capsys):
    from pasta_engine.entrypoints.cli import main
    from pasta_engine.train.common import LoraSettings
    from pasta_engine.train.data import TrainExample
    from pasta_engine.train.sft import SFTSettings, train_sft

    ex = [TrainExample(PROMPT, ANNOTATED, "koala", "sot", 3, 40)] * 2
    train_sft(ex, tmp_path / "sft", SFTSettings(epochs=1, grad_accum=2, lora=LoraSettings(r=4, alpha=8)),
              base=str(tiny_llama), progress=False)
    prompts = tmp_path / "p.json"
    prompts.write_text(json.dumps([{"instruction": "train me", "dataset": "koala", "output": "x"},
                                   {"instruction": "eval one", "dataset": "vicuna", "output": "y"},
                                   {"instruction": "eval two", "dataset": "vicuna", "output": "z"}]))
    out = tmp_path / "learned"
    rc = main(["bench", "learned", "--prompts", str(prompts), "--model", str(tiny_llama), "--adapter",
               str(tmp_path / "sft" / "adapter"), "--max-new-tokens", "6", "--out", str(out)])
    _, err = capsys.readouterr()
    assert rc == 0, err
    rows = [json.loads(x) for x in (out / "prompts.jsonl").read_text().splitlines()]
    assert [r["instruction"] for r in rows] == ["eval one", "eval two"]
    s = json.loads((out / "summary.json").read_text())["summary"]
    assert s["prompts"] == 2 and set(s) >= {"base_sequential", "base_pasta", "adapter_pasta", "geomean_length_ratio",
                                            "cut_fraction_base_sequential", "cut_fraction_adapter_pasta"}
    assert list(s["adapter_pasta"])[1:3] == ["geomean_content_speedup", "geomean_realized_content_speedup"]
    spread = s["adapter_pasta"]["realized_content_speedup_spread"]
    per = sorted(r["adapter_pasta"]["realized_content_speedup"] for r in rows)
    assert (spread["min"], spread["max"]) == (per[0], per[-1]) and per[0] <= spread["median"] <= per[-1]
    for r in rows:
        a = r["adapter_pasta"]
        assert a["tokens"] <= 6 and a["content_speedup"] == pytest.approx(a["content_tokens"] / a["critical_path"])
        assert a["realized_content_speedup"] == pytest.approx(a["clean_text_sequential_wall_s"] / a["pasta_replay_wall_s"])
        b = r["base_sequential"]
        if b["content_tokens"]:
            assert r["length_ratio"] == pytest.approx(a["content_tokens"] / b["content_tokens"])
    # AlpacaEval's format, the clean text (RequestResult.text) as the output, for alpaca_eval's judges
    for label, key in (("adapter_pasta", "adapter_pasta"), ("base_sequential", "base_sequential")):
        exported = json.loads((out / f"model_outputs_{label}.json").read_text())
        assert [x["instruction"] for x in exported] == ["eval one", "eval two"]
        assert [x["output"] for x in exported] == [r[key]["text"] for r in rows]
        assert all(set(x) == {"instruction", "output", "generator", "dataset"} and x["dataset"] == "vicuna"
                   for x in exported)
    # the quality proxies, side by side, in the summary and on stderr
    q = s["quality_proxies"]
    assert list(q) == ["base_sequential", "adapter_pasta", "base_pasta"]
    assert set(q["adapter_pasta"]) >= {"mean_repeated_lines", "mean_distinct_2", "cut_fraction",
                                       "answers_with_empty_list_items", "answers_with_tag_text", "mean_likelihood_proxy"}
    assert all({"distinct_2", "empty_list_items", "tag_text"} <= set(r[k]) for r in rows for k in q)
    assert "quality proxies (base_sequential / adapter_pasta / base_pasta)" in err
    assert (out / "learned.png").read_bytes().startswith(b"\x89PNG")
    # issue 31 item 2: the hygiene of the other measuring commands: repeats (3 by default), every
    # run's wall time, the per-run spread, and the warnings with it
    for r in rows:
        t = r["adapter_pasta"]["timing"]
        assert t["runs"] == 3 and len(t["wall_s"]["pasta"]) == len(t["wall_s"]["clean_text_sequential"]) == 3
        # the fastest run of each side counts
        assert r["adapter_pasta"]["realized_content_speedup"] == pytest.approx(
            min(t["wall_s"]["clean_text_sequential"]) / min(t["wall_s"]["pasta"]))
    # --resume keeps only rows of the same adapter, sampling and baseline (it mixed two runs)
    rc = main(["bench", "learned", "--prompts", str(prompts), "--model", str(tiny_llama), "--adapter",
               str(tmp_path / "sft" / "adapter"), "--max-new-tokens", "7", "--out", str(out), "--resume"])
    _, err2 = capsys.readouterr()
    assert rc == 2 and "was measured with other inputs" in err2 and "sampling.max_new_tokens 6 there, 7 here" in err2, err2
    # ... and of the same model: another checkpoint the adapter also loads on was resumed over
    import shutil

    other = tmp_path / "other-model"
    shutil.copytree(tiny_llama, other)
    rc = main(["bench", "learned", "--prompts", str(prompts), "--model", str(other), "--adapter",
               str(tmp_path / "sft" / "adapter"), "--max-new-tokens", "6", "--out", str(out), "--resume"])
    _, err3 = capsys.readouterr()
    assert rc == 2 and "was measured with other inputs" in err3 and str(other.resolve()) in err3, err3
    timing = s["adapter_pasta"]["timing"]
    assert timing["runs_per_side"] == 3 and set(timing["geomean_realized_content_speedup_spread"]) == {"min", "median", "max"}
    assert isinstance(s["adapter_pasta"]["warnings"], list)
    assert "realized content speedup over 3 runs per side" in err
    settings = json.loads((out / "summary.json").read_text())["settings"]
    assert settings["repeats"] == 3 and settings["warmup"] == 1


def test_bench_learned_warns_when_realized_exceeds_theoretical_beyond_the_spread():
    from pasta_engine.train.evaluate import summarize_learned

    def side(theo, real, runs, forks=2):
        from pasta_engine.tools.bench import realized_beyond_theoretical

        w = realized_beyond_theoretical(real, theo, runs)
        return {"content_speedup": theo, "realized_content_speedup": real, "tag_tokens": 1, "tokens": 10,
                "token_parallelism": 1.5, "forks": forks, "quality": -1.0, "text": "x", "finish_reason": "stop",
                "timing": {"runs": len(runs), "wall_s_spread": {"pasta": {"min": 1, "median": 1, "max": 1.1}},
                           "realized_content_speedup_spread": {"min": min(runs), "median": runs[0], "max": max(runs)},
                           "warnings": [w] if w else []}}

    base = {"text": "x", "content_tokens": 5, "tokens": 5, "wall_s": 1.0, "finish_reason": "stop", "quality": -1.0}
    rows = [{"index": 0, "base_sequential": base, "adapter_pasta": side(1.2, 12.09, [12.09, 11.0]),
             "end_to_end_speedup": 1.0, "length_ratio": 1.0},
            {"index": 1, "base_sequential": base, "adapter_pasta": side(1.5, 1.4, [1.4, 1.3]),
             "end_to_end_speedup": 1.0, "length_ratio": 1.0}]
    a = summarize_learned(rows)["adapter_pasta"]
    assert a["timing"]["realized_beyond_theoretical"] == [0]
    assert any("prompts 0" in w and "disturbed" in w for w in a["warnings"])


def test_bench_learned_takes_every_speedup_figure_over_the_answers_with_content():
    """An empty answer has no content speedup (0, left out of the theoretical geomean); its
    realized figure (a replay of nothing) was still in the realized geomean, so the two
    headline figures were over different answers (1.73x theoretical against 1.08x realized
    here, 1.59x over the same two)."""
    from pasta_engine.train.evaluate import summarize_learned

    def side(theo, real, content):
        return {"content_speedup": theo, "realized_content_speedup": real, "content_tokens": content,
                "tag_tokens": 2, "tokens": content + 3, "token_parallelism": 1.2, "forks": 1 if content else 0,
                "quality": -1.0, "text": "x" if content else "", "finish_reason": "stop"}

    base = {"text": "x", "content_tokens": 5, "tokens": 5, "wall_s": 1.0, "finish_reason": "stop", "quality": -1.0}
    rows = [{"index": i, "base_sequential": base, "adapter_pasta": side(*xs), "end_to_end_speedup": 1.0,
             "length_ratio": 1.0} for i, xs in enumerate([(2.0, 1.8, 20), (1.5, 1.4, 15), (0.0, 0.5, 0)])]
    a = summarize_learned(rows)["adapter_pasta"]
    assert a["geomean_content_speedup"] == pytest.approx((2.0 * 1.5) ** 0.5)
    assert a["geomean_realized_content_speedup"] == pytest.approx((1.8 * 1.4) ** 0.5)
    assert a["realized_content_speedup_spread"]["min"] == pytest.approx(1.4) and a["empty_answers"] == 1


LISTED = "Tips:\n1. Go to bed early, and get up at the same time every day.\n2. Avoid screens at night.\n"


def _sft_command(tiny_llama, tmp_path, capsys, rows: list[dict], *extra: str) -> tuple[Path, Path, str]:
    """``pasta-engine train sft`` for one step on ``rows``: (prompts file, out folder, stderr)."""
    from pasta_engine.entrypoints.cli import main

    prompts = tmp_path / "p.json"
    prompts.write_text(json.dumps(rows))
    out = tmp_path / "sft"
    rc = main(["train", "sft", "--prompts", str(prompts), "--model", str(tiny_llama), "--out", str(out),
               "--grad-accum", "1", "--max-steps", "1", "--lora-r", "4", "--lora-alpha", "8", *extra])
    _, err = capsys.readouterr()
    assert rc == 0, err
    return prompts, out, err


def test_train_sft_command_writes_an_adapter_and_bonbon_needs_two_samples(tiny_llama, tmp_path, capsys):
    from pasta_engine.entrypoints.cli import main

    prompts, out, _ = _sft_command(tiny_llama, tmp_path, capsys,
                                   [{"instruction": PROMPT, "dataset": "koala", "output": LISTED},
                                    {"instruction": "eval", "dataset": "vicuna", "output": LISTED}])
    [ex] = [json.loads(x) for x in (out / "examples.jsonl").read_text().splitlines()]  # never the vicuna row
    assert ex["prompt"] == PROMPT
    assert json.loads((out / "adapter" / "manifest.json").read_text())["stages"][0]["optimizer_steps"] == 1
    with pytest.raises(SystemExit) as e:  # best and worst of n need n >= 2: a usage error before any work
        main(["train", "bonbon", "--prompts", str(prompts), "--adapter", str(out / "adapter"), "--out",
              str(tmp_path / "bb"), "--n", "1"])
    assert e.value.code == 2 and "--n" in capsys.readouterr().err


def test_train_sft_min_promises_drops_answers_with_fewer_promises(tiny_llama, tmp_path, capsys):
    _, out, err = _sft_command(tiny_llama, tmp_path, capsys,
                               [{"instruction": PROMPT, "dataset": "koala", "output": LISTED},
                                {"instruction": "plain", "dataset": "koala", "output": "Sleep well."}],
                               "--min-promises", "1")
    rows = [json.loads(x) for x in (out / "examples.jsonl").read_text().splitlines()]
    assert [r["prompt"] for r in rows] == [PROMPT] and rows[0]["promises"] >= 1  # the unforked answer is gone
    assert "min_promises_1" in err


def test_train_sft_drop_repeats_and_tag_tokens(tiny_llama, tmp_path, capsys):
    looping = "Sleep well.\nSleep well.\nSleep well."
    _, out, err = _sft_command(tiny_llama, tmp_path, capsys,
                               [{"instruction": PROMPT, "dataset": "koala", "output": LISTED},
                                {"instruction": "loop", "dataset": "koala", "output": looping}],
                               "--drop-repeats", "--tag-tokens")
    rows = [json.loads(x) for x in (out / "examples.jsonl").read_text().splitlines()]
    assert [r["prompt"] for r in rows] == [PROMPT]  # the answer that repeats a line is gone
    assert "without_repeated_lines" in err
    manifest = json.loads((out / "adapter" / "manifest.json").read_text())
    assert set(manifest["added_tokens"]) == {'<promise topic="', '" tokens="', '"/>', "<async>", "</async>", "<sync/>"}


def test_train_sft_teaches_a_plain_writers_adapter_the_tags_as_tokens(tiny_llama, tmp_path, capsys):
    """The writer first (--annotator none: no tag, no added token), then the same adapter goes on
    with the PASTA-LANG pieces as tokens: the second stage starts from the writer's LoRA weights
    (not a fresh adapter), adds the pieces and keeps both stages in its manifest."""
    from safetensors.torch import load_file

    from pasta_engine.entrypoints.cli import main

    rows = [{"instruction": PROMPT, "dataset": "koala", "output": LISTED}]
    _, writer, _ = _sft_command(tiny_llama, tmp_path, capsys, rows, "--annotator", "none")
    assert "added_tokens" not in json.loads((writer / "adapter" / "manifest.json").read_text())
    out = tmp_path / "tags"
    rc = main(["train", "sft", "--prompts", str(tmp_path / "p.json"), "--model", str(tiny_llama), "--out", str(out),
               "--grad-accum", "1", "--max-steps", "1", "--lr", "1e-9", "--adapter", str(writer / "adapter"),
               "--tag-tokens"])
    assert rc == 0, capsys.readouterr().err
    manifest = json.loads((out / "adapter" / "manifest.json").read_text())
    assert set(manifest["added_tokens"]) == {'<promise topic="', '" tokens="', '"/>', "<async>", "</async>", "<sync/>"}
    assert [s["stage"] for s in manifest["stages"]] == ["sft", "sft"]
    before, after = load_file(writer / "adapter" / "adapter_model.safetensors"), load_file(
        out / "adapter" / "adapter_model.safetensors")
    lora = [k for k in before if "lora_B" in k]
    assert lora and set(lora) <= set(after)
    for k in lora:  # one step at lr 1e-9: the writer's weights, not a fresh adapter's zeros
        assert before[k].abs().max() > 0
        torch.testing.assert_close(after[k].float(), before[k].float(), rtol=0, atol=1e-3)
    # an adapter that has the pieces already is refused, before any work
    rc = main(["train", "sft", "--prompts", str(tmp_path / "p.json"), "--model", str(tiny_llama), "--out",
               str(tmp_path / "again"), "--adapter", str(out / "adapter"), "--tag-tokens"])
    err = capsys.readouterr().err
    assert rc == 2 and "error: --tag-tokens " in err and "added tokens already" in err, err
    assert not (tmp_path / "again").exists()


def test_train_sft_drop_refusals(tiny_llama, tmp_path, capsys):
    declining = "I'm sorry for any misunderstanding, but as an AI I don't have the ability to sleep."
    _, out, err = _sft_command(tiny_llama, tmp_path, capsys,
                               [{"instruction": PROMPT, "dataset": "koala", "output": LISTED},
                                {"instruction": "decline", "dataset": "koala", "output": declining}],
                               "--drop-refusals")
    rows = [json.loads(x) for x in (out / "examples.jsonl").read_text().splitlines()]
    assert [r["prompt"] for r in rows] == [PROMPT]  # the declining answer is gone
    assert "'without_refusals': 1" in err


def test_annotation_content_speedup_counts_tags_as_overhead(tiny_llama):
    from pasta_engine.lang.grammar import add_tag_tokens
    from pasta_engine.lang.tokenization import encode_text
    from pasta_engine.train.common import load_tokenizer
    from pasta_engine.train.data import annotation_content_speedup

    tok = load_tokenizer(tiny_llama)
    eos = tok.eos_token_id
    plain = "Go to bed early and avoid screens."
    n = len(encode_text(tok, plain))
    assert annotation_content_speedup(tok, plain, eos) == pytest.approx(n / (n + 1))  # one thread: +1 EOS step
    forked = ("Tips:\n1. <promise topic=\"bed\" tokens=\"10\"/><async>Go to bed early, and get up at the same time "
              "every day of the week.</async>\n2. <promise topic=\"screens\" tokens=\"10\"/><async>Avoid screens at "
              "night, and read a paper book in a dim light instead.</async>")
    text_tags = annotation_content_speedup(tok, forked, eos)
    add_tag_tokens(tok)
    token_tags = annotation_content_speedup(tok, forked, eos)
    assert token_tags > text_tags  # the same structure, cheaper tags: a shorter critical path
    assert token_tags > 1.0


@pytest.mark.parametrize("flag, kept, count", [
    (["--min-content-speedup", "1.2"], PROMPT, "min_content_speedup_1.2': 1"),  # the unforked answer (< 1x) goes
    (["--max-decoded-tokens", "40"], "plain", "max_decoded_tokens_40': 1"),  # the long forked one decodes > 40
])
def test_train_sft_annotation_filters_keep_what_they_name(flag, kept, count, tiny_llama, tmp_path, capsys):
    """--min-content-speedup keeps the parallel answers; --max-decoded-tokens leaves out the
    answers the token budget would cut (tags and every thread counted)."""
    long_items = "Tips:\n" + "".join(f"{i}. " + "Go to bed early, and get up at the same time every day. " * 3 + "\n"
                                     for i in range(1, 5))
    _, out, err = _sft_command(tiny_llama, tmp_path, capsys,
                               [{"instruction": PROMPT, "dataset": "koala", "output": long_items},
                                {"instruction": "plain", "dataset": "koala", "output": "Sleep well."}],
                               *flag, "--tag-tokens")
    rows = [json.loads(x) for x in (out / "examples.jsonl").read_text().splitlines()]
    assert [r["prompt"] for r in rows] == [kept]
    assert count in err


def test_annotation_decoded_tokens_counts_every_thread_with_its_tags(tiny_llama):
    """What max_new_tokens counts: main thread (with its promise tags and EOS) + each chunk (with
    its closing tag), the inserted <async> not sampled; by hand from the replay's pieces."""
    from pasta_engine.lang.grammar import add_tag_tokens
    from pasta_engine.lang.tokenization import encode_text
    from pasta_engine.train.common import load_tokenizer
    from pasta_engine.train.data import annotation_decoded_tokens

    tok = load_tokenizer(tiny_llama)
    add_tag_tokens(tok)
    eos = tok.eos_token_id
    plain = "Go to bed early and avoid screens."
    assert annotation_decoded_tokens(tok, plain, eos) == len(encode_text(tok, plain)) + 1
    promise, chunk = '<promise topic="bed" tokens="10"/>', "Go to bed early, every day."
    forked = f"Tips:\n1. {promise}<async>{chunk}</async>"
    promise_ids = tok.encode(promise, add_special_tokens=False)  # the tag pieces are added tokens
    assert len(promise_ids) < len(encode_text(tok, promise))  # '<promise topic="', ..., '"/>' one token each
    main = len(encode_text(tok, "Tips:\n1. ")) + len(promise_ids) + 1  # + EOS
    assert annotation_decoded_tokens(tok, forked, eos) == main + len(encode_text(tok, chunk)) + 1  # + </async>
    assert annotation_decoded_tokens(tok, forked, eos) > len(encode_text(tok, "Tips:\n1. " + chunk)) + 1  # tags cost


def test_an_answer_that_was_cut_trains_no_end(tiny_llama, tmp_path):
    """``end_target="ended"`` (issue 30): an answer cut to fit, or generated up to a token budget,
    trains every token but its end-of-sequence; an answer that ended by itself trains its end."""
    from pasta_engine.tools.traces import PromptRow
    from pasta_engine.train.common import LoraSettings
    from pasta_engine.train.data import TrainExample, build_examples
    from pasta_engine.train.losses import without_end_target
    from pasta_engine.train.sft import SFTSettings, train_sft

    w = without_end_target([5, 2, 7, 2], [2], torch.tensor([1.0, 1.0, 20.0, 1.0]))
    assert w.tolist() == [1.0, 0.0, 20.0, 0.0]
    assert without_end_target([5, 6], [2], None).tolist() == [1.0, 1.0]
    with pytest.raises(ValueError, match="weights"):
        without_end_target([5, 6], [2], torch.ones(3))

    count = lambda t: len(t.split())  # noqa: E731
    answer = "first line of the answer\nsecond line of it"
    rows = [PromptRow("q1", answer, "koala", "stop"), PromptRow("q2", answer, "koala", "length"),
            PromptRow("q3", answer, "koala")]
    ex, counts = build_examples(rows, count, max_response_tokens=20, annotator="sot", seed=0)
    assert counts["ended"] == 2  # q1, and q3 (a reference answer: no finish_reason); q2 ran out of tokens
    by = {e.prompt: e for e in ex}
    assert by["q1"].ended and not by["q2"].ended and by["q3"].ended
    cut, counts = build_examples(rows[:1], count, max_response_tokens=5, annotator="sot")
    assert cut[0].annotated == "first line of the answer" and not cut[0].ended and counts["ended"] == 0

    def first_loss(ended: bool, end_target: str) -> float:
        settings = SFTSettings(epochs=1, lr=1e-3, grad_accum=1, warmup=1, max_steps=1, end_target=end_target,
                               lora=LoraSettings(r=4, alpha=8, dropout=0.0))
        out = tmp_path / f"{ended}-{end_target}"
        train_sft([TrainExample(PROMPT, ANNOTATED, "koala", "sot", 3, 40, ended)], out, settings,
                  base=str(tiny_llama), progress=False)
        return json.loads((out / "loss.json").read_text())[0]["loss"]

    always = first_loss(False, "always")
    assert first_loss(True, "ended") == pytest.approx(always)  # an answer that ended trains its end
    assert first_loss(False, "ended") != pytest.approx(always)  # one that was cut does not
    with pytest.raises(ValueError, match="end_target"):
        train_sft([], tmp_path / "x", SFTSettings(end_target="sometimes"), base=str(tiny_llama), progress=False)


def test_tokens_only_trains_the_tag_rows_and_leaves_every_weight_the_bases(tiny_llama, tmp_path):
    """``tokens_only``: the LoRA stays zero; only the added tag-token rows learn, so the merged
    model equals the base model on every row but the tag tokens'."""
    from safetensors.torch import load_file

    from pasta_engine.train.common import LoraSettings
    from pasta_engine.train.data import TrainExample
    from pasta_engine.train.sft import SFTSettings, train_sft

    settings = SFTSettings(epochs=1, lr=1e-2, grad_accum=1, warmup=1, max_steps=2, tag_tokens=True, tokens_only=True,
                           lora=LoraSettings(r=4, alpha=8, dropout=0.0))
    out = tmp_path / "run"
    train_sft([TrainExample(PROMPT, ANNOTATED, "koala", "sot", 3, 40)] * 2, out, settings, base=str(tiny_llama),
              progress=False)
    w = load_file(out / "adapter" / "adapter_model.safetensors")
    lora_b = [t for n, t in w.items() if "lora_B" in n]
    assert lora_b and all(float(t.abs().max()) == 0 for t in lora_b)  # no weight changed
    rows = [t for n, t in w.items() if "trainable_tokens_delta" in n]
    assert rows and float(rows[0].float().abs().sum()) > 0
    base = Engine.from_pretrained(tiny_llama, adapter=None, kv_cache_bytes=8 * 2**20)
    tuned = Engine.from_pretrained(tiny_llama, adapter=out / "adapter", kv_cache_bytes=8 * 2**20)
    got = {}
    for name, eng in (("base", base), ("tuned", tuned)):
        eng.logits_hook = lambda req, tid, row, name=name: got.setdefault(name, row.clone())
        eng.generate([[5, 6, 7, 8]], SamplingParams(max_new_tokens=1), mode="sequential")
    vocab = got["base"].shape[0]
    torch.testing.assert_close(got["tuned"][:vocab], got["base"])  # the base's logits for every base token
    with pytest.raises(ValueError, match="tokens_only"):
        train_sft([], tmp_path / "x", SFTSettings(tokens_only=True), base=str(tiny_llama), progress=False)


def test_blind_pair_files_round_trip_and_bad_verdicts_name_the_line(tmp_path):
    """write_blind_pairs hides the candidate's side in the key; read_blind_sides turns each order's
    verdict back into the candidate's win, loss or tie; win_value averages the orders judged."""
    from pasta_engine.tools.judge import read_blind_sides, win_value, write_blind_pairs

    write_blind_pairs(["q0", "q1", "q2"], ["c0", "c1", "c2"], ["b0", "b1", "b2"], tmp_path, seed=3)
    pairs = [json.loads(x) for x in (tmp_path / "pairs.jsonl").read_text().splitlines()]
    rev = [json.loads(x) for x in (tmp_path / "pairs_reversed.jsonl").read_text().splitlines()]
    assert "c0" not in (tmp_path / "key.json").read_text()  # the key holds sides, never the answers
    for p, r in zip(pairs, rev):
        assert {p["answer_a"], p["answer_b"]} == {f"c{p['id']}", f"b{p['id']}"}
        assert (r["answer_a"], r["answer_b"]) == (p["answer_b"], p["answer_a"])
    # the reader prefers the candidate in row 0 both times, the baseline in row 1, ties row 2 once
    cand = {p["id"]: "A" if p["answer_a"].startswith("c") else "B" for p in pairs}
    other = {"A": "B", "B": "A"}
    (tmp_path / "verdicts.jsonl").write_text("".join(json.dumps({"id": i, "verdict": v}) + "\n" for i, v in
                                                     [(0, cand[0]), (1, other[cand[1]]), (2, "tie")]))
    (tmp_path / "verdicts_reversed.jsonl").write_text("".join(json.dumps({"id": i, "verdict": v}) + "\n" for i, v in
                                                              [(0, other[cand[0]]), (1, cand[1])]))
    sides = read_blind_sides(tmp_path)
    assert [(s["first_order"], s["reversed_order"]) for s in sides] == [("win", "win"), ("loss", "loss"),
                                                                         ("tie", None)]
    assert [win_value(s) for s in sides] == [1.0, 0.0, 0.5]
    assert win_value({"first_order": None, "reversed_order": None}) is None
    (tmp_path / "verdicts.jsonl").write_text('{"id": 0, "verdict": "C"}\n')
    with pytest.raises(ValueError, match="verdicts.jsonl line 1"):
        read_blind_sides(tmp_path)
    # an id that is no row, not an integer, or judged twice is an error, never joined or dropped
    for lines, why in ((['{"id": 7, "verdict": "A"}'], "id 7 is not a row"),
                       (['{"id": 1.9, "verdict": "A"}'], "line 1 is not a verdict"),
                       (['{"id": true, "verdict": "A"}'], "line 1 is not a verdict"),
                       (['{"id": 0, "verdict": "A"}', '{"id": 0, "verdict": "B"}'], "line 2: id 0 was judged")):
        (tmp_path / "verdicts.jsonl").write_text("\n".join(lines) + "\n")
        with pytest.raises(ValueError, match=why):
            read_blind_sides(tmp_path)


def test_proxy_pair_agreement_counts_pairs_the_reader_separates():
    from pasta_engine.train.bonbon import proxy_pair_agreement

    rows = [{"prompt_index": 0, "quality": 1.0, "proxy_quality": -1.0},
            {"prompt_index": 0, "quality": 0.0, "proxy_quality": -2.0},  # agrees with the reader
            {"prompt_index": 0, "quality": 0.0, "proxy_quality": -0.5},  # vs row 0: disagrees; vs row 1: reader tie
            {"prompt_index": 1, "quality": 0.5, "proxy_quality": -3.0}]  # alone: no pair
    assert proxy_pair_agreement(rows) == {"pairs": 2, "agreement": 0.5}
    assert proxy_pair_agreement(rows[3:]) == {"pairs": 0, "agreement": None}


def test_a_bonbon_round_scored_by_a_reader_stops_for_verdicts_and_goes_on(tiny_llama, tmp_path, capsys):
    """train bonbon --reader: the round samples, writes the blind pair files and exits 3 naming
    them; with the reader's verdicts beside them the round trains from the kept samples, and the
    best sample of each prompt is the one the reader preferred."""
    from pasta_engine.entrypoints.cli import main
    from pasta_engine.train.bonbon import BonbonSettings, train_bonbon

    prompts, out, _ = _sft_command(tiny_llama, tmp_path, capsys,
                                   [{"instruction": "tips", "dataset": "koala", "output": LISTED},
                                    {"instruction": "sleep", "dataset": "koala", "output": LISTED}])
    refs = tmp_path / "refs.json"
    refs.write_text(json.dumps([{"instruction": "tips", "output": "Sleep well."},
                                {"instruction": "sleep", "output": "Go to bed early."}]))
    cmd = ["train", "bonbon", "--prompts", str(prompts), "--adapter", str(out / "adapter"), "--out", str(tmp_path / "bb"),
           "--n", "2", "--max-new-tokens", "8", "--temperature", "1.0", "--reader", "--judge-reference", str(refs),
           "--quality-weight", "100", "--model", str(tiny_llama)]
    assert main(cmd) == 3
    err = capsys.readouterr().err
    folder = tmp_path / "bb" / "round1" / "reader"
    assert "4 of 4 samples wait for a reader" in err and str(folder / "pairs.jsonl") in err
    samples = [json.loads(x) for x in (tmp_path / "bb" / "round1" / "samples.jsonl").read_text().splitlines()]
    pairs = [json.loads(x) for x in (folder / "pairs.jsonl").read_text().splitlines()]
    assert [p["question"] for p in pairs] == [s["prompt"] for s in samples]
    # the reader prefers sample 1 of every prompt (as A or B) and the reference over sample 0
    key = json.loads((folder / "key.json").read_text())["rows"]
    verdict = {0: lambda side: "A" if side == "B" else "B", 1: lambda side: side}
    assert main(cmd) == 3  # run again with no verdicts yet: the same answer, nothing sampled again
    assert "4 of 4 samples wait" in capsys.readouterr().err
    (folder / "verdicts.jsonl").write_text("".join(
        json.dumps({"id": k["id"], "verdict": verdict[s["sample"]](k["candidate_in_pairs"])}) + "\n"
        for k, s in zip(key, samples)))
    # the tiny model never ends an answer in 8 tokens, so the API run lets a cut sample be the best
    settings = BonbonSettings(n=2, max_new_tokens=8, temperature=1.0, best_must_finish=False, grad_accum=1,
                              quality_weight=100, kv_cache_mb=16)
    train_bonbon([s["prompt"] for s in samples[::2]], out / "adapter", tmp_path / "bb", settings,
                 base=str(tiny_llama), reader_references={"tips": "Sleep well.", "sleep": "Go to bed early."},
                 progress=False)
    rows = [json.loads(x) for x in (tmp_path / "bb" / "round1" / "samples.jsonl").read_text().splitlines()]
    assert rows == samples  # the kept samples, not sampled again
    written = [json.loads(x) for x in (tmp_path / "bb" / "round1" / "pairs.jsonl").read_text().splitlines()]
    assert len(written) == 2 and all(p["best"] == 1 and p["worst"] == 0 for p in written)
    assert all(p["best_score"] - p["worst_score"] > 90 for p in written)  # the reader's win outweighs the speedup
    round_ = json.loads((tmp_path / "bb" / "round1" / "round.json").read_text())
    assert round_["mean_quality"] == pytest.approx(0.5) and round_["proxy_pair_agreement"]["pairs"] <= 2
    # the reader's picks: none, as every sample of the tiny model was cut at 8 tokens
    assert (tmp_path / "bb" / "round1" / "picks.jsonl").read_text() == "" and all(r["finish_reason"] == "length"
                                                                                 for r in rows)


def test_train_picks_keeps_the_samples_the_reader_preferred(tmp_path, capsys):
    """train picks: from a read round, exactly the samples whose win value reaches --min-win and
    that ended, as TrainExample rows; a round without verdicts is refused naming --round."""
    from pasta_engine.entrypoints.cli import main
    from pasta_engine.tools.judge import write_blind_pairs
    from pasta_engine.train.data import TrainExample

    rdir = tmp_path / "round1"
    rows = [{"prompt_index": i // 2, "prompt": f"q{i // 2}", "sample": i % 2, "annotated": f"<promise topic=\"T\" "
             f"tokens=\"3\"/><async>a{i}.</async>", "text": f"a{i}.", "finish_reason": "length" if i == 3 else "stop",
             "content_speedup": 1.0, "forks": 1, "tokens": 9, "quality": -1.0, "score": 0.0} for i in range(4)]
    rdir.mkdir()
    (rdir / "samples.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    write_blind_pairs([r["prompt"] for r in rows], [r["text"] for r in rows], ["ref"] * 4, rdir / "reader", seed=1)
    out = tmp_path / "picks.jsonl"
    cmd = ["train", "picks", "--round", str(rdir), "--out", str(out)]
    assert main(cmd) == 2 and "--round" in capsys.readouterr().err and not out.exists()
    key = json.loads((rdir / "reader" / "key.json").read_text())["rows"]
    # row 0 wins both orders (1.0), row 1 a win and a tie (0.75), row 2 a tie and a loss (0.25),
    # row 3 wins both but was cut at the token limit
    first = {0: "win", 1: "win", 2: "tie", 3: "win"}
    second = {0: "win", 1: "tie", 2: "loss", 3: "win"}

    def verdict(side: str, cand: str) -> str:
        other = "B" if cand == "A" else "A"
        return {"win": cand, "loss": other, "tie": "tie"}[side]

    (rdir / "reader" / "verdicts.jsonl").write_text("".join(
        json.dumps({"id": k["id"], "verdict": verdict(first[k["id"]], k["candidate_in_pairs"])}) + "\n" for k in key))
    (rdir / "reader" / "verdicts_reversed.jsonl").write_text("".join(
        json.dumps({"id": k["id"], "verdict": verdict(second[k["id"]], k["candidate_in_pairs_reversed"])}) + "\n"
        for k in key))
    assert main(cmd) == 0
    picks = [TrainExample(**json.loads(x)) for x in out.read_text().splitlines()]
    assert [p.annotated for p in picks] == [rows[0]["annotated"], rows[1]["annotated"]]
    assert all(p.ended and p.promises == 1 and p.annotator == "reader-pick" for p in picks)
    assert main([*cmd, "--min-win", "1"]) == 0 and len(out.read_text().splitlines()) == 1
    assert main([*cmd, "--min-win", "0"]) == 2 and "--min-win" in capsys.readouterr().err


def test_bonbon_reader_flags_are_checked_before_any_work(tiny_llama, tmp_path, capsys):
    from pasta_engine.entrypoints.cli import main

    prompts, out, _ = _sft_command(tiny_llama, tmp_path, capsys,
                                   [{"instruction": "tips", "dataset": "koala", "output": LISTED}])
    base = ["train", "bonbon", "--prompts", str(prompts), "--adapter", str(out / "adapter"), "--out",
            str(tmp_path / "bb"), "--reader", "--model", str(tiny_llama)]
    assert main(base) == 2
    assert "--judge-reference is missing" in capsys.readouterr().err
    refs = tmp_path / "refs.json"
    refs.write_text(json.dumps([{"instruction": "other", "output": "x"}]))
    assert main([*base, "--judge-reference", str(refs)]) == 2
    assert "no answer to 1 of the 1 sampled prompts" in capsys.readouterr().err
    assert main([*base, "--judge-reference", str(refs), "--judge-url", "http://127.0.0.1:9/v1", "--judge-model",
                 "j"]) == 2
    assert "two judges" in capsys.readouterr().err
    assert not (tmp_path / "bb").exists()


def test_bonbon_runs_a_continued_adapter_in_its_own_context(tmp_path):
    from pasta_engine.lang.prompts import LEARNED_PASTA_PROMPT, PastaPrompt
    from pasta_engine.train.bonbon import adapter_pasta_prompt

    (tmp_path / "manifest.json").write_text(json.dumps({"pasta_prompt": {"system": "", "examples": []}}))
    assert adapter_pasta_prompt(tmp_path) == PastaPrompt(system="", examples=())
    assert adapter_pasta_prompt(tmp_path, LEARNED_PASTA_PROMPT) == LEARNED_PASTA_PROMPT
    assert adapter_pasta_prompt(tmp_path / "none") == LEARNED_PASTA_PROMPT  # an adapter from before the manifest kept it


def test_bonbon_reads_a_manifest_pasta_prompt_as_the_engine_does(tmp_path):
    """An empty ``pasta_prompt`` object sets none for the engine (its default), so BoNBoN's
    fallback holds, not the empty context from_dict would read; a bad value is the engine's
    CheckpointError naming the adapter, not a bare ParameterError."""
    from pasta_engine.errors import CheckpointError
    from pasta_engine.lang.prompts import LEARNED_PASTA_PROMPT
    from pasta_engine.models.adapter import manifest_pasta_prompt
    from pasta_engine.train.bonbon import adapter_pasta_prompt

    (tmp_path / "manifest.json").write_text(json.dumps({"pasta_prompt": {}}))
    assert manifest_pasta_prompt({"pasta_prompt": {}}) is None
    assert adapter_pasta_prompt(tmp_path) == LEARNED_PASTA_PROMPT
    (tmp_path / "manifest.json").write_text(json.dumps({"pasta_prompt": {"system": 3}}))
    with pytest.raises(CheckpointError, match=str(tmp_path)):
        adapter_pasta_prompt(tmp_path)


def test_a_bonbon_round_trains_every_pair_once_per_epoch(tiny_llama, tmp_path, monkeypatch):
    """5 pairs at 4 a step: the floor over all epochs trained one step of 4 and never the fifth
    pair, and with 2 epochs a step spanned both. Each epoch now ends with a short step."""
    import pasta_engine.train.bonbon as bb
    from pasta_engine.train.common import LoraSettings
    from pasta_engine.train.data import TrainExample
    from pasta_engine.train.sft import SFTSettings, train_sft

    train_sft([TrainExample(PROMPT, ANNOTATED, "koala", "sot", 3, 40)] * 2, tmp_path / "sft",
              SFTSettings(epochs=1, grad_accum=2, lora=LoraSettings(r=4, alpha=8)), base=str(tiny_llama), progress=False)
    prompts = [f"q{i}" for i in range(5)]
    trained = []
    real = bb.forward_logprobs

    def spy(policy, layout):
        if torch.is_grad_enabled():
            trained.append(id(layout))
        return real(policy, layout)

    monkeypatch.setattr(bb, "forward_logprobs", spy)
    for epochs in (1, 2):
        out = tmp_path / f"bb{epochs}"
        (out / "round1").mkdir(parents=True)
        rows = [{"prompt_index": i, "prompt": p, "sample": s, "annotated": f"answer {s} to {p}.",
                 "text": f"answer {s} to {p}.", "finish_reason": "stop", "content_speedup": 1.0, "forks": 0,
                 "tokens": 5, "quality": float(s), "score": 1.0 + s} for i, p in enumerate(prompts) for s in range(2)]
        (out / "round1" / "samples.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        trained.clear()
        s = bb.train_bonbon(prompts, tmp_path / "sft" / "adapter", out, bb.BonbonSettings(n=2, epochs=epochs, kv_cache_mb=16),
                            base=str(tiny_llama), scorer=lambda p, t: 0.0, progress=False)
        r = s["rounds"][0]
        assert r["pairs"] == 5 and r["optimizer_steps"] == 2 * epochs  # 4 + 1 per epoch
        assert len(trained) == 2 * 5 * epochs  # best and worst of every pair, once per epoch
