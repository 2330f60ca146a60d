"""The offline quality proxies (issue 19 item 6) on hand-built strings, with exact values; their
side-by-side table in ``bench learned``'s summary; ``bench/quality_proxies.py`` on a stored run."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from pasta_engine.metrics import (
    TAG_TEXT_MARKERS,
    distinct_n,
    empty_list_items,
    has_tag_text,
    repeated_line_fraction,
    summarize_text_proxies,
    text_proxies,
)

ROOT = Path(__file__).resolve().parents[1]


def test_repeated_line_fraction():
    assert repeated_line_fraction("") == 0.0
    assert repeated_line_fraction("a\nb\nc") == 0.0
    # 4 non-empty lines (blank ones skipped, spaces stripped), 2 repeat an earlier one
    assert repeated_line_fraction("## Tips\n\n  ## Tips\nwalk\n## Tips  \n") == 2 / 4
    from pasta_engine.train.quality import repeated_line_fraction as from_quality

    assert from_quality is repeated_line_fraction  # one definition, imported where it was


def test_distinct_2_counts_word_bigrams_exactly():
    assert distinct_n("the cat sat", 2) == 1.0  # 2 bigrams, both distinct
    # "a b a b a b": bigrams ab ba ab ba ab -> 2 distinct of 5
    assert distinct_n("a b a b a b", 2) == 2 / 5
    # words are whitespace pieces, case and punctuation kept: "Go go. go go" -> (Go,go.) (go.,go) (go,go)
    assert distinct_n("Go go.\n go  go", 2) == 1.0
    assert distinct_n("x x x x", 2) == 1 / 3
    assert distinct_n("one", 2) == 0.0 and distinct_n("", 2) == 0.0  # no bigram: not a varied answer
    assert distinct_n("a a b", 1) == 2 / 3
    with pytest.raises(ValueError):
        distinct_n("a b", 0)


def test_empty_list_items_are_lines_of_bare_markers():
    text = ("Tips:\n- \n-\n* \n+\n\u2022 \n1. \n17.\n2)\n   - \n1. 1. \n- -\n"  # 11 bare markers
            "- walk\n1. Sleep\n---\n* * *\n***\n1.5\n-- \n**Bold**\n")  # items with text, rules, numbers
    assert empty_list_items(text) == 11
    assert empty_list_items("1. **Python**:\n   - \n   - \n   - <promise\n") == 2
    assert empty_list_items("") == 0


def test_empty_list_items_from_tags_counts_only_items_a_left_out_tag_emptied():
    from pasta_engine.metrics import empty_list_items_from_tags

    # the model wrote "- " bare itself: in the annotated text it is bare too
    assert empty_list_items_from_tags("a\n- \nb", "a\n- \nb") == 0
    # a bare "- 1) " in the clean text whose annotated line held a promise: one
    ann = 'a<promise topic="t" tokens="10"/><async>x\n- 1) <promise topic="y" tokens="10"/>\nz</async>'
    assert empty_list_items_from_tags("ax\n- 1) \nz", ann) == 1
    assert empty_list_items_from_tags("ax\nz", ann) == 0  # what the clean text is (drop_empty_items)
    s = summarize_text_proxies(["ax\nz", "a\n- \nb"], ["stop", "stop"], [ann, "a\n- \nb"])
    assert s["answers_with_empty_list_items"] == 1 and s["answers_with_empty_list_items_from_tags"] == 0
    with pytest.raises(ValueError, match="annotated"):
        summarize_text_proxies(["a"], ["stop"], [])


def test_tag_text_markers():
    assert TAG_TEXT_MARKERS == ("<promise", "<async", "</async", "<sync", '" tokens="')
    for shown in ('6. <promise topic="Social', "a <async>b", "b</async> c", "x <sync/>", 'topic="a" tokens="1',
                  '1. 20"/>\n2. 20"/>', 'x 5"/>', '(20"/>', "cut at <sync", "a <promise"):
        assert has_tag_text(shown), shown
    for clean in ("", "Use <div> and </span> in HTML.", "promise me", 'a "tokens" b', "<sync"[:-1], 'say "hi"/>',
                  '<img src="a.png" width="20"/>', "<rect x='1' height=\"300\"/>",
                  '<circle cx="5" cy="5" r="2.5"/>', "#include <syncstream>", "import <asyncio>"):
        assert not has_tag_text(clean), clean


def test_text_proxies_of_one_answer_and_of_a_side():
    a = "Tips:\n- \n- walk\n- walk\n"
    # words Tips: - - walk - walk: bigrams (Tips:,-) (-,-) (-,walk) (walk,-) (-,walk), 4 distinct of 5
    assert text_proxies(a) == {"repeated_lines": 1 / 4, "distinct_2": 4 / 5, "empty_list_items": 1, "tag_text": False}
    b = 'Yes. <promise topic="x'
    s = summarize_text_proxies([a, b, "the cat sat"], ["stop", "length", "stop"])
    assert s == {
        "answers": 3,
        "mean_repeated_lines": (1 / 4 + 0 + 0) / 3,
        "mean_distinct_2": (4 / 5 + 2 / 2 + 1.0) / 3,
        "cut_fraction": 1 / 3,
        "answers_with_empty_list_items": 1,
        "empty_list_items": 1,
        "answers_with_tag_text": 1,
    }
    with pytest.raises(ValueError):
        summarize_text_proxies([], [])
    with pytest.raises(ValueError):
        summarize_text_proxies(["a"], [])


def _side(text: str, finish: str, quality: float) -> dict:
    return {"text": text, "finish_reason": finish, "quality": quality}


ROWS = [
    {"instruction": "p1", "base_sequential": _side("a b c", "length", -0.5),
     "adapter_pasta": _side("1. \n2. <promise", "length", -1.0)},
    {"instruction": "p2", "base_sequential": _side("x x x\nx x x", "stop", -0.7),
     "adapter_pasta": _side("fine answer", "stop", -0.8)},
]


def test_learned_summary_reports_the_proxies_side_by_side():
    from pasta_engine.train.evaluate import format_quality_proxies, quality_proxies

    table = quality_proxies(ROWS)
    assert list(table) == ["base_sequential", "adapter_pasta"]  # no base_pasta in these rows
    base, ad = table["base_sequential"], table["adapter_pasta"]
    assert base["mean_repeated_lines"] == 0.25 and base["cut_fraction"] == 0.5
    assert base["mean_distinct_2"] == pytest.approx((1.0 + 1 / 5) / 2)  # "x x x\nx x x": 1 distinct of 5 bigrams
    assert base["answers_with_tag_text"] == 0 and base["mean_likelihood_proxy"] == pytest.approx(-0.6)
    assert ad["answers_with_empty_list_items"] == 1 and ad["answers_with_tag_text"] == 1
    assert ad["mean_distinct_2"] == 1.0 and ad["mean_likelihood_proxy"] == pytest.approx(-0.9)
    line = format_quality_proxies(table)
    assert line.startswith("quality proxies (base_sequential / adapter_pasta): repeated lines 25.0% / 0.0%")
    assert "with tag text 0 / 1" in line and "likelihood -0.600 / -0.900" in line


def test_quality_proxies_script_reads_a_stored_run(tmp_path):
    (tmp_path / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    done = subprocess.run([sys.executable, str(ROOT / "bench" / "quality_proxies.py"), str(tmp_path)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    from pasta_engine.train.evaluate import quality_proxies

    assert out["prompts"] == 2 and out["quality_proxies"] == quality_proxies(ROWS)
    assert "quality proxies (base_sequential / adapter_pasta)" in done.stderr
