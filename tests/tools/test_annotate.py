"""Annotators (sot, apar): only tags are inserted, chunks follow their promises, forks where a
list or paragraph makes them sensible and nowhere else."""

from __future__ import annotations

import json
import re

import pytest
from hypothesis import HealthCheck, Phase, find, given, settings
from hypothesis import strategies as st

from pasta_engine.lang.tags import Malformed, Promise, Sync, clean_text, parse, splice, split_threads, strip_tags
from pasta_engine.tools.annotate import annotate, annotate_apar, annotate_sot, approx_token_count

INTRO = "Here are a few ways to sleep better at night, each backed by research:"
ITEMS = [
    "**Keep a schedule**: go to bed and wake up at the same time every day, even on weekends.",
    "**Dim the lights**: bright light in the evening delays the release of melatonin by hours.",
    "**Skip late coffee**: caffeine stays in the blood for six hours or more after a cup.",
]
OUTRO = "Small changes like these add up over a few weeks, so give them time."

NUMBERED = INTRO + "\n\n" + "\n".join(f"{i}. {t}" for i, t in enumerate(ITEMS, 1)) + "\n\n" + OUTRO
BULLETED_NO_INTRO = "\n".join(f"- {t}" for t in ITEMS)
NESTED = (
    "Two steps:\n\n"
    "1. **Prepare the dough**: mix the flour and the water.\n"
    "   - Use cold water so the butter does not melt too early.\n"
    "   - Rest the dough for thirty minutes in the fridge.\n\n"
    "2. **Bake it**: put the tray in a hot oven.\n"
    "   * Bake for twenty minutes at two hundred degrees.\n"
    "   * Let it cool on a rack before cutting it.\n"
)
CODE = (
    "Run this to number your lines:\n\n"
    "```python\n"
    "1. this line is code, not a list item at all\n"
    "2. and neither is this one, it stays inside the fence\n"
    "- nor this bullet, which is part of the code block too\n"
    "```\n\n"
    "It prints each line of the file with its number in front of it."
)
CODE_IN_ITEMS = (
    "To install and run it:\n\n"
    "1. Install the package with pip from the command line:\n"
    "   ```bash\n"
    "   - pip install example-package --upgrade\n"
    "   2. not an item\n"
    "   ```\n"
    "2. Run the tool on your data and check the report it writes carefully.\n"
)
HEADERS = (
    "# Packing list\n\n"
    "## Clothes\n"
    "- Two pairs of warm socks made of wool for the cold nights.\n"
    "- A waterproof jacket that packs into its own pocket easily.\n\n"
    "## Gear\n"
    "1. A headlamp with spare batteries for the evenings in camp.\n"
    "2. A small first aid kit with plasters and pain killers inside.\n\n"
    "Check the weather forecast the day before you leave."
)
SINGLE_ITEM = (
    "One thing matters most:\n\n"
    "1. Sleep at least seven hours every single night of the week.\n\n"
    "Everything else follows from it."
)
NO_LIST = (
    "Photosynthesis turns light into chemical energy in plants and algae.\n\n"
    "In the light reactions, chlorophyll absorbs photons and splits water into oxygen and protons.\n\n"
    "In the Calvin cycle, the plant uses that energy to fix carbon dioxide into sugars it can store."
)
SHORT_ITEMS = "The planets nearest the Sun:\n\n1. Mercury\n2. Venus\n3. Earth\n\nMars comes next."

# (response, sot promises, sot syncs, apar promises)
CASES = {
    "numbered": (NUMBERED, 3, 1, 4),  # apar: the three items and the closing paragraph
    "bulleted_no_intro": (BULLETED_NO_INTRO, 3, 0, 3),
    "nested": (NESTED, 2, 0, 2),
    "code_fence": (CODE, 0, 0, 1),  # apar: only the paragraph after the code
    "code_in_items": (CODE_IN_ITEMS, 2, 0, 2),
    "headers": (HEADERS, 4, 1, 5),
    "single_item": (SINGLE_ITEM, 0, 0, 0),  # "Everything else follows from it." is too short to fork
    "no_list": (NO_LIST, 0, 0, 2),
    "short_items": (SHORT_ITEMS, 0, 0, 0),
}


def check_well_formed(response: str, annotated: str) -> list[Promise]:
    """The annotator guarantees, checked independently of the annotator's own check."""
    assert strip_tags(annotated) == response
    events = parse(annotated)
    assert not [e for e in events if isinstance(e, Malformed)] or "<" in response
    assert sum(isinstance(e, Malformed) for e in events) == sum(isinstance(e, Malformed) for e in parse(response))
    th = split_threads(annotated)
    promises = [e for e in events if isinstance(e, Promise)]
    assert len(th.chunks) == len(promises)
    assert all(c.content is not None and c.closed for c in th.chunks)
    assert splice(th.main, th.chunks) == annotated
    from pasta_engine.lang.grammar import MAX_TOPIC_BYTES, topic_key

    # topics the grammar lets a model write: a letter first, within its byte cap, none twice
    assert len({topic_key(p.topic) for p in promises}) == len(promises), [p.topic for p in promises]
    for p in promises:
        assert not re.search(r'["<>\n]', p.topic) and p.topic.strip() == p.topic and p.topic
        assert p.topic[0].isalpha() and len(p.topic.encode()) <= MAX_TOPIC_BYTES, p.topic
        assert p.tokens % 10 == 0 and p.tokens >= 10
        assert p.raw + "<async>" in annotated  # each chunk directly follows its promise
    return promises


def fence_open_at(text: str, pos: int) -> bool:
    """Whether offset ``pos`` of ``text`` lies inside a fenced code block: after a line opening
    with ``` or ~~~ (3 or more, after spaces or tabs) and before the line that closes it (the
    same character, at least as many, nothing else)."""
    fence = None
    for line in text[:pos].split("\n")[:-1]:
        if fence is None:
            m = re.match(r"[ \t]*(`{3,}|~{3,})", line)
            fence = m.group(1) if m else None
        elif line.strip().startswith(fence) and set(line.strip()) == {fence[0]}:
            fence = None
    return fence is not None


def promise_offsets_in_response(annotated: str) -> list[int]:
    """Offsets in the clean response at which each promise was inserted."""
    out, clean = [], 0
    for e in parse(annotated):
        if hasattr(e, "text"):
            clean += len(e.text)
        elif isinstance(e, Promise):
            out.append(clean)
    return out


@pytest.mark.parametrize("name", sorted(CASES))
def test_sot_on_hand_written_responses(name):
    response, n_promises, n_syncs, _ = CASES[name]
    a = annotate_sot(response)
    promises = check_well_formed(response, a.annotated)
    assert len(promises) == a.promises == n_promises
    assert sum(isinstance(e, Sync) for e in parse(a.annotated)) == a.syncs == n_syncs
    for off in promise_offsets_in_response(a.annotated):
        assert not fence_open_at(response, off)
    if n_promises == 0:
        assert a.annotated == response and a.note


@pytest.mark.parametrize("name", sorted(CASES))
def test_apar_on_hand_written_responses(name):
    response, _, _, n_promises = CASES[name]
    a = annotate_apar(response)
    promises = check_well_formed(response, a.annotated)
    assert len(promises) == a.promises == n_promises
    assert a.syncs == 0 and not any(isinstance(e, Sync) for e in parse(a.annotated))
    for off in promise_offsets_in_response(a.annotated):
        assert not fence_open_at(response, off)


def test_sot_chunks_are_the_points_and_the_skeleton_stays_on_main():
    a = annotate_sot(NUMBERED)
    th = split_threads(a.annotated)
    # a chunk starts right after its marker, the space after the marker its first character
    assert [c.content for c in th.chunks] == [" " + t for t in ITEMS]
    assert [c.topic for c in th.chunks] == ["Keep a schedule", "Dim the lights", "Skip late coffee"]
    # the main thread: intro, numbered skeleton, a sync, then the conclusion
    assert strip_tags(th.main) == INTRO + "\n\n1.\n2.\n3.\n\n" + OUTRO
    assert th.main.index("<sync/>") == th.main.index(OUTRO) - len("<sync/>")
    assert th.main.startswith(INTRO)


@pytest.mark.parametrize("annotator", ["sot", "independent"])
def test_list_forks_sit_at_token_boundaries_of_the_plain_text(smollm2_dir, annotator):
    """A byte-level BPE tokenizer starts a word with its space ("1." " **" "Keep"): each promise
    of a list item goes where the plain answer's own tokens have a boundary, so a model trained on
    the annotation forks where its text has one (after "1. " it would first have to sample a bare
    space token, which it never does writing plain text). The same for the ``independent``
    annotator (every item measured independent here)."""
    from transformers import AutoTokenizer

    from pasta_engine.lang.tokenization import encode_text
    from pasta_engine.tools.annotate_independent import annotate_independent

    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    bullets = NUMBERED.replace("1. ", "- ").replace("2. ", "- ").replace("3. ", "- ")
    for response in (NUMBERED, bullets):
        outro_leans = lambda seen, alone, piece: 0.9 if piece.startswith("Small") else 0.0  # noqa: E731
        a = annotate_sot(response) if annotator == "sot" else annotate_independent(response, outro_leans)[0]
        offsets = promise_offsets_in_response(a.annotated)
        assert len(offsets) == 3
        ends, at = set(), 0
        for i in encode_text(tok, response):
            at += len(tok.decode([i]))
            ends.add(at)
        assert all(off in ends for off in offsets), (offsets, a.annotated[:200])
        # the old place, after the space, is not a boundary: the test can fail
        assert not any(off + 1 in ends for off in offsets)


def test_nested_lists_stay_inside_their_point():
    th = split_threads(annotate_sot(NESTED).annotated)
    assert th.chunks[0].content.startswith(" **Prepare the dough**")
    assert th.chunks[0].content.endswith("Rest the dough for thirty minutes in the fridge.")
    assert "   - Use cold water" in th.chunks[0].content
    assert "   * Let it cool" in th.chunks[1].content
    # no promise inside a chunk: the main thread holds both
    assert th.main.count("<promise") == 2


def test_lengths_are_measured_and_rounded_to_tens():
    count = len  # one "token" per character: easy to predict
    assert sorted(len(t) % 10 for t in ITEMS)[-1] >= 5  # a length that rounds up is among them
    a = annotate_sot(NUMBERED, count)
    promises = [e for e in parse(a.annotated) if isinstance(e, Promise)]
    # the chunk holds the space after its marker: one character more than the item's text
    assert [p.tokens for p in promises] == [max(10, (len(t) + 1 + 5) // 10 * 10) for t in ITEMS]
    # default counting
    b = annotate_sot(NUMBERED)
    assert [e.tokens for e in parse(b.annotated) if isinstance(e, Promise)] == [
        max(10, (approx_token_count(t) + 5) // 10 * 10) for t in ITEMS
    ]


def test_topics_are_sanitized():
    items = ['"Quoted <b>bold</b> title" with\ttabs and more words here to pass the minimum length',
             "<<>> ``` ** nothing but symbols ** and then some ordinary words after them"]
    response = "Intro:\n\n" + "\n".join(f"- {t}" for t in items)
    a = annotate_sot(response)
    promises = check_well_formed(response, a.annotated)
    assert len(promises) == 2
    assert promises[0].topic == "Quoted b bold /b"  # at most TOPIC_WORDS (4) words


def test_responses_containing_tags_are_left_alone_and_say_so():
    response = ("Use the tag <sync/> in your answer:\n\n1. First point is long enough to fork here.\n"
                "2. Second point is long enough as well.")
    for fn in (annotate_sot, annotate_apar):
        a = fn(response)
        assert a.annotated == response and a.promises == 0
        assert "PASTA-LANG tag" in a.note


def test_malformed_tag_text_is_kept_and_still_annotated():
    response = ("Avoid writing <sync> or <promise in plain answers:\n\n"
                "1. The first point is long enough to be forked by the annotator.\n"
                "2. The second point mentions </async and is also long enough.")
    a = annotate_sot(response)
    check_well_formed(response, a.annotated)
    assert a.promises == 2


def test_unknown_annotator_is_named():
    with pytest.raises(ValueError, match="unknown annotator 'skeleton'.*sot.*apar.*model"):
        annotate("x", "skeleton")
    with pytest.raises(ValueError, match="needs an engine"):
        annotate("x", "model")


def test_first_100_alpaca_eval_answers(alpaca_outputs):
    rows = json.loads(alpaca_outputs.read_text())[:100]
    for name in ("sot", "apar"):
        forked = 0
        for row in rows:
            response = row["output"]
            a = annotate(response, name)
            promises = check_well_formed(response, a.annotated)
            assert not any(isinstance(e, Malformed) for e in parse(a.annotated))
            assert len(promises) == a.promises
            for off in promise_offsets_in_response(a.annotated):
                assert not fence_open_at(response, off)
            forked += a.promises > 0
        # most AlpacaEval answers have lists (sot) or several paragraphs (apar)
        assert forked >= 40, (name, forked)


FRAGMENTS = [
    "1. ", "2. ", "10) ", "- ", "* ", "+ ", "   ", "  - ", "\t", "\n", "\n\n", "\r\n", "```", "```python\n", "~~~\n",
    "# ", "## Title", "**Bold**: ", "__b__", "word ", "several words in a row ", "long sentence that keeps going. ",
    ":", "<", ">", "/>", '"', "'", "<sync/>", "<sync", "<async>", "</async>", "<promise", ' topic="t"',
    ' tokens="10"', "<promise topic=\"x\" tokens=\"10\"/>", "</", "é", "中文", "\u2028", "|a|b|", "---",
]
WORDS = "the a sleep early every day walk coffee light dark room water bread oven bake read write".split()
ODD = [""] * 12 + ["<", ">", "<sync", "</async", "<promise", '"q" ', "é中 ", "**b**: ", "\t", "\r", "\u2028", "<sync/>"]
odd = st.sampled_from(ODD)
text = st.one_of(st.lists(st.sampled_from(WORDS), max_size=4), st.lists(st.sampled_from(WORDS), min_size=10, max_size=16))
text = st.tuples(odd, text.map(" ".join), odd).map("".join)
sep = st.sampled_from(["\n", "\n\n", "\n\n\n", "\r\n"])
fence = st.tuples(st.sampled_from(["```", "```python", "~~~", "   ```"]), st.lists(st.one_of(text, st.just("1. " * 3)), max_size=3),
                  st.sampled_from(["```", "~~~", ""])).map(lambda t: "\n".join([t[0], *t[1], t[2]]))
item = st.tuples(text, st.lists(st.one_of(st.tuples(st.sampled_from(["   - ", "   1. ", "  ", "    "]), text).map("".join), fence),
                                max_size=2)).map(lambda t: "\n".join([t[0], *t[1]]))


@st.composite
def markdown_list(draw):
    marker = draw(st.sampled_from(["{}. ", "- ", "* ", "{}) ", "+ ", "  - "]))
    items = draw(st.lists(item, min_size=1, max_size=5))
    gap = draw(st.sampled_from(["\n", "\n\n"]))
    return gap.join(marker.format(i) + it for i, it in enumerate(items, 1))


block = st.one_of(text, markdown_list(), fence, text.map(lambda t: "## " + t))
markdown = st.tuples(st.lists(block, max_size=6), st.lists(sep, min_size=6, max_size=6)).map(
    lambda t: "".join(b + s for b, s in zip(t[0], t[1]))
)
# a soup of markdown and tag fragments
soup = st.lists(st.sampled_from(FRAGMENTS), max_size=40).map("".join)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.one_of(soup, markdown), st.sampled_from(["sot", "apar"]))
def test_random_markdownish_text_always_strips_back(response, name):
    a = annotate(response, name)  # never raises
    has_tags = any(not isinstance(e, Malformed) and not hasattr(e, "text") for e in parse(response))
    if has_tags:
        assert a.annotated == response and a.promises == 0
    else:
        promises = check_well_formed(response, a.annotated)
        assert len(promises) == a.promises
        # the annotator's own check never failed, except where a tag would sit beside an empty
        # list item of the response (the clean text would drop it): then it leaves it unannotated
        assert a.note is None or "nothing to fork" in a.note or "empty list item" in a.note
        assert clean_text(a.annotated) == clean_text(response)
        for off in promise_offsets_in_response(a.annotated):
            assert not fence_open_at(response, off)


def test_the_random_markdown_strategy_reaches_forks():
    """Guard for the property test above: its inputs do exercise forking and syncs (find
    raises NoSuchExample otherwise)."""
    quick = settings(max_examples=2000, database=None, deadline=None, phases=[Phase.generate], derandomize=True)
    find(markdown, lambda r: annotate_sot(r).promises >= 3 and annotate_sot(r).syncs >= 1, settings=quick)
    find(markdown, lambda r: annotate_apar(r).promises >= 3, settings=quick)


def test_annotation_names_the_annotator_that_placed_its_promises():
    from pasta_engine.tools.annotate import annotate

    listed = "Tips:\n1. Go to bed early, and get up at the same time every day.\n2. Avoid screens at night.\n"
    prose = ("Sleep matters a great deal for health and mood, and most adults need seven hours or more.\n\n"
             "Exercise helps too: a daily walk of thirty minutes improves sleep quality and energy levels.\n\n"
             "Finally, keep a regular schedule, going to bed and getting up at the same times each day.\n")
    for text, name in ((listed, "sot"), (prose, "apar")):
        a = annotate(text, "mixed")
        assert a.promises > 0 and a.annotator == name and annotate(text, name).annotator == name
    plain = annotate("Sleep well.", "mixed")
    assert plain.promises == 0 and plain.annotator is None


def test_an_annotation_never_loses_an_empty_list_item_of_the_answer():
    """The clean text drops a list item a tag emptied, so a tag beside an empty item the answer
    itself holds (``1.`` alone on its line) would lose a line of the answer: every annotator's
    clean text is the answer exactly (else the answer is left unannotated)."""
    one = "First point with quite a few words in it to pass the minimum length easily"
    two = "Second point with quite a few words in it to pass the minimum length easily"
    for answer in (f"Intro:\n\n1. {one}\n   -\n2. {two}\n", f"Intro:\n\n- {one}\n- {two}\n\n1.\nThe end.\n",
                   f"- {one}\n- {two}\n\n\u2022\nConclusion text here.\n"):
        for name in ("sot", "apar", "mixed"):
            a = annotate(answer, name)
            assert clean_text(a.annotated) == answer and strip_tags(a.annotated) == answer, (name, a.annotated)


def test_only_the_forks_beside_an_empty_item_are_left_out():
    """The whole answer was left unannotated when one fork sat beside an empty list item of the
    answer; the forks that pass alone and together are kept."""
    one, two, three = (f"{w} point with quite a few words in it to pass the minimum length easily"
                       for w in ("First", "Second", "Third"))
    answer = f"Intro:\n\n1. {one}\n   -\n2. {two}\n3. {three}\n"
    for name in ("sot", "apar", "mixed"):
        a = annotate(answer, name)
        assert a.promises == 2 and "1 of 3 forks left out" in a.note, (name, a.note)
        assert clean_text(a.annotated) == answer and strip_tags(a.annotated) == answer


# --------------------------------------------------------------------------- topics the grammar lets a model write

SERVE_TWICE = ("Recipe:\n\n1. Serve: the soup hot with crusty bread and a little grated cheese on top.\n"
               "2. Serve: the salad cold with a squeeze of lemon and some olive oil drizzled on it.\n")


@pytest.mark.parametrize("annotator", ["sot", "apar", "mixed"])
def test_an_answer_never_promises_one_topic_twice(annotator):
    """Two points that open with the same lead ("Serve") once got the same topic twice; the
    grammar's TOPIC_TAKEN never lets a topic equal to an earlier one (topic_key) end, so a model
    trained on that could not write the second promise. The clash is extended with the point's
    next words."""
    from pasta_engine.lang.grammar import PROMISE_OPEN, GrammarState, grammar_state, topic_key

    a = annotate(SERVE_TWICE, annotator)
    topics = [p.topic for p in check_well_formed(SERVE_TWICE, a.annotated)]
    assert topics == ["Serve", "Serve the salad cold"]
    taken: set[str] = set()
    for t in topics:
        assert grammar_state(True, PROMISE_OPEN + t, taken=taken) is GrammarState.TOPIC
        taken.add(topic_key(t))


def test_a_clash_with_nothing_more_to_say_is_numbered():
    """Three points with one lead and nothing after it on their first line: the lead, then the
    lead with the point's number; topic_key ("Dining-Room" = "dining room") decides a clash."""
    from pasta_engine.lang.grammar import topic_key

    body = "carry the plates and the glasses over and set them out neatly for the guests tonight"
    response = "Tasks:\n\n" + "".join(f"- **{t}**\n  {body}.\n" for t in ("Dining Room", "Dining-Room", "dining room"))
    topics = [p.topic for p in check_well_formed(response, annotate_sot(response).annotated)]
    assert topics == ["Dining Room", "Dining-Room 2", "dining room 3"]
    assert len({topic_key(t) for t in topics}) == 3


def test_topics_open_with_a_letter():
    """A topic whose first word has no letter ("500 g flour", "1. Recognition") is refused by the
    grammar (TOPIC_EMPTY takes only a first token holding a letter; SmolLM2 reads digits one by
    one): leading words that do not open with a letter are dropped, and a lead with none at all
    falls back to "point N"."""
    from pasta_engine.tools.annotate import topic_text

    assert topic_text("500 g flour, sifted twice") == "g flour, sifted twice"
    assert topic_text("1. Recognition") == "Recognition"
    assert topic_text("3D printing at home") == "printing at home"
    assert topic_text("\u00bfQu\u00e9 pasa?") == "Qu\u00e9 pasa?"
    assert topic_text("2024 - 2025") == ""
    response = ("Ingredients:\n\n- 500 g flour, sifted twice for a light and airy crumb in the bread.\n"
                "- 2 eggs, beaten with a fork until smooth and pale yellow in colour.\n"
                "- 2024: the year this recipe was first written down by my grandmother.\n")
    topics = [p.topic for p in check_well_formed(response, annotate_sot(response).annotated)]
    assert topics == ["g flour, sifted twice", "eggs, beaten with a", "point 3"]
    assert all(t[0].isalpha() for t in topics)


def test_topics_fit_the_grammars_byte_cap():
    """The grammar's MAX_TOPIC_BYTES counts UTF-8 bytes, not characters: a topic of 32
    characters may hold 90 bytes. Topics are cut at a word to the byte cap (a single longer
    word at a character)."""
    from pasta_engine.lang.grammar import MAX_TOPIC_BYTES
    from pasta_engine.tools.annotate import topic_text

    french = "\u00c9conomie d'\u00e9nergie \u00e9lev\u00e9e"  # 25 characters, 29 bytes
    assert topic_text(french + " tr\u00e8s") == french  # 30 characters, 35 bytes: over the cap
    assert topic_text("\u65e5\u672c\u8a9e\u306e\u8aac\u660e\u6587\u7ae0\u30c6\u30b9\u30c8\u9805\u76ee") == \
        "\u65e5\u672c\u8a9e\u306e\u8aac\u660e\u6587\u7ae0\u30c6\u30b9"  # 10 characters, 30 bytes
    response = ("Points:\n\n- **" + french + " tr\u00e8s**: r\u00e9duire la consommation "
                "dans les b\u00e2timents publics aujourd'hui.\n"
                "- **\u65e5\u672c\u8a9e\u306e\u8aac\u660e\u6587\u7ae0\u30c6\u30b9\u30c8\u9805\u76ee**: "
                + "\u3053\u308c\u306f\u9577\u3044\u8aac\u660e\u306e\u6587\u7ae0\u3067\u3059\u3002" * 4 + "\n")
    topics = [p.topic for p in check_well_formed(response, annotate_sot(response).annotated)]
    assert len(topics) == 2 and all(len(t.encode()) <= MAX_TOPIC_BYTES for t in topics)


@pytest.mark.parametrize("annotator", ["sot", "apar", "independent"])
def test_forks_before_an_indented_line_sit_at_token_boundaries(smollm2_dir, annotator):
    """An indented paragraph ("\\n\\n    // Read") or a list item whose text starts on the next
    line ("1.\\n   Keep") tokenizes as "\\n\\n   " then " //": the fork goes before the word's own
    space, where the plain text has a boundary, not before "//" (inside " //")."""
    from transformers import AutoTokenizer

    from pasta_engine.lang.tokenization import encode_text
    from pasta_engine.tools.annotate_independent import annotate_independent

    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    code_para = ("Here is the program.\n\nIt reads the file line by line and counts every word it finds on each "
                 "line.\n\n    // Read the file line by line and count the words on each line of the input file\n")
    nl_items = ("Tips:\n\n1.\n   Keep a regular schedule every day, even on weekends and holidays.\n"
                "2.\n   Dim the lights an hour before bed so your body produces melatonin.\n")
    tab_para = code_para.replace("\n\n    // Read", "\n\n\t// Read")
    never = lambda seen, alone, piece: 0.0  # noqa: E731
    cases = {"apar": [code_para, tab_para], "sot": [nl_items], "independent": [code_para, tab_para, nl_items]}
    for response in cases[annotator]:
        a = annotate_independent(response, never)[0] if annotator == "independent" else annotate(response, annotator)
        check_well_formed(response, a.annotated)
        offsets = promise_offsets_in_response(a.annotated)
        assert len(offsets) == 2, a.annotated
        ends, at = {0}, 0
        for i in encode_text(tok, response):
            at += len(tok.decode([i]))
            ends.add(at)
        assert all(off in ends for off in offsets), (offsets, a.annotated[:300])
