"""pasta-engine: PASTA learned asynchronous decoding (Jin et al., ICML 2025, arXiv 2502.11517).

A model marks independent chunks of its answer with PASTA-LANG tags; the interpreter forks a
decoding thread per chunk and the scheduler advances all threads in one forward per step.
"""

import os as _os

if "TRITON_INTERPRET" not in _os.environ:
    # No CUDA GPU: Triton kernels run under Triton's interpreter, which must be chosen before
    # triton is first imported (its own helpers such as tl.sum are decorated at import time).
    import torch as _torch

    if not _torch.cuda.is_available():
        _os.environ["TRITON_INTERPRET"] = "1"

from .engine import Engine, RequestResult, RequestStats
from .interpreter import Limits, PositionPolicy
from .kv_cache import KVCacheExhausted
from .model import UnsupportedModelError
from .sampling import SamplingParams

__all__ = [
    "Engine",
    "SamplingParams",
    "RequestResult",
    "RequestStats",
    "Limits",
    "PositionPolicy",
    "KVCacheExhausted",
    "UnsupportedModelError",
]
__version__ = "0.1.0"
