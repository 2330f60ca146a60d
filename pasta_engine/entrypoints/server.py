"""An OpenAI-compatible HTTP server over the async engine (``pasta-engine serve``).

A thin FastAPI app (run by uvicorn) over :class:`~pasta_engine.engine.async_engine.AsyncEngine`:

* ``POST /v1/chat/completions`` and ``POST /v1/completions``, streamed (server-sent events,
  ``data: {...}`` lines ending with ``data: [DONE]``) or not; ``n``, ``max_tokens`` /
  ``max_completion_tokens``, ``temperature``, ``top_p``, ``top_k``, ``seed``, ``stop``,
  ``logprobs``, ``stream_options.include_usage``. Streamed text is the response in reading
  order (:mod:`pasta_engine.engine.streaming`).
* the ``pasta`` extension: in a request, ``{"mode": "pasta" | "sequential", "position_policy":
  ..., "max_threads": N (0 = unlimited), "max_forks": N, "events": bool, "annotated_response":
  str}`` (``annotated_response`` replays that response: forced decoding); in each choice of a
  response, ``{"annotated_text", "stats": {content_tokens, content_speedup, decode_steps,
  tokens_decoded, tag_tokens, critical_path, token_parallelism, threads, ...}, "diagnostics"}``
  (:class:`~pasta_engine.engine.request.RequestStats`, the content figures first); with ``events`` each streamed chunk's choice carries the
  thread events of that step (``pasta.events``) and the counters ``decode_steps`` and
  ``tokens_decoded``.
* ``GET /v1/pasta/events/{id}``: the thread events of a completion (by the ``id`` of its
  response), from its start and then live, as server-sent events; ``GET /v1/pasta/stats``: the
  engine's counters (KV pages free, requests running and waiting).
* ``GET /v1/models``, ``GET /health`` (200, or 503 once the engine is dead), and ``GET /``: a
  single static page that shows the threads decoding side by side.

Errors use OpenAI's body ``{"error": {"message", "type", "param", "code"}}``: a bad parameter or
a prompt over the context is 400 naming the parameter, an unknown model 404, a missing or wrong
API key 401, a dead engine 503. An error after a stream has started is a last ``data:
{"error": ...}`` event before ``data: [DONE]``. A client that disconnects aborts its requests
(their KV pages are freed before the engine's next step).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import random
import time
import uuid
from collections import OrderedDict
from pathlib import Path
from typing import Any, AsyncIterator, Callable, Sequence

from fastapi import FastAPI, Request
from fastapi.responses import FileResponse, JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..config import MAX_SEED, Limits, SamplingParams, check_float, check_int
from ..engine.async_engine import AsyncEngine, RequestStream, StreamOutput
from ..errors import ContextLengthError, EngineDeadError, ParameterError

__all__ = ["build_app", "OpenAIError", "STATIC_DIR"]

STATIC_DIR = Path(__file__).resolve().parent / "static"
#: Most choices (``n``) and most prompts of a completions request.
MAX_N = 16
MAX_PROMPTS = 64
#: Completions whose thread events are kept for ``GET /v1/pasta/events/{id}`` (oldest dropped).
EVENT_LOGS = 256

# the engine's parameter names as the OpenAI API spells them
_PARAM_NAMES = {
    "max_new_tokens": "max_tokens",
    "position_policy": "pasta.position_policy",
    "max_threads": "pasta.max_threads",
    "max_forks": "pasta.max_forks",
    "annotated_response": "pasta.annotated_response",
    "mode": "pasta.mode",
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


def _get(body: dict[str, Any], name: str, default: Any = None) -> Any:
    v = body.get(name, default)
    return default if v is None else v


@dataclasses.dataclass
class _Options:
    """What a completions request asks for, checked."""

    params: list[SamplingParams]  # one per choice
    n: int
    stream: bool
    include_usage: bool
    stop: list[str]
    logprobs: bool
    mode: str
    events: bool
    annotated_response: str | None
    limits: Limits | None
    position_policy: str | None


class _Server:
    """The app's state: the engine, the served model's name and the request defaults."""

    def __init__(self, engine: AsyncEngine, model_name: str, api_key: str | None, defaults: SamplingParams,
                 seed: int):
        self.engine = engine
        self.model_name = model_name
        self.api_key = api_key
        self.defaults = defaults
        self.rng = random.Random(seed)  # seeds of requests that give none
        self.created = int(time.time())
        self.logs: OrderedDict[str, _EventLog] = OrderedDict()

    # ------------------------------------------------------------------ checks

    def check_auth(self, request: Request) -> None:
        """Raise OpenAIError 401 unless the request sends ``Authorization: Bearer <api_key>``
        (no check when the server has no key)."""
        if self.api_key is None:
            return
        got = request.headers.get("authorization", "")
        if got != f"Bearer {self.api_key}":
            raise OpenAIError(401, "missing or wrong API key: send 'Authorization: Bearer <key>'",
                              type="authentication_error", code="invalid_api_key")

    def check_model(self, body: dict[str, Any]) -> None:
        """Raise OpenAIError 404 (param ``model``) when the request names a model other than
        the one served; a request without ``model`` gets the served one."""
        model = body.get("model")
        if model is None:
            return
        if model != self.model_name:
            raise OpenAIError(404, f"the model {model!r} does not exist: this server serves {self.model_name!r}",
                              param="model", code="model_not_found")

    def options(self, body: dict[str, Any], chat: bool) -> _Options:
        """Check every parameter of a completions request (ParameterError names the first bad
        one as OpenAI spells it)."""
        for name, neutral in (("presence_penalty", 0), ("frequency_penalty", 0)):
            if _get(body, name, neutral) != neutral:
                raise ParameterError(name, body[name], message=f"{name} is not supported by pasta-engine (leave it 0)")
        for name in ("logit_bias", "tools", "functions", "tool_choice", "function_call", "suffix"):
            if body.get(name):
                raise ParameterError(name, body[name], message=f"{name} is not supported by pasta-engine")
        if body.get("response_format") not in (None, {"type": "text"}):
            raise ParameterError("response_format", body["response_format"],
                                 message="only response_format {\"type\": \"text\"} is supported")
        if not chat and body.get("echo"):
            raise ParameterError("echo", body["echo"], message="echo is not supported by pasta-engine")
        n = _get(body, "n", 1)
        check_int("n", n, 1, MAX_N)
        if not chat and _get(body, "best_of", n) != n:
            raise ParameterError("best_of", body["best_of"], message="best_of other than n is not supported")
        name = "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None else "max_tokens"
        max_tokens = _get(body, name, self.defaults.max_new_tokens)
        check_int(name, max_tokens, 1)
        temperature = _get(body, "temperature", self.defaults.temperature)
        check_float("temperature", temperature, 0.0, 2.0)
        top_p = _get(body, "top_p", self.defaults.top_p)
        check_float("top_p", top_p, 0.0, 1.0, lo_open=True)
        top_k = _get(body, "top_k", self.defaults.top_k)
        check_int("top_k", top_k, 0)
        seed = body.get("seed")
        if seed is None:
            seed = self.rng.randrange(MAX_SEED + 1)
        else:
            check_int("seed", seed, -(2**63), MAX_SEED)
        stop = _get(body, "stop", [])
        stop = [stop] if isinstance(stop, str) else stop
        if not isinstance(stop, list) or len(stop) > 4 or not all(isinstance(s, str) and s for s in stop):
            raise ParameterError("stop", body.get("stop"), "a non-empty string or a list of at most 4 of them")
        stream = _get(body, "stream", False)
        if not isinstance(stream, bool):
            raise ParameterError("stream", stream, "true or false")
        so = body.get("stream_options")
        if so is not None and not stream:
            raise ParameterError("stream_options", so, message="stream_options is only allowed with stream=true")
        if so is not None and (not isinstance(so, dict) or not isinstance(so.get("include_usage", False), bool)):
            raise ParameterError("stream_options", so, "{\"include_usage\": true or false}")
        include_usage = bool(so and so.get("include_usage"))
        if chat:
            logprobs = _get(body, "logprobs", False)
            if not isinstance(logprobs, bool):
                raise ParameterError("logprobs", logprobs, "true or false")
            if _get(body, "top_logprobs", 0) != 0:
                raise ParameterError("top_logprobs", body["top_logprobs"],
                                     message="top_logprobs > 0 is not supported: pasta-engine returns the logprob of "
                                     "each sampled token only (logprobs=true)")
        else:
            lp = body.get("logprobs")
            if lp not in (None, 0) or isinstance(lp, bool):
                raise ParameterError("logprobs", lp, message="only logprobs=0 (the sampled tokens' logprobs, no "
                                     "alternatives) is supported")
            logprobs = lp == 0
        pasta = _get(body, "pasta", {})
        if not isinstance(pasta, dict):
            raise ParameterError("pasta", pasta, "an object with mode, position_policy, max_threads, max_forks, "
                                 "events, annotated_response")
        known = ("mode", "position_policy", "max_threads", "max_forks", "events", "annotated_response")
        for k in pasta:
            if k not in known:
                raise ParameterError(f"pasta.{k}", pasta[k], message=f"unknown pasta option {k!r}: known "
                                     f"{', '.join(known)}")
        mode = _get(pasta, "mode", "pasta")
        if mode not in ("pasta", "sequential"):
            raise ParameterError("pasta.mode", mode, "'pasta' or 'sequential'")
        events = _get(pasta, "events", False)
        if not isinstance(events, bool):
            raise ParameterError("pasta.events", events, "true or false")
        limits = None
        if pasta.get("max_threads") is not None or pasta.get("max_forks") is not None:
            base = self.engine.engine.config.limits
            mt = _get(pasta, "max_threads", base.max_threads or 0)
            check_int("pasta.max_threads", mt, 0)
            mf = _get(pasta, "max_forks", base.max_forks)
            check_int("pasta.max_forks", mf, 0)
            limits = dataclasses.replace(base, max_threads=mt or None, max_forks=mf)
        ann = pasta.get("annotated_response")
        if ann is not None and not isinstance(ann, str):
            raise ParameterError("pasta.annotated_response", ann, "a string")
        params = [SamplingParams(max_new_tokens=max_tokens, temperature=float(temperature), top_p=float(top_p),
                                 top_k=top_k, seed=(seed + i) % (MAX_SEED + 1), return_logprobs=logprobs)
                  for i in range(n)]
        return _Options(params=params, n=n, stream=stream, include_usage=include_usage, stop=stop, logprobs=logprobs,
                        mode=mode, events=events, annotated_response=ann, limits=limits,
                        position_policy=pasta.get("position_policy"))

    # ------------------------------------------------------------------ requests

    async def start(self, prompts: Sequence[Any], opts: _Options, cid: str, chat: bool) -> list[RequestStream]:
        """Queue one engine request per (prompt, choice); abort them all if one is refused."""
        streams: list[RequestStream] = []
        try:
            for p, prompt in enumerate(prompts):
                for i, params in enumerate(opts.params):
                    streams.append(await self.engine.add_request(
                        prompt, params, opts.mode, f"{cid}-{p * opts.n + i}", output_kind="delta", events=True,
                        stop=opts.stop, chat_template=chat, annotated_response=opts.annotated_response,
                        limits=opts.limits, position_policy=opts.position_policy))
        except BaseException:
            for s in streams:
                s.abort()
            raise
        log = _EventLog()
        self.logs[cid] = log
        while len(self.logs) > EVENT_LOGS:
            self.logs.popitem(last=False)
        return streams

    def choice_ext(self, out: StreamOutput) -> dict[str, Any]:
        """The ``pasta`` object of a finished choice."""
        r = out.result
        return {"annotated_text": r.annotated_text, "stats": dataclasses.asdict(r.stats), "diagnostics": r.diagnostics,
                "mode": r.mode}

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


class _EventLog:
    """The thread events of one completion, for late and live readers (one event loop)."""

    def __init__(self) -> None:
        self.records: list[dict[str, Any]] = []
        self.done = False
        self._wake = asyncio.Event()

    def add(self, records: list[dict[str, Any]]) -> None:
        if records:
            self.records += records
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


def build_app(engine: AsyncEngine, model_name: str, *, api_key: str | None = None,
              defaults: SamplingParams | None = None, seed: int = 0) -> FastAPI:
    """The FastAPI app over ``engine``.

    Args:
        engine: the async engine (the app never shuts it down).
        model_name: the name ``/v1/models`` lists and requests must use (or leave out).
        api_key: when set, every ``/v1`` route needs ``Authorization: Bearer <api_key>``.
        defaults: sampling values for requests that leave them out (max_tokens, temperature,
            top_p, top_k; default: :class:`SamplingParams`'s).
        seed: seed of the random source that picks a seed for requests that give none."""
    srv = _Server(engine, model_name, api_key, defaults or SamplingParams(), seed)
    app = FastAPI(title="pasta-engine", description="PASTA learned asynchronous decoding: OpenAI-compatible API",
                  version="0.2.0")
    app.state.server = srv

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
        return JSONResponse(e.body(), status_code=e.status)

    async def body_of(request: Request) -> dict[str, Any]:
        srv.check_auth(request)
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise OpenAIError(400, f"the request body is not valid JSON: {e}") from None
        if not isinstance(body, dict):
            raise OpenAIError(400, "the request body must be a JSON object")
        srv.check_model(body)
        return body

    @app.get("/", include_in_schema=False)
    async def index() -> FileResponse:
        return FileResponse(STATIC_DIR / "index.html", media_type="text/html")

    @app.get("/health")
    async def health() -> JSONResponse:
        if not engine.is_running:
            raise _as_openai_error(engine.dead_error or EngineDeadError("the engine is not running"))
        return JSONResponse({"status": "ok"})

    @app.get("/v1/models")
    async def models(request: Request) -> JSONResponse:
        srv.check_auth(request)
        return JSONResponse({"object": "list", "data": [{
            "id": model_name, "object": "model", "created": srv.created, "owned_by": "pasta-engine",
            "max_model_len": engine.engine.max_positions}]})

    @app.get("/v1/pasta/stats")
    async def stats(request: Request) -> JSONResponse:
        srv.check_auth(request)
        return JSONResponse(await engine.stats())

    @app.get("/v1/pasta/events/{completion_id}")
    async def events(completion_id: str, request: Request) -> StreamingResponse:
        srv.check_auth(request)
        log = srv.logs.get(completion_id)
        if log is None:
            raise OpenAIError(404, f"no completion {completion_id!r} (it is unknown, or too old: the last "
                              f"{EVENT_LOGS} are kept)", param="id", code="not_found")

        async def gen() -> AsyncIterator[str]:
            async for rec in log.follow():
                yield _sse(rec)
            yield "data: [DONE]\n\n"

        return StreamingResponse(gen(), media_type="text/event-stream")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        body = await body_of(request)
        opts = srv.options(body, chat=True)
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise ParameterError("messages", messages, "a non-empty list of {role, content} objects")
        cid = f"chatcmpl-{uuid.uuid4().hex}"
        try:
            streams = await srv.start([messages], opts, cid, chat=True)
        except Exception as e:
            raise _as_openai_error(e, "messages") from None
        return await _respond(srv, request, streams, opts, cid, chat=True)

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await body_of(request)
        opts = srv.options(body, chat=False)
        prompt = body.get("prompt")
        if isinstance(prompt, str) or (isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt)):
            prompts = [prompt]
        elif isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
            prompts = list(prompt)
        else:
            raise ParameterError("prompt", prompt, "a string, a list of token ids, or a list of either")
        if len(prompts) * opts.n > MAX_PROMPTS:
            raise ParameterError("prompt", len(prompts), message=f"{len(prompts)} prompts x n={opts.n} is more than "
                                 f"{MAX_PROMPTS} completions in one request")
        cid = f"cmpl-{uuid.uuid4().hex}"
        try:
            streams = await srv.start(prompts, opts, cid, chat=False)
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
                texts[i].append(out.text)
                log.add(_event_records(i, out))
                if out.finished:
                    finals[i] = out
                    if out.finish_reason == "error":
                        raise OpenAIError(500, f"choice {i} failed: {out.error}", type="server_error")
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
        c["pasta"] = srv.choice_ext(out)
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
                    extra: dict[str, Any] = {"pasta": srv.choice_ext(out)}
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
    app = build_app(aengine, name, api_key=args.api_key, defaults=defaults, seed=args.seed)
    family = socket.AF_INET6 if ":" in args.host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((args.host, args.port))
    host, port = sock.getsockname()[:2]
    config = uvicorn.Config(app, log_level=args.log_level, access_log=args.log_level in ("debug", "info"),
                            timeout_graceful_shutdown=5)
    server = uvicorn.Server(config)

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
