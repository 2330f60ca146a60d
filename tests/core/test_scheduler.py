"""The scheduler on its own: it picks threads and token counts under the token budget
(``max_num_batched_tokens``), allocates KV slots when it schedules, and prefills a long prompt in
pieces (chunked prefill) with outputs equal to an unchunked run's."""

from __future__ import annotations

import pytest

from pasta_engine import Engine, Limits, ParameterError, SamplingParams
from pasta_engine.config import EngineConfig, PositionPolicy
from pasta_engine.core.batch import SampledTokens
from pasta_engine.core.block_manager import BlockManager
from pasta_engine.core.interpreter import Interpreter
from pasta_engine.core.request import Request
from pasta_engine.core.scheduler import Scheduler

ANNOTATED = 'Tips: <promise topic="a" tokens="10"/><async>Sleep.</async> <promise topic="b" tokens="10"/>' \
            '<async>Walk.</async><sync/> Done.'
LONG = [5 + (7 * i) % 50 for i in range(13)]  # a prompt of 13 tokens
GREEDY = SamplingParams(max_new_tokens=8, temperature=0.0, return_logprobs=True)


# --------------------------------------------------------------------------- without a model


def dry_request(rid: str, prompt: list[int], forced: list[int]) -> Request:
    """A sequential request whose main thread's tokens are ``forced`` (EOS last: token 0)."""
    def make() -> Interpreter:
        return Interpreter(prompt, decode=lambda ids: "".join(chr(97 + i % 26) for i in ids), eos_ids=[0],
                           open_ids=[1, 2], close_len=2, mode="sequential", max_new_tokens=len(forced),
                           limits=Limits(), policy=PositionPolicy(), forced_main=forced)
    return Request(rid, 0, "sequential", SamplingParams(max_new_tokens=len(forced)), make)


def run_dry(sched: Scheduler, check=None) -> list:
    """Step the scheduler with each sampling thread's forced token until it is idle; returns
    the batches (``check(batch)`` runs on each before its postprocess)."""
    batches = []
    while sched.has_unfinished():
        batch = sched.schedule()
        batches.append(batch)
        if check:
            check(batch)
        forced = [st.step.forced for st in batch.sampling]
        sched.postprocess(batch, SampledTokens(forced, [0.0] * len(forced)))
    return batches


def test_a_budget_below_one_is_refused():
    with pytest.raises(ValueError, match="max_num_batched_tokens=0"):
        Scheduler(BlockManager(8, 4), max_num_batched_tokens=0)
    with pytest.raises(ParameterError, match="max_num_batched_tokens"):
        EngineConfig(max_num_batched_tokens=0)
    assert EngineConfig().max_num_batched_tokens is None  # default: no limit


@pytest.mark.parametrize("budget", [1, 2, 3, 5, 13, None])
def test_the_prompt_is_prefilled_in_budget_sized_pieces_with_slots_allocated_when_scheduled(budget):
    bm = BlockManager(64, 4)
    sched = Scheduler(bm, max_num_batched_tokens=budget)
    req = dry_request("r", LONG, [40, 41, 42, 0])
    sched.add(req)
    seen_positions: list[int] = []

    def check(batch):
        assert batch.num_tokens <= (budget or len(LONG))
        for st in batch.threads:
            assert len(st.slots) == len(st.step.tokens)
            flat = [p * 4 + o for _, pages, lens in st.runs for p, n in zip(pages, lens) for o in range(n)]
            assert flat[-len(st.slots):] == st.slots  # the view ends with this step's slots, just allocated
            assert len(flat) == st.step.positions[-1] + 1  # no slot reserved ahead of its token
            seen_positions.extend(st.step.positions)
            # only the piece that ends the prompt samples
            assert st.step.sample == (st.step.positions[-1] >= len(LONG) - 1)

    batches = run_dry(sched, check)
    prefill_steps = -(-len(LONG) // budget) if budget else 1
    assert len(batches) == prefill_steps + 3  # then one step per sampled token
    assert seen_positions == list(range(len(LONG) + 3))  # each position forwarded once, in order
    assert req.finish_reason == "stop" and req.result().token_ids == [40, 41, 42, 0]
    assert req.prefill_tokens == len(LONG)
    assert bm.num_free == 64


def test_the_interpreter_states_demand_and_the_scheduler_allocates():
    """The interpreter's demand is every runnable thread with all its pending tokens and
    changes nothing; the scheduler's batch carries the slots it allocated for them."""
    bm = BlockManager(256, 4)
    sched = Scheduler(bm)
    req = dry_request("r", [3, 4, 5], [7, 0])
    sched.add(req)
    batch = sched.schedule()
    demand = req.interp.runnable_threads()
    assert [(s.tid, len(s.tokens), s.sample) for s in demand] == [(0, 3, True)]
    assert [(st.step.tid, len(st.slots)) for st in batch.threads] == [(0, 3)]
    sched.postprocess(batch, SampledTokens([7], [0.0]))
    run_dry(sched)
    assert bm.num_free == 256


@pytest.mark.parametrize("exc", [RuntimeError("the detokenizer failed"), KeyboardInterrupt()])
def test_a_preemption_whose_text_snapshot_raises_fails_that_request_alone(monkeypatch, exc):
    """Preempting a request keeps what it had written (its result) for its restart. When taking
    that raised, the request had already left the running queue and not joined the waiting one:
    it never ended and held its id for good. It ends now with an error naming the preemption,
    reported by ``take_ended`` with every page free; an ordinary exception goes no further (the
    other request runs on), a KeyboardInterrupt is raised again once it has ended."""
    import pasta_engine.core.request as request_module

    bm = BlockManager(6, 4)
    sched = Scheduler(bm, lookahead_steps=0)
    reqs = [dry_request(rid, [3, 4, 5, 6], list(range(40, 51)) + [0]) for rid in ("a", "b")]
    for r in reqs:
        sched.add(r)
    final_text = request_module.render.final_text
    fired = []

    def failing(interp, *a, **k):  # only a preemption renders a running request's text
        req = next(r for r in reqs if r.interp is interp)
        if not fired and not req.finished:
            fired.append(req)
            raise exc
        return final_text(interp, *a, **k)

    monkeypatch.setattr(request_module.render, "final_text", failing)
    raised = None
    try:
        run_dry(sched)
    except KeyboardInterrupt as e:
        raised = e
    [victim] = fired
    assert (raised is not None) == isinstance(exc, KeyboardInterrupt)
    assert victim.finished and victim.finish_reason == "error" and not victim.views
    assert "preempting request" in victim.error and type(exc).__name__ in victim.error
    assert sched.take_ended() == [victim]
    assert victim not in sched.running and victim not in sched.waiting and sched.get(victim.request_id) is None
    other = next(r for r in reqs if r is not victim)
    if raised is not None:  # the engine's step ends the others (fail_running); here: they run on
        run_dry(sched)
    assert other.finished and other.finish_reason == "stop" and other.result().token_ids[-1] == 0
    assert not sched.has_unfinished() and bm.num_free == 6


def test_a_restart_ahead_in_one_chunk_and_behind_in_another_keeps_the_text_that_was_streamed():
    """A restarted forking request can be ahead of what it had written in one chunk and behind
    in another. Its result then is the run whose text extends what was streamed, not the one
    with more tokens (all threads together) nor always the restart: the final text never takes
    streamed text back. Once the restart has caught up in every thread, its own text."""
    from pasta_engine.core.render import OutputRenderer

    vocab = ["b", "a", '<promise topic="t" tokens="20"/>', "</async>", "\n", "- ", '<promise topic="u" tokens="20"/>',
             "<async>", "<EOS>"]
    B, A, T, CLOSE, NL, ITEM, U, OPEN, EOS = range(len(vocab))

    def decode(ids):
        return "".join(vocab[i] for i in ids if i != EOS)

    def make() -> Interpreter:
        return Interpreter([0, 1], decode=decode, eos_ids=[EOS], open_ids=[OPEN], close_len=1, mode="pasta",
                           max_new_tokens=50, limits=Limits(max_threads=None), policy=PositionPolicy())

    req = Request("r", 0, "pasta", SamplingParams(max_new_tokens=50), make)
    req.renderer = OutputRenderer()
    def feed(tid_tokens):
        it = req.interp
        for tid, tok in tid_tokens:
            steps = list(it.runnable_threads())
            it.take_kv_ops()
            it.step_done(steps)
            assert tid in [s.tid for s in steps if s.sample], (tid, [s.tid for s in steps])
            it.on_token(tid, tok)
            req.renderer.update(it, [(tid, tok)])

    main = [(0, B), (0, T), (0, NL), (0, ITEM), (0, U)]
    feed(main + [(1, A), (1, A), (1, CLOSE), (2, B)])  # chunk 1 done, chunk 2 has begun
    streamed = req.renderer.text
    written = req.result().text
    assert written.startswith(streamed) and "aa" in streamed
    req.reset()
    assert req.result().text == written  # the restart has nothing yet
    feed(main + [(2, B), (2, B), (2, B), (1, A)])  # ahead in chunk 2, behind in chunk 1, as many tokens
    assert req.renderer.text == streamed  # the restart is behind what was streamed: nothing new
    assert req.interp.total_sampled == 9
    assert req.result().text == written
    req.reset()  # preempted again: what it keeps is still what was streamed
    assert req.result().text == written
    feed(main + [(1, A), (1, A), (1, CLOSE), (2, B), (2, B)])  # caught up in every thread, ahead in one
    assert req.result().text.startswith(written) and req.result().text != written


# --------------------------------------------------------------------------- through the engine


@pytest.fixture(scope="module")
def engine(tiny_llama):
    """No prefix cache: every run computes its whole prompt (the pieces are what is tested)."""
    return Engine.from_pretrained(tiny_llama, kv_cache_bytes=8 * 2**20, page_size=4, max_running_requests=4,
                                  limits=Limits(max_threads=None), enable_prefix_caching=False)


def outputs(engine: Engine, budget: int | None):
    engine.scheduler.max_num_batched_tokens = budget
    try:
        gen = engine.generate([LONG, LONG[:5]], GREEDY, mode="sequential")
        rep = engine.replay([LONG], [ANNOTATED], mode="pasta")
    finally:
        engine.scheduler.max_num_batched_tokens = None
    assert engine.stats()["kv_pages_free"] == engine.stats()["kv_pages_total"]
    return gen + rep


@pytest.fixture(scope="module")
def unchunked(engine):
    return outputs(engine, None)


@pytest.mark.parametrize("budget", range(1, len(LONG) + 1))
def test_outputs_equal_unchunked_for_every_budget(engine, unchunked, budget):
    got = outputs(engine, budget)
    for a, b in zip(got, unchunked):
        assert a.token_ids == b.token_ids and a.text == b.text
        if b.logprobs is not None:
            assert a.logprobs == pytest.approx(b.logprobs, abs=1e-4)
    assert got[2].stats.forks == unchunked[2].stats.forks == 2  # the replay forked under every budget


def test_a_long_prompt_does_not_stall_a_running_decode(engine):
    """Budget 4: a running request decodes one token every step while a 13-token prompt
    admitted after it is prefilled in pieces of 3."""
    engine.scheduler.max_num_batched_tokens = 4
    try:
        first = engine.add_request([5, 6, 7], SamplingParams(max_new_tokens=12, temperature=0.0),
                                   mode="sequential")
        engine.step()  # its prompt
        engine.step()  # its first decode
        late = engine.add_request(LONG, SamplingParams(max_new_tokens=3, temperature=0.0), mode="sequential")
        steps = 0
        stalled = 0
        prefill_steps = 0
        while engine.has_unfinished_requests():
            outs = {o.request_id: o for o in engine.step()}
            steps += 1
            if first in engine._requests or first in outs:
                progressed = first in outs and outs[first].new_token_ids
                done = first in outs and outs[first].finished
                stalled += 0 if (progressed or done) else 1
            if late in engine._requests and not (late in outs and outs[late].new_token_ids):
                prefill_steps += 1
    finally:
        engine.scheduler.max_num_batched_tokens = None
    assert stalled <= 1
    assert prefill_steps >= 4  # 13 prompt tokens in pieces of at most 3 while the first decodes
    assert engine.stats()["kv_pages_free"] == engine.stats()["kv_pages_total"]


def test_abort_in_the_middle_of_a_chunked_prefill_leaks_nothing(engine):
    engine.scheduler.max_num_batched_tokens = 2
    try:
        rid = engine.add_request(LONG, SamplingParams(max_new_tokens=4, temperature=0.0), mode="sequential")
        engine.step()
        engine.step()
        assert engine.stats()["kv_pages_free"] < engine.stats()["kv_pages_total"]
        assert engine.abort(rid)
        engine.step()
    finally:
        engine.scheduler.max_num_batched_tokens = None
    assert not engine.has_unfinished_requests()
    assert engine.stats()["kv_pages_free"] == engine.stats()["kv_pages_total"]


def test_chunked_prefill_with_prefix_caching_equals_a_cold_engine(tiny_llama, engine):
    cold = engine.generate([LONG], GREEDY, mode="sequential")[0]
    warm = Engine.from_pretrained(tiny_llama, kv_cache_bytes=8 * 2**20, page_size=4, max_num_batched_tokens=3)
    first = warm.generate([LONG], GREEDY, mode="sequential")[0]
    again = warm.generate([LONG], GREEDY, mode="sequential")[0]  # its whole pages come from the cache
    assert again.stats.cached_tokens >= 8
    for r in (first, again):
        assert r.token_ids == cold.token_ids
        assert r.logprobs == pytest.approx(cold.logprobs, abs=1e-4)
    assert warm.stats()["kv_pages_free"] == warm.stats()["kv_pages_total"]
