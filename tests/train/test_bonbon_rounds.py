"""BoNBoN rounds: what summary.json says the quality term was, the reader folder of a round
sampled again, and resuming a round only under the settings its samples were drawn with, with the
scores a failing judge had already given kept."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from sample_traces import SLEEP_PROMPT as PROMPT  # noqa: E402  (tests/sample_traces.py)
from sample_traces import SLEEP_TIPS as ANNOTATED  # noqa: E402

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def sft_adapter(tiny_llama, tmp_path_factory) -> Path:
    from pasta_engine.train.common import LoraSettings
    from pasta_engine.train.data import TrainExample
    from pasta_engine.train.sft import SFTSettings, train_sft

    out = tmp_path_factory.mktemp("sft")
    train_sft([TrainExample(PROMPT, ANNOTATED, "koala", "sot", 3, 40)] * 2, out,
              SFTSettings(epochs=1, grad_accum=2, lora=LoraSettings(r=4, alpha=8)), base=str(tiny_llama), progress=False)
    return out / "adapter"


@dataclass
class _Endpoint:
    name: str = "judge-model at http://127.0.0.1:9/v1"


@dataclass
class _Judge:
    """Stands in for tools.judge.JudgeQuality: a win value per sample, ``fail_at`` calls raise."""

    endpoint: _Endpoint = field(default_factory=_Endpoint)
    verdicts: list = field(default_factory=list)
    calls: int = 0
    fail_at: int | None = None

    def __call__(self, prompt: str, text: str) -> float:
        self.calls += 1
        if self.fail_at is not None and self.calls >= self.fail_at:
            raise RuntimeError("judge: the reply holds no JSON object")
        win = float(self.calls % 2)
        self.verdicts.append({"prompt": prompt, "win": win})
        return win


def _settings(**kw):
    from pasta_engine.train.bonbon import BonbonSettings

    return BonbonSettings(**{"n": 2, "max_new_tokens": 6, "temperature": 1.0, "best_must_finish": False,
                             "grad_accum": 1, "kv_cache_mb": 16, **kw})


def test_summary_names_the_judge_not_the_likelihood_proxy(tiny_llama, sft_adapter, tmp_path):
    """A --judge-url run's summary.json said 'base model mean log-likelihood ... (a proxy, not a judge)'."""
    from pasta_engine.train.bonbon import train_bonbon

    s = train_bonbon(["tips", "sleep"], sft_adapter, tmp_path / "bb", _settings(), base=str(tiny_llama),
                     scorer=_Judge(), progress=False)
    on_disk = json.loads((tmp_path / "bb" / "summary.json").read_text())
    assert on_disk["quality_term"] == s["quality_term"] == "judge"
    assert "judge-model at http://127.0.0.1:9/v1" in on_disk["quality"]
    assert "log-likelihood" not in json.dumps(on_disk)
    # the resolved dtype and device (settings keep None for "the device's default")
    assert (on_disk["device"], on_disk["dtype"]) == ("cpu", "float32")
    rows = [json.loads(x) for x in (tmp_path / "bb" / "round1" / "samples.jsonl").read_text().splitlines()]
    assert all(r["quality"] in (0.0, 1.0) for r in rows)

    proxy = train_bonbon(["tips"], sft_adapter, tmp_path / "proxy", _settings(), base=str(tiny_llama), progress=False)
    assert proxy["quality_term"] == "likelihood proxy" and "log-likelihood" in proxy["quality_proxy"]


def test_a_round_sampled_again_moves_the_old_reader_folder_aside(tiny_llama, sft_adapter, tmp_path):
    """Another --n re-sampled the round but kept reader/ with the old samples' pairs."""
    from pasta_engine.train.bonbon import ReaderVerdictsPending, read_round_picks, train_bonbon

    refs = {"tips": "Sleep well.", "sleep": "Go to bed."}
    for n in (2, 3):
        with pytest.raises(ReaderVerdictsPending):
            train_bonbon(list(refs), sft_adapter, tmp_path / "bb", _settings(n=n), base=str(tiny_llama),
                         reader_references=refs, progress=False)
    reader = tmp_path / "bb" / "round1" / "reader"
    assert len((reader / "pairs.jsonl").read_text().splitlines()) == 6  # the new samples' pairs
    assert len(((reader.parent / "reader.stale") / "pairs.jsonl").read_text().splitlines()) == 4
    # a samples file from elsewhere beside these pairs is refused, not joined by position
    samples = reader.parent / "samples.jsonl"
    rows = [json.loads(x) for x in samples.read_text().splitlines()]
    rows[0]["text"] = "another answer"
    samples.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(ValueError, match="remove .*reader"):
        read_round_picks(reader.parent)


def test_resume_refuses_other_settings_and_keeps_a_failing_judges_scores(tiny_llama, sft_adapter, tmp_path):
    """A judge that failed at the last sample lost the round (no samples.jsonl); a resume reused
    samples drawn under other flags whenever the row count matched."""
    from pasta_engine.train.bonbon import train_bonbon

    out, prompts = tmp_path / "bb", ["tips", "sleep"]
    with pytest.raises(RuntimeError, match="no JSON"):
        train_bonbon(prompts, sft_adapter, out, _settings(), base=str(tiny_llama), scorer=_Judge(fail_at=4),
                     progress=False)
    rdir = out / "round1"
    rows = [json.loads(x) for x in (rdir / "samples.jsonl").read_text().splitlines()]
    assert len(rows) == 4 and all(r["score"] is None for r in rows)  # the samples are kept
    assert len((rdir / "scores.jsonl").read_text().splitlines()) == 3  # and the three verdicts paid for

    for kw, what in (({"max_new_tokens": 7}, "--max-new-tokens 6 then, 7 now"), ({"temperature": 0.3}, "temperature"),
                     ({"seed": 5}, "seed")):
        with pytest.raises(ValueError, match=f"other settings: .*{what}.*remove .*round1"):
            train_bonbon(prompts, sft_adapter, out, _settings(**kw), base=str(tiny_llama), scorer=_Judge(),
                         progress=False)
    with pytest.raises(ValueError, match="--prompts: 2 of 2 prompts differ"):
        train_bonbon(["other", "questions"], sft_adapter, out, _settings(), base=str(tiny_llama), scorer=_Judge(),
                     progress=False)

    judge = _Judge()
    train_bonbon(prompts, sft_adapter, out, _settings(), base=str(tiny_llama), scorer=judge, progress=False)
    assert judge.calls == 1  # only the sample the failed reply left unscored
    again = [json.loads(x) for x in (rdir / "samples.jsonl").read_text().splitlines()]
    assert [r["text"] for r in again] == [r["text"] for r in rows] and all(r["score"] is not None for r in again)
