"""The benchmark scripts in bench/ (issue 20, Measuring): a rerun writes a new result file unless
told to overwrite, and bench/plot.py draws the CPU results as well as the GPU ones."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"
RESULTS = BENCH / "results"
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def load_common():
    spec = importlib.util.spec_from_file_location("bench_common", BENCH / "common.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_new_path_keeps_an_existing_file(tmp_path):
    common = load_common()
    p = tmp_path / "r.json"
    assert common.new_path(p) == p  # nothing there yet
    p.write_text("{}")
    assert common.new_path(p) == tmp_path / "r-2.json"
    (tmp_path / "r-2.json").write_text("{}")
    assert common.new_path(p) == tmp_path / "r-3.json"
    assert common.new_path(p, overwrite=True) == p
    written = common.write_json("ignored", {"x": 1}, out=p)
    assert written == tmp_path / "r-3.json" and p.read_text() == "{}"
    assert common.write_json("ignored", {"x": 2}, out=p, overwrite=True) == p and json.loads(p.read_text())["x"] == 2


@pytest.mark.parametrize("script", ["bench_host.py", "bench_cpu_rows.py", "bench_server_load.py", "bench_csrc_ops.py",
                                    "bench_decode_step.py", "bench_tree_attention.py", "bench_threads.py"])
def test_every_result_writing_script_has_overwrite(script):
    out = subprocess.run([sys.executable, str(BENCH / script), "--help"], capture_output=True, text=True, env=ENV,
                         timeout=300)
    assert out.returncode == 0, out.stderr
    assert "--overwrite" in out.stdout


def test_bench_host_writes_a_new_file_unless_told_to_overwrite(tmp_path):
    out = tmp_path / "host.json"
    cmd = [sys.executable, str(BENCH / "bench_host.py"), "--threads", "1", "--repeats", "1", "--tail", "2",
           "--model-dir", str(tmp_path / "model"), "--out", str(out)]
    for _ in range(2):
        run = subprocess.run(cmd, capture_output=True, text=True, env=ENV, timeout=600)
        assert run.returncode == 0, run.stderr
    assert sorted(p.name for p in tmp_path.glob("*.json")) == ["host-2.json", "host.json"]
    run = subprocess.run([*cmd, "--overwrite"], capture_output=True, text=True, env=ENV, timeout=600)
    assert run.returncode == 0, run.stderr
    assert sorted(p.name for p in tmp_path.glob("*.json")) == ["host-2.json", "host.json"]
    assert json.loads(out.read_text())["results"][0]["threads"] == 1


def test_plot_draws_the_cpu_results(tmp_path):
    names = ["cpu_rows.json", "host_step_cpu.json", "host_step_cpu_before.json", "server_load_cpu.json",
             "cpu_micro_host.json", "cpu_alpaca20_generate_both.json", "cpu_threads.json"]
    cpu = [RESULTS / n for n in names]
    for p in cpu:
        shutil.copy(p, tmp_path / p.name)
    run = subprocess.run([sys.executable, str(BENCH / "plot.py"), *sorted(str(tmp_path / p.name) for p in cpu)],
                         capture_output=True, text=True, env=ENV, timeout=300)
    assert run.returncode == 0, run.stderr
    assert "skip" not in run.stdout
    for p in cpu:
        png = (tmp_path / p.name).with_suffix(".png")
        assert png.read_bytes().startswith(b"\x89PNG"), p.name
