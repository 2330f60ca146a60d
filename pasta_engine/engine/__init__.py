"""The engine's front: what a user calls. :class:`~pasta_engine.engine.llm_engine.Engine` (the
step loop over the core and the worker), the async engine that owns that loop on a background
thread (:class:`~pasta_engine.engine.async_engine.AsyncEngine`), the input processor (prompts
and parameters in, checked token ids out) and the streams of the step outputs. The torch-free
core it drives is :mod:`pasta_engine.core`; the model runner is :mod:`pasta_engine.worker`."""

from ..core.outputs import RequestOutput, RequestResult, RequestStats
from .async_engine import AsyncEngine, RequestStream, StreamOutput
from .llm_engine import Engine
from .streaming import OutputKind, ThreadEvent

__all__ = ["Engine", "AsyncEngine", "RequestStream", "StreamOutput", "OutputKind", "ThreadEvent", "RequestOutput",
           "RequestResult", "RequestStats"]
