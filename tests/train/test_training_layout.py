"""The training layout's dry run: its result does not depend on the bookkeeping page size, and
a dry run that fails raises instead of returning a cut layout."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from pasta_engine.config import Limits
from pasta_engine.lang.grammar import add_tag_tokens
from pasta_engine.train.layout import pasta_layout

# 94 one-token chunks, a barrier every seventh: many forks, each leaving part-filled pages
TRACE = "".join(f'<promise topic="a{i}" tokens="1"/><async>x</async>' + ("<sync/>" if i % 7 == 6 else "")
                for i in range(94)) + "<sync/>z"


def test_the_layout_does_not_depend_on_the_page_size(tiny_llama):
    """The dry run's page pool left no room for the pages forks leave part-filled: at 64 tokens a
    page it ran out, ended the request with 'KV cache exhausted' and returned a cut layout (613
    response tokens of 944, no end of sequence) without a word."""
    tok = AutoTokenizer.from_pretrained(tiny_llama)
    add_tag_tokens(tok)
    layouts = [pasta_layout(tok, [5, 6], TRACE, eos_ids=[2], page_size=ps, limits=Limits(max_threads=None))
               for ps in (1, 16, 64)]
    assert len({tuple(x.token_ids) for x in layouts}) == 1
    assert {len(x.forks) for x in layouts} == {64} and layouts[0].token_ids[-1] == 2
    many = Limits(max_threads=None, max_forks=94)  # a cap above the default takes more pages
    assert len(pasta_layout(tok, [5, 6], TRACE, eos_ids=[2], page_size=64, limits=many).forks) == 94


def test_a_failed_dry_run_raises(tiny_llama, monkeypatch):
    import pasta_engine.train.layout as layout

    tok = AutoTokenizer.from_pretrained(tiny_llama)
    add_tag_tokens(tok)
    real = layout.BlockManager
    monkeypatch.setattr(layout, "BlockManager", lambda pages, size: real(4, size))  # far too small
    with pytest.raises(RuntimeError, match="dry run ended with an error"):
        pasta_layout(tok, [5, 6], TRACE, eos_ids=[2], limits=Limits(max_threads=None))


def test_the_training_forward_refuses_a_layout_past_the_sliding_window(tiny_mistral):
    """Its dense mask applies no window; the engine's attention does (the log-probabilities
    differed by up to 0.35 on 128 of 129 tokens)."""
    import torch
    from transformers import AutoModelForCausalLM

    from pasta_engine.train.forward import forward_logprobs, layout_for

    from sample_traces import SLEEP_TIPS  # noqa: E402  (tests/sample_traces.py)

    tok = AutoTokenizer.from_pretrained(tiny_mistral)
    hf = AutoModelForCausalLM.from_pretrained(tiny_mistral, dtype=torch.float32)
    long = layout_for(hf, tok, "Give me sleep tips.", SLEEP_TIPS)
    with pytest.raises(ValueError, match="past the model's sliding window of"):
        forward_logprobs(hf, long)
    short = layout_for(hf, tok, [5], "ok")
    assert max(short.position_ids) < hf.config.sliding_window
    assert forward_logprobs(hf, short).shape == (len(short.sampled()[1]),)
