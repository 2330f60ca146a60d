"""PASTA-LANG tags: the incremental parser and whole-response helpers (no tokenizer, no torch).

Tags (docs/DESIGN.md section 2; Jin et al., ICML 2025, arXiv 2502.11517, section 3):

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

Text that began like a tag but is not one is :class:`TagText` (a :class:`Text`: it is part of
what the model wrote, but a reader never sees it). The line between tag-like text and plain
text that merely holds a ``<`` is the known tag heads ``<promise``, ``<async``, ``</async`` and
``<sync``:

* a would-be tag that got at least as far as a known head and then broke (a malformed tag) is
  tag-like from its ``<`` through the next ``>`` (included), stopping before a line break or the
  next ``<`` and after at most :data:`MAX_TAG_CHARS` characters past the point it broke (so
  ``<promise topic="t" tokens="N"/>`` is tag-like as a whole, and so is
  ``<promise topic="an unclosed topic`` up to its line break); a promise whose topic broke on a
  line break or an angle bracket is tag-like through its ``/>`` when the rest of the tag follows
  (``<promise topic="a\nb" tokens="3"/>`` as a whole: the parser holds that rest back until it
  closes the tag or cannot, or until it reaches a known tag head, and then reads it by the rule
  before; a tag in it is a tag, read when its last character arrives:
  ``<promise topic="a<sync/>`` is tag-like text, then a sync);
* a partial tag that a ``<`` cut short (``<pro<sync/>``, ``<sy</async>``) is tag-like when what
  that ``<`` starts is a tag or tag-like, ``</async>`` included (else both are text: ``a <<b``);
  a lone ``<`` never is: the model's ``<`` right before a tag (``x <<sync/>``, ``a <`` then the
  ``<promise topic="`` piece) is text and stays in the clean text, and the text after the
  left-out tag that would complete it into tag text (``sync/>`` in ``x <<sync/>sync/>``) is
  left out of the clean text instead (:func:`drop_empty_items`: nothing the model wrote is lost,
  no tag text reaches a reader);
* a would-be tag still held back when the text ends (a partial tag at a length cut or end of
  sequence) is tag-like when it got as far as a known head (``<promise topic="x" tokens="1``,
  ``<sync/``);
* anything else is plain text: ``a < b``, ``x <3``, ``<div>``, ``</b>``, and ``<prom`` or
  ``<asy`` that stop short of a known head (at the end of a text too).

Whole-response helpers: :func:`clean_text` (the clean response a reader sees),
:func:`strip_tags` (the response without its well-formed tags, every other character kept: the
inverse of annotating), :func:`split_threads` (an annotated response into the main thread's text
and each promise's chunk) and :func:`splice` (the inverse).

What the parser emits are the events every dialect's parser emits, defined with the dialect
protocol in :mod:`pasta_engine.lang.dialect` (:class:`Text`, :class:`TagText`, :class:`Promise`,
:class:`AsyncOpen`, :class:`AsyncClose`, :class:`Sync`, :class:`Malformed`) and importable from
here too. PASTA-LANG as a dialect (what its tags mean to the engine) is
:mod:`pasta_engine.lang.pasta`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace
from typing import Callable, Iterable, Mapping, Sequence

from .dialect import (AsyncClose, AsyncOpen, Chunk, Malformed, Parsed, Promise, Rejoin, Sync, TagText, Text, Threads,
                      source_text)

__all__ = [
    "Text",
    "TagText",
    "Promise",
    "AsyncOpen",
    "AsyncClose",
    "Sync",
    "Malformed",
    "Parsed",
    "TagParser",
    "parse",
    "strip_tags",
    "clean_text",
    "clean_from_items",
    "thread_text",
    "drop_empty_items",
    "left_out_broken",
    "PASTA_REJOIN",
    "held_line_start",
    "is_empty_list_item",
    "split_threads",
    "splice",
    "promise_tag",
    "ASYNC_OPEN",
    "ASYNC_CLOSE",
    "SYNC",
    "MAX_TAG_CHARS",
]

#: PASTA-LANG's fixed tags (the default ``raw`` of the shared events that stand for them).
ASYNC_OPEN, ASYNC_CLOSE, SYNC = AsyncOpen.raw, AsyncClose.raw, Sync.raw

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
# Characters a topic may not hold; a promise broken by one inside its topic is left out whole
# when the rest of it follows (``<promise topic="a\nb" tokens="3"/>``).
_TOPIC_BREAKS = "<>\n"
_TOPIC_OPEN = re.compile(r"""\btopic\s*=\s*(["'])[^"'<>\n]*\Z""")


#: PASTA-LANG's tags as events.
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
    piece is held back until a later piece decides it. Text that began like a tag and is not
    one comes out as :class:`TagText` (with a :class:`Malformed` diagnostic before it); after a
    malformed tag the parser goes on marking characters tag-like through the next ``>`` (see
    the module docstring). Parsing is per character: the items of a string cut into any pieces
    equal those of the whole string (up to how text runs of one kind are split), which the test
    suite fuzzes.

    Args:
        special_tokens: optional map from added special-token id to its text (e.g.
            ``{49153: "<sync/>"}``) for :meth:`feed` calls that pass an ``int``.
    """

    special_tokens: Mapping[int, str] = field(default_factory=dict)
    _buf: str = ""
    _broken: list[str] = field(default_factory=list)  # partial tags a '<' broke, held until what that '<'
    # starts is decided (only while _buf holds it)
    _count: int = 0  # characters consumed
    _junk: int = 0  # after a malformed tag: characters it may still run on (0: none)
    # after a promise broke inside its topic on '\n', '<' or '>': the broken tag (``prefix``,
    # the topic's quote) and the characters held since, with the offset of the first
    _tail: tuple[str, str] | None = None
    _tail_text: str = ""
    _tail_at: int = 0

    def feed(self, piece: str | int) -> list[Parsed]:
        """Consume one piece (text, or a special-token id). Returns the completed items.

        Raises KeyError for an ``int`` piece that is not in ``special_tokens``."""
        text = self.special_tokens[piece] if isinstance(piece, int) else piece
        out: list[Parsed] = []
        i, n = 0, len(text)
        while i < n:
            if not self._buf and not self._junk and self._tail is None:
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
        if self._buf or self._junk or self._tail is not None or "<" in text:
            return False
        self._count += len(text)
        return True

    def finish(self) -> list[Parsed]:
        """End of stream: a held-back partial tag becomes :class:`TagText` with a Malformed
        diagnostic when it got as far as a known tag head (``<promise topic="x" tokens="1``),
        else plain :class:`Text` (``<``, ``<prom``)."""
        out: list[Parsed] = []
        if self._tail is not None:  # the topic's tail never closed the tag: read as before
            self._release_tail(out)
        self._junk = 0
        buf, self._buf = self._buf, ""
        if buf.startswith(_KNOWN_HEADS):  # tag-like: what a '<' broke before it goes too, as mid-text
            self._left_out(out)
            out += [Malformed(raw=buf, reason="unterminated tag at end of text"), TagText(buf)]
        else:
            self._flush_broken(out)
            if buf:
                out.append(Text(buf))
        return out

    @property
    def pending(self) -> str:
        """Characters held back because they may still become a tag (or be left out with one)."""
        return "".join(self._broken) + self._buf + self._tail_text

    def _push(self, ch: str, out: list[Parsed], at: int) -> None:
        """Consume character ``ch`` found at offset ``at`` of the input."""
        if self._tail is not None:
            self._push_tail(ch, out)
            return
        if not self._buf:
            if self._junk:  # the rest of a malformed tag, through its '>'
                if ch != "<" and ch != "\n":
                    out.append(TagText(ch))
                    self._junk = 0 if ch == ">" else self._junk - 1
                    return
                self._junk = 0
            if ch == "<":
                self._buf = ch
            else:
                out.append(Text(ch))
            return
        buf = self._buf + ch
        status, tag = _scan(buf)
        if status == "done":
            self._buf = ""
            # what a '<' broke goes with the tag, ``</async>`` included: kept as text, it would meet
            # the text after the tag ("<sy</async>nc/>" would show "<sync/>"; a chunk the
            # interpreter closes is read with the ``</async>`` the annotated text gets); a lone
            # '<' stays text (_left_out)
            self._left_out(out)
            out.append(replace(tag, end=at + 1))
        elif status == "partial":
            self._buf = buf
        else:
            # buf[:-1] was a viable prefix (it holds no '<' after its first character: no tag
            # grammar allows one) and ``ch`` broke it; ``ch`` is read again on its own (it may
            # start a real tag, e.g. "<prom<sync/>")
            self._buf = ""
            prefix = buf[:-1]
            if prefix.startswith(_KNOWN_HEADS):
                self._left_out(out)
                out.append(Malformed(raw=buf, reason="malformed tag"))
                out.append(TagText(prefix))
                self._junk = MAX_TAG_CHARS
                topic = _TOPIC_OPEN.search(prefix) if ch in _TOPIC_BREAKS else None
                if topic is not None:
                    # a topic broken by a line break or an angle bracket: the rest of the tag
                    # (``…" tokens="N"/>``) is held until it closes the tag or cannot
                    self._tail, self._tail_text, self._tail_at = (prefix, topic.group(1)), "", at
                    self._push_tail(ch, out)
                    return
            elif ch == "<":
                # "<pro" broken by a '<': if that '<' starts a tag (or tag-like text), the two
                # must not meet again once it is left out ("<pro<sync/>mise ..." would read as
                # "<promise ...") and "<pro" goes with it; else both are text ("a <<b")
                self._broken.append(prefix)
            else:
                out.append(Text("".join(self._broken) + prefix))
                self._broken = []
            self._push(ch, out, at)

    def _push_tail(self, ch: str, out: list[Parsed]) -> None:
        """Hold ``ch`` as part of a broken topic's tail. The tail is tag-like (left out with its
        promise) once the promise with the topic's bad characters blanked out scans as complete;
        when it no longer can, or once it ends with a known tag head (``<sync``, ``</async``:
        a tag, not topic text), the held characters are read again as they were before (the
        rest of a malformed tag, :attr:`_junk`). So a tail read again holds no whole tag: every
        tag is reported with the piece that completes it."""
        prefix, quote = self._tail
        tail = self._tail_text + ch
        if tail.endswith(_KNOWN_HEADS):
            # a tag's head is no topic text: the tail is read now, so a tag it starts is read (and
            # acted on) when its last character arrives, not when a longer tail fails tokens later
            self._tail_text = tail
            self._release_tail(out)
            return
        end = tail.find(quote)
        topic_rest = tail if end < 0 else tail[:end]
        blanked = "".join(" " if c in _TOPIC_BREAKS else c for c in topic_rest) + ("" if end < 0 else tail[end:])
        status, _ = _scan(prefix + blanked)
        if status == "done":
            self._tail, self._tail_text = None, ""
            self._junk = 0
            out.append(TagText(tail))
        elif status == "partial":
            self._tail_text = tail
        else:
            self._tail_text = tail
            self._release_tail(out)

    def _release_tail(self, out: list[Parsed]) -> None:
        """Read the held tail again as the rest of a malformed tag (what it was before it was
        held): tag-like through a ``>``, stopping at a line break or ``<``."""
        held, at = self._tail_text, self._tail_at
        self._tail, self._tail_text = None, ""
        self._junk = MAX_TAG_CHARS
        for k, c in enumerate(held):
            self._push(c, out, at + k)

    def _flush_broken(self, out: list[Parsed]) -> None:
        if self._broken:
            out.append(Text("".join(self._broken)))
            self._broken = []

    def _left_out(self, out: list[Parsed]) -> None:
        """What a '<' broke goes out as tag-like text, since what that '<' started is left out;
        but a lone ``<`` is the model's text (``a <`` then a tag: a less-than sign, never
        tag-like), and so is every partial tag a ``<`` broke before it (what that ``<`` started,
        the lone ``<``, is text): ``x <<sync/>`` keeps ``x <``, ``<pro<<sync/>`` keeps
        ``<pro<``, ``<<sy<sync/>`` keeps ``<`` and leaves ``<sy`` out. Text after the tag that
        would complete the kept ``<`` into tag text is left out of the clean text instead
        (:func:`drop_empty_items`)."""
        if self._broken:
            broken, self._broken = self._broken, []
            left_out_broken(broken, "<", "partial tag cut short by a tag", out)


def left_out_broken(broken: Sequence[str], opener: str, reason: str, out: list[Parsed]) -> None:
    """Emit onto ``out`` what an incremental parser held as ``broken`` (partial tags, or lone
    ``opener`` characters, each cut short by the next ``opener``) once the tag the last one
    started is left out: everything up to the last lone ``opener`` is the model's text, the
    rest is tag-like text (a ``Malformed`` diagnostic with ``reason``, then ``TagText``). The
    rule :class:`TagParser` (``<``) and :class:`~pasta_engine.lang.apar.AparParser` (``[``)
    share. Raises nothing."""
    lone = max((k for k, b in enumerate(broken) if b == opener), default=-1)
    if lone >= 0:
        out.append(Text("".join(broken[: lone + 1])))
    rest = "".join(broken[lone + 1:])
    if rest:
        out.append(Malformed(raw=rest, reason=reason))
        out.append(TagText(rest))


#: PASTA-LANG's :class:`~pasta_engine.lang.dialect.Rejoin`: a kept lone ``<`` and the text after a
#: drop read by :class:`TagParser`, a drop read as ``<sync/>`` (the default of every function
#: here that takes ``rejoin``, and of :attr:`BaseDialect.rejoin <pasta_engine.lang.dialect.BaseDialect>`).
PASTA_REJOIN = Rejoin("<", TagParser, Sync.raw)


def _merge_text(items: list[Parsed]) -> list[Parsed]:
    """Adjacent text of one kind (:class:`Text` or :class:`TagText`) merged, empty text dropped
    (each run joined once: linear in the text, also for a million one-character items)."""
    merged: list[Parsed] = []
    run: list[str] = []
    kind: type | None = None
    for e in items:
        if isinstance(e, Text):
            if not e.text:
                continue
            if type(e) is kind:
                run.append(e.text)
                continue
            if run:
                merged.append(kind(run[0] if len(run) == 1 else "".join(run)))
            run, kind = [e.text], type(e)
            continue
        if run:
            merged.append(kind(run[0] if len(run) == 1 else "".join(run)))
            run, kind = [], None
        merged.append(e)
    if run:
        merged.append(kind(run[0] if len(run) == 1 else "".join(run)))
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
    """``text`` with every well-formed PASTA-LANG tag removed, every other character kept
    (malformed and partial tags included): the inverse of annotating a response, which only
    inserts tags. What a reader is shown is :func:`clean_text`; the two agree on text whose tags
    are all well-formed and that has no list item left empty by a tag."""
    return "".join(e.text for e in parse(text) if isinstance(e, Text))


# One list marker: "-", "*", "+", "•", "1.", "2)".
_ONE_MARKER = r"(?:[-*+\u2022]|[0-9]{1,9}[.)])"
# A line that is only list markers ("- ", "1. ", "• ", or nested ones: "- 1) ", "1. 1. "),
# indentation and spaces allowed.
_MARKER_LINE = re.compile(rf"[ \t\r]*{_ONE_MARKER}(?:[ \t\r]+{_ONE_MARKER})*[ \t\r]*")
# A line that may still become one (every prefix of a _MARKER_LINE, the empty line included).
_MARKER_START = re.compile(rf"[ \t\r]*(?:{_ONE_MARKER}[ \t\r]+)*(?:{_ONE_MARKER}[ \t\r]*|[0-9]{{1,9}})?")
# A number and its "." or ")" right before a drop (with search's endpos): text a tag followed
# ("1949.</async>"), which drop_empty_items keeps; a marker a tag emptied has a space first.
_NUMBER_RIGHT_BEFORE = re.compile(r"[0-9][.)]\Z")
# A thematic break ("---", "* * *", "___"): a line of markers that is no list item.
_THEMATIC_BREAK = re.compile(r"[ \t\r]*([-*_])(?:[ \t\r]*\1){2,}[ \t\r]*")


def is_empty_list_item(line: str) -> bool:
    """Whether ``line`` (one line, no line break) is a list item with nothing in it: only list
    markers (``-``, ``*``, ``+``, ``•``, ``1.``, ``1)``, or nested ones such as ``- 1)`` or
    ``1. 1.``), spaces and tabs around them allowed, and not a thematic break (``---``,
    ``* * *``). The one definition the clean text (:func:`drop_empty_items`) and the quality
    proxies (:func:`pasta_engine.metrics.empty_list_items`) share."""
    return bool(_MARKER_LINE.fullmatch(line)) and not _THEMATIC_BREAK.fullmatch(line)


def held_line_start(text: str) -> int:
    """Where the last line of ``text`` starts when that line may still become an empty list
    item (it is empty, or spaces and the start of a list marker), else ``len(text)``: a text
    that may still grow shows nothing from there on."""
    last = text.rfind("\n") + 1
    return last if _MARKER_START.fullmatch(text, last) else len(text)


def drop_empty_items(text: str, drops: Iterable[int], final: bool = True, rejoin: Rejoin | None = None) -> str:
    """``text`` without the list items that something left out of it has emptied.

    A line of ``text`` (its characters between line breaks) that is an empty list item
    (:func:`is_empty_list_item`: only list markers, nested ones too) and holds a drop
    offset (``d`` with ``start <= d <= end`` of the line, ``end`` being its line break) goes,
    with its line break. A list item the model left empty by itself (no drop in its line) stays,
    and so does a line whose drops all come right after a number and its ``.`` or ``)``: that
    is text the tag followed (``1949.</async>``, ``42.<sync/>``), not a marker the tag emptied
    (``1. <promise .../>``, ``- <sync/>``).

    First, text that would rejoin a kept lone ``<`` into tag text goes: where a ``<`` stands
    right before a drop (``x <<sync/>``: the model's ``<`` stays, the tag is left out), the
    text after the drop that, read after that ``<``, is a tag or tag-like text (``sync/>`` in
    ``x <<sync/>sync/>``, or at the start of the chunk spliced after ``a <<promise .../>``) is
    left out too, so a reader never sees ``<sync/>``; text that is not (``a <<sync/> b``) stays.
    Another dialect's opener and tags are its ``rejoin`` (APAR: ``[[Fork]Fork]`` shows ``[``).

    Args:
        text: a clean text.
        drops: offsets in ``text`` where something was left out of it (a tag, tag-like text).
        final: ``text`` is complete. False: it may still grow at its end, so its last line is
            held back (cut off) while it could still become an empty list item, and so is text
            after a kept ``<`` that may still become tag text; every line before it is decided
            for good (used to stream: what is returned is a prefix of what a longer text
            returns, as long as no drop lands before its last line).
        rejoin: the dialect's opener and parser (:class:`~pasta_engine.lang.dialect.Rejoin`);
            None: PASTA-LANG's (:data:`PASTA_REJOIN`).

    Returns the text a reader sees. Raises nothing for any text and drops (a drop past the end
    of ``text`` counts as at its end).
    """
    text, drops, hold = _cut_rejoined(text, drops, final, rejoin or PASTA_REJOIN)
    end = hold if hold is not None else len(text) if final else held_line_start(text)
    cuts: list[tuple[int, int]] = []
    seen: set[int] = set()
    for d in drops:
        s = text.rfind("\n", 0, d) + 1
        if s in seen or s >= end:
            continue
        e = text.find("\n", d)
        if e < 0:
            e = end
        if is_empty_list_item(text[s:e]) and not _NUMBER_RIGHT_BEFORE.search(text, s, min(d, e)):
            seen.add(s)
            cuts.append((s, min(e + 1, end)))
    if not cuts:
        return text if end == len(text) else text[:end]
    cuts.sort()
    return _without(text[:end], cuts)


def _cut_rejoined(text: str, drops: Iterable[int], final: bool,
                  rejoin: Rejoin = PASTA_REJOIN) -> tuple[str, Sequence[int], int | None]:
    """``text`` less the text after each kept lone ``<`` right before a drop that would read,
    after that ``<``, as a tag or tag-like text (the :class:`TagParser`'s rules, a drop read as a
    tag), repeated while a ``<`` stands before what was left out (``<<sync/>sync/>sync/>``
    shows ``<``). Returns the text, the drops moved to it (a cut is a drop: every cut starts at
    one), and where the text must be held back when not ``final`` (text after a kept ``<``
    that may still become tag text; None: nothing held). O(len(drops)) when no ``<`` stands
    before a drop. ``rejoin``: the dialect's opener and parser (PASTA-LANG's ``<`` and
    :class:`TagParser`, a drop read as ``<sync/>``)."""
    drops = drops if isinstance(drops, (list, tuple)) else list(drops)
    ds, cuts, hold = _rejoin_cuts(text, drops, final, rejoin)
    if not cuts:
        return text, ds, hold
    moved = _mover(cuts)
    return _without(text, cuts), [moved(o) for o in ds], None if hold is None else moved(hold)


def thread_text(text: str, drops: Sequence[int], final: bool, after_lt: bool = False,
                rejoin: Rejoin | None = None) -> tuple[str, Callable[[int], int]]:
    """One thread's clean text as a reader may see it on its own (the per-thread text of a
    stream): ``text`` less the text that would rejoin a kept lone ``<`` into tag text (as
    :func:`drop_empty_items` cuts it from the spliced text: ``x <<sync/>sync/> y`` shows
    ``x < y``), cut where it is held back when not ``final``.

    Args:
        text, drops: the thread's clean text and the offsets where tags were left out of it.
        final: the thread has ended (its text is complete).
        after_lt: the thread is a chunk whose promise stands right after a ``<`` of its
            parent's clean text: its text is read after that ``<`` and the promise
            (``a <<promise .../>`` then a chunk ``sync/> b`` shows `` b``); the dialect's
            opener for another dialect (``rejoin``).
        rejoin: the dialect's opener and parser; None: PASTA-LANG's (:data:`PASTA_REJOIN`).

    Returns the text and a function moving an offset of ``text`` to the returned text (an
    offset inside a cut goes to the cut's start; one past a hold stays past the returned
    text's end). O(len(drops)) when no ``<`` stands before a drop."""
    rejoin = rejoin or PASTA_REJOIN
    if after_lt:
        lead = rejoin.opener + text
        ds, cuts, hold = _rejoin_cuts(lead, [1] + [d + 1 for d in drops], final, rejoin)
        if not cuts and hold is None:
            return text, _same
        moved = _mover(cuts)
        out = _without(lead, cuts)[1:]
        if hold is not None:
            out = out[: moved(hold) - 1]
        return out, lambda o: moved(o + 1) - 1
    ds, cuts, hold = _rejoin_cuts(text, drops, final, rejoin)
    if not cuts and hold is None:
        return text, _same
    moved = _mover(cuts)
    out = _without(text, cuts)
    return (out if hold is None else out[: moved(hold)]), moved


def _same(o: int) -> int:
    return o


def _rejoin_cuts(text: str, drops: Sequence[int], final: bool,
                 rejoin: Rejoin) -> tuple[Sequence[int], list[tuple[int, int]], int | None]:
    """:func:`_cut_rejoined`'s work: the drops (sorted, each once, when the opener stands before
    one; else as given), the ``(start, end)`` spans to cut, and the hold offset (or None)."""
    n = len(text)
    opener = rejoin.opener
    if not any(0 < d <= n and text[d - 1] == opener for d in drops):  # the common case: as they are
        return drops, [], None
    ds = sorted({min(max(d, 0), n) for d in drops})
    marks = set(ds)
    cuts: list[tuple[int, int]] = []
    hold: int | None = None
    done_to = 0  # drops before this are inside a cut (or its restart point)
    for d in ds:
        if d < done_to or d == 0 or (d == done_to and cuts) or text[d - 1] != opener:
            continue
        at = d
        while True:
            end = _rejoined_end(text, at, marks, final, rejoin)
            if end is None:  # may still become tag text: hold the text from here
                hold = at
                break
            if end == at:  # text: the '<' meets it as text
                break
            cuts.append((at, end))
            at = done_to = end  # the '<' now stands before what was left out
        if hold is not None:
            break
    return ds, cuts, hold


def _without(text: str, cuts: Sequence[tuple[int, int]]) -> str:
    parts: list[str] = []
    prev = 0
    for s, e in cuts:
        parts.append(text[prev:s])
        prev = e
    parts.append(text[prev:])
    return "".join(parts)


def _mover(cuts: Sequence[tuple[int, int]]) -> Callable[[int], int]:
    """The offset of a text to the same place in it less ``cuts`` (sorted, disjoint spans)."""
    def moved(o: int) -> int:
        gone = 0
        for s, e in cuts:
            if o <= s:
                break
            gone += min(o, e) - s
        return o - gone

    return moved


def _rejoined_end(text: str, at: int, marks: set[int], final: bool, rejoin: Rejoin) -> int | None:
    """Where the tag or tag-like text that ``text[at:]`` forms after the opener (``<``) ends
    (``at`` when it forms none: the opener is text then), reading each offset in ``marks`` past
    ``at`` as a tag (``rejoin.mark``); None when not ``final`` and the end of ``text`` leaves it
    undecided."""
    p = rejoin.parser()
    p.feed(rejoin.opener)
    mark = rejoin.mark
    offsets = [at - 1]  # the text offset of each character fed, a mark's at its drop
    mark_at: set[int] = set()  # where in what is fed a mark starts
    run_end: int | None = None  # what is fed so far that is tag-like, from its start
    fed = 1
    seen = 0  # characters the items so far stand for

    def read(items: list[Parsed]) -> bool:
        """Take ``items``; True once the run that the '<' starts has ended."""
        nonlocal seen, run_end
        for e in items:
            if isinstance(e, Malformed):
                continue
            start = seen
            seen += len(e.text if isinstance(e, Text) else e.raw)
            if type(e) is Text or start in mark_at:
                if run_end is None:
                    run_end = 0  # the '<' itself is text
                return True
            run_end = seen
        return False

    j = at
    while j < len(text):
        if j in marks and j > at:
            mark_at.add(fed)
            offsets += [j] * len(mark)
            fed += len(mark)
            if read(p.feed(mark)):
                break
        offsets.append(j)
        fed += 1
        if read(p.feed(text[j])):
            break
        j += 1
    else:
        if not final:
            return None
        read(p.finish())
    if not run_end:
        return at
    return offsets[run_end] if run_end < len(offsets) else len(text)


def clean_text(annotated: str) -> str:
    """The clean response a reader sees: ``annotated`` without its tags and without tag-like
    text (:class:`TagText`: a malformed tag, a partial tag at the end), and without the list
    items that leaving them out emptied (:func:`drop_empty_items`: ``- <promise .../>`` written
    inside a chunk leaves no bare ``- `` line). A function of the whole string: the engine's
    result ``text`` is ``clean_text(annotated_text)``, and the interpreter's clean text and the
    streamed deltas end equal to it."""
    return clean_from_items(parse(annotated))


def clean_from_items(items: Iterable[Parsed], rejoin: Rejoin | None = None) -> str:
    """The clean text of a parsed response (any dialect's items, :mod:`pasta_engine.lang.dialect`):
    its :class:`Text` runs, less the list items that the other items (tags, tag-like text) left
    empty and the text that would rejoin a kept lone opener into tag text
    (:func:`drop_empty_items`; ``rejoin``: the dialect's opener and parser, None for
    PASTA-LANG's). Diagnostics (:class:`Malformed`) take no place."""
    parts: list[str] = []
    drops: list[int] = []
    n = 0
    for e in items:
        if type(e) is Text:
            parts.append(e.text)
            n += len(e.text)
        elif not isinstance(e, Malformed):
            drops.append(n)
    return drop_empty_items("".join(parts), drops, rejoin=rejoin)


# --------------------------------------------------------------------------- threads


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
        out.append(source_text(e))
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
