"""Speedup metrics, defined once (docs/DESIGN.md section 3; Jin et al., ICML 2025, section 5).

The question a user asks is whether PASTA delivers the answer's *content* sooner than decoding
that content one token at a time. Tag tokens are overhead, not content, so the headline figure
counts only content.

Units: a *step* is one forward pass that samples tokens for a request. The prompt's prefill
pass counts as the first step because it samples the first response token, so a sequential
response of T sampled tokens (EOS included) takes T steps and has critical path T.

* content tokens: the clean text (tags stripped) under the canonical tokenization
  (``pasta_engine.lang.tokenization.encode_text``): no tag tokens, no end-of-sequence token.
* critical path: steps the response needs with unlimited parallel width, from its structure:
  the main thread samples one token per step; a child forked at the main token sampled at
  step ``s`` samples its ``L`` tokens at steps ``s+1 .. s+L``; after a sync completed at step
  ``s`` the main thread's next token comes at ``max(s, ends of outstanding children) + 1``;
  the response ends when the main thread and every child have ended. Tag tokens are on it.
* **content speedup** (the headline): theoretical = content tokens / critical path
  (:func:`content_speedup`); realized = wall time of decoding the clean text sequentially /
  wall time of the PASTA run, same weights (:func:`realized_speedup`). The EOS step is not
  content, so a sequential answer of T content tokens ended by EOS has T / (T + 1).
  Aggregated over prompts by geometric mean (:func:`geomean`), as the paper does.
* token parallelism = tokens sampled by all threads, tags and EOS included / critical path
  (:func:`token_parallelism`): how parallel the run was (the mean number of threads sampling
  per step), not how much sooner the content came.
* tag tokens = tokens sampled - EOS tokens sampled - content tokens (:func:`tag_tokens`), and
  the tag-token fraction = tag tokens / tokens sampled (:func:`tag_token_fraction`).
* end-to-end speedup = wall time of a sequential baseline answering the prompt / wall time of
  the PASTA answer (:func:`realized_speedup` of two different answers). Always reported with
  the length ratio (:func:`length_ratio`: content tokens of PASTA / of the baseline) and the
  fraction of answers cut by the token budget (:func:`cut_fraction`): a shorter answer is not a
  faster one.
* realized/theoretical ratio (:func:`realized_over_theoretical`): how much of the available
  content speedup the engine turns into time.

Offline quality proxies of an answer's clean text (text only, no model; issue 19 item 6): the
fraction of repeated lines (:func:`repeated_line_fraction`), distinct-2 (:func:`distinct_n`),
empty list items (:func:`empty_list_items`) and tag text shown to the user
(:func:`has_tag_text`), gathered per answer by :func:`text_proxies` and per set of answers by
:func:`summarize_text_proxies` (with the fraction cut by the token budget). Proxies, not a
judge: ``bench learned`` also writes AlpacaEval ``model_outputs`` for one.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

from .lang.tags import is_empty_list_item

__all__ = [
    "ResponseStructure",
    "critical_path",
    "simulate_steps",
    "content_speedup",
    "token_parallelism",
    "content_token_count",
    "tag_tokens",
    "tag_token_fraction",
    "realized_speedup",
    "realized_over_theoretical",
    "length_ratio",
    "cut_fraction",
    "theoretical_speedup_vs_baseline",
    "step_speedup",
    "geomean",
    "geomean_positive",
    "TAG_TEXT_MARKERS",
    "repeated_line_fraction",
    "distinct_n",
    "empty_list_items",
    "has_tag_text",
    "opens_with_refusal",
    "text_proxies",
    "summarize_text_proxies",
    "empty_list_items_from_tags",
]


@dataclass
class ResponseStructure:
    """Token counts of one response, as the interpreter decoded it: a tree of threads.

    Attributes:
        main_tokens: tokens the main thread sampled (EOS included).
        forks: ``(k, L)`` per child in fork order: forked after its parent's k-th sampled
            token (1-based), sampled L tokens (content, closing tag or EOS).
        syncs: main-thread token indices (1-based) that completed a join (``<sync/>``; in a
            dialect whose fork is also a join, the fork's token).
        inserted: tokens the interpreter inserted (the ``<async>`` tags of all children, and
            any text a dialect inserts at a join).
        parents: per child, its parent: 0 the main thread, ``j >= 1`` the child ``forks[j-1]``
            (which comes before it); empty: every child's parent is the main thread (PASTA-LANG).
        fork_syncs: per child, the indices (1-based, into its own sampled tokens) that
            completed a join of its own children; empty: none (no nesting).
    """

    main_tokens: int
    forks: list[tuple[int, int]] = field(default_factory=list)
    syncs: list[int] = field(default_factory=list)
    inserted: int = 0
    parents: list[int] = field(default_factory=list)
    fork_syncs: list[list[int]] = field(default_factory=list)

    @property
    def tokens(self) -> int:
        """Tokens sampled by all threads."""
        return self.main_tokens + sum(n for _, n in self.forks)

    @property
    def spliced_tokens(self) -> int:
        """Tokens of the spliced response, tags included (sampled plus inserted): the steps
        one thread takes to decode the annotated response (not the content: see
        :func:`content_speedup`)."""
        return self.tokens + self.inserted


def critical_path(s: ResponseStructure) -> int:
    """Steps with unlimited width (see the module docstring): :func:`simulate_steps` with no
    width limit. Raises ValueError as :func:`simulate_steps` does."""
    return simulate_steps(s, None)


def _threads(s: ResponseStructure) -> tuple[list[int], list[set[int]], dict[tuple[int, int], list[int]]]:
    """Per thread (0 the main thread, ``j`` the child ``forks[j-1]``): tokens to sample, join
    indices, and the children each ``(thread, k)`` forks. Raises ValueError for an index
    outside its thread or a parent that does not come before its child."""
    if s.parents and len(s.parents) != len(s.forks):
        raise ValueError(f"parents has {len(s.parents)} entries for {len(s.forks)} forks")
    if s.fork_syncs and len(s.fork_syncs) != len(s.forks):
        raise ValueError(f"fork_syncs has {len(s.fork_syncs)} entries for {len(s.forks)} forks")
    total = [s.main_tokens] + [n for _, n in s.forks]
    syncs = [set(s.syncs)] + [set(s.fork_syncs[j]) if s.fork_syncs else set() for j in range(len(s.forks))]
    forks_at: dict[tuple[int, int], list[int]] = {}
    for j, (k, n) in enumerate(s.forks, start=1):
        parent = s.parents[j - 1] if s.parents else 0
        if not 0 <= parent < j:
            raise ValueError(f"fork {j} has parent {parent}: a parent comes before its child")
        if not 1 <= k <= total[parent] or n < 0:
            who = "a main thread" if parent == 0 else f"thread {parent}"
            raise ValueError(f"fork ({k}, {n}) outside {who} of {total[parent]} tokens")
        forks_at.setdefault((parent, k), []).append(j)
    for t, ks in enumerate(syncs):
        for k in ks:
            if not 1 <= k <= total[t]:
                who = "a main thread" if t == 0 else f"thread {t}"
                raise ValueError(f"sync at {k} outside {who} of {total[t]} tokens")
    return total, syncs, forks_at


def simulate_steps(s: ResponseStructure, max_threads: int | None = None) -> int:
    """Steps a response takes at a width of ``max_threads`` sampling threads (None =
    unlimited), under the interpreter's policy: threads in fork order, the main thread first.
    The one simulation of the interpreter's timing: at unlimited width it is the critical path,
    at width 1 it is ``s.tokens``.

    A step samples one token for each runnable thread: every started thread with tokens left
    that is not stalled at a join. A child forked at its parent's k-th token starts in the next
    step; a join completed at a thread's k-th token stalls it until every child it forked so
    far has *finished*: sampled all its tokens, and every child of its own has finished (a
    thread's end is an implicit join of its children; docs/DESIGN.md section 2). The response
    ends when the main thread has finished.

    Raises ValueError for a fork or sync index outside its thread, a parent that does not
    come before its child, or a width < 1."""
    total, syncs, forks_at = _threads(s)
    if max_threads is not None and max_threads < 1:
        raise ValueError(f"max_threads must be >= 1, got {max_threads}")
    n = len(total)
    done = [0] * n
    stalled = [False] * n
    children: list[list[int]] = [[] for _ in range(n)]
    outstanding: list[list[int]] = [[] for _ in range(n)]
    started = [0]  # in fork order

    def finished(t: int) -> bool:
        return done[t] >= total[t] and all(finished(c) for c in children[t])

    steps = 0
    while not finished(0):
        for t in started:
            if stalled[t] and all(finished(c) for c in outstanding[t]):
                stalled[t], outstanding[t] = False, []
        runnable = [t for t in started if done[t] < total[t] and not stalled[t]]
        if max_threads is not None:
            runnable = runnable[:max_threads]
        if not runnable:  # cannot happen: a stalled thread waits only on threads that can run
            raise ValueError("the structure deadlocks: a thread waits on itself")
        steps += 1
        for t in runnable:
            done[t] += 1
            for c in forks_at.get((t, done[t]), ()):
                started.append(c)
                children[t].append(c)
                outstanding[t].append(c)
            if done[t] in syncs[t]:
                stalled[t] = True
    return steps


def content_speedup(content_tokens: int, critical: int) -> float:
    """The theoretical content speedup, the headline figure (docs/DESIGN.md section 3): content
    tokens / critical path (tokens / steps).

    Args:
        content_tokens: tokens of the clean text (tags stripped) under the canonical
            tokenization, no tag tokens and no EOS.
        critical: the critical path in steps (:func:`critical_path`); tag tokens are on it.

    A response without content has 0. Raises ValueError for a negative token count or a
    non-positive critical path."""
    if content_tokens < 0:
        raise ValueError(f"content tokens must be >= 0, got {content_tokens}")
    if critical <= 0:
        raise ValueError(f"the critical path must be positive, got {critical}")
    return content_tokens / critical


def token_parallelism(s: ResponseStructure, critical: int | None = None) -> float:
    """Tokens sampled by all threads (tags and EOS included) / critical path (tokens / steps):
    the mean number of threads sampling per step, how parallel the run was, not how much
    sooner its content came (that is :func:`content_speedup`). ``critical``: the critical path
    when already computed. Raises ValueError for a structure with no step."""
    cp = critical or critical_path(s)
    if cp <= 0:
        raise ValueError("token parallelism of a response with no step")
    return s.tokens / cp


def content_token_count(canonical_tokens: int, tokens_decoded: int, eos_tokens: int) -> int:
    """The content tokens of a response (tokens): its clean text's length under the canonical
    tokenization (``canonical_tokens``), at most the tokens it sampled that were not EOS
    (``tokens_decoded - eos_tokens``).

    The cap: a model can write text in tokens that the canonical tokenization splits into more
    (a byte-fallback character, an odd merge); counting those would report content the run never
    decoded, and an answer that never forked a content speedup above 1. Raises ValueError for a
    negative count."""
    if min(canonical_tokens, tokens_decoded, eos_tokens) < 0:
        raise ValueError(f"token counts must be >= 0, got {canonical_tokens}, {tokens_decoded}, {eos_tokens}")
    return min(canonical_tokens, max(0, tokens_decoded - eos_tokens))


def tag_tokens(tokens_decoded: int, content_tokens: int, eos_tokens: int) -> int:
    """Tokens sampled that are not content: ``tokens_decoded - eos_tokens - content_tokens``,
    at least 0 (tokens).

    The tag tokens, plus the tokens of text the clean output drops (a malformed or partial
    tag); a model whose own tokens merge differently than the canonical tokenization of the
    clean text moves it by a few tokens either way (0 is the floor)."""
    return max(0, tokens_decoded - eos_tokens - content_tokens)


def tag_token_fraction(tags: int, tokens_decoded: int) -> float:
    """Tag tokens / tokens sampled by all threads (:func:`tag_tokens`; 0 when nothing was
    sampled). Raises ValueError for negative counts."""
    if tags < 0 or tokens_decoded < 0:
        raise ValueError(f"token counts must be >= 0, got {tags} and {tokens_decoded}")
    return tags / tokens_decoded if tokens_decoded else 0.0


def theoretical_speedup_vs_baseline(s: ResponseStructure, baseline_tokens: int) -> float:
    """The paper's variant: a sequential baseline answer's length / critical path. Pass the
    baseline's content tokens to compare content with content."""
    return baseline_tokens / critical_path(s)


def realized_speedup(sequential_wall_s: float, pasta_wall_s: float) -> float:
    """Wall time of sequential decoding / wall time of PASTA decoding (seconds / seconds).

    The realized content speedup when the sequential run decoded the PASTA answer's clean text
    (same weights, same prompt); the end-to-end speedup when it is a baseline answering the
    prompt itself (report it with :func:`length_ratio` and :func:`cut_fraction`).

    Raises ValueError for a non-positive time."""
    if sequential_wall_s <= 0 or pasta_wall_s <= 0:
        raise ValueError(f"wall times must be positive, got {sequential_wall_s} and {pasta_wall_s}")
    return sequential_wall_s / pasta_wall_s


def step_speedup(sequential_steps: int, pasta_steps: int) -> float:
    """Decode steps of sequential decoding / decode steps of PASTA decoding. For the clean text
    decoded sequentially (content tokens + 1 EOS step) against a PASTA replay at unlimited
    width, it is (content tokens + 1) / critical path. Raises ValueError for a non-positive
    step count."""
    if sequential_steps <= 0 or pasta_steps <= 0:
        raise ValueError(f"step counts must be positive, got {sequential_steps} and {pasta_steps}")
    return sequential_steps / pasta_steps


def realized_over_theoretical(realized: float, theoretical: float) -> float:
    """How much of the available speedup the engine turns into time (docs/DESIGN.md section 3):
    realized content speedup / theoretical content speedup (a ratio of ratios, no unit).

    Its ideal is not 1: when every decode step costs the same, the realized speedup equals the
    step speedup (:func:`step_speedup`), and the sequential side decodes one step more than
    its content tokens (its end-of-sequence), so the ideal ratio is step speedup / theoretical,
    (content tokens + 1) / content tokens at unlimited width: 1.05 for a 20-token answer, about
    1 for long ones. Below it, a step with several threads costs more than a one-thread step
    (or the run paid other overhead); well above it, the timing was disturbed."""
    return realized / theoretical


def length_ratio(pasta_content_tokens: int, baseline_content_tokens: int) -> float:
    """Content tokens of the PASTA answer / content tokens of the baseline's answer (tokens /
    tokens), the figure every end-to-end speedup carries: below 1, part of that speedup is a
    shorter answer. Raises ValueError for a baseline without content or a negative count."""
    if baseline_content_tokens <= 0 or pasta_content_tokens < 0:
        raise ValueError(f"length ratio of {pasta_content_tokens} over {baseline_content_tokens} content tokens")
    return pasta_content_tokens / baseline_content_tokens


def cut_fraction(finish_reasons: Iterable[str]) -> float:
    """Fraction of answers cut by the token budget (finish reason ``length``), the other figure
    every end-to-end speedup carries. Raises ValueError for no answers."""
    reasons = list(finish_reasons)
    if not reasons:
        raise ValueError("cut fraction of no answers")
    return sum(1 for r in reasons if r == "length") / len(reasons)


def geomean(values: Iterable[float]) -> float:
    """Geometric mean (the paper's aggregate over prompts). Raises ValueError on an empty
    input or a non-positive value."""
    vals = list(values)
    if not vals:
        raise ValueError("geometric mean of no values")
    if any(v <= 0 for v in vals):
        raise ValueError("geometric mean needs positive values")
    return math.exp(sum(math.log(v) for v in vals) / len(vals))


def geomean_positive(values: Iterable[float | None]) -> float | None:
    """Geometric mean of the positive values, None when there is none: for content speedups,
    where an answer without content (0) has no speedup to average; a caller reports how many
    it left out (for example ``empty_answers``)."""
    vals = [v for v in values if v is not None and v > 0]
    return geomean(vals) if vals else None


# --- offline quality proxies of a clean text (no model) ---

#: Pieces of PASTA-LANG tag text: the clean text a user reads holds none of them.
TAG_TEXT_MARKERS = ("<promise", "<async", "</async", "<sync", '" tokens="')
#: The markers as whole tag heads: ``<sync`` but not ``<syncstream>`` (C++), ``<async`` but not
#: ``<asyncio>``; a head at the end of the text (a partial tag at a length cut) counts.
_MARKER = re.compile(r'<(?:promise|/?async|sync)(?![\w-])|" tokens="')
#: A promise's length and close without the rest of the tag (`20"/>`: a chunk that wrote the
#: close piece as text showed this). A number that opens with `="` is an attribute's value
#: (HTML's `<img width="20"/>`, SVG's `r="2.5"/>`), not a promise's length: not counted.
_LENGTH_CLOSE = re.compile(r'(?<![\d.])(?<!=")\d+"/>')



def repeated_line_fraction(text: str) -> float:
    """Fraction of non-empty lines (stripped) that repeat an earlier line exactly, in [0, 1)."""
    lines = [x.strip() for x in text.splitlines() if x.strip()]
    if not lines:
        return 0.0
    seen: set[str] = set()
    dup = 0
    for x in lines:
        dup += x in seen
        seen.add(x)
    return dup / len(lines)


def distinct_n(text: str, n: int = 2) -> float:
    """Distinct word n-grams / word n-grams in ``text`` (distinct-n, Li et al. 2016, per answer):
    words are the whitespace-separated pieces, compared exactly (case and punctuation kept).
    1.0 when no n-gram repeats, lower as the text loops; 0.0 for a text of fewer than ``n``
    words (no n-gram: an empty answer is not a varied one). Raises ValueError for ``n < 1``."""
    if n < 1:
        raise ValueError(f"distinct-n needs n >= 1, got {n}")
    words = text.split()
    grams = [tuple(words[i : i + n]) for i in range(len(words) - n + 1)]
    return len(set(grams)) / len(grams) if grams else 0.0


def empty_list_items(text: str) -> int:
    """Lines of ``text`` that are list items with nothing in them
    (:func:`pasta_engine.lang.tags.is_empty_list_item`: only list markers, ``-``, ``*``, ``+``,
    ``•``, ``1.``, ``1)`` or nested ones such as ``- 1)``; a thematic break is not one): the bare
    ``- `` a dropped promise would leave behind, or one the model wrote itself."""
    return sum(1 for line in text.splitlines() if is_empty_list_item(line))


def empty_list_items_from_tags(text: str, annotated: str) -> int:
    """Empty list items of the clean ``text`` that its ``annotated`` text (every character the
    model wrote, tags included) does not have as bare lines: items that only leaving out a tag
    emptied (``- <promise .../>`` written inside a chunk, a nested marker before ``</async>``),
    which the clean text must drop (:func:`pasta_engine.lang.tags.drop_empty_items`). Items the
    model wrote empty itself are bare lines in both and are not counted. 0 or more."""
    return max(0, empty_list_items(text) - empty_list_items(annotated))


def has_tag_text(text: str) -> bool:
    """Whether ``text`` holds any piece of PASTA-LANG tag text (:data:`TAG_TEXT_MARKERS`, each
    tag head as a whole word: ``#include <syncstream>`` holds none): a clean text that does
    shows the user a tag (for example a partial promise at a length cut), or a promise's length
    and close (``20"/>``)."""
    return _MARKER.search(text) is not None or _LENGTH_CLOSE.search(text) is not None


#: An apology or a capability disclaimer, the way a small chat model declines ("I'm sorry for any
#: misunderstanding, but as an AI ... I don't have the ability to ..."), matched case-blind.
_REFUSAL = re.compile(r"\b(?:I['’]m sorry|I am sorry|I apologi[sz]e|as an AI\b|I can(?:no|['’])t (?:help|assist|provide|"
                      r"create|write|do|fulfil)|I(?:['’]m| am) (?:not able|unable) to|I do(?:n['’]t| not) have "
                      r"(?:the ability|the capability|access|personal))", re.IGNORECASE)


def opens_with_refusal(text: str, window_chars: int = 300) -> bool:
    """Whether the opening ``window_chars`` characters of an answer apologise or disclaim a
    capability (:data:`_REFUSAL`: "I'm sorry", "I apologize", "as an AI", "I can't help",
    "I'm unable to", "I don't have the ability"): a small model's decline, which blind readers
    hold against an answer. A phrase later in the answer does not count (a story may have a
    character apologise). Used to leave such answers out of training data
    (``train sft --drop-refusals``). Raises ValueError for ``window_chars < 1``."""
    if window_chars < 1:
        raise ValueError(f"window_chars must be >= 1, got {window_chars}")
    return _REFUSAL.search(text[:window_chars]) is not None


def text_proxies(text: str) -> dict[str, Any]:
    """The text-only quality proxies of one clean answer: ``repeated_lines``
    (:func:`repeated_line_fraction`), ``distinct_2`` (:func:`distinct_n`, n = 2),
    ``empty_list_items`` (a count) and ``tag_text`` (a bool)."""
    return {"repeated_lines": repeated_line_fraction(text), "distinct_2": distinct_n(text, 2),
            "empty_list_items": empty_list_items(text), "tag_text": has_tag_text(text)}


def summarize_text_proxies(texts: Sequence[str], finish_reasons: Sequence[str],
                           annotated: Sequence[str] | None = None) -> dict[str, Any]:
    """The text-only quality proxies of a set of clean answers, for one side of a comparison:
    ``answers``; ``mean_repeated_lines`` and ``mean_distinct_2`` (arithmetic means over
    answers); ``cut_fraction`` (:func:`cut_fraction` of ``finish_reasons``);
    ``answers_with_empty_list_items`` and ``empty_list_items`` (answers with at least one, and
    the total); ``answers_with_tag_text``; with ``annotated`` (each answer's annotated text),
    ``answers_with_empty_list_items_from_tags`` (:func:`empty_list_items_from_tags`). Raises
    ValueError for no answers or lengths that differ."""
    if not texts:
        raise ValueError("text proxies of no answers")
    if len(texts) != len(finish_reasons) or (annotated is not None and len(annotated) != len(texts)):
        raise ValueError(f"{len(texts)} answers but {len(finish_reasons)} finish reasons"
                         + ("" if annotated is None else f" and {len(annotated)} annotated texts"))
    per = [text_proxies(t) for t in texts]
    n = len(per)
    extra = {} if annotated is None else {"answers_with_empty_list_items_from_tags": sum(
        1 for t, a in zip(texts, annotated) if empty_list_items_from_tags(t, a))}
    return {
        "answers": n,
        "mean_repeated_lines": sum(p["repeated_lines"] for p in per) / n,
        "mean_distinct_2": sum(p["distinct_2"] for p in per) / n,
        "cut_fraction": cut_fraction(finish_reasons),
        "answers_with_empty_list_items": sum(1 for p in per if p["empty_list_items"]),
        "empty_list_items": sum(p["empty_list_items"] for p in per),
        "answers_with_tag_text": sum(1 for p in per if p["tag_text"]),
        **extra,
    }
