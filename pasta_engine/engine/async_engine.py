"""The async engine: the step loop on one background thread, outputs as async iterators
(after vLLM's ``AsyncLLM``).

>>> import asyncio
>>> from pasta_engine import AsyncEngine, SamplingParams
>>> async def main():
...     engine = AsyncEngine.from_pretrained(None)                  # embedded SmolLM2
...     async for out in engine.generate("Name three fruits.", SamplingParams(max_new_tokens=64),
...                                      output_kind="delta"):
...         print(out.text, end="", flush=True)                     # reading-order deltas
...     engine.shutdown()
>>> asyncio.run(main())

One thread (``pasta-engine-core``) owns the :class:`~pasta_engine.engine.llm_engine.Engine`: it
takes commands (add, abort, call) from a queue between steps, runs :meth:`Engine.step` while any
request is unfinished, turns each step's :class:`~pasta_engine.core.outputs.RequestOutput`\\ s
(reading-order text and tokens, rendered by :mod:`pasta_engine.core.render`, cut at a stop
string by the engine itself; it reads nothing else of the engine's requests) into
:class:`StreamOutput`\\ s (the request's output kind, see :mod:`pasta_engine.engine.streaming`)
and hands them to each request's event loop
with ``call_soon_threadsafe``. A forward pass therefore never blocks a caller's event loop, and no
call from an event loop ever waits for the engine's lock.

Backpressure: each request has one pending output slot; a consumer that lags behind gets the
outputs merged (deltas concatenated) instead of a queue that grows without bound.

Failure model (docs/DESIGN.md section 7): a bad request raises
:class:`~pasta_engine.errors.ParameterError` from :meth:`AsyncEngine.add_request` (or the first
iteration of :meth:`AsyncEngine.generate`) and takes no resource; a request that fails in flight
ends with ``finish_reason="error"``; cancelling an iterator (its task cancelled, ``aclose``, a
client gone) aborts its request, and the engine thread frees its KV pages before its next step;
a command that fails on the engine thread (a bad abort, a call that raises) fails its own caller
only; an exception escaping a step (an error the engine cannot pin on one request) marks the
engine dead: every open request's iterator, every command in flight and every later call raise
:class:`~pasta_engine.errors.EngineDeadError` instead of hanging, and the thread's last act is
:meth:`Engine.shutdown` (tensor-parallel workers and the process group stopped).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable, Sequence

from ..config import Limits, PositionPolicy, SamplingParams
from ..core.outputs import CompletionOutput, RequestOutput, RequestResult, RequestStats
from ..core.render import ThreadEvent
from ..errors import EngineDeadError, ParameterError
from ..lang.dialect import Dialect
from .input_processor import CHAT_ROLES, InputProcessor, RequestInputs
from .llm_engine import Engine, Prompt
from .streaming import OutputKind

__all__ = ["AsyncEngine", "StreamOutput", "CompletionOutput", "RequestStream", "format_chat", "CHAT_ROLES"]

logger = logging.getLogger(__name__)


@dataclass
class StreamOutput:
    """One output of a request of the async engine.

    Attributes:
        request_id: the request's id.
        text: reading-order clean text (tags left out, a possible partial tag or stop string
            held back): what is new since the previous output for ``output_kind="delta"``, all
            of it so far for ``cumulative`` and ``final``. Nothing sent is ever taken back.
        token_ids: token ids sampled for the request (all threads, in sampling order, EOS
            included): new ones (``delta``) or all so far.
        finished: whether this is the request's last output; then ``finish_reason`` is
            ``stop`` (end of sequence, a stop token, or a stop string: ``stop_reason`` names
            it), ``length``, ``abort`` or ``error`` (``error`` holds the message), and ``result``
            the engine's whole response (annotated text, stats; its text cut at a stop string
            as this stream's).
        events: thread events since the previous output (only when the request asked for
            them), in order.
        decode_steps: forward passes that sampled for the request so far.
        tokens_decoded: tokens sampled for it so far, all threads.
        logprobs: when the request asked for them (``SamplingParams.return_logprobs``),
            ``(token id, logprob)`` of the sampled tokens in the response's spliced order (tag
            tokens included, inserted ones left out), each sent with the output whose text
            reaches it (:attr:`~pasta_engine.core.outputs.RequestOutput.new_logprobs`): new ones
            (``delta``) or all so far; the final output's concatenate to ``result``'s. Empty
            otherwise."""

    request_id: str
    text: str
    token_ids: list[int]
    finished: bool = False
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    error: str | None = None
    events: list[ThreadEvent] = field(default_factory=list)
    decode_steps: int = 0
    tokens_decoded: int = 0
    result: RequestResult | None = None
    logprobs: list[tuple[int, float]] = field(default_factory=list)

    @property
    def stats(self) -> RequestStats | None:
        """The finished request's stats (None before)."""
        return self.result.stats if self.result is not None else None

    @property
    def outputs(self) -> list["CompletionOutput"]:
        """vLLM's shape of the same output: one :class:`CompletionOutput` (``index`` 0), so code
        written for vLLM's ``AsyncLLM`` (``out.outputs[0].text``) reads it unchanged."""
        return [CompletionOutput(0, self.text, self.token_ids, self.finish_reason, self.stop_reason, result=self.result)]


def _merge(old: StreamOutput, new: StreamOutput, kind: OutputKind) -> StreamOutput:
    """Fold ``new`` into an output the consumer has not taken yet."""
    if kind is OutputKind.DELTA:
        new.text = old.text + new.text
        new.token_ids = old.token_ids + new.token_ids
        new.logprobs = old.logprobs + new.logprobs
    new.events = old.events + new.events
    return new


class _Collector:
    """A request's one-slot mailbox on its event loop (used on that loop's thread only)."""

    def __init__(self, kind: OutputKind):
        self.kind = kind
        self.pending: StreamOutput | None = None
        self.error: BaseException | None = None
        self.ready = asyncio.Event()

    def put(self, out: StreamOutput) -> None:
        self.pending = out if self.pending is None else _merge(self.pending, out, self.kind)
        self.ready.set()

    def fail(self, exc: BaseException) -> None:
        self.error = exc
        self.ready.set()

    async def get(self) -> StreamOutput:
        while self.pending is None:
            if self.error is not None:
                raise self.error
            self.ready.clear()
            await self.ready.wait()
        out, self.pending = self.pending, None
        return out


class RequestStream:
    """The outputs of one request, an async iterator (what :meth:`AsyncEngine.add_request`
    returns). Iteration ends after the finished output; leaving it early does not abort the
    request: call :meth:`abort`, or use :meth:`AsyncEngine.generate`, which does."""

    def __init__(self, engine: "AsyncEngine", request_id: str, collector: _Collector):
        self.engine = engine
        self.request_id = request_id
        self._collector = collector
        self.finished = False

    def __aiter__(self) -> "RequestStream":
        return self

    async def __anext__(self) -> StreamOutput:
        if self.finished:
            raise StopAsyncIteration
        out = await self._collector.get()
        if out.finished:
            self.finished = True
        return out

    def abort(self) -> None:
        """Abort the request (no wait: the engine thread frees its pages before its next step).
        It aborts this stream's request only: once that has finished, a later request that
        reuses its id is left alone."""
        if not self.finished:
            self.finished = True
            self.engine._post_command(("drop", (self.request_id, self._collector), None, None))


@dataclass(frozen=True, eq=False)
class _Add:
    """An add command for the engine thread: the request (typed, already checked for its
    types), what its stream wants, and where its outputs go."""

    inputs: RequestInputs
    kind: OutputKind
    events: bool
    collector: _Collector


@dataclass(eq=False)
class _Tracked:
    """The engine thread's record of one request of the async engine."""

    want_events: bool
    kind: OutputKind
    loop: asyncio.AbstractEventLoop
    collector: _Collector
    token_ids: list[int] = field(default_factory=list)
    events: list[ThreadEvent] = field(default_factory=list)  # held for output_kind="final"
    logprobs: list[tuple[int, float]] = field(default_factory=list)  # so far (cumulative, final)


class AsyncEngine:
    """An :class:`~pasta_engine.engine.llm_engine.Engine` driven by one background thread.

    Args:
        engine: the engine to own. From now on only this object's thread may call it.

    Use :meth:`generate` (an async generator that aborts its request when closed or
    cancelled) or :meth:`add_request` + the returned :class:`RequestStream`. :meth:`shutdown`
    aborts what is open and stops the thread; it is also called on leaving ``with``."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._tracked: dict[str, _Tracked] = {}  # engine thread only
        self._state = threading.Lock()  # orders "is it dead?" checks against dying and shutdown
        self._dead: EngineDeadError | None = None
        self._thread = threading.Thread(target=self._run, name="pasta-engine-core", daemon=True)
        self._thread.start()

    @classmethod
    def from_pretrained(cls, model: Any = None, **kwargs: Any) -> "AsyncEngine":
        """:meth:`Engine.from_pretrained` (same arguments), wrapped."""
        return cls(Engine.from_pretrained(model, **kwargs))

    # ------------------------------------------------------------------ state

    @property
    def is_running(self) -> bool:
        """Whether the engine thread is alive and takes requests."""
        return self._dead is None and self._thread.is_alive()

    @property
    def errored(self) -> bool:
        """Whether the engine is dead (an error or :meth:`shutdown`)."""
        return self._dead is not None

    @property
    def dead_error(self) -> EngineDeadError | None:
        """The error every call raises once the engine is dead (None while it runs)."""
        return self._dead

    async def check_health(self) -> None:
        """Raise EngineDeadError when the engine is dead."""
        if self._dead is not None:
            raise self._dead

    async def decode_tokens(self, token_ids: Sequence[int]) -> list[str]:
        """Each token's text (special tokens kept), decoded on the engine thread (the tokenizer
        is shared with its detokenizers). Raises ParameterError naming ``token_ids`` for an id
        that is not an integer (a bool is not one) or lies outside the model's vocabulary, before
        anything is queued; EngineDeadError."""
        ids = self._token_ids(token_ids)
        return await self._call(lambda: [self.engine.decode([t]) for t in ids])

    async def token_bytes(self, token_ids: Sequence[int]) -> list[bytes]:
        """Each token's own bytes (a byte-level token that holds part of a character gives that
        part, not U+FFFD), read on the engine thread from the tokenizer's byte table
        (:func:`~pasta_engine.lang.detokenizer.token_bytes_for`, built once per tokenizer); a
        tokenizer it does not reproduce gives each token's decoded text as UTF-8. Raises
        ParameterError naming ``token_ids`` for an id that is not an integer (a bool is not one)
        or lies outside the model's vocabulary, before anything is queued; EngineDeadError."""
        from ..lang.detokenizer import token_bytes_for

        ids = self._token_ids(token_ids)

        def read() -> list[bytes]:
            tb = token_bytes_for(self.engine.tokenizer)
            table = tb.table if tb is not None else []
            return [table[t] if t < len(table) else self.engine.decode([t]).encode("utf-8") for t in ids]

        return await self._call(read)

    def _token_ids(self, token_ids: Any) -> list[int]:
        """``token_ids`` checked as the input processor checks prompt ids (ParameterError naming
        ``token_ids``; a negative id would index the byte table from its end)."""
        return self.engine.input_processor.check_token_ids(token_ids, "token_ids")

    async def stats(self) -> dict[str, Any]:
        """:meth:`Engine.stats` read on the engine thread after every command sent before
        this call (so an abort or a cancelled iterator is already applied), plus ``open``:
        requests of this async engine that have not finished. Raises EngineDeadError."""
        return await self._call(lambda: {**self.engine.stats(), "open": len(self._tracked)})

    # ------------------------------------------------------------------ requests

    async def add_request(
        self,
        prompt: Prompt,
        params: SamplingParams | None = None,
        mode: str = "pasta",
        request_id: str | None = None,
        *,
        output_kind: str | OutputKind = "cumulative",
        events: bool = False,
        stop: Sequence[str] | None = None,
        chat_template: bool = True,
        annotated_response: str | None = None,
        limits: Limits | None = None,
        position_policy: str | PositionPolicy | None = None,
        dialect: str | Dialect | None = None,
    ) -> RequestStream:
        """Queue a request on the engine thread and return its output stream.

        Args:
            prompt: as :meth:`Engine.add_request` (a string, or a list of token ids), or chat
                messages ``[{"role": ..., "content": ...}, ...]`` (see :func:`format_chat`).
            params, mode, request_id, annotated_response, limits, position_policy, dialect: as
                :meth:`Engine.add_request` (``params.n`` must be 1: one stream is one completion;
                ``dialect``: a name of
                :data:`~pasta_engine.lang.dialect.DIALECT_NAMES` or a
                :class:`~pasta_engine.lang.dialect.Dialect`; default ``pasta``, PASTA-LANG).
            chat_template: False: a string prompt is tokenized as plain text, without the chat
                template or the PASTA-LANG system prompt (a text completion).
            output_kind: ``cumulative`` (the default, as vLLM's AsyncLLM: each output holds all
                the text so far) | ``delta`` (only what is new) | ``final`` (one output at the
                end) (see :class:`StreamOutput`).
            events: also report thread events (fork, text, end, join, finish).
            stop: strings that end the response right before them, the same as giving them
                as ``SamplingParams.stop`` (not both): the engine ends the request in the step
                whose reading-order text holds one (its pages freed), and its finished output
                says ``finish_reason="stop"`` and ``stop_reason``.

        Raises ParameterError (naming the parameter; ContextLengthError for a prompt that does
        not fit; naming ``dialect`` for an unknown dialect name) before the request takes any
        resource, EngineDeadError when the engine is dead. A registered dialect whose module
        cannot be imported raises that import's error (ModuleNotFoundError), also before the
        request takes any resource."""
        if not isinstance(events, bool):
            raise ParameterError("events", events, "True or False")
        try:
            kind = OutputKind.parse(output_kind)
        except ValueError as e:
            raise ParameterError("output_kind", output_kind, message=str(e)) from None
        params = InputProcessor.merge_stop(params, stop)
        # the engine renders every step for the stream (cumulative); the stream's own kind is applied here
        inputs = RequestInputs(prompt, params, mode, request_id, annotated_response, limits, position_policy,
                               dialect, chat_template, OutputKind.CUMULATIVE)
        loop = asyncio.get_running_loop()
        collector = _Collector(kind)
        fut = loop.create_future()
        self._post_command(("add", _Add(inputs, kind, events, collector), loop, fut))
        try:
            rid = await fut
        except asyncio.CancelledError:
            # cancelled after _accept handed over the id but before this task resumed: nobody
            # else knows the request, so it is aborted here (only while it is still this one)
            if fut.done() and not fut.cancelled() and fut.exception() is None:
                self._post_command(("drop", (fut.result(), collector), None, None))
            raise
        return RequestStream(self, rid, collector)

    async def generate(
        self,
        prompt: Prompt,
        params: SamplingParams | None = None,
        mode: str = "pasta",
        request_id: str | None = None,
        **options: Any,
    ) -> AsyncIterator[StreamOutput]:
        """Yield the outputs of one request until it finishes (an async generator).

        Arguments as :meth:`add_request`. Closing the generator early or cancelling the task
        that iterates it aborts the request (its KV pages are freed before the engine's next
        step). Raises what :meth:`add_request` raises at the first iteration, and
        EngineDeadError if the engine dies while the request is open."""
        stream = await self.add_request(prompt, params, mode, request_id, **options)
        try:
            async for out in stream:
                yield out
        finally:
            stream.abort()  # no-op once finished

    async def abort(self, request_id: str) -> bool:
        """Abort a request; when this returns its pages are free. Returns False when no
        unfinished request has that id. Raises ParameterError naming ``request_id`` when it is
        not a string (before anything is queued), EngineDeadError."""
        if not isinstance(request_id, str):
            raise ParameterError("request_id", request_id, "a request id string (the id add_request gave)")
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        self._post_command(("abort", request_id, loop, fut))
        return await fut

    def shutdown(self, timeout_s: float = 30.0) -> None:
        """Abort every open request (their iterators end with ``finish_reason="abort"``), stop
        the engine thread and wait for it (at most ``timeout_s`` seconds); the thread's last act
        is :meth:`Engine.shutdown` (tensor-parallel workers stopped), also when the engine died
        of an error (then this only waits for that). Later calls raise EngineDeadError. Safe to
        call twice."""
        with self._state:
            if self._dead is None:
                self._dead = EngineDeadError("the async engine was shut down")
                self._commands.put(("shutdown", None, None, None))
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout_s)

    def __enter__(self) -> "AsyncEngine":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()

    # ------------------------------------------------------------------ caller side

    def _post_command(self, cmd: tuple) -> None:
        """Queue a command for the engine thread; raise EngineDeadError if it is dead (a
        fire-and-forget abort, ``drop``, is dropped instead: the dead engine holds nothing)."""
        with self._state:
            if self._dead is not None:
                if cmd[0] == "drop":
                    return
                raise self._dead
            self._commands.put(cmd)

    async def check_requests(self, inputs: Sequence[RequestInputs]) -> list[SamplingParams]:
        """:meth:`Engine.check_request <pasta_engine.engine.llm_engine.Engine.check_request>` of
        each of ``inputs`` on the engine thread, queuing nothing: a group of requests can be
        refused whole before any takes a resource. Returns their sampling parameters; raises the
        first check's error (ParameterError, ContextLengthError), or EngineDeadError."""
        eng = self.engine
        return await self._call(lambda: [eng.check_request(i) for i in inputs])

    async def _call(self, fn: Callable[[], Any]) -> Any:
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        self._post_command(("call", fn, loop, fut))
        return await fut

    # ------------------------------------------------------------------ engine thread

    def _run(self) -> None:
        cmd = None  # the command being handled (its caller must hear if the thread dies now)
        try:
            while True:
                idle = not self.engine.has_unfinished_requests()
                cmd = self._commands.get() if idle else _get_nowait(self._commands)
                while cmd is not None:
                    if cmd[0] == "shutdown":
                        self._shutdown_now()
                        return
                    self._handle(cmd)
                    cmd = _get_nowait(self._commands)
                if self.engine.has_unfinished_requests():
                    self._dispatch(self.engine.step())
        except BaseException as e:  # noqa: BLE001 - the engine cannot go on: every request must hear of it
            self._die(e, cmd)

    def _handle(self, cmd: tuple) -> None:
        """Carry out one command. One that fails fails its own caller (its future gets the
        error; a fire-and-forget one is logged): a bad command never kills the engine."""
        what, payload, loop, fut = cmd
        try:
            self._do(what, payload, loop, fut)
        except Exception as e:  # noqa: BLE001 - the command's own error, not the engine's
            if fut is not None:
                _post(loop, _settle, fut, None, e)
            else:
                logger.exception("the async engine's %r command failed; the engine goes on", what)

    def _do(self, what: str, payload: Any, loop: asyncio.AbstractEventLoop | None, fut: asyncio.Future | None) -> None:
        if what == "add":
            add: _Add = payload
            try:  # tokenized here: the tokenizer is shared with this thread's detokenizers
                rid = self.engine.add_inputs(add.inputs)
            except Exception as e:  # a bad request (ParameterError) or one the engine could not take: its own
                _post(loop, _settle, fut, None, e)
                return
            self._tracked[rid] = _Tracked(add.events, add.kind, loop, add.collector)
            if not _post(loop, self._accept, fut, rid, add.collector):
                self.engine.abort(rid)
        elif what == "abort":  # AsyncEngine.abort: whatever request has that id
            _post(loop, _settle, fut, self.engine.abort(payload), None)
        elif what == "drop":  # a stream's own abort: only while its request is the one tracked under the id
            rid, collector = payload
            t = self._tracked.get(rid)
            # a stream closed after its request finished (in a race with the final output, or the
            # id reused since by another request): nothing to do
            if t is not None and t.collector is collector:
                self.engine.abort(rid)
        elif what == "call":
            try:
                value, err = payload(), None
            except Exception as e:  # the caller's function failed: report it to the caller
                value, err = None, e
            _post(loop, _settle, fut, value, err)

    def _accept(self, fut: asyncio.Future, rid: str, collector: _Collector) -> None:
        """On the caller's loop: hand over the request id, or abort it when nobody waits."""
        if fut.cancelled():
            self._post_command(("drop", (rid, collector), None, None))
        else:
            fut.set_result(rid)

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[_Collector, StreamOutput]]] = {}
        for o in outputs:
            t = self._tracked.get(o.request_id)
            if t is None:
                continue  # a request added to the Engine directly
            out = self._output(t, o)
            if o.finished:
                del self._tracked[o.request_id]
            if out is not None:
                by_loop.setdefault(t.loop, []).append((t.collector, out))
        for loop, items in by_loop.items():
            if not _post(loop, _deliver, items):  # that event loop is gone: nobody reads these requests
                for _, out in items:
                    if not out.finished:
                        self.engine.abort(out.request_id)

    def _output(self, t: _Tracked, o: RequestOutput) -> StreamOutput | None:
        """The StreamOutput for one step's RequestOutput (None when nothing is new). The text
        is the engine's (cut at a stop string, its possible start held back)."""
        new = o.new_token_ids  # each sampled token once, a preempted request's re-sampled ones not again
        t.token_ids += new
        lps = o.new_logprobs  # in spliced order, each with the output whose text reaches it
        if t.kind is not OutputKind.DELTA:
            t.logprobs += lps
        events = o.events if t.want_events else []
        if t.kind is OutputKind.FINAL:
            t.events += events
            if not o.finished:
                return None
            events, t.events = t.events, []
        elif not (o.delta_text or events or new or lps or o.finished):
            return None
        cumulative = t.kind is not OutputKind.DELTA
        return StreamOutput(
            request_id=o.request_id,
            text=o.text if cumulative else o.delta_text,
            token_ids=list(t.token_ids) if cumulative else new,
            finished=o.finished,
            finish_reason=o.finish_reason,
            stop_reason=o.stop_reason,
            error=o.error,
            events=events,
            decode_steps=o.decode_steps,
            tokens_decoded=o.tokens_decoded,
            result=o.result,
            logprobs=list(t.logprobs) if cumulative else lps,
        )

    def _shutdown_now(self) -> None:
        for rid, t in list(self._tracked.items()):
            self.engine.abort(rid)
        while self._tracked and self.engine.has_unfinished_requests():
            self._dispatch(self.engine.step())  # the aborts' final outputs (no forward is left to run)
        self._fail_pending(self._dead or EngineDeadError("the async engine was shut down"))
        self.engine.shutdown()  # tensor-parallel workers stop now, not at process exit

    def _die(self, exc: BaseException, cmd: tuple | None = None) -> None:
        """The thread's end after an error: every request, the command ``cmd`` it was handling
        and every queued one hear EngineDeadError; then :meth:`Engine.shutdown` stops what
        outlives the engine (tensor-parallel workers, the process group)."""
        err = EngineDeadError(f"the engine stopped after an error it could not pin on one request: "
                              f"{type(exc).__name__}: {exc}")
        err.__cause__ = exc
        with self._state:
            if self._dead is None:
                self._dead = err
        for rid in self._tracked:  # free their pages (a failed step already has; an error elsewhere has not)
            with contextlib.suppress(Exception):
                self.engine.abort(rid)
        if cmd is not None and cmd[3] is not None:  # taken off the queue: _fail_pending would not see it
            _post(cmd[2], _settle, cmd[3], None, self._dead)
        self._fail_pending(self._dead)
        try:
            self.engine.shutdown()
        except Exception:  # noqa: BLE001 - the engine is dead already; its callers have heard why
            logger.exception("Engine.shutdown() failed after the async engine died")

    def _fail_pending(self, err: EngineDeadError) -> None:
        """Every open request and every queued command hears ``err`` (the thread is ending)."""
        with self._state:
            for t in self._tracked.values():
                _post(t.loop, t.collector.fail, err)
            self._tracked.clear()
            while (cmd := _get_nowait(self._commands)) is not None:
                _, _, loop, fut = cmd
                if fut is not None:
                    _post(loop, _settle, fut, None, err)


def format_chat(engine: Engine, messages: Sequence[dict[str, Any]], mode: str = "pasta",
                dialect: str | Dialect | None = None) -> list[int]:
    """Prompt token ids for chat messages through the model's chat template: the engine's
    :meth:`InputProcessor.format_chat <pasta_engine.engine.input_processor.InputProcessor.format_chat>`
    (kept here for callers of the earlier API). Raises ParameterError naming ``messages``
    or ``dialect``."""
    return engine.input_processor.format_chat(messages, mode, dialect)


def _get_nowait(q: queue.SimpleQueue) -> Any:
    try:
        return q.get_nowait()
    except queue.Empty:
        return None


def _post(loop: asyncio.AbstractEventLoop, fn: Callable, *args: Any) -> bool:
    """Run ``fn(*args)`` on ``loop``'s thread; False when that loop is closed."""
    try:
        loop.call_soon_threadsafe(fn, *args)
        return True
    except RuntimeError:
        return False


def _settle(fut: asyncio.Future, value: Any, err: BaseException | None) -> None:
    if fut.done():  # cancelled, or settled already (a command handled just before the thread died)
        return
    if err is not None:
        fut.set_exception(err)
    else:
        fut.set_result(value)


def _deliver(items: list[tuple[_Collector, StreamOutput]]) -> None:
    for collector, out in items:
        collector.put(out)
