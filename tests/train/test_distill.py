"""Self-distillation of the content (train.distill): which tokens are content, the reading order,
the teacher's rows, the loss by hand, and `train sft --content-loss distill` end to end."""

from __future__ import annotations

import json
import math

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from pasta_engine.lang.grammar import TagTokens, add_tag_tokens
from pasta_engine.lang.prompts import LEARNED_PASTA_PROMPT
from pasta_engine.lang.tags import strip_tags
from pasta_engine.lang.tokenization import encode_prompt, eos_token_ids
from pasta_engine.train.distill import content_mask, distill_loss, reading_order, teacher_rows
from pasta_engine.train.forward import layout_for

from sample_traces import SLEEP_PROMPT as PROMPT  # noqa: E402  (tests/sample_traces.py)
from sample_traces import SLEEP_TIPS as ANNOTATED  # noqa: E402

TAGS = TagTokens(promise_open=1, promise_length=2, promise_close=3, async_open=4, async_close=5, sync=6)


def test_content_mask_leaves_out_each_tag_with_its_topic_and_length():
    #        text  <promise  topic  " tokens="  3   0   "/>  text <async> text </async> <sync/> text eos
    tokens = [10, 1, 11, 2, 12, 13, 3, 14, 4, 15, 5, 6, 16, 99]
    want = [True, False, False, False, False, False, False, True, False, True, False, False, True, True]
    assert content_mask(tokens, TAGS) == want
    # an unterminated promise runs to the end
    assert content_mask([10, 1, 11, 12], TAGS) == [True, False, False, False]


def test_distill_loss_by_hand():
    # three sampled tokens over a vocabulary of 3 (+1 tag row in the student): two soft, one hard
    student = torch.log_softmax(torch.tensor([[1.0, 0.0, 0.0, -1.0], [0.0, 2.0, 0.0, 0.0], [0.0, 0.0, 0.0, 3.0]]), -1)
    teacher = torch.log_softmax(torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 0.0]]), -1)
    targets = torch.tensor([0, 1, 3])
    soft = torch.tensor([True, True, False])
    weights = torch.tensor([7.0, 7.0, 4.0])  # soft tokens weigh 1 whatever they are given
    loss, parts = distill_loss(student, targets, soft, teacher, weights)
    p = teacher.exp()
    ce = [-(p[i] * student[i, :3]).sum().item() for i in range(2)]
    nll = -student[2, 3].item()
    assert float(loss) == pytest.approx((ce[0] + ce[1] + 4 * nll) / 6, rel=1e-6)
    ent = [-(p[i] * teacher[i]).sum().item() for i in range(2)]
    assert parts["kl"] == pytest.approx(((ce[0] - ent[0]) + (ce[1] - ent[1])) / 2, rel=1e-6)
    assert parts["hard_nll"] == pytest.approx(nll) and parts["soft_fraction"] == pytest.approx(2 / 3)
    # a student that is the teacher (tag row at -inf) has no divergence
    same = torch.cat([teacher, torch.full((2, 1), -math.inf)], 1)
    _, parts = distill_loss(same, torch.tensor([0, 1]), torch.tensor([True, True]), teacher)
    assert parts["kl"] == pytest.approx(0.0, abs=1e-6)
    with pytest.raises(ValueError, match="teacher rows"):
        distill_loss(student, targets, torch.tensor([True, False, False]), teacher)
    with pytest.raises(ValueError, match="larger"):
        distill_loss(student[:, :2], targets, soft, teacher)


@pytest.fixture
def tagged(tiny_llama):
    tok = AutoTokenizer.from_pretrained(tiny_llama)
    tags = add_tag_tokens(tok)
    model = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    return tok, tags, model


def test_reading_order_is_the_clean_text_and_the_teacher_reads_it_sequentially(tagged):
    tok, tags, teacher = tagged
    student = AutoModelForCausalLM.from_pretrained(teacher.name_or_path, dtype=torch.float32)
    student.resize_token_embeddings(len(tok), mean_resizing=False)
    layout = layout_for(student, tok, PROMPT, ANNOTATED, pasta_prompt=LEARNED_PASTA_PROMPT)
    assert len(layout.forks) == 3  # three chunks (the last one inline or not, each with its parent's offset)
    eos = eos_token_ids(tok, teacher.config)
    mask = content_mask(layout.token_ids, tags)
    text, starts = reading_order(layout, mask, tok.decode, eos)
    assert text == strip_tags(ANNOTATED)
    # each content token starts where its text is, in the reading order
    for t, s0, c in zip(layout.token_ids, starts, mask):
        if c and t not in eos:
            piece = tok.decode([t])
            assert text[s0:s0 + len(piece)] == piece
        else:
            assert s0 == -1

    targets, soft, rows = teacher_rows(teacher, tok, PROMPT, layout, tags, eos)
    assert targets == layout.sampled()[1] and rows.shape[0] == sum(soft)
    tag_positions = [not c for c, q in zip(mask, layout.target_index) if q is not None]
    assert not any(s and t for s, t in zip(soft, tag_positions))  # a tag token never gets a teacher row
    assert sum(soft) >= 0.8 * (len(soft) - sum(tag_positions))  # most content tokens do
    assert not soft[-1] and targets[-1] in eos  # the end of the answer keeps its one-hot target (a decision, like a tag)
    # the rows are the teacher's causal distribution over the canonical tokens of the clean text
    prompt_ids = encode_prompt(tok, [{"role": "user", "content": PROMPT}], "text")
    canon = tok(text, add_special_tokens=False)["input_ids"]
    with torch.no_grad():
        want = torch.log_softmax(teacher(torch.tensor([prompt_ids + canon])).logits[0, len(prompt_ids) - 1:].float(), -1)
    torch.testing.assert_close(rows[-1], want[-2])  # the last content token's row; the end's (want[-1]) is not used
    first = want[0] if canon[0] == targets[0] else None
    if first is not None:
        torch.testing.assert_close(rows[0], first)
    for r in rows:  # every row is one of the teacher's
        assert torch.isclose(want, r[None]).all(1).any()

    # hard_open: each chunk's first 3 content tokens keep one-hot targets, the rest as before
    t3, soft3, rows3 = teacher_rows(teacher, tok, PROMPT, layout, tags, eos, hard_open=3)
    assert t3 == targets
    seen: dict[int, int] = {}
    k = 0
    for tid, q, c in zip(layout.thread_ids, layout.target_index, mask):
        n = seen.get(tid, 0)
        if c and tid != layout.main_tid:
            seen[tid] = n + 1
        if q is None:
            continue
        if c and tid != layout.main_tid and n < 3:
            assert not soft3[k]
        else:
            assert soft3[k] == soft[k]
        k += 1
    assert sum(soft) - sum(soft3) >= 3 * 2 and rows3.shape[0] == sum(soft3)


def test_train_sft_content_loss_distill(tiny_llama, tmp_path, capsys):
    from pasta_engine.entrypoints.cli import main

    listed = "Tips:\n1. Go to bed early, and get up at the same time every day.\n2. Avoid screens at night.\n"
    prompts = tmp_path / "p.json"
    prompts.write_text(json.dumps([{"instruction": PROMPT, "dataset": "koala", "output": listed}]))
    out = tmp_path / "sft"
    rc = main(["train", "sft", "--prompts", str(prompts), "--model", str(tiny_llama), "--out", str(out),
               "--grad-accum", "1", "--epochs", "4", "--lr", "5e-2", "--warmup", "1", "--lora-r", "4",
               "--lora-alpha", "8", "--tag-tokens", "--content-loss", "distill", "--tag-weight", "5"])
    _, err = capsys.readouterr()
    assert rc == 0, err
    curve = json.loads((out / "loss.json").read_text())
    assert len(curve) == 4 and all({"kl", "hard_nll", "soft_fraction"} <= set(p) for p in curve)
    assert 0 < curve[0]["soft_fraction"] < 1
    assert curve[-1]["loss"] < curve[0]["loss"]
    manifest = json.loads((out / "adapter" / "manifest.json").read_text())
    assert manifest["stages"][0]["settings"]["content_loss"] == "distill"
    # without tag tokens it cannot tell tags from content: refused before training
    rc = main(["train", "sft", "--prompts", str(prompts), "--model", str(tiny_llama), "--out", str(tmp_path / "x"),
               "--grad-accum", "1", "--max-steps", "1", "--content-loss", "distill"])
    assert rc != 0 and "--tag-tokens" in capsys.readouterr().err


def test_a_token_that_starts_inside_a_character_has_no_start(smollm2_dir):
    """Byte-level pieces of one emoji: the cut character decoded as one U+FFFD gave the piece
    after it the next character's start, and so another place's teacher row."""
    from types import SimpleNamespace

    from transformers import AutoConfig

    from pasta_engine.lang.detokenizer import token_bytes_for

    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    tags = add_tag_tokens(tok)
    cfg = AutoConfig.from_pretrained(smollm2_dir)
    trace = ('Ideas 😀😀:\n1. <promise topic="x" tokens="8"/><async>Smile 😀😀😀 a lot.</async>\n'
             '2. <promise topic="y" tokens="8"/><async>Laugh 😂😂.</async>\n<sync/>\nEnd 🎉🎉.')
    layout = layout_for(SimpleNamespace(config=cfg), tok, "Q?", trace)
    mask = content_mask(layout.token_ids, tags)
    eos = eos_token_ids(tok, cfg)
    text, starts = reading_order(layout, mask, tok.decode, eos)
    table = token_bytes_for(tok).table
    content = [(t, s0) for t, s0, c in zip(layout.token_ids, starts, mask) if c and t not in eos]
    inside = [(t, s0) for t, s0 in content if table[t][0] & 0xC0 == 0x80]  # a UTF-8 continuation byte first
    assert inside and all(s0 == -1 for _, s0 in inside)
    whole = [(t, s0) for t, s0 in content if table[t][0] & 0xC0 != 0x80]
    assert all(s0 >= 0 and text[s0:].encode().startswith(table[t]) for t, s0 in whole)
