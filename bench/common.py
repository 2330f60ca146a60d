"""Shared helpers of the GPU benchmarks: device facts, measured copy bandwidth, timing, JSON."""

from __future__ import annotations

import json
import platform
import subprocess
import sys
import time
from pathlib import Path

import torch

RESULTS = Path(__file__).resolve().parent / "results"


def device_info() -> dict:
    """Device name, SM count, versions (torch, triton, CUDA, driver), host."""
    info = {"python": platform.python_version(), "torch": torch.__version__, "host": platform.node()}
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        pass
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        info.update(device=p.name, sms=p.multi_processor_count, memory_gib=round(p.total_memory / 2**30, 1),
                    cuda=torch.version.cuda)
        try:
            info["driver"] = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                            capture_output=True, text=True, timeout=20).stdout.strip()
        except (OSError, subprocess.TimeoutExpired):
            pass
    else:
        info["device"] = "cpu"
    return info


def copy_bandwidth(n_bytes: int = 2 << 30, reps: int = 20) -> float:
    """Measured device-to-device copy bandwidth in bytes/s (read plus written): the package's
    :func:`pasta_engine.tools.bench_kernels.copy_bandwidth` on the current GPU."""
    from pasta_engine.tools.bench_kernels import copy_bandwidth as measure

    return measure("cuda", n_bytes, reps)


def bench_us(fn, warmup: int = 5, rep: int = 50) -> float:
    """Median microseconds of ``fn`` (triton.testing.do_bench: CUDA events, L2 flushed)."""
    from triton.testing import do_bench

    return 1e3 * do_bench(fn, warmup=warmup, rep=rep, return_mode="median")


def new_path(path: Path, overwrite: bool = False) -> Path:
    """Where a result meant for ``path`` goes: ``path`` itself when it does not exist yet or
    ``overwrite`` is set, else a new file beside it, ``<stem>-2<suffix>``, ``-3``, ... (the first
    free one): a rerun never replaces a committed result unless told to."""
    path = Path(path)
    if overwrite or not path.exists():
        return path
    n = 2
    while (cand := path.with_name(f"{path.stem}-{n}{path.suffix}")).exists():
        n += 1
    return cand


def write_json(name: str, payload: dict, overwrite: bool = False, out: Path | None = None) -> Path:
    """Write ``out`` (default ``bench/results/<name>.json``) with the command line and a timestamp
    added; an existing file is kept unless ``overwrite`` (the result goes to :func:`new_path`)."""
    payload = {"command": " ".join([Path(sys.executable).name] + sys.argv), "time": time.strftime("%Y-%m-%d %H:%M:%S"),
               **payload}
    path = new_path(out if out is not None else RESULTS / f"{name}.json", overwrite)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=1))
    print(f"wrote {path}")
    return path
