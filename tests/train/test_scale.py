"""Training at scale (issue 34): data parallel SFT over torch.distributed equals one process with
the same global batch, a two-rank checkpoint resumes in one process, the memory estimate bounds
the measured peak, a run that will not fit fails before it loads anything, bfloat16 trains on a
CPU, and the device/dtype flags fail before any work."""

from __future__ import annotations

import json
import shutil
import socket
from pathlib import Path

import pytest
import torch

pytest.importorskip("peft")

from pasta_engine.errors import ParameterError  # noqa: E402
from pasta_engine.train.common import LoraSettings  # noqa: E402
from pasta_engine.train.data import TrainExample  # noqa: E402
from pasta_engine.train.scale import PUBLISHED_SHAPES, ModelShape, estimate_training_memory  # noqa: E402
from pasta_engine.train.sft import SFTSettings, sft_worker, train_sft  # noqa: E402

from sample_traces import SLEEP_PROMPT, SLEEP_TIPS  # noqa: E402  (tests/sample_traces.py)

GiB = 2**30

# six different examples: the two ranks' shares of a step differ in length and content
EXAMPLES = [
    TrainExample(SLEEP_PROMPT, SLEEP_TIPS, "koala", "sot", 3, 40),
    TrainExample("Say hi.", "Hi there, friend.", "koala", "sot", 0, 5),
    TrainExample("Name two fruits.", 'Two fruits:\n<promise topic="apple" tokens="4"/><promise topic="pear" tokens="4"/>'
                 '\n<async>1. Apple.</async>\n<async>2. Pear.</async>', "koala", "sot", 2, 12),
    TrainExample("Count.", "One, two, three.", "koala", "sot", 0, 6),
    TrainExample("Greet me twice.", "Hello. Hello again.", "koala", "sot", 0, 6),
    TrainExample("Why sleep?", "Sleep restores the body and the mind.", "koala", "sot", 0, 9),
]


def _settings(epochs: int) -> SFTSettings:
    # LoRA dropout on, tag tokens added (their rows train and are all-reduced), tag decisions weighted
    return SFTSettings(epochs=epochs, lr=1e-2, grad_accum=3, warmup=1, save_every=1, seed=3, tag_weight=5.0,
                       tag_tokens=True, example_seeds=True, lora=LoraSettings(r=4, alpha=8, dropout=0.1))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _losses(out: Path) -> list[float]:
    return [p["loss"] for p in json.loads((out / "loss.json").read_text())]


def _tensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(path)


def _assert_same_adapter(a: Path, b: Path) -> None:
    """The float32 checkpoint adapters agree to float rounding (the ranks sum the gradients in
    another order; AdamW's division by sqrt(v) magnifies that where a gradient is near 0: 2e-5
    absolute, against updates of lr = 1e-2 per step); the float16 exports likewise."""
    ta, tb = _tensors(a / "checkpoint" / "adapter" / "adapter_model.safetensors"), \
        _tensors(b / "checkpoint" / "adapter" / "adapter_model.safetensors")
    assert ta.keys() == tb.keys() and any("trainable_tokens" in k for k in ta)
    for k in ta:
        torch.testing.assert_close(ta[k], tb[k], rtol=1e-4, atol=2e-5)
    ea, eb = _tensors(a / "adapter" / "adapter_model.safetensors"), _tensors(b / "adapter" / "adapter_model.safetensors")
    for k in ea:
        torch.testing.assert_close(ea[k].float(), eb[k].float(), rtol=2e-3, atol=1e-5)  # float16: ~1e-3 relative


@pytest.fixture(scope="module")
def runs(tiny_llama, tmp_path_factory):
    """One process: 1 epoch (2 optimizer steps of 3 examples: rank 0 runs 2, rank 1 runs 1), then resumed to 2 epochs. Two
    ranks over gloo (torch.multiprocessing.spawn): the same first epoch; a copy of its
    checkpoint resumed to 2 epochs in one process."""
    import torch.multiprocessing as mp

    root = tmp_path_factory.mktemp("scale")
    one = root / "one"
    train_sft(EXAMPLES, one, _settings(1), base=str(tiny_llama), progress=False)
    one_epoch = {"losses": _losses(one), "dir": root / "one-epoch1"}
    shutil.copytree(one, one_epoch["dir"])
    train_sft(EXAMPLES, one, _settings(2), base=str(tiny_llama), resume=True, progress=False)
    two = root / "two"
    mp.spawn(sft_worker, args=(2, _free_port(), EXAMPLES, two, _settings(1), str(tiny_llama)), nprocs=2, join=True)
    resumed = root / "resumed"
    shutil.copytree(two, resumed)
    train_sft(EXAMPLES, resumed, _settings(2), base=str(tiny_llama), resume=True, progress=False)
    return {"one": one, "one_epoch": one_epoch, "two": two, "resumed": resumed}


def test_two_ranks_give_the_loss_curve_and_adapter_of_one_process(runs):
    two = runs["two"]
    summary = json.loads((two / "summary.json").read_text())
    assert summary["scale"]["world_size"] == 2 and summary["scale"]["backend"] == "gloo"
    got, want = _losses(two), runs["one_epoch"]["losses"]
    assert len(got) == len(want) == 2
    assert got == pytest.approx(want, rel=1e-5)
    # the global batch: 3 examples per step, their sampled tokens counted once over both ranks
    curve_two = json.loads((two / "loss.json").read_text())
    curve_one = json.loads((runs["one_epoch"]["dir"] / "loss.json").read_text())
    assert [p["tokens"] for p in curve_two] == [p["tokens"] for p in curve_one]
    # the summed gradient itself, before clipping (AdamW and clipping would hide a wrong scale)
    assert [p["grad_norm"] for p in curve_two] == pytest.approx([p["grad_norm"] for p in curve_one], rel=1e-5)
    assert all(p["grad_norm"] > 0 for p in curve_two)
    assert [p["examples"] for p in curve_two] == [3, 6]
    _assert_same_adapter(two, runs["one_epoch"]["dir"])


def test_a_two_rank_checkpoint_resumes_in_one_process(runs):
    resumed, one = runs["resumed"], runs["one"]
    assert len(_losses(resumed)) == 4
    assert _losses(resumed) == pytest.approx(_losses(one), rel=1e-5)
    _assert_same_adapter(resumed, one)
    blob = torch.load(resumed / "checkpoint" / "trainer.pt", weights_only=True)
    assert blob["state"]["step"] == 4 and blob["state"]["world_size"] == 1 and blob["state"]["example_seeds"]


def _profiled_peak(fn) -> int:
    """Bytes: the highest sum of live CPU tensor allocations while ``fn`` runs (torch's profiler,
    ``profile_memory``: every allocation and free, in time order), above what was live before."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = sorted((e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"),
                    key=lambda e: e.start_ns())
    live = peak = 0
    for e in events:
        live += e.nbytes()
        peak = max(peak, live)
    return peak


@pytest.mark.parametrize("dtype,checkpointing", [(torch.float32, False), (torch.bfloat16, True)])
def test_the_memory_estimate_bounds_the_measured_peak(tiny_llama, dtype, checkpointing):
    """Margin: the estimate is an upper bound, at most 40% above the measured peak of one step
    (forward, backward, the first AdamW step) of the tiny model. Measured: the model's resident
    tensors (weights, LoRA, tag rows; each storage once) plus the profiler's peak during the step."""
    from pasta_engine.config import Limits
    from pasta_engine.lang.prompts import LEARNED_PASTA_PROMPT
    from pasta_engine.train.common import load_base, wrap_lora
    from pasta_engine.train.forward import forward_logprobs, layout_for
    from pasta_engine.train.losses import sft_loss

    model, tok, _ = load_base(tiny_llama, dtype)
    model = wrap_lora(model, LoraSettings(), tokenizer=tok, tag_tokens=True)
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    long_answer = SLEEP_TIPS + " " + " ".join(["rest"] * 100)  # a longer example: activations dominate
    layout = layout_for(model, tok, SLEEP_PROMPT, long_answer, pasta_prompt=LEARNED_PASTA_PROMPT,
                        limits=Limits(max_threads=None))
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-3)

    def step():
        sft_loss(forward_logprobs(model, layout)).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    tensors = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
               for t in [*model.parameters(), *model.buffers()]}
    measured = sum(tensors.values()) + _profiled_peak(step)
    shape = ModelShape.from_config(model.get_base_model().config)
    rows = sum(p.shape[0] for n, p in model.named_parameters() if p.requires_grad and "trainable_tokens" in n)
    added = model.get_base_model().get_input_embeddings().weight.shape[0] - shape.vocab
    est = estimate_training_memory(shape, dtype, tokens=len(layout), targets=len(layout.sampled()[0]),
                                   trainable_rows=rows, added_rows=added, gradient_checkpointing=checkpointing)
    assert len(layout) > 500 and rows > 0
    assert measured <= est.total <= 1.4 * measured, (est.total, measured, est.parts)


def test_a_run_that_does_not_fit_fails_before_loading_naming_the_figure_and_the_flag(tiny_llama, tmp_path):
    with pytest.raises(ParameterError) as e:
        train_sft(EXAMPLES, tmp_path / "run", _settings(1), base=str(tiny_llama), progress=False,
                  max_memory_gib=0.0001)
    msg = str(e.value)
    assert "\n" not in msg and e.value.param == "--dtype"
    est = float(msg.split("needs an estimated ")[1].split(" MiB")[0])
    assert 1 < est < 100 and "more than 0.1 MiB (--max-memory-gib 0.0001)" in msg
    assert "--dtype bfloat16" in msg and "--gradient-checkpointing" in msg
    assert not (tmp_path / "run").exists()  # nothing written, nothing loaded


def _cli(tmp_path, tiny_llama, *extra: str) -> tuple[int, Path]:
    """``train sft`` for one step with ``extra`` flags: (exit status, its OUT folder)."""
    from pasta_engine.entrypoints.cli import main

    out = tmp_path / f"o{len(list(tmp_path.iterdir()))}"

    prompts = tmp_path / "p.json"
    prompts.write_text(json.dumps([{"instruction": SLEEP_PROMPT, "dataset": "koala",
                                    "output": "Tips:\n1. Go to bed early.\n2. Avoid screens at night.\n"}]))
    try:
        rc = main(["train", "sft", "--prompts", str(prompts), "--model", str(tiny_llama), "--out", str(out),
                   "--grad-accum", "1", "--max-steps", "1", "--lora-r", "4", "--lora-alpha", "8", *extra])
    except SystemExit as e:  # argparse
        rc = e.code
    return rc, out


def test_the_command_prints_the_estimate_and_refuses_bad_values_before_any_work(tiny_llama, tmp_path, capsys):
    rc, out = _cli(tmp_path, tiny_llama, "--max-memory-gib", "0.0001")
    err = capsys.readouterr().err
    last = err.splitlines()[-1]  # the error: one line, after the examples' count
    assert rc == 2 and last.startswith("pasta-engine: error: train sft needs an estimated")
    assert "--gradient-checkpointing" in last and not (out / "adapter").exists()
    for flags, name in [(("--device", "tpu"), "--device"), (("--dtype", "float8"), "--dtype"),
                        (("--max-memory-gib", "-1"), "--max-memory-gib")]:
        rc, out = _cli(tmp_path, tiny_llama, *flags)
        err = capsys.readouterr().err
        assert rc == 2 and name in err, err
        assert not out.exists()  # refused before any work
    if not torch.cuda.is_available():
        rc, _ = _cli(tmp_path, tiny_llama, "--device", "cuda")
        err = capsys.readouterr().err
        assert rc == 2 and "--device cuda" in err and "no CUDA GPU" in err
    rc, _ = _cli(tmp_path, tiny_llama, "--max-memory-gib", "64")
    err = capsys.readouterr().err
    assert rc == 0 and "train sft: memory estimate" in err and "limit 64.00 GiB (--max-memory-gib 64)" in err


def test_a_bfloat16_step_on_the_cpu(tiny_llama, tmp_path):
    settings = SFTSettings(epochs=1, grad_accum=2, max_steps=1, dtype="bfloat16", gradient_checkpointing=True,
                           lora=LoraSettings(r=4, alpha=8))
    summary = train_sft(EXAMPLES[:2], tmp_path / "bf16", settings, base=str(tiny_llama), progress=False)
    assert summary["scale"]["dtype"] == "bfloat16" and summary["optimizer_steps"] == 1
    assert torch.isfinite(torch.tensor(summary["first_loss"]))
    lora = _tensors(tmp_path / "bf16" / "checkpoint" / "adapter" / "adapter_model.safetensors")
    b = [v for k, v in lora.items() if "lora_B" in k]
    assert b and all(v.dtype == torch.float32 for v in b)  # the adapter trains in float32
    assert any(v.abs().max() > 0 for v in b)  # B starts at zero: the step moved it


def test_a_bonbon_round_in_bfloat16_with_checkpointing_and_its_memory_check(tiny_llama, tmp_path):
    from pasta_engine.train.bonbon import BonbonSettings, train_bonbon

    train_sft(EXAMPLES[:2], tmp_path / "sft", SFTSettings(epochs=1, grad_accum=2, lora=LoraSettings(r=4, alpha=8)),
              base=str(tiny_llama), progress=False)
    settings = BonbonSettings(n=2, max_new_tokens=8, temperature=1.0, best_must_finish=False, grad_accum=1, lr=1e-2,
                              kv_cache_mb=16, max_running_requests=4, dtype="bfloat16", gradient_checkpointing=True)
    with pytest.raises(ParameterError) as e:  # the engine's 16 MiB KV cache alone is over the limit
        train_bonbon(["tips"], tmp_path / "sft" / "adapter", tmp_path / "no", settings, base=str(tiny_llama),
                     scorer=lambda prompt, text: -len(text) / 100, progress=False, max_memory_gib=0.01)
    assert "train bonbon (sampling) needs an estimated" in str(e.value) and "--max-running-requests" in str(e.value)
    assert not (tmp_path / "no").exists()
    summary = train_bonbon(["tips", "sleep"], tmp_path / "sft" / "adapter", tmp_path / "bb", settings,
                           base=str(tiny_llama), scorer=lambda prompt, text: -len(text) / 100, progress=False)
    [r] = summary["rounds"]
    assert r["pairs"] >= 1 and r["optimizer_steps"] >= 1 and summary["settings"]["dtype"] == "bfloat16"
    lora = _tensors(tmp_path / "bb" / "adapter" / "adapter_model.safetensors")
    before = _tensors(tmp_path / "sft" / "adapter" / "adapter_model.safetensors")
    assert any(not torch.equal(lora[k], before[k]) for k in lora)  # the round trained the adapter


@pytest.mark.parametrize("arch", ["tiny_llama", "tiny_qwen2", "tiny_qwen3", "tiny_gemma"])
def test_the_parameter_count_is_exact(arch, request):
    from transformers import AutoConfig, AutoModelForCausalLM

    path = request.getfixturevalue(arch)
    cfg = AutoConfig.from_pretrained(path)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    assert ModelShape.from_config(cfg).params() == sum(p.numel() for p in model.parameters())


def test_the_published_shapes_give_the_published_sizes():
    # Llama 3.1 8B: 8,030,261,248 parameters; Gemma 7B: 8,537,680,896 (their model cards' and
    # safetensors index's totals); Qwen3-8B: 8.2 B, 6.95 B without the embeddings (its model card)
    assert PUBLISHED_SHAPES["Llama-3.1-8B-Instruct"].params() == 8_030_261_248
    assert PUBLISHED_SHAPES["Gemma-7B-it"].params() == 8_537_680_896
    q = PUBLISHED_SHAPES["Qwen3-8B"]
    assert q.params() / 1e9 == pytest.approx(8.19, abs=0.01)
    assert (q.params() - 2 * q.vocab * q.hidden) / 1e9 == pytest.approx(6.95, abs=0.01)


def test_the_recipe_table_scales_training_by_eight_and_not_sampling():
    from pasta_engine.train.scale import recipe_table

    rows = recipe_table()
    assert {r["model"] for r in rows} == set(PUBLISHED_SHAPES) and len(rows) == 3 * 5
    for r in rows:
        if r["stage"].startswith("SFT"):
            assert r["h100x8_s"] == pytest.approx(r["h100_s"] / 8)
            assert r["memory_gc_gib"] < r["memory_gib"] < 80  # fits one H100 in bfloat16
        else:
            assert r["h100x8_s"] == r["h100_s"]


@pytest.mark.gpu
def test_sft_on_cuda_in_bfloat16_stays_under_its_estimate(tiny_llama, tmp_path):
    # what earlier tests of this process still hold is not this training's: the peak counts from here
    held_before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    settings = SFTSettings(epochs=1, grad_accum=2, max_steps=2, device="cuda", dtype="bfloat16",
                           lora=LoraSettings(r=4, alpha=8))
    summary = train_sft(EXAMPLES[:4], tmp_path / "gpu", settings, base=str(tiny_llama), progress=False)
    assert summary["scale"]["device"].startswith("cuda") and summary["optimizer_steps"] == 2
    assert torch.isfinite(torch.tensor(summary["first_loss"]))
    # + 64 MiB: cuBLAS workspaces (allocated through the caching allocator) are not in the estimate
    assert torch.cuda.max_memory_allocated() - held_before <= summary["scale"]["memory_estimate_bytes"] + 64 * 2**20


def test_train_answers_through_the_engine_equals_greedy_generation(tiny_llama, tmp_path):
    """Issue 34: ``train answers`` samples through the engine, batched (here 2 prompts per call,
    decoded together), and its greedy answers are the engine's own sequential answers to the
    same prompts one at a time: batching and the device flag change nothing."""
    import json as _json

    from pasta_engine import Engine, SamplingParams
    from pasta_engine.entrypoints.cli import main

    rows = [{"instruction": f"Name {k} things.", "dataset": "koala"} for k in ("two", "three", "four")]
    rows.append({"instruction": "never", "dataset": "vicuna"})
    prompts = tmp_path / "p.json"
    prompts.write_text(_json.dumps(rows))
    assert main(["train", "answers", "--prompts", str(prompts), "--model", str(tiny_llama), "--out", str(tmp_path / "a"),
                 "--temperature", "0", "--repetition-penalty", "1.1", "--max-new-tokens", "12", "--batch", "2",
                 "--device", "cpu"]) == 0
    got = _json.loads((tmp_path / "a" / "answers.json").read_text())
    assert [r["instruction"] for r in got] == [r["instruction"] for r in rows[:3]]  # never the vicuna row
    engine = Engine.from_pretrained(tiny_llama, adapter=None, max_running_requests=1)
    for r in got:
        [one] = engine.generate([r["instruction"]], SamplingParams(max_new_tokens=12, temperature=0.0,
                                                                    repetition_penalty=1.1), mode="sequential")
        assert r["output"] == one.text and r["tokens"] == one.stats.tokens_decoded
