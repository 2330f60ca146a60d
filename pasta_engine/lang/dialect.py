"""The dialect protocol: what a learned-parallel decoding language tells the engine, the events
its parser emits, and the registry of dialects by name (no torch).

The engine's threads, forks, joins, KV views and positions are language-free; a *dialect* says
how one language is written and what its tags mean (docs/DESIGN.md section 2, "Dialects").
Three ship, each in its own module of this package: PASTA-LANG (:mod:`.pasta`, the default
everywhere), APAR (:mod:`.apar`) and Multiverse (:mod:`.multiverse`). A dialect is passed to the
interpreter (``Interpreter(dialect=...)``), to :func:`~pasta_engine.lang.tokenization.tokenize_annotated`
and to :func:`~pasta_engine.core.replay.replay_script`, or named (:func:`get_dialect`).

What a dialect is made of, declared here once:

* :class:`Dialect`, the protocol: the members every dialect must have (checked when it is
  registered and when the engine takes it: :func:`as_dialect`);
* :class:`BaseDialect`, the one base class: every other member the engine reads, each with a
  real default (what PASTA-LANG does); a dialect that forks otherwise overrides them.

Every dialect's parser speaks one event vocabulary, defined in this module, whatever its syntax:

* :class:`Text`: text a reader sees; :class:`TagText`: text the model wrote that a reader never
  sees (a malformed or partial marker); :class:`Malformed`: a diagnostic beside it;
* :class:`Promise` (the fork event: ``topic``, ``tokens`` the predicted length or 0, ``raw``,
  ``end``): fork here (on the main thread; on any thread under the depth cap when the dialect
  nests);
* :class:`AsyncOpen`: the main thread opens a chunk itself (only meaningful for a chunk decoded
  inline past the fork cap);
* :class:`AsyncClose`: a forked thread ends here;
* :class:`Sync` (the join event): wait for every outstanding child of the joining thread, then
  see them all;
* :class:`Markup`: a tag that changes no thread.

The events carry PASTA-LANG's names (the paper's words, and the first dialect's); ``AsyncOpen()``,
``AsyncClose()`` and ``Sync()`` default to PASTA-LANG's tag text, every other dialect's parser
gives its own ``raw``.

What the interpreter does with those events is the engine's, the same for every dialect: a
fork's context is the forking thread's context at the token that completed the fork marker (its
KV view shared, never copied); each new thread first forwards its branch's inserted tokens
(:meth:`BaseDialect.branches`; :attr:`Dialect.open_tag` by default, tokenized by the caller); it
ends at :class:`AsyncClose`, at end-of-sequence or at :meth:`Dialect.child_cap`; a join (and a
thread's end, an implicit join) adds the ended threads' KV to the joining thread's view;
positions come from :meth:`Dialect.reserved_positions` and :meth:`BaseDialect.join_position`;
fork markers inside a forked thread are acted on only when :attr:`Dialect.nesting` is True (and
the thread's depth is under ``limits.max_fork_depth``).

``limits`` and ``policy`` below are :class:`pasta_engine.config.Limits` and
:class:`~pasta_engine.config.PositionPolicy` (read by attribute: ``lang`` imports nothing else of
the package).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any, Callable, Collection, Protocol, Sequence, Union, runtime_checkable

from .prompts import NO_PROMPT, PastaPrompt

__all__ = [
    "Text", "TagText", "Promise", "AsyncOpen", "AsyncClose", "Sync", "Markup", "Malformed", "Parsed", "source_text",
    "Chunk", "Threads", "TraceFork", "TraceThread",
    "TextParser", "Rejoin", "Dialect", "BaseDialect", "DIALECT_MEMBERS", "as_dialect", "check_dialect",
    "policy_reserve", "dialect_prompt",
    "DIALECT_NAMES", "register_dialect", "get_dialect",
]


# --------------------------------------------------------------------------- events


@dataclass(frozen=True)
class Text:
    """Text a reader sees (anything that is not a well-formed tag)."""

    text: str


@dataclass(frozen=True)
class TagText(Text):
    """Text that began like one of the dialect's tags but is not one (a malformed tag, or a
    partial tag at the end of the text). It is a :class:`Text`, so whatever rebuilds what the
    model wrote keeps it; the clean text a reader sees leaves it out."""


@dataclass(frozen=True)
class Promise:
    """The fork event: fork here. PASTA-LANG's ``<promise topic="T" tokens="N"/>`` (``tokens`` the
    predicted length), APAR's ``[Fork]`` (no topic, no length: ``Promise("", 0, "[Fork]")``),
    Multiverse's ``</Goal>`` (:class:`~pasta_engine.lang.multiverse.GoalFork`).

    ``end`` (on every tag event): offset in the parser's input just past the tag's last
    character (not compared: equal tags at different places are equal items)."""

    topic: str
    tokens: int
    raw: str
    end: int = field(default=0, compare=False)


@dataclass(frozen=True)
class AsyncOpen:
    """A chunk's opening tag (PASTA-LANG's ``<async>``, the default ``raw``; APAR's ``[Child]``)."""

    raw: str = "<async>"
    end: int = field(default=0, compare=False)


@dataclass(frozen=True)
class AsyncClose:
    """A forked thread's end (PASTA-LANG's ``</async>``, the default ``raw``; APAR's ``[/Child]``,
    a path's own ``</Path>`` in Multiverse)."""

    raw: str = "</async>"
    end: int = field(default=0, compare=False)


@dataclass(frozen=True)
class Sync:
    """The join event: the thread waits for its outstanding children (PASTA-LANG's ``<sync/>``,
    the default ``raw``)."""

    raw: str = "<sync/>"
    end: int = field(default=0, compare=False)


@dataclass(frozen=True)
class Markup:
    """A complete tag that changes no thread (a block's opening, a planning element): never
    shown, never acted on, tokenized apart from the text around it like every tag."""

    raw: str
    end: int = field(default=0, compare=False)


@dataclass(frozen=True)
class Malformed:
    """Diagnostic only: ``raw`` looked like the start of a tag but is not one (``raw`` ends with
    the character that broke it, or is the partial tag left at the end).

    The characters are also emitted, as :class:`TagText` (the tag-like part) and :class:`Text`
    (nothing is lost)."""

    raw: str
    reason: str


#: What a parser emits: text (plain or tag-like), a tag event, or a diagnostic beside the text.
Parsed = Union[Text, TagText, Promise, AsyncOpen, AsyncClose, Sync, Markup, Malformed]


def source_text(e: Parsed) -> str:
    """The characters of the parsed text that ``e`` stands for: a text run's text, a tag's raw
    text, and nothing for a :class:`Malformed` diagnostic (its characters come as the
    :class:`TagText` and :class:`Text` beside it). Joined over ``parse(s)``, gives ``s`` back."""
    return e.text if isinstance(e, Text) else "" if isinstance(e, Malformed) else e.raw


# --------------------------------------------------------------------------- traces


@dataclass
class Chunk:
    """One fork of an annotated response and the chunk spliced after it.

    ``content`` is the chunk's text between its opening and closing tags (``None`` when the fork
    has no chunk); ``closed`` is False for a chunk that runs to the end of the text."""

    topic: str
    tokens: int
    content: str | None
    closed: bool = True


@dataclass
class Threads:
    """An annotated response split into what each thread wrote.

    ``main`` is the main thread's text: the response without its chunks (fork markers and joins
    kept verbatim). ``chunks[i]`` belongs to the i-th fork in ``main``. Whitespace between a
    fork and its chunk's opening tag stays in ``main``."""

    main: str
    chunks: list[Chunk]
    diagnostics: list[str] = field(default_factory=list)


@dataclass
class TraceFork:
    """One fork event of a trace thread: the branches it forks, each a :class:`TraceThread`
    (or None: no chunk in the trace), and what the joining thread gets inserted after it."""

    branches: list["TraceThread | None"]
    join_insert: str = ""


@dataclass
class TraceThread:
    """One thread of an annotated trace for a nesting dialect (:meth:`BaseDialect.split_tree`).

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


# --------------------------------------------------------------------------- the protocol


@runtime_checkable
class TextParser(Protocol):
    """An incremental parser of one thread's text (:class:`~pasta_engine.lang.tags.TagParser`
    is PASTA-LANG's): fed each decoded token's text, it returns the items completed, never raises
    on content and never drops a character."""

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


@dataclass(frozen=True)
class Rejoin:
    """How a dialect's tag text could form again in its clean text, and how the clean text keeps
    it from (:func:`~pasta_engine.lang.tags.drop_empty_items`; docs/DESIGN.md section 2: no tag
    text reaches a reader). A lone ``opener`` the model wrote right before something left out
    (``x <<sync/>``, ``x [[Fork]``) is its text and stays; the text after what was left out that,
    read after that opener by a fresh ``parser()``, is a tag or tag-like text (``sync/>``,
    ``Fork]``) is left out instead.

    Attributes:
        opener: the one character every tag of the dialect starts with (``<``, ``[``).
        parser: a fresh parser that reads that text as the dialect's tags read anywhere a
            reader sees text (a context-free one for a dialect whose parser has contexts).
        mark: a whole tag of the dialect, which that parser reads for each offset where something
            was left out (so a partial tag cut short there reads as cut short by a tag, as it
            does in the annotated text)."""

    opener: str
    parser: Callable[[], TextParser]
    mark: str


@runtime_checkable
class Dialect(Protocol):
    """The members every dialect must have (docs/DESIGN.md section 2, "Dialects"); a dialect
    derives from :class:`BaseDialect` for every other member the engine reads.

    Attributes:
        name: the dialect's name (``pasta``), its key in the registry.
        open_tag: the text inserted into a forked thread before its first sample (its tokens
            are the thread's first forward; the annotated text shows it after the fork marker).
        close_tag: the text that ends a forked thread; the annotated text gets it when the
            interpreter closed a thread (cap, end-of-sequence, cut off).
        nesting: whether a fork marker inside a forked thread forks (False: it is not acted
            on and left out of the clean text)."""

    name: str
    open_tag: str
    close_tag: str
    nesting: bool

    # ---- how the tags parse
    def parser(self) -> TextParser:
        """A fresh incremental parser for one thread."""
        ...

    def parse(self, text: str) -> list[Parsed]:
        """A whole text's items, text runs merged."""
        ...

    def grammar_state(self, is_main: bool, pending: str, can_fork: bool, taken: Collection[str] = (),
                      tail: str | None = None) -> int:
        """The sampler's grammar state for a thread's next token (0, ``FREE``: no mask), when
        the tokenizer has PASTA-LANG's tag pieces as added tokens
        (:class:`~pasta_engine.lang.grammar.GrammarState`); ``taken``: the topics already
        promised in the response (:func:`~pasta_engine.lang.grammar.topic_key`), for a dialect
        whose grammar keeps sibling topics distinct; ``tail``: an async thread's own text so far
        (tags left out; None: no rule), for a dialect whose grammar holds a chunk open while it
        may not end (``Limits.chunk_clean_end``). A dialect without masks answers
        ``FREE`` always; ``MAIN`` where the main thread may open a promise is where
        ``Limits.fork_threshold`` acts."""
        ...

    # ---- forks and positions
    def child_cap(self, limits: Any, fork: Promise) -> int:
        """Tokens a forked thread may sample before the interpreter closes it."""
        ...

    def reserved_positions(self, fork: Promise, policy: Any, limits: Any, open_len: int,
                           close_len: int, chunk_len: int | None) -> tuple[int, str | None]:
        """Positions the forking thread skips after ``fork`` (its child's positions start right
        after the fork marker), and a diagnostic to record (or None). ``open_len``,
        ``close_len``: the opening and closing tags' lengths in tokens; ``chunk_len``: the
        child's forced tokens in a replay (None otherwise)."""
        ...

    # ---- traces (annotated responses)
    def split_threads(self, annotated: str, lead_whitespace: str = "main") -> Threads:
        """An annotated response split into the main thread's text and each fork's chunk."""
        ...

    def splice(self, main: str, chunks: Sequence[Chunk | str | None]) -> str:
        """The inverse of :meth:`split_threads`."""
        ...

    # ---- rendering
    def clean_text(self, annotated: str) -> str:
        """The clean response a reader sees: no tag, no tag-like text."""
        ...


def _declared(cls: type) -> tuple[str, ...]:
    """The members ``cls`` itself declares: its annotated attributes, then its methods and
    properties, in definition order (private names left out)."""
    names = [n for n in cls.__dict__.get("__annotations__", {}) if not n.startswith("_")]
    names += [n for n, v in cls.__dict__.items()
              if not n.startswith("_") and (callable(v) or isinstance(v, property)) and n not in names]
    return tuple(names)


#: The members every dialect must have (the :class:`Dialect` protocol's), in its order.
DIALECT_MEMBERS = _declared(Dialect)


class BaseDialect:
    """The base class of every dialect: the members the engine reads besides the protocol's
    (:class:`Dialect`), each with a real default, the one PASTA-LANG and APAR use. A subclass
    implements the protocol's members itself (:func:`register_dialect` and :func:`as_dialect`
    refuse it, naming the member, when one is missing) and overrides a default where its
    language differs (Multiverse: several branches per fork, a fork that is also a join, text
    inserted at the join, positions after the longest branch, traces as trees, its own prompt).

    Attributes:
        fork_joins: a fork is also a join: the forking thread forwards the fork marker's token,
            then waits for the threads it just forked (default False).
        join_tag: text inserted into a thread when its join completes, forwarded with the
            children's KV visible (default ``""``: none).
        rejoin: the opener, parser and mark with which the clean text cuts text that would
            complete a kept lone opener into a tag (:class:`Rejoin`; default None: PASTA-LANG's)."""

    fork_joins: bool = False
    join_tag: str = ""
    #: How this dialect's clean text keeps tag text from forming again after a kept lone opener
    #: (:class:`Rejoin`; read by :mod:`pasta_engine.core.render` and by the dialect's
    #: ``clean_text``). Default None: PASTA-LANG's (``<`` read by
    #: :class:`~pasta_engine.lang.tags.TagParser`).
    rejoin: Rejoin | None = None

    def branches(self, fork: Promise) -> list[tuple[Promise, str]]:
        """The threads ``fork`` starts, in fork order: ``(promise, inserted text)`` each (the
        promise gives the thread's topic and predicted length). Default: one, ``(fork,
        open_tag)``."""
        return [(fork, self.open_tag)]  # type: ignore[attr-defined]  # a protocol member

    def join_position(self, next_pos: int, child_next: Sequence[int]) -> int:
        """The joining thread's next logical position after a join, given its own
        (``next_pos``) and each joined child's next position. Default: its own (a fork's
        reservation already made room)."""
        return next_pos

    def inserted_bytes(self, limits: Any) -> int:
        """An upper bound, in UTF-8 bytes, of the text one fork inserts besides ``open_tag``
        (a branch header of its own, the join's text), for the KV bound of a generated request
        (a token is at least a byte). Default 0: each branch gets ``open_tag``, whose tokens
        the interpreter knows. A dialect that overrides :meth:`branches` or :attr:`join_tag`
        bounds that text here."""
        return 0

    def split_tree(self, annotated: str) -> TraceThread | None:
        """``annotated`` as a tree of threads, for a nesting dialect's replay and training
        tokenization; None (the default): the trace is read with ``split_threads``."""
        return None

    def prompt(self, pasta_prompt: PastaPrompt) -> PastaPrompt:
        """The system prompt and example exchanges that teach an un-finetuned model this
        dialect: what a string prompt is formatted with in pasta mode and in a replay.
        ``pasta_prompt`` is the engine's configured PASTA-LANG prompt (an adapter's manifest's
        when it has one), PASTA-LANG's answer. Default: none (the user's message alone)."""
        return NO_PROMPT


def check_dialect(dialect: Any) -> None:
    """Check that ``dialect`` has every member of the :class:`Dialect` protocol and a non-empty
    ``name``. Raises TypeError naming the first member it lacks (and its class), ValueError
    for a name that is not a non-empty string."""
    for member in DIALECT_MEMBERS:
        if not hasattr(dialect, member):
            raise TypeError(f"dialect class {type(dialect).__name__} lacks the member {member!r} of the "
                            f"Dialect protocol (every dialect has {', '.join(DIALECT_MEMBERS)})")
    if not isinstance(dialect.name, str) or not dialect.name:
        raise ValueError(f"dialect class {type(dialect).__name__}: name must be a non-empty string, got "
                         f"{dialect.name!r}")


class _ProtocolDialect(BaseDialect):
    """A dialect object that implements only the :class:`Dialect` protocol (it does not derive
    from :class:`BaseDialect`), as the engine reads it: the protocol's members are its own,
    every other member is the default."""

    __slots__ = ("inner",)

    def __init__(self, inner: Dialect) -> None:
        self.inner = inner

    @property
    def name(self) -> str:
        return self.inner.name

    @property
    def open_tag(self) -> str:
        return self.inner.open_tag

    @property
    def close_tag(self) -> str:
        return self.inner.close_tag

    @property
    def nesting(self) -> bool:
        return self.inner.nesting

    def parser(self) -> TextParser:
        return self.inner.parser()

    def parse(self, text: str) -> list[Parsed]:
        return self.inner.parse(text)

    def grammar_state(self, is_main: bool, pending: str, can_fork: bool, taken: Collection[str] = (),
                      tail: str | None = None) -> int:
        return self.inner.grammar_state(is_main, pending, can_fork, taken, tail)

    def child_cap(self, limits: Any, fork: Promise) -> int:
        return self.inner.child_cap(limits, fork)

    def reserved_positions(self, fork: Promise, policy: Any, limits: Any, open_len: int,
                           close_len: int, chunk_len: int | None) -> tuple[int, str | None]:
        return self.inner.reserved_positions(fork, policy, limits, open_len, close_len, chunk_len)

    def split_threads(self, annotated: str, lead_whitespace: str = "main") -> Threads:
        return self.inner.split_threads(annotated, lead_whitespace)

    def splice(self, main: str, chunks: Sequence[Chunk | str | None]) -> str:
        return self.inner.splice(main, chunks)

    def clean_text(self, annotated: str) -> str:
        return self.inner.clean_text(annotated)

    def __repr__(self) -> str:
        return repr(self.inner)


def as_dialect(dialect: Dialect) -> BaseDialect:
    """``dialect`` as the engine reads it, every member present: itself when it derives from
    :class:`BaseDialect`; an object that implements only the :class:`Dialect` protocol gets
    :class:`BaseDialect`'s defaults for the rest (what it answers to the protocol's members is
    its own). Raises as :func:`check_dialect` (TypeError naming a protocol member it lacks)."""
    check_dialect(dialect)
    return dialect if isinstance(dialect, BaseDialect) else _ProtocolDialect(dialect)


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


def dialect_prompt(dialect: Dialect, pasta_prompt: PastaPrompt) -> PastaPrompt:
    """The prompt a string prompt is formatted with in pasta mode (and in a replay) for a
    request in ``dialect``: the dialect's own (:meth:`BaseDialect.prompt`), given the engine's
    configured PASTA-LANG prompt ``pasta_prompt``. Raises as :func:`as_dialect`."""
    return as_dialect(dialect).prompt(pasta_prompt)


# --------------------------------------------------------------------------- the registry

#: Where the dialects that ship are defined: name -> (module of this package, attribute holding
#: its registered instance). A module is imported when its dialect is first asked for
#: (:func:`get_dialect`), so every name is known before its module loads and an install that
#: lacks a module says which (ModuleNotFoundError naming it); the import registers the dialect.
_MODULES: dict[str, tuple[str, str]] = {
    "pasta": ("pasta", "PASTA"),
    "apar": ("apar", "APAR"),
    "multiverse": ("multiverse", "MULTIVERSE"),
}

#: Every registered dialect by name (:func:`register_dialect`): the shipped ones once their
#: module is imported (PASTA-LANG's with this package), and any other a caller registered.
_REGISTRY: dict[str, BaseDialect] = {}

#: The dialects that ship, by name, PASTA-LANG's first: the CLI's ``--dialect`` choices, the
#: server's ``pasta.dialect``, what :func:`get_dialect` knows before anything is registered.
DIALECT_NAMES: tuple[str, ...] = tuple(_MODULES)


def register_dialect(dialect: Dialect) -> BaseDialect:
    """Put ``dialect`` in the registry under its ``name`` (each shipped dialect's module does it
    for its own when imported), after checking it (:func:`check_dialect`). Returns the
    registered object: ``dialect`` itself when it derives from :class:`BaseDialect`
    (:func:`as_dialect` otherwise). Registering the same object again changes nothing.

    Raises TypeError naming a protocol member ``dialect``'s class lacks, ValueError for an
    empty name or a name another dialect holds."""
    registered = as_dialect(dialect)
    held = _REGISTRY.get(registered.name)
    if held is not None and held is not registered:
        raise ValueError(f"dialect name {registered.name!r} is registered already, to {held!r}")
    _REGISTRY[registered.name] = registered
    return registered


def get_dialect(name: str) -> BaseDialect:
    """The dialect called ``name``: ``pasta`` (PASTA-LANG, Jin et al. 2025), ``apar`` (APAR,
    Liu et al. 2024, arXiv 2401.06761), ``multiverse`` (Multiverse, Yang et al. 2025, arXiv
    2506.09991), or one a caller registered. A shipped dialect's module is imported on first
    use.

    Raises ValueError naming the parameter ``dialect``, the value and the known names for any
    other name; ModuleNotFoundError when a shipped dialect's module is missing from this
    install, or what its import raises."""
    if isinstance(name, str) and name in _MODULES:
        module, attribute = _MODULES[name]
        return getattr(importlib.import_module(f".{module}", __package__), attribute)
    if isinstance(name, str) and name in _REGISTRY:
        return _REGISTRY[name]
    known = ", ".join(repr(n) for n in dict.fromkeys([*_MODULES, *_REGISTRY]))
    raise ValueError(f"dialect={name!r} is not a registered dialect (known: {known})")


def __getattr__(name: str) -> Any:
    """``PASTA`` and ``PastaDialect`` (PASTA-LANG, defined in :mod:`.pasta` like every dialect
    in its own module) are read here too, by code that imports them with the protocol."""
    if name in ("PASTA", "PastaDialect"):
        return getattr(importlib.import_module(".pasta", __package__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
