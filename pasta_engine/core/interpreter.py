"""The interpreter: one request's decoding threads, forks, joins and positions.

The language is a :class:`~pasta_engine.lang.dialect.Dialect` (PASTA-LANG by default): its
parser turns each thread's text into forks, closes and joins, and it gives each child's cap and
the positions a fork reserves; the rest (threads, KV operations, demand) is the same for every
dialect. Below, in PASTA-LANG's words:

It knows nothing about tensors or KV pages (no torch). It states its demand, the threads with
tokens to forward and all their pending tokens (:meth:`Interpreter.runnable_threads`, one
:class:`~pasta_engine.core.batch.ThreadStep` each), and a bound on the KV it can ever write
(:meth:`Interpreter.worst_case_kv`); the scheduler decides which threads run and how many of
their tokens (:mod:`pasta_engine.core.batch` is the contract). It takes back what ran
(:meth:`Interpreter.step_done`) and each sampled token (:meth:`Interpreter.on_token`), and
reports what the KV cache must do as KV operations (:class:`KVFork`, :class:`KVJoin`,
:class:`KVRelease`) that the scheduler applies to the block manager. Semantics follow docs/DESIGN.md section 2 (after
Jin et al., ICML 2025, arXiv 2502.11517, section 3):

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

Modes (:data:`MODES`): ``"pasta"`` acts on the tags as above; ``"sequential"`` treats them as
text in one thread; ``"inline"`` acts on tags like pasta, but decodes each promise's chunk in
place in the same thread (no fork): the same weights sequentially; the baseline for realized
speedup of a PASTA-LANG model. (A PASTA-LANG model never writes ``<async>`` itself, the
interpreter inserts it, so "sequential" is no same-weights baseline for it: after a promise it
writes tag-like text.) In inline mode, right after the token that completes a promise the
interpreter inserts the opening tokens a child would get (``<async>``) into the thread itself;
the thread then samples the chunk, seeing every earlier chunk's text, with the grammar state
and the cap (``dialect.child_cap``, with ``chunk_clean_end``'s sentence grace) a child would
have; the chunk ends when the thread writes ``</async>``, and at its cap or an end-of-sequence
token the interpreter closes it by inserting the closing tag's tokens (the dialect's
``close_tag``, tokenized through ``encode``; the end-of-sequence token is not kept, as a child's
is not), and the thread goes on as main text. The chunk's positions follow the promise's
(nothing is reserved), ``limits.max_forks`` bounds the promises acted on, and no KV operation
is issued: one thread, no fork, the critical path is every sampled token. Text that the
promise's last token holds past the tag comes before the chunk (a fork splices the chunk at the
tag's end); a dialect that nests or joins at its forks (Multiverse) is refused.

Generalized for other dialects (docs/DESIGN.md section 2, "Dialects"; the members are
:class:`~pasta_engine.lang.dialect.BaseDialect`'s): a fork marker may fork several threads, each
with its own inserted text (``dialect.branches``); a fork may also be a join
(``dialect.fork_joins``: the thread forwards the marker's token, then waits, status
``WAITING``); a join may insert text (``dialect.join_tag``) and move the thread's position
(``dialect.join_position``); and when ``dialect.nesting`` is True any thread whose depth is
under ``limits.max_fork_depth`` forks (past it, or past ``max_forks``, a replay decodes the
branches inline in the same thread). A join waits only for the joining thread's own children,
and a thread's end is an implicit join of its children (it ends when they have).

Step accounting: a token sampled at step ``t`` is forwarded (its KV written) at step ``t+1``
(when the scheduler's token budget lets every pending token run: see the scheduler).
A child that ended still forwards its last token once (a "flush" step with no sampling), so
the joined view holds every token the child wrote; that flush shares the step in which the
main thread resumes. With unlimited width the steps a request takes equal
:func:`pasta_engine.metrics.critical_path` of its structure exactly.

Context length: no token is kept at a logical position at or past ``max_positions`` (the
model's ``max_position_embeddings``); the request ends with ``length`` instead. With PASTA
positions the largest logical position counts: after a promise the main thread's reserved
range can reach the limit before the response's token count does.
"""

from __future__ import annotations

import enum
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Sequence

from ..config import Limits, PositionPolicy
from ..lang.detokenizer import Decode, IncrementalDetokenizer, TokenBytes
from ..lang.dialect import (AsyncClose, AsyncOpen, BaseDialect, Dialect, Malformed, Markup, Promise, Sync, TagText,
                            Text, TextParser, as_dialect)
from ..lang.grammar import GrammarState, ends_sentence, topic_cont_state, topic_key
from ..lang.pasta import PASTA
from ..lang.tokenization import ForcedChunk
from ..metrics import ResponseStructure
from . import render
from .batch import KVBound, KVFork, KVJoin, KVOp, KVRelease, ThreadStep  # re-exported: they lived here
from .render import Spliced, reading_order_key, splice_clean  # re-exported: they lived here

__all__ = [
    "Thread",
    "ThreadStatus",
    "ThreadStep",
    "KVFork",
    "KVJoin",
    "KVRelease",
    "KVOp",
    "KVBound",
    "Interpreter",
    "Spliced",
    "reading_order_key",
    "splice_clean",
    "MODES",
]

#: ``"pasta"``: acts on tags (forks, joins); ``"sequential"``: tags are text, one thread;
#: ``"inline"``: acts on tags like pasta, but decodes each promise's chunk in place in the same
#: thread (no fork): the same weights sequentially; the baseline for realized speedup of a
#: PASTA-LANG model.
MODES = ("pasta", "sequential", "inline")
#: The grammar states inside a promise's topic (:meth:`Interpreter._grammar_state` turns them into
#: ``TOPIC_CONT1``-``TOPIC_CONT3``, or ``TOPIC_CONT`` without a bytes table, while the thread's
#: last token ended inside a UTF-8 character).
_TOPIC_STATES = frozenset({GrammarState.TOPIC_EMPTY, GrammarState.TOPIC, GrammarState.TOPIC_FULL,
                           GrammarState.TOPIC_TAKEN, GrammarState.TOPIC_OPENING})
#: With ``Limits.chunk_clean_end``, a chunk at its cap mid-sentence may sample this many more
#: tokens to end the sentence (it ends at the first sentence or line end; at the cap plus this, in
#: any case): a chunk cut mid-sentence by its cap reads as cut off.
SENTENCE_GRACE_TOKENS = 32


class ThreadStatus(enum.Enum):
    """Where a thread is in its life (see :meth:`Interpreter.runnable_threads`)."""

    QUEUED = "queued"  # forked, waiting for width
    RUNNING = "running"
    STALLED = "stalled"  # at a join (its pending tokens forward when it resumes), or ending with children running
    WAITING = "waiting"  # at a join on the token that forked (its pending tokens forward now, no sampling)
    FLUSH = "flush"  # ended; forwards its last token once more (no sampling)
    DONE = "done"


# --------------------------------------------------------------------------- threads


@dataclass(eq=False, slots=True)
class Thread:
    """One decoding thread, a node of the request's tree (``parent``, ``children``, ``depth``).
    ``tokens``/``pieces``/``logprobs`` hold what it wrote (inserted tokens, with ``logprob``
    None, at ``inserted_idx``: a child's header first, a dialect's join text after a join);
    ``clean`` holds its text with tags and
    tag-like text left out (what a reader sees, before :func:`~pasta_engine.lang.tags.drop_empty_items`);
    ``drops`` the offsets in that text where something was left out (a child's inserted
    ``<async>`` at 0, and its ``</async>`` at its end when the interpreter closed it);
    ``n_sampled`` counts sampled tokens, EOS included."""

    tid: int
    detok: IncrementalDetokenizer
    parser: TextParser
    next_pos: int
    promise: Promise | None = None
    parent: "Thread | None" = None
    depth: int = 0  # 0 the main thread, 1 its children, ...
    fork_at: int = 0  # parent tokens before the chunk in the spliced response
    promise_from: int = 0  # parent tokens before the chunk's own promise (the penalties leave it out)
    fork_k: int = 0  # tokens the parent had sampled at the fork (its fork index, 1-based)
    fork_char: int = 0  # parent characters before the chunk in the annotated text
    fork_clean: int = 0  # parent clean characters before the chunk in the clean text
    fork_drop: int = 0  # parent drops before the chunk (its promise's included)
    cap: int | None = None
    forced: deque | None = None
    status: ThreadStatus = ThreadStatus.RUNNING
    tokens: list[int] = field(default_factory=list)
    pieces: list[str] = field(default_factory=list)
    clean: list[str] = field(default_factory=list)
    clean_len: int = 0
    clean_joined: tuple[int, str] = (0, "")  # the first n pieces of ``clean``, joined (clean_text per step)
    drops: list[int] = field(default_factory=list)
    logprobs: list[float | None] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    pending: list[int] = field(default_factory=list)
    pending_pos: list[int] = field(default_factory=list)
    n_sampled: int = 0
    inserted: int = 0  # tokens the interpreter inserted (a child's opening tag, a join's text), not sampled
    inserted_idx: list[int] = field(default_factory=list)  # their indices in ``tokens``
    children: list["Thread"] = field(default_factory=list)
    outstanding: list["Thread"] = field(default_factory=list)  # children not joined yet
    forced_chunks: list = field(default_factory=list)  # replay: per branch it forks, its chunk
    n_branches: int = 0  # branches of its fork markers so far (the index into forced_chunks)
    syncs: list[int] = field(default_factory=list)  # its sampled-token index (1-based) of each join
    inline: bool = False  # inside a chunk decoded inline (inline mode; past the fork cap in a replay)
    inline_pending: bool = False  # that chunk's <async> is its next tag
    inline_open: tuple | None = None  # inline mode: (ids, promise, forced chunk) to insert after this token's text
    inline_cap: int | None = None  # inline mode: the open chunk's cap (a child's), None: no cap (replay)
    inline_from: int = 0  # inline mode: n_sampled when the open chunk started
    inline_clean: int = 0  # inline mode: len(clean) when the open chunk started (its tail starts there)
    inline_promise: tuple[int, int] | None = None  # inline mode: the last chunk's promise, a token span (penalties)
    end_flush: bool = False  # ending once its children end: flush its last token then
    finish: str | None = None
    closed_by_interpreter: bool = False
    started: bool = False
    joined: bool = False
    released: bool = False

    @property
    def is_main(self) -> bool:
        return self.parent is None

    @property
    def ended(self) -> bool:
        return self.status in (ThreadStatus.FLUSH, ThreadStatus.DONE)

    @property
    def uncounted(self) -> tuple[int, int] | None:
        """The span of its own tokens the penalties leave out: an open inline chunk's promise
        (None: none). It changes only when a chunk opens or closes, so an incremental count of
        the thread's seen tokens recounts when it changes (the scheduler's)."""
        return self.inline_promise if self.inline else None


_RUNNING = ThreadStatus.RUNNING


# --------------------------------------------------------------------------- interpreter


def _tokens_before_tag(thread: Thread, raw: str) -> int:
    """How many of ``thread``'s tokens come before the tag whose text ``raw`` its last tokens
    end with: walks back over the tokens' text pieces until they hold ``len(raw)`` characters."""
    n, i = 0, len(thread.pieces)
    while i > 0 and n < len(raw):
        i -= 1
        n += len(thread.pieces[i])
    return i


class Interpreter:
    """One request's threads.

    Args:
        prompt_ids: the prompt's token ids (prefilled by the main thread at positions 0..P-1).
        decode: ``ids -> str`` with special tokens kept (for tag detection and output text).
        eos_ids: token ids that end a thread.
        open_ids: token ids of ``<async>`` (inserted into each child before its first step).
        close_len: number of tokens of ``</async>`` (for position reservations).
        mode: ``"pasta"`` acts on tags; ``"sequential"`` treats them as text; ``"inline"`` acts
            on tags like pasta, but decodes each promise's chunk in place in the same thread (no
            fork): the same weights sequentially; the baseline for realized speedup of a
            PASTA-LANG model (see the module docstring). Outside replay it needs ``encode`` (the
            closing tag it inserts into a capped chunk).
        max_new_tokens: tokens the request samples in all its threads together.
        limits: :class:`~pasta_engine.config.Limits`.
        policy: :class:`~pasta_engine.config.PositionPolicy` or its string.
        max_positions: the model's context length: no token gets a logical position at or past
            it (None: no limit).
        forced_main: replay: the main thread's tokens (EOS last) replacing sampling.
        forced_chunks: replay: per branch the main thread forks, in order (one per promise in
            PASTA-LANG), the child's tokens (content then ``</async>``), or a
            :class:`~pasta_engine.lang.tokenization.ForcedChunk` for a child that forks threads of
            its own (a nesting dialect), or None for a branch without a chunk.
        token_bytes: the tokenizer's token-bytes table (fast incremental detokenization, see
            :mod:`pasta_engine.lang.detokenizer`), or None to detokenize through ``decode``.
        grammar: report each sampling thread's :class:`~pasta_engine.lang.grammar.GrammarState`
            in its :class:`ThreadStep` (the tokenizer has the dialect's piece tokens); only in
            pasta and inline modes and outside replay (forced tokens need no mask).
        dialect: the language the model writes (:class:`~pasta_engine.lang.dialect.Dialect`;
            one that does not derive from :class:`~pasta_engine.lang.dialect.BaseDialect` gets
            its defaults: :func:`~pasta_engine.lang.dialect.as_dialect`): how its text parses
            into forks, closes and joins, each child's cap, the positions a fork reserves, the
            grammar state; ``open_ids``/``close_len`` are its ``open_tag``/``close_tag``
            tokenized. Default: PASTA-LANG.
        encode: ``text -> ids`` for the other text the dialect inserts (a branch's own header,
            a join's text: :func:`~pasta_engine.lang.tokenization.encode_tag`); None: only
            ``open_ids`` (PASTA-LANG needs no more).
        stop_strings: ``SamplingParams.stop``, the request's stop rule (docs/DESIGN.md section 2,
            item 9). Each thread's own clean text is checked as it grows: a child that writes one
            ends there (``stop``, closed by the interpreter), the main thread ends as at end of
            sequence (its children finish first). When a thread wrote one or a child ended, the
            reading-order prefix is checked (:func:`~pasta_engine.core.render.stop_in_prefix`):
            once it holds a stop string the request ends at once with ``stop`` (threads still
            decoding are cut off) and ``stop_reason`` names the string. At any end (``stop`` or
            ``length``) a stop string in the finished text makes the finish ``stop`` as well
            (one that spans two threads' texts is found there at the latest). The text is cut
            right before it by :func:`~pasta_engine.core.render.final_text`.

    Raises ValueError for an empty prompt, an unknown mode, ``oracle`` without replay (pasta
    mode), or inline mode with a dialect that nests or joins at its forks, or (outside replay)
    without ``encode``;
    TypeError for a ``dialect`` that lacks a member of the protocol.

    The request's ``finish`` is ``"stop"`` (end of sequence, the end of a replayed trace, or a
    stop string: ``stop_reason``) or ``"length"`` (``max_new_tokens`` or the context length
    reached; ``length_end`` stays True when a stop string then makes it ``stop``).
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
        max_new_tokens: int = 512,
        limits: Limits | None = None,
        policy: PositionPolicy | str = "predicted",
        max_positions: int | None = None,
        forced_main: Sequence[int] | None = None,
        forced_chunks: Sequence[Sequence[int] | None] | None = None,
        token_bytes: TokenBytes | None = None,
        grammar: bool = False,
        dialect: Dialect | None = None,
        encode: Callable[[str], Sequence[int]] | None = None,
        stop_strings: Sequence[str] = (),
    ):
        if mode not in MODES:
            raise ValueError(f"unknown mode {mode!r}: expected 'pasta', 'sequential' or 'inline'")
        if len(prompt_ids) == 0:
            raise ValueError("empty prompt: at least one token is needed")
        self.mode = mode
        self.dialect: BaseDialect = PASTA if dialect is None else as_dialect(dialect)
        if mode == "inline" and (self.dialect.nesting or self.dialect.fork_joins):
            raise ValueError(f"inline mode decodes one chunk per fork in place: the {self.dialect.name!r} dialect "
                             "nests or joins at its forks")
        self.encode = encode
        self._insert_ids: dict[str, list[int]] = {self.dialect.open_tag: [int(t) for t in open_ids]}
        self.join_ids = self._inserted_ids(self.dialect.join_tag)
        self.max_new_tokens = int(max_new_tokens)
        self.stop_strings = tuple(stop_strings)
        self.stop_matcher = render.StopMatcher(self.stop_strings) if self.stop_strings else None
        self._stop_window = max((len(x) for x in self.stop_strings), default=0)
        self._stop_check = False  # a thread wrote a stop string or a child ended: check the reading order
        self.stop_reason: str | None = None  # the stop string that ended the request
        self._prefix_stop: str | None = None
        self.length_end = False  # the request ended at max_new_tokens or the context length
        self.limits = limits or Limits()
        self.policy = PositionPolicy.parse(policy)
        if self.policy.kind == "oracle" and forced_chunks is None and mode == "pasta":
            raise ValueError("position policy 'oracle' needs the true chunk lengths: use replay, not generate")
        self.decode = decode
        self.token_bytes = token_bytes
        self.eos_ids = frozenset(int(e) for e in eos_ids)
        self.open_ids = [int(t) for t in open_ids]
        self.close_len = int(close_len)
        self.prompt_ids = [int(t) for t in prompt_ids]
        self.max_positions = max_positions
        self.replay = forced_main is not None
        # a replay writes at most its trace's tokens, however large max_new_tokens is
        self._trace_tokens = (len(forced_main) + _count_forced_tokens(forced_chunks or [])) if self.replay else None
        self.grammar = bool(grammar) and mode != "sequential" and not self.replay
        self._forced_chunks = [None if c is None else c if isinstance(c, ForcedChunk) else [int(t) for t in c]
                               for c in (forced_chunks or [])]
        self.threads: list[Thread] = []
        self.kv_ops: list[KVOp] = []
        self.diagnostics: list[str] = []
        self.total_sampled = 0
        self.n_promises = 0  # fork markers completed (by any thread)
        self.n_forks = 0
        self.n_inline = 0  # inline mode: chunks decoded in place (bounded by limits.max_forks as forks are)
        self.close_ids: list[int] = []  # inline mode: the closing tag the interpreter inserts into a chunk it ends
        if mode == "inline" and not self.replay:
            self.close_ids = list(self._inserted_ids(self.dialect.close_tag))
        self.topics_taken: set[str] = set()  # topic_key of every promise so far (Limits.distinct_topics)
        self.finish: str | None = None
        main = self._new_thread(next_pos=0, forced=forced_main)
        main.forced_chunks = self._forced_chunks
        self.syncs: list[int] = main.syncs  # main sampled-token index (1-based) of each sync
        main.pending = list(self.prompt_ids)
        main.pending_pos = list(range(len(self.prompt_ids)))
        main.next_pos = len(self.prompt_ids)
        main.started = True
        self.main = main

    # ------------------------------------------------------------------ scheduling side

    @property
    def done(self) -> bool:
        return self.finish is not None

    @property
    def live_threads(self) -> int:
        """Threads that may still write tokens (not ended)."""
        return sum(1 for t in self.threads if not t.ended)

    def take_kv_ops(self) -> list[KVOp]:
        """The KV operations since the last call, in the order they must be applied."""
        ops, self.kv_ops = self.kv_ops, []
        return ops

    def skip_cached_prompt(self, n: int) -> None:
        """The KV of the prompt's first ``n`` tokens is in the cache already (prefix caching:
        the main thread's view starts with those pages): the main thread forwards only the
        rest. Only before the first step; ``0 <= n < len(prompt_ids)`` (the last prompt token
        is always forwarded: its logits give the first sampled token).

        Raises ValueError otherwise."""
        main = self.main
        p = len(self.prompt_ids)
        if not (0 <= n < p and main.n_sampled == 0 and len(main.pending) == p):
            raise ValueError(f"cannot skip {n} cached prompt tokens: only before the prompt's prefill, and fewer "
                             f"than the prompt's {p}")
        main.pending, main.pending_pos = main.pending[n:], main.pending_pos[n:]

    def runnable_threads(self) -> list[ThreadStep]:
        """The demand: every thread with tokens to forward, each with all its pending tokens
        (one :class:`ThreadStep`), in the order they should run: every flush first (an ended
        thread's last tokens, no sampling), then the sampling threads, the main thread first,
        then children in fork order. Changes nothing: the scheduler picks among them (at most
        :attr:`max_width` sampling threads) and how many of each one's tokens run, and reports
        what ran to :meth:`step_done`."""
        if self.finish is not None:
            return []
        flush, queued, running, done = ThreadStatus.FLUSH, ThreadStatus.QUEUED, _RUNNING, ThreadStatus.DONE
        waiting = ThreadStatus.WAITING
        # a thread whose pending token forks children runs with that fork (the scheduler appends
        # its KV as it forks their views), whatever its status: one that ended on its fork token
        # (a path whose cap-th token opens a nested block) waits for those very children
        forking = {op.parent for op in self.kv_ops if type(op) is KVFork} if self.kv_ops else ()
        steps = [ThreadStep(t.tid, t.pending, t.pending_pos, False) for t in self.threads
                 if t.pending and (t.status is flush or t.status is waiting or (t.status is done and not t.released)
                                   or (t.tid in forking and t.status is not running and t.status is not queued))]
        for t in self.threads:
            status = t.status
            if status is running or status is queued:
                forced = t.forced
                steps.append(ThreadStep(t.tid, t.pending, t.pending_pos, True, forced[0] if forced else None,
                                        self._grammar_state(t) if self.grammar else 0))
        return steps

    @property
    def max_width(self) -> int | None:
        """Sampling threads of this request that may run in one step (``limits.max_threads``;
        None: unlimited)."""
        return self.limits.max_threads

    def worst_case_kv(self) -> KVBound:
        """The most KV the request can write over its whole life, in tokens (its prompt, every
        token it may sample (a replay: its trace's, however large ``max_new_tokens``), the
        inserted ``<async>`` tags of its forks and a dialect's join text) and forks (a replay
        forks only for the chunks its trace holds; sequential and inline modes never fork: an
        inline chunk writes its inserted opening tag, and the closing tag when the interpreter
        ends it, into the one thread)."""
        # the opening tag's tokens, or a bound by bytes on a branch header of the dialect's own,
        # and the join's text
        per_fork = max(len(self.open_ids), self.dialect.inserted_bytes(self.limits)) + len(self.join_ids)
        sampled = self.max_new_tokens if self._trace_tokens is None else min(self.max_new_tokens, self._trace_tokens)
        if self.mode == "sequential":
            return KVBound(len(self.prompt_ids) + sampled, 0)
        if self.replay:
            chunks = _count_chunks(self._forced_chunks)
        else:
            chunks = min(self.limits.max_forks, self.max_new_tokens)
        if self.mode == "inline":
            inserted = chunks * (per_fork + len(self.close_ids))
            return KVBound(len(self.prompt_ids) + sampled + inserted, 0)
        return KVBound(len(self.prompt_ids) + sampled + chunks * per_fork, chunks)

    def peek_kv_ops(self) -> tuple[KVOp, ...]:
        """The KV operations :meth:`take_kv_ops` would return, left in place."""
        return tuple(self.kv_ops)

    def seen_tokens(self, tid: int) -> list[int]:
        """Token ids thread ``tid`` counts for the penalties: the prompt, then for the main
        thread its own tokens, for a chunk its parent's tokens up to its own promise, which is
        left out (and so on up to the main thread), and its own (the inserted ``<async>``
        included); in inline mode, a thread inside a chunk leaves that chunk's promise out the
        same way until the chunk closes (:attr:`Thread.uncounted`). A chunk writes about the
        topic it was promised and usually opens with the topic's words: counted, its own promise
        pushed it off them (promised "Start with the basics", a chunk wrote "**100%**"). Its siblings' promises stay counted, keeping it off
        their subjects (counting no promise at all read worse:
        bench/results/penalty-content-smollm2-cpu/)."""
        t = self.threads[tid]
        seen = t.tokens
        if t.uncounted is not None:  # inline mode: the open chunk's own promise, as a child's
            a, b = t.uncounted
            seen = seen[:a] + seen[b:]
        cut = t.promise_from
        while t.parent is not None:  # list concatenation (C speed): this runs per step per penalised thread
            seen = t.parent.tokens[:cut] + seen
            t = t.parent
            cut = t.fork_at
        return self.prompt_ids + seen

    def _grammar_state(self, t: Thread) -> int:
        """The thread's :class:`~pasta_engine.lang.grammar.GrammarState` for its next sample
        (inside an inline chunk: a chunk's state, its own text the tail)."""
        is_main = t.is_main and not t.inline
        tail = _clean_tail(t) if self.limits.chunk_clean_end and not is_main else None
        acted = self.n_inline if self.mode == "inline" else self.n_forks
        may_fork = acted < self.limits.max_forks and (not is_main or self._fork_fits())
        state = self.dialect.grammar_state(is_main, t.parser.pending, may_fork,
                                           self.topics_taken if self.limits.distinct_topics else (), tail)
        if state in _TOPIC_STATES and t.detok.mid_character:  # the cheap test first: this runs per step
            # inside a UTF-8 character of a topic (the first bytes of an emoji, say): only a token
            # that continues it with as many continuation bytes as it needs; ending there, or any
            # other token, would put U+FFFD in the topic and in the chunk that copies it
            return self._topic_cont(t)
        if state == GrammarState.TOPIC_EMPTY and self.limits.independent_topics:
            return GrammarState.TOPIC_OPENING  # no leaning first word (LEANING_WORDS)
        return state

    def _fork_fits(self) -> bool:
        """Whether a new promise fits the tokens left under ``max_new_tokens``
        (``Limits.fork_headroom_tokens``; True when it is off): the running chunks' promised
        tokens not written yet, plus the headroom. A chunk promised no length owes nothing."""
        headroom = self.limits.fork_headroom_tokens
        if headroom is None:
            return True
        owed = 0
        for c in self.threads:
            if c.promise is not None and not c.ended:
                owed += max(0, min(c.promise.tokens, self.limits.max_promise_tokens) - c.n_sampled)
        return self.max_new_tokens - self.total_sampled >= owed + headroom

    def _topic_cont(self, t: Thread) -> int:
        """The state of thread ``t``'s topic inside a UTF-8 character: by the continuation bytes
        the character still needs (:func:`~pasta_engine.lang.grammar.topic_cont_state`, from its
        last tokens' bytes), or ``TOPIC_CONT`` (any continuation) without a bytes table."""
        if self.token_bytes is None:
            return GrammarState.TOPIC_CONT
        table = self.token_bytes.table
        held, i = b"", len(t.tokens)
        while i > 0 and len(held) < 4:
            i -= 1
            tok = t.tokens[i]
            held = (table[tok] if 0 <= tok < len(table) else b"") + held
        return topic_cont_state(held)

    def _cap_ends(self, t: Thread) -> bool:
        """Whether thread ``t`` (or its inline chunk), at or past its cap, ends now: at once, unless
        ``limits.chunk_clean_end`` holds (where the grammar applies), which gives a chunk mid-sentence up to
        :data:`SENTENCE_GRACE_TOKENS` more to end its sentence."""
        if not (self.grammar and self.limits.chunk_clean_end) or (t.is_main and not t.inline):
            return True
        sampled, cap = (t.n_sampled - t.inline_from, t.inline_cap) if t.inline else (t.n_sampled, t.cap)
        return sampled >= cap + SENTENCE_GRACE_TOKENS or ends_sentence(_clean_tail(t))

    def _inserted_ids(self, text: str) -> list[int]:
        """Token ids of ``text`` the interpreter inserts (the dialect's opening tag: ``open_ids``;
        another text through ``encode``). Raises ValueError when another text is needed and
        the interpreter was built without ``encode``."""
        ids = self._insert_ids.get(text)
        if ids is None and not text:
            return []
        if ids is None:
            if self.encode is None:
                raise ValueError(f"dialect {self.dialect.name!r} inserts {text!r}: the interpreter needs encode=")
            ids = self._insert_ids[text] = [int(t) for t in self.encode(text)]
        return ids

    def step_done(self, steps: Sequence[ThreadStep]) -> None:
        """Call after the forward of ``steps`` (before :meth:`on_token`): each step's tokens
        (the first ones of its thread's pending tokens; a sampling step, all of them) are in the
        KV cache now, a queued thread is running, and a flush that wrote its last token ends.

        Raises RuntimeError when a step is not a prefix of its thread's pending tokens."""
        for s in steps:
            t = self.threads[s.tid]
            n = len(s.tokens)
            if t.pending_pos[:n] != s.positions or (s.sample and n != len(t.pending)):
                raise RuntimeError(f"thread {t.tid}: the step's {n} tokens at {s.positions[:3]}... are not its "
                                   f"next pending tokens")
            t.pending, t.pending_pos = t.pending[n:], t.pending_pos[n:]
            if t.status is ThreadStatus.QUEUED:
                t.status = _RUNNING
            t.started = True
            if not t.pending and (t.status is ThreadStatus.FLUSH or t.status is ThreadStatus.DONE):
                t.status = ThreadStatus.DONE
                if t.joined:
                    self._release(t)

    def cancel(self, reason: str) -> None:
        """End the request now (``abort`` or ``error``): running threads are cut off, queued
        ones never run, and every thread's KV view is released (see :meth:`take_kv_ops`)."""
        self._finish_request(reason)

    def on_token(self, tid: int, token: int, logprob: float | None = None) -> None:
        """Apply a token sampled (or forced) for thread ``tid`` after its forward.

        Raises RuntimeError when the thread cannot take a token (not running)."""
        if self.finish is not None:
            return  # the request ended earlier in this step (e.g. at max_new_tokens)
        thread = self.threads[tid]
        if thread.status is not _RUNNING:
            raise RuntimeError(f"thread {thread.tid} cannot take a token in status {thread.status}")
        if self.max_positions is not None and thread.next_pos >= self.max_positions:
            # the token would sit at a position the model does not have: it is not kept
            self._note(thread, f"reached the model's context length of {self.max_positions} positions")
            self._finish_request("length")
            return
        token = int(token)
        if thread.forced:
            thread.forced.popleft()
        thread.pending, thread.pending_pos = [], []
        thread.n_sampled += 1
        self.total_sampled += 1
        if token in self.eos_ids and thread.inline and not self.replay:
            # inside an inline chunk: it ends as a child's chunk does at end-of-sequence (closed by
            # the interpreter, the EOS not kept), and the thread goes on as main text
            self._close_inline(thread, "ended at end-of-sequence")
        elif token in self.eos_ids:
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
            # _give(thread, [token]) for one token (new lists: a ThreadStep may hold the old ones)
            pos = thread.next_pos
            thread.pending, thread.pending_pos = [token], [pos]
            thread.positions.append(pos)
            thread.next_pos = pos + 1
            before = thread.clean_len
            if thread.parser.feed_plain(piece):  # no tag can start or continue in it: all text
                self._add_clean(thread, piece)
            else:
                self._on_text(thread, piece)
            if self.stop_strings and thread.clean_len > before and not thread.ended:
                self._check_stop_strings(thread, before)
            if (thread.cap is not None and not thread.ended and thread.n_sampled >= thread.cap
                    and self._cap_ends(thread)):
                self._note(thread, f"reached its cap of {thread.cap} tokens; closed by the interpreter")
                self._end_thread(thread, "cap", flush=True)
            if (thread.inline and thread.inline_cap is not None and not thread.ended and self.finish is None
                    and thread.n_sampled - thread.inline_from >= thread.inline_cap and self._cap_ends(thread)):
                self._close_inline(thread, f"reached its cap of {thread.inline_cap} tokens")
            if thread.forced is not None and not thread.forced and not thread.ended:
                self._note(thread, "trace ended without a closing tag")
                self._end_thread(thread, "trace_end", flush=not thread.is_main)
            if self.max_positions is not None and thread.next_pos >= self.max_positions and not thread.ended \
                    and self.finish is None:
                # the thread's next token has no position left: end now, not after a forward whose token is dropped
                self._note(thread, f"reached the model's context length of {self.max_positions} positions")
                self._finish_request("length")
        if self._stop_check and self.finish is None:
            self._check_request_stop()
        if self.total_sampled >= self.max_new_tokens and self.finish is None:
            self._finish_request("length")

    # ------------------------------------------------------------------ internals

    def _new_thread(self, next_pos: int, forced: Sequence[int] | None = None, **kw) -> Thread:
        t = Thread(
            tid=len(self.threads),
            detok=IncrementalDetokenizer(self.decode, self.token_bytes),
            parser=self.dialect.parser(),
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

    def _note(self, thread: Thread, msg: str) -> None:
        who = "main thread" if thread.is_main else f"thread {thread.tid} (topic {thread.promise.topic!r})"
        self.diagnostics.append(f"{who}: {msg}")

    def _add_clean(self, thread: Thread, text: str) -> None:
        if text:
            thread.clean.append(text)
            thread.clean_len += len(text)

    def _check_stop_strings(self, thread: Thread, before: int) -> None:
        """End ``thread`` when its clean text holds a stop string that ends past ``before``
        (the clean length before this token's text): only the tail can hold a new one."""
        tail = render.joined(thread)[max(0, before - self._stop_window + 1):]
        hit = next((s for s in self.stop_strings if s in tail), None)
        if hit is None:
            return
        self._note(thread, f"wrote the stop string {hit!r}; ended by the interpreter")
        self._stop_check = True
        self._end_thread(thread, "stop", flush=not thread.is_main)

    def _check_request_stop(self) -> None:
        """End the request with ``stop`` when its reading-order prefix holds a stop string (the
        text before it can no longer change, so nothing after it is needed)."""
        self._stop_check = False
        hit = render.stop_in_prefix(self)
        if hit is not None:
            self.diagnostics.append(f"the reading-order text holds the stop string {hit[1]!r}: the request ends "
                                    "right before it")
            self._prefix_stop = hit[1]
            self._finish_request("stop")

    def _note_malformed(self, thread: Thread, item: Malformed) -> None:
        what = "partial tag at its end" if item.reason.startswith("unterminated") else "malformed tag"
        self._note(thread, f"{what} left out of the clean text: {item.raw!r}")

    def _on_text(self, thread: Thread, piece: str) -> None:
        forked_now = closed = False
        act = self.mode != "sequential"
        for item in thread.parser.feed(piece):
            if type(item) is Text:
                self._add_clean(thread, item.text)
                continue
            if isinstance(item, Malformed):
                self._note_malformed(thread, item)
                continue
            # a tag or tag-like text: never in the clean text (a tag not acted on stays in the
            # annotated text only)
            thread.drops.append(thread.clean_len)
            if not act or closed or isinstance(item, (TagText, Markup)):
                continue  # sequential mode: tags are text for decoding, left out of the clean text
            if not thread.is_main:
                if isinstance(item, AsyncClose):
                    closed = True  # what follows in this piece sits right after </async>: the chunk's
                    continue
                if not self.dialect.nesting:
                    self._note(thread, f"{item.raw} inside a chunk not acted on (no nesting); left out of the clean text")
                    continue
            if thread.inline_open is not None:  # inline mode: its chunk opens after this token's text
                self._note(thread, f"{item.raw} in the same token as a promise kept as text")
                continue
            if thread.inline:
                if isinstance(item, AsyncClose):
                    thread.inline, thread.inline_cap = False, None
                else:
                    self._note(thread, f"{item.raw} inside an inline chunk kept as text")
                continue
            if isinstance(item, Promise):
                self.n_promises += 1
                forked_now |= self._on_fork(thread, item)
                if self.done:
                    return
            elif isinstance(item, Sync):
                if forked_now:
                    # The fork needs this token's KV, which a stalled thread would not write.
                    self._note(thread, "<sync/> completed by the same token as a promise kept as text")
                    continue
                thread.syncs.append(thread.n_sampled)
                self._stall(thread, ThreadStatus.STALLED)
            elif isinstance(item, AsyncOpen):
                if thread.inline_pending:
                    thread.inline_pending, thread.inline = False, True
                else:  # text, as split_threads reads it: only an <async> right after a promise opens a chunk
                    self._note(thread, "main thread wrote <async> itself; kept as text")
            elif isinstance(item, AsyncClose):
                self._note(thread, "</async> on the main thread kept as text")
        if closed:
            self._end_thread(thread, "close", flush=True)
        if thread.inline_open is not None:
            self._open_inline(thread)

    def _on_fork(self, parent: Thread, fork: Promise) -> bool:
        """Fork the branches of ``fork`` from ``parent`` (docs/DESIGN.md section 2; a dialect
        may fork several, each with its own inserted text, and may join them at once). Returns
        whether a thread was forked."""
        branches = self.dialect.branches(fork)
        self.topics_taken.update(topic_key(bp.topic) for bp, _ in branches if bp.topic)
        base = parent.n_branches
        parent.n_branches += len(branches)
        chunks: list = [None] * len(branches)
        if self.replay:
            chunks = [parent.forced_chunks[base + i] if base + i < len(parent.forced_chunks) else None
                      for i in range(len(branches))]
            for (bp, _), chunk in zip(branches, chunks):
                if chunk is None:
                    self._note(parent, f"promise {bp.topic!r} has no chunk in the trace; kept as text")
            branches = [b for b, c in zip(branches, chunks) if c is not None]
            chunks = [c for c in chunks if c is not None]
            if not branches:
                return False
        p = branches[0][0]
        refused = None
        if (self.n_inline if self.mode == "inline" else self.n_forks) + len(branches) > self.limits.max_forks:
            refused = f"fork cap {self.limits.max_forks} reached"
        elif self.mode == "inline" and len(branches) != 1:
            refused = f"inline mode decodes one chunk per fork, not {len(branches)}"
        elif parent.depth >= self.limits.max_fork_depth:
            refused = f"fork depth cap {self.limits.max_fork_depth} reached"
        if refused is not None:
            what = p.topic if len(branches) == 1 else f"{len(branches)} branches"
            if self.replay:
                self._note(parent, f"{refused}: chunk {what!r} decoded inline")
                inline: list[int] = []
                for (_, text), chunk in zip(branches, chunks):
                    inline += self._inserted_ids(text) + (chunk.spliced if isinstance(chunk, ForcedChunk) else chunk)
                if self.dialect.fork_joins:
                    inline += self.join_ids
                parent.forced.extendleft(reversed(inline))
                parent.inline_pending = not self.dialect.nesting  # PASTA-LANG: its <async> opens the inline chunk
            else:
                self._note(parent, f"{refused}: promise {what!r} kept as text")
            return False
        start = parent.next_pos  # right after the fork marker's last token
        header_ids = [self._inserted_ids(text) for _, text in branches]
        if self.max_positions is not None and start + max(len(h) for h in header_ids) > self.max_positions:
            self._note(parent, f"promise {p.topic!r} not forked: no room under the context length")
            self._finish_request("length")
            return False
        if self.mode == "inline":
            # no fork: the chunk is decoded in place, its opening tag inserted once this token's
            # text is taken (_open_inline), at the positions right after it (nothing reserved)
            self.n_inline += 1
            chunk = chunks[0]
            parent.inline_open = (header_ids[0], p, None if chunk is None else list(chunk))
            parent.inline_promise = (_tokens_before_tag(parent, p.raw), len(parent.tokens))
            return True
        self.n_forks += len(branches)
        size = 0
        for (bp, _), ids, chunk in zip(branches, header_ids, chunks):
            forced = None if chunk is None else chunk.ids if isinstance(chunk, ForcedChunk) else chunk
            size += self._reserved(parent, bp, ids, forced)
            child = self._new_thread(
                next_pos=start,
                forced=forced,
                promise=bp,
                parent=parent,
                depth=parent.depth + 1,
                fork_at=len(parent.tokens),
                promise_from=_tokens_before_tag(parent, fork.raw),
                fork_k=parent.n_sampled,
                fork_char=fork.end,
                fork_clean=parent.clean_len,
                fork_drop=len(parent.drops),
                cap=None if self.replay else self.dialect.child_cap(self.limits, bp),
                status=ThreadStatus.QUEUED,
            )
            child.forced_chunks = chunk.chunks if isinstance(chunk, ForcedChunk) else []
            self.kv_ops.append(KVFork(parent.tid, child.tid))
            self._insert(child, ids)  # the inserted opening tag is part of the child's text
            child.drops.append(0)  # where its opening tag was left out
            parent.children.append(child)
            parent.outstanding.append(child)
        parent.next_pos += size
        if self.dialect.fork_joins:  # the fork is a join: wait for these children now
            parent.syncs.append(parent.n_sampled)
            self._stall(parent, ThreadStatus.WAITING)
        for child in parent.children[-len(branches):]:
            if child.forced is not None and not child.forced and not child.ended:
                # replay of a trace that ends right after this opening tag: the child has no token
                # to take, so it ends now (its tag still flushes into the cache), as a thread whose
                # trace runs out mid-chunk does in on_token
                self._note(child, "trace ended without a closing tag")
                self._end_thread(child, "trace_end", flush=True)
        return True

    def _open_inline(self, thread: Thread) -> None:
        """Inline mode: open the chunk of the promise ``thread`` just completed in ``thread``
        itself: insert the opening tag a child would get (left out of the clean text), and
        give the chunk a child's cap (a replay: its trace's tokens are forced next)."""
        ids, p, chunk = thread.inline_open
        thread.inline_open = None
        if self.done or thread.ended:
            return
        self._insert(thread, ids, drops=True)  # the opening tag is left out of the clean text
        thread.inline, thread.inline_pending = True, False
        thread.inline_from, thread.inline_clean = thread.n_sampled, len(thread.clean)
        thread.inline_cap = None if self.replay else self.dialect.child_cap(self.limits, p)
        if chunk is not None:
            thread.forced.extendleft(reversed(chunk))

    def _close_inline(self, thread: Thread, why: str) -> None:
        """Inline mode: end ``thread``'s open chunk as the interpreter closes a child's (at its
        cap or an end-of-sequence token): insert the closing tag (left out of the clean text),
        and the thread goes on as main text. With no room for it under the context length the
        request ends with ``length`` instead (the chunk stays open in the annotated text, as a
        chunk cut off by a length end)."""
        self._note(thread, f"inline chunk {why}; closed by the interpreter")
        thread.inline, thread.inline_cap = False, None
        ids = self.close_ids
        if self.max_positions is not None and thread.next_pos + len(ids) >= self.max_positions:
            self._note(thread, f"reached the model's context length of {self.max_positions} positions")
            self._finish_request("length")
            return
        self._insert(thread, ids, drops=True)  # the closing tag is left out of the clean text

    def _insert(self, thread: Thread, ids: list[int], drops: bool = False) -> None:
        """Give ``thread`` inserted tokens (not sampled): they are its text and its next input.
        ``drops``: record where each tag they complete is left out of the clean text (an
        inline chunk's tags; a child's opening tag is recorded by its fork)."""
        for tok in ids:
            thread.inserted_idx.append(len(thread.tokens))
            thread.tokens.append(tok)
            piece = thread.detok.push(tok)
            thread.pieces.append(piece)
            thread.logprobs.append(None)
            for item in thread.parser.feed(piece):  # a tag: nothing for the clean text
                if type(item) is Text:
                    self._add_clean(thread, item.text)
                elif drops and not isinstance(item, Malformed):
                    thread.drops.append(thread.clean_len)
        thread.inserted += len(ids)
        self._give(thread, list(ids))

    def _reserved(self, parent: Thread, p: Promise, open_ids: list[int], chunk: list[int] | None) -> int:
        size, note = self.dialect.reserved_positions(p, self.policy, self.limits, len(open_ids), self.close_len,
                                                     None if chunk is None else len(chunk))
        if note:
            self._note(parent, note)
        return size

    def _stall(self, thread: Thread, status: ThreadStatus) -> None:
        thread.status = status
        self._try_resume(thread)

    def _try_resume(self, thread: Thread | None) -> None:
        """Complete ``thread``'s join (or its end, which waits for its children) once every
        child it waits for has ended: their KV joins its view (metadata only)."""
        if thread is None or thread.status not in (ThreadStatus.STALLED, ThreadStatus.WAITING):
            return
        if any(not c.ended for c in thread.outstanding):
            return
        children, thread.outstanding = thread.outstanding, []
        if children:
            self.kv_ops.append(KVJoin(thread.tid, [c.tid for c in children]))
            for c in children:
                c.joined = True
                if c.status is ThreadStatus.DONE:  # a FLUSH child is released after its flush
                    self._release(c)
            thread.next_pos = self.dialect.join_position(thread.next_pos, [c.next_pos for c in children])
        if thread.finish is not None:  # its end waited for its children
            self._finish_thread(thread)
            return
        if self.join_ids and children:
            self._insert(thread, self.join_ids)
        thread.status = _RUNNING

    def _release(self, thread: Thread) -> None:
        if not thread.released:
            thread.released = True
            self.kv_ops.append(KVRelease(thread.tid))

    def _flush_text(self, thread: Thread) -> None:
        """The end of ``thread``'s text: what the detokenizer and the parser still hold. A chunk
        the interpreter closes (``closed_by_interpreter``) is read with the closing tag the
        annotated text gives it (the dialect's ``close_tag``, not kept in its text): a partial
        tag that the tag cuts short is left out, as :func:`~pasta_engine.lang.tags.clean_text`
        of the annotated text leaves it out; read as the end of the text, ``<sy`` would stay
        text and the main thread's ``nc/>`` after the splice would show ``<sync/>`` (reported as
        a partial tag at its end). The cost: such a chunk (cap, end-of-sequence, length cut,
        stop) whose text ends with a partial tag (``</``, ``<pro``) loses it from the clean
        text; the annotated text keeps it. A lone ``<`` there stays (it is text:
        :meth:`~pasta_engine.lang.tags.TagParser` keeps it, and
        :func:`~pasta_engine.lang.tags.drop_empty_items` leaves out what would join it into a tag)."""
        tail = thread.detok.flush()
        if tail and thread.pieces:
            thread.pieces[-1] += tail
        items = thread.parser.feed(tail)
        if thread.closed_by_interpreter and thread.parser.pending:
            held = thread.parser.pending  # reported as what it is to the thread: a partial tag at its end
            closing = [e for e in thread.parser.feed(self.dialect.close_tag)
                       if not isinstance(e, (AsyncClose, Malformed))]
            if any(type(e) is not Text for e in closing):
                items.append(Malformed(raw=held, reason="unterminated tag at the end of the text"))
            items += closing
        for item in items + thread.parser.finish():
            if type(item) is Text:
                self._add_clean(thread, item.text)
            elif isinstance(item, Malformed):
                self._note_malformed(thread, item)
            else:  # a partial tag at a length cut or EOS (tag-like text) is left out
                thread.drops.append(thread.clean_len)

    def _end_thread(self, thread: Thread, reason: str, flush: bool) -> None:
        thread.finish = reason
        # before its text is flushed: a chunk the interpreter closes is read with its </async>. A
        # replayed chunk whose trace ends without one stays as the trace has it (unclosed): its
        # text, a partial tag at its end included, reads as in the trace (the replay's text is
        # the trace's clean text)
        thread.closed_by_interpreter = not thread.is_main and reason in ("cap", "eos", "length", "stop")
        self._flush_text(thread)
        if thread.is_main:
            if reason in ("eos", "trace_end", "stop"):
                # implicit sync: the request ends once every child has ended
                thread.status = ThreadStatus.DONE
                self._maybe_finish()
            return
        if thread.closed_by_interpreter:
            thread.drops.append(thread.clean_len)  # where its inserted </async> is left out
            if reason == "eos":
                self._note(thread, "ended at end-of-sequence; closed by the interpreter")
        thread.end_flush = flush
        if any(not c.ended for c in thread.outstanding):
            # a thread's end is an implicit join of its own children: it ends when they have
            thread.status = ThreadStatus.STALLED
            return
        thread.outstanding = []  # ended children (it forked them and ended before joining)
        self._finish_thread(thread)

    def _finish_thread(self, thread: Thread) -> None:
        """A child's end, once its own children have ended: it flushes its last token (when
        ``end_flush``), and its parent may resume."""
        if self.stop_matcher is not None:
            self._stop_check = True  # the reading-order prefix may now reach past a stop string
        if thread.end_flush and thread.pending:
            thread.status = ThreadStatus.FLUSH
        else:
            thread.status = ThreadStatus.DONE
            thread.pending, thread.pending_pos = [], []
        self._try_resume(thread.parent)
        self._maybe_finish()

    def _maybe_finish(self) -> None:
        if self.main.status is ThreadStatus.DONE and all(t.ended for t in self.threads):
            self._finish_request("length" if self.main.finish == "length" else "stop")

    def _finish_request(self, reason: str) -> None:
        if self.done:
            return
        for t in self.threads:
            if t.is_main or t.ended:
                continue
            if t.finish is not None and t.status is ThreadStatus.STALLED:
                continue  # it ended itself, waiting for its children
            if t.started and t.n_sampled > 0:
                t.finish = reason
                t.closed_by_interpreter = True
                self._note(t, f"cut off by the request's end ({reason}); closed by the interpreter")
            else:
                t.finish = "not_run"
                self._note(t, f"never ran (request ended: {reason}); its promise has no chunk")
        if reason == "length":
            self.main.finish = self.main.finish or "length"
            cut = [t.tid for t in self.threads[1:] if t.finish in ("length", "not_run")]
            if cut and self.limits.length_cut == "prefix":
                self.diagnostics.append(
                    f"length: chunk{'s' if len(cut) > 1 else ''} {', '.join(map(str, cut))} cut off or never run; the "
                    f"clean text ends where the first of them in reading order stopped (Limits.length_cut 'prefix'; "
                    f"the annotated text keeps everything)")
        for t in self.threads:
            t.status = ThreadStatus.DONE
            t.pending, t.pending_pos = [], []
            self._flush_text(t)  # idempotent
            if t.closed_by_interpreter:
                t.drops.append(t.clean_len)  # where its inserted </async> is left out
            self._release(t)
        self.finish = reason
        self.length_end = reason == "length"
        if self.stop_matcher is not None and reason in ("stop", "length"):
            hit = render.stop_in_final(self)  # the first in the finished text: what final_text cuts at
            if hit is not None:
                self.stop_reason, self.finish = hit[1], "stop"
            elif reason == "stop" and self._prefix_stop is not None:
                self.stop_reason = self._prefix_stop

    # ------------------------------------------------------------------ results

    def spliced(self) -> Spliced:
        """The response's tokens in spliced order (:func:`pasta_engine.core.render.spliced`)."""
        return render.spliced(self)

    def annotated_text(self) -> str:
        """Every character the model wrote, each chunk after its promise tag
        (:func:`pasta_engine.core.render.annotated_text`)."""
        return render.annotated_text(self)

    def clean_text(self, final: bool | None = None) -> str:
        """What a reader sees so far, in the response's order, with what may still change held
        back until the request ends (:func:`pasta_engine.core.render.clean_text`; ``final``:
        None for :attr:`done`). At the end it equals :func:`pasta_engine.lang.tags.clean_text` of
        :meth:`annotated_text`."""
        return render.clean_text(self, final)

    def structure(self) -> ResponseStructure:
        """Token counts of the response for the critical-path simulation: a tree when forks
        nest (:class:`~pasta_engine.metrics.ResponseStructure` ``parents``, ``fork_syncs``)."""
        ran = [c for c in self.threads[1:] if c.finish != "not_run"]
        index = {c.tid: j for j, c in enumerate(ran, start=1)}
        forks = [(c.fork_k, c.n_sampled) for c in ran]
        inserted = sum(t.inserted for t in self.threads if t.finish != "not_run")
        nested = any(not c.parent.is_main or c.syncs for c in ran)
        parents = [0 if c.parent.is_main else index[c.parent.tid] for c in ran] if nested else []
        fork_syncs = [list(c.syncs) for c in ran] if nested else []
        return ResponseStructure(main_tokens=self.main.n_sampled, forks=forks, syncs=list(self.syncs),
                                 inserted=inserted, parents=parents, fork_syncs=fork_syncs)


def _clean_tail(t: Thread, chars: int = 8) -> str:
    """The last ``chars`` or more characters of thread ``t``'s clean text, back to its last
    non-space character (its whole text when shorter; inside an inline chunk, the chunk's text
    only): what :func:`~pasta_engine.lang.grammar.ends_sentence` reads. A few pieces per call,
    not the thread's whole text."""
    tail, i = "", len(t.clean)
    lo = t.inline_clean if t.inline else 0
    while i > lo and (len(tail) < chars or not tail.strip()):
        i -= 1
        tail = t.clean[i] + tail
    return tail


def _count_forced_tokens(chunks: Sequence) -> int:
    """Tokens a replay's forced chunks sample, nested ones included."""
    return sum(len(c.ids) + _count_forced_tokens(c.chunks) if isinstance(c, ForcedChunk) else len(c)
               for c in chunks if c is not None)


def _count_chunks(chunks: Sequence) -> int:
    """Chunks in a replay's forced chunks, nested ones included."""
    return sum(1 + (_count_chunks(c.chunks) if isinstance(c, ForcedChunk) else 0) for c in chunks if c is not None)
