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
in :mod:`pasta_engine.core.render` (:class:`~pasta_engine.core.render.OutputRenderer`), and
every :class:`~pasta_engine.core.outputs.RequestOutput` of the step API carries them. This
module adds what a stream's consumer chooses: :class:`OutputKind` (delta, cumulative, final).
Stop strings are the request's (``SamplingParams.stop``): the engine applies them itself (the
interpreter ends the request, the renderer cuts the text and holds back a tail that may still
become one, vLLM's rule); :class:`StopMatcher` and :class:`StopFilter` live in
:mod:`~pasta_engine.core.render` and are re-exported here. :class:`ReadingOrderStream`
renders straight from an interpreter (tests, tools that drive an interpreter themselves).
"""

from __future__ import annotations

import enum
from typing import Any, Sequence

from ..core.render import EVENT_KINDS, OutputRenderer, StopFilter, StopMatcher, ThreadEvent, reading_order_prefix

# Stands for pasta_engine.core.interpreter's Interpreter, read by attribute (as render.py does):
# no import of the interpreter, not even for type checking, so the input processor, which needs
# OutputKind, stays apart from the core (import-linter).
Interpreter = Any

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


class ReadingOrderStream:
    """The reading-order deltas and thread events of one request, rendered straight from its
    interpreter (an :class:`~pasta_engine.core.render.OutputRenderer`, which applies the
    interpreter's own stop strings, and a :class:`StopFilter` for ``stop``; the engine's step
    outputs carry the same).

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
