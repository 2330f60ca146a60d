"""PASTA-LANG tags: the incremental parser and whole-response helpers (no tokenizer, no torch).

Tags (DESIGN.md section 2; Jin et al., ICML 2025, arXiv 2502.11517, section 3):

``<promise topic="T" tokens="N"/>``
    written by the main thread: a chunk about ``T`` of about ``N`` tokens goes here.
``<async>`` ... ``</async>``
    the chunk's content; the interpreter writes the opening tag, the async thread the closing one.
``<sync/>``
    barrier: the main thread waits for every outstanding chunk.

Everything here works on text. A tag may arrive split across any number of token pieces, or
as one added special token whose text is the tag; :class:`TagParser` is fed text pieces (or
special-token ids it maps to text) one at a time and reports each tag the moment its last
character arrives. Anything that is not a well-formed tag is text: the parser never raises on
what a model wrote, and it never drops a character (``"".join`` of the text it emits plus the
raw text of the tags it emits equals its input).

Whole-response helpers: :func:`strip_tags` (clean response), :func:`split_threads` (an annotated
response into the main thread's text and each promise's chunk) and :func:`splice` (the inverse).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Iterable, Mapping, Sequence

__all__ = [
    "Text",
    "Promise",
    "AsyncOpen",
    "AsyncClose",
    "Sync",
    "Malformed",
    "Parsed",
    "TagParser",
    "parse",
    "strip_tags",
    "split_threads",
    "splice",
    "promise_tag",
    "ASYNC_OPEN",
    "ASYNC_CLOSE",
    "SYNC",
    "MAX_TAG_CHARS",
]

ASYNC_OPEN = "<async>"
ASYNC_CLOSE = "</async>"
SYNC = "<sync/>"

#: A would-be tag longer than this many characters is text (guards against runaway attributes
#: such as ``tokens="1000000000..."``).
MAX_TAG_CHARS = 256
#: At most this many digits in ``tokens="N"``.
MAX_TOKENS_DIGITS = 6

_WS = " \t\r\n"
_LITERALS = {
    "<async>": "async_open",
    "</async>": "async_close",
    "<sync/>": "sync",
    "<sync />": "sync",
}
_PROMISE = "<promise"
_ATTRS = ("topic", "tokens")
# A buffer that fails to become a tag is reported as malformed only when it got this far.
_KNOWN_HEADS = ("<promise", "<async", "</async", "<sync")


@dataclass(frozen=True)
class Text:
    """Plain text (anything that is not a well-formed tag)."""

    text: str


@dataclass(frozen=True)
class Promise:
    """A completed ``<promise topic=.. tokens=../>`` tag; ``tokens`` is the predicted length.

    ``end`` (on every tag): offset in the parser's input just past the tag's last
    character (not compared: equal tags at different places are equal items)."""

    topic: str
    tokens: int
    raw: str
    end: int = field(default=0, compare=False)


@dataclass(frozen=True)
class AsyncOpen:
    """A completed ``<async>`` tag."""

    raw: str = ASYNC_OPEN
    end: int = field(default=0, compare=False)


@dataclass(frozen=True)
class AsyncClose:
    """A completed ``</async>`` tag."""

    raw: str = ASYNC_CLOSE
    end: int = field(default=0, compare=False)


@dataclass(frozen=True)
class Sync:
    """A completed ``<sync/>`` tag."""

    raw: str = SYNC
    end: int = field(default=0, compare=False)


@dataclass(frozen=True)
class Malformed:
    """Diagnostic only: ``raw`` looked like the start of a PASTA-LANG tag but is not one.

    The same characters are also emitted as :class:`Text` (nothing is lost)."""

    raw: str
    reason: str


#: What the parser emits: text, or a tag (Malformed is a diagnostic beside the text).
Parsed = Text | Promise | AsyncOpen | AsyncClose | Sync | Malformed
Tag = Promise | AsyncOpen | AsyncClose | Sync


def promise_tag(topic: str, tokens: int) -> str:
    """Render a promise tag. Raises ValueError if ``topic`` holds ``"``, ``<`` or ``>`` or
    ``tokens`` is negative."""
    if any(c in topic for c in '"<>') or tokens < 0:
        raise ValueError(f"cannot render promise topic={topic!r} tokens={tokens}")
    return f'<promise topic="{topic}" tokens="{tokens}"/>'


# --------------------------------------------------------------------------- scanning


def _scan_literal(buf: str) -> tuple[str, Tag | None]:
    status = "fail"
    for lit, kind in _LITERALS.items():
        if lit == buf:
            tag = {"async_open": AsyncOpen, "async_close": AsyncClose, "sync": Sync}[kind](raw=buf)
            return "done", tag
        if lit.startswith(buf):
            status = "partial"
    return status, None


def _scan_promise(buf: str) -> tuple[str, Tag | None]:
    """Scan ``buf`` (which starts with '<') against the promise grammar:
    ``<promise`` (WS+ NAME '=' QUOTE VALUE QUOTE)+ WS* ``/>`` with NAME in {topic, tokens},
    each exactly once, QUOTE ``"`` or ``'``. Returns ("done", Promise) when ``buf`` is exactly
    one complete tag, ("partial", None) when it may still become one, else ("fail", None)."""
    n = len(buf)
    if n <= len(_PROMISE):
        return ("partial" if _PROMISE.startswith(buf) else "fail"), None
    if not buf.startswith(_PROMISE):
        return "fail", None
    i = len(_PROMISE)
    attrs: dict[str, str] = {}
    while True:
        j = i
        while j < n and buf[j] in _WS:
            j += 1
        if j == n:
            return "partial", None
        if buf[j] == "/":
            if len(attrs) != len(_ATTRS):
                return "fail", None
            if j + 1 == n:
                return "partial", None
            if buf[j + 1] == ">" and j + 2 == n:
                return "done", Promise(topic=attrs["topic"], tokens=int(attrs["tokens"]), raw=buf)
            return "fail", None
        if j == i:  # an attribute must follow whitespace
            return "fail", None
        k = j
        while k < n and buf[k].isalpha():
            k += 1
        name = buf[j:k]
        if k == n:
            ok = any(a.startswith(name) and a not in attrs for a in _ATTRS)
            return ("partial" if ok else "fail"), None
        if name not in _ATTRS or name in attrs or buf[k] != "=":
            return "fail", None
        k += 1
        if k == n:
            return "partial", None
        quote = buf[k]
        if quote not in "\"'":
            return "fail", None
        k += 1
        start = k
        while k < n and buf[k] != quote:
            k += 1
        value = buf[start:k]
        if name == "tokens":
            if not value.isdigit() and value != "":
                return "fail", None
            if len(value) > MAX_TOKENS_DIGITS:
                return "fail", None
        elif any(c in "<>\n" for c in value):
            return "fail", None
        if k == n:
            return "partial", None
        if name == "tokens" and value == "":
            return "fail", None
        attrs[name] = value
        i = k + 1


def _scan(buf: str) -> tuple[str, Tag | None]:
    """Classify a buffer that starts with '<': a complete tag, a viable prefix, or not a tag."""
    if len(buf) > MAX_TAG_CHARS:
        return "fail", None
    st1, tag = _scan_literal(buf)
    if st1 == "done":
        return st1, tag
    st2, tag = _scan_promise(buf)
    if st2 == "done":
        return st2, tag
    return ("partial" if "partial" in (st1, st2) else "fail"), None


# --------------------------------------------------------------------------- parser


@dataclass(slots=True)
class TagParser:
    """Incremental PASTA-LANG tokenizer-independent parser.

    Feed it the text of each decoded token (or a special-token id, mapped through
    ``special_tokens``); it returns the items completed by that piece, in order. Text is
    emitted as soon as it can no longer be part of a tag, so a partial tag at the end of a
    piece is held back until a later piece decides it. Parsing is per character: the items
    of a string cut into any pieces equal those of the whole string (up to how :class:`Text`
    runs are split), which the test suite fuzzes.

    Args:
        special_tokens: optional map from added special-token id to its text (e.g.
            ``{49153: "<sync/>"}``) for :meth:`feed` calls that pass an ``int``.
    """

    special_tokens: Mapping[int, str] = field(default_factory=dict)
    _buf: str = ""
    _count: int = 0  # characters consumed

    def feed(self, piece: str | int) -> list[Parsed]:
        """Consume one piece (text, or a special-token id). Returns the completed items.

        Raises KeyError for an ``int`` piece that is not in ``special_tokens``."""
        text = self.special_tokens[piece] if isinstance(piece, int) else piece
        out: list[Parsed] = []
        i, n = 0, len(text)
        while i < n:
            if not self._buf:
                # fast path: text up to the next '<' cannot be part of a tag
                j = text.find("<", i)
                if j < 0:
                    out.append(Text(text[i:]))
                    self._count += n - i
                    break
                if j > i:
                    out.append(Text(text[i:j]))
                    self._count += j - i
                    i = j
            self._push(text[i], out, self._count)
            self._count += 1
            i += 1
        return out if len(out) < 2 else _merge_text(out)

    def feed_plain(self, text: str) -> bool:
        """Consume ``text`` when it is all text: no ``<`` in it and no partial tag held back
        (what :meth:`feed` would return as one :class:`Text`, or nothing for ``""``); returns
        True then. Otherwise consumes nothing and returns False (call :meth:`feed`)."""
        if self._buf or "<" in text:
            return False
        self._count += len(text)
        return True

    def finish(self) -> list[Parsed]:
        """End of stream: a held-back partial tag becomes text (and a Malformed diagnostic
        when it began like a PASTA-LANG tag)."""
        out: list[Parsed] = []
        if self._buf:
            buf, self._buf = self._buf, ""
            self._fail(buf, out, "unterminated tag at end of text", self._count - 1)
        return _merge_text(out)

    @property
    def pending(self) -> str:
        """Characters held back because they may still become a tag."""
        return self._buf

    def _push(self, ch: str, out: list[Parsed], at: int) -> None:
        """Consume character ``ch`` found at offset ``at`` of the input."""
        if not self._buf:
            if ch == "<":
                self._buf = ch
            else:
                out.append(Text(ch))
            return
        buf = self._buf + ch
        status, tag = _scan(buf)
        if status == "done":
            self._buf = ""
            out.append(replace(tag, end=at + 1))
        elif status == "partial":
            self._buf = buf
        else:
            self._buf = ""
            self._fail(buf, out, "malformed tag", at)

    def _fail(self, buf: str, out: list[Parsed], reason: str, at: int) -> None:
        # buf[0] is '<' and buf[:-1] was a viable prefix; emit text up to the next '<' and
        # re-scan the rest (it may hold the start of a real tag, e.g. "<prom<sync/>").
        if buf.startswith(_KNOWN_HEADS):
            out.append(Malformed(raw=buf, reason=reason))
        nxt = buf.find("<", 1)
        if nxt < 0:
            out.append(Text(buf))
            return
        out.append(Text(buf[:nxt]))
        first = at - (len(buf) - 1)  # input offset of buf[0]
        for k in range(nxt, len(buf)):
            self._push(buf[k], out, first + k)


def _merge_text(items: list[Parsed]) -> list[Parsed]:
    merged: list[Parsed] = []
    for e in items:
        if isinstance(e, Text) and merged and isinstance(merged[-1], Text):
            merged[-1] = Text(merged[-1].text + e.text)
        elif not (isinstance(e, Text) and e.text == ""):
            merged.append(e)
    return merged


def parse(pieces: str | Iterable[str | int], special_tokens: Mapping[int, str] | None = None) -> list[Parsed]:
    """Parse a whole string (or a sequence of pieces) into items, text runs merged."""
    p = TagParser(special_tokens=dict(special_tokens or {}))
    items: list[Parsed] = []
    for piece in [pieces] if isinstance(pieces, str) else pieces:
        items.extend(p.feed(piece))
    items.extend(p.finish())
    return _merge_text(items)


def strip_tags(text: str) -> str:
    """The clean response: ``text`` with every well-formed PASTA-LANG tag removed.

    Malformed tags stay as text, so no non-tag character is lost."""
    return "".join(e.text for e in parse(text) if isinstance(e, Text))


# --------------------------------------------------------------------------- threads


@dataclass
class Chunk:
    """One promise of an annotated response and the chunk spliced after it.

    ``content`` is the text between ``<async>`` and ``</async>`` (``None`` when the promise
    has no chunk); ``closed`` is False for a chunk that runs to the end of the text."""

    topic: str
    tokens: int
    content: str | None
    closed: bool = True


@dataclass
class Threads:
    """An annotated response split into what each thread wrote.

    ``main`` is the main thread's text: the response without the ``<async>..</async>``
    chunks (promise and sync tags kept verbatim). ``chunks[i]`` belongs to the i-th promise
    tag in ``main``. Whitespace between a promise and its ``<async>`` stays in ``main``."""

    main: str
    chunks: list[Chunk]
    diagnostics: list[str] = field(default_factory=list)


def split_threads(annotated: str, lead_whitespace: str = "main") -> Threads:
    """Split an annotated response into the main thread's text and each promise's chunk.

    A chunk belongs to the promise right before it: ``<async>`` opens a chunk only when the
    main text since the last promise is whitespace and that promise has no chunk yet. Inside
    a chunk every tag but ``</async>`` is text (no nesting). Stray tags are text and noted in
    ``diagnostics``. Never raises on content.

    Args:
        annotated: the annotated response.
        lead_whitespace: where whitespace between a promise and its ``<async>`` goes:
            ``"main"`` (stays in the main thread's text, after the promise) or ``"chunk"`` (the
            chunk's content starts with it; the canonical form replay decodes, in which the
            chunk follows its promise directly, so the clean text keeps the whitespace where
            it was)."""
    if lead_whitespace not in ("main", "chunk"):
        raise ValueError(f"lead_whitespace must be 'main' or 'chunk', got {lead_whitespace!r}")
    main: list[str] = []
    chunks: list[Chunk] = []
    diags: list[str] = []
    open_chunk: list[str] | None = None
    lead: str | None = None  # whitespace since the last chunkless promise, not placed yet

    def place_lead() -> None:
        nonlocal lead
        if lead:
            main.append(lead)
        lead = None

    for e in parse(annotated):
        if open_chunk is not None:
            if isinstance(e, AsyncClose):
                chunks[-1].content = "".join(open_chunk)
                open_chunk = None
            elif isinstance(e, Malformed):
                diags.append(f"malformed tag inside a chunk kept as text: {e.raw!r}")
            else:
                if not isinstance(e, Text):
                    diags.append(f"tag inside a chunk kept as text: {e.raw!r}")
                open_chunk.append(e.text if isinstance(e, Text) else e.raw)
            continue
        if isinstance(e, Promise):
            place_lead()
            main.append(e.raw)
            chunks.append(Chunk(topic=e.topic, tokens=e.tokens, content=None))
            lead = ""
        elif isinstance(e, AsyncOpen) and lead is not None:
            open_chunk = []
            if lead_whitespace == "chunk":
                open_chunk.append(lead)
                lead = None
            else:
                place_lead()
        elif isinstance(e, Text):
            if lead is not None and e.text.strip() == "":
                lead += e.text
            else:
                place_lead()
                main.append(e.text)
        elif isinstance(e, Malformed):
            diags.append(f"malformed tag kept as text: {e.raw!r}")
        else:
            if isinstance(e, (AsyncOpen, AsyncClose)):
                diags.append(f"{e.raw} without a promise right before it kept as text")
            place_lead()
            main.append(e.raw)
    place_lead()
    if open_chunk is not None:
        chunks[-1].content = "".join(open_chunk)
        chunks[-1].closed = False
        diags.append("last chunk has no </async>")
    return Threads(main="".join(main), chunks=chunks, diagnostics=diags)


def splice(main: str, chunks: Sequence[Chunk | str | None]) -> str:
    """Put each chunk right after its promise in the main thread's text.

    Args:
        main: the main thread's text; its i-th well-formed promise tag owns ``chunks[i]``.
        chunks: a :class:`Chunk`, the chunk's content string, or None (no chunk) per promise.

    Returns the annotated response, ``<async>content</async>`` after each promise (an unclosed
    :class:`Chunk` gets no ``</async>``). Raises ValueError when ``main`` has fewer promises
    than ``chunks``. ``splice(t.main, t.chunks)`` inverts :func:`split_threads` on
    well-formed input where chunks follow their promises directly."""
    out: list[str] = []
    i = 0
    for e in parse(main):
        if isinstance(e, Malformed):
            continue
        out.append(e.text if isinstance(e, Text) else e.raw)
        if isinstance(e, Promise):
            if i < len(chunks) and chunks[i] is not None:
                c = chunks[i]
                content = c.content if isinstance(c, Chunk) else c
                closed = c.closed if isinstance(c, Chunk) else True
                if content is not None:
                    out.append(ASYNC_OPEN + content + (ASYNC_CLOSE if closed else ""))
            i += 1
    if i < len(chunks):
        raise ValueError(f"main text has {i} promise tags but {len(chunks)} chunks were given")
    return "".join(out)
