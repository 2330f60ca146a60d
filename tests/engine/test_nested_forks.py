"""Nested forks and k-way forks on the tiny model (issue 23 item 2): Multiverse replays through
the real engine (model, scheduler, block manager, attention over shared KV views) with replay
text == the dialect's clean text in both modes, decode steps == the critical path of the
structure at unlimited width (nested included), every KV page back after the requests, nesting
past the depth cap decoded inline, and the training forward (pasta_logprobs) == the replay's
log-probabilities."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from pasta_engine import Engine
from pasta_engine.config import Limits, SamplingParams
from pasta_engine.engine.replay import replay_script
from pasta_engine.lang.multiverse import MULTIVERSE
from pasta_engine.lang.tokenization import eos_token_ids, replay_eos_id
from pasta_engine.metrics import critical_path, simulate_steps
from pasta_engine.train import pasta_logprobs

FLAT = ("Tips:\n<Parallel><Goal><Outline>1: sleep</Outline><Outline>2: walk</Outline><Outline>3: eat</Outline></Goal>"
        "<Path>\n1: Go to bed early, every day.\n</Path><Path>\n2: Walk daily.\n</Path><Path>\n3: Eat well.\n</Path>"
        "<Conclusion>\nThat is all.\n</Conclusion></Parallel>\nDone.")
NESTED = ("Plan:\n<Parallel><Goal><Outline>1: a</Outline><Outline>2: b</Outline></Goal>"
          "<Path>\n1: first, short\n</Path>"
          "<Path>\n2: second <Parallel><Goal><Outline>1: x</Outline><Outline>2: y</Outline></Goal>"
          "<Path>\n1: inner one</Path><Path>\n2: inner two is the longest path of all here</Path>"
          "<Conclusion>inner end</Conclusion></Parallel> after\n</Path>"
          "<Conclusion>\nSo.\n</Conclusion></Parallel>\nBye")
PROMPT = "Give me tips."


def unlimited(tiny_llama, **kw) -> Engine:
    return Engine.from_pretrained(tiny_llama, kv_cache_bytes=16 * 2**20, page_size=4,
                                  limits=Limits(max_threads=None, **kw))


@pytest.fixture(scope="module")
def engine(tiny_llama):
    return unlimited(tiny_llama)


@pytest.mark.parametrize("trace", [FLAT, NESTED], ids=["flat", "nested"])
def test_replay_text_steps_and_pages(engine, trace):
    pool = engine.block_manager.pool
    want = MULTIVERSE.clean_text(trace)
    [p] = engine.replay([PROMPT], [trace], dialect="multiverse")
    [s] = engine.replay([PROMPT], [trace], mode="sequential", dialect="multiverse")
    assert p.text == want and s.text == want
    assert p.token_ids == s.token_ids[: len(p.token_ids)]
    script = replay_script(engine.tokenizer, trace, replay_eos_id(engine.tokenizer, eos_token_ids(engine.tokenizer)),
                           MULTIVERSE)
    assert p.stats.decode_steps == p.stats.critical_path == critical_path(script.structure)
    assert p.stats.decode_steps < s.stats.decode_steps == s.stats.tokens_decoded
    assert p.stats.forks == len(script.structure.forks) == (3 if trace is FLAT else 4)
    if trace is NESTED:
        assert script.structure.parents == [0, 0, 2, 2]  # the second path forks two of its own
    assert all(r == 0 for r in pool.refcount) and pool.num_free == pool.num_pages


@pytest.mark.parametrize("trace", [FLAT, NESTED], ids=["flat", "nested"])
def test_width_limited_steps_follow_the_simulation(tiny_llama, trace):
    engine = Engine.from_pretrained(tiny_llama, kv_cache_bytes=16 * 2**20, page_size=4, limits=Limits(max_threads=2))
    [p] = engine.replay([PROMPT], [trace], dialect="multiverse")
    script = replay_script(engine.tokenizer, trace, replay_eos_id(engine.tokenizer, eos_token_ids(engine.tokenizer)),
                           MULTIVERSE)
    assert p.stats.max_width == 2
    assert p.stats.decode_steps == simulate_steps(script.structure, 2)
    if trace is FLAT:  # three paths at a width of two: one waits
        assert simulate_steps(script.structure, 2) > critical_path(script.structure)


def test_nesting_past_the_depth_cap_decodes_inline(tiny_llama):
    engine = unlimited(tiny_llama, max_fork_depth=1)
    [p] = engine.replay([PROMPT], [NESTED], dialect="multiverse")
    assert p.text == MULTIVERSE.clean_text(NESTED)
    assert p.stats.forks == 2  # the second path's block is its own text
    assert any("fork depth cap 1 reached" in d for d in p.diagnostics)
    assert p.stats.decode_steps == p.stats.critical_path
    pool = engine.block_manager.pool
    assert pool.num_free == pool.num_pages


@pytest.mark.parametrize("trace", [FLAT, NESTED], ids=["flat", "nested"])
def test_training_forward_equals_the_replay(tiny_llama, engine, trace):
    [res] = engine.replay([PROMPT], [trace], params=SamplingParams(return_logprobs=True), dialect="multiverse")
    hf = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32)
    ids, lps = pasta_logprobs(hf, engine.tokenizer, PROMPT, trace, limits=Limits(max_threads=None),
                              dialect=MULTIVERSE)
    assert ids == res.token_ids
    assert [x is None for x in lps] == [x is None for x in res.logprobs]
    assert sum(x is None for x in lps) > 0  # path headers and the conclusion tags are inserted
    got = torch.tensor([x for x in lps if x is not None])
    want = torch.tensor([x for x in res.logprobs if x is not None])
    torch.testing.assert_close(got, want, rtol=0, atol=1e-4)
