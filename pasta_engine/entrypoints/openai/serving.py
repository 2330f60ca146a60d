"""The app's state and what a completions request asks for: the engine, the served model, the
request defaults; the checks of a request (key, content type, size, model), its options checked
(:class:`Options`), its engine requests started, and the prompts tokenized off the event loop
(:class:`Prompts`)."""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import queue
import random
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Sequence

from fastapi import Request

from ...config import MAX_SEED, Limits, SamplingParams, limits_without_effect
from ...engine.async_engine import AsyncEngine, RequestStream, StreamOutput
from ...engine.input_processor import InputProcessor, RequestInputs, choice_params
from ...engine.streaming import OutputKind
from ...errors import ParameterError
from ...lang.dialect import DIALECT_NAMES, get_dialect
from ...lang.tokenization import decode
from .auth import check_api_key
from .errors import OpenAIError
from .metrics import Meter, Metrics
from .schema import (MIN_TOP_P, ChatCompletionRequest, CompletionRequest, PastaOptions, decode_json,
                     engine_sampling_fields, max_tokens_of)
from .sse import EVENT_LOG_BYTES, EventLog

__all__ = ["MAX_BODY_BYTES", "Options", "Server", "Prompts", "check_pasta_fields"]

#: The ``pasta`` extension's fields that are :class:`~pasta_engine.config.Limits` fields of the
#: same name, derived from both (a knob added to both reaches the request's limits by itself;
#: ``max_threads`` 0 is Limits' None, unlimited).
PASTA_LIMITS = tuple(f.name for f in dataclasses.fields(Limits) if f.name in PastaOptions.model_fields)


def request_limits(pasta: PastaOptions, base: Limits) -> Limits | None:
    """A request's :class:`~pasta_engine.config.Limits`: ``base`` (the engine's) with each
    :data:`PASTA_LIMITS` field the ``pasta`` extension sets (null: the engine's; ``max_threads``
    0: unlimited); None when it sets none (the engine's limits apply). Raises ParameterError
    (from ``Limits``) naming a field whose value ``Limits`` refuses."""
    given = {name: getattr(pasta, name) for name in PASTA_LIMITS if getattr(pasta, name) is not None}
    if "max_threads" in given:
        given["max_threads"] = given["max_threads"] or None
    return dataclasses.replace(base, **given) if given else None


def check_pasta_fields(pasta: PastaOptions) -> None:
    """Refuse a ``pasta`` field the request sets (not null) that has no effect in its mode and
    dialect (:func:`~pasta_engine.config.limits_without_effect`, the rule the CLI's flags follow
    too), raising ParameterError naming ``pasta.<field>``. ``fork_threshold``,
    ``independent_topics`` and ``fork_headroom_tokens`` are checked by the engine
    (:meth:`~pasta_engine.engine.input_processor.InputProcessor.process`). The dialect must be
    valid (:func:`_check_dialect`)."""
    unused = limits_without_effect(pasta.mode, nesting=get_dialect(pasta.dialect).nesting,
                                   replay=pasta.annotated_response is not None, dialect=pasta.dialect)
    for name, why in unused.items():
        value = getattr(pasta, name)
        if value is not None:
            raise ParameterError(f"pasta.{name}", value, message=f"pasta.{name}={value!r} has no effect in {why}; "
                                 "leave it out")


#: Default request-body limit (bytes).
MAX_BODY_BYTES = 2**20


@dataclasses.dataclass
class Options:
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
    max_tokens: tuple[str, int] | None = None  # (field, value) of the response length the request gave
    meter: "Meter | None" = None


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


class Server:
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
        self.logs: OrderedDict[str, EventLog] = OrderedDict()
        self.log_budget = event_log_bytes
        self.log_bytes = 0
        self.prompts = Prompts(engine)
        self.metrics = Metrics(engine, model_name)

    # ------------------------------------------------------------------ checks

    def check_auth(self, request: Request) -> None:
        """Raise OpenAIError 401 unless the request carries this server's API key
        (:func:`~.auth.check_api_key`)."""
        check_api_key(request, self.api_key)

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
        (415), at most ``max_body_bytes`` (413, read no further), then :func:`decode_json`
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
        body = await asyncio.to_thread(decode_json, b"".join(chunks))
        self.check_model(body)
        return body

    def options(self, req: ChatCompletionRequest | CompletionRequest, chat: bool) -> Options:
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
        check_pasta_fields(pasta)
        limits = request_limits(pasta, self.engine.engine.config.limits)
        more = engine_sampling_fields(req)  # vLLM's fields SamplingParams has too (penalties, ...)
        honoured = dict(max_new_tokens=max_tokens, return_logprobs=logprobs, stop=tuple(req.stops()))
        if pasta.annotated_response is not None:  # a replay samples nothing: the request's sampling fields
            # were checked neutral (schema.check_replay_sampling), and the server's defaults cannot apply
            params = SamplingParams(**honoured)
        else:
            params = SamplingParams(**honoured, temperature=float(temperature), top_p=float(top_p), top_k=top_k,
                                    seed=seed, n=req.n, **more)
        return Options(params=choice_params(params), n=req.n, stream=req.stream,  # seeds seed, seed + 1, ...
                        include_usage=bool(req.stream_options and req.stream_options.include_usage),
                        logprobs=logprobs, mode=pasta.mode, dialect=pasta.dialect,
                        events=pasta.events,
                        annotated_response=pasta.annotated_response, limits=limits,
                        position_policy=pasta.position_policy, max_tokens=given)

    # ------------------------------------------------------------------ requests

    async def start(self, prompts: Sequence[list[int]], opts: Options, cid: str, t0: float) -> list[RequestStream]:
        """Queue one engine request per (prompt's token ids, choice), after :meth:`check` when
        there are several prompts or a replay given ``max_tokens`` (so a refused request has
        queued nothing); abort them all if one is refused after all. ``t0``: when the request
        arrived (``time.monotonic``), for the metrics."""
        if len(prompts) > 1 or (opts.annotated_response is not None and opts.max_tokens is not None):
            await self.check(prompts, opts, cid)
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
        opts.meter = Meter(self.metrics, t0, opts.n)
        self.logs[cid] = EventLog(max(2**16, self.log_budget // 4), self._log_grew)
        return streams

    async def check(self, prompts: Sequence[list[int]], opts: Options, cid: str) -> None:
        """Make, for each prompt, every check the engine makes when it takes the request (its
        parameters, the prompt's fit in the KV cache, a replay's response: the engine builds
        the request, which holds no resource, and drops it), on the engine thread, before any
        prompt is queued: a request of several prompts then fails whole, naming the prompt
        (``prompt 1: ...``), before any of them has taken a resource (docs/DESIGN.md section 7).
        The choices of a prompt differ only in their seeds: its first is checked.

        A replay's ``max_tokens`` (or ``max_completion_tokens``, ``max_new_tokens``) below the
        replay's length is refused naming the field (ParameterError): a replay forces its whole
        response, the engine raises a smaller budget to it, so a smaller value would be ignored.

        Raises what the engine's ``add_request`` raises (ParameterError, ContextLengthError,
        EngineDeadError)."""
        several = len(prompts) > 1
        inputs = [RequestInputs(prompt, opts.params[0], opts.mode, f"{cid}-{p * opts.n}", opts.annotated_response,
                                opts.limits, opts.position_policy, opts.dialect, False, OutputKind.FINAL,
                                index=p if several else None)
                  for p, prompt in enumerate(prompts)]
        budgets = [p.max_new_tokens for p in await self.engine.check_requests(inputs)]
        if opts.max_tokens is not None:
            name, value = opts.max_tokens
            need = max(budgets)
            if need > value:  # only a replay raises the budget (to its response's length)
                raise ParameterError(name, value, message=(
                    f"{name}={value} is below the replay's length: a replay of pasta.annotated_response runs with a "
                    f"budget of {need} tokens whatever {name} says (it forces its whole response and cannot end "
                    f"early); leave {name} out or give at least {need}"))

    def _log_grew(self, log: "EventLog", nbytes: int) -> None:
        """Count a log's new bytes; drop the oldest logs while all of them hold more than the
        budget (the newest is always kept)."""
        self.log_bytes += nbytes
        while self.log_bytes > self.log_budget and len(self.logs) > 1:
            _, old = self.logs.popitem(last=False)
            old.dropped = True
            self.log_bytes -= old.nbytes

    def choice_ext(self, out: StreamOutput, opts: Options) -> dict[str, Any]:
        """The ``pasta`` object of a finished choice (``dialect``: the dialect its request ran
        in, a name of :data:`~pasta_engine.lang.dialect.DIALECT_NAMES`)."""
        r = out.result
        return {"annotated_text": r.annotated_text, "stats": dataclasses.asdict(r.stats), "diagnostics": r.diagnostics,
                "mode": r.mode, "dialect": opts.dialect}

    async def logprobs(self, out: StreamOutput, chat: bool) -> dict[str, Any] | None:
        """OpenAI's logprobs object for a finished choice: every sampled token in spliced order
        (tag tokens included, the inserted ``<async>`` tokens left out). A chat token's ``bytes``
        are the token's own (joined, they rebuild its text even where a character spans two
        tokens); a completion's ``text_offset`` indexes the concatenation of its ``tokens`` (the
        sampled text with its tags, not ``text``, which has none)."""
        r = out.result
        pairs = [(t, lp) for t, lp in zip(r.token_ids, r.logprobs or []) if lp is not None]
        lp, _ = await self.logprobs_of(pairs, chat)
        return lp

    async def logprobs_of(self, pairs: Sequence[tuple[int, float]], chat: bool,
                          text_offset: int = 0) -> tuple[dict[str, Any], int]:
        """OpenAI's logprobs object for ``pairs``, ``(token id, logprob)`` in spliced order (a
        whole choice's, or a streamed chunk's: :attr:`StreamOutput.logprobs
        <pasta_engine.engine.async_engine.StreamOutput.logprobs>`), each token's text and bytes
        read on the engine thread (both reads queued at once). ``text_offset``: characters of
        the choice's ``tokens`` before these (a completion's offsets count from its first
        token, so a stream's chunks concatenate to the non-streamed object).

        Returns the object and the text offset after these tokens. Raises EngineDeadError."""
        ids = [t for t, _ in pairs]
        if chat:
            texts, raw = await asyncio.gather(self.engine.decode_tokens(ids), self.engine.token_bytes(ids))
            return {"content": [{"token": s, "logprob": lp, "bytes": list(b), "top_logprobs": []}
                                for s, b, (_, lp) in zip(texts, raw, pairs)]}, text_offset
        texts = await self.engine.decode_tokens(ids)
        offsets, at = [], text_offset
        for s in texts:
            offsets.append(at)
            at += len(s)
        return {"tokens": texts, "token_logprobs": [lp for _, lp in pairs], "top_logprobs": None,
                "text_offset": offsets}, at


class Prompts:
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
