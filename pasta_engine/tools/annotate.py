"""Annotators: turn a plain response into PASTA-LANG, and the trace files that carry the result.

An annotated trace is what :meth:`pasta_engine.Engine.replay` forces: the same content decoded
sequentially and with PASTA's threads, so realized speedup can be measured at any model shape
(docs/DESIGN.md section 3). Three annotators:

``sot``
    Skeleton-of-Thought style (Ning et al., 2023, "Skeleton-of-Thought: Prompting LLMs for
    Efficient Parallel Generation", arXiv 2307.15337): each point of a numbered or bulleted list
    becomes a promise whose chunk is the point's content; the list markers, the intro, headers
    and everything outside list points stay on the main thread (the skeleton). The promise goes
    right after the marker and the chunk starts with the space that follows it
    (``1.<promise .../><async> **Point**: ...``): byte-level BPE tokenizers start a word with its
    space, so this is where the plain text's own tokens have a boundary. A ``<sync/>`` is
    placed before any text that follows forked points (a conclusion may refer to them).
``apar``
    APAR style (Liu et al., 2024, "APAR: LLMs Can Do Auto-Parallel Auto-Regressive Decoding",
    arXiv 2401.06761): the model forks at the boundaries of list items and of paragraphs; every
    list item and every paragraph after the opening one forks (titles, headers, code and
    paragraphs that introduce what follows with a colon stay on the main thread). No sync: as in
    APAR, the end of the response waits for all threads.
``model``
    the model itself, prompted with the PASTA-LANG system prompt (what
    :meth:`~pasta_engine.Engine.generate` does in pasta mode); its response replaces the
    original one.

Guarantees of ``sot`` and ``apar`` (checked on every output, see :func:`verify_annotation`):
only tags are inserted, so ``strip_tags(annotated) == response``; each ``<async>`` directly
follows its promise, so :func:`~pasta_engine.lang.split_threads` and
:func:`~pasta_engine.lang.splice` round-trip; topics hold no ``"``, ``<``, ``>`` or newline;
nothing is forked inside a code fence, a single-item list never forks, and neither annotator
raises on any input. A response that itself contains text that parses as a PASTA-LANG tag is
left unannotated (its stripped form could never equal it) and the result says so in ``note``;
an annotation that would fail a check falls back the same way. By construction, too: topics are
ones the grammar (:mod:`pasta_engine.lang.grammar`) lets a model write (they open with a letter,
fit its byte cap :data:`~pasta_engine.lang.grammar.MAX_TOPIC_BYTES`, and never repeat in an
answer as :func:`~pasta_engine.lang.grammar.topic_key` compares them), and every promise sits at
a token boundary of the plain text for a byte-level BPE tokenizer (before an indented line's
first word it goes on the space that word's token starts with).

Promise lengths: ``tokens`` is the chunk's measured length (``count_tokens``, a tokenizer's
count when one is given, else :func:`approx_token_count`) rounded to tens, as in PASTA's
Pred-10x scheme (Jin et al., ICML 2025, arXiv 2502.11517, section 4).

Trace files (:mod:`pasta_engine.tools.traces`) carry the results.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from ..lang.grammar import MAX_TOPIC_BYTES, topic_key
from ..lang.tags import (
    ASYNC_CLOSE, ASYNC_OPEN, SYNC, AsyncClose, AsyncOpen, Malformed, Promise, Sync, Text, clean_text, parse, promise_tag,
    splice,
    split_threads,
)

__all__ = [
    "ANNOTATORS",
    "TEXT_ANNOTATORS",
    "Annotation",
    "annotate",
    "annotate_sot",
    "annotate_apar",
    "annotate_mixed",
    "annotate_with_model",
    "approx_token_count",
    "round_to_tens",
    "verify_annotation",
]

#: Annotators working on text alone.
TEXT_ANNOTATORS = ("sot", "apar", "mixed")
#: Every annotator name (``model`` needs an engine; ``endpoint`` an OpenAI-compatible endpoint,
#: :mod:`pasta_engine.tools.annotate_endpoint`).
ANNOTATORS = ("sot", "apar", "mixed", "model", "endpoint")

#: Items or paragraphs shorter than this many tokens are not forked by default.
MIN_CHUNK_TOKENS = 10
#: A topic keeps at most this many words and characters, and at most the grammar's
#: :data:`~pasta_engine.lang.grammar.MAX_TOPIC_BYTES` bytes (UTF-8): short, because every topic
#: token is decoded on the main thread's critical path (the paper's topics are a few words).
TOPIC_WORDS = 4
TOPIC_CHARS = 32

CountTokens = Callable[[str], int]


@dataclass
class Annotation:
    """One annotated response.

    ``annotated``: the response with PASTA-LANG tags inserted (the response itself when it
    was left unannotated); ``promises``/``syncs``: tags inserted; ``note``: why the response
    was left unannotated or kept whole, None otherwise; ``annotator``: which annotator placed
    the tags (``sot``, ``apar``, ``model``; for ``mixed`` the one that forked), None when no
    promise was placed."""

    annotated: str
    promises: int = 0
    syncs: int = 0
    note: str | None = None
    annotator: str | None = None


def approx_token_count(text: str) -> int:
    """Tokens of ``text`` estimated without a tokenizer: words (``\\w+`` runs) plus other
    non-space characters, each counted as one token (close to a BPE count for English)."""
    return len(re.findall(r"\w+|[^\w\s]", text))


# --------------------------------------------------------------------------- markdown structure


_ITEM = re.compile(r"([ \t]*)([-*+]|\d{1,9}[.)])([ \t]+|$)")
_HEADER = re.compile(r"[ \t]{0,3}#{1,6}([ \t]|$)")
_FENCE = re.compile(r"[ \t]*(`{3,}|~{3,})")


@dataclass
class _Line:
    start: int  # offset of the first character
    end: int  # offset of the newline (or the end of the text)
    text: str
    kind: str  # blank | code | item | header | text
    indent: int = 0
    marker: str = ""  # item: "ordered" or "bullet"
    content: int = 0  # item: offset where the item's text starts (after marker and spaces)
    marker_end: int = 0  # item: offset just past the marker (before the spaces that follow it)
    fence_end: int = -1  # code: index of the last line of this fenced block (on its first line)


@dataclass
class _Item:
    content_start: int
    content_end: int  # offset just past the item's last non-space character
    fork_start: int  # where a fork of the item starts: right after its marker (see _list_unit)


@dataclass
class _Unit:
    """A top-level piece of the response: a list (with items), a paragraph, a header or code."""

    kind: str  # list | para | header | code
    start: int
    end: int  # just past the last non-space character
    items: list[_Item] = field(default_factory=list)


def _indent(s: str) -> int:
    return len(s.expandtabs(4)) - len(s.expandtabs(4).lstrip(" "))


def _lines(text: str) -> list[_Line]:
    """Lines (split at ``\\n`` only), classified; lines inside fenced code are ``code``."""
    out: list[_Line] = []
    pos = 0
    for raw in text.split("\n"):
        out.append(_Line(pos, pos + len(raw), raw, "text"))
        pos += len(raw) + 1
    i = 0
    while i < len(out):
        ln = out[i]
        m = _FENCE.match(ln.text)
        if m:
            fence = m.group(1)
            j = i + 1
            while j < len(out):
                close = out[j].text.strip()
                if close.startswith(fence[0] * len(fence)) and close.strip(fence[0]) == "":
                    break
                j += 1
            last = min(j, len(out) - 1)
            for k in range(i, last + 1):
                out[k].kind = "code"
                out[k].indent = _indent(ln.text)
            ln.fence_end = last
            i = last + 1
            continue
        if not ln.text.strip():
            ln.kind = "blank"
        elif _HEADER.match(ln.text):
            ln.kind = "header"
            ln.indent = _indent(ln.text)
        else:
            im = _ITEM.match(ln.text)
            ln.indent = _indent(ln.text)
            if im:
                ln.kind = "item"
                ln.marker = "bullet" if im.group(2) in "-*+" else "ordered"
                ln.content = ln.start + im.end()
                ln.marker_end = ln.start + im.end(2)
        i += 1
    return out


def _last_nonspace(text: str, start: int, end: int) -> int:
    """Offset just past the last non-whitespace character of ``text[start:end]`` (``start``
    when there is none)."""
    seg = text[start:end].rstrip()
    return start + len(seg)


def _token_start(text: str, at: int) -> int:
    """Where a chunk whose first non-space character is ``text[at]`` starts so that its promise
    sits at a token boundary of the plain text: one character earlier when the character before
    is a space preceded by other whitespace (``"\\n\\n    // Read"``: a byte-level BPE tokenizer
    reads ``"\\n\\n   "`` then ``" //"``, the word taking its own leading space), else ``at``.
    A tab never joins the word after it (``"\\t"`` then ``"//"``), so ``at`` already is one."""
    if at >= 2 and text[at - 1] == " " and text[at - 2].isspace():
        return at - 1
    return at


def _units(text: str) -> list[_Unit]:
    """Top-level units of a markdown-ish response, in order."""
    lines = _lines(text)
    units: list[_Unit] = []
    i = 0
    n = len(lines)
    while i < n:
        ln = lines[i]
        if ln.kind == "blank":
            i += 1
        elif ln.kind == "code":
            last = ln.fence_end
            units.append(_Unit("code", ln.start, _last_nonspace(text, ln.start, lines[last].end)))
            i = last + 1
        elif ln.kind == "header":
            units.append(_Unit("header", ln.start, _last_nonspace(text, ln.start, ln.end)))
            i += 1
        elif ln.kind == "item":
            i = _list_unit(text, lines, i, units)
        else:  # a paragraph: text lines up to a blank line, header, fence or list item
            j = i
            while j + 1 < n and lines[j + 1].kind == "text":
                j += 1
            units.append(_Unit("para", ln.start, _last_nonspace(text, ln.start, lines[j].end)))
            i = j + 1
    return units


def _list_unit(text: str, lines: list[_Line], i: int, units: list[_Unit]) -> int:
    """Collect the list block starting at item line ``i``; return the index after it.

    Siblings are item lines of the same marker kind indented at most one column more than the
    first item; deeper items, indented lines, fences right after a non-blank line and lazy
    continuation lines belong to the current item. A blank line followed by an unindented
    paragraph, header or fence, or an item of the other kind, ends the block."""
    base = lines[i].indent
    kind = lines[i].marker
    items: list[tuple[int, int]] = [(i, i)]  # (first line, last non-blank line)
    j = i + 1
    n = len(lines)
    prev_blank = False
    while j < n:
        ln = lines[j]
        if ln.kind == "blank":
            prev_blank = True
            j += 1
            continue
        if ln.kind == "item" and ln.indent <= base + 1:
            if ln.marker != kind:
                break
            items.append((j, j))
            prev_blank = False
            j += 1
            continue
        if ln.kind == "code":
            last = ln.fence_end
            if ln.indent > base or not prev_blank:
                items[-1] = (items[-1][0], last)
                prev_blank = False
                j = last + 1
                continue
            break
        # a nested item, a header, or a text line
        if ln.indent > base or (ln.kind == "text" and not prev_blank):
            items[-1] = (items[-1][0], j)
            prev_blank = False
            j += 1
            continue
        break
    unit = _Unit("list", lines[i].start, 0)
    for first, last in items:
        start = lines[first].content
        end = _last_nonspace(text, start, lines[last].end)
        # content may begin on the next line ("1.\n   text"): skip to its first character
        while start < end and text[start].isspace():
            start += 1
        # A fork of the item starts right after its marker, the spaces after the marker in the
        # chunk ("1.<promise .../><async> **Point**: ..."): byte-level BPE tokenizers start a word
        # with its space ("1." " **" "Point"), so this is a token boundary of the plain text, and
        # a model that learns to fork there forks where its own text has a boundary. A promise
        # after the space ("1. <promise") is reached only by sampling a bare " " token, which a
        # model writing the plain text almost never does (the shipped adapter, trained on that,
        # forks after a numbered marker in 3 of 80 answers: bench/results/marker-fork-smollm2-cpu/).
        # Content on the next line ("1.\n   Keep"): the chunk starts with the word's own space
        # (the tokens are "\n  " then " Keep", see _token_start).
        ln = lines[first]
        fork = _token_start(text, start) if text[ln.marker_end:start].strip(" \t") else ln.marker_end
        unit.items.append(_Item(start, end, fork))
    unit.end = max(it.content_end for it in unit.items)
    units.append(unit)
    # j is the first line not in the block; blank lines before it are not part of the block
    return j


# --------------------------------------------------------------------------- topics and tags


_BOLD_LEAD = re.compile(r"\s*(\*\*|__)(.+?)\1")
_LEAD_END = re.compile(r":|\s[-\u2013\u2014]\s|[.;?!](\s|$)")
_TOPIC_DROP = re.compile(r"[*_`#\[\](){}<>\"\\|]")
_REST_EDGE = " :;,.-\u2013\u2014"  # what separates a lead from the words after it


def _topic(content: str, n: int, taken: set[str] | None = None) -> str:
    """The point's lead words: a bold title when the point starts with one, else the words up
    to the first colon, dash or sentence end; at most :data:`TOPIC_WORDS` words,
    :data:`TOPIC_CHARS` characters and :data:`~pasta_engine.lang.grammar.MAX_TOPIC_BYTES` bytes;
    never holds ``"``, ``<``, ``>`` or a newline, and opens with a letter (:func:`topic_text`).

    ``taken`` holds the :func:`~pasta_engine.lang.grammar.topic_key` of the topics already
    promised in the answer: the grammar never lets a topic equal to one of them end
    (``TOPIC_TAKEN``), so a clash is extended with the words that follow the lead on the point's
    first line ("Serve" twice: "Serve the soup hot", "Serve the salad cold"), else suffixed with
    the point's number ("Serve 2"), else ``point N`` with an unused N."""
    taken = taken if taken is not None else set()
    first = content.lstrip().split("\n", 1)[0]
    m = _BOLD_LEAD.match(first)
    if m:
        lead, rest = m.group(2), first[m.end():]
    else:
        lead = _LEAD_END.split(first, maxsplit=1)[0]
        rest = first[len(lead):]
    topic = topic_text(lead)
    if topic and topic_key(topic) not in taken:
        return topic
    if topic:
        longer = topic_text(lead + " " + rest.lstrip(_REST_EDGE))
        if longer and topic_key(longer) not in taken:
            return longer
        suffixed = topic_text(f"{topic} {n}", fit_tail=True)
        if topic_key(suffixed) not in taken:
            return suffixed
    k = n
    while topic_key(f"point {k}") in taken:
        k += 1
    return f"point {k}"


def _opening(word: str) -> str | None:
    """``word`` as a topic's first word: from its first letter on when a letter comes before any
    digit (``"\u00bfQu\u00e9"`` -> ``"Qu\u00e9"``), None when a digit comes first or it has no
    letter (``"500"``, ``"1."``, ``"3D"``, ``"$5"``)."""
    for i, c in enumerate(word):
        if c.isalpha():
            return word[i:]
        if c.isalnum():
            return None
    return None


def topic_text(text: str, fit_tail: bool = False) -> str:
    """``text`` as a promise topic: characters a topic may not hold (``"``, ``<``, ``>``,
    markdown, non-printables) become spaces; leading words that do not open with a letter are
    dropped (``"500 g flour"`` -> ``"g flour"``, ``"1. Recognition"`` -> ``"Recognition"``: the
    grammar's ``TOPIC_EMPTY`` takes only a first token holding a letter, and a byte-level
    tokenizer such as SmolLM2's reads a digit as a token of its own); then at most
    :data:`TOPIC_WORDS` words, :data:`TOPIC_CHARS` characters and
    :data:`~pasta_engine.lang.grammar.MAX_TOPIC_BYTES` UTF-8 bytes (the grammar's cap counts
    bytes), cut at a word (a first word longer than that is cut at a character), trimmed of edge
    punctuation. Empty when no word opens with a letter.

    ``fit_tail``: keep the last word (a suffix such as a number) and drop words before it until
    the caps hold."""
    words = "".join(c if c.isprintable() else " " for c in _TOPIC_DROP.sub(" ", text)).split()
    while words and _opening(words[0]) is None:
        words.pop(0)
    if not words:
        return ""
    words[0] = _opening(words[0]) or words[0]

    def fits(ws: list[str]) -> bool:
        t = " ".join(ws)
        return len(ws) <= TOPIC_WORDS and len(t) <= TOPIC_CHARS and len(t.encode()) <= MAX_TOPIC_BYTES

    if fit_tail and len(words) > 1:
        head, tail = words[:-1], words[-1]
        while head and not fits([*head, tail]):
            head.pop()
        if head:
            return " ".join([*head, tail]).strip(" :,.;-'")
    out: list[str] = []
    for w in words:
        if not fits([*out, w]):
            break
        out.append(w)
    if not out:  # one word over the caps: cut it at a character
        w = words[0][:TOPIC_CHARS]
        while len(w.encode()) > MAX_TOPIC_BYTES:
            w = w[:-1]
        out = [w]
    return " ".join(out).strip(" :,.;-'")


def round_to_tens(n: int) -> int:
    """A promise's ``tokens``: the chunk's length ``n`` (tokens) rounded to the nearest ten
    (halves up), at least 10 (PASTA's Pred-10x convention, Jin et al. 2025, section 4)."""
    return max(10, (n + 5) // 10 * 10)


@dataclass
class _Fork:
    start: int  # the chunk's first character (the promise goes right before it)
    end: int  # just past its last character (</async> goes here)


def _render(response: str, forks: Sequence[_Fork], syncs: Sequence[int], count: CountTokens,
            topics: Sequence[str] | None = None) -> str:
    inserts: list[tuple[int, int, str]] = []  # (offset, order, text)
    taken: set[str] = set()  # topic_key of the topics promised so far: never promised twice
    for k, f in enumerate(forks, 1):
        content = response[f.start : f.end]
        topic = topics[k - 1] if topics is not None else _topic(content, k, taken)
        taken.add(topic_key(topic))
        tag = promise_tag(topic, round_to_tens(count(content)))
        inserts.append((f.start, 2, tag + ASYNC_OPEN))
        inserts.append((f.end, 0, ASYNC_CLOSE))
    # at one offset: a chunk's close, then a sync, then the next promise (a sync before a fork
    # waits for the chunks before it; after the promise it would sit inside the new chunk)
    inserts += [(s, 1, SYNC) for s in syncs]
    inserts.sort(key=lambda x: (x[0], x[1]))
    out, at = [], 0
    for off, _, tag in inserts:
        out += [response[at:off], tag]
        at = off
    out.append(response[at:])
    return "".join(out)


def _has_tags(response: str) -> bool:
    if "<" not in response:
        return False
    return any(not isinstance(e, (Text, Malformed)) for e in parse(response))


def verify_annotation(response: str, annotated: str) -> str | None:
    """Check the annotator guarantees; returns None when they hold, else what failed.

    Checks: ``strip_tags(annotated) == response``, and the clean text unchanged by the tags
    (``clean_text(annotated) == clean_text(response)``: the clean text drops a list item a tag
    emptied, so a tag beside an empty item the response holds would lose it); no Malformed tag beyond those already in
    ``response``; every chunk closed and directly after its promise (split_threads then
    splice gives ``annotated`` back, with one chunk per promise); no sync inside a chunk; topics
    without newlines."""
    events = parse(annotated)
    stripped = "".join(e.text for e in events if isinstance(e, Text))
    if stripped != response:
        return "stripping the tags does not give the response back"
    if clean_text(annotated) != clean_text(response):  # what a reader is shown, and what a replay decodes
        return "a tag beside an empty list item of the response makes the clean text drop it"
    before = sum(isinstance(e, Malformed) for e in parse(response)) if "<" in response else 0
    if sum(isinstance(e, Malformed) for e in events) != before:
        return "a malformed tag appeared"
    th = split_threads(annotated)
    promises = [e for e in events if isinstance(e, Promise)]
    if len(th.chunks) != len(promises) or any(c.content is None or not c.closed for c in th.chunks):
        return "a promise without a closed chunk right after it"
    if splice(th.main, th.chunks) != annotated:
        return "split_threads/splice does not round-trip"
    inside = False
    for e in events:
        if isinstance(e, AsyncOpen):
            inside = True
        elif isinstance(e, AsyncClose):
            inside = False
        elif isinstance(e, Sync) and inside:
            return "a sync inside a chunk"
    if any("\n" in p.topic for p in promises):
        return "a topic holds a newline"
    return None


def _finish(response: str, forks: list[_Fork], syncs: list[int], count: CountTokens, name: str,
            topics: Sequence[str] | None = None) -> Annotation:
    if not forks:
        return Annotation(response, note=f"{name}: nothing to fork")
    annotated = _render(response, forks, syncs, count, topics)
    problem = verify_annotation(response, annotated)
    if problem is not None and len(forks) > 1:
        # leave out only the forks that fail alone (a tag beside an empty item of the answer),
        # keep the rest when they pass together; else the whole answer stays unannotated
        keep = [i for i, f in enumerate(forks)
                if verify_annotation(response, _render(response, [f], syncs, count,
                                                       None if topics is None else [topics[i]])) is None]
        if 0 < len(keep) < len(forks):
            sub = [forks[i] for i in keep]
            again = _render(response, sub, syncs, count, None if topics is None else [topics[i] for i in keep])
            if verify_annotation(response, again) is None:
                return Annotation(again, promises=len(sub), syncs=len(syncs), annotator=name,
                                  note=f"{name}: {len(forks) - len(sub)} of {len(forks)} forks left out ({problem})")
    if problem is not None:
        return Annotation(response, note=f"{name}: left unannotated ({problem})")
    return Annotation(annotated, promises=len(forks), syncs=len(syncs), annotator=name)


def _precheck(response: str, name: str) -> Annotation | None:
    if not isinstance(response, str):
        raise TypeError(f"a response must be a string, got {type(response).__name__}")
    if _has_tags(response):
        return Annotation(
            response,
            note=f"{name}: response contains text that parses as a PASTA-LANG tag; left unannotated "
            "(stripping it would not give the response back)",
        )
    return None


def _list_forks(response: str, unit: _Unit, count: CountTokens, min_tokens: int) -> list[_Fork]:
    if len(unit.items) < 2:
        return []  # a single-item list: nothing runs beside it
    return [
        _Fork(it.fork_start, it.content_end)
        for it in unit.items
        if it.content_end > it.content_start and count(response[it.content_start : it.content_end]) >= min_tokens
    ]


# --------------------------------------------------------------------------- annotators


def annotate_sot(
    response: str, count_tokens: CountTokens | None = None, *, min_chunk_tokens: int = MIN_CHUNK_TOKENS
) -> Annotation:
    """Skeleton-of-Thought style annotation (Ning et al., 2023, arXiv 2307.15337).

    Each point of a list with two or more points becomes ``<promise topic=LEAD tokens=N/>``
    followed by ``<async>point</async>`` (nested sub-lists, continuation lines and code inside
    the point belong to it); the marker, intro, headers and other text stay on the main thread.
    The promise goes right after the marker, the spaces after it the chunk's first characters
    (``1.<promise .../><async> **Point**``: a token boundary of the plain text).
    A ``<sync/>`` goes before the first paragraph, code block or unforked list that follows
    forked points (headers and further forked lists do not need it).

    Args:
        response: the plain response.
        count_tokens: ``text -> tokens`` for the promise lengths (default
            :func:`approx_token_count`); N is the point's length rounded to tens (min 10).
        min_chunk_tokens: points shorter than this are not forked.

    Returns an :class:`Annotation`; never raises on content (TypeError for a non-string)."""
    pre = _precheck(response, "sot")
    if pre is not None:
        return pre
    count = count_tokens or approx_token_count
    forks: list[_Fork] = []
    syncs: list[int] = []
    outstanding = False
    for unit in _units(response):
        unit_forks = _list_forks(response, unit, count, min_chunk_tokens) if unit.kind == "list" else []
        if unit.kind == "header" or unit_forks:
            forks += unit_forks
            outstanding |= bool(unit_forks)
            continue
        if outstanding:
            syncs.append(unit.start)
            outstanding = False
    return _finish(response, forks, syncs, count, "sot")


def _is_title(text: str) -> bool:
    """A paragraph that introduces what follows (ends with a colon) or is one bold line."""
    t = text.strip().rstrip("*_ ").rstrip()
    one_bold = "\n" not in text.strip() and bool(re.fullmatch(r"\s*(\*\*|__).+(\*\*|__)\s*:?\s*", text))
    return t.endswith(":") or one_bold


def annotate_apar(
    response: str, count_tokens: CountTokens | None = None, *, min_chunk_tokens: int = MIN_CHUNK_TOKENS
) -> Annotation:
    """APAR style annotation (Liu et al., 2024, arXiv 2401.06761): fork at the boundaries of
    list items and paragraphs.

    Every item of a list with two or more items forks (whole item, nested content included);
    every paragraph forks except the opening one (the response's first unit after any headers:
    the rest follows from it), titles (a paragraph ending with a colon, or one bold line), headers
    and code. No ``<sync/>`` is written: the end of the response joins every thread.

    Args and returns: as :func:`annotate_sot`."""
    pre = _precheck(response, "apar")
    if pre is not None:
        return pre
    count = count_tokens or approx_token_count
    forks: list[_Fork] = []
    opening = True  # no unit but headers seen yet
    for unit in _units(response):
        first, opening = opening, opening and unit.kind == "header"
        if unit.kind == "list":
            forks += _list_forks(response, unit, count, min_chunk_tokens)
        elif unit.kind == "para" and not first:
            body = response[unit.start : unit.end]
            if not _is_title(body) and count(body) >= min_chunk_tokens:
                # the promise goes at the paragraph's first non-space character, or on the space
                # before it when that space is a token of the word (an indented line, _token_start)
                start = _token_start(response, unit.start + (len(body) - len(body.lstrip())))
                forks.append(_Fork(start, unit.end))
    return _finish(response, forks, [], count, "apar")


def annotate_mixed(response: str, count_tokens: CountTokens | None = None) -> Annotation:
    """``sot`` where it forks (lists: a promise per point, a sync before the conclusion), else
    ``apar`` (paragraphs after the first fork). The training data of the shipped adapter: most
    answers with a list fork like Skeleton-of-Thought, prose answers fork like APAR.

    Args and returns: as :func:`annotate_sot`."""
    a = annotate_sot(response, count_tokens)
    if a.promises:
        return a
    b = annotate_apar(response, count_tokens)
    return b if b.promises else a


def annotate(response: str, annotator: str, count_tokens: CountTokens | None = None) -> Annotation:
    """Annotate with a text annotator by name (``sot``, ``apar`` or ``mixed``).

    Raises ValueError naming the known annotators for an unknown name, and for ``model``
    (which needs an engine: use :func:`annotate_with_model`) and ``endpoint`` (use
    :func:`pasta_engine.tools.annotate_endpoint.annotate_with_endpoint`)."""
    if annotator == "sot":
        return annotate_sot(response, count_tokens)
    if annotator == "apar":
        return annotate_apar(response, count_tokens)
    if annotator == "mixed":
        return annotate_mixed(response, count_tokens)
    if annotator == "model":
        raise ValueError("the 'model' annotator needs an engine: use annotate_with_model(engine, prompts)")
    if annotator == "endpoint":
        raise ValueError("the 'endpoint' annotator needs an endpoint: use "
                         "pasta_engine.tools.annotate_endpoint.annotate_with_endpoint(endpoint, instruction, response)")
    raise ValueError(f"unknown annotator {annotator!r}: known {list(ANNOTATORS)}")


def annotate_with_model(
    engine: Any, prompts: Sequence[str], params: Any = None, progress: bool = False
) -> list[Annotation]:
    """The ``model`` annotator: the engine's model answers each prompt in pasta mode (with the
    PASTA-LANG system prompt, as :meth:`~pasta_engine.Engine.generate` does); its annotated
    response (chunks spliced after their promises) is the annotation. The original response is
    not used: the model writes its own.

    Args:
        engine: a :class:`pasta_engine.Engine`.
        prompts: the instructions.
        params: :class:`~pasta_engine.SamplingParams` (default greedy, 256 tokens).

    Returns one :class:`Annotation` per prompt (``note`` lists the interpreter's diagnostics)."""
    results = engine.generate(list(prompts), params, mode="pasta", progress=progress)
    out = []
    for r in results:
        note = "; ".join(r.diagnostics[:5]) + (f"; ... {len(r.diagnostics) - 5} more" if len(r.diagnostics) > 5 else "")
        syncs = sum(isinstance(e, Sync) for e in parse(r.annotated_text))
        out.append(Annotation(r.annotated_text, promises=r.stats.forks, syncs=syncs, note=note or None,
                              annotator="model" if r.stats.forks else None))
    return out
