"""Streaming a PASTA response: output kinds, stop strings, and the reading-order stream (no torch).

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

That prefix, the deltas that never take anything back and the thread events are rendered once,
in :mod:`pasta_engine.engine.render` (:class:`~pasta_engine.engine.render.OutputRenderer`), and
every :class:`~pasta_engine.engine.request.RequestOutput` of the step API carries them. This
module adds what a stream's consumer chooses: :class:`OutputKind` (delta, cumulative, final) and
stop strings, applied to the reading-order text (what the reader sees) and held back like a
partial tag while a suffix could still become one (vLLM's rule), by :class:`StopMatcher` and
:class:`StopFilter`. :class:`ReadingOrderStream` renders straight from an interpreter (tests,
tools that drive an interpreter themselves).
"""

from __future__ import annotations

import enum
from typing import TYPE_CHECKING, Sequence

from .render import EVENT_KINDS, OutputRenderer, ThreadEvent, reading_order_prefix

if TYPE_CHECKING:
    from .interpreter import Interpreter

__all__ = [
    "OutputKind",
    "ThreadEvent",
    "EVENT_KINDS",
    "reading_order_prefix",
    "ReadingOrderStream",
    "StopMatcher",
    "StopFilter",
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


class StopFilter:
    """Stop strings over a prefix-stable text (each text extends the previous one).

    Args:
        stop: the stop strings (see :class:`StopMatcher`); none: the text passes unchanged.

    After :meth:`update`, ``sent`` is the text let through so far and ``stop_reason`` the stop
    string that ended it (None while none has). Raises ValueError for an empty stop string."""

    __slots__ = ("sent", "stop_reason", "_matcher")

    def __init__(self, stop: Sequence[str] = ()):
        self.sent = ""
        self.stop_reason: str | None = None
        self._matcher = StopMatcher(stop) if stop else None

    @property
    def stopped(self) -> bool:
        """Whether a stop string ended the text (the request should be aborted)."""
        return self.stop_reason is not None

    def update(self, text: str, finished: bool = False) -> str:
        """The part of ``text`` (the cumulative text now) to let through now: up to the first
        stop string (which is left out), less a tail that may still become one unless
        ``finished``. Empty once a stop string was seen."""
        if self.stopped or len(text) <= len(self.sent):
            return ""
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


class ReadingOrderStream:
    """The reading-order deltas and thread events of one request, rendered straight from its
    interpreter (an :class:`~pasta_engine.engine.render.OutputRenderer` and a
    :class:`StopFilter`; the engine's step outputs carry the same without stop strings).

    Args:
        events: also report :class:`ThreadEvent`\\ s.
        stop: stop strings applied to the reading-order text (see :class:`StopMatcher`).

    After :meth:`update` returns, ``sent`` is the reading-order text streamed so far and
    ``stop_reason`` the stop string that ended it (None while none has)."""

    def __init__(self, events: bool = False, stop: Sequence[str] = ()):
        self.events = events
        self.stop = list(stop)
        self._renderer = OutputRenderer()
        self._filter = StopFilter(self.stop)
        self._finished = False

    @property
    def sent(self) -> str:
        return self._filter.sent

    @property
    def stop_reason(self) -> str | None:
        return self._filter.stop_reason

    @property
    def stopped(self) -> bool:
        """Whether a stop string ended the text (the request should be aborted)."""
        return self._filter.stopped

    def update(self, interp: "Interpreter", finish_reason: str | None = None) -> tuple[str, list[ThreadEvent]]:
        """The new reading-order text and the thread events since the previous call.

        Args:
            interp: the request's interpreter now (a fresh one after a preemption is fine).
            finish_reason: the request's finish reason once it has ended (None while it runs):
                then every thread has ended and whatever was held back is flushed.

        Returns ``(delta, events)``; ``delta`` is empty once a stop string was seen."""
        step = self._renderer.update(interp, (), finish_reason)
        delta = self._filter.update(self._renderer.text, finish_reason is not None)
        return delta, (step.events if self.events else [])
