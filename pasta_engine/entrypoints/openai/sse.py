"""Server-sent events: the ``data: {...}`` lines, the event stream response that aborts its
requests however it ends, the merge of several request streams, and the per-completion log of
thread events that ``GET /v1/pasta/events/{id}`` replays and follows."""

from __future__ import annotations

import asyncio
import json
from typing import Any, AsyncIterator, Callable, Sequence

from fastapi import Request
from fastapi.responses import StreamingResponse

from ...engine.async_engine import RequestStream, StreamOutput

__all__ = ["EVENT_LOG_BYTES", "EventLog", "EventStream", "event_records", "merge_streams", "sse", "until_disconnected"]

#: Default memory for the thread events kept for ``GET /v1/pasta/events/{id}`` (bytes, all
#: completions together; the oldest completions' logs are dropped first, and one completion's
#: log keeps at most a quarter of it).
EVENT_LOG_BYTES = 64 * 2**20


def record_bytes(rec: dict[str, Any]) -> int:
    """About the bytes of a record as JSON (cheaper than encoding it)."""
    return 2 + sum(len(k) + (len(v) if isinstance(v, str) else 8) + 6 for k, v in rec.items())


class EventLog:
    """The thread events of one completion, for late and live readers (one event loop).

    Holds at most ``cap`` bytes of records (about their JSON size): past it, one ``truncated``
    record ends what is kept (live readers then see the log end with it). ``grew(log, n)`` is
    told of every byte added until the server drops the log (``dropped``)."""

    def __init__(self, cap: int = EVENT_LOG_BYTES, grew: Callable[["EventLog", int], None] | None = None) -> None:
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
            size = sum(record_bytes(r) for r in records)
            if self.nbytes + size > self.cap:
                self.truncated = True
                records = [{"kind": "truncated", "message": f"this completion's event log reached its cap of "
                            f"{self.cap} bytes: later events are not kept"}]
                size = record_bytes(records[0])
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


def event_records(index: int, out: StreamOutput) -> list[dict[str, Any]]:
    recs = [{"index": index, **e.to_dict()} for e in out.events]
    recs.append({"index": index, "kind": "progress", "decode_steps": out.decode_steps,
                 "tokens_decoded": out.tokens_decoded})
    return recs


async def merge_streams(streams: Sequence[RequestStream]) -> AsyncIterator[tuple[int, StreamOutput]]:
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


class EventStream(StreamingResponse):
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


async def until_disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


def sse(obj: Any) -> str:
    return f"data: {json.dumps(obj)}\n\n"
