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


class _Killed(BaseException):
    pass


@pytest.mark.parametrize("kill_at", [1, 2, 3])
def test_a_kill_anywhere_in_a_save_leaves_a_whole_checkpoint_to_resume(tmp_path, monkeypatch, kill_at):
    """save_checkpoint deleted the old checkpoint before renaming the new one into place: a kill
    between the two left only ``checkpoint.tmp``, and ``--resume`` started again from step 0.
    A kill at any file operation of a save (the old one moved aside, the new one moved in, the
    old one deleted) now leaves the previous checkpoint or the new one, whole."""
    import shutil
    from pathlib import Path

    from pasta_engine.train import common

    p = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.AdamW([p], lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    save_checkpoint(tmp_path, _Adapter(), opt, sched, {"step": 1})
    calls = []
    real_rename, real_rmtree = Path.rename, shutil.rmtree

    def op(real):
        def run(*a, **k):
            calls.append(a[0])
            if len(calls) == kill_at:
                raise _Killed
            return real(*a, **k)
        return run

    monkeypatch.setattr(Path, "rename", op(real_rename))
    monkeypatch.setattr(shutil, "rmtree", op(real_rmtree))
    with pytest.raises(_Killed):
        save_checkpoint(tmp_path, _Adapter(), opt, sched, {"step": 2})
    monkeypatch.undo()
    read = common.checkpoint_state(tmp_path)  # what a resume reads, before anything is moved
    common._finish_checkpoint_swap(tmp_path)  # what the next save does first
    blob = torch.load(tmp_path / "checkpoint" / "trainer.pt", map_location="cpu", weights_only=True)
    assert read == blob["state"]
    # killed moving the old one aside (1): the old one stays; the new one not yet in place (2) or the
    # old one not yet deleted (3): the new one, written whole, is the checkpoint
    assert blob["state"]["step"] == (2 if kill_at >= 2 else 1)
    assert not (tmp_path / "checkpoint.old").exists()
    save_checkpoint(tmp_path, _Adapter(), opt, sched, {"step": 3})  # and the next save goes on from there
    assert torch.load(tmp_path / "checkpoint" / "trainer.pt", weights_only=True)["state"]["step"] == 3
    assert sorted(x.name for x in tmp_path.iterdir()) == ["checkpoint"]
