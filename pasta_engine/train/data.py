"""Training data: AlpacaEval prompts with reference answers, annotated with PASTA-LANG.

The split follows the ``dataset`` field (docs/command_line.md, "AlpacaEval data"): **every subset but ``vicuna``
is training data; ``vicuna`` (80 prompts) is the evaluation split and is never trained on.**
Answers are cut at a line boundary to at most ``max_response_tokens`` tokens (never inside a
code fence), so CPU training stays affordable and the model learns answers of a length it can
decode; the cut answer is then annotated (``mixed``: Skeleton-of-Thought for lists, APAR for
prose; ``independent``: those candidates forked only where the piece does not lean on the chunks
beside it, :mod:`pasta_engine.tools.annotate_independent`) and kept only when the annotation strips back to it exactly (the paper's filter, Jin et
al. 2025, section 4.1).
"""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass
from typing import Any, Callable, Mapping, Sequence

from ..core.replay import replay_script, trace_content_figures
from ..lang.tags import strip_tags
from ..metrics import content_speedup
from ..tools.annotate import annotate
from ..tools.traces import PromptRow

__all__ = ["EVAL_DATASET", "TrainExample", "split_rows", "cut_response", "build_examples", "annotation_content_speedup"]

#: The AlpacaEval subset that is never trained on.
EVAL_DATASET = "vicuna"


@dataclass
class TrainExample:
    """One annotated training response: the instruction, the annotated (cut) answer, its
    source subset, which annotator wrote the tags, the promises, the answer's token count, and
    whether the answer ``ended`` there by itself (False when :func:`cut_response` cut it or its
    generation ran out of tokens, ``finish_reason`` ``length``: its end is not a place to stop)."""

    prompt: str
    annotated: str
    dataset: str | None
    annotator: str
    promises: int
    response_tokens: int
    ended: bool = True

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def split_rows(rows: Sequence[PromptRow], split: str) -> list[PromptRow]:
    """``train``: every row whose dataset is not ``vicuna``; ``eval``: the ``vicuna`` rows.
    Raises ValueError for another split name, and for ``train`` when a row has no dataset (a
    text file, a list of strings, JSON without the field): such a row cannot be told from the
    evaluation split, which is never trained on."""
    if split == "train":
        unknown = next((i for i, r in enumerate(rows) if r.dataset is None), None)
        if unknown is not None:
            raise ValueError(f"prompt row {unknown} has no dataset, so it cannot be told from the evaluation split "
                             f"({EVAL_DATASET!r}, never trained on): give rows with a 'dataset' field (AlpacaEval's "
                             "JSON has one)")
        return [r for r in rows if r.dataset != EVAL_DATASET]
    if split == "eval":
        return [r for r in rows if r.dataset == EVAL_DATASET]
    raise ValueError(f"split must be 'train' or 'eval', got {split!r}")


def cut_response(text: str, count_tokens: Callable[[str], int], max_tokens: int) -> str | None:
    """The longest prefix of ``text`` that ends at a line break, lies outside any code fence and
    holds at most ``max_tokens`` tokens (trailing whitespace dropped); the whole text when it
    fits; None when not even the first line fits."""
    if count_tokens(text) <= max_tokens:
        return text
    lines = text.split("\n")
    best = None
    fence = False
    acc: list[str] = []
    for line in lines:
        acc.append(line)
        if line.lstrip().startswith(("```", "~~~")):
            fence = not fence
        if fence:
            continue
        cand = "\n".join(acc).rstrip()
        if not cand:
            continue
        if count_tokens(cand) > max_tokens:
            break
        best = cand
    return best


def build_examples(
    rows: Sequence[PromptRow],
    count_tokens: Callable[[str], int],
    *,
    max_response_tokens: int = 448,
    annotator: str = "mixed",
    seed: int = 0,
    independence_labels: Mapping[str, Mapping[str, Any]] | None = None,
    annotate_fn: Callable[[str, str], Any] | None = None,
    drop_long: bool = False,
) -> tuple[list[TrainExample], dict[str, int]]:
    """Annotated training examples of ``rows`` (which must carry ``output``), shuffled with
    ``seed``.

    ``annotator`` ``none`` keeps every answer as it is, with no tag (plain SFT: the writer alone,
    e.g. a stronger model's answers, or self-distillation). ``drop_long``: an answer of more than
    ``max_response_tokens`` tokens is left out (counted ``too_long``) instead of cut at a line
    break: a cut answer still teaches its length, which a token budget then cuts.

    ``independence_labels`` (annotator ``independent`` only): instruction -> a row of
    ``bench/reader_independence.py collect`` (``response``: the cut answer, ``pieces``: each
    piece's ``start`` and ``dependence``): a reader's judgement decides those pieces, the
    :class:`~pasta_engine.tools.annotate_independent.LexicalDependence` measure the rest; a
    row whose ``response`` is not the answer as cut here is not used.

    ``annotate_fn`` (annotator ``endpoint``): ``(instruction, cut answer) -> Annotation``
    (:func:`pasta_engine.tools.annotate_endpoint.endpoint_annotator`); an annotation it discards
    (its stripped text is not the answer) counts as ``filtered`` and is left out.

    Returns ``(examples, counts)``: counts of rows ``kept``, ``forked`` (with at least one
    promise), ``ended`` (kept answers that end by themselves: not cut here, not ``finish_reason``
    ``length``), ``too_long`` (no line fits), ``no_output``, ``filtered`` (annotation not
    stripping back to the answer) and, with labels, ``reader_labelled``."""
    out: list[TrainExample] = []
    counts = {"rows": len(rows), "kept": 0, "forked": 0, "ended": 0, "too_long": 0, "no_output": 0, "filtered": 0}
    idf = None
    if annotator == "independent":
        from ..tools.annotate_independent import (
            LexicalDependence, annotate_independent, document_frequencies, table_dependence,
        )

        idf = document_frequencies(r.output for r in rows if r.output)
    for r in rows:
        if r.output is None or not r.output.strip():
            counts["no_output"] += 1
            continue
        cut = cut_response(r.output, count_tokens, max_response_tokens)
        if cut is None or (drop_long and cut != r.output):
            counts["too_long"] += 1
            continue
        if annotator == "independent":
            dep = LexicalDependence(r.instruction)
            row = (independence_labels or {}).get(r.instruction)
            if row is not None and row.get("response") == cut:
                dep = table_dependence(row["pieces"], default=dep)
                counts["reader_labelled"] = counts.get("reader_labelled", 0) + 1
            a, _ = annotate_independent(cut, dep, count_tokens, idf=idf)
        elif annotator == "none":
            from ..tools.annotate import Annotation

            a = Annotation(cut, note="no tags (annotator none)")
        elif annotator == "endpoint":
            if annotate_fn is None:
                raise ValueError("annotator 'endpoint' needs annotate_fn (an endpoint's annotator)")
            a = annotate_fn(r.instruction, cut)
            if a.note and "annotation discarded" in a.note:
                counts["filtered"] += 1
                continue
        else:
            a = annotate(cut, annotator, count_tokens)
        if strip_tags(a.annotated) != cut:
            counts["filtered"] += 1
            continue
        ended = cut == r.output and r.finish_reason != "length"
        out.append(TrainExample(r.instruction, a.annotated, r.dataset, a.annotator or "none", a.promises,
                                count_tokens(cut), ended))
        counts["kept"] += 1
        counts["forked"] += a.promises > 0
        counts["ended"] += ended
    random.Random(seed).shuffle(out)
    return out, counts


def annotation_decoded_tokens(tokenizer: Any, annotated: str, eos_id: int) -> int:
    """The tokens an annotated answer samples when every promise forks, all threads together:
    content, tags and the end-of-sequence tokens (the inserted ``<async>`` tags are not sampled).
    This is what ``max_new_tokens`` counts (docs/DESIGN.md section 8), so an annotation above a
    token budget teaches an answer that the budget cuts.

    Args:
        tokenizer: a ``transformers`` tokenizer (with the added tag tokens when the model has them).
        annotated: the annotated answer (malformed tags are text).
        eos_id: the end-of-sequence token id the main thread ends with (counted).

    Never raises on content."""
    structure = replay_script(tokenizer, annotated, eos_id).structure
    return structure.main_tokens + sum(length for _, length in structure.forks)


def annotation_content_speedup(tokenizer: Any, annotated: str, eos_id: int) -> float:
    """The theoretical content speedup of an annotated answer when every promise forks
    (docs/DESIGN.md section 3): content tokens of its clean text / the critical path of its
    pasta replay at unlimited width (tokens / steps). Tag tokens are on the critical path and
    not in the content, so the same annotation scores higher with tags as added tokens.

    Args:
        tokenizer: a ``transformers`` tokenizer (with the added tag tokens when the model has them).
        annotated: the annotated answer (malformed tags are text).
        eos_id: the end-of-sequence token id the main thread ends with (counted as a step).

    Never raises on content; an answer without content has 0."""
    content, critical, _ = trace_content_figures(tokenizer, annotated, eos_id)
    return content_speedup(content, critical)
