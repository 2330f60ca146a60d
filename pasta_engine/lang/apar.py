"""APAR as a dialect: fork after a list item's header, the item's body in a child (no torch).

APAR (Liu et al. 2024, "APAR: LLMs Can Do Auto-Parallel Auto-Regressive Decoding", arXiv
2401.06761, section 3) teaches a model to write a fork token (the paper's ``[Fork]``) where a
list item's header ends. Decoding forks there: a child thread starts from the context up to and
including the fork token, gets a child token (``[Child]``) inserted, and writes the item's body;
the parent does not wait, it goes on with the next item's header. Every child joins at the end of
the response: there is no join marker (the main thread's end is the engine's implicit join).

Syntax (docs/DESIGN.md section 2, "Dialects", APAR):

``[Fork]``
    written by the main thread after an item's header: fork here (a :class:`~.dialect.Promise`
    with no topic and no predicted length: ``Promise(topic="", tokens=0)``).
``[Child]``
    inserted by the interpreter as the child's first token(s) (:class:`~.dialect.AsyncOpen`).
``[/Child]``
    written by the child where the item's body ends (:class:`~.dialect.AsyncClose`). This marker is
    the dialect's choice: in the paper's released data a child ends at end-of-sequence, which
    the engine also accepts (the interpreter then closes the child, and notes it); a text
    marker lets a trace say where a body ends, so replay and training can force it.

The markers are plain text (a tokenizer that has them as added tokens encodes each as one
token: :func:`~pasta_engine.lang.tokenization.encode_tag`). The clean text a reader sees is the
annotated text without the markers: each item's header followed by its child's body, in order.

What is a marker and what is text (the line the parser draws, character by character):

* ``[Fork]``, ``[Child]`` and ``[/Child]`` exactly (case-sensitive) are markers;
* a would-be marker that got as far as a head (``[Fork``, ``[Child``, ``[/Child``) and then broke
  on a character that is not a word character (``[Fork ]``, ``[Child}``, ``[Fork\\n``) is
  malformed: tag-like text (:class:`~pasta_engine.lang.dialect.TagText`, never in the clean text,
  kept in the annotated text, with a :class:`~pasta_engine.lang.dialect.Malformed` diagnostic) from
  its ``[`` through the next ``]``, stopping before a line break or the next ``[`` and after at
  most :data:`MAX_MARKER_JUNK` characters;
* a head followed by a letter, digit, ``_`` or ``-`` is a word, and text (``[Forklift]``,
  ``[Children]``); so is anything that stops short of a head (``[1]``, ``[For``, ``[/b]``);
* a partial marker that a ``[`` cut short (``[Fo[Fork]``, ``[/Chi[Fork]``) is tag-like when what
  that ``[`` starts is a marker or tag-like (else both are text: ``[a[b``), as PASTA-LANG's
  partial tags are (:class:`~pasta_engine.lang.tags.TagParser`): kept as text it would meet the
  text after the left-out marker (``[Fo[Fork]rk]`` would show ``[Fork]``). A lone ``[`` never is:
  the model's ``[`` right before a marker (``x [[Fork]``) stays in the clean text, and the text
  after the marker that would complete it into a marker (``Fork]`` in ``[[Fork]Fork]``) is left
  out of the clean text instead (:data:`APAR_REJOIN`,
  :func:`~pasta_engine.lang.tags.drop_empty_items`);
* a head still held back when the text ends (a partial marker at a length cut or end of
  sequence: ``[Fork``, ``[/Child``) is tag-like; a shorter prefix (``[Fo``) is text.

Positions (:meth:`AparDialect.reserved_positions`): the child's start right after the fork
marker. The paper's decoder copies the sequence at a fork, so parent and child continue from the
same position (the engine's ``none`` policy). Since APAR predicts no length, the default
``predicted`` policy reserves a fixed :attr:`AparDialect.reserve` positions (plus the markers)
for each child; ``constant:K``, ``none`` and ``oracle`` mean what they mean for PASTA-LANG.
"""

from __future__ import annotations

from typing import Any, Collection, Sequence

from .dialect import (AsyncClose, AsyncOpen, BaseDialect, Chunk, Malformed, Parsed, Promise, Rejoin, TagText, Text,
                      Threads, policy_reserve, register_dialect, source_text)
from .grammar import GrammarState
from .prompts import PastaPrompt
from .tags import clean_from_items, left_out_broken

__all__ = ["AparDialect", "AparParser", "APAR", "APAR_PROMPT", "APAR_REJOIN", "FORK", "CHILD", "CHILD_CLOSE",
           "DEFAULT_RESERVE", "MAX_MARKER_JUNK"]

#: The paper's ``[Fork]``: the main thread forks after it.
FORK = "[Fork]"
#: The paper's ``[Child]``: inserted as a child's first token(s).
CHILD = "[Child]"
#: Where a child's body ends (this dialect's marker; see the module docstring).
CHILD_CLOSE = "[/Child]"
#: Positions the main thread skips per fork under the ``predicted`` policy (plus the markers).
DEFAULT_RESERVE = 64
#: After a malformed marker, at most this many further characters are tag-like (through ``]``).
MAX_MARKER_JUNK = 16

#: The prompt that teaches an un-finetuned instruct model APAR (a request in this dialect gets it
#: instead of the engine's PASTA-LANG prompt: :meth:`AparDialect.prompt`). As PASTA-LANG's,
#: its example is what the main thread writes and sees: headers each ending in ``[Fork]``; the
#: bodies are written by the children, after ``[Child]``.
APAR_PROMPT = PastaPrompt(
    system=(f"You are a helpful assistant. When a list has independent items, write each item's short "
            f"header and then {FORK} instead of the item's body. Each body is then written in parallel: it "
            f"starts after {CHILD} and ends with {CHILD_CLOSE}, for example: {CHILD}: go to bed at the same "
            f"time every day.{CHILD_CLOSE} After the last header, finish the answer."),
    examples=((
        "Give me three tips for better sleep.",
        f"Here are three tips for better sleep:\n1. **Regular schedule**{FORK}\n2. **No screens**{FORK}\n"
        f"3. **A quiet, dark room**{FORK}\nThese habits will help you sleep better.",
    ),),
)

_MARKERS = {FORK: "fork", CHILD: "open", CHILD_CLOSE: "close"}
_HEADS = tuple(m[:-1] for m in _MARKERS)  # "[Fork", "[Child", "[/Child"


def _word_char(ch: str) -> bool:
    return ch.isalnum() or ch in "_-"


class AparParser:
    """Incremental parser of one thread's APAR text (the :class:`~.dialect.TextParser`
    protocol): fed each decoded token's text, it returns the items completed, per character (a
    marker split across pieces is held back until decided), never raises on content and never
    drops a character (the text it emits plus the markers' ``raw`` equal its input)."""

    __slots__ = ("_buf", "_broken", "_count", "_junk")

    def __init__(self) -> None:
        self._buf = ""  # a would-be marker held back (starts with "[")
        # partial markers a "[" cut short, held until what that "[" starts is decided (only while
        # _buf holds it)
        self._broken: list[str] = []
        self._count = 0  # characters consumed
        self._junk = 0  # after a malformed marker: characters it may still run on

    @property
    def pending(self) -> str:
        """Characters held back because they may still become a marker (or be left out with one)."""
        return "".join(self._broken) + self._buf if self._broken else self._buf

    def feed_plain(self, text: str) -> bool:
        """Consume ``text`` and return True when it is all text (no ``[`` in it, nothing held
        back); else consume nothing and return False."""
        if self._buf or self._junk or "[" in text:
            return False
        self._count += len(text)
        return True

    def feed(self, piece: str) -> list[Parsed]:
        """Consume one piece of text; the items it completed, in order."""
        out: list[Parsed] = []
        i, n = 0, len(piece)
        while i < n:
            if not self._buf and not self._junk:
                j = piece.find("[", i)  # text up to the next "[" cannot be part of a marker
                if j < 0:
                    out.append(Text(piece[i:]))
                    self._count += n - i
                    break
                if j > i:
                    out.append(Text(piece[i:j]))
                    self._count += j - i
                    i = j
            self._push(piece[i], out, self._count)
            self._count += 1
            i += 1
        return _merge(out)

    def finish(self) -> list[Parsed]:
        """End of the text: a held-back head (``[Fork``) is tag-like with a Malformed
        diagnostic (and so is a partial marker its ``[`` cut short), a shorter prefix (``[Fo``) is
        text."""
        self._junk = 0
        buf, self._buf = self._buf, ""
        out: list[Parsed] = []
        if buf.startswith(_HEADS):
            self._left_out(out)
            out += [Malformed(raw=buf, reason="unterminated marker at end of text"), TagText(buf)]
        else:
            if self._broken:
                out.append(Text("".join(self._broken)))
                self._broken = []
            if buf:
                out.append(Text(buf))
        return _merge(out)

    def _left_out(self, out: list[Parsed]) -> None:
        """What a ``[`` cut short goes out as tag-like text, since what that ``[`` started is left
        out; but a lone ``[`` is the model's text, and so is every partial marker a ``[`` cut
        short before it (``x [[Fork]`` keeps ``x [``, ``[Fo[[Fork]`` keeps ``[Fo[``, ``[[Fo[Fork]``
        keeps ``[`` and leaves ``[Fo`` out), as :class:`~pasta_engine.lang.tags.TagParser` does."""
        if self._broken:
            broken, self._broken = self._broken, []
            left_out_broken(broken, "[", "partial marker cut short by a marker", out)

    def _push(self, ch: str, out: list[Parsed], at: int) -> None:
        """Consume ``ch``, found at offset ``at`` of the input."""
        if not self._buf:
            if self._junk:  # the rest of a malformed marker, through its "]"
                if ch != "[" and ch != "\n":
                    out.append(TagText(ch))
                    self._junk = 0 if ch == "]" else self._junk - 1
                    return
                self._junk = 0
            if ch == "[":
                self._buf = ch
            else:
                out.append(Text(ch))
            return
        buf = self._buf + ch
        kind = _MARKERS.get(buf)
        if kind is not None:
            self._buf = ""
            self._left_out(out)  # what a "[" cut short goes with the marker ("[Fo[Fork]rk]")
            end = at + 1
            out.append(Promise("", 0, buf, end=end) if kind == "fork"
                       else AsyncOpen(buf, end=end) if kind == "open" else AsyncClose(buf, end=end))
            return
        if any(m.startswith(buf) for m in _MARKERS):
            self._buf = buf
            return
        prefix, self._buf = buf[:-1], ""
        if prefix in _HEADS and not _word_char(ch):
            self._left_out(out)
            out.append(Malformed(raw=buf, reason="malformed marker"))
            out.append(TagText(prefix))
            self._junk = MAX_MARKER_JUNK
        elif ch == "[":
            # "[Fo" cut short by a "[": if that "[" starts a marker (or tag-like text), the two must
            # not meet again once it is left out ("[Fo[Fork]rk]" would read "[Fork]") and "[Fo"
            # goes with it; else both are text ("[a[b")
            self._broken.append(prefix)
        else:
            out.append(Text("".join(self._broken) + prefix) if self._broken else Text(prefix))
            self._broken = []
        self._push(ch, out, at)  # it may start a marker itself ("[Fo[Fork]")


def _merge(items: list[Parsed]) -> list[Parsed]:
    """Adjacent text of one kind merged, empty text dropped."""
    merged: list[Parsed] = []
    for e in items:
        if isinstance(e, Text):
            if not e.text:
                continue
            if merged and type(merged[-1]) is type(e):
                merged[-1] = type(e)(merged[-1].text + e.text)
                continue
        merged.append(e)
    return merged


#: APAR's :class:`~pasta_engine.lang.dialect.Rejoin`: a kept lone ``[`` and the text after a
#: drop read by :class:`AparParser`, a drop read as ``[Fork]`` (``[[Fork]Fork]`` shows ``[``).
APAR_REJOIN = Rejoin("[", AparParser, FORK)


class AparDialect(BaseDialect):
    """APAR (Liu et al. 2024, arXiv 2401.06761) as a dialect (see the module docstring):
    ``[Fork]`` forks, ``[Child]`` (inserted) ... ``[/Child]`` is the item's body, every child
    joins at the end of the response. Every member of :class:`~.dialect.BaseDialect` but
    :meth:`prompt` keeps its default (one branch per fork, no join of its own).

    Args:
        reserve: positions the main thread skips per fork under the ``predicted`` position
            policy, besides the markers' (APAR predicts no length); an int >= 0.

    Raises ValueError naming ``reserve`` for a negative or non-int value."""

    name = "apar"
    open_tag = CHILD
    close_tag = CHILD_CLOSE
    nesting = False
    rejoin = APAR_REJOIN

    def __init__(self, reserve: int = DEFAULT_RESERVE) -> None:
        if isinstance(reserve, bool) or not isinstance(reserve, int) or reserve < 0:
            raise ValueError(f"reserve must be an int >= 0 (positions per fork), got {reserve!r}")
        self.reserve = reserve

    def parser(self) -> AparParser:
        """A fresh incremental parser for one thread."""
        return AparParser()

    def parse(self, text: str) -> list[Parsed]:
        """A whole text's items (text runs merged)."""
        p = AparParser()
        return _merge(p.feed(text) + p.finish())

    def grammar_state(self, is_main: bool, pending: str, can_fork: bool, taken: Collection[str] = (),
                      tail: str | None = None) -> int:
        """Always ``FREE``: the sampler's grammar masks are PASTA-LANG's; APAR gets none."""
        return GrammarState.FREE

    def child_cap(self, limits: Any, fork: Promise) -> int:
        """Tokens a child may sample: what a promise of the longest length gets
        (``limits.chunk_cap(limits.max_promise_tokens)``), since a fork predicts none; a body
        normally ends well before at ``[/Child]`` or end-of-sequence."""
        return limits.chunk_cap(limits.max_promise_tokens)

    def reserved_positions(self, fork: Promise, policy: Any, limits: Any, open_len: int,
                           close_len: int, chunk_len: int | None) -> tuple[int, str | None]:
        """Positions the main thread skips after a fork (the child's start right after the
        fork marker): ``predicted`` (default) the markers plus :attr:`reserve`; ``constant:K``
        the markers plus K; ``none`` nothing (the paper's decoder: parent and child go on from
        the same position); ``oracle`` the child's true length (replay)."""
        return policy_reserve(policy, open_len, close_len, chunk_len, self.reserve), None

    def split_threads(self, annotated: str, lead_whitespace: str = "main") -> Threads:
        """An annotated response as the main thread's text (``[Fork]`` markers kept, bodies
        out) and one :class:`~pasta_engine.lang.dialect.Chunk` per fork (topic ``""``, tokens 0).

        ``[Child]`` opens a body only right after a ``[Fork]`` that has none yet (whitespace
        between them allowed: it stays in the main text for ``lead_whitespace="main"``, starts
        the body for ``"chunk"``); inside a body every marker but ``[/Child]`` is text (no
        nesting); stray markers are text. Each is noted in ``diagnostics``. A body without
        ``[/Child]`` runs to the end (``closed=False``). Raises ValueError for another
        ``lead_whitespace``; never on content."""
        if lead_whitespace not in ("main", "chunk"):
            raise ValueError(f"lead_whitespace must be 'main' or 'chunk', got {lead_whitespace!r}")
        main: list[str] = []
        chunks: list[Chunk] = []
        diags: list[str] = []
        body: list[str] | None = None
        lead: str | None = None  # whitespace since the last bodiless [Fork], not placed yet

        def place_lead() -> None:
            nonlocal lead
            if lead:
                main.append(lead)
            lead = None

        for e in self.parse(annotated):
            if isinstance(e, Malformed):
                diags.append(f"malformed marker kept as text: {e.raw!r}")
                continue
            if body is not None:
                if isinstance(e, AsyncClose):
                    chunks[-1].content, body = "".join(body), None
                    continue
                if not isinstance(e, Text):
                    diags.append(f"{e.raw} inside a child's body kept as text (no nesting)")
                body.append(source_text(e))
                continue
            if isinstance(e, Promise):
                place_lead()
                main.append(e.raw)
                chunks.append(Chunk(topic="", tokens=0, content=None))
                lead = ""
            elif isinstance(e, AsyncOpen) and lead is not None:
                body = []
                if lead_whitespace == "chunk":
                    body.append(lead)
                    lead = None
                else:
                    place_lead()
            elif isinstance(e, Text) and lead is not None and e.text.strip() == "":
                lead += e.text
            else:
                if not isinstance(e, Text):
                    diags.append(f"{e.raw} without a {FORK} right before it kept as text")
                place_lead()
                main.append(source_text(e))
        place_lead()
        if body is not None:
            chunks[-1].content, chunks[-1].closed = "".join(body), False
            diags.append(f"the last child's body has no {CHILD_CLOSE}")
        return Threads(main="".join(main), chunks=chunks, diagnostics=diags)

    def splice(self, main: str, chunks: Sequence[Chunk | str | None]) -> str:
        """Each body right after its ``[Fork]`` in the main text: ``[Child]`` + content (+
        ``[/Child]`` unless an unclosed :class:`~pasta_engine.lang.dialect.Chunk`); None: no body.
        The inverse of :meth:`split_threads`. Raises ValueError when ``main`` has fewer
        ``[Fork]`` markers than ``chunks``."""
        out: list[str] = []
        i = 0
        for e in self.parse(main):
            if isinstance(e, Malformed):
                continue  # a diagnostic: its characters come as TagText
            out.append(source_text(e))
            if isinstance(e, Promise):
                c = chunks[i] if i < len(chunks) else None
                content = c.content if isinstance(c, Chunk) else c
                if content is not None:
                    closed = c.closed if isinstance(c, Chunk) else True
                    out.append(CHILD + content + (CHILD_CLOSE if closed else ""))
                i += 1
        if i < len(chunks):
            raise ValueError(f"main text has {i} {FORK} markers but {len(chunks)} chunks were given")
        return "".join(out)

    def clean_text(self, annotated: str) -> str:
        """What a reader sees: ``annotated`` without markers and tag-like text (each item's
        header then its body), less the list items that leaving them out emptied
        (:func:`~pasta_engine.lang.tags.drop_empty_items`, the rule the engine's streamed text
        follows too), and less the text that would rejoin a kept lone ``[`` into a marker
        (``[[Fork]Fork]`` shows ``[``: :data:`APAR_REJOIN`)."""
        return clean_from_items(self.parse(annotated), APAR_REJOIN)

    def prompt(self, pasta_prompt: PastaPrompt) -> PastaPrompt:
        """:data:`APAR_PROMPT` (``pasta_prompt``, PASTA-LANG's, would teach the wrong tags)."""
        return APAR_PROMPT

    def __repr__(self) -> str:
        return f"AparDialect(reserve={self.reserve})"


#: APAR with the default reserve: what ``get_dialect("apar")`` returns.
APAR = register_dialect(AparDialect())
