"""OpenAI's error body, and how the engine's errors map onto it: a bad parameter or a prompt
over the context is 400 naming the parameter as the OpenAI API spells it, a dead engine 503,
anything else 500."""

from __future__ import annotations

from typing import Any

from ...errors import ContextLengthError, EngineDeadError, ParameterError

__all__ = ["OpenAIError", "as_openai_error"]

#: the engine's parameter names as the OpenAI API spells them
_PARAM_NAMES = {
    "max_new_tokens": "max_tokens",
    "position_policy": "pasta.position_policy",
    "max_threads": "pasta.max_threads",
    "max_forks": "pasta.max_forks",
    "max_fork_depth": "pasta.max_fork_depth",
    "fork_threshold": "pasta.fork_threshold",
    "length_cut": "pasta.length_cut",
    "distinct_topics": "pasta.distinct_topics",
    "chunk_clean_end": "pasta.chunk_clean_end",
    "independent_topics": "pasta.independent_topics",
    "fork_headroom_tokens": "pasta.fork_headroom_tokens",
    "annotated_response": "pasta.annotated_response",
    "mode": "pasta.mode",
    "dialect": "pasta.dialect",
}


class OpenAIError(Exception):
    """An error answered with OpenAI's error body.

    Args:
        status: HTTP status code.
        message: what went wrong, for a person.
        type: OpenAI's error type (``invalid_request_error``, ``authentication_error``,
            ``server_error``, ...).
        param: the request parameter at fault, or None.
        code: a short machine-readable code, or None."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict[str, Any]:
        """The OpenAI error body: ``{"error": {"message", "type", "param", "code"}}``."""
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def as_openai_error(exc: BaseException, prompt_param: str = "messages") -> OpenAIError:
    """Map an engine error to OpenAI's status and body."""
    if isinstance(exc, OpenAIError):
        return exc
    if isinstance(exc, ContextLengthError):  # the prompt's length, or a floor of tokens (max_tokens, min_tokens)
        param = prompt_param if exc.param == "prompt" else _PARAM_NAMES.get(exc.param, exc.param)
        return OpenAIError(400, str(exc), param=param, code="context_length_exceeded")
    if isinstance(exc, ParameterError):
        param = exc.param if exc.param != "prompt" else prompt_param
        return OpenAIError(400, str(exc), param=_PARAM_NAMES.get(param, param))
    if isinstance(exc, EngineDeadError):
        return OpenAIError(503, str(exc), type="server_error", code="engine_dead")
    return OpenAIError(500, f"{type(exc).__name__}: {exc}", type="server_error")
