"""The PASTA-LANG interpreter: one request's decoding threads, forks, joins and positions.

It knows nothing about tensors or KV pages. It says which threads have tokens to forward this
step (:meth:`Interpreter.rows`), takes each sampled token back (:meth:`Interpreter.on_token`),
and reports what the KV cache must do as events (:class:`Append`, :class:`Fork`,
:class:`Join`, :class:`Release`) that the scheduler applies. Semantics follow DESIGN.md
section 2 (after Jin et al., ICML 2025, arXiv 2502.11517, section 3):

* the main thread decodes; when it completes a promise tag, a child thread is forked whose
  context is the main thread's context at that moment (its KV view is shared, not copied) and
  whose first forward is the inserted ``<async>`` tokens; the main thread does not wait;
* a child ends at ``</async>``, at end-of-sequence or at its length cap
  ``max(async_min_cap, cap_factor * N)``; a capped or EOS-ended child is closed by the
  interpreter (recorded in diagnostics);
* at ``<sync/>`` the main thread stalls until every outstanding child has ended; then their
  KV pages join its view (metadata only) and it forwards the sync token seeing them;
* end of sequence on the main thread is an implicit sync; the response is the main text with
  each chunk spliced right after the token that completed its promise.

Step accounting: a token sampled at step ``t`` is forwarded (its KV written) at step ``t+1``.
A child that ended still forwards its last token once (a "flush" row with no sampling), so
the joined view holds every token the child wrote; that row shares the step in which the
main thread resumes. With unlimited width the steps a request takes equal
:func:`pasta_engine.metrics.critical_path` of its structure exactly.
"""

from __future__ import annotations

import enum
import math
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Sequence

from .detok import Decode, IncrementalDetokenizer
from .lang import ASYNC_CLOSE, AsyncClose, AsyncOpen, Malformed, Promise, Sync, TagParser, split_threads
from .metrics import ResponseStructure

__all__ = [
    "PositionPolicy",
    "Limits",
    "Thread",
    "ThreadStatus",
    "Row",
    "Append",
    "Fork",
    "Join",
    "Release",
    "Interpreter",
    "ReplayPlan",
    "Spliced",
    "plan_replay",
]


# --------------------------------------------------------------------------- configuration


@dataclass(frozen=True)
class PositionPolicy:
    """How many logical positions the main thread skips after a promise.

    The child's tokens take positions right after the promise's last token; the main thread
    continues after a reserved range of ``open + size + close`` positions, where ``open`` and
    ``close`` are the token counts of ``<async>`` and ``</async>`` and ``size`` is:

    * ``predicted`` (default): the promise's ``tokens="N"`` (PASTA's Pred-10x scheme);
    * ``constant:K``: K for every promise;
    * ``none``: nothing is reserved (not even the tags): positions collide;
    * ``oracle``: the chunk's true length (replay only; positions then equal those of
      sequential decoding of the spliced response).
    """

    kind: str = "predicted"
    constant: int = 0

    @classmethod
    def parse(cls, spec: "str | PositionPolicy") -> "PositionPolicy":
        """Parse ``predicted``, ``none``, ``oracle`` or ``constant:K`` (K >= 0).

        Raises ValueError naming the bad spec."""
        if isinstance(spec, PositionPolicy):
            return spec
        s = str(spec).strip().lower()
        if s in ("predicted", "none", "oracle"):
            return cls(kind=s)
        if s.startswith("constant:"):
            try:
                k = int(s.split(":", 1)[1])
            except ValueError:
                k = -1
            if k >= 0:
                return cls(kind="constant", constant=k)
        raise ValueError(
            f"unknown position policy {spec!r}: expected 'predicted', 'none', 'oracle' or 'constant:K' with K >= 0"
        )

    def __str__(self) -> str:
        return f"constant:{self.constant}" if self.kind == "constant" else self.kind


@dataclass(frozen=True)
class Limits:
    """Per-request limits (all counts in tokens or threads).

    Attributes:
        max_new_tokens: cap on the tokens the request samples in all its threads together
            (the spliced response's length, so pasta and sequential runs are comparable).
        max_threads: threads of one request that decode in the same step, main included;
            further children wait in fork order. ``None`` = unlimited width.
        max_forks: forks per request; later promises are text (generate) or decoded inline
            by the main thread (replay).
        async_min_cap, cap_factor: a child samples at most
            ``max(async_min_cap, ceil(cap_factor * N))`` tokens.
        max_promise_tokens: ``N`` above this is clamped (positions and caps).
    """

    max_new_tokens: int = 512
    max_threads: int | None = 16
    max_forks: int = 64
    async_min_cap: int = 64
    cap_factor: float = 2.0
    max_promise_tokens: int = 4096

    def __post_init__(self) -> None:
        checks = [
            ("max_new_tokens", self.max_new_tokens, self.max_new_tokens >= 1),
            ("max_threads", self.max_threads, self.max_threads is None or self.max_threads >= 1),
            ("max_forks", self.max_forks, self.max_forks >= 0),
            ("async_min_cap", self.async_min_cap, self.async_min_cap >= 1),
            ("cap_factor", self.cap_factor, self.cap_factor > 0 and math.isfinite(self.cap_factor)),
            ("max_promise_tokens", self.max_promise_tokens, self.max_promise_tokens >= 0),
        ]
        for name, value, ok in checks:
            if not ok:
                raise ValueError(f"invalid limit {name}={value!r}")

    def chunk_cap(self, predicted: int) -> int:
        """Most tokens a child forked for ``tokens="predicted"`` may sample."""
        return max(self.async_min_cap, math.ceil(self.cap_factor * min(predicted, self.max_promise_tokens)))


class ThreadStatus(enum.Enum):
    """Where a thread is in its life (see :meth:`Interpreter.rows`)."""

    QUEUED = "queued"  # forked, waiting for width
    RUNNING = "running"
    STALLED = "stalled"  # main thread at a sync
    FLUSH = "flush"  # ended; forwards its last token once more (no sampling)
    DONE = "done"


# --------------------------------------------------------------------------- events


@dataclass
class Append:
    """Reserve KV slots for ``n`` tokens just given to ``thread`` (forwarded next step)."""

    thread: "Thread"
    n: int


@dataclass
class Fork:
    """``child`` starts with the KV view ``parent`` has now (pages shared, not copied)."""

    parent: "Thread"
    child: "Thread"


@dataclass
class Join:
    """The children's own KV pages join ``parent``'s view (before its pending tokens)."""

    parent: "Thread"
    children: list["Thread"]


@dataclass
class Release:
    """``thread`` is gone: drop its references to KV pages."""

    thread: "Thread"


Event = Append | Fork | Join | Release


@dataclass
class Row:
    """One thread's work in a step: forward ``tokens`` at ``positions``; sample after the
    last one when ``sample`` is True (False for a flush row)."""

    thread: "Thread"
    tokens: list[int]
    positions: list[int]
    sample: bool


# --------------------------------------------------------------------------- threads


@dataclass(eq=False)
class Thread:
    """One decoding thread. ``tokens``/``pieces``/``logprobs`` hold what it wrote (inserted tag
    tokens first for a child, with ``logprob`` None); ``n_sampled`` counts sampled tokens,
    EOS included. ``kv`` is an opaque handle owned by the scheduler."""

    tid: int
    detok: IncrementalDetokenizer
    parser: TagParser | None
    next_pos: int
    promise: Promise | None = None
    fork_at: int = 0  # main tokens before the chunk in the spliced response
    fork_char: int = 0  # main-thread characters before the chunk in the annotated text
    cap: int | None = None
    forced: deque | None = None
    status: ThreadStatus = ThreadStatus.RUNNING
    tokens: list[int] = field(default_factory=list)
    pieces: list[str] = field(default_factory=list)
    logprobs: list[float | None] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    pending: list[int] = field(default_factory=list)
    pending_pos: list[int] = field(default_factory=list)
    n_sampled: int = 0
    finish: str | None = None
    closed_by_interpreter: bool = False
    started: bool = False
    joined: bool = False
    released: bool = False
    kv: object = None

    @property
    def is_main(self) -> bool:
        return self.promise is None

    @property
    def ended(self) -> bool:
        return self.status in (ThreadStatus.FLUSH, ThreadStatus.DONE)


# --------------------------------------------------------------------------- interpreter


class Interpreter:
    """One request's threads.

    Args:
        prompt_ids: the prompt's token ids (prefilled by the main thread at positions 0..P-1).
        decode: ``ids -> str`` with special tokens kept (for tag detection and output text).
        eos_ids: token ids that end a thread.
        open_ids: token ids of ``<async>`` (inserted into each child before its first step).
        close_len: number of tokens of ``</async>`` (for position reservations).
        mode: ``"pasta"`` acts on tags; ``"sequential"`` treats them as text.
        limits: :class:`Limits`.
        policy: :class:`PositionPolicy` or its string.
        forced_main: replay: the main thread's tokens (EOS last) replacing sampling.
        forced_chunks: replay: per promise in order, the child's tokens (content then
            ``</async>``), or None for a promise without a chunk.
        special_tokens: added special-token ids whose text is a tag (passed to the parser).

    Raises ValueError for an empty prompt, an unknown mode, or ``oracle`` without replay.
    """

    def __init__(
        self,
        prompt_ids: Sequence[int],
        *,
        decode: Decode,
        eos_ids: Sequence[int],
        open_ids: Sequence[int],
        close_len: int,
        mode: str = "pasta",
        limits: Limits | None = None,
        policy: PositionPolicy | str = "predicted",
        forced_main: Sequence[int] | None = None,
        forced_chunks: Sequence[Sequence[int] | None] | None = None,
    ):
        if mode not in ("pasta", "sequential"):
            raise ValueError(f"unknown mode {mode!r}: expected 'pasta' or 'sequential'")
        if len(prompt_ids) == 0:
            raise ValueError("empty prompt: at least one token is needed")
        self.mode = mode
        self.limits = limits or Limits()
        self.policy = PositionPolicy.parse(policy)
        if self.policy.kind == "oracle" and forced_chunks is None and mode == "pasta":
            raise ValueError("position policy 'oracle' needs the true chunk lengths: use replay, not generate")
        self.decode = decode
        self.eos_ids = frozenset(int(e) for e in eos_ids)
        self.open_ids = [int(t) for t in open_ids]
        self.close_len = int(close_len)
        self.prompt_ids = [int(t) for t in prompt_ids]
        self.replay = forced_main is not None
        self._forced_chunks = [None if c is None else [int(t) for t in c] for c in (forced_chunks or [])]
        self.threads: list[Thread] = []
        self.events: list[Event] = []
        self.diagnostics: list[str] = []
        self.total_sampled = 0
        self.n_promises = 0  # promises the main thread completed
        self.n_forks = 0
        self.finish: str | None = None
        self.syncs: list[int] = []  # main sampled-token index (1-based) of each sync
        self._outstanding: list[Thread] = []
        self._inline = False  # main thread inside an <async> block it wrote itself
        main = self._new_thread(next_pos=0, forced=forced_main)
        main.pending = list(self.prompt_ids)
        main.pending_pos = list(range(len(self.prompt_ids)))
        main.next_pos = len(self.prompt_ids)
        main.started = True
        self.main = main
        self.events.append(Append(main, len(self.prompt_ids)))

    # ------------------------------------------------------------------ scheduling side

    @property
    def done(self) -> bool:
        return self.finish is not None

    def take_events(self) -> list[Event]:
        """The KV events since the last call, in the order they must be applied."""
        ev, self.events = self.events, []
        return ev

    def rows(self) -> list[Row]:
        """Threads to forward this step: every flush row, then up to ``max_threads`` sampling
        threads (the main thread first, then children in fork order)."""
        if self.done:
            return []
        rows = [Row(t, t.pending, t.pending_pos, False) for t in self.threads if t.status is ThreadStatus.FLUSH]
        width = self.limits.max_threads or len(self.threads)
        runnable = [t for t in self.threads if t.status in (ThreadStatus.RUNNING, ThreadStatus.QUEUED)]
        for t in runnable[:width]:
            t.status = ThreadStatus.RUNNING
            t.started = True
            rows.append(Row(t, t.pending, t.pending_pos, True))
        return rows

    def step_done(self, rows: Sequence[Row]) -> None:
        """Call after the forward of ``rows`` (before :meth:`on_token`): flush rows end."""
        for r in rows:
            if not r.sample and r.thread.status is ThreadStatus.FLUSH:
                r.thread.status = ThreadStatus.DONE
                r.thread.pending, r.thread.pending_pos = [], []
                if r.thread.joined:
                    self._release(r.thread)

    def forced_token(self, thread: Thread) -> int | None:
        """Replay: the token to take instead of sampling (None when sampling)."""
        if thread.forced is None:
            return None
        return thread.forced[0] if thread.forced else None

    def on_token(self, thread: Thread, token: int, logprob: float | None = None) -> None:
        """Apply a token sampled (or forced) for ``thread`` after its row's forward."""
        if self.done:
            return  # the request ended earlier in this step (e.g. at max_new_tokens)
        if thread.status is not ThreadStatus.RUNNING:
            raise RuntimeError(f"thread {thread.tid} cannot take a token in status {thread.status}")
        token = int(token)
        if thread.forced is not None and thread.forced:
            thread.forced.popleft()
        thread.pending, thread.pending_pos = [], []
        thread.n_sampled += 1
        self.total_sampled += 1
        if token in self.eos_ids:
            if thread.is_main:
                thread.tokens.append(token)
                thread.pieces.append("")
                thread.logprobs.append(logprob)
                thread.positions.append(thread.next_pos)
            self._end_thread(thread, "eos", flush=False)
        else:
            piece = thread.detok.push(token)
            thread.tokens.append(token)
            thread.pieces.append(piece)
            thread.logprobs.append(logprob)
            self._give(thread, [token])
            if thread.parser is not None:
                self._on_tags(thread, piece)
            if not thread.ended and thread.cap is not None and thread.n_sampled >= thread.cap:
                self._note(thread, f"reached its cap of {thread.cap} tokens; closed by the interpreter")
                self._end_thread(thread, "cap", flush=True)
            if not thread.ended and thread.forced is not None and not thread.forced:
                self._note(thread, "trace ended without a closing tag")
                self._end_thread(thread, "trace_end", flush=not thread.is_main)
        if not self.done and self.total_sampled >= self.limits.max_new_tokens:
            self._finish_request("length")

    # ------------------------------------------------------------------ internals

    def _new_thread(self, next_pos: int, forced: Sequence[int] | None = None, **kw) -> Thread:
        parser = TagParser() if self.mode == "pasta" else None
        t = Thread(
            tid=len(self.threads),
            detok=IncrementalDetokenizer(self.decode),
            parser=parser,
            next_pos=next_pos,
            forced=None if forced is None else deque(int(x) for x in forced),
            **kw,
        )
        self.threads.append(t)
        return t

    def _give(self, thread: Thread, tokens: list[int]) -> None:
        """Make ``tokens`` the thread's pending input at its next positions."""
        pos = list(range(thread.next_pos, thread.next_pos + len(tokens)))
        thread.pending = thread.pending + tokens
        thread.pending_pos = thread.pending_pos + pos
        thread.positions += pos
        thread.next_pos += len(tokens)
        self.events.append(Append(thread, len(tokens)))

    def _note(self, thread: Thread, msg: str) -> None:
        who = "main thread" if thread.is_main else f"thread {thread.tid} (topic {thread.promise.topic!r})"
        self.diagnostics.append(f"{who}: {msg}")

    def _on_tags(self, thread: Thread, piece: str) -> None:
        forked_now = False
        for ev in thread.parser.feed(piece):
            if isinstance(ev, Malformed):
                self._note(thread, f"malformed tag kept as text: {ev.raw!r}")
                continue
            if not thread.is_main:
                if isinstance(ev, AsyncClose):
                    self._end_thread(thread, "close", flush=True)
                    return
                if not hasattr(ev, "text"):
                    self._note(thread, f"{ev.raw} inside a chunk kept as text (no nesting)")
                continue
            if self._inline:
                if isinstance(ev, AsyncClose):
                    self._inline = False
                elif not hasattr(ev, "text"):
                    self._note(thread, f"{ev.raw} inside an inline chunk kept as text")
                continue
            if isinstance(ev, Promise):
                self.n_promises += 1
                forked_now |= self._on_promise(thread, ev)
            elif isinstance(ev, Sync):
                if forked_now:
                    # The fork needs this token's KV, which a stalled thread would not write.
                    self._note(thread, "<sync/> completed by the same token as a promise kept as text")
                    continue
                self.syncs.append(thread.n_sampled)
                self._stall(thread)
            elif isinstance(ev, AsyncOpen):
                self._inline = True
                if not (self.replay and thread.forced is not None):
                    self._note(thread, "main thread wrote <async> itself; its chunk is kept as text")
            elif isinstance(ev, AsyncClose):
                self._note(thread, "</async> on the main thread kept as text")

    def _on_promise(self, main: Thread, p: Promise) -> bool:
        idx = self.n_promises - 1
        chunk = None
        if self.replay:
            chunk = self._forced_chunks[idx] if idx < len(self._forced_chunks) else None
            if chunk is None:
                self._note(main, f"promise {p.topic!r} has no chunk in the trace; kept as text")
                return False
        if self.n_forks >= self.limits.max_forks:
            if chunk is not None:
                self._note(main, f"fork cap {self.limits.max_forks} reached: chunk {p.topic!r} decoded inline")
                main.forced.extendleft(reversed(self.open_ids + chunk))
            else:
                self._note(main, f"fork cap {self.limits.max_forks} reached: promise {p.topic!r} kept as text")
            return False
        self.n_forks += 1
        start = main.next_pos  # right after the promise's last token
        size = self._reserved(p, chunk)
        child = self._new_thread(
            next_pos=start,
            forced=chunk,
            promise=p,
            fork_at=len(main.tokens),
            fork_char=p.end,
            cap=None if self.replay else self.limits.chunk_cap(p.tokens),
            status=ThreadStatus.QUEUED,
        )
        main.next_pos += size
        self.events.append(Fork(main, child))
        for tok in self.open_ids:  # the inserted opening tag is part of the child's text
            child.tokens.append(tok)
            child.pieces.append(child.detok.push(tok))
            child.logprobs.append(None)
        self._give(child, list(self.open_ids))
        self._outstanding.append(child)
        return True

    def _reserved(self, p: Promise, chunk: list[int] | None) -> int:
        pol = self.policy
        if pol.kind == "none":
            return 0
        tags = len(self.open_ids) + self.close_len
        if pol.kind == "oracle":
            return len(self.open_ids) + len(chunk or [])
        if pol.kind == "constant":
            return tags + pol.constant
        if p.tokens > self.limits.max_promise_tokens:
            self._note(self.main, f"promise tokens={p.tokens} clamped to {self.limits.max_promise_tokens}")
        return tags + min(p.tokens, self.limits.max_promise_tokens)

    def _stall(self, main: Thread) -> None:
        main.status = ThreadStatus.STALLED
        self._try_resume()

    def _try_resume(self) -> None:
        main = self.main
        if main.status is not ThreadStatus.STALLED or any(not c.ended for c in self._outstanding):
            return
        children, self._outstanding = self._outstanding, []
        if children:
            self.events.append(Join(main, children))
            for c in children:
                c.joined = True
                if c.status is ThreadStatus.DONE:  # a FLUSH child is released after its flush row
                    self._release(c)
        main.status = ThreadStatus.RUNNING

    def _release(self, thread: Thread) -> None:
        if not thread.released:
            thread.released = True
            self.events.append(Release(thread))

    def _flush_text(self, thread: Thread) -> None:
        tail = thread.detok.flush()
        if tail and thread.pieces:
            thread.pieces[-1] += tail

    def _end_thread(self, thread: Thread, reason: str, flush: bool) -> None:
        thread.finish = reason
        self._flush_text(thread)
        if thread.is_main:
            if reason == "eos" or reason == "trace_end":
                # implicit sync: the request ends once every child has ended
                thread.status = ThreadStatus.DONE
                self._maybe_finish()
            return
        if reason in ("cap", "eos", "length", "trace_end"):
            thread.closed_by_interpreter = True
            if reason == "eos":
                self._note(thread, "ended at end-of-sequence; closed by the interpreter")
        if flush and thread.pending:
            thread.status = ThreadStatus.FLUSH
        else:
            thread.status = ThreadStatus.DONE
            thread.pending, thread.pending_pos = [], []
        self._try_resume()
        self._maybe_finish()

    def _maybe_finish(self) -> None:
        if self.main.status is ThreadStatus.DONE and all(t.ended for t in self.threads):
            self._finish_request(self.main.finish or "eos")

    def _finish_request(self, reason: str) -> None:
        if self.done:
            return
        for t in self.threads:
            if t.is_main or t.ended:
                continue
            if t.started and t.n_sampled > 0:
                t.finish = reason
                t.closed_by_interpreter = True
                self._note(t, f"cut off by the request's end ({reason}); closed by the interpreter")
            else:
                t.finish = "not_run"
                self._note(t, f"never ran (request ended: {reason}); its promise has no chunk")
        if reason == "length":
            self.main.finish = self.main.finish or "length"
        for t in self.threads:
            t.status = ThreadStatus.DONE
            t.pending, t.pending_pos = [], []
            self._flush_text(t)
            self._release(t)
        self.finish = reason

    # ------------------------------------------------------------------ results

    def _ran(self) -> list[Thread]:
        return [c for c in self.threads[1:] if c.finish != "not_run"]

    def spliced(self) -> "Spliced":
        """The response's tokens in spliced order: each child's tokens right after the main
        token that completed its promise (token granularity: if that token also holds the
        next characters, they come before the chunk here but after it in
        :meth:`annotated_text`). A child's EOS is left out (it counts in ``n_sampled``)."""
        out = Spliced()
        by_tok: dict[int, list[Thread]] = {}
        for c in self._ran():
            by_tok.setdefault(c.fork_at, []).append(c)

        def add(t: Thread, lo: int, hi: int) -> None:
            out.ids += t.tokens[lo:hi]
            out.logprobs += t.logprobs[lo:hi]
            out.positions += t.positions[lo:hi]
            out.threads += [t.tid] * (hi - lo)

        main = self.main
        for i in range(len(main.tokens) + 1):
            for c in by_tok.get(i, []):
                add(c, 0, len(c.tokens))
            if i < len(main.tokens):
                add(main, i, i + 1)
        return out

    def annotated_text(self) -> str:
        """The main thread's text with each chunk (``<async>`` + content, and ``</async>`` when
        the interpreter closed it) spliced right after its promise tag."""
        text = "".join(self.main.pieces)
        parts, at = [], 0
        for c in sorted(self._ran(), key=lambda c: (c.fork_char, c.tid)):
            parts += [text[at : c.fork_char], "".join(c.pieces), ASYNC_CLOSE if c.closed_by_interpreter else ""]
            at = c.fork_char
        parts.append(text[at:])
        return "".join(parts)

    def structure(self) -> ResponseStructure:
        """Token counts of the response for the critical-path simulation."""
        forks = [(c.fork_at, c.n_sampled) for c in self.threads[1:] if c.finish != "not_run"]
        inserted = len(self.open_ids) * len(forks)
        return ResponseStructure(main_tokens=self.main.n_sampled, forks=forks, syncs=list(self.syncs), inserted=inserted)


@dataclass
class Spliced:
    """A response in spliced order, one entry per token: id, logprob (None for inserted
    tokens or when not asked), logical position and owning thread id."""

    ids: list[int] = field(default_factory=list)
    logprobs: list[float | None] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    threads: list[int] = field(default_factory=list)


# --------------------------------------------------------------------------- replay plans


@dataclass
class ReplayPlan:
    """Forced token streams for replaying an annotated response.

    ``main_ids`` are the main thread's tokens (the response without its chunks, EOS last);
    ``chunk_ids[i]`` the i-th promise's child tokens (content then ``</async>``; None when
    the promise has no chunk); ``spliced_ids`` the same content in spliced order (with the
    inserted ``<async>`` tokens), i.e. what sequential decoding of it forces;
    ``structure`` its token counts for the critical path; ``steps`` the decode steps of the
    dry run (equal to the critical path at unlimited width)."""

    main_ids: list[int]
    chunk_ids: list[list[int] | None]
    spliced_ids: list[int]
    structure: ResponseStructure
    steps: int
    diagnostics: list[str]


def plan_replay(
    annotated: str,
    encode: Callable[[str], list[int]],
    decode: Decode,
    eos_id: int,
    max_threads: int | None = None,
    max_forks: int = 1 << 30,
) -> ReplayPlan:
    """Tokenize an annotated response the way replay forces it, and dry-run the interpreter.

    The main text and each chunk (content + ``</async>``) are tokenized separately with
    ``encode`` (no special tokens added). The interpreter is then run over these forced
    streams with no model (every thread takes its next forced token each step), which gives
    the spliced order, the structure and the number of steps at width ``max_threads``. Never
    raises on content: malformed tags are text (reported in ``diagnostics``)."""
    th = split_threads(annotated)
    main_ids = encode(th.main) + [int(eos_id)]
    chunk_ids = [None if c.content is None else encode(c.content + (ASYNC_CLOSE if c.closed else "")) for c in th.chunks]
    interp = Interpreter(
        [int(eos_id)],
        decode=decode,
        eos_ids=[eos_id],
        open_ids=encode("<async>"),
        close_len=len(encode(ASYNC_CLOSE)),
        limits=Limits(max_new_tokens=1 << 30, max_threads=max_threads, max_forks=max_forks),
        forced_main=main_ids,
        forced_chunks=chunk_ids,
    )
    steps = 0
    while not interp.done:
        rows = interp.rows()
        interp.take_events()
        interp.step_done(rows)
        sampling = [r for r in rows if r.sample]
        steps += bool(sampling)
        for r in sampling:
            interp.on_token(r.thread, interp.forced_token(r.thread))
    spliced = interp.spliced().ids
    diags = list(th.diagnostics) + interp.diagnostics
    return ReplayPlan(main_ids, chunk_ids, spliced, interp.structure(), steps, diags)
