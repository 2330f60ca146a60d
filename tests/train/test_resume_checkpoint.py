"""``train --resume`` reads ``trainer.pt`` with ``torch.load(weights_only=True)``: what
save_checkpoint writes (optimizer, schedule, counters, the RNG state as a tensor) loads that way,
and a pickle that would run code is refused without running it (issue 20)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("peft")

from pasta_engine.errors import CheckpointError  # noqa: E402
from pasta_engine.train.common import load_checkpoint, save_checkpoint  # noqa: E402


class _Adapter:
    def save_pretrained(self, path: str, **kwargs) -> None:
        from pathlib import Path

        Path(path).mkdir(parents=True)


def test_what_save_checkpoint_writes_loads_with_weights_only(tmp_path):
    p = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.AdamW([p], lr=1e-3)
    p.grad = torch.ones(3)
    opt.step()
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    save_checkpoint(tmp_path, _Adapter(), opt, sched, {"step": 3, "elapsed_s": 1.5})
    blob = torch.load(tmp_path / "checkpoint" / "trainer.pt", map_location="cpu", weights_only=True)
    assert blob["state"] == {"step": 3, "elapsed_s": 1.5} and isinstance(blob["torch_rng"], torch.Tensor)


class _Payload:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (str(self.marker), "w"))


def test_a_trainer_pt_that_would_run_code_is_refused_unread(tmp_path):
    ck = tmp_path / "checkpoint"
    ck.mkdir()
    marker = tmp_path / "ran"
    torch.save({"optimizer": _Payload(marker)}, ck / "trainer.pt")
    with pytest.raises(CheckpointError, match="cannot resume from") as e:
        load_checkpoint(tmp_path, None, None, None)
    assert e.value.param == "resume" and not marker.exists()
