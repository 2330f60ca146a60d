"""The engine core: requests, the interpreter, the scheduler, the block manager, the model
runner, and the step loop over them (:class:`~pasta_engine.engine.llm_engine.Engine`), and the
async engine that owns that loop on a background thread
(:class:`~pasta_engine.engine.async_engine.AsyncEngine`)."""

from .async_engine import AsyncEngine, RequestStream, StreamOutput
from .llm_engine import Engine
from .request import RequestOutput, RequestResult, RequestStats
from .streaming import OutputKind, ThreadEvent

__all__ = ["Engine", "AsyncEngine", "RequestStream", "StreamOutput", "OutputKind", "ThreadEvent", "RequestOutput",
           "RequestResult", "RequestStats"]
