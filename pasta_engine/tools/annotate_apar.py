"""The APAR dialect's annotator: a reference answer as an APAR trace (``[Fork]`` after each list
item's header, the item's body in a child).

Not to be confused with PASTA-LANG's ``apar`` annotator (:func:`pasta_engine.tools.annotate.annotate_apar`,
``--annotator apar``), which writes PASTA-LANG promises *in APAR's style*. This one writes the APAR
dialect itself (:mod:`pasta_engine.lang.apar`; Liu et al. 2024, "APAR: LLMs Can Do Auto-Parallel
Auto-Regressive Decoding", arXiv 2401.06761, section 3): in a list of two or more items, each
item's header is followed by ``[Fork][Child]``, and its body (the rest of the item: nested lines
and sub-lists included) by ``[/Child]``; the main thread goes on with the next item's header, and
everything joins at the end of the response. The answer's text is never changed: only markers
are inserted, so the dialect's clean text of the trace equals the answer exactly (checked on every
output; an annotation that fails the check is not kept, and the answer comes back unannotated).

An item's header is its bold lead (``**Sleep well**`` or ``__Sleep well__``, with a colon right
after it), else its words up to a colon or a spaced dash when one comes within
:data:`HEADER_WORDS` words, else its first :data:`LEAD_WORDS` words. An item whose body is shorter
than ``min_body_tokens`` tokens is not forked. Answers without such a list, and answers that
already hold APAR marker text, stay unannotated.
"""

from __future__ import annotations

import re
from typing import Callable

from ..lang.apar import APAR, CHILD, CHILD_CLOSE, FORK
from ..lang.tags import Text
from .annotate import _units, approx_token_count

__all__ = ["apar_trace", "apar_forks", "HEADER_WORDS", "LEAD_WORDS", "MIN_BODY_TOKENS"]

#: A colon or spaced dash within this many words of an item's start ends its header.
HEADER_WORDS = 8
#: Without a bold lead, colon or dash, the header is this many words.
LEAD_WORDS = 3
#: Items whose body is shorter than this many tokens are not forked (nothing worth a thread).
MIN_BODY_TOKENS = 10

_BOLD = re.compile(r"(\*\*|__)[^\n]+?\1:?")
_WORD = re.compile(r"\S+")
_STOP = re.compile(r":|\s[-\u2013\u2014](?=\s)")


def _header_end(text: str, start: int, end: int) -> int:
    """Offset just past the header of the item ``text[start:end]`` (see the module docstring);
    ``start`` when the item has no usable header."""
    m = _BOLD.match(text, start, end)
    if m:
        return m.end()
    line_end = text.find("\n", start, end)
    line_end = end if line_end < 0 else line_end
    words = list(_WORD.finditer(text, start, line_end))
    limit = words[min(HEADER_WORDS, len(words)) - 1].end() if words else start
    stop = _STOP.search(text, start, limit)
    if stop:
        return stop.end() if stop.group() == ":" else stop.start()
    if len(words) <= LEAD_WORDS:
        return start  # a short item is all header: no body to fork
    return words[LEAD_WORDS - 1].end()


def apar_forks(text: str, count_tokens: Callable[[str], int] | None = None,
               min_body_tokens: int = MIN_BODY_TOKENS) -> list[tuple[int, int]]:
    """Where :func:`apar_trace` forks ``text``: ``(header_end, body_end)`` per forked item,
    in order (``[Fork][Child]`` goes at ``header_end``, ``[/Child]`` at ``body_end``)."""
    count = count_tokens or approx_token_count
    forks: list[tuple[int, int]] = []
    for unit in _units(text):
        if unit.kind != "list" or len(unit.items) < 2:
            continue
        for item in unit.items:
            h = _header_end(text, item.content_start, item.content_end)
            body = text[h:item.content_end]
            if h > item.content_start and body.strip() and count(body) >= min_body_tokens:
                forks.append((h, item.content_end))
    return forks


def apar_trace(text: str, count_tokens: Callable[[str], int] | None = None, *,
                  min_body_tokens: int = MIN_BODY_TOKENS) -> str:
    """``text`` (an AlpacaEval reference answer) as a trace in the APAR dialect (see the module
    docstring); ``APAR.clean_text`` of the result equals ``text`` exactly.

    Args:
        text: the answer.
        count_tokens: ``text -> tokens`` for the body lengths (a tokenizer's count; default
            :func:`~pasta_engine.tools.annotate.approx_token_count`).
        min_body_tokens: items with a shorter body are not forked.

    Returns the trace, or ``text`` itself when nothing forks, when ``text`` already holds APAR
    marker text, or when the annotation would not give ``text`` back. Raises TypeError for a
    non-string ``text``; never on content."""
    if not isinstance(text, str):
        raise TypeError(f"text must be a string, got {type(text).__name__}")
    if any(type(e) is not Text for e in APAR.parse(text)):
        return text  # marker-like text of its own: its clean text could never equal it
    forks = apar_forks(text, count_tokens, min_body_tokens)
    if not forks:
        return text
    out, at = [], 0
    for h, e in forks:
        out += [text[at:h], FORK, CHILD, text[h:e], CHILD_CLOSE]
        at = e
    out.append(text[at:])
    annotated = "".join(out)
    th = APAR.split_threads(annotated)
    ok = (APAR.clean_text(annotated) == text and len(th.chunks) == len(forks) and not th.diagnostics
          and APAR.splice(th.main, th.chunks) == annotated)
    return annotated if ok else text
