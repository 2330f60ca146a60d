"""Automatic prefix caching (issue 21 item 5; pasta_engine/core/block_manager.py): a prompt's
whole KV pages stay cached, keyed by their tokens and the prefix before them; a later prompt
reuses the matching leading pages instead of prefilling them, never the page of its last token.

What holds: the shared prefix is forwarded once (counted at the model's forward), outputs
(greedy tokens, logprobs) equal a cold engine's with caching off, in pasta and sequential mode
and in replay with forks; a cached page is never written; eviction under KV pressure,
preemption, abort, injected errors and Ctrl-C leave every page accounted for (free + cached
free + held == total, and nothing held once no request runs). The page-level rules (what is
cached, reused, evicted) are tested in tests/core/test_block_manager.py."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pasta_engine import Engine, ParameterError, SamplingParams
from pasta_engine.config import EngineConfig
from pasta_engine.layers import sampler as sampler_module

PAGE = 4
GREEDY = SamplingParams(max_new_tokens=24, return_logprobs=True)
# two traces with forks (and a sync) for replay
TRACES = [
    'Tips:\n1. <promise topic="sleep" tokens="30"/><async>Go to bed early.</async>\n2. '
    '<promise topic="screens" tokens="20"/><async>Avoid screens at night.</async>\n<sync/>\nDone.',
    'Plan: <promise topic="a" tokens="10"/><async>Read the notes.</async> '
    '<promise topic="b" tokens="10"/><async>Do the exercises.</async><sync/> Then rest.',
]
# token-id prompts in two families (a shared head of 21 tokens, then their own tails)
HEADS = [list(range(10, 31)), list(range(40, 61))]
ID_PROMPTS = [HEADS[i % 2] + [100 + i, 101 + i, 102 + 2 * i][: 1 + i % 3] for i in range(6)]


def make(path, caching: bool, kv_bytes: int = 4 * 2**20, **kw) -> Engine:
    return Engine.from_pretrained(path, kv_cache_bytes=kv_bytes, page_size=PAGE, enable_prefix_caching=caching, **kw)


def instrument(engine: Engine) -> list[int]:
    """Count the tokens of every model forward, and check before each one that no KV slot the
    step writes lies in a cached page (a cached page is never written)."""
    counts: list[int] = []
    forward, run = engine.model.forward, engine.model_runner.run
    pool = engine.block_manager.pool

    def counting_forward(ids, *a, **k):
        counts.append(int(ids.shape[0]))
        return forward(ids, *a, **k)

    def checked_run(batch):
        for t in batch.threads:
            for slot in t.slots:
                assert pool.key_of[slot // PAGE] is None, f"a step writes slot {slot} of a cached page"
        return run(batch)

    engine.model.forward = counting_forward
    engine.model_runner.run = checked_run
    return counts


def accounted(engine: Engine, idle: bool = True) -> dict[str, int]:
    """The pool's audit (every page free, cached free or held, exactly once); with ``idle``,
    no page is held and every page can be taken again."""
    a = engine.block_manager.pool.audit()
    assert a["free"] + a["cached_free"] + a["held"] == engine.block_manager.num_pages
    if idle:
        s = engine.stats()
        assert a["held"] == 0 and s["kv_pages_free"] == s["kv_pages_total"] and s["running"] == s["waiting"] == 0
    return a


def assert_same(got, want):
    assert [r.token_ids for r in got] == [r.token_ids for r in want]
    for g, w in zip(got, want):
        assert g.text == w.text and g.stats.finish_reason == w.stats.finish_reason
        if w.logprobs is not None:
            assert g.logprobs == pytest.approx(w.logprobs, abs=1e-5)


def shared_len(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def test_the_option_is_validated_and_off_means_no_reuse(tiny_llama):
    with pytest.raises(ParameterError, match="enable_prefix_caching"):
        EngineConfig(enable_prefix_caching="yes")
    assert EngineConfig().enable_prefix_caching is True  # on by default, as in vLLM
    off = make(tiny_llama, False)
    off.generate([ID_PROMPTS[0]] * 2, SamplingParams(max_new_tokens=3))
    s = off.stats()
    assert s["prefix_caching"] is False and s["prefix_cache_hit_tokens"] == 0 and s["kv_pages_cached"] == 0
    assert s["prefix_cache_query_tokens"] == 2 * len(ID_PROMPTS[0])


# --------------------------------------------------------------------------- the engine


@pytest.mark.parametrize("mode", ["pasta", "sequential"])
def test_a_shared_prefix_is_computed_once_and_outputs_equal_a_cold_engine(tiny_llama, mode):
    prompts = ["Name three fruits.", "Name three vegetables."]
    cold, warm = make(tiny_llama, False), make(tiny_llama, True)
    cold_n, warm_n = instrument(cold), instrument(warm)
    want = [cold.generate([p], GREEDY, mode=mode)[0] for p in prompts]
    got = [warm.generate([p], GREEDY, mode=mode)[0] for p in prompts]
    assert_same(got, want)
    p0, p1 = got[0].prompt_ids, got[1].prompt_ids
    hit = min(shared_len(p0, p1), len(p1) - 1) // PAGE * PAGE
    assert hit >= (500 if mode == "pasta" else 8)  # the PASTA-LANG system prompt / the chat template's head
    assert [r.stats.cached_tokens for r in got] == [0, hit]
    assert got[1].stats.prefill_tokens == want[1].stats.prefill_tokens - hit
    assert sum(warm_n) == sum(cold_n) - hit  # the shared prefix was forwarded once
    s = warm.stats()
    assert s["prefix_cache_hit_tokens"] == hit and s["prefix_cache_query_tokens"] == len(p0) + len(p1)
    assert s["kv_pages_cached"] == len(p0) // PAGE + (len(p1) - hit) // PAGE
    # the same prompts again, now in one batch: everything but each prompt's last page is reused
    again = warm.generate(prompts, GREEDY, mode=mode)
    assert_same(again, want)
    assert [r.stats.cached_tokens for r in again] == [(len(p) - 1) // PAGE * PAGE for p in (p0, p1)]
    accounted(warm)


@pytest.mark.parametrize("ckpt", ["tiny_mistral", "tiny_gemma2", "tiny_qwen3", "tiny_phi3"])
def test_other_architectures_windows_and_soft_caps_give_the_same_outputs(ckpt, request):
    """Sliding windows of 8 tokens (a reused prefix of 20 is mostly outside the window of the
    tokens computed after it), soft-caps, q/k norms, fused checkpoints."""
    path = request.getfixturevalue(ckpt)
    params = SamplingParams(max_new_tokens=10, return_logprobs=True)
    cold, warm = make(path, False), make(path, True)
    want = [cold.generate([p], params, mode="sequential")[0] for p in ID_PROMPTS]
    got = [warm.generate([p], params, mode="sequential")[0] for p in ID_PROMPTS]
    assert_same(got, want)
    assert [r.stats.cached_tokens for r in got] == [0, 0, 20, 20, 20, 20]
    accounted(warm)


def test_replay_with_forks_reuses_the_system_prompt_in_both_modes(tiny_llama):
    prompts = ["Give me sleep tips.", "Plan my study day."]
    params = SamplingParams(return_logprobs=True)
    cold, warm = make(tiny_llama, False), make(tiny_llama, True)
    cold_n, warm_n = instrument(cold), instrument(warm)
    for mode in ("pasta", "sequential"):
        want = [cold.replay([p], [t], mode=mode, params=params)[0] for p, t in zip(prompts, TRACES)]
        got = [warm.replay([p], [t], mode=mode, params=params)[0] for p, t in zip(prompts, TRACES)]
        assert_same(got, want)
        if mode == "pasta":
            assert [r.stats.forks for r in got] == [2, 2]
        assert all(r.stats.cached_tokens > 500 for r in got[mode == "pasta":])  # replay: the PASTA prompt in both
    s = warm.stats()
    assert sum(warm_n) == sum(cold_n) - s["prefix_cache_hit_tokens"]
    accounted(warm)


def test_children_forked_after_a_cached_prefix_see_it_and_write_only_their_own_pages(tiny_llama):
    """Width-limited replays of one trace in a batch: the children share the cached pages with
    the main thread and with the other requests, and every step's writes avoid cached pages
    (checked in instrument())."""
    from pasta_engine import Limits

    cold = make(tiny_llama, False, limits=Limits(max_threads=2))
    warm = make(tiny_llama, True, limits=Limits(max_threads=2))
    instrument(warm)
    prompts = ["Give me sleep tips."] * 3
    params = SamplingParams(return_logprobs=True)
    want = cold.replay(prompts, [TRACES[0]] * 3, params=params)
    warm.replay(prompts[:1], TRACES[:1], params=params)
    got = warm.replay(prompts, [TRACES[0]] * 3, params=params)
    assert_same(got, want)
    assert all(r.stats.cached_tokens == (len(r.prompt_ids) - 1) // PAGE * PAGE for r in got)
    accounted(warm)


def test_eviction_under_kv_pressure_keeps_outputs_right(tiny_llama):
    # six families of two prompts: 6 x 5 cached pages do not fit in 30 beside a running request
    prompts = [list(range(10 + 30 * f, 31 + 30 * f)) + [200 + i] * (1 + i) for f in range(6) for i in range(2)]
    params = SamplingParams(max_new_tokens=12, return_logprobs=True)
    cold = make(tiny_llama, False)
    want = [cold.generate([p], params, mode="sequential")[0] for p in prompts]
    per_page = cold.model_runner.kv_cache_bytes // cold.stats()["kv_pages_total"]
    tight = make(tiny_llama, True, kv_bytes=30 * per_page, max_running_requests=2)
    assert tight.stats()["kv_pages_total"] == 30
    instrument(tight)
    for _ in range(2):
        got = [tight.generate([p], params, mode="sequential")[0] for p in prompts]
        assert_same(got, want)
        got = tight.generate(prompts, params, mode="sequential")  # a batch
        assert_same(got, want)
        accounted(tight)
    s = tight.stats()
    assert s["prefix_cache_evictions"] > 0 and s["prefix_cache_hit_tokens"] > 0


def test_preemption_with_cached_prefixes_keeps_outputs_and_pages(tiny_llama):
    prompts = [HEADS[0] + [5 + i, 9, 10, 11] for i in range(4)]
    params = SamplingParams(max_new_tokens=40, temperature=0.9, seed=11)
    want = make(tiny_llama, False, kv_bytes=8 * 2**20).generate(prompts, params, mode="sequential")
    probe = make(tiny_llama, False)
    per_page = probe.model_runner.kv_cache_bytes // probe.stats()["kv_pages_total"]
    tight = make(tiny_llama, True, kv_bytes=36 * per_page)
    instrument(tight)
    for _ in range(2):  # the second run starts with every prefix cached
        got = tight.generate(prompts, params, mode="sequential")
        assert [r.token_ids for r in got] == [r.token_ids for r in want]
        accounted(tight)
    s = tight.stats()
    assert s["preemptions"] >= 1 and s["prefix_cache_hit_tokens"] > 0


def test_abort_mid_request_leaves_every_page_accounted_for(tiny_llama):
    cold, warm = make(tiny_llama, False), make(tiny_llama, True)
    instrument(warm)
    want = cold.generate(ID_PROMPTS[2], GREEDY, mode="sequential")[0]
    warm.generate(ID_PROMPTS[0], SamplingParams(max_new_tokens=2), mode="sequential")  # caches HEADS[0]
    a = warm.add_request(ID_PROMPTS[4], GREEDY, mode="sequential")
    b = warm.add_request(ID_PROMPTS[2], GREEDY, mode="sequential")
    for _ in range(3):
        warm.step()
    held = accounted(warm, idle=False)["held"]
    assert warm.abort(a)
    after = accounted(warm, idle=False)
    assert 0 < after["held"] < held  # a's own pages are back; the prefix b shares is still held
    finals = {}
    while warm.has_unfinished_requests():
        for out in warm.step():
            if out.finished:
                finals[out.request_id] = out
    assert finals[a].finish_reason == "abort"
    assert_same([finals[b].result], [want])
    assert finals[b].result.stats.cached_tokens == 20
    accounted(warm)


from faults import Boom, fail_on_call  # noqa: E402  (tests/engine/faults.py)


@pytest.mark.parametrize("where", ["model.forward", "reuse_prefix", "cache_prefix", "append"])
@pytest.mark.parametrize("exc", [Boom("injected"), KeyboardInterrupt()])
def test_an_injected_error_or_ctrl_c_leaves_every_page_accounted_for(tiny_llama, monkeypatch, where, exc):
    params = SamplingParams(max_new_tokens=10, return_logprobs=True)
    want = make(tiny_llama, False).generate(ID_PROMPTS, params, mode="sequential")
    warm = make(tiny_llama, True)
    instrument(warm)
    warm.generate(ID_PROMPTS[:2], params, mode="sequential")  # both heads cached: the next prompts reuse them
    obj, name = (warm.model, "forward") if where == "model.forward" else (warm.block_manager, where)
    real = getattr(obj, name)
    for n in (1, 2, 4, 7):
        monkeypatch.setattr(obj, name, fail_on_call(n, exc)(real))
        try:
            warm.generate(ID_PROMPTS, params, mode="sequential")
        except (Boom, KeyboardInterrupt):
            pass
        accounted(warm)
        assert not warm.has_unfinished_requests()
    monkeypatch.setattr(obj, name, real)
    assert_same(warm.generate(ID_PROMPTS, params, mode="sequential"), want)
    accounted(warm)


def test_a_failed_sampling_ends_its_request_alone_and_frees_its_pages(tiny_llama, monkeypatch):
    params = SamplingParams(max_new_tokens=12, temperature=0.8, seed=7)
    want = make(tiny_llama, False).generate(ID_PROMPTS, params, mode="sequential")
    real = sampler_module.draw_noise

    def draw_noise(out, generator):
        if generator.initial_seed() == 666:
            raise Boom("bad logits")
        return real(out, generator)

    monkeypatch.setattr(sampler_module, "draw_noise", draw_noise)  # SamplingBatch.pick draws through it
    warm = make(tiny_llama, True)
    instrument(warm)
    warm.generate(ID_PROMPTS[:2], params, mode="sequential")
    bad = SamplingParams(max_new_tokens=12, temperature=0.8, seed=666)
    res = warm.generate(ID_PROMPTS, [params, bad, params, params, bad, params], mode="sequential")
    assert [r.stats.finish_reason == "error" for r in res] == [False, True, False, False, True, False]
    assert [r.token_ids for k, r in enumerate(res) if k not in (1, 4)] == \
        [r.token_ids for k, r in enumerate(want) if k not in (1, 4)]
    accounted(warm)


@pytest.fixture(scope="module")
def interleaved(tiny_llama):
    """A tight engine shared by every example (its cache carries over) and each prompt's
    greedy output from a cold engine."""
    cold = make(tiny_llama, False)
    params = SamplingParams(max_new_tokens=8)
    want = {i: cold.generate([p], params, mode="sequential")[0].token_ids for i, p in enumerate(ID_PROMPTS)}
    per_page = cold.model_runner.kv_cache_bytes // cold.stats()["kv_pages_total"]
    warm = make(tiny_llama, True, kv_bytes=24 * per_page, max_running_requests=3)
    instrument(warm)
    return warm, params, want


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=st.lists(st.tuples(st.sampled_from(["add", "add", "step", "step", "abort"]), st.integers(0, 5)),
                    max_size=20))
def test_interleavings_of_add_step_abort_keep_outputs_and_pages(interleaved, ops):
    engine, params, want = interleaved
    ids: list[tuple[str, int]] = []
    finals = {}
    for op, k in ops:
        if op == "add":
            ids.append((engine.add_request(ID_PROMPTS[k], params, mode="sequential"), k))
        elif op == "abort" and ids:
            engine.abort(ids[k % len(ids)][0])
        else:
            for out in engine.step():
                if out.finished:
                    finals[out.request_id] = out
        accounted(engine, idle=False)
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
    for rid, k in ids:
        out = finals[rid]
        if out.finish_reason != "abort":
            assert out.result.token_ids == want[k]
    accounted(engine)
