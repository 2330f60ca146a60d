"""The package installs without scripts/setup.sh (issue 20): a wheel built from this checkout,
installed with ``--no-deps`` into a fresh venv that sees this environment's packages (torch and the
rest come from here, so nothing is downloaded and no CUDA torch is pulled), reports the version in
pyproject.toml and answers a tiny-preset generate, run from a folder outside the checkout."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _pyproject_version() -> str:
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        import re

        return re.search(r'^version = "([^"]+)"', (ROOT / "pyproject.toml").read_text(), re.M).group(1)
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]


def _run(cmd: list, cwd: Path, env: dict | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    out = subprocess.run([str(c) for c in cmd], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, f"{cmd}: exit {out.returncode}\n{out.stdout[-2000:]}\n{out.stderr[-3000:]}"
    return out


@pytest.mark.slow
def test_the_wheel_installs_in_a_fresh_venv_and_generates(tmp_path):
    version = _pyproject_version()
    # built from a copy of what the wheel is made of, so the build writes nothing into the checkout
    src = tmp_path / "src"
    skip = shutil.ignore_patterns("__pycache__", "*.pyc", "*.so")
    for name in ("pasta_engine", "triton_kernels"):
        shutil.copytree(ROOT / name, src / name, symlinks=True, ignore=skip)
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(ROOT / name, src / name)
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-q", src,
          "-w", tmp_path / "dist"], cwd=tmp_path)
    [wheel] = (tmp_path / "dist").glob("pasta_engine-*.whl")
    assert wheel.name.startswith(f"pasta_engine-{version}-")
    names = zipfile.ZipFile(wheel).namelist()
    for want in ("pasta_engine/py.typed", f"pasta_engine-{version}.dist-info/licenses/LICENSE",
                 "pasta_engine/entrypoints/openai/static/index.html", "pasta_engine/triton_kernels/__init__.py",
                 "pasta_engine/adapters/smollm2-135m-pasta/adapter_model.safetensors"):
        assert want in names, want
    # every subpackage of the checkout is in the wheel (pasta_engine.distributed once was not)
    for init in sorted((ROOT / "pasta_engine").glob("*/__init__.py")):
        assert f"pasta_engine/{init.parent.name}/__init__.py" in names, init.parent.name

    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", "--system-site-packages", venv], cwd=tmp_path)
    bindir = venv / ("Scripts" if os.name == "nt" else "bin")
    python = bindir / ("python.exe" if os.name == "nt" else "python")
    # this environment's packages (torch, transformers, ...) after the venv's own: a .pth line adds
    # the folder to sys.path without running its .pth files (so no editable install of this checkout)
    site = Path(_run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], cwd=tmp_path)
                .stdout.strip())
    here = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}
    (site / "outer_env.pth").write_text("\n".join(sorted(here)) + "\n")
    _run([sys.executable, "-m", "pip", "--python", python, "install", "--no-deps", "--no-index", "-q", wheel],
         cwd=tmp_path)

    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    env.update(OMP_NUM_THREADS="1", PASTA_ENGINE_CACHE=str(tmp_path / "cache"))
    exe = bindir / "pasta-engine"
    assert _run([exe, "--version"], cwd=tmp_path, env=env).stdout.strip() == f"pasta-engine {version}"
    where = _run([python, "-c", "import pasta_engine, pasta_engine.distributed.executor; print(pasta_engine.__file__); "
                  "print(pasta_engine.__version__)"], cwd=tmp_path, env=env).stdout.split()
    assert Path(where[0]).is_relative_to(venv) and where[1] == version  # the wheel's copy, not this checkout
    out = _run([exe, "generate", "Give me two tips.", "--preset", "tiny-llama", "--max-new-tokens", "4",
                "--kv-cache-mb", "8", "--json"], cwd=tmp_path, env=env)
    row = json.loads(out.stdout.strip().splitlines()[-1])
    assert row["pasta"]["stats"]["finish_reason"] in ("stop", "length") and row["pasta"]["token_ids"]
    # tensor parallelism from the installed copy: two ranks start, decode and give rank 0's answer
    out = _run([exe, "generate", "Give me two tips.", "--preset", "tiny-llama", "--max-new-tokens", "4",
                "--kv-cache-mb", "8", "--tensor-parallel-size", "2", "--json"], cwd=tmp_path, env=env)
    tp = json.loads(out.stdout.strip().splitlines()[-1])
    assert tp["pasta"]["token_ids"] == row["pasta"]["token_ids"]
