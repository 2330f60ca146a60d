"""An OpenAI-compatible HTTP server over the async engine (``pasta-engine serve``).

A thin FastAPI app (run by uvicorn) over :class:`~pasta_engine.engine.async_engine.AsyncEngine`:

* ``POST /v1/chat/completions`` and ``POST /v1/completions``, streamed (server-sent events,
  ``data: {...}`` lines ending with ``data: [DONE]``) or not; ``n``, ``max_tokens`` /
  ``max_completion_tokens`` / ``max_new_tokens``, ``temperature``, ``top_p``, ``top_k``,
  ``seed``, ``stop``, ``logprobs``, ``stream_options.include_usage``. Bodies are read by the
  pydantic models of :mod:`.schema` (vLLM's field names; a field the engine does not honour, or
  an unknown one, is a 400 naming it). Streamed text is the response in reading order
  (:mod:`pasta_engine.engine.streaming`).
* the ``pasta`` extension: in a request, ``{"mode": "pasta" | "sequential", "dialect": "pasta" |
  "apar" | "multiverse", "position_policy": ..., "max_threads": N (0 = unlimited), "max_forks":
  N, "max_fork_depth": N (>= 1), "fork_threshold": p (0 < p <= 1), "events": bool, "annotated_response": str}`` (``dialect``: the language the model writes,
  :data:`~pasta_engine.lang.dialect.DIALECT_NAMES`, default PASTA-LANG; ``annotated_response``
  replays that response, written in that dialect: forced decoding); in each choice of a
  response, ``{"annotated_text", "stats": {content_tokens, content_speedup, decode_steps,
  tokens_decoded, tag_tokens, critical_path, token_parallelism, threads, ...}, "diagnostics",
  "mode", "dialect"}``
  (:class:`~pasta_engine.core.outputs.RequestStats`, the content figures first); with ``events`` each streamed chunk's choice carries the
  thread events of that step (``pasta.events``) and the counters ``decode_steps`` and
  ``tokens_decoded``.
* ``GET /v1/pasta/events/{id}``: the thread events of a completion (by the ``id`` of its
  response), from its start and then live, as server-sent events; ``GET /v1/pasta/stats``: the
  engine's counters (KV pages free, requests running and waiting).
* ``GET /v1/models``, ``GET /health`` (200, or 503 once the engine is dead), ``GET /version``,
  ``GET /metrics`` (Prometheus, vLLM's metric names with the ``pasta:`` prefix), ``GET
  /openapi.json`` (the request schemas; no Swagger UI is served: ``/docs`` would load its script
  from a CDN) and ``GET /``: a single static page that shows the threads decoding side by side.
  Every GET route answers HEAD too.

Limits and hygiene: a request body must be ``Content-Type: application/json`` (415), at most
``max_body_bytes`` (413), nest at most :data:`~.schema.MAX_JSON_DEPTH` deep, hold integers of at
most :data:`~.schema.MAX_INT_DIGITS` digits and no lone surrogate (400 naming the field). Prompts
are tokenized and checked against the context on worker threads with their own tokenizer
copies, never on the engine thread, so a long prompt never stalls other requests' steps. With
``allowed_hosts`` set, a request whose ``Host`` header names another host is refused (400):
``serve`` sets it by default when it binds a loopback address without an API key, so that a web
page cannot use the local server through DNS rebinding. The API key (``/v1`` routes and
``/openapi.json``) is compared in constant time; the ``Bearer`` scheme is case-insensitive.
``/health``, ``/version`` and ``/metrics`` need no key (as in vLLM).

Errors use OpenAI's body ``{"error": {"message", "type", "param", "code"}}``: a bad parameter or
a prompt over the context is 400 naming the parameter, an unknown model 404, a missing or wrong
API key 401, a dead engine 503. An error after a stream has started is a last ``data:
{"error": ...}`` event before ``data: [DONE]``. A client that disconnects aborts its requests
(their KV pages are freed before the engine's next step).
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import dataclasses
import hmac
import ipaddress
import json
import queue
import random
import time
import uuid
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, AsyncIterator, Callable, Sequence

from fastapi import FastAPI, Request
from fastapi.openapi.utils import get_openapi
from fastapi.responses import FileResponse, JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..config import MAX_SEED, Limits, SamplingParams
from ..engine.async_engine import AsyncEngine, RequestStream, StreamOutput
from ..engine.input_processor import InputProcessor, choice_params
from ..errors import ContextLengthError, EngineDeadError, ParameterError
from ..lang.dialect import DIALECT_NAMES, get_dialect
from ..lang.tokenization import decode
from .args import api_key_problem
from .schema import (
    MAX_INT_DIGITS,
    MAX_JSON_DEPTH,
    MAX_N,
    MIN_TOP_P,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    engine_sampling_fields,
    max_tokens_of,
    parse_request,
)

__all__ = ["build_app", "OpenAIError", "STATIC_DIR", "LOCAL_HOSTS", "default_allowed_hosts"]

STATIC_DIR = Path(__file__).resolve().parent / "static"
#: The page's icon: three bars of different lengths side by side (threads decoding together).
_FAVICON = (b'<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 16 16"><rect width="16" height="16" rx="3" '
            b'fill="#1d1d1f"/><rect x="3" y="3" width="10" height="2.5" fill="#f2c14e"/><rect x="3" y="6.75" width="6" '
            b'height="2.5" fill="#7ec4cf"/><rect x="3" y="10.5" width="8" height="2.5" fill="#e58f65"/></svg>')
#: Most prompts x choices of a completions request.
MAX_PROMPTS = 64
#: Default request-body limit (bytes).
MAX_BODY_BYTES = 2**20
#: Default memory for the thread events kept for ``GET /v1/pasta/events/{id}`` (bytes, all
#: completions together; the oldest completions' logs are dropped first, and one completion's
#: log keeps at most a quarter of it).
EVENT_LOG_BYTES = 64 * 2**20
#: ``Host`` names a loopback-bound server without an API key accepts by default.
LOCAL_HOSTS = ("localhost", "127.0.0.1", "[::1]")

# the engine's parameter names as the OpenAI API spells them
_PARAM_NAMES = {
    "max_new_tokens": "max_tokens",
    "position_policy": "pasta.position_policy",
    "max_threads": "pasta.max_threads",
    "max_forks": "pasta.max_forks",
    "max_fork_depth": "pasta.max_fork_depth",
    "fork_threshold": "pasta.fork_threshold",
    "length_cut": "pasta.length_cut",
    "distinct_topics": "pasta.distinct_topics",
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


def _as_openai_error(exc: BaseException, prompt_param: str = "messages") -> OpenAIError:
    """Map an engine error to OpenAI's status and body."""
    if isinstance(exc, OpenAIError):
        return exc
    if isinstance(exc, ContextLengthError):
        return OpenAIError(400, str(exc), param=prompt_param, code="context_length_exceeded")
    if isinstance(exc, ParameterError):
        param = exc.param if exc.param != "prompt" else prompt_param
        return OpenAIError(400, str(exc), param=_PARAM_NAMES.get(param, param))
    if isinstance(exc, EngineDeadError):
        return OpenAIError(503, str(exc), type="server_error", code="engine_dead")
    return OpenAIError(500, f"{type(exc).__name__}: {exc}", type="server_error")


# --------------------------------------------------------------------------- request parsing


class _BigNumber:
    """A number literal of the request body too long to read (kept to name its field)."""

    def __init__(self, text: str):
        self.text = text

    def __repr__(self) -> str:
        return f"<a number of {len(self.text)} characters>"


def _parse_int(text: str) -> int | _BigNumber:
    return int(text) if len(text.lstrip("-")) <= MAX_INT_DIGITS else _BigNumber(text)


def _parse_float(text: str) -> float | _BigNumber:
    return float(text) if len(text) <= 64 else _BigNumber(text)


def _no_constant(text: str) -> Any:
    raise ValueError(f"{text} is not a JSON number")


def _loc_param(loc: tuple[Any, ...]) -> tuple[str, str]:
    """``(param, path)`` of a place in the request body (param as OpenAI spells it)."""
    path = ""
    for part in loc:
        path += f"[{part}]" if isinstance(part, int) else (f".{part}" if path else str(part))
    if not loc:
        return "body", "the request body"
    if loc[0] == "pasta" and len(loc) > 1 and isinstance(loc[1], str):
        return f"pasta.{loc[1]}", path
    return str(loc[0]), path


def _check_json(body: Any) -> None:
    """Raise ParameterError for what the request models cannot see or should never get: a
    number literal too long to read, nesting deeper than MAX_JSON_DEPTH, a string that is not
    text (a lone surrogate such as ``"\\udcff"``: it cannot be encoded, so neither tokenized)."""
    stack: list[tuple[Any, tuple[Any, ...], int]] = [(body, (), 0)]
    while stack:
        obj, loc, depth = stack.pop()
        if isinstance(obj, str):
            if not obj.isascii():
                try:
                    obj.encode("utf-8")
                except UnicodeEncodeError as e:
                    param, path = _loc_param(loc)
                    raise ParameterError(param, obj, message=f"invalid {path}: character {e.start} is a lone "
                                         f"surrogate ({obj[e.start]!r}), not text") from None
        elif isinstance(obj, _BigNumber):
            param, path = _loc_param(loc)
            raise ParameterError(param, obj, message=f"invalid {path}: a number of {len(obj.text)} characters "
                                 f"(integers have at most {MAX_INT_DIGITS} digits)")
        elif isinstance(obj, (dict, list)):
            if depth >= MAX_JSON_DEPTH:
                param, path = _loc_param(loc)
                raise ParameterError(param, None, message=f"the request body nests deeper than {MAX_JSON_DEPTH} "
                                     f"levels (at {path})")
            if isinstance(obj, dict):
                for k, v in obj.items():
                    stack.append((k, loc, depth + 1))
                    stack.append((v, (*loc, k), depth + 1))
            else:
                stack.extend((v, (*loc, i), depth + 1) for i, v in enumerate(obj))


def _decode_json(raw: bytes) -> dict[str, Any]:
    """The request body as a JSON object, checked by :func:`_check_json` (runs off the event
    loop). Raises OpenAIError 400 or ParameterError."""
    try:
        body = json.loads(raw, parse_int=_parse_int, parse_float=_parse_float, parse_constant=_no_constant)
    except RecursionError:
        raise OpenAIError(400, f"the request body nests deeper than {MAX_JSON_DEPTH} levels", param="body") from None
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError, NaN/Infinity
        raise OpenAIError(400, f"the request body is not valid JSON: {e}", param="body") from None
    if not isinstance(body, dict):
        raise OpenAIError(400, "the request body must be a JSON object", param="body")
    _check_json(body)
    return body


@dataclasses.dataclass
class _Options:
    """What a completions request asks for, checked."""

    params: list[SamplingParams]  # one per choice (choice_params: each its own seed), stop strings in them
    n: int
    stream: bool
    include_usage: bool
    logprobs: bool
    mode: str
    dialect: str  # a name of DIALECT_NAMES whose module imports (checked by _check_dialect)
    events: bool
    annotated_response: str | None
    limits: Limits | None
    position_policy: str | None
    meter: "_Meter | None" = None


def _check_dialect(name: str) -> None:
    """Check that the dialect ``name`` (one of :data:`~pasta_engine.lang.dialect.DIALECT_NAMES`,
    as the request schema allows) can run on this server, before the request takes any resource.

    Each dialect but ``pasta`` lives in a module of :mod:`pasta_engine.lang` imported on first
    use (:func:`~pasta_engine.lang.dialect.get_dialect`). Raises OpenAIError 400 (param
    ``pasta.dialect``, code ``dialect_unavailable``) when that module is not installed in this
    server's pasta-engine, 500 (``server_error``) when it is there but fails to import, and
    ParameterError naming ``pasta.dialect`` for a name that is not a dialect."""
    try:
        get_dialect(name)
    except ValueError as e:
        raise ParameterError("pasta.dialect", name, message=f"invalid pasta.dialect={name!r}: {e}") from None
    except ModuleNotFoundError as e:
        lang = get_dialect.__module__.rpartition(".")[0]  # pasta_engine.lang: where the dialect modules live
        if e.name is not None and e.name.startswith(f"{lang}."):  # the dialect's own module, not a dependency
            raise OpenAIError(400, f"pasta.dialect={name!r} is not available on this server: its module "
                              f"{e.name} is not installed in this pasta-engine (use another dialect of "
                              f"{', '.join(DIALECT_NAMES)}, or upgrade the server's pasta-engine)",
                              param="pasta.dialect", code="dialect_unavailable") from None
        raise OpenAIError(500, f"pasta.dialect={name!r} failed to load: {type(e).__name__}: {e}",
                          type="server_error", param="pasta.dialect") from None
    except Exception as e:  # noqa: BLE001 - a dialect module that fails to import is the server's fault
        raise OpenAIError(500, f"pasta.dialect={name!r} failed to load: {type(e).__name__}: {e}",
                          type="server_error", param="pasta.dialect") from None


class _Server:
    """The app's state: the engine, the served model's name and the request defaults."""

    def __init__(self, engine: AsyncEngine, model_name: str, api_key: str | None, defaults: SamplingParams,
                 seed: int, max_body_bytes: int = MAX_BODY_BYTES, event_log_bytes: int = EVENT_LOG_BYTES):
        self.engine = engine
        self.model_name = model_name
        self.api_key = api_key
        self.defaults = defaults
        self.max_body_bytes = max_body_bytes
        self.rng = random.Random(seed)  # seeds of requests that give none
        self.created = int(time.time())
        self.logs: OrderedDict[str, _EventLog] = OrderedDict()
        self.log_budget = event_log_bytes
        self.log_bytes = 0
        self.prompts = _Prompts(engine)
        self.metrics = _Metrics(engine, model_name)

    # ------------------------------------------------------------------ checks

    def check_auth(self, request: Request) -> None:
        """Raise OpenAIError 401 unless the request sends ``Authorization: Bearer <api_key>``
        (the scheme in any case; the key compared in constant time; no check when the server
        has no key)."""
        if self.api_key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").strip().partition(" ")
        if not (scheme.lower() == "bearer"
                and hmac.compare_digest(token.strip().encode("utf-8"), self.api_key.encode("utf-8"))):
            raise OpenAIError(401, "missing or wrong API key: send 'Authorization: Bearer <key>'",
                              type="authentication_error", code="invalid_api_key")

    def check_model(self, body: dict[str, Any]) -> None:
        """Raise OpenAIError 404 (param ``model``) when the request names a model other than
        the one served; a request without ``model`` gets the served one (a ``model`` that is
        not a string is left to the request schema)."""
        model = body.get("model")
        if not isinstance(model, str):
            return
        if model != self.model_name:
            raise OpenAIError(404, f"the model {model!r} does not exist: this server serves {self.model_name!r}",
                              param="model", code="model_not_found")

    async def read_body(self, request: Request) -> dict[str, Any]:
        """The checked JSON object of a POST: the key, ``Content-Type: application/json``
        (415), at most ``max_body_bytes`` (413, read no further), then :func:`_decode_json`
        and the model's name."""
        self.check_auth(request)
        ctype = request.headers.get("content-type", "")
        if ctype.split(";", 1)[0].strip().lower() != "application/json":
            raise OpenAIError(415, f"the request body must be sent as 'Content-Type: application/json' (got "
                              f"{ctype or 'none'!r})", code="unsupported_media_type")
        limit = self.max_body_bytes
        too_large = OpenAIError(413, f"the request body is larger than this server's limit of {limit} bytes "
                                "(serve --max-body-mb)", code="request_too_large")
        length = request.headers.get("content-length")
        if length is not None and (len(length) > 20 or not (length.strip().isascii() and length.strip().isdigit())):
            raise OpenAIError(400, f"invalid Content-Length {length[:40]!r}")
        if length is not None and int(length) > limit:
            raise too_large
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise too_large
            chunks.append(chunk)
        body = await asyncio.to_thread(_decode_json, b"".join(chunks))
        self.check_model(body)
        return body

    def options(self, req: ChatCompletionRequest | CompletionRequest, chat: bool) -> _Options:
        """The engine's settings for a parsed request (ParameterError names a bad one as
        OpenAI spells it). ``top_p`` below MIN_TOP_P is taken as MIN_TOP_P (see
        :mod:`.schema`); ``top_k=-1`` (vLLM's "all") is 0."""
        given = max_tokens_of(req)
        max_tokens = given[1] if given else self.defaults.max_new_tokens
        temperature = self.defaults.temperature if req.temperature is None else req.temperature
        top_p = max(self.defaults.top_p if req.top_p is None else req.top_p, MIN_TOP_P)
        top_k = self.defaults.top_k if req.top_k is None else max(req.top_k, 0)
        seed = self.rng.randrange(MAX_SEED + 1) if req.seed is None else req.seed
        logprobs = req.logprobs if chat else req.logprobs == 0
        pasta = req.pasta
        _check_dialect(pasta.dialect)
        limits = None
        if (pasta.max_threads is not None or pasta.max_forks is not None or pasta.max_fork_depth is not None
                or pasta.fork_threshold is not None or pasta.length_cut is not None
                or pasta.distinct_topics is not None):
            base = self.engine.engine.config.limits
            mt = (base.max_threads or 0) if pasta.max_threads is None else pasta.max_threads
            mf = base.max_forks if pasta.max_forks is None else pasta.max_forks
            md = base.max_fork_depth if pasta.max_fork_depth is None else pasta.max_fork_depth
            ft = base.fork_threshold if pasta.fork_threshold is None else pasta.fork_threshold
            limits = dataclasses.replace(base, max_threads=mt or None, max_forks=mf, max_fork_depth=md,
                                         fork_threshold=ft, length_cut=pasta.length_cut or base.length_cut,
                                         distinct_topics=base.distinct_topics if pasta.distinct_topics is None
                                         else pasta.distinct_topics)
        more = engine_sampling_fields(req)  # vLLM's fields SamplingParams has too (penalties, ...)
        params = SamplingParams(max_new_tokens=max_tokens, temperature=float(temperature), top_p=float(top_p),
                                top_k=top_k, seed=seed, return_logprobs=logprobs, stop=tuple(req.stops()), n=req.n,
                                **more)
        return _Options(params=choice_params(params), n=req.n, stream=req.stream,  # seeds seed, seed + 1, ...
                        include_usage=bool(req.stream_options and req.stream_options.include_usage),
                        logprobs=logprobs, mode=pasta.mode, dialect=pasta.dialect,
                        events=pasta.events,
                        annotated_response=pasta.annotated_response, limits=limits,
                        position_policy=pasta.position_policy)

    # ------------------------------------------------------------------ requests

    async def start(self, prompts: Sequence[list[int]], opts: _Options, cid: str, t0: float) -> list[RequestStream]:
        """Queue one engine request per (prompt's token ids, choice); abort them all if one is
        refused. ``t0``: when the request arrived (``time.monotonic``), for the metrics."""
        streams: list[RequestStream] = []
        try:
            for p, prompt in enumerate(prompts):
                for i, params in enumerate(opts.params):
                    streams.append(await self.engine.add_request(
                        prompt, params, opts.mode, f"{cid}-{p * opts.n + i}", output_kind="delta", events=True,
                        chat_template=False, annotated_response=opts.annotated_response,
                        limits=opts.limits, position_policy=opts.position_policy, dialect=opts.dialect))
        except BaseException:
            for s in streams:
                s.abort()
            raise
        opts.meter = _Meter(self.metrics, t0, opts.n)
        self.logs[cid] = _EventLog(max(2**16, self.log_budget // 4), self._log_grew)
        return streams

    def _log_grew(self, log: "_EventLog", nbytes: int) -> None:
        """Count a log's new bytes; drop the oldest logs while all of them hold more than the
        budget (the newest is always kept)."""
        self.log_bytes += nbytes
        while self.log_bytes > self.log_budget and len(self.logs) > 1:
            _, old = self.logs.popitem(last=False)
            old.dropped = True
            self.log_bytes -= old.nbytes

    def choice_ext(self, out: StreamOutput, opts: _Options) -> dict[str, Any]:
        """The ``pasta`` object of a finished choice (``dialect``: the dialect its request ran
        in, a name of :data:`~pasta_engine.lang.dialect.DIALECT_NAMES`)."""
        r = out.result
        return {"annotated_text": r.annotated_text, "stats": dataclasses.asdict(r.stats), "diagnostics": r.diagnostics,
                "mode": r.mode, "dialect": opts.dialect}

    async def logprobs(self, out: StreamOutput, chat: bool) -> dict[str, Any] | None:
        """OpenAI's logprobs object for a finished choice: every sampled token in spliced order
        (tag tokens included, the inserted ``<async>`` tokens left out)."""
        r = out.result
        pairs = [(t, lp) for t, lp in zip(r.token_ids, r.logprobs or []) if lp is not None]
        texts = await self.engine.decode_tokens([t for t, _ in pairs])
        if chat:
            return {"content": [{"token": s, "logprob": lp, "bytes": list(s.encode()), "top_logprobs": []}
                                for s, (_, lp) in zip(texts, pairs)]}
        offsets, at = [], 0
        for s in texts:
            offsets.append(at)
            at += len(s)
        return {"tokens": texts, "token_logprobs": [lp for _, lp in pairs], "top_logprobs": None,
                "text_offset": offsets}


def _record_bytes(rec: dict[str, Any]) -> int:
    """About the bytes of a record as JSON (cheaper than encoding it)."""
    return 2 + sum(len(k) + (len(v) if isinstance(v, str) else 8) + 6 for k, v in rec.items())


class _EventLog:
    """The thread events of one completion, for late and live readers (one event loop).

    Holds at most ``cap`` bytes of records (about their JSON size): past it, one ``truncated``
    record ends what is kept (live readers then see the log end with it). ``grew(log, n)`` is
    told of every byte added until the server drops the log (``dropped``)."""

    def __init__(self, cap: int = EVENT_LOG_BYTES, grew: Callable[["_EventLog", int], None] | None = None) -> None:
        self.records: list[dict[str, Any]] = []
        self.done = False
        self.nbytes = 0
        self.cap = cap
        self.truncated = False
        self.dropped = False
        self._grew = grew
        self._wake = asyncio.Event()

    def add(self, records: list[dict[str, Any]]) -> None:
        if records and not self.truncated:
            size = sum(_record_bytes(r) for r in records)
            if self.nbytes + size > self.cap:
                self.truncated = True
                records = [{"kind": "truncated", "message": f"this completion's event log reached its cap of "
                            f"{self.cap} bytes: later events are not kept"}]
                size = _record_bytes(records[0])
            self.records += records
            self.nbytes += size
            if self._grew is not None and not self.dropped:
                self._grew(self, size)
            self._wake.set()
            self._wake = asyncio.Event()

    def close(self) -> None:
        self.done = True
        self._wake.set()

    async def follow(self) -> AsyncIterator[dict[str, Any]]:
        i = 0
        while True:
            while i < len(self.records):
                yield self.records[i]
                i += 1
            if self.done:
                return
            await self._wake.wait()


class _Prompts:
    """Prompts to token ids on worker threads, never on the engine thread (docs/DESIGN.md section 7:
    a long prompt must not stall other requests' steps), by the engine's rules.

    Each worker uses an :class:`~pasta_engine.engine.input_processor.InputProcessor` over its
    own copy of the engine's tokenizer (a ``transformers`` tokenizer changes its own settings
    while it encodes, and the engine thread decodes with the original): the same chat
    formatting, tokenization and checks (vocabulary, context length; a text too long to fit
    however it tokenizes is refused before it is tokenized) as every other API.

    Args:
        engine: the async engine (its tokenizer, settings and context length).
        workers: worker threads (each with a tokenizer copy)."""

    def __init__(self, engine: AsyncEngine, workers: int = 2):
        eng = engine.engine
        self._copies: queue.SimpleQueue = queue.SimpleQueue()
        per_token = eng.input_processor.bytes_per_token  # read from the vocabulary once, now
        for _ in range(workers):
            self._copies.put(InputProcessor(copy.deepcopy(eng.tokenizer), eng.config,
                                            vocab_size=eng.model.config.vocab_size, max_positions=eng.max_positions,
                                            eos_ids=eng.eos_ids, grammar=eng.tag_tokens is not None,
                                            bytes_per_token=per_token))
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="pasta-tokenize")

    async def tokenize(self, prompts: Sequence[Any], chat: bool, mode: str, dialect: str = "pasta") -> list[list[int]]:
        """Token ids of each prompt: chat messages (``[{"role", "content"}]``, through the chat
        template in ``mode``, with ``dialect``'s system prompt in pasta mode), a text (tokenized as
        text, no template) or token ids (kept).

        Raises ParameterError naming the prompt (ContextLengthError for one that leaves no room
        under the model's context)."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, self._tokenize, list(prompts), chat, mode, dialect)

    async def detokenize(self, ids: Sequence[int]) -> str:
        """The text of token ids (special tokens kept), decoded on a worker thread. Raises
        ParameterError naming ``tokens`` for an id outside the vocabulary."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, self._detokenize, list(ids))

    def _detokenize(self, ids: list[int]) -> str:
        proc = self._copies.get()
        try:
            tok = proc.tokenizer
            bad = next((t for t in ids if t >= len(tok)), None)
            if bad is not None:
                raise ParameterError("tokens", bad, message=f"token id {bad} is outside the vocabulary of {len(tok)}")
            return decode(tok, ids)
        finally:
            self._copies.put(proc)

    def _tokenize(self, prompts: list[Any], chat: bool, mode: str, dialect: str) -> list[list[int]]:
        proc = self._copies.get()
        try:
            one = len(prompts) == 1
            return [proc.tokenize(prompt, mode, dialect, chat_template=chat, index=None if one else i)
                    for i, prompt in enumerate(prompts)]
        finally:
            self._copies.put(proc)


# vLLM's histogram buckets (seconds)
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                 40.0, 80.0, 160.0, 640.0, 2560.0)
_ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
                80.0)
_E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0,
                960.0, 1920.0, 7680.0)
_SPEEDUP_BUCKETS = (0.5, 1.0, 1.1, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 4.0, 5.0, 8.0)


class _Metrics:
    """The Prometheus metrics of one app (its own registry), vLLM's names with the ``pasta:``
    prefix and a ``model_name`` label, plus PASTA's own:

    * ``pasta:num_requests_running``, ``pasta:num_requests_waiting``, ``pasta:kv_cache_usage_perc``
      (0 to 1): read from the engine at each scrape;
    * ``pasta:time_to_first_token_seconds``: from a request's arrival to its choice's first
      sampled token; ``pasta:inter_token_latency_seconds``: between a choice's successive
      outputs, divided by the tokens sampled in between (PASTA samples several per step);
      ``pasta:e2e_request_latency_seconds``: arrival to a choice's end;
    * ``pasta:prompt_tokens_total``, ``pasta:generation_tokens_total`` (all threads),
      ``pasta:request_success_total`` (label ``finished_reason``), ``pasta:threads_forked_total``;
    * ``pasta:content_speedup``: each finished choice's theoretical content speedup
      (``RequestStats.content_speedup``)."""

    def __init__(self, engine: AsyncEngine, model_name: str):
        self.engine = engine
        self.registry = r = CollectorRegistry()
        lab = ("model_name",)
        self.running = Gauge("pasta:num_requests_running", "Requests decoding in the engine's batch", lab,
                             registry=r).labels(model_name)
        self.waiting = Gauge("pasta:num_requests_waiting", "Requests waiting for the engine's batch", lab,
                             registry=r).labels(model_name)
        self.kv_usage = Gauge("pasta:kv_cache_usage_perc", "Fraction of KV cache pages in use (0 to 1)", lab,
                              registry=r).labels(model_name)
        self.ttft = Histogram("pasta:time_to_first_token_seconds", "Seconds from a request's arrival to its first "
                              "sampled token", lab, buckets=_TTFT_BUCKETS, registry=r).labels(model_name)
        self.itl = Histogram("pasta:inter_token_latency_seconds", "Seconds between a choice's successive outputs per "
                             "token sampled", lab, buckets=_ITL_BUCKETS, registry=r).labels(model_name)
        self.e2e = Histogram("pasta:e2e_request_latency_seconds", "Seconds from a request's arrival to a choice's "
                             "end", lab, buckets=_E2E_BUCKETS, registry=r).labels(model_name)
        self.prompt_tokens = Counter("pasta:prompt_tokens", "Prompt tokens of finished requests", lab,
                                     registry=r).labels(model_name)
        self.generation_tokens = Counter("pasta:generation_tokens", "Tokens sampled by finished choices (all threads)",
                                         lab, registry=r).labels(model_name)
        self.success = Counter("pasta:request_success", "Finished choices by finish reason",
                               (*lab, "finished_reason"), registry=r)
        self.forks = Counter("pasta:threads_forked", "Threads forked by finished choices", lab,
                             registry=r).labels(model_name)
        self.content_speedup = Histogram("pasta:content_speedup", "Theoretical content speedup of finished choices "
                                         "(content tokens / critical path)", lab, buckets=_SPEEDUP_BUCKETS,
                                         registry=r).labels(model_name)
        self.model_name = model_name

    def render(self) -> tuple[bytes, str]:
        """The scrape's body and content type (the engine's gauges read now)."""
        if self.engine.is_running:
            st = self.engine.engine.stats()  # read without the engine's lock (plain counters)
            self.running.set(st["running"])
            self.waiting.set(st["waiting"])
            total = st["kv_pages_total"]
            self.kv_usage.set((total - st["kv_pages_free"]) / total if total else 0.0)
        return generate_latest(self.registry), CONTENT_TYPE_LATEST

    def finished(self, out: StreamOutput, seconds: float, first_of_prompt: bool) -> None:
        self.e2e.observe(seconds)
        self.success.labels(self.model_name, out.finish_reason or "unknown").inc()
        r = out.result
        if r is None:
            return
        if first_of_prompt:
            self.prompt_tokens.inc(len(r.prompt_ids))
        self.generation_tokens.inc(r.stats.tokens_decoded)
        self.forks.inc(r.stats.forks)
        speedup = getattr(r.stats, "content_speedup", None)
        if speedup is not None:
            self.content_speedup.observe(speedup)


class _Meter:
    """Times the choices of one request for :class:`_Metrics` (``t0``: its arrival)."""

    def __init__(self, metrics: _Metrics, t0: float, n: int):
        self.metrics, self.t0, self.n = metrics, t0, n
        self.last: dict[int, float] = {}

    def output(self, i: int, out: StreamOutput) -> None:
        now = time.monotonic()
        k = len(out.token_ids)
        if k:
            if i in self.last:
                self.metrics.itl.observe((now - self.last[i]) / k)
            else:
                self.metrics.ttft.observe(now - self.t0)
            self.last[i] = now
        if out.finished:
            self.metrics.finished(out, now - self.t0, i % self.n == 0)


def _event_records(index: int, out: StreamOutput) -> list[dict[str, Any]]:
    recs = [{"index": index, **e.to_dict()} for e in out.events]
    recs.append({"index": index, "kind": "progress", "decode_steps": out.decode_steps,
                 "tokens_decoded": out.tokens_decoded})
    return recs


async def _merged(streams: Sequence[RequestStream]) -> AsyncIterator[tuple[int, StreamOutput]]:
    """``(index, output)`` from several request streams as they come; closing this aborts every
    stream still open."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, s: RequestStream) -> None:
        try:
            async for out in s:
                queue.put_nowait((i, out))
        except BaseException as e:  # noqa: BLE001 - handed to the reader
            queue.put_nowait((i, e))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    open_ = len(streams)
    try:
        while open_:
            i, item = await queue.get()
            if isinstance(item, BaseException):
                raise item
            if item.finished:
                open_ -= 1
            yield i, item
    finally:
        for t in tasks:
            t.cancel()
        for s in streams:
            s.abort()


class _EventStream(StreamingResponse):
    """A server-sent event response that closes its generator however it ends (done, the client
    gone, the task cancelled) and then calls ``on_close``: Starlette leaves an unfinished body
    generator to the garbage collector, and a generator that never started runs no ``finally``
    at all, so the requests' abort cannot wait for either."""

    def __init__(self, body: AsyncIterator[str], on_close: Callable[[], None]):
        super().__init__(body, media_type="text/event-stream")
        self._on_close = on_close

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            try:
                await self.body_iterator.aclose()
            finally:
                self._on_close()


async def _until_disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _sse(obj: Any) -> str:
    return f"data: {json.dumps(obj)}\n\n"


def _usage(prompt_tokens: int, finals: dict[int, StreamOutput]) -> dict[str, int]:
    completion = sum(o.result.stats.tokens_decoded for o in finals.values() if o.result is not None)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion,
            "total_tokens": prompt_tokens + completion}


def _prompt_tokens(finals: dict[int, StreamOutput], n: int) -> int:
    """Prompt tokens of a request: each prompt once, whatever ``n`` is."""
    return sum(len(o.result.prompt_ids) for i, o in finals.items() if i % n == 0 and o.result is not None)


# --------------------------------------------------------------------------- the app


def default_allowed_hosts(bind_host: str, api_key: str | None) -> list[str] | None:
    """The ``Host`` names ``serve`` accepts unless told: :data:`LOCAL_HOSTS` for a loopback
    bind without an API key (a web page the user visits could otherwise reach the server through
    DNS rebinding and read its answers), else any (None)."""
    if api_key is not None:
        return None
    host = bind_host.strip("[]")
    try:
        local = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        local = False
    return list(LOCAL_HOSTS) if local else None


def _host_name(host: str) -> str:
    """``example.com:8000`` -> ``example.com``; ``[::1]:8000`` -> ``[::1]``; lower case."""
    host = host.strip().lower()
    if host.startswith("["):
        return host[: host.find("]") + 1] if "]" in host else host
    if host.count(":") > 1:  # a bare IPv6 address
        return f"[{host}]"
    return host.split(":", 1)[0]


class _HostCheck:
    """ASGI middleware: refuse (400) an HTTP request whose ``Host`` header is not one of
    ``hosts`` (names, ``[v6]`` addresses; any port)."""

    def __init__(self, app: Any, hosts: Sequence[str]):
        self.app = app
        self.hosts = frozenset(_host_name(h) for h in hosts)

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            host = ""
            for k, v in scope["headers"]:
                if k == b"host":
                    host = v.decode("latin-1")
                    break
            if _host_name(host) not in self.hosts:
                e = OpenAIError(400, f"the Host header {host[:100]!r} is not allowed: this server answers "
                                f"{', '.join(sorted(self.hosts))} (serve --allowed-hosts)", code="host_not_allowed")
                await JSONResponse(e.body(), status_code=400)(scope, receive, send)
                return
        await self.app(scope, receive, send)


def _body_schema(model: type) -> dict[str, Any]:
    return {"requestBody": {"required": True, "content": {"application/json": {
        "schema": {"$ref": f"#/components/schemas/{model.__name__}"}}}}}


def build_app(engine: AsyncEngine, model_name: str, *, api_key: str | None = None,
              defaults: SamplingParams | None = None, seed: int = 0, max_body_bytes: int = MAX_BODY_BYTES,
              allowed_hosts: Sequence[str] | None = None, event_log_bytes: int = EVENT_LOG_BYTES) -> FastAPI:
    """The FastAPI app over ``engine``.

    Args:
        engine: the async engine (the app never shuts it down).
        model_name: the name ``/v1/models`` lists and requests must use (or leave out).
        api_key: when set, every ``/v1`` route and ``/openapi.json`` need ``Authorization:
            Bearer <api_key>``; an empty key, or one with whitespace or control characters (a
            header cannot carry them intact, so it could never match), is a ParameterError.
        defaults: sampling values for requests that leave them out (max_tokens, temperature,
            top_p, top_k; default: :class:`SamplingParams`'s).
        seed: seed of the random source that picks a seed for requests that give none.
        max_body_bytes: largest request body (413 above).
        allowed_hosts: ``Host`` names answered (others get 400); None: any (see
            :func:`default_allowed_hosts` for ``serve``'s default).
        event_log_bytes: memory for the thread events kept for ``/v1/pasta/events/{id}``."""
    problem = None if api_key is None else api_key_problem(api_key)
    if problem is not None:
        raise ParameterError("api_key", "(hidden)", message=problem)
    srv = _Server(engine, model_name, api_key, defaults or SamplingParams(), seed, max_body_bytes, event_log_bytes)
    import pasta_engine

    version = pasta_engine.__version__
    # no Swagger UI or ReDoc (their pages load scripts from a CDN); /openapi.json is served below
    app = FastAPI(title="pasta-engine", description="PASTA learned asynchronous decoding: OpenAI-compatible API",
                  version=version, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.server = srv
    if allowed_hosts is not None:
        app.add_middleware(_HostCheck, hosts=list(allowed_hosts))

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            doc = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
            schemas = doc.setdefault("components", {}).setdefault("schemas", {})
            for model in (ChatCompletionRequest, CompletionRequest, TokenizeRequest, DetokenizeRequest):
                js = model.model_json_schema(ref_template="#/components/schemas/{model}")
                schemas.update(js.pop("$defs", {}))
                schemas[model.__name__] = js
            app.openapi_schema = doc
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]

    @app.exception_handler(OpenAIError)
    async def _openai_error(_: Request, exc: OpenAIError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(ParameterError)
    async def _param_error(_: Request, exc: ParameterError) -> JSONResponse:
        e = _as_openai_error(exc)
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(EngineDeadError)
    async def _dead(_: Request, exc: EngineDeadError) -> JSONResponse:
        e = _as_openai_error(exc)
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        e = OpenAIError(exc.status_code, str(exc.detail), code="not_found" if exc.status_code == 404 else None)
        return JSONResponse(e.body(), status_code=e.status, headers=exc.headers)

    def get(path: str, include_in_schema: bool = True) -> Callable[[Callable], Callable]:
        """Route GET and HEAD of ``path`` to the function (HEAD: the headers only)."""

        def route(fn: Callable) -> Callable:
            app.add_api_route(path, fn, methods=["GET"], include_in_schema=include_in_schema)
            app.add_api_route(path, fn, methods=["HEAD"], include_in_schema=False)
            return fn

        return route

    @get("/", include_in_schema=False)
    async def index() -> FileResponse:
        return FileResponse(STATIC_DIR / "index.html", media_type="text/html")

    @get("/favicon.ico", include_in_schema=False)
    async def favicon() -> Response:
        return Response(_FAVICON, media_type="image/svg+xml", headers={"Cache-Control": "max-age=86400"})

    @get("/health")
    async def health() -> JSONResponse:
        if not engine.is_running:
            raise _as_openai_error(engine.dead_error or EngineDeadError("the engine is not running"))
        return JSONResponse({"status": "ok"})

    @get("/version")
    async def version_() -> JSONResponse:
        return JSONResponse({"version": version})

    @get("/metrics")
    async def metrics() -> Response:
        body, ctype = srv.metrics.render()
        return Response(body, media_type=ctype)

    @get("/openapi.json", include_in_schema=False)
    async def openapi_json(request: Request) -> JSONResponse:
        srv.check_auth(request)
        return JSONResponse(app.openapi())

    @get("/v1/models")
    async def models(request: Request) -> JSONResponse:
        srv.check_auth(request)
        return JSONResponse({"object": "list", "data": [{
            "id": model_name, "object": "model", "created": srv.created, "owned_by": "pasta-engine",
            "max_model_len": engine.engine.max_positions}]})

    @get("/v1/pasta/stats")
    async def stats(request: Request) -> JSONResponse:
        srv.check_auth(request)
        return JSONResponse(await engine.stats())

    @app.get("/v1/pasta/events/{completion_id}")
    async def events(completion_id: str, request: Request) -> StreamingResponse:
        srv.check_auth(request)
        log = srv.logs.get(completion_id)
        if log is None:
            raise OpenAIError(404, f"no completion {completion_id!r} (it is unknown, or too old: the newest logs "
                              f"are kept, {srv.log_budget} bytes in all)", param="id", code="not_found")

        async def gen() -> AsyncIterator[str]:
            async for rec in log.follow():
                yield _sse(rec)
            yield "data: [DONE]\n\n"

        return StreamingResponse(gen(), media_type="text/event-stream")

    @app.post("/tokenize", openapi_extra=_body_schema(TokenizeRequest))
    async def tokenize(request: Request) -> JSONResponse:
        try:
            req = parse_request(TokenizeRequest, await srv.read_body(request))
            if req.messages is not None:
                chat = [{"role": m.role, "content": m.text()} for m in req.messages]
                [ids] = await srv.prompts.tokenize([chat], chat=True, mode=req.pasta.mode, dialect=req.pasta.dialect)
            else:
                [ids] = await srv.prompts.tokenize([req.prompt], chat=False, mode=req.pasta.mode,
                                                   dialect=req.pasta.dialect)
        except Exception as e:
            raise _as_openai_error(e, "prompt") from None
        return JSONResponse({"count": len(ids), "max_model_len": engine.engine.max_positions, "tokens": ids})

    @app.post("/detokenize", openapi_extra=_body_schema(DetokenizeRequest))
    async def detokenize(request: Request) -> JSONResponse:
        try:
            req = parse_request(DetokenizeRequest, await srv.read_body(request))
            text = await srv.prompts.detokenize(req.tokens)  # off the event loop, as prompts are tokenized
        except Exception as e:
            raise _as_openai_error(e, "tokens") from None
        return JSONResponse({"prompt": text})

    @app.post("/v1/chat/completions", openapi_extra=_body_schema(ChatCompletionRequest))
    async def chat_completions(request: Request):
        t0 = time.monotonic()
        try:
            req = parse_request(ChatCompletionRequest, await srv.read_body(request))
            opts = srv.options(req, chat=True)
            messages = [{"role": m.role, "content": m.text()} for m in req.messages]
            mode = "pasta" if opts.annotated_response is not None else opts.mode  # a replay's prompt: pasta's
            prompts = await srv.prompts.tokenize([messages], chat=True, mode=mode, dialect=opts.dialect)
            cid = f"chatcmpl-{uuid.uuid4().hex}"
            streams = await srv.start(prompts, opts, cid, t0)
        except Exception as e:
            raise _as_openai_error(e, "messages") from None
        return await _respond(srv, request, streams, opts, cid, chat=True)

    @app.post("/v1/completions", openapi_extra=_body_schema(CompletionRequest))
    async def completions(request: Request):
        t0 = time.monotonic()
        try:
            req = parse_request(CompletionRequest, await srv.read_body(request))
            opts = srv.options(req, chat=False)
            prompt = req.prompt
            prompts = [prompt] if isinstance(prompt, str) or isinstance(prompt[0], int) else list(prompt)
            if len(prompts) * opts.n > MAX_PROMPTS:
                raise ParameterError("prompt", len(prompts), message=f"{len(prompts)} prompts x n={opts.n} is more "
                                     f"than {MAX_PROMPTS} completions in one request")
            prompts = await srv.prompts.tokenize(prompts, chat=False, mode=opts.mode, dialect=opts.dialect)
            cid = f"cmpl-{uuid.uuid4().hex}"
            streams = await srv.start(prompts, opts, cid, t0)
        except Exception as e:
            raise _as_openai_error(e, "prompt") from None
        return await _respond(srv, request, streams, opts, cid, chat=False)

    return app


async def _respond(srv: _Server, request: Request, streams: list[RequestStream], opts: _Options, cid: str,
                   chat: bool):
    log = srv.logs[cid]
    if opts.stream:
        def on_close() -> None:  # no-ops after a normal end
            for s in streams:
                s.abort()
            log.close()

        return _EventStream(_stream(srv, streams, opts, cid, chat, log), on_close)
    collect = asyncio.create_task(_collect(srv, streams, opts, cid, chat, log))
    gone = asyncio.create_task(_until_disconnected(request))
    try:
        await asyncio.wait([collect, gone], return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not collect.done():  # the client left (or this handler was cancelled): abort its requests
            collect.cancel()
            log.close()
    if not collect.done():  # cancelled above (a cancelled task is done only once it has run again)
        return JSONResponse({}, status_code=499)
    return JSONResponse(collect.result())


async def _collect(srv: _Server, streams: list[RequestStream], opts: _Options, cid: str, chat: bool,
                   log: _EventLog) -> dict[str, Any]:
    texts: dict[int, list[str]] = {i: [] for i in range(len(streams))}
    finals: dict[int, StreamOutput] = {}
    try:
        async with contextlib.aclosing(_merged(streams)) as merged:  # an error aborts the other choices now
            async for i, out in merged:
                if opts.meter is not None:
                    opts.meter.output(i, out)
                texts[i].append(out.text)
                log.add(_event_records(i, out))
                if out.finished:
                    finals[i] = out
                    if out.finish_reason == "error":
                        raise OpenAIError(500, f"choice {i} failed: {out.error}", type="server_error")
                    if out.finish_reason == "abort" and srv.engine.dead_error is not None:
                        raise OpenAIError(503, f"the server is shutting down: choice {i} was cut before it ended; "
                                          "send the request again to another server", type="server_error")
    except Exception as e:
        raise _as_openai_error(e) from None
    finally:
        log.close()
    choices = []
    for i in range(len(streams)):
        out = finals[i]
        text = "".join(texts[i])
        lp = await srv.logprobs(out, chat) if opts.logprobs else None
        c: dict[str, Any] = {"index": i, "finish_reason": out.finish_reason, "logprobs": lp}
        if chat:
            c["message"] = {"role": "assistant", "content": text}
        else:
            c["text"] = text
        if out.stop_reason is not None:
            c["stop_reason"] = out.stop_reason
        c["pasta"] = srv.choice_ext(out, opts)
        choices.append(c)
    return {"id": cid, "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
            "model": srv.model_name, "choices": choices, "usage": _usage(_prompt_tokens(finals, opts.n), finals)}


async def _stream(srv: _Server, streams: list[RequestStream], opts: _Options, cid: str, chat: bool,
                  log: _EventLog) -> AsyncIterator[str]:
    created = int(time.time())
    obj = "chat.completion.chunk" if chat else "text_completion"
    usage_field = {"usage": None} if opts.include_usage else {}

    def chunk(choices: list[dict[str, Any]]) -> str:
        return _sse({"id": cid, "object": obj, "created": created, "model": srv.model_name, "choices": choices,
                     **usage_field})

    def choice(i: int, text: str | None, finish: str | None = None, **extra: Any) -> dict[str, Any]:
        c: dict[str, Any] = {"index": i}
        if chat:
            c["delta"] = {} if text is None else {"content": text}
        else:
            c["text"] = text or ""
        c.update(logprobs=None, finish_reason=finish, **extra)
        return c

    finals: dict[int, StreamOutput] = {}
    try:
        if chat:
            for i in range(len(streams)):
                yield chunk([{**choice(i, ""), "delta": {"role": "assistant", "content": ""}}])
        async with contextlib.aclosing(_merged(streams)) as merged:  # an error aborts the other choices now
            async for i, out in merged:
                if opts.meter is not None:
                    opts.meter.output(i, out)
                log.add(_event_records(i, out))
                if opts.events and (out.events or not out.finished):
                    ext = {"events": [e.to_dict() for e in out.events], "decode_steps": out.decode_steps,
                           "tokens_decoded": out.tokens_decoded}
                    yield chunk([choice(i, out.text, pasta=ext)])
                elif out.text:
                    yield chunk([choice(i, out.text)])
                if out.finished:
                    finals[i] = out
                    if out.finish_reason == "error":
                        raise OpenAIError(500, f"choice {i} failed: {out.error}", type="server_error")
                    if out.finish_reason == "abort" and srv.engine.dead_error is not None:
                        raise OpenAIError(503, f"the server is shutting down: choice {i} was cut after the text sent "
                                          "so far", type="server_error")
                    extra: dict[str, Any] = {"pasta": srv.choice_ext(out, opts)}
                    if out.stop_reason is not None:
                        extra["stop_reason"] = out.stop_reason
                    c = choice(i, None, out.finish_reason, **extra)
                    if opts.logprobs:
                        c["logprobs"] = await srv.logprobs(out, chat)
                    yield chunk([c])
        if opts.include_usage:
            yield _sse({"id": cid, "object": obj, "created": created, "model": srv.model_name, "choices": [],
                        "usage": _usage(_prompt_tokens(finals, opts.n), finals)})
    except Exception as e:  # after the stream started: a last error event
        yield _sse(_as_openai_error(e).body())
    finally:
        log.close()
    yield "data: [DONE]\n\n"


# --------------------------------------------------------------------------- serve


def served_model_name(args: Any) -> str:
    """The name ``/v1/models`` lists: ``--served-model-name``, else the preset's name, the
    checkpoint folder's (or GGUF file's) name, or the embedded model's."""
    if getattr(args, "served_model_name", None):
        return args.served_model_name
    if getattr(args, "preset", None):
        return args.preset
    if getattr(args, "model", None):
        p = Path(args.model)
        return p.stem if p.suffix == ".gguf" else (p.name or str(p))
    from ..models.loader import EMBEDDED_MODEL

    return EMBEDDED_MODEL


def draining_server(config: Any, engine: AsyncEngine) -> Any:
    """A ``uvicorn.Server`` for ``config`` that, on Ctrl-C or SIGTERM, shuts ``engine`` down
    before it waits for open connections: every open stream then ends with an error event
    (503, "the server is shutting down") and ``data: [DONE]``, and every open non-streamed
    request with a 503, instead of being cut without either when uvicorn's graceful wait ends.
    ``config``: a ``uvicorn.Config``; raises ImportError without uvicorn (``[serve]``)."""
    import uvicorn

    class _Draining(uvicorn.Server):
        def handle_exit(self, sig: int, frame: Any) -> None:
            engine.shutdown(timeout_s=0)  # the engine thread aborts every request; no wait here
            super().handle_exit(sig, frame)

    return _Draining(config)


def serve(args: Any) -> int:
    """Run the server the ``serve`` flags describe until interrupted (Ctrl-C, SIGTERM).

    Loads the engine, binds ``--host``/``--port`` (port 0: a free one), prints one line
    ``pasta-engine: serving MODEL at http://HOST:PORT`` on stdout once it accepts connections,
    and shuts the engine down on exit. Returns the exit status."""
    import socket

    import uvicorn

    from .args import build_engine, sampling_params

    defaults = sampling_params(args)
    engine, _ = build_engine(args, max_running_requests=args.max_running_requests)
    name = served_model_name(args)
    aengine = AsyncEngine(engine)
    hosts = getattr(args, "allowed_hosts", None)
    if hosts is None:
        hosts = default_allowed_hosts(args.host, args.api_key)
    elif "*" in hosts:
        hosts = None
    app = build_app(aengine, name, api_key=args.api_key, defaults=defaults, seed=args.seed,
                    max_body_bytes=int(getattr(args, "max_body_mb", 1) * 2**20), allowed_hosts=hosts,
                    event_log_bytes=int(getattr(args, "event_log_mb", 64) * 2**20))
    family = socket.AF_INET6 if ":" in args.host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((args.host, args.port))
    host, port = sock.getsockname()[:2]
    config = uvicorn.Config(app, log_level=args.log_level, access_log=args.log_level in ("debug", "info"),
                            timeout_graceful_shutdown=5)
    server = draining_server(config, aengine)

    async def run() -> None:
        task = asyncio.create_task(server.serve(sockets=[sock]))
        while not server.started and not task.done():
            await asyncio.sleep(0.05)
        if server.started:
            shown = f"[{host}]" if family == socket.AF_INET6 else host
            print(f"pasta-engine: serving {name} at http://{shown}:{port} (OpenAI API at /v1, threads page at /)",
                  flush=True)
        await task

    try:
        asyncio.run(run())
    finally:
        aengine.shutdown()
        sock.close()
    return 0
