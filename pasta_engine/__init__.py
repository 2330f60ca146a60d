"""pasta-engine: PASTA learned asynchronous decoding (Jin et al., ICML 2025, arXiv 2502.11517).

A model marks independent chunks of its answer with PASTA-LANG tags; the interpreter forks a
decoding thread per chunk and the scheduler advances all threads in one forward per step.
"""

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
