"""The ``independent`` annotator: fork where the meaning is independent, measured, not assumed.

The syntactic annotators (``sot``, ``apar``, ``mixed``) fork every list item and every paragraph
after the first. PASTA's claim (Jin et al., ICML 2025, arXiv 2502.11517, section 3) is that a model
learns *semantic* independence: a chunk forks only when it can be written without the sibling
chunks it will not see. This annotator keeps the syntactic candidates (list items of a list with
two or more items, paragraphs after the opening one that are not titles) and decides each by a
measurement, ``dependence(seen, alone, piece)``: how much better a reference model predicts the
piece when it sees what runs beside it (``seen``: all the text before the piece) than when it
sees only what its thread would see (``alone``: the same text with the outstanding forked chunks
cut out). A piece that refers to a sibling, continues it, or repeats it scores high; an
unrelated list item scores near zero (:class:`pasta_engine.train.independence.SiblingDependence`
is the measurement with a causal LM; any callable works, e.g. a reader's judgement).

Walking the answer in order with the set of outstanding forked chunks:

- a candidate with nothing outstanding forks;
- a candidate whose dependence on the outstanding chunks is at most ``threshold`` forks beside
  them; above it, a ``<sync/>`` goes before it (it then sees everything) and it forks as the
  first chunk of a new group;
- main-thread text of at least ``min_chunk_tokens`` tokens after forks (a conclusion, code, an
  unforked list) is measured the same way: above the threshold a ``<sync/>`` goes before it,
  else the main thread goes on without waiting. Shorter main text (markers, headers) never syncs.

Topics say what the chunk covers, not its first words: the chunk's bold title when it opens with
one, else its most specific words (highest inverse document frequency over the answers being
annotated, see :func:`document_frequencies`) in the order they appear; never a topic already
promised in the same answer. The checks of :func:`~pasta_engine.tools.annotate.verify_annotation`
apply, so ``strip_tags(annotated) == response`` always.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Callable, Iterable, Mapping, Sequence

from ..lang.grammar import LEANING_WORDS, topic_key
from ..lang.tags import AsyncClose, AsyncOpen, Promise, Sync, Text
from ..lang.tags import parse as parse_events
from .annotate import (
    _BOLD_LEAD, MIN_CHUNK_TOKENS, Annotation, CountTokens, _finish, _Fork, _is_title, _precheck, _token_start, _units,
    approx_token_count, topic_text,
)

__all__ = [
    "DEFAULT_THRESHOLD",
    "LexicalDependence",
    "Dependence",
    "PieceScore",
    "ForkCheck",
    "annotate_independent",
    "check_forks",
    "table_dependence",
    "descriptive_topic",
    "document_frequencies",
    "opens_with_topic",
]

#: ``dependence(seen, alone, piece) -> score``: how much ``piece`` needs what ``seen`` (the
#: answer before the piece) holds and ``alone`` (the same text with each outstanding forked chunk
#: replaced by its topic: what the piece's thread sees) does not. Higher is more dependent.
Dependence = Callable[[str, str, str], float]

#: Default threshold of :class:`LexicalDependence` (calibrated against a reader's labels; see
#: bench/results/independence-smollm2-cpu/README.md).
DEFAULT_THRESHOLD = 0.5

_WORD = re.compile(r"[^\W\d_](?:[^\W\d_]|['\-])*[^\W\d_]|[^\W\d_]")  # letters of any script
#: Function words and generic answer words, never a topic word.
_STOP = frozenset(
    """a about above after again against all also am an and any are as at be because been before being below between
    both but by can could did do does doing down during each even every few for from further had has have having he
    her here hers herself him himself his how however i if in into is it its itself just let like make makes many may
    me might more most much must my myself no nor not now of off on once only or other our ours ourselves out over
    own per rather same she should so some such than that the their theirs them themselves then there these they this
    those through thus to too under until up upon us use used using very was we well were what when where which while
    who whom why will with within without would you your yours yourself yourselves one two three first second third
    also another example examples include includes including important help helps way ways thing things lot able
    get gets good great new often sure various overall additionally however finally lastly""".split()
)


def _words(text: str) -> list[str]:
    return [w.lower() for w in _WORD.findall(text)]


def document_frequencies(texts: Iterable[str]) -> dict[str, float]:
    """Inverse document frequency of each lower-cased word over ``texts``: ``log((1 + n) / (1 +
    df)) + 1`` (scikit-learn's smoothed idf), where ``n`` is the number of texts and ``df`` how
    many hold the word. Words never seen get the largest value when looked up by
    :func:`descriptive_topic`."""
    df: dict[str, int] = {}
    n = 0
    for t in texts:
        n += 1
        for w in set(_words(t)):
            df[w] = df.get(w, 0) + 1
    return {w: math.log((1 + n) / (1 + d)) + 1 for w, d in df.items()}


def descriptive_topic(content: str, taken: Iterable[str] = (), idf: Mapping[str, float] | None = None,
                      words: int = 3) -> str:
    """A topic that says what ``content`` covers, in at most :data:`TOPIC_WORDS` words,
    :data:`TOPIC_CHARS` characters and :data:`~pasta_engine.lang.grammar.MAX_TOPIC_BYTES` bytes,
    never equal to a topic in ``taken`` as the grammar compares them
    (:func:`~pasta_engine.lang.grammar.topic_key`: case, spacing and punctuation ignored, so
    "Step-by-step" clashes with "Step by step"; the grammar never lets such a topic end).

    The chunk's bold title when it opens with one (the author's own plan of the chunk; its
    leading words without a letter dropped, ``"1. Recognition"`` -> ``"Recognition"``, see
    :func:`~pasta_engine.tools.annotate.topic_text`); else the ``words`` most specific words of
    its first 60 words (highest ``idf``, unknown words highest, function words never; ties by
    position), in the order they appear. When that topic is taken, the next most specific word
    is added or swapped in; ``point N`` is the last resort. Never holds ``"``, ``<``, ``>`` or a
    newline, and opens with a letter."""
    taken_l = {topic_key(t) for t in taken}
    m = _BOLD_LEAD.match(content.lstrip().split("\n", 1)[0])
    if m:
        title = topic_text(m.group(2))
        if title and topic_key(title) not in taken_l:
            return title
    seq = [w for w in _words(" ".join(content.split()[:60])) if w not in _STOP and len(w) > 2]
    order: dict[str, int] = {}
    for i, w in enumerate(seq):
        order.setdefault(w, i)
    # rarest first (a word the table never saw counts as the rarest), then by position
    ranked = sorted(order, key=lambda w: (-(idf.get(w, math.inf) if idf else 1.0), order[w]))
    head = ranked[: words - 1]
    for last in ranked[words - 1:] or [None]:  # the next rarest word swapped in while the topic is taken
        topic = topic_text(" ".join(sorted(head + ([last] if last else []), key=order.__getitem__)))
        if topic and topic_key(topic) not in taken_l:
            return topic
    n = len(taken_l) + 1
    while topic_key(f"point {n}") in taken_l:
        n += 1
    return f"point {n}"


def opens_with_topic(topic: str, content: str) -> bool:
    """Whether ``content`` opens with its own ``topic`` (its first words, case and punctuation
    ignored): a topic that restates the chunk's opening instead of planning it."""
    t = _words(topic)
    return bool(t) and _words(content)[: len(t)] == t


#: Openings that lean on what came before: connectives, anaphora, sequence words. A piece that
#: opens with one continues a sibling ("Finally, ...", "This means ...", "Another ..."). Its single
#: words are the grammar's :data:`~pasta_engine.lang.grammar.LEANING_WORDS` (the ones
#: ``Limits.independent_topics`` keeps out of a topic's opening), then phrases and "step 2".
_LEANS_ON = re.compile(
    "(" + "|".join([*sorted(LEANING_WORDS - {"step"}), "it's", "in fact", "in summary", "in conclusion", "in short",
                    "as mentioned", "as a result", "some other", "on the other hand", r"step\s*\d+"]) + r")\b",
    re.IGNORECASE)


def _bigrams(text: str) -> set[tuple[str, str]]:
    w = _words(text)
    return set(zip(w, w[1:]))


@dataclass
class LexicalDependence:
    """A piece's dependence on the chunks its thread will not see, read from its words (a
    :data:`Dependence`; no model). Three signals, summed:

    - **new names**: the fraction of the piece's content words (not function words, 3+ letters)
      that occur in the hidden chunks and nowhere the thread can see (the question, the visible
      answer): a term only a sibling introduced ("the canjo", "Galileo himself");
    - **repetition**: the fraction of the piece's word bigrams that occur only in the hidden
      chunks: a piece that repeats a sibling;
    - **a leaning opening**, worth ``opening_weight``: the piece opens with a connective, an
      anaphor or a step number ("Finally", "This", "Another", "In fact", "Step 3").

    The hidden text is what ``seen`` holds and ``alone`` does not. Checked against a reader's
    labels (bench/results/independence-smollm2-cpu/): it ranks the reader's dependent pieces
    above the independent ones with an AUC of 0.75 on the calibration set, where the base
    model's context-removal likelihood change (:class:`pasta_engine.train.independence.SiblingDependence`)
    scored 0.54.

    Args:
        question: the user's instruction (visible to every thread).
        opening_weight: the weight of a leaning opening."""

    question: str = ""
    opening_weight: float = 0.5

    def parts(self, seen: str, alone: str, piece: str) -> dict[str, float]:
        """The three signals (``new_names``, ``repetition``, ``leaning_opening``) of ``piece``."""
        visible = set(_words(alone)) | set(_words(self.question))
        hidden = set(_words(seen)) - visible
        content = {w for w in _words(piece) if w not in _STOP and len(w) > 2}
        names = len(content & hidden) / len(content) if content else 0.0
        pb = _bigrams(piece)
        hb = _bigrams(seen) - _bigrams(alone) - _bigrams(self.question)
        rep = len(pb & hb) / len(pb) if pb else 0.0
        opening = re.sub(r"^[\s*_#>`\-]+", "", piece)
        lean = 1.0 if _LEANS_ON.match(opening) else 0.0
        return {"new_names": names, "repetition": rep, "leaning_opening": lean}

    def __call__(self, seen: str, alone: str, piece: str) -> float:
        p = self.parts(seen, alone, piece)
        return p["new_names"] + p["repetition"] + self.opening_weight * p["leaning_opening"]


def table_dependence(pieces: Iterable[Mapping[str, float]], default: Dependence | None = None) -> Dependence:
    """A :data:`Dependence` answering from measured or labelled pieces of one answer (each a
    mapping with ``start``, the piece's first character in the answer, and ``dependence``),
    looked up by the piece's start (``len(seen)``). A piece not in the table asks ``default``
    (0.0 without one). What a reader's labels or an earlier measurement become."""
    by_start = {int(p["start"]): float(p["dependence"]) for p in pieces}

    def dependence(seen: str, alone: str, piece: str) -> float:
        hit = by_start.get(len(seen))
        if hit is not None:
            return hit
        return default(seen, alone, piece) if default is not None else 0.0

    return dependence


def _alone(text: str, outstanding: Sequence[tuple[int, int, str]], end: int) -> str:
    """``text[:end]`` as the thread of a piece starting at ``end`` sees it: each outstanding
    sibling ``(start, stop, topic)`` (character offsets) replaced by its topic, the promise its
    thread saw instead of its text."""
    parts, at = [], 0
    for start, stop, topic in outstanding:
        parts += [text[at:start], topic]
        at = stop
    parts.append(text[at:end])
    return "".join(parts)


@dataclass
class PieceScore:
    """One measured piece: its character span in the response, whether it was a fork candidate,
    its dependence on the outstanding chunks (nats per token), and what the annotator did
    (``fork``, ``sync+fork``, ``main`` or ``sync``)."""

    start: int
    end: int
    candidate: bool
    dependence: float
    decision: str


@dataclass
class _Piece:
    start: int  # where a fork of it starts (a list item: right after its marker)
    at: int  # where its text starts (after a marker's spaces): what is measured, labelled and scored
    end: int
    candidate: bool

    def text(self, response: str) -> str:
        return response[self.at:self.end]


def _pieces(response: str, count: CountTokens, min_tokens: int) -> list[_Piece]:
    """Fork candidates (list items of lists with two or more items, paragraphs after the opening
    one that are not titles) and main-thread units, in order, each at least ``min_tokens`` long
    (shorter text stays on the main thread unmeasured)."""
    out: list[_Piece] = []
    opening = True
    for unit in _units(response):
        first, opening = opening, opening and unit.kind == "header"
        if unit.kind == "list":
            many = len(unit.items) >= 2
            for it in unit.items:
                if it.content_end > it.content_start and count(response[it.content_start:it.content_end]) >= min_tokens:
                    # from right after the marker, as the other annotators fork an item: a token
                    # boundary of the plain text ("1." " **Point"), not after the marker's space
                    out.append(_Piece(it.fork_start, it.content_start, it.content_end, many))
        elif unit.kind in ("para", "code"):
            body = response[unit.start:unit.end]
            if count(body) < min_tokens:
                continue
            at = unit.start + (len(body) - len(body.lstrip()))
            # a fork starts on the space before an indented line's first word when that space is
            # the word's own (a token boundary of the plain text, see annotate._token_start)
            candidate = unit.kind == "para" and not first and not _is_title(body)
            out.append(_Piece(_token_start(response, at), at, unit.end, candidate))
    return out


def _drop_lone_forks(response: str, forks: list[_Fork], syncs: list[int], count: CountTokens,
                     min_tokens: int) -> tuple[list[_Fork], list[int]]:
    """A fork with nothing beside it saves no step and costs its tags: a group (forks up to the
    next sync or the end) of one chunk followed by less than ``min_tokens`` tokens of main-thread
    text is decoded inline, and the sync that closed it goes too."""
    bounds = sorted(syncs) + [len(response)]
    keep: list[_Fork] = []
    drop_syncs: set[int] = set()
    at = 0
    for b in bounds:
        group = [f for f in forks if at <= f.start < b]
        if len(group) == 1 and count(response[group[0].end:b]) < min_tokens:
            if b < len(response):
                drop_syncs.add(b)
        else:
            keep += group
        at = b
    return keep, [s for s in syncs if s not in drop_syncs]


def annotate_independent(
    response: str,
    dependence: Dependence,
    count_tokens: CountTokens | None = None,
    *,
    threshold: float = DEFAULT_THRESHOLD,
    idf: Mapping[str, float] | None = None,
    min_chunk_tokens: int = MIN_CHUNK_TOKENS,
) -> tuple[Annotation, list[PieceScore]]:
    """Annotate ``response`` where the measured meaning is independent (see the module docstring).

    Args:
        response: the plain response.
        dependence: ``(seen, alone, piece) -> nats per token`` (:data:`Dependence`); called only
            for pieces that follow outstanding forked chunks.
        count_tokens: ``text -> tokens`` (default :func:`approx_token_count`): promise lengths
            (rounded to tens, PASTA's Pred-10x) and the minimum chunk length.
        threshold: a piece whose dependence is above this many nats per token does not run beside
            the outstanding chunks (a ``<sync/>`` goes before it).
        idf: word -> inverse document frequency for the topics (:func:`document_frequencies`).
        min_chunk_tokens: shorter list items and paragraphs are neither forked nor measured.

    Returns ``(annotation, scores)``: the :class:`Annotation` (``annotator`` is ``independent``
    when it forks) and a :class:`PieceScore` per measured or forked piece. Never raises on
    content (TypeError for a non-string response)."""
    pre = _precheck(response, "independent")
    if pre is not None:
        return pre, []
    count = count_tokens or approx_token_count
    forks: list[_Fork] = []
    topics: list[str] = []
    syncs: list[int] = []
    scores: list[PieceScore] = []
    outstanding: list[tuple[_Piece, str]] = []

    def fork(p: _Piece) -> None:
        topic = descriptive_topic(p.text(response), topics, idf)
        forks.append(_Fork(p.start, p.end))
        topics.append(topic)
        outstanding.append((p, topic))

    for p in _pieces(response, count, min_chunk_tokens):
        if not outstanding:
            if p.candidate:
                fork(p)
                scores.append(PieceScore(p.at, p.end, True, 0.0, "fork"))
            continue
        alone = _alone(response, [(o.at, o.end, topic) for o, topic in outstanding], p.at)
        dep = float(dependence(response[:p.at], alone, p.text(response)))
        if dep > threshold:
            syncs.append(p.start)
            outstanding.clear()
            decision = "sync"
        else:
            decision = "main"
        if p.candidate:
            fork(p)
            decision = "sync+fork" if decision == "sync" else "fork"
        scores.append(PieceScore(p.at, p.end, p.candidate, dep, decision))
    kept, syncs = _drop_lone_forks(response, forks, syncs, count, min_chunk_tokens)
    topics = [t for f, t in zip(forks, topics) if f in kept]
    forks = kept
    return _finish(response, forks, syncs, count, "independent", topics), scores


@dataclass
class ForkCheck:
    """One fork of an annotated answer, checked: its ``topic``, its chunk's text, its
    ``dependence`` on the sibling chunks outstanding when it forked, whether it ``passes`` the
    independence test (dependence at most the threshold), and whether it ``opens_with_topic``."""

    topic: str
    chunk: str
    dependence: float
    passes: bool
    opens_with_topic: bool


def check_forks(annotated: str, dependence: Dependence, threshold: float = DEFAULT_THRESHOLD) -> list[ForkCheck]:
    """The forks of an annotated PASTA-LANG answer (a model's own, or an annotator's), each
    checked against the chunks outstanding beside it: ``seen`` is the clean text before the
    chunk, ``alone`` the same with each outstanding sibling's text replaced by its topic (what the
    chunk's thread saw; a ``<sync/>`` ends the outstanding set). Malformed tags are text; a chunk
    never closed counts to the end. Never raises on content."""
    seen: list[str] = []  # clean text so far (main and chunks, in reading order)
    outstanding: list[tuple[int, int, str]] = []  # each open sibling: start, end (in seen's characters), topic
    out: list[ForkCheck] = []
    topic: str | None = None
    chunk: list[str] | None = None
    chunk_start = 0

    def close() -> None:
        nonlocal chunk, topic
        if chunk is None:
            return
        text, so_far = "".join(chunk), "".join(seen)
        dep = (float(dependence(so_far[:chunk_start], _alone(so_far, outstanding, chunk_start), text))
               if outstanding and text.strip() else 0.0)
        out.append(ForkCheck(topic or "", text, dep, dep <= threshold, opens_with_topic(topic or "", text)))
        outstanding.append((chunk_start, chunk_start + len(text), topic or ""))
        chunk, topic = None, None

    for e in parse_events(annotated):
        if isinstance(e, Promise):
            topic = e.topic
        elif isinstance(e, AsyncOpen):
            chunk, chunk_start = [], sum(map(len, seen))
        elif isinstance(e, AsyncClose):
            close()
        elif isinstance(e, Sync):
            close()
            outstanding.clear()
        elif isinstance(e, Text):  # a malformed tag's characters come as TagText (a Text) after its diagnostic
            t = e.text
            if chunk is not None:
                chunk.append(t)
            seen.append(t)
    close()
    return out
