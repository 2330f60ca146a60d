"""pasta-engine: PASTA learned asynchronous decoding (Jin et al., ICML 2025, arXiv 2502.11517).

A model marks independent chunks of its answer with PASTA-LANG tags; the interpreter forks a
decoding thread per chunk and the scheduler advances all threads in one forward per step.

Layout (data flows down): ``entrypoints`` (CLI, the OpenAI server) and ``tools`` (annotators,
presets, benchmarks) use ``engine``, the front (``Engine``'s step loop, ``AsyncEngine``, the input
processor, the streams), which drives ``worker`` (the model runner, the forward, CUDA graphs) and
``core`` (plain Python: requests, outputs, scheduler, interpreter, batch, block manager, render);
``distributed`` runs the worker's runner on every tensor-parallel rank; the worker uses
``models`` (checkpoints, the Llama-family forward) and ``layers`` (attention backends, rotary,
sampler); ``lang`` (tags, tokenization, prompts), ``config``, ``errors`` and ``metrics`` are plain
Python at the bottom; ``triton_kernels`` is a leaf.
"""

import os as _os

if "TRITON_INTERPRET" not in _os.environ:
    # No CUDA GPU: Triton kernels run under Triton's interpreter, which must be chosen before
    # triton is first imported (its own helpers such as tl.sum are decorated at import time).
    import torch as _torch

    if not _torch.cuda.is_available():
        _os.environ["TRITON_INTERPRET"] = "1"

from .config import EngineConfig, Limits, PositionPolicy, SamplingParams
from .engine import AsyncEngine, Engine, RequestOutput, RequestResult, RequestStats, StreamOutput, ThreadEvent
from .errors import (
    CheckpointError,
    ContextLengthError,
    EngineDeadError,
    KVCacheExhausted,
    ParameterError,
    PastaEngineError,
    UnsupportedModelError,
)

__all__ = [
    "Engine",
    "AsyncEngine",
    "StreamOutput",
    "ThreadEvent",
    "EngineConfig",
    "SamplingParams",
    "Limits",
    "PositionPolicy",
    "RequestOutput",
    "RequestResult",
    "RequestStats",
    "PastaEngineError",
    "ParameterError",
    "ContextLengthError",
    "CheckpointError",
    "KVCacheExhausted",
    "UnsupportedModelError",
    "EngineDeadError",
]


def _version() -> str:
    """The installed distribution's version (pyproject.toml's ``version``: the one place it is
    written); ``0+unknown`` in a source tree that was never installed."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("pasta-engine")
    except PackageNotFoundError:
        return "0+unknown"


__version__ = _version()
