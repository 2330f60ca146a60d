"""PASTA-LANG parser: split-invariance, no lost characters, malformed tags as tag-like text;
the clean text a reader sees (no tag text, no list item left empty by a tag)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pasta_engine.lang.tags import (
    AsyncClose,
    AsyncOpen,
    Chunk,
    Malformed,
    Promise,
    Sync,
    TagParser,
    TagText,
    Text,
    clean_from_items,
    clean_text,
    drop_empty_items,
    is_empty_list_item,
    parse,
    promise_tag,
    splice,
    split_threads,
    strip_tags,
)

from clean_stream import streamed_cleans as stream_cleans  # noqa: E402  (tests/clean_stream.py)

TAGS = [
    '<promise topic="a list" tokens="30"/>',
    "<promise topic='x' tokens='0' />",
    '<promise tokens="120" topic="swapped order"/>',
    "<async>",
    "</async>",
    "<sync/>",
    "<sync />",
]
NEAR_MISSES = [
    "<promise",
    '<promise topic="x"/>',  # tokens missing
    '<promise topic="x" tokens="N"/>',  # tokens not a number
    '<promise topic="x" tokens="1000000000"/>',  # runaway digits
    '<promise topic="a<b" tokens="3"/>',
    '<promise topic="a\nb" tokens="3"/>',
    "<async",
    "</asyn>",
    "<sync/",
    "<syncx/>",
    "< sync/>",
    "<",
    "<<",
    "</",
    "<b>bold</b>",
]
WORDS = ["<prom", "ise", "async", "sync", "/>", 'topic="t"', 'tokens="2"', " ", "<", "/"]


def fragments():
    piece = st.one_of(st.sampled_from(TAGS + NEAR_MISSES + WORDS), st.text("ab <>/=\"' \n\té", max_size=6))
    return st.lists(piece, max_size=12).map("".join)


def normalize(events):
    """Merge adjacent text of one kind (plain or tag-like) so event lists can be compared
    across different cuts."""
    out = []
    for e in events:
        if isinstance(e, Text) and out and type(out[-1]) is type(e):
            out[-1] = type(e)(out[-1].text + e.text)
        else:
            out.append(e)
    return out


def raw_of(events):
    return "".join(e.text if isinstance(e, Text) else ("" if isinstance(e, Malformed) else e.raw) for e in events)


@st.composite
def cut(draw, text_strategy):
    text = draw(text_strategy)
    cuts = sorted(draw(st.lists(st.integers(0, len(text)), max_size=len(text) + 1)))
    pieces, prev = [], 0
    for c in cuts + [len(text)]:
        pieces.append(text[prev:c])
        prev = c
    return text, pieces


@settings(max_examples=400, deadline=None)
@given(cut(fragments()))
def test_any_cut_parses_like_the_whole_string(case):
    text, pieces = case
    whole = normalize(parse(text))
    p = TagParser()
    events = []
    for piece in pieces:
        events += p.feed(piece)
    events += p.finish()
    assert normalize(events) == whole
    # nothing the model wrote is lost: text plus tag sources reproduce the input exactly
    assert raw_of(events) == text
    # each tag knows where it ends in the input
    for e in events:
        if not isinstance(e, (Text, Malformed)):
            assert text[e.end - len(e.raw) : e.end] == e.raw


@settings(max_examples=300, deadline=None)
@given(fragments())
def test_strip_loses_no_non_tag_character(text):
    stripped = strip_tags(text)
    events = parse(text)
    assert stripped == "".join(e.text for e in events if isinstance(e, Text))
    # removing exactly the well-formed tags' characters from the input gives the stripped text
    rebuilt, i = [], 0
    for e in events:
        if isinstance(e, Text):
            assert text.startswith(e.text, i)
            rebuilt.append(e.text)
            i += len(e.text)
        elif not isinstance(e, Malformed):
            assert text.startswith(e.raw, i)
            i += len(e.raw)
    assert i == len(text) and "".join(rebuilt) == stripped


def test_tags_are_recognised_split_across_pieces():
    p = TagParser()
    out = []
    for piece in ["Intro <pro", 'mise topic="sleep', ' tips" tok', 'ens="3', '0"/', "><sync", "/> end"]:
        out += p.feed(piece)
    out += p.finish()
    assert out == [
        Text("Intro "),
        Promise(topic="sleep tips", tokens=30, raw='<promise topic="sleep tips" tokens="30"/>'),
        Sync(raw="<sync/>"),
        Text(" end"),
    ]


def test_partial_tag_is_held_back_until_decided():
    p = TagParser()
    assert p.feed("a <asy") == [Text("a ")]
    assert p.pending == "<asy"
    assert p.feed("nc>") == [AsyncOpen()]
    assert p.feed("<asx") == [Text("<asx")]  # not a PASTA-LANG tag name: plain text, no report
    # a known head that breaks: tag-like through the next '>' (or up to a line break or '<')
    assert p.feed("<asyncx") == [Malformed(raw="<asyncx", reason="malformed tag"), TagText("<asyncx")]
    assert p.feed("y> z") == [TagText("y>"), Text(" z")]
    assert p.pending == ""


def test_special_token_ids_map_to_tags():
    p = TagParser(special_tokens={50001: "<sync/>", 50002: "</async>"})
    assert p.feed("done") == [Text("done")]
    assert p.feed(50001) == [Sync()]
    assert p.feed(50002) == [AsyncClose()]


def test_malformed_tags_are_text_and_reported():
    text = 'x <promise topic="t" tokens="N"/> y'
    events = parse(text)
    assert strip_tags(text) == text
    assert any(isinstance(e, Malformed) for e in events)
    assert not any(isinstance(e, Promise) for e in events)


def test_runaway_attribute_is_capped_as_text():
    text = '<promise topic="t" tokens="' + "0" * 5000 + '"/>'
    assert strip_tags(text) == text


def test_a_later_tag_inside_a_failed_buffer_is_still_found():
    events = parse("<prom<sync/>")
    assert Sync() in events
    assert strip_tags("<prom<sync/>") == "<prom"


def test_split_and_splice_round_trip():
    ann = (
        "Tips:\n1. " + promise_tag("sleep", 30) + "<async>Go to bed.</async>\n2. "
        + promise_tag("food", 20) + "<async>Eat <sync/> well.</async>\n" + promise_tag("none", 10)
        + "\n<sync/>\nDone."
    )
    th = split_threads(ann)
    assert th.main == (
        "Tips:\n1. " + promise_tag("sleep", 30) + "\n2. " + promise_tag("food", 20) + "\n"
        + promise_tag("none", 10) + "\n<sync/>\nDone."
    )
    assert [c.content for c in th.chunks] == ["Go to bed.", "Eat <sync/> well.", None]
    assert any("inside a chunk" in d for d in th.diagnostics)
    assert splice(th.main, th.chunks) == ann
    assert strip_tags(ann) == "Tips:\n1. Go to bed.\n2. Eat  well.\n\n\nDone."


def test_unclosed_chunk_and_stray_async():
    th = split_threads("<async>stray</async> " + promise_tag("t", 10) + "<async>open to the end")
    assert th.main.startswith("<async>stray</async> ")
    assert th.chunks == [Chunk(topic="t", tokens=10, content="open to the end", closed=False)]
    assert splice(th.main, th.chunks).endswith("<async>open to the end")


def test_splice_rejects_more_chunks_than_promises():
    import pytest

    with pytest.raises(ValueError, match="1 promise tags but 2 chunks"):
        splice(promise_tag("a", 10), ["x", "y"])


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.text("abc \n.", max_size=8), st.text("xyz .", max_size=8)), max_size=5),
       st.text("d e", max_size=5))
def test_split_splice_inverse_on_generated_responses(items, tail):
    ann = "".join(lead + promise_tag("t", 10) + "<async>" + body + "</async>" for lead, body in items) + tail
    th = split_threads(ann)
    assert [c.content for c in th.chunks] == [b for _, b in items]
    assert splice(th.main, th.chunks) == ann


@settings(max_examples=300, deadline=None)
@given(cut(fragments()))
def test_feed_plain_consumes_what_feed_returns_as_text(case):
    """The interpreter's fast path: feed_plain, then feed where it declines, parses like feed alone."""
    text, pieces = case
    fast, slow = TagParser(), TagParser()
    events, want = [], []
    for piece in pieces:
        want += slow.feed(piece)
        if fast.feed_plain(piece):
            assert "<" not in piece
            events += [Text(piece)] if piece else []
        else:
            events += fast.feed(piece)
    events += fast.finish()
    want += slow.finish()
    assert normalize(events) == normalize(want)
    for a, b in zip([e for e in events if not isinstance(e, Text)], [e for e in want if not isinstance(e, Text)]):
        assert a.end == b.end if hasattr(a, "end") else a == b


# --------------------------------------------------------------------------- the clean text


def test_a_partial_tag_at_the_end_is_tag_like_only_past_a_known_head():
    p = TagParser()
    assert p.feed('4. <promise topic="Premature Death" tokens="1') == [Text("4. ")]
    raw = '<promise topic="Premature Death" tokens="1'
    assert p.finish() == [Malformed(raw=raw, reason="unterminated tag at end of text"), TagText(raw)]
    for tail in ("<", "<prom", "</", "<asy"):  # short of a known head: plain text, even at the end
        assert parse("x " + tail) == [Text("x " + tail)]
        assert clean_text("x " + tail) == "x " + tail
    assert clean_text("a\n4. " + raw) == "a\n"  # the tag and the list item it leaves empty go
    assert strip_tags("a\n4. " + raw) == "a\n4. " + raw  # strip_tags keeps every non-tag character


def test_malformed_tags_are_left_out_of_the_clean_text():
    for text, want in [
        ('x <promise topic="t" tokens="N"/> y', "x  y"),
        ('A <promise topic="Python is a general-purpose programming\nB', "A \nB"),
        ("<promise topic='x'/>.", "."),  # tokens missing: through its '>'
        ("a<sync>b", "ab"),
        ("a <asyncio and more\nnext", "a \nnext"),  # past a known head: tag-like up to the line break
        ("<sync x<sync/>y", "y"),  # a '<' ends the malformed span and is read again
    ]:
        assert clean_text(text) == want, text
        # nothing is lost: only the clean text leaves it out
        assert strip_tags(text) == text.replace("<sync/>", "")


def test_a_promise_broken_inside_its_topic_is_left_out_whole():
    # a topic may not hold a line break or an angle bracket; the rest of such a promise
    # (its tokens attribute and '/>') is tag-like too, so no tag text reaches the clean text
    for text in [
        'A <promise topic="foo\nbar" tokens="3"/> B',
        'A <promise topic="a<b" tokens="3"/> B',
        'A <promise topic="a>b" tokens="3"/> B',
        "A <promise tokens='3' topic='a\n\nb'/> B",
    ]:
        assert clean_text(text) == "A  B", text
        assert strip_tags(text) == text
        for cut in range(1, len(text)):  # the same split anywhere (streaming)
            assert normalize(parse([text[:cut], text[cut:]])) == normalize(parse(text)), (text, cut)
    # a tail that never closes the tag is read as before: text after the line break, and a
    # tag after it is still a tag
    assert clean_text('A <promise topic="a\nb" tokens="3"<sync/>C') == 'A \nb" tokens="3"C'
    assert clean_text('A <promise topic="a\nnext line') == "A \nnext line"
    p = TagParser()
    assert p.feed('x <promise topic="a\nb" tok') == [
        Text("x "),
        Malformed(raw='<promise topic="a\n', reason="malformed tag"),
        TagText('<promise topic="a'),
    ]
    assert p.pending == '\nb" tok'  # held: it may still close the tag
    assert p.feed("ens") == []
    assert not p.feed_plain("x")
    assert normalize(p.finish()) == [Text('\nb" tokens')]


def test_prose_with_angle_brackets_keeps_its_characters():
    for text in ["if a < b then", "x <3", "<div>hi</div>", "a <prom b", "<b>bold</b> <asy", "1 << 2", "</ x"]:
        assert clean_text(text) == text
        assert all(type(e) is Text for e in parse(text))


def test_a_promise_written_inside_a_chunk_leaves_no_empty_list_item():
    chunk = '\n- <promise topic="x" tokens="10"/>\n- real item\n  2. <sync/>\n3) ok'
    ann = "Tips:" + promise_tag("list", 50) + "<async>" + chunk + "</async>\nDone."
    assert clean_text(ann) == "Tips:\n- real item\n3) ok\nDone."
    assert strip_tags(ann) == "Tips:\n- \n- real item\n  2. \n3) ok\nDone."  # the old rule left bare items
    # an item the model left empty by itself stays; so does one that a kept text fills
    assert clean_text("- \n- a<sync/>\n") == "- \n- a\n"
    # a promise whose chunk never came leaves its item empty: it goes too
    assert clean_text("1. " + promise_tag("t", 10) + "\n2. b") == "2. b"


def test_a_nested_or_bulleted_item_emptied_by_a_tag_goes_too():
    """The rule's list markers are the quality proxy's (``is_empty_list_item``): nested markers
    (``- 1)``, ``1. 1.``) and ``•`` are list items too; a thematic break is not one."""
    chunk = '\n- 1) <promise topic="x" tokens="10"/>\n  1. 1. <sync/>\n• <sync/>\n- 2) kept\n- 3) '
    ann = "Tips:" + promise_tag("list", 50) + "<async>" + chunk + "</async>\n* * *<sync/>\n---\n- 1)\nDone."
    assert clean_text(ann) == "Tips:\n- 2) kept\n* * *\n---\n- 1)\nDone."  # the bare "- 1)" the model wrote stays
    assert [is_empty_list_item(x) for x in ["- 1) ", " 1. 1.", "\u2022", "* * *", "---", "- x", "1.5", "-1)"]] == \
        [True, True, True, False, False, False, False, False]


def test_a_number_a_tag_follows_is_text_not_an_emptied_item():
    """A chunk whose last line was a number and a full stop lost that line ("published in\n1949."
    read "published in"): a drop right after a number's "." or ")" is text the tag followed; a
    marker with a space before the tag, or a bullet, is an item the tag emptied, as before."""
    ann = 'Intro <promise topic="Year" tokens="10"/><async>It was published in\n1949.</async>\nMore.'
    assert clean_text(ann) == "Intro It was published in\n1949.\nMore." == strip_tags(ann)
    assert clean_text("The answer is\n42.<sync/>\nDone.") == "The answer is\n42.\nDone."
    assert clean_text("Steps:\n7)<sync/>\nDone.") == "Steps:\n7)\nDone."
    assert clean_text("Tips:\n1. <sync/>\n- <sync/>\n-<sync/>\nDone.") == "Tips:\nDone."
    assert drop_empty_items("a\n1949.", [7]) == "a\n1949." and drop_empty_items("a\n1. ", [5]) == "a\n"
    assert drop_empty_items("a\n1. ", [4, 5]) == "a\n"  # any drop of the line that empties it counts


def test_drop_empty_items_holds_a_last_line_that_may_still_become_an_empty_item():
    assert drop_empty_items("a\n- ", [4], final=True) == "a\n"
    assert drop_empty_items("a\n- ", [], final=True) == "a\n- "
    for tail in ["", " ", "-", "- ", "12", "12.", "3) ", "  * ", "- 1", "- 1)", "1. 2", "\u2022 "]:
        assert drop_empty_items("a\n" + tail, [], final=False) == "a\n"
    for tail in ["x", "- x", "1.5", "-x", "1234567890"]:
        assert drop_empty_items("a\n" + tail, [], final=False) == "a\n" + tail


LISTY = st.sampled_from(["- ", "* ", "1. ", "2) ", "  - ", "\n", "\n- ", "\n1. ", "x", " ", "-", "- 1) ", "\u2022 ", "* * *"])


def annotated_lists():
    piece = st.one_of(st.sampled_from(TAGS + NEAR_MISSES + WORDS), LISTY, st.text("ab <>/=\"' \n\t-1.", max_size=6))
    return st.lists(piece, max_size=14).map("".join)


@settings(max_examples=300, deadline=None)
@given(annotated_lists())
def test_clean_text_never_holds_tag_text(text):
    clean = clean_text(text)
    kept = [e for e in parse(text) if type(e) is Text]
    # the clean text is the plain text, less whole lines (an emptied list item and its line break)
    plain = "".join(e.text for e in kept)
    assert len(clean) <= len(plain)
    it = iter(plain)
    assert all(ch in it for ch in clean)  # a subsequence
    # well-formed tags and tag-like text never reach it: re-parsing it finds no tag-like text
    # beyond what joining plain runs can form
    if not any(type(e) is not Text and not isinstance(e, Malformed) for e in parse(text)):
        assert clean == plain  # nothing left out: nothing to tidy either
    # and what is left never forms a tag where something was left out ("<pro<sync/>mise ...")
    assert not any(isinstance(e, (Promise, AsyncOpen, AsyncClose, Sync)) for e in parse(clean)), clean


@pytest.mark.parametrize("text, clean", [
    ('<pro<sync/>mise topic="x" tokens="3"/>', 'mise topic="x" tokens="3"/>'),  # issue 31 item 10
    ("<<sync/>sync/>", "<"),  # the lone '<' stays; what would complete it into a tag after the sync goes
    ("<as<sync/>ync>", "ync>"),
    ('<prom<promise topic="y" tokens="3"/><async>z</async>ise topic="x" tokens="3"/>', 'zise topic="x" tokens="3"/>'),
    ("x << 2 and y <<= 3", "x << 2 and y <<= 3"),  # a '<' broken by a '<' that starts no tag stays text
    ("a<b<c", "a<b<c"),
    ("<p<r<sync/>x", "<p<rx"),
    ("ends <pro", "ends <pro"),
])
def test_a_partial_tag_cut_short_by_a_tag_goes_with_it(text, clean):
    assert clean_text(text) == clean
    assert strip_tags(text) == "".join(e.text for e in parse(text) if isinstance(e, Text))  # annotations still invert
    # piece by piece, as the engine feeds tokens, the same items come out
    p = TagParser()
    items = [e for ch in text for e in p.feed(ch)] + p.finish()
    assert clean_from_items(items) == clean


@pytest.mark.parametrize("text, clean", [
    ("<sy</async>nc/>", "nc/>"),
    ("</</async>async>", "async>"),
    ('a <prom</async>ise topic="x" tokens="3"/> b', 'a ise topic="x" tokens="3"/> b'),
    ("x <</async>sync/>", "x <"),  # a lone '<' stays, what would complete it into a tag goes
])
def test_a_partial_tag_cut_short_by_async_close_goes_with_it(text, clean):
    """``</async>`` cuts a partial tag short as every tag does: kept as text, the partial tag met
    the text after the ``</async>`` and showed a whole tag (``<sy</async>nc/>`` read ``<sync/>``)."""
    assert any(isinstance(e, AsyncClose) for e in parse(text))
    assert clean_text(text) == clean
    assert not [e for e in parse(clean) if not isinstance(e, Text)], clean  # no tag, no tag-like text
    p = TagParser()
    assert clean_from_items([e for ch in text for e in p.feed(ch)] + p.finish()) == clean
    assert strip_tags(text) == text.replace("</async>", "")  # nothing the model wrote is lost


def streamed_cleans(pieces, special_tokens=None):
    """The clean text after each piece as a stream shows it, and the final one (PASTA-LANG)."""
    return stream_cleans(TagParser(special_tokens=dict(special_tokens or {})), pieces)


LONE = ["<", "<<", "a<", "x <", "a <<", "<p<", "\n- <"]  # text that ends with a lone '<' (or several)
AFTER = [" b", "b", "", "\nc", " < d", "<b"]  # text after the tag that does not join the '<' into a tag


@pytest.mark.parametrize("tag", TAGS + ['<promise topic="a\nb" tokens="3"/>', '<promise topic="x" tokens="N"/>'])
@pytest.mark.parametrize("before", LONE + ["< ", "a< "])
@pytest.mark.parametrize("after", AFTER)
def test_a_lone_lt_right_before_a_tag_stays_in_the_clean_text(before, tag, after):
    """A lone '<' the model writes right before a tag (or a malformed tag) is its text: it stays
    in the clean text, whole and streamed, and in what the parser emits; the tag is left out."""
    text = before + tag + after
    want = before + after
    assert clean_text(text) == want
    assert strip_tags(text) == (want if tag in TAGS else text)  # only well-formed tags go
    assert raw_of(parse(text)) == text  # nothing the model wrote is lost
    for pieces in ([text], list(text), [before, tag, after]):
        shown, final = streamed_cleans(pieces)
        assert final == want
        assert all(want.startswith(s) for s in shown), (pieces, shown)  # never taken back
        assert shown[-1] == want  # the '<' is shown once the tag after it is read


def test_a_lone_lt_before_a_promise_written_as_piece_tokens_stays():
    """``<promise topic="`` as one added token, right after text that ends with '<'."""
    special = {1001: '<promise topic="', 1002: '" tokens="', 1003: '"/>', 1004: "<sync/>", 1005: "</async>"}
    for before in LONE:
        pieces = ["Tip", before, 1001, "Sle", "ep", 1002, "1", "0", 1003, " b", 1004, " c"]
        items = parse(pieces, special)
        kinds = [type(e) for e in items]
        assert kinds == [Text, Promise, Text, Sync, Text], (before, items)
        assert items[0] == Text("Tip" + before) and items[1].topic == "Sleep"
        shown, final = streamed_cleans(pieces, special)
        assert final == "Tip" + before + " b c"
        assert all(final.startswith(s) for s in shown) and "Tip" + before in shown[2:]  # shown with the promise's head
        for lt in ["<", "<<"]:  # '<' then the sync token, and '<' then the chunk's close
            assert parse(["x ", lt, 1004, " y"], special)[0] == Text("x " + lt)
            assert parse(["x ", lt, 1005], special) == [Text("x " + lt), AsyncClose(raw="</async>", end=4 + len(lt))]


@pytest.mark.parametrize("text, clean", [
    ("x <<sync/>sync/> y", "x < y"),
    ("x <<sync/>sync/>sync/>", "x <"),  # the '<' stands before what was left out: again
    ("x <<sync/>sync x", "x <"),  # tag-like through the next '>' or the end
    ("x <<sync/>sync x> y", "x < y"),
    ("x <<sync/>sy<sync/>nc/>", "x <nc/>"),  # a partial tag a tag cuts short goes with it
    ("x <<sync/>sy nc/>", "x <sy nc/>"),  # no tag: it all stays
    ("x <<sync/>/async> y", "x < y"),
    ("x <<sync/><sync/> y", "x < y"),
    ('a <<promise topic="t" tokens="3"/><async></async>sync/> b', "a < b"),  # an empty chunk
    ('a <<promise topic="t" tokens="3"/><async>async> c</async> b', "a < c b"),  # the chunk's first words
    ('a <<promise topic="t" tokens="3"/><async>c<</async>sync/> b', "a <c< b"),  # the text after a chunk
    ("- <<sync/>sync/>\n- b", "- <\n- b"),  # the item keeps its '<': not empty
])
def test_text_that_would_complete_a_kept_lt_into_a_tag_is_left_out(text, clean):
    """Nothing the model wrote is lost and no tag text reaches the clean text: the lone '<' stays,
    so the text after the left-out tag that would complete it into a tag (or tag-like text) is
    left out instead, in the whole text and as it streams, in every cut of the text."""
    assert clean_text(text) == clean
    assert not [e for e in parse(clean) if not isinstance(e, Text)], clean  # no tag, no tag-like text
    assert raw_of(parse(text)) == text
    for pieces in ([text], list(text)):
        shown, final = streamed_cleans(pieces)
        assert final == clean and all(clean.startswith(s) for s in shown), (pieces, shown)


LT_PIECES = st.sampled_from(["<", "<", "<<", "a", " ", "\n", "- ", "sync", "/>", "sync/>", "async>", "/async>", "sy",
                             "promise", ' topic="x" tokens="3"', ">", "</", "<p"] + TAGS)


@settings(max_examples=300, deadline=None)
@given(st.lists(LT_PIECES, max_size=14))
def test_lone_lts_stay_and_never_join_into_tag_text(pieces):
    """Every lone '<' right before a tag stays, the clean text never holds tag text, and the
    stream of any cut never takes text back and ends as the whole text's clean text."""
    text = "".join(pieces)
    clean = clean_text(text)
    assert not any(isinstance(e, (Promise, AsyncOpen, AsyncClose, Sync, TagText)) for e in parse(clean)), clean
    assert clean.count("<") >= sum(1 for e in parse(text) if type(e) is Text and e.text.endswith("<"))
    shown, final = streamed_cleans(pieces)
    assert final == clean
    assert all(clean.startswith(s) for s in shown), shown


def test_a_tag_in_a_broken_topics_tail_is_read_with_the_piece_that_completes_it():
    """A promise whose topic broke on a '<' holds the rest back; a tag head in it ends the hold,
    so the tag comes out with its last character (a fork or a sync acted on then), not tokens
    later when a longer tail failed."""
    p = TagParser()
    assert p.feed('<promise topic="a') == []
    assert p.feed("<") == [Malformed(raw='<promise topic="a<', reason="malformed tag"), TagText('<promise topic="a')]
    got = p.feed("promise topic='b' tokens='1'/>")
    assert [type(e) for e in got] == [Promise] and got[0].topic == "b"
    assert p.pending == "" and p.feed('x"y') == [Text('x"y')]
    for text, kinds in [
        ('<promise topic="a<sync/>x"y', [Malformed, TagText, Sync, Text]),
        ('<promise topic="a\n</async>b', [Malformed, TagText, Text, AsyncClose, Text]),
        ('<promise topic="a<b" tokens="3"/> c', [Malformed, TagText, Text]),  # no tag head: left out whole
    ]:
        assert [type(e) for e in parse(text)] == kinds, text
        for cut in range(1, len(text)):  # the same split anywhere (streaming)
            assert normalize(parse([text[:cut], text[cut:]])) == normalize(parse(text)), (text, cut)
    # the sync comes out with its '>', not with the character that ended the tail
    p = TagParser()
    out = [(ch, e) for ch in '<promise topic="a<sync/>x"y' for e in p.feed(ch)]
    assert [ch for ch, e in out if isinstance(e, Sync)] == [">"]


def test_thread_text_leaves_out_what_would_rejoin_a_kept_lt_into_a_tag():
    """One thread's text on its own (its stream's per-thread deltas): ``x <<sync/>sync/> y``
    written by one thread shows ``x < y`` as the spliced text does (it showed ``x <sync/> y``),
    a chunk whose promise follows the parent's ``<`` is read after it, undecided text after a
    kept ``<`` is held while the thread runs, and offsets move with the cuts."""
    from pasta_engine.lang.tags import thread_text

    text, moved = thread_text("x <sync/> y", [3], final=True)  # "x <" <sync/> "sync/> y"
    assert text == "x < y" and [moved(o) for o in (0, 3, 5, 9, 11)] == [0, 3, 3, 3, 5]
    assert thread_text("x <syn", [3], final=False)[0] == "x <"  # may still become "sync/>"
    assert thread_text("x <syn", [3], final=True)[0] == "x <syn"  # it never did: the model's text
    assert thread_text("x <, y", [3], final=False)[0] == "x <, y"  # text after the '<': decided
    assert thread_text("sync/> b", [], final=True, after_lt=True)[0] == " b"
    assert thread_text("b c", [], final=True, after_lt=True)[0] == "b c"
    plain, same = thread_text("a b", [1, 3], final=False)
    assert plain == "a b" and same(2) == 2
