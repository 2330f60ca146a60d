"""Sampling rows (issue 32 item 1): the scheduler fills one typed row per sampling thread and
the sampler packs them in one place; every sampling option must still pick the tokens the code
before the rows picked (``data/sampling_golden.json``, recorded from it by
``sampling_cases.py``): greedy, seeded sampling, top-k/p, min-p, the repetition, presence and
frequency penalties (per thread, forked threads included), end masks (``ignore_eos``,
``min_tokens``, stop ids), grammar masks, ``fork_threshold`` and a replay's forced tokens, in
mixed batches."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from pasta_engine import Engine, SamplingParams
from pasta_engine.core.batch import SamplingRow, SeenTokens
from pasta_engine.lang.grammar import GrammarState, tag_tokens_of
from pasta_engine.layers.sampler import SamplingBatch
from sampling_cases import GOLDEN, PROMPTS, _promise_first, make_tagged_adapter, run_cases


@pytest.fixture(scope="module")
def adapter(tiny_llama, tmp_path_factory):
    return make_tagged_adapter(tiny_llama, tmp_path_factory.mktemp("tagged") / "adapter")


@pytest.fixture(scope="module")
def results(tiny_llama, adapter):
    return run_cases(tiny_llama, adapter)


@pytest.mark.parametrize("case", ["mixed_options", "penalties", "end_masks", "replay", "grammar_forks",
                                  "fork_threshold"])
def test_every_sampling_option_picks_the_recorded_tokens(results, case):
    want = json.loads(GOLDEN.read_text())[case]
    got = results[case]
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g["error"] is None and g["finish"] == w["finish"]
        assert g["token_ids"] == w["token_ids"] and g["threads"] == w["threads"]
        assert (g["logprobs"] is None) == (w["logprobs"] is None)
        if w["logprobs"] is not None:
            pairs = [(a, b) for a, b in zip(g["logprobs"], w["logprobs"]) if b is not None]
            assert [a is None for a in g["logprobs"]] == [b is None for b in w["logprobs"]]
            torch.testing.assert_close(torch.tensor([a for a, _ in pairs]), torch.tensor([b for _, b in pairs]),
                                       rtol=1e-5, atol=1e-5)


def test_the_cases_fork_and_mix_options(results):
    """The recorded cases exercise what they claim: forked threads under grammar masks and
    penalties, requests ending early under the end masks."""
    assert all(len(set(r["threads"])) > 1 for r in results["grammar_forks"])
    assert len(set(results["replay"][0]["threads"])) == 4
    assert {r["finish"] for r in results["end_masks"]} == {"stop", "length"}


def _forking_engine(ckpt, adapter, **kw):
    engine = Engine.from_pretrained(ckpt, adapter=adapter, position_policy="constant:8", page_size=4,
                                    max_running_requests=4, **kw)
    engine.logits_hook = _promise_first(tag_tokens_of(engine.tokenizer))
    return engine


def _check_seen_counts(engine) -> list[tuple[int, bool]]:
    """Wrap ``engine``'s model runner so that every penalised row's seen-token counts are checked
    against a full recount before the step runs; returns the list of ``(tid, inside an inline
    chunk)`` of the rows checked, filled as the engine runs."""
    run, checked = engine.model_runner.run, []

    def checking_run(batch):
        for row in batch.rows:
            if row.seen is not None:
                it = engine.scheduler.get(row.request_id).interp
                assert row.seen == SeenTokens.recount(it.seen_tokens(row.tid), len(it.prompt_ids))
                checked.append((row.tid, it.threads[row.tid].inline))
        return run(batch)

    engine.model_runner.run = checking_run
    return checked


def test_seen_counts_equal_a_recount_every_step_and_after_preemption(tiny_llama, adapter):
    """The scheduler keeps each thread's seen-token counts incrementally (a thread's tokens are
    counted once, at its first penalised sample, then each step adds what it forwards); at every
    step of forking requests, in a cache so tight that requests are preempted and restart (under
    a token budget that prefills in pieces, with prefix caching), they equal a recount of the
    tokens the thread sees, and the tokens equal those of a roomy engine."""
    params = [SamplingParams(max_new_tokens=40, temperature=0.0, repetition_penalty=1.2, presence_penalty=0.3),
              SamplingParams(max_new_tokens=40, temperature=0.8, seed=3, frequency_penalty=0.5)] * 2
    want = _forking_engine(tiny_llama, adapter, kv_cache_bytes=8 * 2**20).generate(PROMPTS, params, mode="pasta")
    tight = _forking_engine(tiny_llama, adapter, kv_cache_bytes=48 * 1024, max_num_batched_tokens=6,
                            enable_prefix_caching=True)
    checked = _check_seen_counts(tight)
    got = tight.generate(PROMPTS, params, mode="pasta")
    assert tight.stats()["preemptions"] > 0 and any(tid for tid, _ in checked) and len(checked) > 100
    assert [r.token_ids for r in got] == [r.token_ids for r in want]
    assert all(r.stats.forks >= 1 for r in got)


def test_seen_counts_equal_a_recount_every_step_in_inline_mode(tiny_llama, adapter):
    """In inline mode what a thread counts shrinks while a chunk is open (its promise leaves the
    count) and grows back when it closes; the incremental counts recount at both ends and equal a
    full recount at every step."""
    params = [SamplingParams(max_new_tokens=40, temperature=0.0, repetition_penalty=1.2, presence_penalty=0.3)] * 2
    engine = _forking_engine(tiny_llama, adapter, kv_cache_bytes=8 * 2**20)
    checked = _check_seen_counts(engine)
    got = engine.generate(PROMPTS[:2], params, mode="inline")
    assert any(inline for _, inline in checked) and not all(inline for _, inline in checked)  # in a chunk and out
    assert all(r.error is None for r in got)


def _row(rid, tid=0, forced=None, grammar=0, seen=None, ends=(), threshold=None, rng=None, **params):
    from pasta_engine.core.batch import RandomStream

    prm = SamplingParams(**params)
    return SamplingRow(rid, tid, prm, forced, grammar, seen, tuple(ends), threshold, rng or RandomStream(prm.seed))


def test_the_packed_batch_applies_what_transformers_processors_do():
    """One SamplingBatch over rows of several requests: the repetition penalty is transformers'
    RepetitionPenaltyLogitsProcessor on the thread's tokens, the end masks its
    SuppressTokensLogitsProcessor, the grammar mask the table's row, a forced row is left as it
    is, and greedy rows pick the argmax."""
    from transformers import RepetitionPenaltyLogitsProcessor, SuppressTokensLogitsProcessor

    vocab = 50
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(4, vocab, generator=g) * 3
    seen = [3, 7, 7, 11, 40]
    table = torch.zeros(2, vocab, dtype=torch.bool)
    table[1, 20:] = True
    rows = [_row("a", seen=SeenTokens.recount(seen, 2), repetition_penalty=1.7, temperature=0.0),
            _row("b", ends=(0, 7, 99), temperature=0.0),
            _row("c", grammar=1, temperature=0.0),
            _row("d", forced=5, temperature=0.0, repetition_penalty=1.3, seen=SeenTokens.recount(seen, 2))]
    sb = SamplingBatch.from_rows(rows, vocab, torch.device("cpu"), table, None, GrammarState.MAIN)
    out = sb.process(logits)
    want0 = RepetitionPenaltyLogitsProcessor(1.7)(torch.tensor([seen]), logits[:1].clone())
    torch.testing.assert_close(out[0], want0[0])
    want1 = SuppressTokensLogitsProcessor([0, 7], device="cpu")(torch.tensor([[1]]), logits[1:2].clone())
    torch.testing.assert_close(out[1], want1[0])
    assert torch.isinf(out[2, 20:]).all() and torch.equal(out[2, :20], logits[2, :20])
    assert torch.equal(out[3], logits[3])  # forced: untouched
    tokens, _ = sb.pick(out, {})
    assert tokens.tolist() == [int(out[0].argmax()), int(out[1].argmax()), int(out[2].argmax()), 5]


def test_a_masked_end_id_the_grammar_requires_is_left_to_the_grammar():
    """A stop id that is the only token a tag state allows (a ``"/>`` piece under ``min_tokens``):
    the end mask and the grammar would leave the row no token, and greedy's argmax would be
    token 0. The grammar wins on that row (the tag closes); another row keeps its end mask, and
    a row masked throughout is flagged bad instead of sampled."""
    from pasta_engine.layers.sampler import sample_batch

    vocab = 30
    logits = torch.randn(3, vocab, generator=torch.Generator().manual_seed(1))
    table = torch.zeros(2, vocab, dtype=torch.bool)
    table[1] = True
    table[1, 9] = False  # state 1 allows only token 9
    rows = [_row("a", grammar=1, ends=(9,), temperature=0.0),  # the grammar needs the masked end id
            _row("b", grammar=0, ends=(9,), temperature=0.0),
            _row("c", grammar=1, temperature=0.0)]
    out = SamplingBatch.from_rows(rows, vocab, torch.device("cpu"), table, None, GrammarState.MAIN).process(logits)
    assert out[0, 9] == logits[0, 9] and torch.isinf(out[0]).sum() == vocab - 1
    assert torch.isinf(out[1, 9]) and torch.isfinite(out[1, :9]).all()
    tokens, bad = sample_batch(torch.cat([out, torch.full((1, vocab), float("-inf"))]),
                               torch.ones(4, dtype=torch.bool), torch.ones(4, 1), None, None, None)
    assert tokens[0] == 9 and bad.tolist() == [False, False, False, True]


def _forking_hook(engine, child_tokens=5):
    """A logits hook that makes the main thread write two promises and a sync, and each chunk
    sample ``child_tokens`` tokens (no '<', no early end) before it ends."""
    script = engine.encode('Intro <promise topic="a" tokens="4"/> mid <promise topic="b" tokens="4"/> more<sync/> end')
    eos, lt = sorted(engine.eos_ids)[0], engine.encode("<")[0]

    def hook(row, tid, x):
        req = engine._requests.get(row.request_id)
        if req is None or req.interp is None:
            return
        k = req.interp.threads[tid].n_sampled
        if tid == 0:
            if k < len(script):
                x[script[k]] += 1e4
        elif k >= child_tokens:
            x[eos] += 1e4
        else:
            x[eos] -= 1e4
            x[lt] -= 1e4

    return hook


def test_each_thread_draws_from_its_own_stream(tiny_llama):
    """A request's threads shared one random stream: a thread that stopped sampling (the main
    thread ending at a stop string) or a width limit changed what its siblings drew, so a stop
    string changed text before it. Each thread has its own stream now
    (``core.batch.thread_seed``): the stopped text is the unstopped text cut at the stop, one
    thread at a time (max_threads=1) gives every thread the same tokens as all at once, and the
    main thread keeps the request's own seed."""
    from pasta_engine.config import Limits
    from pasta_engine.core.batch import thread_seed

    engine = Engine.from_pretrained(tiny_llama, kv_cache_bytes=8 * 2**20, page_size=4)
    engine.logits_hook = _forking_hook(engine)
    params = SamplingParams(max_new_tokens=50, temperature=1.0, seed=10)
    [full] = engine.generate([[5, 9, 10]], params)
    [cut] = engine.generate([[5, 9, 10]], dataclasses.replace(params, stop=(" mid ",)))
    assert full.stats.forks == 2 and cut.stats.finish_reason == "stop"
    assert full.text.startswith(cut.text) and full.text[len(cut.text):].startswith(" mid ")
    one = Engine.from_pretrained(tiny_llama, kv_cache_bytes=8 * 2**20, page_size=4, limits=Limits(max_threads=1))
    one.logits_hook = _forking_hook(one)
    [narrow] = one.generate([[5, 9, 10]], params)
    by_thread = lambda r: sorted(zip(r.threads, r.token_ids), key=lambda p: p[0])  # noqa: E731
    assert by_thread(narrow) == by_thread(full) and narrow.stats.decode_steps > full.stats.decode_steps
    assert thread_seed(10, 0) == 10 and thread_seed(None, 3) is None
    assert len({thread_seed(s, t) for s in range(4) for t in range(4)}) == 16  # no two streams alike
