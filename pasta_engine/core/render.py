"""One door out: how a request's threads become what a reader gets (no torch).

Every text and token order the engine hands out is rendered here, once (docs/DESIGN.md
sections 2 and 7):

* the splice: :func:`spliced` (the response's tokens, each chunk's after the token that completed
  its promise) and :func:`annotated_text` (every character the model wrote, each chunk after its
  promise tag);
* the clean text: :func:`final_text` (the finished response a reader sees:
  :func:`pasta_engine.lang.tags.clean_text` of the annotated text, the one rule for what tag text
  is left out) and :func:`clean_text` (the same text while the request runs, with what may still
  change held back), both one walk of the thread tree that splices each thread's children into
  its clean text at their forks (the rule of :func:`splice_clean`), for flat and nested forks alike;
* reading order: :func:`reading_order_prefix`, the prefix of the response in reading order that
  can no longer change (main text up to a promise, its chunk, the main text after it, ...);
* the cuts: at a ``length`` end (``Limits.length_cut``) and right before the first stop string
  (``SamplingParams.stop``, the interpreter's ``stop_strings``) in reading order, applied once
  here (:func:`final_text`, :func:`stop_in_prefix`, :func:`stop_in_final`; :class:`StopMatcher`,
  :class:`StopFilter`), so every API's text ends the same;
* :class:`OutputRenderer`: per request, across steps and preemptions, what is new since the
  previous output (vLLM's DELTA/CUMULATIVE semantics): the reading-order text delta and the
  cumulative text, the sampled tokens and each thread's tokens and clean text with its thread id
  (never repeated after a preemption restarts the request), and :class:`ThreadEvent`\\ s. The
  engine's :class:`~pasta_engine.core.outputs.RequestOutput` carries it, and the async engine,
  the server and the CLI read only that.

The interpreter keeps the threads' state (tokens, pieces, clean pieces, drops, fork offsets);
nothing here changes it, except the cached join of a thread's clean pieces.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Sequence

from ..lang.dialect import Rejoin
from ..lang.tags import PASTA_REJOIN, drop_empty_items, held_line_start, thread_text

# The interpreter imports this module, so this one does not import it (no cycle, not even for
# type checking): these names stand for pasta_engine.core.interpreter's Interpreter and Thread,
# read by attribute.
Interpreter = Any
Thread = Any

__all__ = [
    "Spliced",
    "ThreadEvent",
    "EVENT_KINDS",
    "ThreadDelta",
    "OutputRenderer",
    "reading_order_key",
    "splice_clean",
    "spliced",
    "settled_spliced",
    "annotated_text",
    "clean_text",
    "final_text",
    "reading_order_prefix",
    "StopMatcher",
    "StopFilter",
    "stop_in_prefix",
    "stop_in_final",
]


# --------------------------------------------------------------------------- the splice


@dataclass
class Spliced:
    """A response in spliced order, one entry per token: id, logprob (None for inserted
    tokens or when not asked), logical position and owning thread id."""

    ids: list[int] = field(default_factory=list)
    logprobs: list[float | None] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    threads: list[int] = field(default_factory=list)


def _kids(t: "Thread") -> list["Thread"]:
    """The children of ``t`` that ran (a chunk the request ended before it ran has no text;
    each thread splices its own children, so one walk serves flat and nested forks)."""
    return [c for c in t.children if c.finish != "not_run"]


def spliced(interp: "Interpreter") -> Spliced:
    """The response's tokens in spliced order: each child's tokens (its own children spliced
    in the same way) right after its parent's token that completed its promise (token
    granularity: if that token also holds the next characters, they come before the chunk here
    but after it in :func:`annotated_text`). A child's EOS is left out (it counts in its
    ``n_sampled``)."""
    out = Spliced()

    def add(t: Thread, lo: int, hi: int) -> None:
        out.ids += t.tokens[lo:hi]
        out.logprobs += t.logprobs[lo:hi]
        out.positions += t.positions[lo:hi]
        out.threads += [t.tid] * (hi - lo)

    def walk(t: Thread) -> None:
        by_tok: dict[int, list[Thread]] = {}
        for c in _kids(t):
            by_tok.setdefault(c.fork_at, []).append(c)
        for i in range(len(t.tokens) + 1):
            for c in by_tok.get(i, []):
                walk(c)
            if i < len(t.tokens):
                add(t, i, i + 1)

    walk(interp.main)
    return out


def settled_spliced(interp: "Interpreter", final: bool = False) -> list[tuple["Thread", int, int]]:
    """The part of :func:`spliced` that can no longer change, as ``(thread, lo, hi)``: runs of
    ``thread.tokens[lo:hi]`` in spliced order. While the request runs (``final`` False) the walk
    stops after the first chunk still decoding (its tokens so far included): a chunk's later
    tokens, and its parent's tokens after its fork, come later. Each later call's runs extend
    the earlier ones'; with ``final`` (the request has ended) they cover :func:`spliced` whole.
    The prefix :func:`reading_order_prefix` gives in text, in tokens (tag tokens included). A
    chunk that has sampled nothing yet stops the walk before its inserted tokens: if the request
    ends before it samples, it never ran, and :func:`spliced` leaves it out."""
    runs: list[tuple[Thread, int, int]] = []

    def walk(t: Thread) -> bool:  # True: stopped at a chunk still decoding
        at = 0
        for c in sorted(_kids(t), key=lambda c: c.fork_at):  # stable: fork order at one token
            if c.fork_at > at:
                runs.append((t, at, c.fork_at))
                at = c.fork_at
            if not (final or c.ended or c.started and c.n_sampled > 0):
                return True  # it may still end as "not_run" (the interpreter's _finish_request rule)
            if walk(c) or not (final or c.ended):
                return True
        if len(t.tokens) > at:
            runs.append((t, at, len(t.tokens)))
        return False

    walk(interp.main)
    return runs


def annotated_text(interp: "Interpreter") -> str:
    """The main thread's text with each chunk (``<async>`` + content, and ``</async>`` when the
    interpreter closed it: the dialect's ``open_tag`` and ``close_tag``; its own chunks spliced
    the same way) spliced right after its promise tag: every character the model wrote."""
    close = interp.dialect.close_tag

    def render(t: Thread) -> str:
        text = "".join(t.pieces)
        parts, at = [], 0
        for c in sorted(_kids(t), key=lambda c: (c.fork_char, c.tid)):
            parts += [text[at : c.fork_char], render(c), close if c.closed_by_interpreter else ""]
            at = c.fork_char
        parts.append(text[at:])
        return "".join(parts)

    return render(interp.main)


# --------------------------------------------------------------------------- the clean text


def joined(t: "Thread") -> str:
    """``"".join(t.clean)``: a thread's clean text so far (tags left out, before empty list items
    are dropped), joining only the pieces added since the last call."""
    n, text = t.clean_joined
    if n < len(t.clean):
        text += "".join(t.clean[n:])
        t.clean_joined = (len(t.clean), text)
    return text


def _thread_view(t: "Thread", ended: bool, rejoin: Rejoin | None = None) -> tuple[str, Callable[[int], int]]:
    """A thread's clean text on its own (its per-thread deltas and text events) and the mover of
    its offsets: :func:`~pasta_engine.lang.tags.thread_text` of :func:`joined`, final once the
    thread or the request (``ended``) has ended; a chunk whose promise follows a ``<`` of its
    parent's text (the dialect's opener: ``rejoin``, None for PASTA-LANG's) is read after it, as
    the spliced text reads it."""
    rejoin = rejoin or PASTA_REJOIN
    p = t.parent
    after_lt = p is not None and t.fork_clean > 0 and joined(p)[t.fork_clean - 1 : t.fork_clean] == rejoin.opener
    return thread_text(joined(t), t.drops, ended or t.ended, after_lt, rejoin)


def reading_order_key(t: "Thread") -> tuple[int, int]:
    """Where a chunk's clean text goes: after ``fork_clean`` characters of the main thread's
    (ties in fork order)."""
    return (t.fork_clean, t.tid)


def splice_clean(main: str, main_drops: Sequence[int], chunks: Sequence[tuple["Thread", str, Sequence[int], bool]],
                 final: bool, stop_after: "Thread | None" = None, rejoin: Rejoin | None = None) -> str:
    """The clean text a reader sees: the main thread's clean text with each chunk's spliced at
    its promise, less the list items left empty by what was left out
    (:func:`~pasta_engine.lang.tags.drop_empty_items` over every thread's drops).

    Args:
        main, main_drops: the main thread's clean text and drops (or a prefix of them).
        chunks: ``(thread, clean text, drops, ended)`` per chunk, in reading order.
        final: the text is complete. False: what may still change is held back: the text's
            last line while it may still become an empty list item, and so is the last line of
            a chunk that has not ended (after its first line, which holds the chunk's
            ``<async>`` and so is dropped when it is only a marker).
        stop_after: the text ends after this chunk (a reading-order prefix).
        rejoin: the dialect's opener and parser (``dialect.rejoin``); None: PASTA-LANG's.

    A main-thread drop at a chunk's splice offset goes before the chunk when it was made
    before the fork (``fork_drop``), after it otherwise, as in the annotated text."""
    text, drops, _ = _splice(main, main_drops, chunks, final, stop_after)
    return drop_empty_items(text, drops, final, rejoin)


def _splice(main: str, main_drops: Sequence[int], chunks: Sequence[tuple["Thread", str, Sequence[int], bool]],
            final: bool, stop_after: "Thread | None" = None) -> tuple[str, list[int], bool]:
    """:func:`splice_clean` before empty list items are dropped: the text, its drops, and
    whether it stopped after ``stop_after``."""
    parts: list[str] = []
    drops: list[int] = []
    at = shift = i = 0
    for c, text, cdrops, ended in chunks:
        if not final and not ended and "\n" in text:
            held = held_line_start(text)
            if held < len(text):
                text, cdrops = text[:held], [d for d in cdrops if d < held]
        fc = c.fork_clean
        parts.append(main[at:fc])
        fd = min(c.fork_drop, len(main_drops))
        while i < fd:
            drops.append(main_drops[i] + shift)
            i += 1
        base = fc + shift
        drops += [base + d for d in cdrops]
        parts.append(text)
        shift += len(text)
        at = fc
        if c is stop_after:
            return "".join(parts), drops, True
    parts.append(main[at:])
    drops += [d + shift for d in main_drops[i:]]
    return "".join(parts), drops, False


def clean_text(interp: "Interpreter", final: bool | None = None) -> str:
    """What a reader sees so far, in the response's order: the main thread's clean text with
    each chunk's clean text spliced at its promise (:func:`splice_clean`). A partial tag still
    being decoded is held back, and so is a last line that may still become an empty list item,
    until the request ends (``final``: None for ``interp.done``). Not prefix-stable while the
    request runs (a chunk's text lands in the middle); :func:`reading_order_prefix` is. At the
    end it equals :func:`final_text`."""
    final = interp.done if final is None else final
    text, drops, _ = _clean_tree(interp.main, final, False)
    return drop_empty_items(text, drops, final, interp.dialect.rejoin)


#: Thread finishes the request's end imposed: a chunk cut off mid-way, or never run.
_CUT = ("length", "not_run")


def _clean_tree(t: "Thread", final: bool, prefix: bool, cut: bool = False) -> tuple[str, list[int], bool]:
    """The clean text and drops of ``t`` with its children's (their own spliced in) at their
    forks, and whether a thread still decoding stopped it (``prefix``: stop after the first
    one in reading order, as :func:`reading_order_prefix` does; ``cut``: stop after the first
    one the request's end cut off or left unrun, as :func:`final_text` does at a ``length``
    end). A thread without children (every
    chunk of a flat response) is its own clean text and drops, returned as they are (the caller
    copies nothing from them: this runs for every thread on every output of a step)."""
    stopped = (prefix and not t.ended or cut and t.finish in _CUT) and t.parent is not None
    kids = [c for c in t.children] if cut else _kids(t)
    if not kids:
        return joined(t), t.drops, stopped
    chunks: list[tuple[Thread, str, list[int], bool]] = []
    stop = None
    for c in sorted(kids, key=reading_order_key):
        if c.finish == "not_run":
            text, drops, c_stopped = "", [], True
        elif c.children:
            text, drops, c_stopped = _clean_tree(c, final, prefix, cut)
        else:  # a leaf, inline (the common case: the walk's cost is per thread per step)
            text, drops, c_stopped = joined(c), c.drops, prefix and not c.ended or cut and c.finish in _CUT
        chunks.append((c, text, drops, c.ended and not c_stopped))
        if c_stopped or prefix and not c.ended:
            stop = c
            break
    text, drops, stopped_inside = _splice(joined(t), t.drops, chunks, final, stop)
    return text, drops, stopped_inside or stopped


def final_text(interp: "Interpreter", annotated: str | None = None) -> str:
    """The finished response a reader sees: the dialect's ``clean_text`` of
    :func:`annotated_text` (PASTA's: :func:`pasta_engine.lang.tags.clean_text`: no tag, no
    malformed or partial tag, no list item a left-out tag emptied; ``annotated``: that text when
    the caller has it). What ``RequestResult.text`` holds and every output's text ends as.

    At a ``length`` end (``interp.length_end``) with ``Limits.length_cut`` ``"prefix"`` (the
    default) and a chunk cut off or never run, the text ends where the first such chunk in
    reading order stopped (the same walk, :func:`clean_text`'s, stopped there): no later text
    follows a hole. Then, when the request has stop strings (``interp.stop_matcher``), the text
    ends right before the first of them (:func:`stop_in_final`). It still extends every
    :func:`reading_order_prefix` of the run, cut the same way."""
    text = _uncut_final_text(interp, annotated)
    hit = _find_stop(interp, text)
    return text if hit is None else text[: hit[0]]


def _uncut_final_text(interp: "Interpreter", annotated: str | None = None) -> str:
    """:func:`final_text` before the stop-string cut."""
    if interp.length_end and interp.limits.length_cut == "prefix" and \
            any(c.finish in _CUT for c in interp.threads[1:]):
        text, drops, _ = _clean_tree(interp.main, True, False, cut=True)
        return drop_empty_items(text, drops, True, interp.dialect.rejoin)
    return interp.dialect.clean_text(annotated_text(interp) if annotated is None else annotated)


def _find_stop(interp: "Interpreter", text: str) -> tuple[int, str] | None:
    matcher = interp.stop_matcher
    return None if matcher is None else matcher.find(text)


def stop_in_final(interp: "Interpreter") -> tuple[int, str] | None:
    """``(index, stop string)`` of the first stop string in the finished response's text
    (:func:`final_text` before its stop cut), None when there is none or the request has no
    stop strings. The interpreter reads it once, when the request ends."""
    return _find_stop(interp, _uncut_final_text(interp)) if interp.stop_matcher is not None else None


def stop_in_prefix(interp: "Interpreter") -> tuple[int, str] | None:
    """``(index, stop string)`` of the first stop string in :func:`reading_order_prefix` (the
    text that can no longer change), None when there is none or the request has no stop
    strings. The interpreter asks only when a thread wrote one or a chunk ended (the prefix is
    not rebuilt every step for this)."""
    return _find_stop(interp, reading_order_prefix(interp)) if interp.stop_matcher is not None else None


def reading_order_prefix(interp: "Interpreter") -> str:
    """The longest prefix of the response in reading order that can no longer change: main
    text and chunks in reading order, stopping after the first chunk that is still decoding
    (its text so far included), less a last line that may still become an empty list item.
    Every later prefix of the same run extends it, and :func:`final_text` at the end does."""
    text, drops, _ = _clean_tree(interp.main, False, True)
    return drop_empty_items(text, drops, False, interp.dialect.rejoin)


# --------------------------------------------------------------------------- stop strings


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
        """Whether a stop string ended the text."""
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


# --------------------------------------------------------------------------- outputs


#: Kinds of :class:`ThreadEvent`, in the order one thread goes through them.
EVENT_KINDS = ("fork", "text", "end", "join", "finish")


@dataclass(frozen=True)
class ThreadEvent:
    """Something that happened to one thread of a request.

    Attributes:
        kind: ``fork`` (a promise forked thread ``thread`` from ``parent``; ``topic`` and
            ``tokens``, the predicted length in tokens, come from the promise; ``at`` is the
            parent's clean length in characters where the chunk splices in), ``text``
            (``text`` is the thread's new clean text, tags left out), ``end`` (the thread stopped
            decoding; ``reason``: ``close`` at ``</async>``, ``eos``, ``cap`` (its length cap),
            ``length``, ``trace_end``, ``abort``, ``error``, or ``not_run`` for a chunk the request
            ended before it ran), ``join`` (an ended chunk became visible to its parent, at a
            join or at the end of the parent or of the request), ``finish`` (the request ended; thread 0,
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


@dataclass(slots=True)
class ThreadDelta:
    """What is new for one thread of a request since its previous output.

    Attributes:
        thread: the thread's id (0 is the main thread; children in fork order).
        token_ids: the tokens it sampled (EOS included; a chunk's inserted ``<async>`` is not
            sampled, so not here), each once, in order: a thread's deltas concatenate to every
            token it sampled.
        text: its new clean text (tags and tag-like text left out; empty list items are only
            dropped from the spliced text), in characters: a thread's deltas concatenate to its
            whole clean text."""

    thread: int
    token_ids: list[int] = field(default_factory=list)
    text: str = ""


@dataclass(slots=True)
class RenderedStep:
    """What :meth:`OutputRenderer.update` found new: ``delta_text`` (reading-order text),
    ``new_token_ids`` (all threads, in the step's thread order), ``thread_deltas`` (by thread
    id), ``events``, and ``logprobs``: ``(token id, logprob)`` of each sampled token that
    entered the response's settled spliced order (:func:`settled_spliced`) since the previous
    update, in that order (empty unless asked; inserted tokens, which have no logprob, left out)."""

    delta_text: str
    new_token_ids: list[int]
    thread_deltas: list[ThreadDelta]
    events: list[ThreadEvent]
    logprobs: list[tuple[int, float]] = field(default_factory=list)


class OutputRenderer:
    """What of one request has been output, and what is new at each step.

    One per request for its whole life: it outlives a preemption (the request restarts from its
    prompt with a fresh interpreter and re-decodes the same tokens); then nothing is output again
    until the restarted run gets past what was output (no token, text or event twice).

    ``text`` is the reading-order text output so far (:func:`reading_order_prefix`, then
    :func:`final_text` at the end): each output's text extends the previous one's (prefix-stable).
    With stop strings (the interpreter's ``stop_strings``) it ends right before the first one,
    and a tail that may still become one is held back (:class:`StopFilter`, vLLM's rule).
    """

    __slots__ = ("text", "_tokens_sent", "_text_sent", "_forked", "_ended", "_joined", "_finished", "_stop", "_held",
                 "_lp_sent")

    def __init__(self) -> None:
        self.text = ""
        self._tokens_sent: dict[int, int] = {}  # thread id -> tokens it sampled that were output
        self._text_sent: dict[int, int] = {}  # thread id -> characters of its clean text output
        self._forked: set[int] = set()
        self._ended: set[int] = set()
        self._joined: set[int] = set()
        self._finished = False
        self._stop: StopFilter | None = None
        self._held: list[tuple[int, int, int]] = []  # (thread id, sampled index, token id) not output yet
        self._lp_sent = 0  # entries of settled_spliced (inserted tokens included) whose logprobs were output

    def hold(self, interp: "Interpreter", sampled: Iterable[tuple[int, int]]) -> None:
        """Keep tokens a step sampled whose output was never built (the step raised before or
        while this request's output was rendered): the next :meth:`update` outputs them first,
        so a request's ``new_token_ids`` still concatenate to every token it sampled.

        Args:
            interp: the request's interpreter, right after the step's sampling was applied
                (each thread's ``n_sampled`` counts the step's token).
            sampled: ``(thread id, token id)`` as :meth:`update` takes them.

        Raises IndexError for a thread id the interpreter does not have. A token already output
        is not output again (the same rule as :meth:`update`'s)."""
        threads = interp.threads
        self._held += [(tid, threads[tid].n_sampled - 1, tok) for tid, tok in sampled]

    def update(self, interp: "Interpreter", sampled: Iterable[tuple[int, int]] = (),
               finish_reason: str | None = None, final: str | None = None, logprobs: bool = False) -> RenderedStep:
        """What is new after a step.

        Args:
            interp: the request's interpreter now (a fresh one after a preemption is fine).
            sampled: ``(thread id, token id)`` of each token the step's sampling gave the
                interpreter (applied by ``on_token``), in thread order.
            finish_reason: the request's finish reason once it has ended (None while it runs):
                every thread has ended then, and whatever was held back is output.
            final: the finished response's clean text when the caller has it already
                (:func:`final_text` otherwise).
            logprobs: also give the logprobs of the tokens that entered the settled spliced
                order (:func:`settled_spliced`; all of it once ``finish_reason`` is set): the
                request asked for logprobs. Over a request's updates they concatenate to the
                logprobs of :func:`spliced` at its end (inserted tokens left out).

        Returns a :class:`RenderedStep`; afterwards ``text`` is the cumulative text. Nothing is
        recorded as output before everything is rendered: when it raises (the dialect's text
        rules, Ctrl-C), nothing of this call counts as output, and once the caller has handed
        ``sampled`` to :meth:`hold`, the next call outputs all this one would have. Raises what
        rendering raises."""
        threads = interp.threads
        sampled = list(sampled)
        # the reading-order text first: it is what runs the dialect's rules (and stop strings)
        if finish_reason is not None:
            text = final if final is not None else final_text(interp)
        else:
            text = reading_order_prefix(interp)
        if interp.stop_strings:  # the cut is final_text's at the end; a possible stop string's start is held
            if self._stop is None:
                self._stop = StopFilter(interp.stop_strings)
            self._stop.update(text, finish_reason is not None)  # its cut moves only forward: safe to redo
            text = self._stop.sent
        # tokens: a thread samples one token per step, its index is n_sampled - 1; a restarted
        # request re-samples the same ones: only those past what was output are new. Tokens held
        # from a step whose output was never built come first.
        new_ids: list[int] = []
        per_thread: dict[int, ThreadDelta] = {}
        sent_tokens = self._tokens_sent
        staged: dict[int, int] = {}  # thread id -> its tokens output after this call
        items = self._held + [(tid, threads[tid].n_sampled - 1, tok) for tid, tok in sampled]
        for tid, idx, tok in items:
            if idx >= staged.get(tid, sent_tokens.get(tid, 0)):
                staged[tid] = idx + 1
                new_ids.append(tok)
                d = per_thread.get(tid)
                if d is None:
                    d = per_thread[tid] = ThreadDelta(tid)
                d.token_ids.append(tok)
        # each thread's clean text (less text that would rejoin a kept '<' (the dialect's opener)
        # into tag text)
        text_sent = self._text_sent
        staged_text: dict[int, int] = {}
        before0 = text_sent.get(0, 0)
        main_view = None
        rejoin = interp.dialect.rejoin
        for t in threads:
            s, moved = _thread_view(t, finish_reason is not None, rejoin)
            if t.tid == 0:
                main_view = (s, moved)  # the main thread's text events are cut from the same view
            done = text_sent.get(t.tid, 0)
            if len(s) > done:
                staged_text[t.tid] = len(s)
                d = per_thread.get(t.tid)
                if d is None:
                    d = per_thread[t.tid] = ThreadDelta(t.tid)
                d.text = s[done:]
        events, forked, ended, joined_now = self._events(interp, finish_reason, before0, per_thread, main_view)
        lps, lp_sent = self._new_logprobs(interp, finish_reason is not None) if logprobs else ([], self._lp_sent)
        # everything is rendered: record it as output
        self._tokens_sent.update(staged)
        text_sent.update(staged_text)
        self._held = []
        self._forked |= forked
        self._ended |= ended
        self._joined |= joined_now
        self._finished = self._finished or finish_reason is not None
        self._lp_sent = lp_sent
        delta = ""
        if len(text) > len(self.text):  # a restarted run gives nothing new until it gets past the output
            delta = text[len(self.text):]
            self.text = text
        return RenderedStep(delta, new_ids, [per_thread[k] for k in sorted(per_thread)], events, lps)

    def _new_logprobs(self, interp: "Interpreter", final: bool) -> tuple[list[tuple[int, float]], int]:
        """``(token id, logprob)`` of the tokens of :func:`settled_spliced` past the entries
        output so far, and the entries it holds (a restarted run gives nothing until it gets
        past what was output)."""
        out: list[tuple[int, float]] = []
        sent = self._lp_sent
        at = 0
        for t, lo, hi in settled_spliced(interp, final):
            end = at + hi - lo
            if end > sent:
                start = lo + max(0, sent - at)
                out += [(tok, lp) for tok, lp in zip(t.tokens[start:hi], t.logprobs[start:hi]) if lp is not None]
            at = end
        return out, max(sent, at)

    def _events(self, interp: "Interpreter", finish_reason: str | None, sent0: int,
                per_thread: dict[int, ThreadDelta], main_view: tuple[str, Callable[[int], int]],
                ) -> tuple[list[ThreadEvent], set[int], set[int], set[int]]:
        """The thread events since the previous output, and the threads now reported forked,
        ended and joined (the caller records them once everything is rendered). ``main_view``:
        the main thread's text as :func:`_thread_view` gives it, with its offset mover."""
        out: list[ThreadEvent] = []
        forked_now: set[int] = set()
        ended_now: set[int] = set()
        joined_now: set[int] = set()
        main = interp.main
        main_text, moved = main_view
        # the main thread's new text, with each new fork at its splice point (a column view then
        # shows where each chunk belongs)
        for c in sorted((c for c in interp.threads[1:] if c.tid not in self._forked), key=reading_order_key):
            at = moved(c.fork_clean) if c.parent is main else c.fork_clean
            if c.parent is main and at > sent0:
                upto = min(at, len(main_text))  # past a held '<': the rest of the text comes later
                if upto > sent0:
                    out.append(ThreadEvent("text", 0, text=main_text[sent0:upto]))
                    sent0 = upto
            p = c.promise
            out.append(ThreadEvent("fork", c.tid, parent=c.parent.tid, topic=p.topic, tokens=p.tokens, at=at))
            forked_now.add(c.tid)
        if len(main_text) > sent0:
            out.append(ThreadEvent("text", 0, text=main_text[sent0:]))
        if main.finish is not None and 0 not in self._ended:
            out.append(ThreadEvent("end", 0, reason=main.finish))
            ended_now.add(0)
        for c in interp.threads[1:]:
            d = per_thread.get(c.tid)
            if d is not None and d.text:
                out.append(ThreadEvent("text", c.tid, text=d.text))
            if c.ended and c.tid not in self._ended:
                out.append(ThreadEvent("end", c.tid, reason=c.finish or finish_reason or "stop"))
                ended_now.add(c.tid)
            implicit = finish_reason == "stop" and c.finish != "not_run"  # the main thread's end syncs
            if (c.joined or implicit) and c.ended and c.tid not in self._joined:
                out.append(ThreadEvent("join", c.tid, parent=c.parent.tid))
                joined_now.add(c.tid)
        if finish_reason is not None and not self._finished:
            if 0 not in self._ended and 0 not in ended_now:
                out.append(ThreadEvent("end", 0, reason=finish_reason))
                ended_now.add(0)
            out.append(ThreadEvent("finish", 0, reason=finish_reason))
        return out, forked_now, ended_now, joined_now
