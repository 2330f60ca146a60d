"""The CPU thread policy (issue 20, Measuring; issue 31 item 4): ``--threads auto`` and
``Engine.from_pretrained(threads="auto")`` leave the cores other work holds alone (torch's default
of one thread per core collapses when another process is busy, bench/results/cpu_threads.json);
N sets N; the Python API and the CLI apply the same policy in one place."""

from __future__ import annotations

import pytest
import torch

from pasta_engine.entrypoints.cli import main


def test_cpu_threads_policy(monkeypatch):
    import pasta_engine.worker.cpu_threads as a
    from pasta_engine.worker.cpu_threads import cpu_threads

    monkeypatch.setattr(a.os, "sched_getaffinity", lambda pid: set(range(16)))
    for busy, want in ((0.0, 4), (12.2, 3), (15.5, 1), (40.0, 1)):
        monkeypatch.setattr(a, "busy_cores", lambda b=busy: b)
        assert cpu_threads("auto") == want
    monkeypatch.setattr(a.os, "sched_getaffinity", lambda pid: {0, 1})
    monkeypatch.setattr(a, "busy_cores", lambda: 1.0)  # one other busy process on two cores: one thread
    assert cpu_threads("auto") == 1
    assert cpu_threads(3) == 3
    assert a.busy_cores() >= 0


def test_threads_flag_sets_torch_threads(tiny_llama, built, capsys):
    before = torch.get_num_threads()
    try:
        rc = main(["generate", "x", "--model", str(tiny_llama), "--max-new-tokens", "2", "--kv-cache-mb", "8",
                   "--threads", "1"])
        assert rc == 0 and torch.get_num_threads() == 1
        assert built[0][1]["cpu_threads"] == 1 and built[0][1]["cpu_threads_flag"] == 1
    finally:
        torch.set_num_threads(before)
    capsys.readouterr()
    with pytest.raises(SystemExit):
        main(["generate", "x", "--threads", "0"])
    assert "--threads: expected auto or an integer from 1 to 4096, got '0'" in capsys.readouterr().err


def test_from_pretrained_applies_the_policy_and_refuses_a_bad_value(tiny_llama, monkeypatch):
    import pasta_engine.worker.cpu_threads as a
    from pasta_engine import Engine
    from pasta_engine.errors import ParameterError

    before = torch.get_num_threads()
    try:
        monkeypatch.setattr(a.os, "sched_getaffinity", lambda pid: {0, 1})
        monkeypatch.setattr(a, "busy_cores", lambda: 1.0)  # another busy process: the Python API takes one thread
        torch.set_num_threads(2)
        engine = Engine.from_pretrained(tiny_llama, kv_cache_bytes=8 * 2**20)
        assert engine.cpu_threads == 1 and torch.get_num_threads() == 1
        engine = Engine.from_pretrained(tiny_llama, kv_cache_bytes=8 * 2**20, threads=2)
        assert engine.cpu_threads == 2 and torch.get_num_threads() == 2
        torch.set_num_threads(1)
        engine = Engine.from_pretrained(tiny_llama, kv_cache_bytes=8 * 2**20, threads=None)  # left alone
        assert engine.cpu_threads is None and torch.get_num_threads() == 1
        for bad in (0, -1, "four", 2.5, True):
            with pytest.raises(ParameterError, match="threads"):
                Engine.from_pretrained(tiny_llama, kv_cache_bytes=8 * 2**20, threads=bad)
    finally:
        torch.set_num_threads(before)
