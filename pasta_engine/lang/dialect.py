"""The dialect interface: what a learned-parallel decoding language must tell the engine (no torch).

The engine's threads, forks, joins, KV views and positions are language-free; a *dialect* says
how one language is written and what its tags mean (docs/DESIGN.md section 2, "Dialects").
:data:`PASTA` (:class:`PastaDialect`, PASTA-LANG) is the one the engine ships and every part
defaults to; another language (Multiverse, APAR) implements :class:`Dialect` and is passed to
the interpreter (``Interpreter(dialect=...)``), to :func:`~pasta_engine.lang.tokenization.tokenize_annotated`
and to :func:`~pasta_engine.core.replay.replay_script`.

A dialect speaks to the interpreter in one event vocabulary, the items of
:mod:`pasta_engine.lang.tags`, whatever its own syntax is. Its parser (:meth:`Dialect.parser`)
turns the text of each decoded token into:

* :class:`~pasta_engine.lang.tags.Text`: text a reader sees; :class:`~pasta_engine.lang.tags.TagText`:
  text the model wrote that a reader never sees (a malformed or partial marker);
  :class:`~pasta_engine.lang.tags.Malformed`: a diagnostic beside it;
* :data:`Fork` (a :class:`~pasta_engine.lang.tags.Promise`: ``topic``, ``tokens`` the
  predicted length or 0, ``raw``, ``end``): fork here (on the main thread; on any thread under
  the depth cap when the dialect nests);
* :data:`Open` (:class:`~pasta_engine.lang.tags.AsyncOpen`): the main thread opens a chunk
  itself (only meaningful for a chunk decoded inline past the fork cap);
* :data:`Close` (:class:`~pasta_engine.lang.tags.AsyncClose`): a forked thread ends here;
* :data:`Join` (:class:`~pasta_engine.lang.tags.Sync`): wait for every outstanding child of
  the joining thread, then see them all;
* :class:`Markup`: a tag that changes no thread.

What the interpreter does with those events is the engine's, the same for every dialect: a
fork's context is the main thread's context at the token that completed the fork marker (its
KV view shared, never copied); the new thread first forwards the dialect's inserted tokens
(:attr:`Dialect.open_tag`, tokenized by the caller); it ends at :data:`Close`, at
end-of-sequence or at :meth:`Dialect.child_cap`; a join (and the main thread's end, an implicit
join) adds the ended threads' KV to the joining thread's view; positions come from
:meth:`Dialect.reserved_positions`; fork markers inside a forked thread are acted on only when
:attr:`Dialect.nesting` is True (and the thread's depth is under ``limits.max_fork_depth``).

Optional members (a dialect without them behaves as PASTA-LANG; read through the functions of
this module, so a dialect written for the first version of the interface keeps working):

* ``branches(fork)``: the threads one fork event starts, ``[(promise, inserted text), ...]``
  (:func:`fork_branches`; default: one, ``(fork, open_tag)``);
* ``fork_joins``: a fork is also a join: the forking thread forwards the fork marker's token,
  then waits for the threads it just forked (default False);
* ``join_tag``: text inserted into a thread when its join completes, forwarded with the
  children's KV visible (default ``""``: none);
* ``join_position(next_pos, child_next)``: the joining thread's next position after a join,
  given its own and each joined child's next position (default: its own);
* ``inserted_bytes(limits)``: an upper bound in UTF-8 bytes of one branch's inserted text
  (default ``len(open_tag)``), for the KV bound of a generated request;
* ``split_tree(annotated)``: a trace as a :class:`TraceThread` tree, for a nesting dialect's
  replay and training tokenization (default: none; :meth:`Dialect.split_threads` is used).

``limits`` and ``policy`` below are :class:`pasta_engine.config.Limits` and
:class:`~pasta_engine.config.PositionPolicy` (read by attribute: ``lang`` imports nothing else of
the package).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any, Collection, Protocol, Sequence, Union, runtime_checkable

from . import grammar, tags
from .prompts import NO_PROMPT, PastaPrompt
from .tags import ASYNC_CLOSE, ASYNC_OPEN, AsyncClose, AsyncOpen, Parsed, Promise, Sync, Threads

__all__ = ["Dialect", "TextParser", "PastaDialect", "PASTA", "DIALECT_NAMES", "get_dialect", "policy_reserve", "Fork", "Open", "Close", "Join",
           "Markup", "TraceFork", "TraceThread", "fork_branches", "fork_joins", "join_tag", "join_position",
           "inserted_bytes", "split_tree", "dialect_prompt"]

#: The event vocabulary a dialect's parser speaks (see the module docstring).
Fork = Promise
Open = AsyncOpen
Close = AsyncClose
Join = Sync


@dataclass(frozen=True)
class Markup:
    """A complete tag that changes no thread (a block's opening, a planning element): never
    shown, never acted on, tokenized apart from the text around it like every tag."""

    raw: str
    end: int = field(default=0, compare=False)


# ---- the optional members (see the module docstring), with their PASTA-LANG defaults


def fork_branches(dialect: Any, fork: Promise) -> list[tuple[Promise, str]]:
    """The threads ``fork`` starts in ``dialect``: ``(promise, inserted text)`` each, in fork
    order (the promise gives the thread's topic and predicted length). PASTA-LANG: one thread,
    ``<async>`` inserted."""
    method = getattr(dialect, "branches", None)
    return [(fork, dialect.open_tag)] if method is None else list(method(fork))


def fork_joins(dialect: Any) -> bool:
    """Whether a fork in ``dialect`` is also a join of the threads it forks (Multiverse: the
    parent waits at ``</Goal>`` for its paths)."""
    return bool(getattr(dialect, "fork_joins", False))


def join_tag(dialect: Any) -> str:
    """The text inserted into a thread when its join completes (``""``: none)."""
    return getattr(dialect, "join_tag", "")


def join_position(dialect: Any, next_pos: int, child_next: Sequence[int]) -> int:
    """The joining thread's next logical position after a join: ``next_pos`` (its own; the
    PASTA-LANG reservation already made room) unless the dialect says otherwise."""
    method = getattr(dialect, "join_position", None)
    return next_pos if method is None else int(method(next_pos, child_next))


def inserted_bytes(dialect: Any, limits: Any) -> int:
    """An upper bound, in UTF-8 bytes, of the text inserted into one forked thread."""
    method = getattr(dialect, "inserted_bytes", None)
    return len(dialect.open_tag.encode()) if method is None else int(method(limits))


@dataclass
class TraceFork:
    """One fork event of a trace thread: the branches it forks, each a :class:`TraceThread`
    (or None: no chunk in the trace), and what the joining thread gets inserted after it."""

    branches: list["TraceThread | None"]
    join_insert: str = ""


@dataclass
class TraceThread:
    """One thread of an annotated trace for a nesting dialect (:func:`split_tree`).

    Attributes:
        items: in order: ``("text", s)`` (text, tag-like text included), ``("tag", raw)`` (a
            tag the thread writes; ``("fork", raw)`` for the one completing a fork marker,
            ``("join", raw)`` for a join marker) and :class:`TraceFork` right after its fork
            marker.
        header: the text the interpreter inserts before the thread's first sample (a child).
        closed: whether the trace closes the thread itself (a child)."""

    items: list[Union[tuple[str, str], TraceFork]] = field(default_factory=list)
    header: str = ""
    closed: bool = True

    def text(self, header: bool = True) -> str:
        """The thread's annotated text: its items, each fork's branches (header, text) and
        join text in place (``header``: its own header first)."""
        parts = [self.header] if header else []
        for it in self.items:
            if isinstance(it, TraceFork):
                parts += [b.text() for b in it.branches if b is not None]
                parts.append(it.join_insert)
            else:
                parts.append(it[1])
        return "".join(parts)


def split_tree(dialect: Any, annotated: str) -> TraceThread | None:
    """``annotated`` as a tree of threads when ``dialect`` tokenizes traces as trees (a nesting
    dialect), else None."""
    method = getattr(dialect, "split_tree", None)
    return None if method is None else method(annotated)


@runtime_checkable
class TextParser(Protocol):
    """An incremental parser of one thread's text (:class:`~pasta_engine.lang.tags.TagParser`
    is PASTA's): fed each decoded token's text, it returns the items completed, never raises on
    content and never drops a character."""

    def feed(self, piece: str) -> list[Parsed]:
        """Consume one piece of text; the items it completed."""
        ...

    def feed_plain(self, text: str) -> bool:
        """Consume ``text`` and return True when it is all text (what :meth:`feed` would
        return as one Text); else consume nothing and return False. A fast path: a parser may
        always return False."""
        ...

    def finish(self) -> list[Parsed]:
        """End of the text: what was held back, as text or tag-like text."""
        ...

    @property
    def pending(self) -> str:
        """Characters held back because they may still become a marker."""
        ...


@runtime_checkable
class Dialect(Protocol):
    """What a learned-parallel decoding language must say (docs/DESIGN.md, "Dialects").

    Attributes:
        name: the dialect's name (``pasta``).
        open_tag: the text inserted into a forked thread before its first sample (its tokens
            are the thread's first forward; the annotated text shows it after the fork marker).
        close_tag: the text that ends a forked thread; the annotated text gets it when the
            interpreter closed a thread (cap, end-of-sequence, cut off).
        nesting: whether a fork marker inside a forked thread forks (False: it is not acted
            on and left out of the clean text).

    Optional members (read through this module's helpers; a dialect without them gets
    PASTA-LANG's behaviour): ``branches`` (:func:`fork_branches`), ``fork_joins``
    (:func:`fork_joins`), ``join_tag``, ``join_position``, ``inserted_bytes``, and ``prompt``
    (:func:`dialect_prompt`: the system prompt and examples that teach an un-finetuned model the
    dialect)."""

    name: str
    open_tag: str
    close_tag: str
    nesting: bool

    # ---- how the tags tokenize and parse
    def parser(self) -> TextParser:
        """A fresh incremental parser for one thread."""
        ...

    def parse(self, text: str) -> list[Parsed]:
        """A whole text's items, text runs merged."""
        ...

    def grammar_state(self, is_main: bool, pending: str, can_fork: bool, taken: Collection[str] = (),
                      tail: str | None = None) -> int:
        """The sampler's grammar state for a thread's next token (0, ``FREE``: no mask), when
        the tokenizer has the dialect's tag pieces as added tokens; ``taken``: the topics
        already promised in the response (:func:`~pasta_engine.lang.grammar.topic_key`), for a
        dialect whose grammar keeps sibling topics distinct; ``tail``: an async thread's own text
        so far (tags left out; None: no rule), for a dialect whose grammar holds a chunk open until
        it ends a sentence (``Limits.chunk_sentence_end``)."""
        ...

    # ---- forks and positions
    def child_cap(self, limits: Any, fork: Promise) -> int:
        """Tokens a forked thread may sample before the interpreter closes it."""
        ...

    def reserved_positions(self, fork: Promise, policy: Any, limits: Any, open_len: int,
                           close_len: int, chunk_len: int | None) -> tuple[int, str | None]:
        """Positions the main thread skips after ``fork`` (its child's positions start right
        after the fork marker), and a diagnostic to record (or None). ``chunk_len``: the
        child's forced tokens in a replay (None otherwise)."""
        ...

    # ---- traces (annotated responses)
    def split_threads(self, annotated: str, lead_whitespace: str = "main") -> Threads:
        """An annotated response split into the main thread's text and each fork's chunk."""
        ...

    def splice(self, main: str, chunks: Sequence[tags.Chunk | str | None]) -> str:
        """The inverse of :meth:`split_threads`."""
        ...

    # ---- rendering
    def clean_text(self, annotated: str) -> str:
        """The clean response a reader sees: no tag, no tag-like text."""
        ...


def dialect_prompt(dialect: Any, pasta_prompt: PastaPrompt) -> PastaPrompt:
    """The prompt a string prompt is formatted with in pasta mode (and in a replay), for a
    request in ``dialect``: ``pasta_prompt`` (the engine's configured one, an adapter's manifest's
    when it has one) for PASTA-LANG; the dialect's own ``prompt`` member for any other, since a
    prompt that teaches PASTA-LANG's tags would teach the wrong language; no system prompt and
    no example for a dialect that has none."""
    if dialect is PASTA or getattr(dialect, "name", None) == PASTA.name:
        return pasta_prompt
    own = getattr(dialect, "prompt", None)
    return own if isinstance(own, PastaPrompt) else NO_PROMPT


def policy_reserve(policy: Any, open_len: int, close_len: int, chunk_len: int | None, predicted: int) -> int:
    """Positions a parent skips after a fork under position policy ``policy``
    (:class:`pasta_engine.config.PositionPolicy`; Jin et al. 2025, section 3.2, the paper's
    position ablation): ``none`` 0 (the child and the parent's next text overlap); ``oracle``
    the opening tag plus the child's true length ``chunk_len`` (replay); ``constant:K`` the tags
    plus K; ``predicted`` the tags plus ``predicted`` (the dialect's predicted chunk length).
    All in tokens (positions)."""
    if policy.kind == "none":
        return 0
    if policy.kind == "oracle":
        return open_len + (chunk_len or 0)
    if policy.kind == "constant":
        return open_len + close_len + policy.constant
    return open_len + close_len + predicted


class PastaDialect:
    """PASTA-LANG (docs/DESIGN.md section 2): ``<promise topic="T" tokens="N"/>`` forks,
    ``<async>`` (inserted) ... ``</async>`` is the chunk, ``<sync/>`` joins; positions follow the
    position policy (``predicted`` reserves ``N`` plus the tags)."""

    name = "pasta"
    open_tag = ASYNC_OPEN
    close_tag = ASYNC_CLOSE
    nesting = False
    #: Fixed pieces a tokenizer may add as tokens (:mod:`pasta_engine.lang.grammar`).
    tag_pieces = grammar.TAG_PIECES

    def parser(self) -> tags.TagParser:
        return tags.TagParser()

    def parse(self, text: str) -> list[Parsed]:
        return tags.parse(text)

    def grammar_state(self, is_main: bool, pending: str, can_fork: bool, taken: Collection[str] = (),
                      tail: str | None = None) -> int:
        return grammar.grammar_state(is_main, pending, can_fork, taken, tail)

    def child_cap(self, limits: Any, fork: Promise) -> int:
        return limits.chunk_cap(fork.tokens)

    def reserved_positions(self, fork: Promise, policy: Any, limits: Any, open_len: int,
                           close_len: int, chunk_len: int | None) -> tuple[int, str | None]:
        if policy.kind != "predicted":
            return policy_reserve(policy, open_len, close_len, chunk_len, 0), None
        note = None
        if fork.tokens > limits.max_promise_tokens:
            note = f"promise tokens={fork.tokens} clamped to {limits.max_promise_tokens}"
        return open_len + close_len + min(fork.tokens, limits.max_promise_tokens), note

    def split_threads(self, annotated: str, lead_whitespace: str = "main") -> Threads:
        return tags.split_threads(annotated, lead_whitespace)

    def splice(self, main: str, chunks: Sequence[tags.Chunk | str | None]) -> str:
        return tags.splice(main, chunks)

    def clean_text(self, annotated: str) -> str:
        return tags.clean_text(annotated)

    def __repr__(self) -> str:
        return "PastaDialect()"


#: The engine's default dialect.
PASTA = PastaDialect()


_MODULES = {"apar": ("apar", "APAR"), "multiverse": ("multiverse", "MULTIVERSE")}

#: Every dialect the engine runs, by name (``--dialect``, the request's ``pasta.dialect``).
DIALECT_NAMES = ("pasta", "apar", "multiverse")


def get_dialect(name: str) -> Dialect:
    """The dialect called ``name`` (one of :data:`DIALECT_NAMES`): ``pasta`` (PASTA-LANG, Jin
    et al. 2025), ``apar`` (APAR, Liu et al. 2024, arXiv 2401.06761), ``multiverse``
    (Multiverse, Yang et al. 2025, arXiv 2506.09991). Raises ValueError naming the name and
    the choices for any other."""
    if name == "pasta":
        return PASTA
    if name in _MODULES:  # imported on first use (a module per dialect, in this package)
        module, attr = _MODULES[name]
        return getattr(importlib.import_module(f".{module}", __package__), attr)
    raise ValueError(f"dialect {name!r} is not one of {', '.join(DIALECT_NAMES)}")
