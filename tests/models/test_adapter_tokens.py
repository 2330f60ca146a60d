"""PASTA-LANG pieces as added tokens: an adapter that adds them saves, loads into the base model
(embeddings grown, tokenizer extended) and gives the logits of peft's own forward; the engine
then tokenizes, replays and enforces the grammar with them."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from pasta_engine import Engine, SamplingParams
from pasta_engine.lang.grammar import TAG_PIECES, GrammarState, TagTokens, grammar_state, state_masks, tag_tokens_of
from pasta_engine.lang.tags import strip_tags
from pasta_engine.lang.tokenization import encode_text, tokenize_annotated
from pasta_engine.train import pasta_logprobs
from pasta_engine.train.common import LoraSettings, export_adapter, wrap_lora

ANNOTATED = (
    "Tips:\n1. "
    '<promise topic="sleep" tokens="30"/><async>Go to bed early.</async>\n2. '
    '<promise topic="screens" tokens="20"/><async>Avoid screens.</async>\n'
    "<sync/>\nDone."
)
PROMPT = "Give me sleep tips."


def _make_adapter(ckpt, out):
    """A LoRA adapter with the PASTA-LANG pieces as added tokens, its weights (LoRA and token
    rows) moved away from their start so that a merge that dropped them would show."""
    hf = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(ckpt)
    vocab = len(tok)
    torch.manual_seed(0)  # LoRA's own initialisation draws from the global generator: the same adapter every run
    model = wrap_lora(hf, LoraSettings(r=4, alpha=8, dropout=0.0), tokenizer=tok, tag_tokens=True)
    tags = tag_tokens_of(tok)
    assert tags is not None and len(tok) > vocab
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.requires_grad:
                p.add_(0.05 * torch.randn(p.shape, generator=g))
    export_adapter(model.eval(), out, {"added_tokens": tags.as_dict()})
    return model, tok


@pytest.fixture(scope="module", params=["tiny_qwen2", "tiny_llama"])  # tied and untied LM head
def tagged(request, tmp_path_factory):
    ckpt = request.getfixturevalue(request.param)
    out = tmp_path_factory.mktemp("tagged") / "adapter"
    peft_model, tok = _make_adapter(ckpt, out)
    return ckpt, out, peft_model, tok


def test_the_adapter_adds_the_pieces_and_merges_to_peft_logits(tagged):
    ckpt, adapter, peft_model, tok = tagged
    manifest = json.loads((adapter / "manifest.json").read_text())
    assert set(manifest["added_tokens"]) == set(TAG_PIECES)
    engine = Engine.from_pretrained(ckpt, adapter=adapter, kv_cache_bytes=8 * 2**20)
    tags = tag_tokens_of(engine.tokenizer)
    assert tags is not None and tags.as_dict() == manifest["added_tokens"]
    assert engine.model.config.vocab_size == len(tok) == engine.model.weights.lm_head.shape[0]
    # prompt ids that hold the new tokens: the merged rows must equal peft's
    prompt = [5, 6, tags.promise_open, 7, tags.promise_length, 8, tags.promise_close, tags.async_open, 9]
    seen = []
    engine.logits_hook = lambda req, tid, row: seen.append(row.clone())
    [res] = engine.generate([prompt], SamplingParams(max_new_tokens=5), mode="sequential")
    with torch.no_grad():
        want = peft_model(torch.tensor([prompt + res.token_ids[:-1]])).logits[0, len(prompt) - 1:].float()
    torch.testing.assert_close(torch.stack(seen), want[: len(seen)], rtol=1e-3, atol=1e-3)


def test_annotated_text_tokenizes_with_the_pieces_and_replays_exactly(tagged):
    ckpt, adapter, _, _ = tagged
    engine = Engine.from_pretrained(ckpt, adapter=adapter, kv_cache_bytes=8 * 2**20)
    tok = engine.tokenizer
    tags = tag_tokens_of(tok)
    at = tokenize_annotated(tok, ANNOTATED)
    assert at.open_ids == [tags.async_open]
    # a promise is: open, topic text, length piece, digits, close
    want = [tags.promise_open, *encode_text(tok, "sleep"), tags.promise_length, *encode_text(tok, "30"),
            tags.promise_close]
    assert at.main_ids[at.promise_ends[0] - len(want): at.promise_ends[0]] == want
    # the same text in a user's prompt is text, never a piece token
    assert not set(encode_text(tok, ANNOTATED)) & {tags.promise_open, tags.promise_length, tags.async_open,
                                                     tags.async_close, tags.sync}
    for mode in ("pasta", "sequential"):
        [res] = engine.replay([PROMPT], [ANNOTATED], mode=mode)
        assert res.text == strip_tags(ANNOTATED)
    [res] = engine.replay([PROMPT], [ANNOTATED], mode="pasta")
    assert res.stats.decode_steps == res.stats.critical_path and res.stats.forks == 2


def test_training_forward_equals_replay_with_the_pieces(tagged):
    ckpt, adapter, _, _ = tagged
    engine = Engine.from_pretrained(ckpt, adapter=adapter, kv_cache_bytes=8 * 2**20)
    [res] = engine.replay([PROMPT], [ANNOTATED], params=SamplingParams(return_logprobs=True))
    hf = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(ckpt)
    policy = wrap_lora(hf, adapter=adapter, tokenizer=tok).eval()
    ids, lps = pasta_logprobs(policy, tok, PROMPT, ANNOTATED)
    assert ids == res.token_ids
    got = torch.tensor([x for x in lps if x is not None])
    want = torch.tensor([x for x in res.logprobs if x is not None])
    torch.testing.assert_close(got, want, rtol=0, atol=1e-3)


def _boost(ids):
    def hook(req, tid, row):
        row[list(ids)] += 1e4  # the model now prefers these far above anything else
    return hook


def test_the_grammar_mask_keeps_forbidden_pieces_out(tagged):
    ckpt, adapter, _, _ = tagged
    engine = Engine.from_pretrained(ckpt, adapter=adapter, kv_cache_bytes=8 * 2**20)
    tags = tag_tokens_of(engine.tokenizer)
    # the model wants </async> on the main thread, <async>, and a promise's length and close
    # pieces outside a promise: all are masked there
    stray = [tags.async_close, tags.async_open, tags.promise_length, tags.promise_close]
    engine.logits_hook = _boost(stray)
    [res] = engine.generate(["Hi"], SamplingParams(max_new_tokens=12), mode="pasta")
    assert res.stats.finish_reason in ("stop", "length"), res.error
    assert not set(res.token_ids) & set(stray)
    # a model that wants to promise: the promise then follows the grammar to its close, and
    # the chunk never promises or syncs (no nesting) although the model prefers to
    state: dict = {}

    def hook(req, tid, row):
        if tid == 0 and not state.get("promised"):
            row[tags.promise_open] += 1e4
        elif tid > 0:
            row[[tags.promise_open, tags.sync, tags.promise_length, tags.promise_close]] += 1e4
    # a random model predicts 9999 tokens: reserve a constant range instead
    engine = Engine.from_pretrained(ckpt, adapter=adapter, kv_cache_bytes=8 * 2**20, position_policy="constant:8")
    engine.logits_hook = hook
    [res] = engine.generate(["Hi"], SamplingParams(max_new_tokens=120), mode="pasta")  # a 64-character topic fits
    assert res.stats.finish_reason in ("stop", "length"), res.error
    by_thread: dict[int, list[int]] = {}
    for t, th in zip(res.token_ids, res.threads):
        by_thread.setdefault(th, []).append(t)
    main = by_thread[0]
    assert main[0] == tags.promise_open
    # the first promise completes: open, >= 1 topic token, length piece, >= 1 digit, close
    k = main.index(tags.promise_length)
    assert k >= 2 and tags.promise_close in main[k + 2:]
    assert res.stats.forks >= 1, res.annotated_text
    for tid, toks in by_thread.items():
        if tid > 0:
            assert not set(toks) & {tags.promise_open, tags.sync, tags.promise_length, tags.promise_close}, \
                res.annotated_text


def test_grammar_states_follow_the_parsers_pending_text():
    assert grammar_state(False, "") is GrammarState.CHUNK
    assert grammar_state(True, "") is GrammarState.MAIN
    assert grammar_state(True, "", can_fork=False) is GrammarState.MAIN_NO_FORK
    assert grammar_state(True, "<prom") is GrammarState.MAIN  # text tokens: not constrained
    assert grammar_state(True, '<promise topic="') is GrammarState.TOPIC_EMPTY
    assert grammar_state(True, '<promise topic="Sleep') is GrammarState.TOPIC
    assert grammar_state(True, '<promise topic="' + "x" * 31) is GrammarState.TOPIC
    assert grammar_state(True, '<promise topic="' + "x" * 32) is GrammarState.TOPIC_FULL
    # the cap is in bytes: 8 four-byte emoji fill it (the learned model wrote ~20 in one topic)
    assert grammar_state(True, '<promise topic="' + "\N{GLOWING STAR}" * 7) is GrammarState.TOPIC
    assert grammar_state(True, '<promise topic="' + "\N{GLOWING STAR}" * 8) is GrammarState.TOPIC_FULL
    assert grammar_state(True, '<promise topic="a" tokens="') is GrammarState.LENGTH_EMPTY
    assert grammar_state(True, '<promise topic="a" tokens="3') is GrammarState.LENGTH
    assert grammar_state(True, '<promise topic="a" tokens="3000') is GrammarState.LENGTH_FULL
    # a broken partial tag held back before the piece ("<" then it) does not switch the promise's
    # grammar off: the parser still takes what follows as a promise
    assert grammar_state(True, '<<promise topic="') is GrammarState.TOPIC_EMPTY
    assert grammar_state(True, '<pro<promise topic="Sleep') is GrammarState.TOPIC
    assert grammar_state(True, '<<promise topic="a" tokens="3') is GrammarState.LENGTH
    # text tokens past the topic's quote ('=""' is one SmolLM2 token) or a length that is no
    # digits: TOPIC allowed topic text the parser then rejected, and masked every valid way on
    assert grammar_state(True, '<promise topic=""') is GrammarState.MAIN
    assert grammar_state(True, '<promise topic="" tokens=\'1\'') is GrammarState.MAIN
    assert grammar_state(True, '<promise topic="a" tokens="3"', can_fork=False) is GrammarState.MAIN_NO_FORK


def test_a_topic_already_promised_may_not_end_there():
    """Issue 30: siblings promised the same topic wrote the same chunk ("Dining Drawers" four
    times). A topic equal to one already promised (case, spacing, punctuation ignored) is
    ``TOPIC_TAKEN``: topic text only, no ``" tokens="``; a full topic must still end."""
    from pasta_engine.lang.grammar import topic_key

    taken = {topic_key("Dining Drawers")}
    assert topic_key("  dining   Drawers:") == "dining drawers"
    assert grammar_state(True, '<promise topic="Dining Drawers', taken=taken) is GrammarState.TOPIC_TAKEN
    assert grammar_state(True, '<promise topic="dining drawers:', taken=taken) is GrammarState.TOPIC_TAKEN
    assert grammar_state(True, '<promise topic="Dining Drawers for', taken=taken) is GrammarState.TOPIC
    assert grammar_state(True, '<promise topic="Dining Drawers', taken=()) is GrammarState.TOPIC
    full = "Dining Drawers" + " " * 18
    assert grammar_state(True, '<promise topic="' + full, taken={topic_key(full)}) is GrammarState.TOPIC_FULL
    table = [b"Sleep", b" more", b"x", b"3"]
    pieces = TagTokens(*range(len(table), len(table) + len(TAG_PIECES)))
    table += [p.encode() for p in TAG_PIECES]
    allow, ids = dict(zip(GrammarState, state_masks(pieces, table, len(table), eos_ids=[2])))[GrammarState.TOPIC_TAKEN]
    assert allow and set(ids) == {0, 1, 3}  # topic text, never the piece that would end it (nor EOS)


def test_a_chunk_may_not_end_empty_at_a_colon_or_on_a_bare_list_marker():
    """Issue 30: blind readers named chunks that stop at a colon ("Some popular items include:"
    and nothing after) or cut off among the defects of forked answers. With a tail, an async
    thread whose text is empty or stops at ``:``, ``,`` or ``;`` is ``CHUNK_OPEN``: no
    ``</async>``, no EOS. A chunk without a full stop may end (forcing a degenerate chunk on made
    it repeat itself). :func:`ends_sentence` is the cap's finer test (the interpreter's grace)."""
    from pasta_engine.lang.grammar import chunk_may_end, ends_sentence

    for done in ("It helps.", "Really?", "Go!", 'He said "yes."', "(see below.)", "**Done!**", "Wait\u2026",
                 "1. Apples\n", "It helps.  "):
        assert ends_sentence(done) and chunk_may_end(done), done
    # a last line that is only a list marker: the item it opens would reach the reader empty
    # (two chunks of the GPT-4-data adapter ended "...\n\n1." and "...:<br />\n\n1)")
    for open_ in ("", "  ", "\n", "Some popular items include:", "apples, pears,", "first; ", "functions.\n\n1.",
                  "<br />\n\n1)", "Tips.\n- ", "x\n  - 1) "):
        assert not ends_sentence(open_) and not chunk_may_end(open_), open_
    for fragment in ("which could include wheelchair-accessible", "It is 3", "**Bold**", "= 6ml", "It was 1949",
                     "---"):
        assert chunk_may_end(fragment) and not ends_sentence(fragment), fragment
    assert grammar_state(False, "", tail="Some items include:") is GrammarState.CHUNK_OPEN
    assert grammar_state(False, "", tail="") is GrammarState.CHUNK_OPEN  # an empty chunk may not end
    assert grammar_state(False, "", tail="It helps") is GrammarState.CHUNK
    assert grammar_state(False, "", tail=None) is GrammarState.CHUNK  # the rule off
    assert grammar_state(True, "", tail="include:") is GrammarState.MAIN  # the main thread is not held
    table = [b"Sleep", b" more", b"x", b"3"]
    pieces = TagTokens(*range(len(table), len(table) + len(TAG_PIECES)))
    table += [p.encode() for p in TAG_PIECES]
    masks = dict(zip(GrammarState, state_masks(pieces, table, len(table), eos_ids=[2])))
    allow, ids = masks[GrammarState.CHUNK_OPEN]
    assert not allow and set(ids) == set(masks[GrammarState.CHUNK][1]) | {pieces.async_close, 2}
    assert pieces.async_close not in masks[GrammarState.CHUNK][1] and 2 not in masks[GrammarState.CHUNK][1]


def test_the_interpreter_keeps_sibling_topics_distinct_unless_told_not_to():
    from pasta_engine.config import Limits
    from pasta_engine.core.interpreter import Interpreter

    pieces = ["<EOS>", "a", '<promise topic="', "Sleep", '" tokens="', "1", '"/>']
    decode = lambda ids: "".join(pieces[i] for i in ids if i != 0)  # noqa: E731

    def state_after(distinct: bool) -> GrammarState:
        it = Interpreter([1], decode=decode, eos_ids=[0], open_ids=[1], close_len=1, grammar=True,
                         limits=Limits(max_threads=None, distinct_topics=distinct))
        for tok in [2, 3, 4, 5, 6, 1, 2, 3]:  # a promise "Sleep", text, then "Sleep" again
            it.step_done(it.runnable_threads())
            it.take_kv_ops()
            it.on_token(0, tok)
        [main] = [s for s in it.runnable_threads() if s.tid == 0]
        return GrammarState(main.grammar)

    assert state_after(True) is GrammarState.TOPIC_TAKEN
    assert state_after(False) is GrammarState.TOPIC


def test_a_topic_may_not_end_inside_a_character():
    """The README's first command once showed `<promise topic="Beds\ufffd" .../>` and a chunk that
    copied it: the model wrote the first two bytes of an emoji and the grammar let the topic end
    there (and a lone continuation byte, U+00A8's token, in the same place). Inside a character the
    topic may only continue it (TOPIC_CONT); a token that starts with a continuation byte is topic
    text nowhere else; once the character is whole the topic may end again."""
    from pasta_engine.config import Limits
    from pasta_engine.core.interpreter import Interpreter
    from pasta_engine.lang.detokenizer import IncrementalDetokenizer, TokenBytes

    pieces = [b"", b"a", b'<promise topic="', b"Beds", "\U0001f6cf".encode()[:2], "\U0001f6cf".encode()[2:],
              b'" tokens="', b"1", b'"/>']
    decode = lambda ids: b"".join(pieces[i] for i in ids).decode("utf-8", errors="replace")  # noqa: E731

    def states(tokens):
        it = Interpreter([1], decode=decode, eos_ids=[0], open_ids=[1], close_len=1, grammar=True,
                         limits=Limits(max_threads=None))
        out = []
        for tok in tokens:
            it.step_done(it.runnable_threads())
            it.take_kv_ops()
            it.on_token(0, tok)
            [main] = [s for s in it.runnable_threads() if s.tid == 0]
            out.append(GrammarState(main.grammar))
        return out

    assert states([2, 3, 4, 5]) == [GrammarState.TOPIC_EMPTY, GrammarState.TOPIC, GrammarState.TOPIC_CONT,
                                    GrammarState.TOPIC]
    d = IncrementalDetokenizer(decode)
    assert [(d.push(t), d.mid_character) for t in (3, 4, 5)] == [("Beds", False), ("", True), ("\U0001f6cf", False)]
    d = IncrementalDetokenizer(None, TokenBytes(list(pieces)))  # the engine's way: a bytes table
    assert [(d.push(t), d.mid_character) for t in (3, 4, 5)] == [("Beds", False), ("", True), ("\U0001f6cf", False)]


def test_a_continuation_byte_is_topic_text_only_inside_a_character():
    tags = TagTokens(0, 1, 2, 3, 4, 5)
    table = [b'<promise topic="', b'" tokens="', b'"/>', b"<async>", b"</async>", b"<sync/>", b"", b"Beds",
             b"\xa8", b"\xf0\x9f", b"\x9b\x8f", b"7"]
    masks = state_masks(tags, table, len(table), eos_ids=[6])
    for state in (GrammarState.TOPIC_EMPTY, GrammarState.TOPIC, GrammarState.TOPIC_TAKEN):
        allow, ids = masks[state]
        assert allow and 8 not in ids and 10 not in ids and 9 in ids  # a lead byte may start a character
    assert masks[GrammarState.TOPIC_CONT] == (True, [8, 10])


def test_the_interpreter_holds_a_chunk_open_at_a_colon_unless_told_not_to():
    from pasta_engine.config import Limits
    from pasta_engine.core.interpreter import Interpreter

    pieces = ["<EOS>", "<async>", '<promise topic="', "Sleep", '" tokens="', "1", '"/>', " Rest", " well", ".", ":"]
    decode = lambda ids: "".join(pieces[i] for i in ids if i != 0)  # noqa: E731

    def child_states(rule: bool, chunk: list[int]) -> list[GrammarState]:
        it = Interpreter([1], decode=decode, eos_ids=[0], open_ids=[1], close_len=1, grammar=True,
                         limits=Limits(max_threads=None, chunk_clean_end=rule))
        for tok in [2, 3, 4, 5, 6]:  # the main thread promises "Sleep": a child forks
            it.step_done(it.runnable_threads())
            it.take_kv_ops()
            it.on_token(0, tok)
        states = []
        for tok in [*chunk, None]:
            steps = it.runnable_threads()
            it.step_done(steps)
            it.take_kv_ops()
            states.append(GrammarState(next(s for s in steps if s.tid == 1 and s.sample).grammar))
            it.on_token(0, 7)  # the main thread writes on
            if tok is not None:
                it.on_token(1, tok)
        return states

    open_, chunk = GrammarState.CHUNK_OPEN, GrammarState.CHUNK
    # empty (held), " Rest", " Rest well", " Rest well." (may end), " Rest well.:" (held again)
    assert child_states(True, [7, 8, 9, 10]) == [open_, chunk, chunk, chunk, open_]
    assert child_states(False, [7, 8, 9, 10]) == [chunk] * 5


def test_a_chunk_at_its_cap_mid_sentence_gets_a_grace_to_end_it():
    """With chunk_clean_end, a chunk at its cap mid-sentence samples on to its sentence end
    (at most SENTENCE_GRACE_TOKENS past the cap); without it, or at a sentence end, the cap ends it."""
    from pasta_engine.config import Limits
    from pasta_engine.core.interpreter import SENTENCE_GRACE_TOKENS, Interpreter

    pieces = ["<EOS>", "<async>", '<promise topic="', "Sleep", '" tokens="', "1", '"/>', " word", "."]
    decode = lambda ids: "".join(pieces[i] for i in ids if i != 0)  # noqa: E731

    def child_samples(rule: bool, chunk: list[int]) -> int:
        """Tokens the child samples of ``chunk`` (then " word" forever) before it ends; cap 4."""
        it = Interpreter([1], decode=decode, eos_ids=[0], open_ids=[1], close_len=1, grammar=True,
                         limits=Limits(max_threads=None, chunk_clean_end=rule, async_min_cap=4))
        for tok in [2, 3, 4, 5, 6]:
            it.step_done(it.runnable_threads())
            it.take_kv_ops()
            it.on_token(0, tok)
        for n in range(200):
            steps = it.runnable_threads()
            if not any(s.tid == 1 and s.sample for s in steps):
                return n
            it.step_done(steps)
            it.take_kv_ops()
            it.on_token(0, 7)
            it.on_token(1, chunk[n] if n < len(chunk) else 7)
        raise AssertionError("the child never ended")

    assert child_samples(False, []) == 4  # the cap
    assert child_samples(True, [7, 7, 7, 8]) == 4  # a sentence ends at the cap: it ends there
    assert child_samples(True, [7, 7, 7, 7, 7, 8]) == 6  # past the cap, at its sentence end
    assert child_samples(True, []) == 4 + SENTENCE_GRACE_TOKENS  # no sentence end: the grace, no more


def test_a_topic_starts_with_a_letter_and_a_length_with_a_nonzero_digit():
    """Stage-2 training once wrote ``<promise topic="10" tokens="00"/>``: the masks forbid a topic
    that starts with a number and a length that starts with 0."""
    table = [b"Sleep", b"10", b" 1", b"\xc3\xa9t\xc3\xa9", b"0", b"00", b"3", b"10", b"<a>", b"x"]
    pieces = TagTokens(*range(len(table), len(table) + len(TAG_PIECES)))
    table += [p.encode() for p in TAG_PIECES]
    masks = dict(zip(GrammarState, state_masks(pieces, table, len(table), eos_ids=[9])))
    allow, ids = masks[GrammarState.TOPIC_EMPTY]
    assert allow and set(ids) == {0, 3}  # "Sleep", "ete" (not "10", " 1", "0", "<a>", the EOS "x")
    allow, ids = masks[GrammarState.TOPIC]
    assert allow and {0, 1, 2, 3, 4, pieces.promise_length} <= set(ids)
    allow, ids = masks[GrammarState.LENGTH_EMPTY]
    assert allow and set(ids) == {1, 6, 7}  # "10", "3", "10": no leading zero
    allow, ids = masks[GrammarState.LENGTH]
    assert allow and set(ids) == {1, 4, 5, 6, 7, pieces.promise_close}


def _fork_odds_hook(tags, p_promise: float, other: int, p_other: float, steps: int = 1):
    """A hook that, on the main thread's first ``steps`` samples, gives the promise piece
    probability about ``p_promise`` and token ``other`` about ``p_other`` (the rest shares what
    is left evenly)."""
    import math

    calls = {"n": 0}

    def hook(req, tid, row):
        if tid != 0 or calls["n"] >= steps:
            return
        calls["n"] += 1
        rest = 1.0 - p_promise - p_other
        n = row.shape[0] - 2
        row.zero_()
        row[tags.promise_open] = math.log(p_promise / rest * n)
        row[other] = math.log(p_other / rest * n)

    return hook


def _run_one(engine, prompt, params, mode="pasta", **kw):
    """One request through add_request and step (the per-request limits' door); its result."""
    rid = engine.add_request(prompt, params, mode, output_kind="final", **kw)
    final = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id == rid and out.finished:
                final = out
    assert final is not None and final.error is None, final and final.error
    return final.result


def test_fork_threshold_forks_exactly_where_the_promise_is_likely_enough(tagged):
    from pasta_engine import Limits

    ckpt, adapter, _, _ = tagged
    engine = Engine.from_pretrained(ckpt, adapter=adapter, kv_cache_bytes=8 * 2**20, position_policy="constant:8")
    tags = tag_tokens_of(engine.tokenizer)
    other = 11
    params = SamplingParams(max_new_tokens=3)

    def first_token(threshold):
        engine.logits_hook = _fork_odds_hook(tags, 0.3, other, 0.6)
        limits = None if threshold is None else Limits(fork_threshold=threshold)
        return _run_one(engine, "Hi", params, limits=limits).token_ids[0]

    assert first_token(None) == other  # greedy: the likelier token
    assert first_token(0.25) == tags.promise_open  # 0.3 >= 0.25: forced to fork
    assert first_token(0.35) == other  # 0.3 < 0.35: the promise is masked
    # a likely promise (0.6) below a high threshold is masked, and the next likeliest is taken
    engine.logits_hook = _fork_odds_hook(tags, 0.6, other, 0.3)
    assert _run_one(engine, "Hi", params, limits=Limits(fork_threshold=0.7)).token_ids[0] == other
    # the engine's default knob is the same per-request setting
    ranked = Engine.from_pretrained(ckpt, adapter=adapter, kv_cache_bytes=8 * 2**20, position_policy="constant:8",
                                    limits=Limits(fork_threshold=0.25))
    ranked.logits_hook = _fork_odds_hook(tags, 0.3, other, 0.6)
    [res] = ranked.generate(["Hi"], params, mode="pasta")
    assert res.token_ids[0] == tags.promise_open
    # ... and a sequential request on that engine is served without it (the default is for pasta mode)
    ranked.logits_hook = None
    [res] = ranked.generate(["Hi"], params, mode="sequential")
    assert res.error is None and res.stats.finish_reason in ("stop", "length")


@pytest.mark.parametrize("name", ["fork_threshold", "independent_topics", "fork_headroom_tokens"])
def test_grammar_knobs_are_refused_where_they_cannot_apply(tagged, tiny_engine, name):
    """The fork knob and the topic rule act on the PASTA-LANG grammar's states: each is refused by
    name where no promise is sampled under the grammar (sequential, a replay, another dialect, a
    model without the tag tokens; the engine's constructor too), before the request takes any
    resource; where it applies it is taken, and the engine serves the next call."""
    from pasta_engine import Limits
    from pasta_engine.errors import ParameterError

    ckpt, adapter, _, _ = tagged
    engine = Engine.from_pretrained(ckpt, adapter=adapter, kv_cache_bytes=8 * 2**20)
    knob = Limits(**{name: {"fork_threshold": 0.5, "independent_topics": True, "fork_headroom_tokens": 64}[name]})
    two = SamplingParams(max_new_tokens=2)
    with pytest.raises(ParameterError, match=f"{name}.*sequential"):
        engine.add_request("Hi", two, "sequential", limits=knob)
    with pytest.raises(ParameterError, match=f"{name}.*replay"):
        engine.add_request("Hi", two, "pasta", annotated_response="Hello.", limits=knob)
    with pytest.raises(ParameterError, match=f"{name}.*apar"):
        engine.add_request("Hi", two, "pasta", limits=knob, dialect="apar")
    with pytest.raises(ParameterError, match=f"{name}.*tag-tokens"):
        tiny_engine.add_request("Hi", two, "pasta", limits=knob)
    with pytest.raises(ParameterError, match=f"{name}.*tag-tokens"):
        Engine.from_pretrained(tiny_engine.source, kv_cache_bytes=8 * 2**20, limits=knob)
    assert engine.block_manager.num_free == engine.block_manager.num_pages
    engine.add_request("Hi", two, "pasta", limits=knob)  # where it applies it is taken
    while engine.has_unfinished_requests():
        engine.step()
    [res] = engine.generate(["Hi"], two, mode="pasta")
    assert res.error is None
    assert engine.block_manager.num_free == engine.block_manager.num_pages


def test_the_fork_threshold_is_a_probability():
    from pasta_engine import Limits
    from pasta_engine.errors import ParameterError

    for bad in (0.0, 1.5, float("nan"), True):
        with pytest.raises(ParameterError, match="fork_threshold"):
            Limits(fork_threshold=bad)


def test_a_topic_may_not_open_with_a_word_that_leans_on_a_sibling():
    """A chunk opens with its topic's words: promised "Another challenge", it opens by leaning on a
    sibling its thread cannot see. With Limits.independent_topics (off by default) the topic's first token
    may not be a leaning word (any case, with or without its space); later in the topic it may."""
    from pasta_engine.config import Limits
    from pasta_engine.core.interpreter import Interpreter

    tags = TagTokens(0, 1, 2, 3, 4, 5)
    table = [b'<promise topic="', b'" tokens="', b'"/>', b"<async>", b"</async>", b"<sync/>", b"",
             b"Another", b" another", b"This", b" Finally", b"Sleep", b" Then", b"Inad", b"equate", b"7"]
    masks = state_masks(tags, table, len(table), eos_ids=[6])
    allow, opening = masks[GrammarState.TOPIC_OPENING]
    assert allow and opening == [11, 13, 14]  # "Sleep", and "Inad"/"equate" (not whole leaning words)
    assert {7, 8, 9, 10, 12} <= set(masks[GrammarState.TOPIC_EMPTY][1])  # the rule is the new state's only
    assert {7, 8, 9, 10, 12} <= set(masks[GrammarState.TOPIC][1])  # "Sleep then" is a topic

    pieces = ["<EOS>", "a", '<promise topic="', "Sleep"]
    decode = lambda ids: "".join(pieces[i] for i in ids if i != 0)  # noqa: E731

    def first_topic_state(rule: bool) -> GrammarState:
        it = Interpreter([1], decode=decode, eos_ids=[0], open_ids=[1], close_len=1, grammar=True,
                         limits=Limits(max_threads=None, independent_topics=rule))
        it.step_done(it.runnable_threads())
        it.take_kv_ops()
        it.on_token(0, 2)
        [main] = [s for s in it.runnable_threads() if s.tid == 0]
        return GrammarState(main.grammar)

    assert first_topic_state(True) is GrammarState.TOPIC_OPENING
    assert first_topic_state(False) is GrammarState.TOPIC_EMPTY
    assert Limits().independent_topics is False


def test_the_engine_keeps_a_leaning_word_out_of_a_topics_opening_when_asked(tagged):
    """End to end: a model that wants to promise and to open every topic with a leaning word
    ("another") gets it with the rule off and does not with Limits.independent_topics."""
    from pasta_engine.config import Limits
    from pasta_engine.lang.grammar import LEANING_WORDS

    ckpt, adapter, _, _ = tagged

    def first_topic_token(rule: bool) -> tuple[int, int]:
        engine = Engine.from_pretrained(ckpt, adapter=adapter, kv_cache_bytes=8 * 2**20, position_policy="constant:8",
                                        limits=Limits(independent_topics=rule))
        tok = engine.tokenizer
        tags = tag_tokens_of(tok)
        lean = next(i for i in range(len(tok)) if tok.decode([i]).strip().lower() in LEANING_WORDS
                    and tok.decode([i]).strip().isalpha())

        def hook(req, tid, row):
            if tid == 0:  # the promise first (where it may open), then the leaning word
                row[tags.promise_open] += 2e4
                row[lean] += 1e4
        engine.logits_hook = hook
        [res] = engine.generate(["Hi"], SamplingParams(max_new_tokens=16), mode="pasta")
        assert res.error is None, res.error
        main = [t for t, th in zip(res.token_ids, res.threads) if th == 0]
        return main[main.index(tags.promise_open) + 1], lean

    got, lean = first_topic_token(False)
    assert got == lean
    got, lean = first_topic_token(True)
    assert got != lean


def test_a_promise_opens_only_while_the_budget_covers_the_running_chunks_and_the_headroom():
    """Limits.fork_headroom_tokens: after a fork promised 30 tokens, the main thread may promise
    again only while tokens left (max_new_tokens - sampled, all threads) >= 30 - the chunk's
    sampled tokens + the headroom; off (None), only max_forks decides."""
    from pasta_engine.config import Limits
    from pasta_engine.core.interpreter import Interpreter
    from pasta_engine.errors import ParameterError

    pieces = ["<EOS>", "<async>", '<promise topic="', "Sleep", '" tokens="', "3", "0", '"/>', "a"]
    decode = lambda ids: "".join(pieces[i] for i in ids if i != 0)  # noqa: E731

    def main_state(headroom: int | None, chunk_tokens: int = 0) -> GrammarState:
        it = Interpreter([8], decode=decode, eos_ids=[0], open_ids=[1], close_len=1, grammar=True, max_new_tokens=100,
                         limits=Limits(max_threads=None, fork_headroom_tokens=headroom))
        it.step_done(it.runnable_threads())
        it.take_kv_ops()
        for tok in (8, 2, 3, 4, 5, 6, 7):  # "a", then the promise: 7 tokens sampled, 93 left, 30 owed
            it.on_token(0, tok)
        it.take_kv_ops()
        for _ in range(chunk_tokens):  # the chunk writes: it owes less, and the budget shrinks as much
            it.step_done([s for s in it.runnable_threads() if s.tid == 1])
            it.on_token(1, 8)
        assert len(it.threads) == 2 and it.threads[1].promise.tokens == 30
        [main] = [s for s in it.runnable_threads() if s.tid == 0]
        return GrammarState(main.grammar)

    assert main_state(None) is GrammarState.MAIN
    assert main_state(63) is GrammarState.MAIN  # 93 >= 30 + 63
    assert main_state(64) is GrammarState.MAIN_NO_FORK
    assert main_state(64, chunk_tokens=10) is GrammarState.MAIN_NO_FORK  # 83 < 20 + 64
    assert main_state(53, chunk_tokens=10) is GrammarState.MAIN  # 83 >= 20 + 53
    assert Limits().fork_headroom_tokens is None
    for bad in (-1, 1.5, True):
        with pytest.raises(ParameterError, match="fork_headroom_tokens"):
            Limits(fork_headroom_tokens=bad)


def test_the_leaning_words_are_the_independence_measurements_openings():
    """The grammar's LEANING_WORDS and the lexical independence test's leaning openings are one
    list: a topic the grammar lets through does not fail the test for its opening word."""
    from pasta_engine.lang.grammar import LEANING_WORDS
    from pasta_engine.tools.annotate_independent import _LEANS_ON

    assert all(_LEANS_ON.fullmatch(w) or _LEANS_ON.fullmatch(w + " 2") for w in LEANING_WORDS)  # "step 2"
    assert not _LEANS_ON.match("sleep")


def test_limits_refuses_a_non_boolean_independent_topics():
    from pasta_engine.config import Limits
    from pasta_engine.errors import ParameterError

    with pytest.raises(ParameterError, match="independent_topics"):
        Limits(independent_topics="yes")


def test_a_length_token_never_carries_the_length_past_what_the_parser_reads():
    """GPT-2-style vocabularies have digit tokens such as ``0000`` and ``10000000``: the length
    states allowed any of them, and the tag parser reads at most MAX_TOKENS_DIGITS digits, so a
    masked model could write a promise that was lost. Every length the masks allow parses."""
    from pasta_engine.lang.grammar import MAX_DIGIT_TOKEN, MAX_LENGTH_DIGITS
    from pasta_engine.lang.tags import MAX_TOKENS_DIGITS, Promise, TagParser

    tags = TagTokens(0, 1, 2, 3, 4, 5)
    table = [p.encode() for p in TAG_PIECES] + [b"", b"Sleep", b"1", b"0", b"20", b"100", b"2000", b"0000",
                                                 b"10000000"]
    masks = state_masks(tags, table, len(table), eos_ids=[6])

    def allowed(state):
        allow, ids = masks[state]
        return [table[i] for i in range(len(table)) if (i in ids) == allow]

    assert allowed(GrammarState.LENGTH_EMPTY) == [b"1", b"20", b"100"]
    assert allowed(GrammarState.LENGTH) == [b'"/>', b"1", b"0", b"20", b"100"]
    assert MAX_LENGTH_DIGITS - 1 + MAX_DIGIT_TOKEN <= MAX_TOKENS_DIGITS

    def longest(digits: str) -> list[str]:  # every length the masks allow from here, walked
        state = grammar_state(True, '<promise topic="Sleep" tokens="' + digits)
        if state == GrammarState.LENGTH_FULL:
            return [digits]
        out = [digits] if state == GrammarState.LENGTH else []
        return out + [x for t in allowed(state) if t.isdigit() for x in longest(digits + t.decode())]

    for digits in longest(""):
        p = TagParser()
        items = p.feed('<promise topic="Sleep" tokens="' + digits + '"/>') + p.finish()
        assert [type(e) for e in items] == [Promise] and items[0].tokens == int(digits), digits


def test_inside_a_topics_character_only_as_many_continuation_bytes_as_it_needs():
    """TOPIC_CONT1..3: a token whose leading run of continuation bytes fits what the character
    still needs (exactly, or fewer and nothing else); TOPIC_CONT (no bytes table): any."""
    from pasta_engine.lang.grammar import topic_cont_state

    tags = TagTokens(0, 1, 2, 3, 4, 5)
    table = [p.encode() for p in TAG_PIECES] + [b"", b"Beds", b"\xa8", b"\x82\xac", b"\x9f\x98\x80", b"\xa9x",
                                                 b"\x82\xacs", b"\xf0\x9f", b"1"]
    masks = dict(zip(GrammarState, state_masks(tags, table, len(table), eos_ids=[6])))
    want = {GrammarState.TOPIC_CONT1: [8, 11], GrammarState.TOPIC_CONT2: [8, 9, 12],
            GrammarState.TOPIC_CONT3: [8, 9, 10], GrammarState.TOPIC_CONT: [8, 9, 10, 11, 12]}
    for state, ids in want.items():
        assert masks[state] == (True, ids), state
    G = GrammarState
    assert [topic_cont_state(b) for b in (b"\xc3", b"Caf\xe2", b"\xe2\x82", b"\xf0", b"\xf0\x9f\x98")] == \
        [G.TOPIC_CONT1, G.TOPIC_CONT2, G.TOPIC_CONT1, G.TOPIC_CONT3, G.TOPIC_CONT1]
    assert topic_cont_state(b"abc") == topic_cont_state(b"\x80\x80\x80\x80") == G.TOPIC_CONT  # not inside one


def test_a_tokenless_adapter_goes_on_with_the_pieces_only_if_its_weights_all_fit(tiny_llama, tmp_path):
    """wrap_lora(adapter=..., tag_tokens=True) of a plain writer's adapter: a LoRA weight the fresh
    adapter of its shape has no place for (or lacks) is an error, not a silently fresh adapter;
    an adapter with the pieces already is refused."""
    from sample_adapters import tiny_adapter

    hf = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32)
    partial = tiny_adapter(tmp_path)  # q_proj of layer 0 only: the other layers' LoRA would start fresh
    with pytest.raises(ValueError, match="do not fit"):
        wrap_lora(hf, adapter=partial, tokenizer=AutoTokenizer.from_pretrained(tiny_llama), tag_tokens=True)
    tok = AutoTokenizer.from_pretrained(tiny_llama)
    tagged_out = tmp_path / "tagged"
    model = wrap_lora(AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32),
                      LoraSettings(r=4, alpha=8, dropout=0.0), tokenizer=tok, tag_tokens=True)
    export_adapter(model, tagged_out, {"added_tokens": tag_tokens_of(tok).as_dict()})
    with pytest.raises(ValueError, match="added tokens already"):
        wrap_lora(AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32), adapter=tagged_out,
                  tokenizer=AutoTokenizer.from_pretrained(tiny_llama), tag_tokens=True)
