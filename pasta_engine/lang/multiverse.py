"""Multiverse as a dialect: a block plans its paths, the paths decode in parallel, then a
conclusion sees them all; paths may hold blocks of their own (no torch).

Multiverse (Yang et al. 2025, "Multiverse: Your Language Models Secretly Decide How to
Parallelize and Merge Generation", arXiv 2506.09991, sections 3 and 4) writes a parallel block as::

    <Parallel>
    <Goal><Outline>1: ...</Outline><Outline>2: ...</Outline></Goal>
    <Path>1: ...</Path><Path>2: ...</Path>
    <Conclusion>...</Conclusion>
    </Parallel>

Its engine forks at ``</Goal>``: one thread per ``<Outline>``, each started with its own
inserted header (:func:`path_header`: ``<Path>`` then the path's label ``\\n{i}:``); a path ends
at ``</Path>``; the parent waits for its paths (the fork is also a join), then sees every path
(their KV joins its view, never recomputed) and continues with the inserted ``<Conclusion>``. A
path may hold a block of its own (nesting, up to ``Limits.max_fork_depth``; past it the nested
block decodes inline, in the same thread, as text the model writes itself).

How it maps onto the engine's event vocabulary (docs/DESIGN.md section 2, "Dialects"):

* ``</Goal>`` of the thread's outermost block, with at least one outline: a
  :class:`GoalFork` (a :class:`~.dialect.Promise` carrying the outlines), whose
  :meth:`MultiverseDialect.branches` are one ``(promise, header)`` per outline; ``fork_joins``;
* ``</Path>`` closing the thread's own path (its parser's outermost element): an
  :class:`~.dialect.AsyncClose`;
* every other tag: :class:`~.dialect.Markup` (never shown, tokenized apart);
* ``join_tag`` ``<Conclusion>``: inserted into the parent when its paths have ended.

What is shown (the clean text): text outside any block, and inside a block the paths' bodies
(in order) and the conclusion's; the goal and its outlines are planning, overhead like PASTA-LANG's
promise topics, and text inside a block but outside its elements (the layout between them) is
left out too. A path's label (``1:`` right after ``<Path>``, whitespace before it allowed) is part
of its header tag, not of its body.

Where the line between tag and text falls (character by character):

* the ten tags exactly (case-sensitive), where the context allows them (``<Parallel>`` outside a
  block or inside a path or conclusion; ``<Goal>``, ``<Path>``, ``<Conclusion>`` directly in a
  block; ``<Outline>`` in a goal; a closing tag for the element open), are tags;
* a tag in a context that does not allow it is tag-like text (:class:`~.dialect.TagText`, never
  shown, with a :class:`~.dialect.Malformed` diagnostic); so is a would-be tag that got as far as its
  name and broke on a character that is not a word character (``<Path x>``: ``<Path`` is
  tag-like, `` x>`` is text);
* ``</Path>`` inside a path closes it with whatever it left open (a nested block cut by the
  path's end or cap: the interpreter's ``</Path>`` follows it), as HTML's implied end tags do;
* so is a partial tag (``<`` and at least one more character of a tag) cut by another ``<``
  (``<Concl</Path>``: what a path cut inside a tag and closed by the interpreter reads as); a
  lone ``<`` never is: the model's ``<`` right before a tag (``x <</Path>``) stays in the clean
  text, and the shown text after the left-out tag that would complete it into a tag
  (``Parallel>`` in ``<</Parallel>Parallel>``), read wherever a reader sees it, is left out of
  the clean text instead (:data:`MULTIVERSE_REJOIN`, :func:`~pasta_engine.lang.tags.drop_empty_items`);
* a name followed by a word character is a word, and text (``<Pathway>``, ``<Goals>``), and so is
  anything else that stops short of a name (``<P>``, ``a < b``);
* at the end of the text, what is held back is tag-like when it is at least ``<`` and one more
  character of a tag (a partial tag at a length cut or end of sequence: left out, reported),
  text otherwise; a ``<Path>`` whose label is incomplete is the tag and its whitespace and
  digits are text.

Positions: every path starts right after ``</Goal>`` (the fork marker), and after the join the
parent continues after the longest path (:meth:`MultiverseDialect.join_position`), as
Multiverse's engine places them; no range is reserved at the fork, whatever the position policy.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Collection, Sequence

from .dialect import (AsyncClose, BaseDialect, Chunk, Malformed, Markup, Parsed, Promise, Rejoin, TagText, Text,
                      Threads, TraceFork, TraceThread, register_dialect, source_text)
from .prompts import PastaPrompt
from .tags import clean_from_items

__all__ = [
    "PARALLEL", "GOAL", "OUTLINE", "PATH", "CONCLUSION", "GoalFork", "MultiverseParser", "MultiverseDialect",
    "MULTIVERSE", "MULTIVERSE_PROMPT", "MULTIVERSE_REJOIN", "path_header", "MAX_LABEL_CHARS",
]

PARALLEL, GOAL, OUTLINE, PATH, CONCLUSION = "Parallel", "Goal", "Outline", "Path", "Conclusion"
_NAMES = (PARALLEL, GOAL, OUTLINE, PATH, CONCLUSION)
_TAGS = {f"<{n}>": (n, True) for n in _NAMES} | {f"</{n}>": (n, False) for n in _NAMES}
_HEADS = {t[:-1] for t in _TAGS}  # "<Path", "</Goal", ...
_PREFIXES = {t[:i] for t in _TAGS for i in range(1, len(t) + 1)}
#: Characters a path's label may take after ``<Path>`` (whitespace, digits, the colon).
MAX_LABEL_CHARS = 12
_SHOWN = (PATH, CONCLUSION)


def path_header(i: int) -> str:
    """The text inserted into the ``i``-th path (1-based) of a block: ``<Path>`` and its label
    (``"<Path>\\n2:"``). Raises ValueError for ``i < 1``."""
    if i < 1:
        raise ValueError(f"path index i must be >= 1, got {i}")
    return f"<{PATH}>\n{i}:"


#: The prompt that teaches an un-finetuned instruct model Multiverse (a request in this dialect
#: gets it instead of the engine's PASTA-LANG prompt: :meth:`MultiverseDialect.prompt`). Its
#: example is a whole block: after ``</Goal>`` the parent sees every path, then concludes.
MULTIVERSE_PROMPT = PastaPrompt(
    system=("You are a helpful assistant. When an answer has independent parts, write them as a parallel "
            "block: <Parallel>, then a <Goal> with one short <Outline> per part, then one <Path> per outline "
            "(each starts with the outline's number and is written in parallel), then a <Conclusion> that "
            "uses them all, then </Parallel>."),
    examples=((
        "Give me two tips for better sleep.",
        "Here are two tips for better sleep:\n<Parallel>\n<Goal>\n<Outline>1: regular schedule</Outline>\n"
        "<Outline>2: no screens</Outline>\n</Goal>\n<Path>\n1: Go to bed and get up at the same time every day.\n"
        "</Path>\n<Path>\n2: Put your phone away an hour before bed.\n</Path>\n<Conclusion>\nThese habits "
        "will help you sleep better.\n</Conclusion>\n</Parallel>",
    ),),
)


@dataclass(frozen=True)
class GoalFork(Promise):
    """A completed ``</Goal>`` that forks: one path per outline (``outlines``, their text)."""

    outlines: tuple[str, ...] = field(default=(), compare=False)


def _word_char(ch: str) -> bool:
    return ch.isalnum() or ch in "_-"


def _label_ok(rest: str) -> bool:
    """Whether ``rest`` (after ``<Path>``) may still grow into a label (whitespace, digits, ``:``)."""
    body = rest.lstrip(" \t\r\n")
    return len(rest) <= MAX_LABEL_CHARS and (body == "" or body.isdigit())


class MultiverseParser:
    """An incremental parser of one thread's Multiverse text (the module docstring draws the
    lines). ``all_forks``: every ``</Goal>`` with outlines is a fork (a trace's tree: nested
    blocks included), not only the thread's outermost block's (what a decoding thread acts on).
    ``flat``: every tag is :class:`~.dialect.Markup` wherever it stands and every text is shown
    (no context: how a reader's text is read for tags, :data:`MULTIVERSE_REJOIN`)."""

    __slots__ = ("_buf", "_count", "_stack", "_outlines", "_outline", "_all_forks", "_flat")

    def __init__(self, all_forks: bool = False, flat: bool = False) -> None:
        self._buf = ""
        self._count = 0  # characters consumed
        self._stack: list[str] = []
        self._outlines: list[list[str]] = []  # per open goal, its outlines' text
        self._outline: list[str] | None = None
        self._all_forks = all_forks
        self._flat = flat

    @property
    def pending(self) -> str:
        """Characters held back because they may still become a tag."""
        return self._buf

    def _shown(self) -> bool:
        return not self._stack or self._stack[-1] in _SHOWN

    def _text(self, s: str, out: list[Parsed]) -> None:
        if not s:
            return
        if self._outline is not None:
            self._outline.append(s)
        out.append(Text(s) if self._shown() else TagText(s))

    def feed_plain(self, text: str) -> bool:
        """True (and ``text`` consumed) when ``text`` is all shown text: no ``<``, nothing held,
        in a context whose text is shown; else consume nothing and return False."""
        if self._buf or "<" in text or not self._shown() or self._outline is not None:
            return False
        self._count += len(text)
        return True

    def feed(self, piece: str) -> list[Parsed]:
        """Consume ``piece``; the items it completed (text runs merged)."""
        out: list[Parsed] = []
        i = 0
        n = len(piece)
        while i < n:
            if not self._buf:
                j = piece.find("<", i)
                if j < 0:
                    j = n
                self._text(piece[i:j], out)
                self._count += j - i
                i = j
                if i == n:
                    break
            self._push(piece[i], out)
            i += 1
        return _merge(out)

    def finish(self) -> list[Parsed]:
        """End of the text: what is held back (see the module docstring)."""
        out: list[Parsed] = []
        buf, self._buf = self._buf, ""
        if buf.startswith(f"<{PATH}>"):
            self._tag(f"<{PATH}>", out, self._count - len(buf) + len(PATH) + 2)
            self._text(buf[len(PATH) + 2:], out)
        elif len(buf) >= 2:
            out.append(Malformed(buf, "unterminated tag at the end of the text"))
            out.append(TagText(buf))
        elif buf:
            self._text(buf, out)
        return _merge(out)

    def _push(self, ch: str, out: list[Parsed]) -> None:
        self._count += 1
        buf = self._buf + ch
        if buf.startswith(f"<{PATH}>"):  # a label may follow
            rest = buf[len(PATH) + 2:]
            if rest.endswith(":") and rest[:-1].lstrip(" \t\r\n").isdigit() and len(rest) <= MAX_LABEL_CHARS:
                self._buf = ""
                self._tag(buf, out, self._count)
                return
            if _label_ok(rest):
                self._buf = buf
                return
            # no label: the tag, then the rest again as text
            self._buf = ""
            self._tag(f"<{PATH}>", out, self._count - len(rest))
            self._count -= len(rest)
            for c in rest:
                if self._buf or c == "<":
                    self._push(c, out)
                else:
                    self._count += 1
                    self._text(c, out)
            return
        if buf in _TAGS and buf != f"<{PATH}>":
            self._buf = ""
            self._tag(buf, out, self._count)
            return
        if buf in _PREFIXES:
            self._buf = buf
            return
        self._buf = ""
        head = buf[:-1]
        if (head in _HEADS and not _word_char(ch)) or (ch == "<" and len(head) >= 2):
            out.append(Malformed(buf, f"{head} broken by {ch!r}"))
            out.append(TagText(head))
        else:
            self._text(head, out)
        # the breaking character starts over (it may open a tag)
        self._count -= 1
        if ch == "<":
            self._push(ch, out)
        else:
            self._count += 1
            self._text(ch, out)

    def _tag(self, raw: str, out: list[Parsed], end: int) -> None:
        if self._flat:
            out.append(Markup(raw, end))
            return
        name, opening = _TAGS[raw] if raw in _TAGS else (PATH, True)
        st = self._stack
        top = st[-1] if st else None
        bad = None
        if opening:
            allowed = {PARALLEL: top is None or top in _SHOWN, GOAL: top == PARALLEL, OUTLINE: top == GOAL,
                       PATH: top == PARALLEL or (top is None and end == len(raw)),
                       CONCLUSION: top == PARALLEL}[name]
            if not allowed:
                bad = f"{raw} not allowed {'here' if top is None else 'inside <' + top + '>'}"
            else:
                st.append(name)
                if name == GOAL:
                    self._outlines.append([])
                elif name == OUTLINE:
                    self._outline = []
                out.append(Markup(raw, end))
                return
        elif name == PARALLEL:  # closes its block, and the block's conclusion left open
            if top == CONCLUSION and len(st) >= 2 and st[-2] == PARALLEL:
                st.pop()
                top = PARALLEL
            if top != PARALLEL:
                bad = f"{raw} without an open <{PARALLEL}>"
            else:
                st.pop()
                out.append(Markup(raw, end))
                return
        elif top != name and not (name == PATH and PATH in st):
            bad = f"{raw} without an open <{name}>"
        else:
            while st[-1] != name:  # </Path> closes what its path left open (a block cut by its end)
                inner = st.pop()
                if inner == GOAL:
                    self._outlines.pop()
                elif inner == OUTLINE:
                    self._outline = None
            st.pop()
            if name == OUTLINE:
                self._outlines[-1].append("".join(self._outline or []))
                self._outline = None
                out.append(Markup(raw, end))
            elif name == GOAL:
                outlines = tuple(self._outlines.pop())
                if outlines and (self._all_forks or st.count(PARALLEL) == 1):
                    out.append(GoalFork("", 0, raw, end, outlines))
                else:
                    out.append(Markup(raw, end))
            elif name == PATH and not st:
                out.append(AsyncClose(raw, end))
            else:
                out.append(Markup(raw, end))
            return
        out.append(Malformed(raw, bad))
        out.append(TagText(raw))


def _merge(items: list[Parsed]) -> list[Parsed]:
    """Adjacent runs of the same text type merged into one."""
    out: list[Parsed] = []
    for e in items:
        if out and type(e) in (Text, TagText) and type(out[-1]) is type(e):
            out[-1] = type(e)(out[-1].text + e.text)
        else:
            out.append(e)
    return out


def _flat_parser() -> MultiverseParser:
    return MultiverseParser(flat=True)


#: Multiverse's :class:`~pasta_engine.lang.dialect.Rejoin`: a kept lone ``<`` and the shown text
#: after a drop, read by a context-free parser (any of the ten tags is a tag there: in a reader's
#: text even ``<Goal>`` is tag text), a drop read as ``<Parallel>`` (``<</Parallel>Parallel>``
#: shows ``<``).
MULTIVERSE_REJOIN = Rejoin("<", _flat_parser, f"<{PARALLEL}>")


class MultiverseDialect(BaseDialect):
    """Multiverse (module docstring): forks at ``</Goal>``, one path per outline, joins its
    paths at once and concludes after them; nests. It overrides every default of
    :class:`~.dialect.BaseDialect`."""

    name = "multiverse"
    open_tag = f"<{PATH}>"
    close_tag = f"</{PATH}>"
    join_tag = f"<{CONCLUSION}>"
    nesting = True
    fork_joins = True
    rejoin = MULTIVERSE_REJOIN

    def parser(self) -> MultiverseParser:
        """A fresh parser for one decoding thread."""
        return MultiverseParser()

    def parse(self, text: str, all_forks: bool = False) -> list[Parsed]:
        """``text``'s items, text runs merged (``all_forks``: see :class:`MultiverseParser`)."""
        p = MultiverseParser(all_forks)
        return _merge(p.feed(text) + p.finish())

    def grammar_state(self, is_main: bool, pending: str, can_fork: bool, taken: Collection[str] = (),
                      tail: str | None = None) -> int:
        """0 (``FREE``): the sampler masks nothing for Multiverse (its tags are text)."""
        return 0

    def branches(self, fork: Promise) -> list[tuple[Promise, str]]:
        """One path per outline of ``fork`` (a :class:`GoalFork`): its topic is the outline's
        text (stripped), its inserted text :func:`path_header`."""
        outlines = (fork.outlines if isinstance(fork, GoalFork) else ()) or ("",)
        return [(Promise(o.strip(), 0, fork.raw, fork.end), path_header(i)) for i, o in enumerate(outlines, 1)]

    def child_cap(self, limits: Any, fork: Promise) -> int:
        """A path predicts no length: it may sample ``limits.chunk_cap(limits.max_promise_tokens)``
        tokens (the request's token budget bounds it too)."""
        return limits.chunk_cap(limits.max_promise_tokens)

    def reserved_positions(self, fork: Promise, policy: Any, limits: Any, open_len: int,
                           close_len: int, chunk_len: int | None) -> tuple[int, str | None]:
        """0: nothing is reserved at the fork; the parent waits and continues after the
        longest path (:meth:`join_position`), whatever the policy."""
        return 0, None

    def join_position(self, next_pos: int, child_next: Sequence[int]) -> int:
        """After the join, the parent's next position is past the longest path."""
        return max([next_pos, *child_next])

    def inserted_bytes(self, limits: Any) -> int:
        """Bytes of the longest path header a request can insert (labels up to ``max_forks``),
        plus the conclusion tag inserted at the join (UTF-8 bytes)."""
        return len(path_header(max(1, limits.max_forks)).encode()) + len(self.join_tag.encode())

    # ---- traces

    def split_tree(self, annotated: str) -> TraceThread:
        """``annotated`` as a tree of threads (docs/DESIGN.md section 2, "Dialects"): at each
        ``</Goal>`` with outlines, the block's next paths (one per outline, at most) become its
        branches; the layout between ``</Goal>`` and the conclusion is left out, and the
        ``<Conclusion>`` tag is the join's inserted text (a block without one gets it too).
        Paths past the outlines stay in their thread's text. Never raises on content."""
        items = self.parse(annotated, all_forks=True)
        root = TraceThread()
        stack: list[str] = []  # the parser's open elements
        threads: list[tuple[TraceThread, int]] = [(root, 0)]  # (thread, len(stack) once its path opened)
        forks: list[tuple[TraceFork, int, int, TraceThread]] = []  # (fork, len(stack) at its block, outlines, thread)
        for e in items:
            if isinstance(e, Malformed):
                continue
            t, base = threads[-1]
            fk = forks[-1] if forks and forks[-1][3] is t and forks[-1][1] == len(stack) else None
            if isinstance(e, Text):  # shown or tag-like text alike
                if fk is None:
                    t.items.append(("text", e.text))
                continue  # layout between </Goal> and the conclusion: left out
            raw = e.raw
            name, opening = _TAGS.get(raw, (PATH, True))
            if isinstance(e, GoalFork):
                stack.pop()
                fork = TraceFork([None] * len(e.outlines), self.join_tag)  # one branch per outline
                t.items += [("fork", raw), fork]
                forks.append((fork, len(stack), 0, t))
                continue
            if fk is not None:
                fork, _, k, _ = fk
                if name == PATH and opening and k < len(fork.branches):
                    stack.append(PATH)
                    child = TraceThread(header=path_header(k + 1), closed=False)
                    fork.branches[k] = child
                    forks[-1] = (fork, len(stack) - 1, k + 1, t)
                    threads.append((child, len(stack)))
                    continue
                forks.pop()  # its paths are over
                if name == CONCLUSION and opening and k:
                    stack.append(CONCLUSION)
                    continue  # the join's inserted text
            t.items.append(("tag", raw))
            if name == PATH and not opening:
                while stack and stack[-1] != PATH:  # as the parser: it closes what its path left open
                    stack.pop()
            if name == PATH and not opening and len(threads) > 1 and len(stack) == base:
                t.closed = True  # the thread's own path ends
                stack.pop()
                threads.pop()
                while forks and forks[-1][3] is t:
                    forks.pop()
            elif opening:
                stack.append(name)
            elif name == PARALLEL:
                if stack and stack[-1] == CONCLUSION:
                    stack.pop()
                stack.pop()
            else:
                stack.pop()
        _no_join_without_paths(root)
        return root

    def split_threads(self, annotated: str, lead_whitespace: str = "main") -> Threads:
        """The main thread's text and the chunk of each branch it forks (a chunk's nested
        blocks left in its text: :meth:`split_tree` has them as threads). ``lead_whitespace``
        is accepted for the interface (whitespace at a fork is layout here)."""
        root = self.split_tree(annotated)
        main: list[str] = []
        chunks: list[Chunk] = []
        for it in root.items:
            if isinstance(it, TraceFork):
                for b in it.branches:
                    chunks.append(Chunk("", 0, _body(b), b.closed) if b is not None else Chunk("", 0, None))
                main.append(it.join_insert)
            else:
                main.append(it[1])
        return Threads("".join(main), chunks, [])

    def splice(self, main: str, chunks: Sequence[Chunk | str | None]) -> str:
        """The inverse of :meth:`split_threads`: each chunk, after its path header, right after
        the ``</Goal>`` that forks it (one per outline), closed by ``</Path>`` when it is."""
        parser = MultiverseParser()
        parts: list[str] = []
        i = 0
        for e in _merge(parser.feed(main) + parser.finish()):
            parts.append(source_text(e))
            if isinstance(e, GoalFork):
                for k in range(1, len(e.outlines) + 1):
                    c = chunks[i] if i < len(chunks) else None
                    i += 1
                    content = c.content if isinstance(c, Chunk) else c
                    if content is None:
                        continue
                    closed = c.closed if isinstance(c, Chunk) else True
                    parts.append(path_header(k) + content + (self.close_tag if closed else ""))
        return "".join(parts)

    def clean_text(self, annotated: str) -> str:
        """What a reader sees (module docstring): the text outside blocks, the paths' bodies
        and the conclusions, no tag and no tag-like text, and no list item a left-out tag
        emptied (:func:`~pasta_engine.lang.tags.drop_empty_items`, as for PASTA-LANG), nor
        text that would rejoin a kept lone ``<`` into a tag (:data:`MULTIVERSE_REJOIN`)."""
        return clean_from_items(self.parse(annotated), MULTIVERSE_REJOIN)

    def prompt(self, pasta_prompt: PastaPrompt) -> PastaPrompt:
        """:data:`MULTIVERSE_PROMPT` (``pasta_prompt``, PASTA-LANG's, would teach the wrong tags)."""
        return MULTIVERSE_PROMPT

    def __repr__(self) -> str:
        return "MultiverseDialect()"


def _body(t: TraceThread) -> str:
    """A path's text without its header and its closing ``</Path>`` (a chunk's content)."""
    items = t.items[:-1] if t.closed and t.items and t.items[-1] == ("tag", f"</{PATH}>") else t.items
    return TraceThread(items).text(header=False)


def _no_join_without_paths(t: TraceThread) -> None:
    """A block whose trace has no path forks nothing, so nothing is inserted at its join."""
    for it in t.items:
        if isinstance(it, TraceFork):
            if all(b is None for b in it.branches):
                it.join_insert = ""
            for b in it.branches:
                if b is not None:
                    _no_join_without_paths(b)


#: The Multiverse dialect (``get_dialect("multiverse")``).
MULTIVERSE = register_dialect(MultiverseDialect())
