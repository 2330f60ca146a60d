"""A completions request's answer in OpenAI's shapes: one JSON body (``chat.completion``,
``text_completion``) or a stream of chunks ending with ``data: [DONE]`` (an error after the
stream started is a last error event), its usage, and the abort of its requests when the
client leaves."""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any, AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse

from ...engine.async_engine import RequestStream, StreamOutput
from .errors import OpenAIError, as_openai_error
from .serving import Options, Server
from .sse import EventLog, EventStream, event_records, merge_streams, sse, until_disconnected

__all__ = ["respond"]


def _check_final(srv: Server, i: int, out: Any, cut: str) -> None:
    """Raise for choice ``i``'s final output ``out`` that is no answer: an OpenAIError 500 for
    ``error``, 503 for an ``abort`` because the engine is shutting down (``cut`` says what the
    client got of it)."""
    if out.finish_reason == "error":
        raise OpenAIError(500, f"choice {i} failed: {out.error}", type="server_error")
    if out.finish_reason == "abort" and srv.engine.dead_error is not None:
        raise OpenAIError(503, f"the server is shutting down: choice {i} was cut {cut}", type="server_error")

async def respond(srv: Server, request: Request, streams: list[RequestStream], opts: Options, cid: str,
                   chat: bool):
    log = srv.logs[cid]
    if opts.stream:
        def on_close() -> None:  # no-ops after a normal end
            for s in streams:
                s.abort()
            log.close()

        return EventStream(_stream(srv, streams, opts, cid, chat, log), on_close)
    collect = asyncio.create_task(_collect(srv, streams, opts, cid, chat, log))
    gone = asyncio.create_task(until_disconnected(request))
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


async def _collect(srv: Server, streams: list[RequestStream], opts: Options, cid: str, chat: bool,
                   log: EventLog) -> dict[str, Any]:
    texts: dict[int, list[str]] = {i: [] for i in range(len(streams))}
    finals: dict[int, StreamOutput] = {}
    try:
        async with contextlib.aclosing(merge_streams(streams)) as merged:  # an error aborts the other choices now
            async for i, out in merged:
                if opts.meter is not None:
                    opts.meter.output(i, out)
                texts[i].append(out.text)
                log.add(event_records(i, out))
                if out.finished:
                    finals[i] = out
                    _check_final(srv, i, out, "before it ended; send the request again to another server")
    except Exception as e:
        raise as_openai_error(e) from None
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
        c["stop_reason"] = out.stop_reason
        c["pasta"] = srv.choice_ext(out, opts)
        choices.append(c)
    return {"id": cid, "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
            "model": srv.model_name, "choices": choices, "usage": _usage(_prompt_tokens(finals, opts.n), finals)}


async def _stream(srv: Server, streams: list[RequestStream], opts: Options, cid: str, chat: bool,
                  log: EventLog) -> AsyncIterator[str]:
    created = int(time.time())
    obj = "chat.completion.chunk" if chat else "text_completion"
    usage_field = {"usage": None} if opts.include_usage else {}

    def chunk(choices: list[dict[str, Any]]) -> str:
        return sse({"id": cid, "object": obj, "created": created, "model": srv.model_name, "choices": choices,
                     **usage_field})

    def choice(i: int, text: str | None, finish: str | None = None, **extra: Any) -> dict[str, Any]:
        c: dict[str, Any] = {"index": i}
        if chat:
            c["delta"] = {} if text is None else {"content": text}
        else:
            c["text"] = text or ""
        c.update(logprobs=None, finish_reason=finish, stop_reason=None)  # vLLM's keys, in every chunk
        c.update(extra)
        return c

    finals: dict[int, StreamOutput] = {}
    # logprobs: each chunk carries those of the tokens its text reaches (entries that came with
    # no text, tag tokens or a held-back tail, ride with the choice's next chunk)
    lp_held: dict[int, list[tuple[int, float]]] = {i: [] for i in range(len(streams))}
    lp_offset: dict[int, int] = {i: 0 for i in range(len(streams))}

    async def with_logprobs(c: dict[str, Any]) -> dict[str, Any]:
        i = c["index"]
        if lp_held[i]:
            pairs, lp_held[i] = lp_held[i], []
            c["logprobs"], lp_offset[i] = await srv.logprobs_of(pairs, chat, lp_offset[i])
        return c

    try:
        if chat:
            for i in range(len(streams)):
                yield chunk([{**choice(i, ""), "delta": {"role": "assistant", "content": ""}}])
        async with contextlib.aclosing(merge_streams(streams)) as merged:  # an error aborts the other choices now
            async for i, out in merged:
                if opts.meter is not None:
                    opts.meter.output(i, out)
                log.add(event_records(i, out))
                if opts.logprobs:
                    lp_held[i] += out.logprobs
                if opts.events and (out.events or not out.finished):
                    ext = {"events": [e.to_dict() for e in out.events], "decode_steps": out.decode_steps,
                           "tokens_decoded": out.tokens_decoded}
                    yield chunk([await with_logprobs(choice(i, out.text, pasta=ext))])
                elif out.text:
                    yield chunk([await with_logprobs(choice(i, out.text))])
                if out.finished:
                    finals[i] = out
                    _check_final(srv, i, out, "after the text sent so far")
                    extra: dict[str, Any] = {"stop_reason": out.stop_reason,
                                             "pasta": srv.choice_ext(out, opts)}
                    yield chunk([await with_logprobs(choice(i, None, out.finish_reason, **extra))])
        if opts.include_usage:
            yield sse({"id": cid, "object": obj, "created": created, "model": srv.model_name, "choices": [],
                        "usage": _usage(_prompt_tokens(finals, opts.n), finals)})
    except Exception as e:  # after the stream started: a last error event
        yield sse(as_openai_error(e).body())
    finally:
        log.close()
    yield "data: [DONE]\n\n"


def _usage(prompt_tokens: int, finals: dict[int, StreamOutput]) -> dict[str, int]:
    completion = sum(o.result.stats.tokens_decoded for o in finals.values() if o.result is not None)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion,
            "total_tokens": prompt_tokens + completion}


def _prompt_tokens(finals: dict[int, StreamOutput], n: int) -> int:
    """Prompt tokens of a request: each prompt once, whatever ``n`` is."""
    return sum(len(o.result.prompt_ids) for i, o in finals.items() if i % n == 0 and o.result is not None)
