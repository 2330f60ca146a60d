"""The Multiverse dialect's annotator: a reference answer's markdown list as one parallel block.

Multiverse (:mod:`pasta_engine.lang.multiverse`; Yang et al. 2025, arXiv 2506.09991, section 4,
where the paper's data is rewritten by a model into its structure) decodes a block's paths in
parallel after a goal that outlines them. This annotator writes that structure from an answer's
own text, without a model: in the answer's largest list of two or more items (by tokens),

* the text before the list stays outside the block;
* each item is one ``<Path>`` (its marker, text, nested lines and the line breaks up to the next
  item: the path's body is the answer's text, verbatim), headed by :func:`~pasta_engine.lang.multiverse.path_header`;
* each item has an ``<Outline>`` ``i: lead`` (its bold header, else its words up to a colon, dash
  or sentence end: planning, never shown);
* the text after the list is the block's ``<Conclusion>``.

Only tags are inserted, so the dialect's clean text of the trace equals the answer exactly; that
is checked on every output, and an annotation that fails it is not kept (the answer comes back
unannotated). Answers without such a list, and answers that already hold Multiverse tag text,
stay unannotated.
"""

from __future__ import annotations

from typing import Callable

from ..lang.multiverse import CONCLUSION, GOAL, MULTIVERSE, OUTLINE, PARALLEL, PATH, path_header
from .annotate import _ITEM, _topic, _units, approx_token_count

__all__ = ["multiverse_trace", "multiverse_lists"]

_TAG_TEXTS = tuple(f"<{n}>" for n in (PARALLEL, GOAL, OUTLINE, PATH, CONCLUSION)) + \
    tuple(f"</{n}>" for n in (PARALLEL, GOAL, OUTLINE, PATH, CONCLUSION))


def _line_start(text: str, at: int) -> int:
    return text.rfind("\n", 0, at) + 1


def multiverse_lists(text: str) -> list[list[tuple[int, int]]]:
    """The lists of ``text`` a block could hold, in order: per list of two or more items, each
    item's span ``(start, end)`` as a path's body (character offsets: from its line's start to
    the next item's line start; the last item to its last non-space character)."""
    out = []
    for unit in _units(text):
        if unit.kind != "list" or len(unit.items) < 2:
            continue
        starts = [unit.start] + [_line_start(text, it.content_start) for it in unit.items[1:]]
        ends = starts[1:] + [unit.items[-1].content_end]
        out.append(list(zip(starts, ends)))
    return out


def _lead(item: str, i: int) -> str:
    """An item's outline: its lead words without its list marker (never tag text)."""
    m = _ITEM.match(item)
    return _topic(item[m.end():] if m else item, i)


def multiverse_trace(text: str, count_tokens: Callable[[str], int] | None = None) -> str:
    """``text`` (an answer, e.g. an AlpacaEval reference) as a Multiverse trace (see the module
    docstring), or ``text`` itself when it has no list of two or more items, already holds
    Multiverse tag text, or the annotation's clean text would not equal it.

    Args:
        text: the answer.
        count_tokens: ``text -> tokens`` (the model's canonical count), to pick the largest
            list; None: :func:`~pasta_engine.tools.annotate.approx_token_count`.

    Never raises on content."""
    if any(t in text for t in _TAG_TEXTS):
        return text
    lists = multiverse_lists(text)
    if not lists:
        return text
    count = count_tokens or approx_token_count
    spans = max(lists, key=lambda sp: count(text[sp[0][0]: sp[-1][1]]))
    outlines = "".join(f"<{OUTLINE}>{i}: {_lead(text[s:e], i)}</{OUTLINE}>" for i, (s, e) in enumerate(spans, 1))
    paths = "".join(f"{path_header(i)}{text[s:e]}</{PATH}>" for i, (s, e) in enumerate(spans, 1))
    trace = (f"{text[: spans[0][0]]}<{PARALLEL}><{GOAL}>{outlines}</{GOAL}>{paths}"
             f"<{CONCLUSION}>{text[spans[-1][1]:]}</{CONCLUSION}></{PARALLEL}>")
    return trace if MULTIVERSE.clean_text(trace) == text else text
