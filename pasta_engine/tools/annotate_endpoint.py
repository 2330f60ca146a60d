"""The ``endpoint`` annotator: a (larger) model behind any OpenAI-compatible endpoint inserts the
PASTA-LANG tags into an existing answer, as PASTA's stage 1 does with a large model (Jin et al.,
ICML 2025, arXiv 2502.11517, section 4.1: annotations by Gemini, kept only when stripping the tags
gives the original answer back).

The prompt (:data:`ANNOTATION_PROMPT`, also in docs/annotation_prompt.md) asks for forks where
the meaning is independent (a chunk a writer could write without seeing its siblings), topics that
say what a chunk covers, and ``<sync/>`` before text that needs the chunks. What comes back is
checked, never trusted:

- one code fence wrapped around the whole reply is removed (models add them);
- the reply must pass :func:`~pasta_engine.tools.annotate.verify_annotation` against the answer
  (stripping the tags gives the answer exactly; chunks closed and right after their promises; no
  sync inside a chunk), else the answer is kept **unannotated** with a ``note`` saying why (the
  paper's filter; a training command then counts it as ``filtered``);
- every promise's topic, cut at a word to the grammar's 32 bytes, must be one the grammar lets a
  model write (:func:`~pasta_engine.lang.grammar.topic_problem`): non-empty, without ``"``,
  ``<``, ``>`` or a newline (a single-quoted ``topic='...'`` may hold a ``"``), opening with a letter (not ``"8 hours"``) and
  not a topic already promised in the answer (:func:`~pasta_engine.lang.grammar.topic_key`),
  else the answer is kept unannotated with a ``note``, as above;
- every promise's ``tokens`` is replaced by its chunk's measured length rounded to tens (PASTA's
  Pred-10x).
"""

from __future__ import annotations

import re
from typing import Callable

from ..lang.grammar import MAX_TOPIC_BYTES, topic_key, topic_problem
from ..lang.dialect import source_text
from ..lang.tags import Promise, parse, promise_tag, split_threads
from .annotate import Annotation, CountTokens, approx_token_count, round_to_tens, verify_annotation
from .endpoint import ChatEndpoint

__all__ = ["ANNOTATION_PROMPT", "annotate_with_endpoint", "endpoint_annotator", "unfence"]

#: The system prompt of the ``endpoint`` annotator (docs/annotation_prompt.md holds the same text).
ANNOTATION_PROMPT = """\
You mark up an assistant's answer for parallel decoding with PASTA-LANG tags. Reply with the
answer exactly as given, character for character (spaces, newlines, markdown and typos included),
with tags inserted and nothing else changed, added or removed: no preface, no code fence, no
comment.

The tags:
- <promise topic="TOPIC" tokens="N"/><async>CHUNK</async> marks CHUNK, a part of the answer that a
  separate writer will write at the same time as the rest. The promise goes right before the
  chunk's first character and </async> right after its last. TOPIC (a few words opening with
  a letter, at most 32 characters, no quotes, < or >) says what the chunk covers, for example "health benefits" or
  "cost of travel"; not the chunk's first words, and never a topic already used in this answer.
  N is the chunk's length in tokens, roughly (it is measured again).
- <sync/> makes the text after it wait for every chunk before it. Put it before text that needs
  what the chunks say: a summary, a conclusion, a reference back to them.

Fork a chunk only where it is independent in meaning: a writer who sees the question and the text
before its promise, but not the other chunks, could write it just as well. Good chunks are list
items or paragraphs on distinct aspects. Do not fork: the opening sentence, headings and lines
ending in a colon, a sentence that continues or refers to a neighbour ("this", "also", "as
mentioned", "finally", "however"), steps that build on the step before, code, or anything under
about 8 words. Chunks never nest, and a <sync/> never goes inside a chunk. If no part is
independent, reply with the answer unchanged.

Example. The answer
Here are three ways to save water:
1. Fix leaking taps, which can waste litres a day.
2. Take shorter showers: a shower uses about ten litres a minute.
3. Water the garden in the evening so less evaporates.
These habits add up over a year.
is marked up as
Here are three ways to save water:
1. <promise topic="leaking taps" tokens="10"/><async>Fix leaking taps, which can waste litres a day.</async>
2. <promise topic="shorter showers" tokens="10"/><async>Take shorter showers: a shower uses about ten litres a minute.</async>
3. <promise topic="garden watering time" tokens="10"/><async>Water the garden in the evening so less evaporates.</async>
<sync/>These habits add up over a year.
"""

_FENCE = re.compile(r"\A\s*```[^\n]*\n(.*)\n```\s*\Z", re.S)


def unfence(reply: str) -> str:
    """``reply`` without one code fence wrapped around all of it (```` ```text ... ``` ````);
    any other reply unchanged."""
    m = _FENCE.match(reply)
    return m.group(1) if m else reply


def _topic(topic: str) -> str:
    topic = " ".join(topic.split())
    if len(topic.encode()) <= MAX_TOPIC_BYTES:
        return topic
    words, out = topic.split(" "), ""
    for w in words:
        cand = f"{out} {w}".strip()
        if len(cand.encode()) > MAX_TOPIC_BYTES:
            break
        out = cand
    return out or topic.encode()[:MAX_TOPIC_BYTES].decode(errors="ignore")


def _topics_problem(annotated: str) -> str | None:
    """The first topic of ``annotated`` that :func:`topic_problem` refuses, said, or None."""
    taken: set[str] = set()
    for e in parse(annotated):
        if isinstance(e, Promise):
            topic = _topic(e.topic)
            problem = topic_problem(topic, taken)
            if problem is not None:
                return problem
            taken.add(topic_key(topic))
    return None


def _measured(annotated: str, count: CountTokens) -> str:
    """``annotated`` with every promise's length measured (Pred-10x) and its topic capped."""
    chunks = split_threads(annotated).chunks
    out: list[str] = []
    k = 0
    for e in parse(annotated):
        if isinstance(e, Promise):
            content = chunks[k].content or "" if k < len(chunks) else ""
            out.append(promise_tag(_topic(e.topic), round_to_tens(count(content))))
            k += 1
        else:
            out.append(source_text(e))
    return "".join(out)


def annotate_with_endpoint(endpoint: ChatEndpoint, instruction: str, response: str,
                           count_tokens: CountTokens | None = None, max_tokens: int | None = None) -> Annotation:
    """Annotate ``response`` (the answer to ``instruction``) with the model behind ``endpoint``.

    Args:
        endpoint: the annotating model (:class:`~pasta_engine.tools.endpoint.ChatEndpoint`).
        instruction: the question the answer answers.
        response: the answer to annotate.
        count_tokens: measures each chunk (a tokenizer's count; default :func:`approx_token_count`).
        max_tokens: the reply's budget in tokens (default: twice the answer's approximate
            length + 256, room for the tags).

    Returns the :class:`~pasta_engine.tools.annotate.Annotation` (``annotator`` ``endpoint``), or
    the answer unannotated (``promises`` 0, ``annotator`` None) with a ``note`` starting
    "endpoint annotation discarded" when the reply is not the answer with tags inserted or a
    topic is not one the grammar lets a model write
    (:func:`~pasta_engine.lang.grammar.topic_problem`).
    Raises :class:`~pasta_engine.tools.endpoint.EndpointError` when the endpoint fails."""
    count = count_tokens or approx_token_count
    budget = max_tokens or 2 * approx_token_count(response) + 256
    reply = endpoint.complete([{"role": "system", "content": ANNOTATION_PROMPT},
                               {"role": "user", "content": f"Question:\n{instruction}\n\nAnswer to mark up:\n{response}"}],
                              max_tokens=budget)
    lead = response[: len(response) - len(response.lstrip())]
    trail = response[len(response.rstrip()):]
    text = lead + unfence(reply).strip() + trail  # the answer's own outer whitespace, whatever the reply's
    problem = verify_annotation(response, text)
    if problem is None:
        problem = _topics_problem(text)
    if problem is not None:
        return Annotation(response, note=f"endpoint annotation discarded ({endpoint.name}): {problem}")
    text = _measured(text, count)
    events = parse(text)
    promises = sum(isinstance(e, Promise) for e in events)
    syncs = text.count("<sync/>") - response.count("<sync/>")
    return Annotation(text, promises=promises, syncs=syncs, annotator="endpoint" if promises else None)


def endpoint_annotator(endpoint: ChatEndpoint, count_tokens: CountTokens | None = None
                       ) -> Callable[[str, str], Annotation]:
    """``(instruction, response) -> Annotation`` through ``endpoint`` (for
    :func:`pasta_engine.train.data.build_examples` and ``bench annotate``)."""
    return lambda instruction, response: annotate_with_endpoint(endpoint, instruction, response, count_tokens)
