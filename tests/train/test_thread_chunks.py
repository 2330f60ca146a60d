"""Chunks rewritten in their own thread's context (pasta_engine.train.thread_chunks): what each
chunk's thread sees, how a rewrite ends, the reassembled annotation, resumption, and the two
commands (`train chunks`, `train sft --examples`) on a tiny model."""

from __future__ import annotations

import gzip
import json
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from pasta_engine.lang.tags import split_threads, strip_tags
from pasta_engine.train.data import TrainExample
from pasta_engine.train.thread_chunks import (
    ChunkJob, _finish, assemble, chunk_jobs, chunk_opening, chunk_topics, rewrite_chunks,
)

from sample_traces import SLEEP_PROMPT, SLEEP_TIPS  # noqa: E402  (tests/sample_traces.py)


def _words(s: str) -> int:
    return len(s.split())


def test_each_chunk_sees_its_siblings_as_topics_and_a_synced_group_in_full():
    jobs = chunk_jobs(SLEEP_TIPS, ["bedtime", "screens", "walking"], _words)
    assert [j.prefix for j in jobs] == [
        "Tips:\n1. Go to bed",  # its own opening: the first three words
        "Tips:\n1. bedtime\n2. Avoid screens.",  # the sibling before it as its topic only
        # after the <sync/> the earlier chunks are seen in full
        "Tips:\n1. Go to bed early, and get up at the same time every day.\n2. Avoid screens.\n\nAlso: Walk daily.",
    ]
    assert [j.stop for j in jobs] == [("\n",), ("\n",), ("\n\n", "\r\n\r\n")]  # list items end at their line
    assert [j.max_new_tokens for j in jobs] == [48, 48, 48]
    assert chunk_jobs(SLEEP_TIPS, ["a", "b", "c"], _words, max_new_tokens=10)[0].max_new_tokens == 10
    with pytest.raises(ValueError, match="3 promises but 2 topics"):
        chunk_jobs(SLEEP_TIPS, ["a", "b"], _words)


def test_the_opening_is_the_bold_title_or_the_first_words():
    assert chunk_opening("**Exercise daily**: it helps sleep.") == "**Exercise daily**:"
    assert chunk_opening("  Keep the room cool and dark at night.") == "  Keep the room"
    assert chunk_opening("Walk daily.") == "Walk daily."


def test_a_rewrite_ends_at_its_unit_or_a_sentence_or_keeps_the_original():
    job = ChunkJob(prefix="x Go to", opening="Go to", stop=("\n",), max_new_tokens=48, content="Go to bed early.")
    assert _finish(job, " sleep at ten.  ", "stop") == ("Go to sleep at ten.", "stop")
    assert _finish(job, " sleep at ten. Then read a", "length") == ("Go to sleep at ten.", "cut")
    assert _finish(job, " sleep and then", "length") == ("Go to bed early.", "original")
    assert _finish(job, "", "stop") == ("Go to bed early.", "original")  # nothing written after the opening
    assert _finish(job, " <promise", "stop") == ("Go to bed early.", "original")  # tag-like text is never kept
    para = ChunkJob(prefix="p", opening="Also", stop=("\n\n",), max_new_tokens=48, content="Also this.\n")
    assert _finish(para, " that.", "stop") == ("Also that.\n", "stop")  # the original's trailing whitespace stays


def test_a_rewrite_whose_line_breaks_mid_sentence_is_cut_or_kept_original():
    job = ChunkJob(prefix="x Go to", opening="Go to", stop=("\n",), max_new_tokens=48, content="Go to bed early.")
    assert _finish(job, " sleep at ten. Then read a", "stop") == ("Go to sleep at ten.", "cut")
    assert _finish(job, " sleep and then", "stop") == ("Go to bed early.", "original")  # no sentence end
    assert _finish(job, ' sleep at ten." ', "eos") == ('Go to sleep at ten."', "stop")  # a closing quote ends it too
    phrase = ChunkJob(prefix="- Red", opening="Red", stop=("\n",), max_new_tokens=48, content="Red apples")
    assert _finish(phrase, " pears and plums", "stop") == ("Red pears and plums", "stop")  # the original is a phrase


def test_assemble_puts_new_topics_lengths_and_chunks_in_place():
    new = ["Sleep at ten, every single night of the week.", "No phones.", "Walk after dinner."]
    out = assemble(SLEEP_TIPS, ["bedtime", "screens", "walking"], new, _words)
    t = split_threads(out)
    assert [c.content for c in t.chunks] == new
    assert [(c.topic, c.tokens) for c in t.chunks] == [("bedtime", 10), ("screens", 10), ("walking", 10)]
    assert strip_tags(out) == f"Tips:\n1. {new[0]}\n2. {new[1]}\n\nAlso: {new[2]} Done."
    with pytest.raises(ValueError, match="3 promises"):
        assemble(SLEEP_TIPS, ["a"], ["b"], _words)


@dataclass
class _Stats:
    finish_reason: str


@dataclass
class _Result:
    text: str
    stats: _Stats


@dataclass
class _FakeEngine:
    """format_prompt/encode/generate of an Engine, writing a fixed continuation per chunk."""

    calls: list = field(default_factory=list)

    def format_prompt(self, prompt, mode="pasta"):
        assert mode == "sequential"  # the base model's own chat template, no PASTA-LANG prompt
        return [1, 2]

    def encode(self, text):
        return [ord(c) for c in text]

    def generate(self, prompts, params, mode="pasta"):
        assert mode == "sequential"
        self.calls.append((prompts, params))
        return [_Result(" rewritten.", _Stats("stop")) for _ in prompts]


def test_rewrite_chunks_prompts_the_base_model_as_each_thread_sees_the_answer_and_resumes(tmp_path):
    ex = TrainExample(SLEEP_PROMPT, SLEEP_TIPS, "koala", "mixed", 3, 30, ended=False)
    plain = TrainExample("plain", "No forks here.", "koala", "mixed", 0, 3)
    eng = _FakeEngine()
    got, counts = rewrite_chunks(eng, [ex, plain], tmp_path, count_tokens=_words, repetition_penalty=1.1, progress=False)
    [(prompts, params)] = eng.calls
    # while writing, an earlier sibling shows as the topic of its original text
    jobs = chunk_jobs(SLEEP_TIPS, chunk_topics([c.content for c in split_threads(SLEEP_TIPS).chunks]), _words)
    assert prompts == [[1, 2] + eng.encode(j.prefix) for j in jobs]
    new = split_threads(got[0].annotated).chunks  # the topics then say what the rewritten chunks cover
    assert [c.topic for c in new] == chunk_topics([c.content for c in new])
    assert [tuple(p.stop) for p in params] == [("\n",), ("\n",), ("\n\n", "\r\n\r\n")]
    assert all(p.temperature == 0 and p.repetition_penalty == 1.1 for p in params)
    assert [c.content for c in split_threads(got[0].annotated).chunks] == [
        "Go to bed rewritten.", "Avoid screens. rewritten.", "Walk daily. rewritten."]
    assert got[0].ended is False and got[0].annotator == "mixed+thread-rewrite"
    assert got[1].annotated == "No forks here."  # nothing to rewrite
    assert counts == {"answers": 2, "stop": 3, "cut": 0, "original": 0}
    again, _ = rewrite_chunks(eng, [ex, plain], tmp_path, count_tokens=_words, progress=False)
    assert len(eng.calls) == 1 and again == got  # read back from examples.jsonl: no second generation
    # a stored run keeps its rows gzipped: it resumes from examples.jsonl.gz alone
    log = tmp_path / "examples.jsonl"
    (tmp_path / "examples.jsonl.gz").write_bytes(gzip.compress(log.read_bytes()))
    log.unlink()
    packed, _ = rewrite_chunks(eng, [ex, plain], tmp_path, count_tokens=_words, progress=False)
    assert len(eng.calls) == 1 and packed == got and log.exists()


def test_train_chunks_then_sft_on_its_examples(tiny_llama, tmp_path, capsys):
    from pasta_engine.entrypoints.cli import main

    listed = "Tips:\n1. Go to bed early, and get up at the same time every day.\n2. Avoid screens at night.\n"
    prompts = tmp_path / "answers.json"
    prompts.write_text(json.dumps([{"instruction": SLEEP_PROMPT, "dataset": "koala", "output": listed},
                                   {"instruction": "eval", "dataset": "vicuna", "output": listed}]))
    assert main(["train", "chunks", "--prompts", str(prompts), "--model", str(tiny_llama), "--out",
                 str(tmp_path / "chunks"), "--max-chunk-tokens", "8"]) == 0
    rows = [json.loads(x) for x in (tmp_path / "chunks" / "examples.jsonl").read_text().splitlines()]
    assert [r["prompt"] for r in rows] == [SLEEP_PROMPT]  # never the vicuna row
    assert rows[0]["promises"] == 2 and sum(len(rows[0]["chunks"]) for _ in rows) == 2
    assert strip_tags(rows[0]["annotated"]).startswith("Tips:\n1. Go to bed")
    assert main(["train", "sft", "--prompts", str(prompts), "--examples", str(tmp_path / "chunks" / "examples.jsonl"),
                 "--model", str(tiny_llama), "--out", str(tmp_path / "sft"), "--grad-accum", "1", "--max-steps", "1",
                 "--lora-r", "4", "--lora-alpha", "8", "--tag-tokens"]) == 0
    [ex] = [json.loads(x) for x in (tmp_path / "sft" / "examples.jsonl").read_text().splitlines()]
    assert ex["annotated"] == rows[0]["annotated"]
    # an examples file holding an evaluation prompt is refused, naming the flag
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({**rows[0], "prompt": "eval", "dataset": "vicuna"}) + "\n")
    capsys.readouterr()
    assert main(["train", "sft", "--prompts", str(prompts), "--examples", str(bad), "--model", str(tiny_llama),
                 "--out", str(tmp_path / "sft2")]) != 0
    assert "--examples" in capsys.readouterr().err


def test_train_sft_system_prompt_is_trained_and_recorded(tiny_llama, tmp_path):
    """``--system-prompt ''`` trains without the one-line PASTA-LANG system message (the chat
    template's own, the context the base model wrote its answers in); the manifest records it, so
    the engine runs the adapter the same way; a continued adapter keeps its prompt."""
    from pasta_engine import Engine
    from pasta_engine.entrypoints.cli import main

    listed = "Tips:\n1. Go to bed early, and get up at the same time every day.\n2. Avoid screens at night.\n"
    prompts = tmp_path / "answers.json"
    prompts.write_text(json.dumps([{"instruction": SLEEP_PROMPT, "dataset": "koala", "output": listed}]))
    args = ["--model", str(tiny_llama), "--grad-accum", "1", "--max-steps", "1", "--lora-r", "4", "--lora-alpha", "8"]
    assert main(["train", "sft", "--prompts", str(prompts), "--out", str(tmp_path / "a"), "--tag-tokens",
                 "--system-prompt", "", *args]) == 0
    manifest = json.loads((tmp_path / "a" / "adapter" / "manifest.json").read_text())
    assert manifest["pasta_prompt"]["system"] == ""
    engine = Engine.from_pretrained(tiny_llama, adapter=tmp_path / "a" / "adapter", kv_cache_bytes=8 * 2**20)
    assert engine.config.pasta_prompt.system == "" and engine.config.pasta_prompt.messages("hi") == [
        {"role": "user", "content": "hi"}]
    assert main(["train", "sft", "--prompts", str(prompts), "--out", str(tmp_path / "b"),
                 "--adapter", str(tmp_path / "a" / "adapter"), *args[:-4]]) == 0  # the adapter's own LoRA shape
    assert json.loads((tmp_path / "b" / "adapter" / "manifest.json").read_text())["pasta_prompt"]["system"] == ""


def test_a_malformed_tag_is_seen_once_and_a_topic_after_a_bare_marker_gets_its_space():
    ann = ('Intro <sync> here.\n1.<promise topic="a" tokens="10"/><async> Use <asyncx> in code.</async>\n'
           '2.<promise topic="b" tokens="10"/><async> Second item text.</async>')
    jobs = chunk_jobs(ann, ["use", "second"], _words)
    # the parser reports a malformed tag and then gives its characters as text: counted once
    assert jobs[0].prefix == "Intro <sync> here.\n1. Use <asyncx> in"
    assert jobs[1].prefix == "Intro <sync> here.\n1. use\n2. Second item text."  # "1. use", not "1.use"
    out = assemble(ann, ["use", "second"], [c.content for c in split_threads(ann).chunks], _words)
    assert strip_tags(out) == strip_tags(ann)


def test_a_list_item_ends_before_the_next_item_and_never_on_a_bare_marker():
    tight = ChunkJob(prefix="Plan:\n1. Pack bags:", opening=" Pack bags:", stop=("\n\n",), max_new_tokens=48,
                     content=" Pack bags:\n   - clothes\n   - shoes")
    # a multi-line item of a tight list: no blank line comes, the next item's marker ends the unit
    assert _finish(tight, "\n   - clothes\n   - a toothbrush.\n2. Book the train.\n3. Leave.", "length") == (
        " Pack bags:\n   - clothes\n   - a toothbrush.", "stop")
    bullet = ChunkJob(prefix="- Red", opening="Red", stop=("\n\n",), max_new_tokens=48, content="Red apples.")
    assert _finish(bullet, " apples.\n  - a nested dash stays.\n- Green pears.", "length") == (
        "Red apples.\n  - a nested dash stays.", "stop")
    para = ChunkJob(prefix="x To install it", opening="To install it", stop=("\n\n",), max_new_tokens=48,
                    content="To install it, run these steps.\n1. Download it.\n2. Run it.")
    # "2." alone at its line start is a list marker, not a sentence end to cut at
    assert _finish(para, ", follow these steps:\n1. Download the installer\n2. Run the", "length") == (para.content, "original")
    assert _finish(para, ", run this. Then:\n1. Download it\n2. Run", "length") == ("To install it, run this.", "cut")


def test_a_curly_quote_ends_a_sentence_and_a_comparison_is_not_a_tag():
    job = ChunkJob(prefix="x He said", opening="He said", stop=("\n",), max_new_tokens=48, content="He said no.")
    assert _finish(job, " “go home.”\n", "stop") == ("He said “go home.”", "stop")
    assert _finish(job, " it. Then “go", "length") == ("He said it.", "cut")
    code = ChunkJob(prefix="x Check that", opening="Check that", stop=("\n",), max_new_tokens=48, content="Check it.")
    assert _finish(code, " x < 10 holds.", "stop") == ("Check that x < 10 holds.", "stop")
    assert _finish(code, " <sync/> holds.", "stop") == ("Check it.", "original")


def test_rewrite_chunks_skips_empty_chunks_repeats_and_a_row_cut_off_by_an_interrupted_run(tmp_path):
    ex = TrainExample(SLEEP_PROMPT, SLEEP_TIPS, "koala", "mixed", 3, 30)
    empty = TrainExample("empty", 'Tips:\n1.<promise topic="a" tokens="10"/><async> </async>\n2.<promise topic="b" '
                         'tokens="10"/><async> Walk daily.</async>\n3.<promise topic="c" tokens="10"/>', "koala", "mixed", 3, 5)
    eng = _FakeEngine()
    got, counts = rewrite_chunks(eng, [ex, ex, empty], tmp_path / "run", count_tokens=_words, progress=False)
    [(prompts, _)] = eng.calls
    assert len(prompts) == 3 + 1  # the repeated answer once; of the third only its chunk with text
    assert got[0] == got[1]  # each copy counts its own chunks; the empty chunk and the chunkless promise stay
    assert counts == {"answers": 3, "stop": 7, "cut": 0, "original": 2}
    assert split_threads(got[2].annotated).chunks[0].content == " "  # the empty chunk kept, not written
    assert got[2].annotated.endswith('3.<promise topic="c" tokens="10"/>')  # no chunk invented
    log = tmp_path / "run" / "examples.jsonl"
    rows = log.read_text(encoding="utf-8").splitlines()
    log.write_text(rows[0] + "\n" + rows[1][:40], encoding="utf-8")  # killed while writing the second row
    again, _ = rewrite_chunks(eng, [ex, empty], tmp_path / "run", count_tokens=_words, progress=False)
    assert len(eng.calls) == 2 and eng.calls[1][0] == prompts[3:] and again == [got[0], got[2]]
    assert len(log.read_text(encoding="utf-8").splitlines()) == 2  # the cut-off row replaced, not appended to
    log.write_text("{oops\n" + rows[0] + "\n", encoding="utf-8")
    with pytest.raises(ValueError, match="line 1 is not a JSON row"):
        rewrite_chunks(eng, [ex], tmp_path / "run", count_tokens=_words, progress=False)


def test_rewrite_chunks_refuses_to_resume_under_other_flags(tmp_path):
    """A rerun with another --max-chunk-tokens / --repetition-penalty / model kept the first run's
    rewrites as if made under the new flags."""
    from pasta_engine.errors import ParameterError

    ex = TrainExample(SLEEP_PROMPT, SLEEP_TIPS, "koala", "mixed", 3, 30, ended=False)
    eng = _FakeEngine()
    rewrite_chunks(eng, [ex], tmp_path, count_tokens=_words, repetition_penalty=1.0, max_new_tokens=2,
                   model="m", progress=False)
    assert json.loads((tmp_path / "sampling.json").read_text()) == {
        "model": "m", "max_chunk_tokens": 2, "repetition_penalty": 1.0}
    for kw, flag in [({"max_new_tokens": 256}, "--max-chunk-tokens"), ({"repetition_penalty": 1.1},
                     "--repetition-penalty"), ({"model": "other"}, "--model")]:
        given = {"repetition_penalty": 1.0, "max_new_tokens": 2, "model": "m", **kw}
        with pytest.raises(ParameterError, match=f"{flag} .* then, .* now.*new --out") as e:
            rewrite_chunks(eng, [ex], tmp_path, count_tokens=_words, progress=False, **given)
        assert e.value.param == flag
    again, _ = rewrite_chunks(eng, [ex], tmp_path, count_tokens=_words, repetition_penalty=1.0, max_new_tokens=2,
                              model="m", progress=False)
    assert len(eng.calls) == 1  # the same flags go on from the kept rows
