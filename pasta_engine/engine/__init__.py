"""The engine core: requests, the interpreter, the scheduler, the block manager, the model
runner, and the step loop over them (:class:`~pasta_engine.engine.llm_engine.Engine`)."""

from .llm_engine import Engine
from .request import RequestOutput, RequestResult, RequestStats

__all__ = ["Engine", "RequestOutput", "RequestResult", "RequestStats"]
