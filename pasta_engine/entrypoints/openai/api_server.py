"""An OpenAI-compatible HTTP server over the async engine (``pasta-engine serve``): the app, its
routes, and ``serve``.

A thin FastAPI app (run by uvicorn) over :class:`~pasta_engine.engine.async_engine.AsyncEngine`.
This module holds the routes; the rest of the package, one concern a module: :mod:`.schema` (the
request bodies: JSON read and checked, pydantic models), :mod:`.serving` (the app's state, a
request's checks and options, prompts tokenized off the event loop), :mod:`.completions` (the
answers in OpenAI's shapes, streamed or not), :mod:`.sse` (server-sent events and the thread
event logs), :mod:`.metrics` (Prometheus), :mod:`.auth` (API key, ``Host`` check) and
:mod:`.errors` (OpenAI's error body and the engine's errors mapped onto it).

* ``POST /v1/chat/completions`` and ``POST /v1/completions``, streamed (server-sent events,
  ``data: {...}`` lines ending with ``data: [DONE]``) or not; ``n``, ``max_tokens`` /
  ``max_completion_tokens`` / ``max_new_tokens``, ``temperature``, ``top_p``, ``top_k``,
  ``seed``, ``stop``, ``logprobs``, ``stream_options.include_usage``; each choice has vLLM's
  ``stop_reason`` (the stop string or ``stop_token_ids`` id that ended it, else null), and a
  sampled special token that is no tag leaves no text (``skip_special_tokens``). Bodies are read by the
  pydantic models of :mod:`.schema` (vLLM's field names; a field the engine does not honour, or
  an unknown one, is a 400 naming it). Streamed text is the response in reading order
  (:mod:`pasta_engine.engine.streaming`).
* the ``pasta`` extension: in a request, ``{"mode": "pasta" | "sequential" | "inline", "dialect": "pasta" |
  "apar" | "multiverse", "position_policy": ..., "max_threads": N (0 = unlimited), "max_forks":
  N, "max_fork_depth": N (>= 1), "fork_threshold": p (0 < p <= 1), "length_cut": "prefix" | "keep",
  "distinct_topics": bool, "chunk_clean_end": bool, "independent_topics": bool,
  "fork_headroom_tokens": N, "events": bool
  (stream=true only), "annotated_response": str}`` (:class:`.schema.PastaOptions` has each
  field's meaning; ``dialect``: the language the model writes,
  :data:`~pasta_engine.lang.dialect.DIALECT_NAMES`, default PASTA-LANG; ``annotated_response``
  replays that response, written in that dialect: forced decoding, so a sampling field or
  ``seed`` set with it is a 400, and so is a ``max_tokens`` below its length; a field set where
  it has no effect, such as ``max_threads`` in sequential mode, is a 400 naming
  ``pasta.<field>``: :func:`.serving.check_pasta_fields`); in each choice of a
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
copies, never on the engine thread, so a long prompt never stalls other requests' steps; a
request of several prompts has every prompt checked (the KV cache's fit included) before any is
queued, and an error names the prompt. With
``allowed_hosts`` set, a request whose ``Host`` header names another host is refused (400):
``serve`` sets it by default when it binds a loopback address without an API key (the local
names and the bind address itself), so that a web page cannot use the local server through DNS
rebinding. The API key (``/v1`` routes,
``/tokenize``, ``/detokenize`` and ``/openapi.json``) is compared in constant time; the
``Bearer`` scheme is case-insensitive. ``/health``, ``/version`` and ``/metrics`` need no key
(as in vLLM).

Errors use OpenAI's body ``{"error": {"message", "type", "param", "code"}}``: a bad parameter or
a prompt over the context is 400 naming the parameter, an unknown model 404, a missing or wrong
API key 401, a dead engine 503. An error after a stream has started is a last ``data:
{"error": ...}`` event before ``data: [DONE]``. A client that disconnects aborts its requests
(their KV pages are freed before the engine's next step).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from pathlib import Path
from typing import Any, AsyncIterator, Callable, Sequence

from fastapi import FastAPI, Request
from fastapi.openapi.utils import get_openapi
from fastapi.responses import FileResponse, JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ...config import SamplingParams
from ...engine.async_engine import AsyncEngine
from ...errors import EngineDeadError, ParameterError
from ..args import api_key_problem
from .auth import HostCheck, default_allowed_hosts
from .completions import respond
from .errors import OpenAIError, as_openai_error
from .schema import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest, parse_request
from .serving import MAX_BODY_BYTES, Server
from .sse import EVENT_LOG_BYTES, sse

__all__ = ["build_app", "serve", "served_model_name", "draining_server", "STATIC_DIR"]

STATIC_DIR = Path(__file__).resolve().parent / "static"
#: The page's icon: three bars of different lengths side by side (threads decoding together).
_FAVICON = (b'<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 16 16"><rect width="16" height="16" rx="3" '
            b'fill="#1d1d1f"/><rect x="3" y="3" width="10" height="2.5" fill="#f2c14e"/><rect x="3" y="6.75" width="6" '
            b'height="2.5" fill="#7ec4cf"/><rect x="3" y="10.5" width="8" height="2.5" fill="#e58f65"/></svg>')

#: Most prompts x choices of a completions request.
MAX_PROMPTS = 64


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
        api_key: when set, every ``/v1`` route, ``/tokenize``, ``/detokenize`` and
            ``/openapi.json`` need ``Authorization: Bearer <api_key>``; an empty key, or one with
            whitespace or control characters (a header cannot carry them intact, so it could
            never match), is a ParameterError.
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
    srv = Server(engine, model_name, api_key, defaults or SamplingParams(), seed, max_body_bytes, event_log_bytes)
    import pasta_engine

    version = pasta_engine.__version__
    # no Swagger UI or ReDoc (their pages load scripts from a CDN); /openapi.json is served below
    app = FastAPI(title="pasta-engine", description="PASTA learned asynchronous decoding: OpenAI-compatible API",
                  version=version, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.server = srv
    if allowed_hosts is not None:
        app.add_middleware(HostCheck, hosts=list(allowed_hosts))

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
        e = as_openai_error(exc)
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(EngineDeadError)
    async def _dead(_: Request, exc: EngineDeadError) -> JSONResponse:
        e = as_openai_error(exc)
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
            raise as_openai_error(engine.dead_error or EngineDeadError("the engine is not running"))
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

    @get("/v1/pasta/events/{completion_id}")
    async def events(completion_id: str, request: Request) -> Response:
        srv.check_auth(request)
        log = srv.logs.get(completion_id)
        if log is None:
            raise OpenAIError(404, f"no completion {completion_id!r} (it is unknown, or too old: the newest logs "
                              f"are kept, {srv.log_budget} bytes in all)", param="id", code="not_found")
        if request.method == "HEAD":  # the headers only: a live log is not followed
            return Response(media_type="text/event-stream")

        async def gen() -> AsyncIterator[str]:
            async for rec in log.follow():
                yield sse(rec)
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
            raise as_openai_error(e, "prompt") from None
        return JSONResponse({"count": len(ids), "max_model_len": engine.engine.max_positions, "tokens": ids})

    @app.post("/detokenize", openapi_extra=_body_schema(DetokenizeRequest))
    async def detokenize(request: Request) -> JSONResponse:
        try:
            req = parse_request(DetokenizeRequest, await srv.read_body(request))
            text = await srv.prompts.detokenize(req.tokens)  # off the event loop, as prompts are tokenized
        except Exception as e:
            raise as_openai_error(e, "tokens") from None
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
            raise as_openai_error(e, "messages") from None
        return await respond(srv, request, streams, opts, cid, chat=True)

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
            raise as_openai_error(e, "prompt") from None
        return await respond(srv, request, streams, opts, cid, chat=False)

    return app


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
    from ...models.loader import EMBEDDED_MODEL

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

    from ..args import build_engine, sampling_params

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
