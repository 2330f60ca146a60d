"""A finished BoNBoN round is reused only under the inputs it was sampled, scored and trained with:
train_bonbon run again into an OUT whose round1 was done skipped it before any check, so a run with
other prompts, --n, --seed, --alpha or --lr returned the first run's adapter and a summary.json
stating settings that trained nothing. (train_bonbon is called directly: on the random tiny model
only best_must_finish=False yields a pair, which the command line does not set.)"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch

from sample_traces import SLEEP_PROMPT as PROMPT  # noqa: E402  (tests/sample_traces.py)
from sample_traces import SLEEP_TIPS as ANNOTATED  # noqa: E402

torch.set_num_threads(1)

PROMPTS = ["How to sleep better 0?", "How to sleep better 1?"]


@pytest.fixture(scope="module")
def done_round(tiny_llama, tmp_path_factory) -> tuple[Path, Path]:
    """``(sft adapter, OUT)``: OUT's round1 trained to the end under :func:`_settings`."""
    from pasta_engine.train.bonbon import train_bonbon
    from pasta_engine.train.common import LoraSettings
    from pasta_engine.train.data import TrainExample
    from pasta_engine.train.sft import SFTSettings, train_sft

    sft = tmp_path_factory.mktemp("sft")
    train_sft([TrainExample(PROMPT, ANNOTATED, "koala", "sot", 3, 40)] * 2, sft,
              SFTSettings(epochs=1, grad_accum=2, lora=LoraSettings(r=4, alpha=8)), base=str(tiny_llama), progress=False)
    out = tmp_path_factory.mktemp("bb")
    train_bonbon(PROMPTS, sft / "adapter", out, _settings(), base=str(tiny_llama), progress=False)
    assert (out / "round1" / "round.json").exists()
    return sft / "adapter", out


def _settings(**kw):
    from pasta_engine.train.bonbon import BonbonSettings

    return BonbonSettings(**{"n": 2, "max_new_tokens": 6, "temperature": 1.0, "best_must_finish": False,
                             "grad_accum": 1, "kv_cache_mb": 16, "alpha": 0.5, "lr": 5e-5, "seed": 0, **kw})


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.mark.parametrize("kw, flag, shown", [
    ({"alpha": 0.9}, "--alpha", "--alpha 0.5 then, 0.9 now"),
    ({"lr": 1e-3}, "--lr", "--lr 5e-05 then, 0.001 now"),
    ({"n": 3}, "--n", "--n 2 then, 3 now"),
    ({"seed": 7}, "--seed", "--seed 0 then, 7 now"),
    ({"epochs": 2}, "--epochs", "--epochs 1 then, 2 now"),
])
def test_a_finished_round_is_refused_under_other_flags(tiny_llama, done_round, kw, flag, shown):
    from pasta_engine.errors import ParameterError
    from pasta_engine.train.bonbon import train_bonbon

    adapter, out = done_round
    before = {p: _sha(p) for p in sorted(out.rglob("*")) if p.is_file()}
    with pytest.raises(ParameterError, match="same flags.*new --out") as e:
        train_bonbon(PROMPTS, adapter, out, _settings(**kw), base=str(tiny_llama), progress=False)
    assert e.value.param == flag
    assert shown in str(e.value) and "round1 is a finished round" in str(e.value)
    assert {p: _sha(p) for p in sorted(out.rglob("*")) if p.is_file()} == before  # refused before any work


def test_a_finished_round_is_refused_for_other_prompts(tiny_llama, done_round):
    """The reviewer's run: other prompts, --n, --alpha, --lr and --seed at once; the first is named."""
    from pasta_engine.errors import ParameterError
    from pasta_engine.train.bonbon import train_bonbon

    adapter, out = done_round
    with pytest.raises(ParameterError, match="2 of 2 prompts differ") as e:
        train_bonbon(["How to sleep better 2?", "How to sleep better 3?"], adapter, out,
                     _settings(n=3, alpha=0.9, lr=1e-3, seed=7), base=str(tiny_llama), progress=False)
    assert e.value.param == "--prompts"
    for each in ("--n 2 then, 3 now", "--alpha 0.5 then, 0.9 now", "--lr 5e-05 then, 0.001 now",
                 "--seed 0 then, 7 now"):
        assert each in str(e.value)


def test_a_finished_round_is_reused_under_the_same_flags(tiny_llama, done_round, capsys):
    from pasta_engine.train.bonbon import train_bonbon

    adapter, out = done_round
    trained = _sha(out / "round1" / "adapter" / "adapter_model.safetensors")
    assert json.loads((out / "round1" / "round.json").read_text())["training"]["alpha"] == 0.5
    s = train_bonbon(PROMPTS, adapter, out, _settings(), base=str(tiny_llama), progress=False)
    assert "done before, resumed from" in capsys.readouterr().err
    assert _sha(out / "round1" / "adapter" / "adapter_model.safetensors") == trained
    assert _sha(out / "adapter" / "adapter_model.safetensors") == trained
    assert s["rounds"][0]["training"]["lr"] == s["settings"]["lr"] == 5e-5


def test_a_round_from_before_the_records_resumes_as_before(tiny_llama, done_round, tmp_path, capsys):
    """A round folder written by an older version (no sampling.json, no training record) is reused."""
    import shutil

    from pasta_engine.train.bonbon import train_bonbon

    adapter, out = done_round
    old = tmp_path / "old"
    shutil.copytree(out, old)
    (old / "round1" / "sampling.json").unlink()
    record = json.loads((old / "round1" / "round.json").read_text())
    del record["training"]
    (old / "round1" / "round.json").write_text(json.dumps(record))
    train_bonbon(PROMPTS, adapter, old, _settings(alpha=0.9), base=str(tiny_llama), progress=False)
    assert "done before, resumed from" in capsys.readouterr().err
