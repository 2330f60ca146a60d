"""Import a script of ``bench/`` as a module (the scripts are not a package)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

BENCH = Path(__file__).resolve().parents[1] / "bench"


def load_bench(script: str) -> ModuleType:
    """``bench/<script>`` imported under the name ``bench_<stem>`` (registered in ``sys.modules``,
    so its dataclasses can look their module up). Raises FileNotFoundError for a missing script."""
    path = BENCH / script
    if not path.exists():
        raise FileNotFoundError(path)
    name = "bench_" + path.stem.removeprefix("bench_")
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod
