"""Independence measured: the lexical measure on hand-built answers, the context-removal
likelihood probe's exact values on a model whose probabilities are known by hand, forks of an
annotated answer checked, and a reader's labels deciding the training annotation."""

from __future__ import annotations

import math

import torch
from transformers import AutoTokenizer

from pasta_engine.lang.tags import Promise, parse, strip_tags
from pasta_engine.lang.tokenization import encode_prompt, encode_text
from pasta_engine.tools.annotate import approx_token_count
from pasta_engine.tools.annotate_independent import (
    DEFAULT_THRESHOLD, LexicalDependence, annotate_independent, check_forks, table_dependence,
)
from pasta_engine.tools.traces import PromptRow
from pasta_engine.train.data import build_examples
from pasta_engine.train.independence import SiblingDependence

QUESTION = "How can I sleep better?"
INTRO = "Here are a few ideas:\n\n1. "
FIRST = "Keep a fixed bedtime, even on weekends, so that your circadian clock settles into a rhythm."


def _dep(piece: str, first: str = FIRST) -> float:
    seen = INTRO + first + "\n2. "
    alone = INTRO + "fixed bedtime" + "\n2. "  # the thread sees its sibling's topic only
    return LexicalDependence(QUESTION)(seen, alone, piece)


def test_a_chunk_that_refers_to_or_repeats_a_sibling_is_dependent_and_an_unrelated_one_is_not():
    unrelated = "Skip coffee after lunch: caffeine stays in the blood for six hours or more."
    refers = "As mentioned above, the circadian clock also needs morning light to settle."
    repeats = "Keep a fixed bedtime, even on weekends, so that your circadian clock settles."
    assert _dep(unrelated) == 0.0
    assert _dep(refers) > DEFAULT_THRESHOLD
    assert _dep(repeats) > DEFAULT_THRESHOLD
    parts = LexicalDependence(QUESTION).parts(INTRO + FIRST + "\n2. ", INTRO + "fixed bedtime\n2. ", refers)
    # "circadian", "clock", "settle"... only the hidden sibling introduced "circadian" and "clock"
    assert parts["leaning_opening"] == 1.0 and parts["new_names"] > 0 and parts["repetition"] > 0
    # words the question or the visible text already hold are no sign of dependence
    assert _dep("Sleep better by keeping your bedroom dark and quiet at night.") == 0.0


class _SeenBoostLM(torch.nn.Module):
    """A causal LM whose probabilities are known by hand: at every position, each token that
    occurs in the sequence so far gets logit ``boost``, every other token 0."""

    def __init__(self, vocab: int, boost: float):
        super().__init__()
        self.vocab, self.boost = vocab, boost
        self.dummy = torch.nn.Parameter(torch.zeros(1))

    def forward(self, input_ids, use_cache=False):
        ids = input_ids[0].tolist()
        logits = torch.zeros(1, len(ids), self.vocab)
        seen: set[int] = set()
        for i, t in enumerate(ids):
            seen.add(t)
            logits[0, i, list(seen)] = self.boost

        class Out:
            pass

        out = Out()
        out.logits = logits
        return out


def _by_hand(prefix: list[int], piece: list[int], vocab: int, boost: float) -> float:
    """Mean log p of ``piece`` after ``prefix`` under :class:`_SeenBoostLM`, by its formula."""
    total, seen = 0.0, set(prefix)
    for t in piece:
        z = len(seen) * math.exp(boost) + (vocab - len(seen))
        total += (boost if t in seen else 0.0) - math.log(z)
        seen.add(t)
    return total / len(piece)


def test_the_likelihood_probe_gives_the_values_computed_by_hand(tiny_llama):
    tok = AutoTokenizer.from_pretrained(tiny_llama)
    vocab, boost = len(tok), 3.0
    probe = SiblingDependence(_SeenBoostLM(vocab, boost), tok, QUESTION)
    prompt = encode_prompt(tok, [{"role": "user", "content": QUESTION}])
    seen, alone, piece = "Intro.\nalpha beta gamma\n", "Intro.\nsibling\n", "alpha beta delta"
    ids = probe.piece_ids(seen, piece)
    assert ids == encode_text(tok, seen + piece)[len(encode_text(tok, seen)):]
    gains = probe.token_gains(seen, alone, piece)
    want_seen = _by_hand(prompt + encode_text(tok, seen), ids, vocab, boost)
    want_alone = _by_hand(prompt + encode_text(tok, alone), ids, vocab, boost)
    assert math.isclose(sum(gains) / len(gains), want_seen - want_alone, rel_tol=1e-5, abs_tol=1e-5)
    assert probe(seen, alone, piece) > 0  # the repeated words are likelier with the sibling in view
    assert probe(seen, seen, piece) == 0.0 and probe(seen, alone, "") == 0.0


def test_check_forks_reads_the_siblings_each_chunk_ran_beside():
    annotated = (
        "Ideas:\n1. " '<promise topic="fixed bedtime" tokens="20"/><async>' + FIRST + "</async>\n2. "
        '<promise topic="coffee" tokens="20"/><async>Skip coffee after lunch, it lasts six hours.</async>\n3. '
        '<promise topic="again" tokens="20"/><async>As mentioned, keep a fixed bedtime for your clock.</async>'
        "\n<sync/>Finally, these habits add up."
    )
    checks = check_forks(annotated, LexicalDependence(QUESTION))
    assert [c.topic for c in checks] == ["fixed bedtime", "coffee", "again"]
    assert [c.passes for c in checks] == [True, True, False]
    assert checks[0].dependence == 0.0  # nothing outstanding beside the first fork
    assert checks[0].opens_with_topic is False and checks[2].opens_with_topic is False
    assert check_forks("No forks here.", LexicalDependence()) == []


def test_a_readers_labels_decide_the_training_annotation():
    answer = INTRO + FIRST + "\n2. Skip coffee after lunch: caffeine stays in the blood for hours.\n\nSo sleep well."
    start2 = answer.index("Skip")
    table = table_dependence([{"start": start2, "dependence": 1.0}], default=lambda s, a, p: 0.0)
    a, scores = annotate_independent(answer, table, approx_token_count)
    assert [s.decision for s in scores][:2] == ["fork", "sync+fork"]
    # item 2 depends on item 1 (the reader said so): a sync before it, and no two chunks run together
    assert "<sync/>" in a.annotated or a.promises <= 1
    rows = [PromptRow(QUESTION, output=answer, dataset="oasst")]
    labels = {QUESTION: {"response": answer, "pieces": [{"start": start2, "dependence": 1.0}]}}
    ex, counts = build_examples(rows, approx_token_count, annotator="independent", independence_labels=labels)
    ex_free, _ = build_examples(rows, approx_token_count, annotator="independent")
    assert counts["reader_labelled"] == 1 and strip_tags(ex[0].annotated) == answer
    assert ex[0].annotated != ex_free[0].annotated  # the label changed what forks
    assert sum(isinstance(e, Promise) for e in parse(ex_free[0].annotated)) >= 2
    # labels of another cut of the answer are not used
    stale = {QUESTION: {"response": answer + " more", "pieces": [{"start": start2, "dependence": 1.0}]}}
    ex_stale, counts = build_examples(rows, approx_token_count, annotator="independent", independence_labels=stale)
    assert "reader_labelled" not in counts and ex_stale[0].annotated == ex_free[0].annotated
