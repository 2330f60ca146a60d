"""Streaming a PASTA response in reading order, and the live events of its threads (no torch).

A PASTA response is read as: the main thread's text up to the first promise, that promise's
chunk, the main text after it up to the next promise, its chunk, and so on (docs/DESIGN.md section 7).
Its threads decode at the same time, so at any step the text a reader can be given is only the
prefix of that order that can no longer change:

* the main thread's clean text so far is final where it is: a later promise forks at the main
  thread's clean length at that moment, so its chunk splices after everything already written
  (the tag parser holds a possible partial tag back, so a tag's characters never reach the
  clean text; a partial tag the text ends in, or a malformed one, is left out);
* a chunk's clean text so far is final, and so is its place (right after its promise);
* what follows a chunk that is still decoding is not: the reader has not got there yet. The
  main text after an unfinished chunk is held, and flushed at once when the chunk ends;
* the last line of that prefix is held while it is only a list marker (``- ``, ``1. ``, spaces)
  or could still become one: a tag left out of it would leave an empty list item, which the
  clean text does not show (:func:`~pasta_engine.lang.tags.drop_empty_items`). It is released
  as soon as the line gets text of its own (or a chunk's).

:func:`reading_order_prefix` computes that prefix from an
:class:`~pasta_engine.engine.interpreter.Interpreter`'s state; :class:`ReadingOrderStream` turns
successive prefixes into deltas that never take anything back (a request restarted after a KV
preemption re-decodes the same tokens; nothing is sent again until it gets past what was sent)
and, on request, into :class:`ThreadEvent`\\ s: fork, per-thread text, end, join, finish. At the
request's end every thread has ended, so the prefix is the whole clean text, which equals the
result's ``text``: the deltas concatenate to it exactly.

Stop strings are applied to the reading-order text (what the reader sees), held back like a
partial tag while a suffix could still become one (vLLM's rule), by :class:`StopMatcher`.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, Sequence

from .interpreter import Interpreter, Thread, reading_order_key, splice_clean

__all__ = [
    "OutputKind",
    "ThreadEvent",
    "EVENT_KINDS",
    "reading_order_prefix",
    "ReadingOrderStream",
    "StopMatcher",
]


class OutputKind(str, enum.Enum):
    """What each output of a request carries (vLLM's ``RequestOutputKind``).

    ``delta``: the text and token ids that are new since the previous output; ``cumulative``:
    everything so far; ``final``: one output, when the request has finished."""

    DELTA = "delta"
    CUMULATIVE = "cumulative"
    FINAL = "final"

    @classmethod
    def parse(cls, value: "str | OutputKind") -> "OutputKind":
        """``value`` as an OutputKind. Raises ValueError naming the three kinds."""
        try:
            return cls(value)
        except ValueError:
            raise ValueError(f"output_kind must be 'delta', 'cumulative' or 'final', got {value!r}") from None


#: Kinds of :class:`ThreadEvent`, in the order one thread goes through them.
EVENT_KINDS = ("fork", "text", "end", "join", "finish")


@dataclass(frozen=True)
class ThreadEvent:
    """Something that happened to one thread of a request.

    Attributes:
        kind: ``fork`` (a promise forked thread ``thread`` from ``parent``; ``topic`` and
            ``tokens``, the predicted length in tokens, come from the promise; ``at`` is the
            main thread's clean length in characters where the chunk splices in), ``text``
            (``text`` is the thread's new clean text, tags left out), ``end`` (the thread stopped
            decoding; ``reason``: ``close`` at ``</async>``, ``eos``, ``cap`` (its length cap),
            ``length``, ``trace_end``, ``abort``, ``error``, or ``not_run`` for a chunk the request
            ended before it ran), ``join`` (an ended chunk became visible to the main thread, at a
            ``<sync/>`` or at the main thread's end), ``finish`` (the request ended; thread 0,
            ``reason`` is its finish reason).
        thread: the thread's id (0 is the main thread; children are numbered in fork order).
    """

    kind: str
    thread: int
    parent: int | None = None
    topic: str | None = None
    tokens: int | None = None
    at: int | None = None
    text: str | None = None
    reason: str | None = None

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict without the fields this kind does not use."""
        return {k: v for k, v in self.__dict__.items() if v is not None}


def _order(interp: Interpreter) -> list[Thread]:
    """The children in reading order: by splice offset in the main thread's clean text, then
    fork order (the order :meth:`Interpreter.clean_text` splices them in)."""
    return sorted(interp.threads[1:], key=reading_order_key)


def reading_order_prefix(interp: Interpreter) -> str:
    """The longest prefix of the response in reading order that can no longer change: main
    text and chunks in reading order, stopping after the first chunk that is still decoding
    (its text so far included), less a last line that may still become an empty list item.
    Once the request has ended, :meth:`Interpreter.clean_text` (with ``final=True``) is the
    whole text, of which every earlier prefix is a prefix."""
    main = interp.main
    chunks: list[tuple[Thread, str, list[int], bool]] = []
    stop = None
    for c in _order(interp):
        chunks.append((c, "".join(c.clean), c.drops, c.ended))
        if not c.ended:
            stop = c
            break
    return splice_clean("".join(main.clean), main.drops, chunks, False, stop)


class StopMatcher:
    """Stop strings over a growing text.

    Args:
        stop: strings; the text ends right before the first occurrence of any of them (the
            stop string itself is not part of the text). Empty strings are not allowed.

    Raises ValueError for an empty stop string."""

    def __init__(self, stop: Sequence[str]):
        if any(not s for s in stop):
            raise ValueError("a stop string must not be empty")
        self.stop = list(stop)
        self.longest = max((len(s) for s in self.stop), default=0)

    def find(self, text: str, start: int = 0) -> tuple[int, str] | None:
        """``(index, stop string)`` of the earliest stop string in ``text`` that ends after
        ``start`` (None when there is none)."""
        lo = max(0, start - self.longest + 1)
        best: tuple[int, str] | None = None
        for s in self.stop:
            i = text.find(s, lo)
            if i >= 0 and (best is None or i < best[0]):
                best = (i, s)
        return best

    def held(self, text: str) -> int:
        """Characters at the end of ``text`` that could be the start of a stop string (held
        back until the next text shows whether they are)."""
        for k in range(min(self.longest - 1, len(text)), 0, -1):
            tail = text[-k:]
            if any(s.startswith(tail) for s in self.stop):
                return k
        return 0


@dataclass
class ReadingOrderStream:
    """What of one request has been streamed, and what is new at each step.

    Args:
        events: also report :class:`ThreadEvent`\\ s.
        stop: stop strings applied to the reading-order text (see :class:`StopMatcher`).

    After :meth:`update` returns, ``sent`` is the reading-order text streamed so far and
    ``stop_reason`` the stop string that ended it (None while none has)."""

    events: bool = False
    stop: Sequence[str] = ()
    sent: str = ""
    stop_reason: str | None = None
    _matcher: StopMatcher | None = None
    _thread_sent: dict[int, int] = field(default_factory=dict)
    _forked: set[int] = field(default_factory=set)
    _ended: set[int] = field(default_factory=set)
    _joined: set[int] = field(default_factory=set)
    _finished: bool = False

    def __post_init__(self) -> None:
        self._matcher = StopMatcher(self.stop) if self.stop else None

    @property
    def stopped(self) -> bool:
        """Whether a stop string ended the text (the request should be aborted)."""
        return self.stop_reason is not None

    def update(self, interp: Interpreter, finish_reason: str | None = None) -> tuple[str, list[ThreadEvent]]:
        """The new reading-order text and the thread events since the previous call.

        Args:
            interp: the request's interpreter now (a fresh one after a preemption is fine).
            finish_reason: the request's finish reason once it has ended (None while it runs):
                then every thread has ended and whatever was held back is flushed.

        Returns ``(delta, events)``; ``delta`` is empty once a stop string was seen."""
        delta = self._text_delta(interp, finish_reason is not None)
        events = self._events(interp, finish_reason) if self.events else []
        return delta, events

    def _text_delta(self, interp: Interpreter, finished: bool) -> str:
        if self.stopped:
            return ""
        text = interp.clean_text(final=True) if finished else reading_order_prefix(interp)
        if len(text) <= len(self.sent):
            return ""  # restarted after a preemption: nothing new until it gets past what was sent
        end = len(text)
        if self._matcher is not None:
            hit = self._matcher.find(text, len(self.sent))
            if hit is not None:
                end, self.stop_reason = hit[0], hit[1]
            elif not finished:
                end -= self._matcher.held(text)
        if end <= len(self.sent):
            return ""
        delta = text[len(self.sent) : end]
        self.sent += delta
        return delta

    def _events(self, interp: Interpreter, finish_reason: str | None) -> list[ThreadEvent]:
        out: list[ThreadEvent] = []
        main = interp.main
        forks = sorted((c for c in interp.threads[1:] if c.tid not in self._forked), key=reading_order_key)
        main_text = "".join(main.clean)
        sent = self._thread_sent.get(0, 0)
        # the main thread's new text, with each new fork at its splice point (a column view then
        # shows where each chunk belongs)
        for c in forks:
            if c.fork_clean > sent:
                out.append(ThreadEvent("text", 0, text=main_text[sent : c.fork_clean]))
                sent = c.fork_clean
            p = c.promise
            out.append(ThreadEvent("fork", c.tid, parent=0, topic=p.topic, tokens=p.tokens, at=c.fork_clean))
            self._forked.add(c.tid)
        if len(main_text) > sent:
            out.append(ThreadEvent("text", 0, text=main_text[sent:]))
            sent = len(main_text)
        self._thread_sent[0] = max(sent, self._thread_sent.get(0, 0))
        if main.finish is not None and 0 not in self._ended:
            out.append(ThreadEvent("end", 0, reason=main.finish))
            self._ended.add(0)
        for c in interp.threads[1:]:
            if c.tid not in self._forked:
                continue
            text = "".join(c.clean)
            done = self._thread_sent.get(c.tid, 0)
            if len(text) > done:
                out.append(ThreadEvent("text", c.tid, text=text[done:]))
                self._thread_sent[c.tid] = len(text)
            if c.ended and c.tid not in self._ended:
                out.append(ThreadEvent("end", c.tid, reason=c.finish or finish_reason or "stop"))
                self._ended.add(c.tid)
            implicit = finish_reason == "stop" and c.finish != "not_run"  # the main thread's end syncs
            if (c.joined or implicit) and c.ended and c.tid not in self._joined:
                out.append(ThreadEvent("join", c.tid, parent=0))
                self._joined.add(c.tid)
        if finish_reason is not None and not self._finished:
            if 0 not in self._ended:
                out.append(ThreadEvent("end", 0, reason=finish_reason))
                self._ended.add(0)
            out.append(ThreadEvent("finish", 0, reason=finish_reason))
            self._finished = True
        return out
