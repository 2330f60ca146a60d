"""Triton kernels of pasta-engine, imported as ``pasta_engine.triton_kernels``.

This folder is mapped onto that package name by pyproject.toml; never import it as a
top-level ``triton_kernels`` (the name collides with other projects' packages).

On a machine without a CUDA GPU the kernels run under Triton's interpreter: importing
``pasta_engine`` sets ``TRITON_INTERPRET=1`` unless the variable is already set (Triton reads it
when a ``@triton.jit`` function is defined, its own helpers included, so it must be set before
triton is first imported; this package raises a clear error when that was missed). The interpreter has gaps (docs/DESIGN.md section 5): bfloat16 ``tl.dot`` is wrong, so CPU
tests use float16/float32.

The package is a leaf: it imports torch and triton only, never the rest of pasta_engine (an
import-linter contract holds this). Scratch memory (split-KV partials, merge counters) is
passed in by the caller, as in SGLang's decode attention.

Every kernel module registers how to compile its kernels for a real GPU target with
:func:`register_compile_spec`; ``python -m pasta_engine.triton_kernels.compile_check`` compiles
them all for ``GPUTarget("cuda", 90, 32)`` (no GPU needed), so a kernel that only a GPU can run
cannot rot unnoticed.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

import torch

if not torch.cuda.is_available() and "TRITON_INTERPRET" not in os.environ:
    os.environ["TRITON_INTERPRET"] = "1"

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0", "false", "False")
#: The dtypes the kernels take for queries, keys, values and caches (each wrapper refuses others).
FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)

if INTERPRET:
    import triton.language.standard as _std

    if type(_std.sum).__name__ != "InterpretedFunction":
        raise RuntimeError(
            "triton was imported before TRITON_INTERPRET=1 was set, so its helpers cannot run under the "
            "interpreter: import pasta_engine before triton, or export TRITON_INTERPRET=1"
        )


@dataclass
class CompileSpec:
    """One specialization of a kernel to compile ahead of time.

    ``signature`` maps every argument name to a Triton type string (``"*fp16"``, ``"i32"``,
    ``"fp32"``, ``"constexpr"``); ``constexprs`` gives the constexpr values; ``options`` the
    launch options the wrapper uses (``num_warps``, ``num_stages``)."""

    name: str
    fn: Any
    signature: dict[str, str]
    constexprs: dict[str, Any] = field(default_factory=dict)
    options: dict[str, Any] = field(default_factory=dict)


COMPILE_SPECS: list[CompileSpec] = []


def upload_int32(values, device: torch.device | str) -> torch.Tensor:
    """A host list of ints as an int32 tensor on ``device`` without a host-device sync: on
    CUDA it is staged in pinned memory (torch's caching host allocator keeps the block until the
    copy is done) and copied asynchronously; a copy from pageable memory may wait for the
    stream, which would stall the decode loop."""
    device = torch.device(device)
    if device.type != "cuda":
        return torch.as_tensor(values, dtype=torch.int32)
    host = torch.empty(len(values), dtype=torch.int32, pin_memory=True)
    host.copy_(torch.as_tensor(values, dtype=torch.int32))
    return host.to(device, non_blocking=True)


def register_compile_spec(
    name: str, fn: Any, signature: dict[str, str], constexprs: dict[str, Any], options: dict[str, Any] | None = None
) -> None:
    """Record a specialization of ``fn`` (with the wrapper's launch ``options``) for the
    GPU-target compile check."""
    COMPILE_SPECS.append(CompileSpec(name, fn, signature, constexprs, dict(options or {})))
