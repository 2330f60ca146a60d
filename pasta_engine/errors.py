"""Every exception pasta-engine raises on purpose, in one place (no torch).

The failure model (docs/DESIGN.md section 7): a bad request fails alone, before it takes any
resource, with an error that names the parameter and its value (:class:`ParameterError`, and
:class:`ContextLengthError` for a prompt that leaves no room under the model's context); an
error that belongs to one request in flight ends that request only (its output says
``finish_reason="error"``); only an error the engine cannot pin on one request ends the engine
(:class:`EngineDeadError`, raised by the async wrapper).
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "PastaEngineError",
    "ParameterError",
    "ContextLengthError",
    "CheckpointError",
    "KVCacheExhausted",
    "UnsupportedModelError",
    "EngineDeadError",
]


class PastaEngineError(Exception):
    """Base class of pasta-engine's own errors."""


class ParameterError(ValueError, PastaEngineError):
    """A parameter a user set is invalid. ``param`` names it (``"temperature"``,
    ``"prompt"``, ``"page_size"``, ...) and ``value`` holds what was given, so that a server can
    answer HTTP 400 with OpenAI's ``{"param": ...}`` field.

    Args:
        param: the parameter's name as the user spells it.
        value: the value that was given.
        expected: what would be valid (completes the message).
        message: a complete message instead of the generated one."""

    def __init__(self, param: str, value: Any = None, expected: str = "", message: str | None = None):
        self.param = param
        self.value = value
        if message is None:
            shown = repr(value)
            if len(shown) > 80:
                shown = shown[:77] + "..."
            message = f"invalid {param}={shown}" + (f": expected {expected}" if expected else "")
        super().__init__(message)


class ContextLengthError(ParameterError):
    """A prompt leaves no room for a response under the model's context length
    (``max_position_embeddings``), or could never fit in the KV cache."""


class CheckpointError(ParameterError):
    """A checkpoint or adapter a user named cannot be used as it is: a file that is truncated or
    not what its name says (``config.json``, weights, ``.gguf``, tokenizer), a config whose sizes
    are impossible (``num_attention_heads: 0``), or weights that disagree with the config (a
    vocabulary of another size). ``param`` is ``"model"``, ``"adapter"`` or ``"tokenizer"`` and
    ``value`` the path; the message names the file and what is wrong with it."""


class KVCacheExhausted(RuntimeError, PastaEngineError):
    """No free KV page is left for a request (the message names the cache's size and what to
    raise)."""


class UnsupportedModelError(ValueError, PastaEngineError):
    """The checkpoint's architecture (or one of its options) is not implemented."""


class EngineDeadError(RuntimeError, PastaEngineError):
    """The engine hit an error it could not pin on one request and stopped; every open and
    later request gets this error instead of hanging. Build a new engine."""
