"""A chat model behind any OpenAI-compatible endpoint (OpenAI, vLLM, SGLang, our own ``serve``):
the client that the ``endpoint`` annotator (:mod:`pasta_engine.tools.annotate_endpoint`) and the
pairwise judge (:mod:`pasta_engine.tools.judge`) share.

It is the ``openai`` client (``pip install 'pasta-engine[train]'``) with its retries and timeout;
every failure (connection, HTTP status, a body that is not JSON, an empty or missing reply) is an
:class:`EndpointError`
that names the endpoint and the model, so a bad URL fails the command with a line that says what
to fix instead of a traceback from inside a training round.

Example (against a local ``pasta-engine serve --port 8000``)::

    from pasta_engine.tools.endpoint import ChatEndpoint
    ep = ChatEndpoint("http://127.0.0.1:8000/v1", "smollm2-135m-pasta")
    print(ep.complete([{"role": "user", "content": "Say hi."}], max_tokens=16))
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

from ..errors import ParameterError, PastaEngineError

__all__ = ["ChatEndpoint", "EndpointError", "API_KEY_ENV"]

#: Environment variables read for the API key, in order, when none is given.
API_KEY_ENV = ("PASTA_ENDPOINT_API_KEY", "OPENAI_API_KEY")


class EndpointError(RuntimeError, PastaEngineError):
    """An OpenAI-compatible endpoint failed or replied with something unusable; the message
    names the endpoint (URL and model) and what went wrong."""


@dataclass
class ChatEndpoint:
    """One model behind an OpenAI-compatible ``/v1/chat/completions``.

    Args:
        base_url: the API root, e.g. ``http://127.0.0.1:8000/v1`` (``http`` or ``https``).
        model: the model name the endpoint serves.
        api_key: the bearer token (None: the first of :data:`API_KEY_ENV` that is set, else
            ``"EMPTY"``, which local servers without a key accept).
        timeout_s: per request, in seconds.
        max_retries: the ``openai`` client's retries of connection errors, 429 and 5xx.
        client: a ready ``openai.OpenAI`` (tests); None builds one from the fields above.

    Raises :class:`~pasta_engine.errors.ParameterError` naming ``base_url`` or ``model`` when
    one is empty or the URL is not http(s), and ``timeout_s`` when it is not > 0."""

    base_url: str
    model: str
    api_key: str | None = None
    timeout_s: float = 120.0
    max_retries: int = 2
    client: Any = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if not isinstance(self.base_url, str) or not self.base_url.startswith(("http://", "https://")):
            raise ParameterError("base_url", self.base_url, "an http(s) URL of an OpenAI-compatible API root, "
                                 "e.g. http://127.0.0.1:8000/v1")
        if not isinstance(self.model, str) or not self.model.strip():
            raise ParameterError("model", self.model, "the model name the endpoint serves (GET /v1/models lists them)")
        if not self.timeout_s > 0:
            raise ParameterError("timeout_s", self.timeout_s, "a timeout in seconds > 0")
        if self.client is None:
            try:
                from openai import OpenAI
            except ImportError:
                raise ParameterError("base_url", self.base_url, message="an OpenAI-compatible endpoint needs the "
                                     "openai client: pip install 'pasta-engine[train]'") from None
            key = self.api_key or next((os.environ[k] for k in API_KEY_ENV if os.environ.get(k)), "EMPTY")
            self.client = OpenAI(base_url=self.base_url, api_key=key, timeout=self.timeout_s,
                                 max_retries=self.max_retries)

    @property
    def name(self) -> str:
        """``model at base_url``, for messages and records."""
        return f"{self.model} at {self.base_url}"

    def complete(self, messages: Sequence[Mapping[str, str]], *, max_tokens: int, temperature: float = 0.0,
                 seed: int | None = 0) -> str:
        """The assistant's reply text to ``messages`` (chat format).

        Args:
            messages: ``[{"role": ..., "content": ...}, ...]``.
            max_tokens: the reply's budget, in tokens.
            temperature: 0 for a reproducible annotation or verdict.
            seed: sent as ``seed`` (None: not sent).

        Raises :class:`EndpointError` naming the endpoint for a connection or HTTP failure, for
        a body that does not parse (invalid JSON sent as ``application/json``: the ``openai``
        client raises ``json.JSONDecodeError``, a ValueError) and for a reply without text."""
        import openai

        extra = {} if seed is None else {"seed": seed}
        try:
            resp = self.client.chat.completions.create(model=self.model, messages=list(messages),
                                                       max_tokens=max_tokens, temperature=temperature, **extra)
        except openai.APIStatusError as e:
            raise EndpointError(f"{self.name}: HTTP {e.status_code}: {_short(e.message)}") from None
        except openai.APIError as e:
            raise EndpointError(f"{self.name}: {type(e).__name__}: {_short(str(e))}") from None
        except ValueError as e:  # json.JSONDecodeError: a 200 whose body claims JSON and is not
            raise EndpointError(f"{self.name}: the reply does not parse "
                                f"({type(e).__name__}: {_short(str(e))})") from None
        try:
            text = resp.choices[0].message.content
        except (AttributeError, IndexError, TypeError):
            text = None
        if not isinstance(text, str) or not text.strip():
            raise EndpointError(f"{self.name}: the reply holds no text ({_short(repr(resp))})")
        return text


def _short(s: str, n: int = 300) -> str:
    s = " ".join(str(s).split())
    return s if len(s) <= n else s[: n - 3] + "..."
