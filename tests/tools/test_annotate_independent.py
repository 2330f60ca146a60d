"""The ``independent`` annotator: forks decided by a dependence measurement, syncs where later
text needs the chunks, descriptive topics that are never repeated in an answer."""

from __future__ import annotations

import math

from hypothesis import given, settings
from hypothesis import strategies as st

from pasta_engine.lang.tags import Promise, Sync, parse, strip_tags
from pasta_engine.tools.annotate import verify_annotation
from pasta_engine.tools.annotate_independent import (
    annotate_independent, check_forks, descriptive_topic, document_frequencies, opens_with_topic,
)

INTRO = "Here are a few ways to sleep better at night:"
ITEMS = [
    "**Keep a schedule**: go to bed and wake up at the same time every day, even on weekends.",
    "**Dim the lights**: bright light in the evening delays the release of melatonin by hours.",
    "**Skip late coffee**: caffeine stays in the blood for six hours or more after a cup.",
]
OUTRO = "In short, these three habits together will make your nights calmer within a few weeks."
ANSWER = INTRO + "\n\n" + "\n".join(f"{i}. {t}" for i, t in enumerate(ITEMS, 1)) + "\n\n" + OUTRO


def scripted(scores: dict[str, float], calls: list | None = None):
    """A dependence that answers by the piece's first word (0.0 when not listed)."""

    def dep(seen: str, alone: str, piece: str) -> float:
        if calls is not None:
            calls.append((seen, alone, piece))
        return scores.get(piece.split()[0].strip("*"), 0.0)

    return dep


def test_independent_items_fork_together_and_a_dependent_conclusion_syncs():
    calls: list = []
    a, scores = annotate_independent(ANSWER, scripted({"In": 0.9}, calls), threshold=0.3)
    events = parse(a.annotated)
    assert strip_tags(a.annotated) == ANSWER and verify_annotation(ANSWER, a.annotated) is None
    assert sum(isinstance(e, Promise) for e in events) == 3 and a.annotator == "independent"
    assert a.annotated.count("<sync/>") == 1 and "<sync/>In short" in a.annotated
    # the conclusion is a paragraph (a candidate): after its sync it would fork alone at the end,
    # beside nothing, so it is decoded inline
    assert [s.decision for s in scores] == ["fork", "fork", "fork", "sync+fork"]
    # the thread of item 3 sees items 1 and 2 only as their promised topics, never their text
    seen, alone, piece = calls[1]
    assert piece == ITEMS[2] and ITEMS[0] in seen and ITEMS[1] in seen
    assert ITEMS[0] not in alone and ITEMS[1] not in alone
    assert "Keep a schedule" in alone and "Dim the lights" in alone


def test_an_independent_conclusion_runs_beside_the_chunks():
    a, scores = annotate_independent(ANSWER, scripted({}), threshold=0.3)
    assert "<sync/>" not in a.annotated and scores[-1].decision == "fork" and a.promises == 4


def test_a_dependent_item_starts_a_new_group_after_a_sync():
    a, scores = annotate_independent(ANSWER, scripted({"Skip": 0.5, "In": 0.9}), threshold=0.3)
    assert [s.decision for s in scores] == ["fork", "fork", "sync+fork", "sync+fork"]
    # item 3 forked alone right before the conclusion's sync: it runs beside nothing, so it is
    # decoded inline and that sync goes too; items 1 and 2 still run together
    assert a.promises == 2 and a.annotated.count("<sync/>") == 1
    assert a.annotated.index("<sync/>") < a.annotated.index("Skip late coffee")


def test_a_sync_before_a_fork_waits_outside_the_new_chunk():
    four = ANSWER.replace(OUTRO, "4. " + ITEMS[0].replace("Keep", "Hold"))
    a, scores = annotate_independent(four, scripted({"Skip": 0.9}), threshold=0.3)
    assert [s.decision for s in scores] == ["fork", "fork", "sync+fork", "fork"]
    assert '3.<sync/><promise topic=' in a.annotated and "<async><sync/>" not in a.annotated
    assert verify_annotation(four, a.annotated) is None
    inside = a.annotated.replace("<async>", "<async><sync/>", 1)
    assert verify_annotation(four, inside) is not None


def test_a_piece_is_scored_where_it_is_measured():
    """A list item forks right after its marker, but is measured, scored and labelled from its
    text (``bench/reader_independence.py`` asks a reader about the pieces measured)."""
    measured: list[int] = []
    a, scores = annotate_independent(ANSWER, lambda s, al, p: measured.append(len(s)) or 0.0, threshold=math.inf)
    assert len(measured) == 3 and set(measured) <= {s.start for s in scores}
    assert all(not ANSWER[s.start].isspace() for s in scores)
    assert "1.<promise" in a.annotated and "1. <promise" not in a.annotated


def test_a_lone_fork_is_decoded_inline():
    two = "Try this:\n\n1. Walk for twenty minutes after every single meal.\n2. As said in one, walk after meals."
    a, _ = annotate_independent(two, scripted({"As": 2.0}), threshold=0.3)
    assert a.promises == 0 and a.annotated == two and a.note


def test_threshold_infinity_measures_every_piece_against_every_earlier_fork():
    calls: list = []
    _, scores = annotate_independent(ANSWER, scripted({"Dim": 5.0, "In": 5.0}, calls), threshold=math.inf)
    assert [s.decision for s in scores] == ["fork", "fork", "fork", "fork"]
    assert [s.dependence for s in scores] == [0.0, 5.0, 0.0, 5.0]
    assert len(calls) == 3 and ITEMS[0] not in calls[2][1] and ITEMS[1] not in calls[2][1]


def test_descriptive_topics_plan_the_chunk_and_never_repeat():
    assert descriptive_topic(ITEMS[0]) == "Keep a schedule"
    common = "bright evening light delays release hours water plants early morning rain"
    idf = document_frequencies([common + " melatonin", common, common])
    t = descriptive_topic("The bright evening light delays the release of melatonin by hours.", idf=idf)
    assert t == "bright evening melatonin"  # the rarest word, then the first ones, in text order
    assert not opens_with_topic(t, "The bright evening light")
    first = descriptive_topic("Water your plants early in the morning with rain water.", idf=idf)
    second = descriptive_topic("Water your plants early in the morning with rain water.", taken=[first], idf=idf)
    assert second != first and second
    assert descriptive_topic("a an the of", taken=["point 1"]) == "point 2"
    # words of any script are words: not "die nchner cke", and Cyrillic gives words, not "point 1"
    assert descriptive_topic("Die Münchner Brücke ist sehr alt und schön.") == "die münchner brücke"
    # ... cut at a word to the grammar's 32 bytes ("москва большой город" is 20 characters, 38 bytes)
    assert descriptive_topic("Москва большой город России.") == "москва большой"
    assert opens_with_topic("Keep a schedule", "**Keep a schedule**: go to bed")
    assert not opens_with_topic("", "anything")


def test_check_forks_reads_a_malformed_tag_once():
    ann = ('Intro <sync> here.\n1.<promise topic="a" tokens="10"/><async> Use <asyncx> in code.</async>\n'
           '2.<promise topic="b" tokens="10"/><async> Second item text.</async>')
    checks = check_forks(ann, lambda seen, alone, piece: 0.0)
    assert [c.chunk for c in checks] == [" Use <asyncx> in code.", " Second item text."]


def test_topics_in_one_answer_are_distinct():
    same = "Tips:\n\n" + "\n".join(f"- Drink water with every meal, every day. {i}" for i in range(4))
    a, _ = annotate_independent(same, scripted({}), threshold=0.3)
    topics = [e.topic for e in parse(a.annotated) if isinstance(e, Promise)]
    assert len(topics) == 4 and len({t.lower() for t in topics}) == 4


@settings(max_examples=60, deadline=None)
@given(st.text(alphabet=st.sampled_from(list("ab \n-1.*:#`<>\"")), max_size=200),
       st.floats(min_value=-1, max_value=1), st.floats(min_value=-1, max_value=1))
def test_any_text_strips_back(text, score, threshold):
    a, _ = annotate_independent(text, lambda s, al, p: score, threshold=threshold)
    assert strip_tags(a.annotated) == text or a.annotated == text
    if a.promises:
        assert verify_annotation(text, a.annotated) is None
        assert a.syncs == sum(isinstance(e, Sync) for e in parse(a.annotated))


def test_descriptive_topics_clash_as_the_grammar_compares_them():
    """The grammar compares topics by topic_key (case, spacing and punctuation ignored): a topic
    that differs from a taken one only in a hyphen could never end (TOPIC_TAKEN), so it counts as
    taken; and a bold title that opens with a number ("1. Recognition") loses the number (the
    grammar's first topic token must hold a letter)."""
    assert descriptive_topic("**Step-by-step**: x y z", taken=["Step by step"]) == "point 2"
    assert descriptive_topic("**Dim lights**: a b c", taken=["dim  LIGHTS!"]) == "point 2"
    assert descriptive_topic("a an the of", taken=["Point-1"]) == "point 2"
    answer = ("Steps:\n\n1. **1. Recognition**: notice the feeling as it arises in the body and name it.\n"
              "2. **2. Identify Triggers**: write down what situations started the feeling today.\n")
    a, _ = annotate_independent(answer, scripted({}))
    assert [e.topic for e in parse(a.annotated) if isinstance(e, Promise)] == ["Recognition", "Identify Triggers"]
