"""One canonical tokenization of annotated responses: replay text in both modes equals
``clean_text(annotated)`` exactly (``strip_tags(annotated)`` when nothing in it is tag-like text)
and both modes decode the same tokens, for the issue's cases,
the annotators' outputs and hypothesis-generated responses, on SmolLM2's tokenizer and on a
tokenizer whose tags are added special tokens. Also: prompts keep special-token text as text."""

from __future__ import annotations

import copy
import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pasta_engine.config import Limits, PositionPolicy, SamplingParams
from pasta_engine.core.block_manager import BlockManager
from pasta_engine.core.request import Request, interpreter_factory
from pasta_engine.core.scheduler import SampledTokens, Scheduler
from pasta_engine.lang.tags import TagText, clean_text, parse, promise_tag, strip_tags
from pasta_engine.lang.tokenization import encode_prompt, encode_text, eos_token_ids, tokenize_annotated

README_TRACE = ('Tips: <promise topic="sleep" tokens="10"/><async>Sleep early.</async> '
                '<promise topic="walk" tokens="10"/><async>Walk daily.</async><sync/> Done.')
CASES = [
    README_TRACE,  # one BPE token '><' would span the end of a promise and the next tag
    'A <promise topic="x" tokens="10"/> <async>spaced chunk</async> after.',  # space between /> and <async>
    'Keep <|im_end|> as text <promise topic="y" tokens="10"/><async>and <|im_start|> here</async> end<|im_end|>',
    '<promise topic="a" tokens="10"/><promise topic="b" tokens="10"/><async>b only</async><sync/><sync/>tail',
    'x<promise topic="a" tokens="10"/>\n\n<async>line\n</async>\n<sync/>\n\nAfter the sync.',
    'broken <promise topic="a" tokens="x"/> and <async>stray</async> and <sync /> and </async>',
    'unclosed <promise topic="a" tokens="20"/><async>never closed',
    '<promise topic="a" tokens="0"/><async>',  # the trace ends right after <async>: an empty chunk (hypothesis)
    'émoji 🙌 <promise topic="ü" tokens="10"/><async>日本語のテキスト</async><sync/>ok',
]


@pytest.fixture(scope="module")
def smol_tok(smollm2_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_dir)


@pytest.fixture(scope="module")
def special_tok(smol_tok):
    """SmolLM2's tokenizer with the fixed tags as added special tokens."""
    tok = copy.deepcopy(smol_tok)
    tok.add_special_tokens({"additional_special_tokens": ["<async>", "</async>", "<sync/>"]})
    return tok


def dry_replay(tok, annotated: str, mode: str, max_forks: int = 64):
    """The engine's replay of ``annotated`` without a model: interpreter, scheduler and block
    manager run over the forced tokens (a model cannot change forced tokens)."""
    eos = eos_token_ids(tok)
    prompt = [1, 2, 3]
    make, max_new = interpreter_factory(tok, prompt, mode=mode, max_new_tokens=1,
                                        limits=Limits(max_threads=None, max_forks=max_forks),
                                        policy=PositionPolicy(), max_positions=None, eos_ids=eos,
                                        annotated_response=annotated)
    req = Request("r", 0, mode, SamplingParams(max_new_tokens=max_new), make)
    run_forced(req, BlockManager(4096, 4))
    return req.result()


def run_forced(req, block_manager) -> None:
    """Run ``req`` to its end through a scheduler over ``block_manager``, every sampled token the
    forced one (no model), and check it ends with ``stop``."""
    sched = Scheduler(block_manager, 1)
    sched.add(req)
    while sched.has_unfinished():
        batch = sched.schedule()
        forced = [s.step.forced for s in batch.sampling]
        sched.postprocess(batch, SampledTokens(forced, [0.0] * len(forced)))
    assert req.finish_reason == "stop"


def check_round_trip(tok, annotated: str, max_forks: int = 64) -> None:
    want = clean_text(annotated)
    if not any(isinstance(e, TagText) for e in parse(annotated)):
        assert want == strip_tags(annotated)  # no tag-like text (and no list markers here): the old rule
    pasta = dry_replay(tok, annotated, "pasta", max_forks)
    seq = dry_replay(tok, annotated, "sequential", max_forks)
    assert pasta.text == want, (pasta.text, want)
    assert seq.text == want, (seq.text, want)
    assert seq.token_ids == pasta.token_ids
    assert strip_tags(pasta.annotated_text) == strip_tags(annotated)  # nothing the model wrote is lost


@pytest.mark.parametrize("annotated", CASES)
def test_the_issue_cases_round_trip_in_both_modes(smol_tok, special_tok, annotated):
    check_round_trip(smol_tok, annotated)
    check_round_trip(special_tok, annotated)


def test_past_the_fork_cap_a_chunk_decodes_inline_in_place(smol_tok):
    check_round_trip(smol_tok, README_TRACE, max_forks=1)
    check_round_trip(smol_tok, README_TRACE, max_forks=0)


def test_the_bpe_merge_across_a_tag_is_gone(smol_tok):
    """Tokenized whole, SmolLM2 merges '/><' into one token; the canonical form never does."""
    assert any(smol_tok.decode([t]) == "><" for t in smol_tok.encode(README_TRACE))
    tok = tokenize_annotated(smol_tok, README_TRACE)
    pieces = [smol_tok.decode([t]) for t in tok.spliced_ids]
    assert "><" not in pieces
    assert smol_tok.decode(tok.spliced_ids) == tok.canonical
    assert strip_tags(tok.canonical) == strip_tags(README_TRACE)


def test_special_token_text_in_a_response_is_text(smol_tok, special_tok):
    tok = tokenize_annotated(smol_tok, "a <|im_end|> b")
    assert smol_tok.convert_tokens_to_ids("<|im_end|>") not in tok.main_ids
    sync = special_tok.convert_tokens_to_ids("<sync/>")
    tags = tokenize_annotated(special_tok, "a<sync/>b")
    assert sync in tags.main_ids and len(tags.main_ids) == 3  # 'a', the special <sync/>, 'b'


def test_annotator_outputs_round_trip(smol_tok, alpaca_outputs):
    from pasta_engine.tools.annotate import annotate

    rows = json.loads(alpaca_outputs.read_text())[:40]
    count = lambda t: len(smol_tok.encode(t, add_special_tokens=False))  # noqa: E731
    n = 0
    for r in rows:
        for name in ("sot", "apar"):
            a = annotate(r["output"], name, count)
            if a.promises:
                check_round_trip(smol_tok, a.annotated)
                n += 1
    assert n >= 30


text = st.lists(st.sampled_from(list("ab é🙌 \n\t<>/\"=") + ["<|im_end|>", "</", "<sync", "/>", "tokens"]),
                max_size=12).map("".join)


@st.composite
def annotated_responses(draw):
    parts = []
    for _ in range(draw(st.integers(0, 6))):
        kind = draw(st.sampled_from(["text", "promise", "chunk", "sync", "stray"]))
        if kind == "text":
            parts.append(draw(text))
        elif kind in ("promise", "chunk"):
            parts.append(promise_tag(draw(st.sampled_from(["a", "b c", "ü"])), draw(st.integers(0, 40))))
            if kind == "chunk":
                parts.append(draw(st.sampled_from(["", " ", "\n"])) + "<async>" + draw(text)
                             + draw(st.sampled_from(["</async>", "</async>", ""])))
        elif kind == "sync":
            parts.append(draw(st.sampled_from(["<sync/>", "<sync />"])))
        else:
            parts.append(draw(st.sampled_from(["<async>", "</async>", "<promise", '<promise topic="x"/>'])))
    return "".join(parts) + draw(text)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(annotated=annotated_responses())
def test_any_annotated_response_round_trips(smol_tok, special_tok, annotated):
    check_round_trip(smol_tok, annotated)
    check_round_trip(special_tok, annotated)


def test_prompts_keep_user_special_token_text_as_text(smol_tok, alpaca_outputs):
    """encode_prompt tokenizes the chat template's markers as control tokens and the users'
    text as text; for ordinary prompts that is exactly the whole-string tokenization."""
    end = smol_tok.convert_tokens_to_ids("<|im_end|>")
    msgs = [{"role": "user", "content": "stop<|im_end|>here"}]
    as_text = encode_prompt(smol_tok, msgs)
    as_control = encode_prompt(smol_tok, msgs, "control")
    assert as_control.count(end) == as_text.count(end) + 1
    assert smol_tok.decode(as_text) == smol_tok.decode(as_control)
    for row in json.loads(alpaca_outputs.read_text())[:805:5]:
        m = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": row["instruction"]}]
        whole = smol_tok.apply_chat_template(m, add_generation_prompt=True, tokenize=False)
        assert encode_prompt(smol_tok, m) == smol_tok.encode(whole, add_special_tokens=False)
    assert encode_text(smol_tok, "") == []
