"""The scheduler's thread policy under load (issue 33): when the token budget
(``max_num_batched_tokens``) binds, ``critical_first`` runs every running request's critical
thread (its main thread; while the main thread waits at a sync, the child with the longest
remaining promised length) before any extra child thread and shares the rest round-robin across
requests; ``fcfs`` keeps the policy before it. Outputs never depend on the policy.

Most tests drive the scheduler with replayed requests and no model (the forced token of each
sampling thread is its sample, as in test_scheduler's dry runs), over a vocabulary whose tags are
single tokens; one compares a tiny model's greedy outputs and logprobs across policies and budgets."""

from __future__ import annotations

import pytest

from pasta_engine import Engine, Limits, ParameterError, SamplingParams
from pasta_engine.config import EngineConfig, PositionPolicy
from pasta_engine.core.batch import KVFork, KVJoin, SampledTokens
from pasta_engine.core.block_manager import BlockManager
from pasta_engine.core.interpreter import Interpreter
from pasta_engine.core.request import Request
from pasta_engine.core.scheduler import Scheduler

PIECES = ["<EOS>", "a", " ", "<async>", "</async>", "<sync/>", '<promise topic="x" tokens="2"/>',
          '<promise topic="y" tokens="9"/>', '<promise topic="z" tokens="5"/>']
EOS, A, SP, OPEN, CLOSE, SYNC, PX, PY, PZ = range(len(PIECES))


def decode(ids):
    return "".join(PIECES[i] for i in ids if i != EOS)


def replayed(rid: str, main: list[int], chunks: list[list[int]] | None = None, width: int | None = None) -> Request:
    """A pasta-mode request whose main thread's tokens are ``main`` (EOS last) and whose
    children's are ``chunks`` (``</async>`` last), prompt of 3 tokens."""
    def make() -> Interpreter:
        return Interpreter([1, 2, 1], decode=decode, eos_ids=[EOS], open_ids=[OPEN], close_len=1, mode="pasta",
                           max_new_tokens=500, limits=Limits(max_threads=width), policy=PositionPolicy(),
                           forced_main=main, forced_chunks=chunks or [])
    return Request(rid, 0, "pasta", SamplingParams(max_new_tokens=500), make)


def forky(rid: str) -> Request:
    """Three children promised 2, 9 and 5 tokens; the main thread waits at a sync for them."""
    return replayed(rid, [A, PX, PY, PZ, A, A, SYNC, A, EOS], [[A] * 2 + [CLOSE], [A] * 9 + [CLOSE], [A] * 5 + [CLOSE]])


def wide(rid: str) -> Request:
    """Three children of 9 tokens each forked at once, a main thread of 12 more tokens, then a sync."""
    return replayed(rid, [PX, PY, PZ] + [A] * 12 + [SYNC, A, EOS], [[A] * 9 + [CLOSE]] * 3)


def plain(rid: str, n: int) -> Request:
    """No fork: ``n`` tokens then EOS."""
    return replayed(rid, [A] * n + [EOS])


def critical_tid(req: Request) -> int | None:
    """The oracle, from the definition: the main thread when it samples; else the sampling
    child with the longest remaining promised length (ties: forked first); None when no thread
    samples."""
    it = req.interp
    sampling = [s.tid for s in it.runnable_threads() if s.sample]
    if it.main.tid in sampling:
        return it.main.tid
    if not sampling:
        return None
    rem = {t: max(0, it.threads[t].promise.tokens - it.threads[t].n_sampled) for t in sampling}
    return max(sampling, key=lambda t: (rem[t], -t))


def must_tids(req: Request) -> set[int]:
    """Threads a pending fork or join needs in the next step (they run with all their tokens)."""
    out: set[int] = set()
    for op in req.interp.peek_kv_ops():
        if isinstance(op, KVFork):
            out.add(op.parent)
        elif isinstance(op, KVJoin):
            out.update(op.children)
    return out


class Trace:
    """Steps a scheduler to the end (each sampling thread samples its forced token) and records,
    per step, what each running request needed before the step (``before``: request id ->
    (request, critical thread id, ids of the threads a fork or join needs, the tokens those need
    besides the critical thread's); ``demand``: its pending tokens) and what ran (``ran``: request
    id -> thread id -> tokens; ``tokens``: the batch's; ``sampling``: request id -> its sampling
    threads)."""

    def __init__(self, sched: Scheduler, reqs: list[Request]):
        self.sched, self.reqs, self.steps = sched, reqs, []
        for r in reqs:
            sched.add(r)
        while sched.has_unfinished():
            assert len(self.steps) < 1000, "the scheduler did not finish"
            before = {}
            for r in sched.running:
                crit, must = critical_tid(r), must_tids(r)
                extra = sum(len(st.tokens) for st in r.interp.runnable_threads() if st.tid in must and st.tid != crit)
                before[r.request_id] = (r, crit, must, extra)
            demand = {rid: sum(len(s.tokens) for s in v[0].interp.runnable_threads()) for rid, v in before.items()}
            batch = sched.schedule()
            ran: dict[str, dict[int, int]] = {}
            for st in batch.threads:
                ran.setdefault(st.request_id, {})[st.step.tid] = len(st.step.tokens)
            self.steps.append({"before": before, "demand": demand, "ran": ran, "tokens": batch.num_tokens,
                               "sampling": {rid: sum(1 for st in batch.sampling if st.request_id == rid)
                                            for rid in ran}})
            forced = [st.step.forced for st in batch.sampling]
            sched.postprocess(batch, SampledTokens(forced, [0.0] * len(forced)))
        assert all(r.finish_reason == "stop" for r in reqs)
        assert sched.block_manager.num_free == sched.block_manager.num_pages  # every page back

    def critical_waits(self) -> dict[str, int]:
        """Per request, the most consecutive steps it had a critical thread that did not run."""
        run: dict[str, int] = {}
        worst: dict[str, int] = {}
        for s in self.steps:
            for rid, (_, crit, _, _) in s["before"].items():
                if crit is None:
                    continue
                run[rid] = 0 if crit in s["ran"].get(rid, {}) else run.get(rid, 0) + 1
                worst[rid] = max(worst.get(rid, 0), run[rid])
        return worst


def scheduler(budget: int | None, policy: str, max_running: int = 8) -> Scheduler:
    return Scheduler(BlockManager(512, 4), max_running_requests=max_running, max_num_batched_tokens=budget,
                     thread_policy=policy)


# --------------------------------------------------------------------------- the policy's rule


@pytest.mark.parametrize("budget", [4, 5, 6])
def test_every_critical_thread_advances_every_step_under_a_binding_budget(budget):
    t = Trace(scheduler(budget, "critical_first"), [forky("A"), plain("B", 14), forky("C"), wide("D")])
    checked = binding = 0
    for s in t.steps[1:]:  # the first step admits everyone (the oracle ran before admission)
        before = s["before"]
        # the budget the rule promises to cover: one token per critical thread, plus what forks and joins need
        need = sum(1 + extra for _, crit, _, extra in before.values() if crit is not None)
        if need > budget:
            continue
        checked += 1
        binding += sum(s["demand"].values()) > budget
        for rid, (_, crit, _, _) in before.items():
            if crit is not None:
                assert crit in s["ran"].get(rid, {}), (rid, crit, s["ran"])
    assert checked >= 20 and binding >= 10  # not vacuous: the budget bound in many of the checked steps


@pytest.mark.parametrize("budget", [1, 2, 3, 4, 6])
def test_no_extra_thread_runs_before_every_critical_thread_has_run(budget):
    t = Trace(scheduler(budget, "critical_first"), [forky("A"), wide("B"), plain("C", 9), forky("D")])
    extras_ran = 0
    for s in t.steps[1:]:
        extra = [(rid, tid) for rid, threads in s["ran"].items() for tid in threads
                 if tid != s["before"][rid][1] and tid not in s["before"][rid][2]]
        if extra:
            extras_ran += 1
            for rid, (_, crit, _, _) in s["before"].items():
                assert crit is None or crit in s["ran"].get(rid, {}), (extra, rid, crit)
    assert extras_ran > 0 or budget == 1


@pytest.mark.parametrize("budget", [1, 2, 3])
def test_no_request_waits_more_than_max_running_minus_one_steps(budget):
    """The bound: with R running requests (at most ``max_running_requests``), a request's critical
    thread waits at most R - 1 steps in a row, whatever the budget (here 3 running at once out
    of 6, so admissions happen while others wait)."""
    reqs = [forky("A"), wide("B"), plain("C", 7), forky("D"), plain("E", 3), wide("F")]
    t = Trace(scheduler(budget, "critical_first", max_running=3), reqs)
    waits = t.critical_waits()
    assert max(waits.values()) <= 2, waits
    if budget < 3:
        assert max(waits.values()) >= 1  # the budget was below one token per request: someone did wait
    # fcfs has no such bound: the first request takes the budget until it is done
    assert max(Trace(scheduler(budget, "fcfs", max_running=3),
                     [forky("A"), wide("B"), plain("C", 7), forky("D"), plain("E", 3), wide("F")])
               .critical_waits().values()) > 2


def test_a_request_alone_gets_its_full_width():
    alone = Trace(scheduler(None, "critical_first"), [wide("A")])
    full = alone.reqs[0].max_width
    peak = max(s["tokens"] for s in alone.steps)
    assert full == 4  # the main thread and its three children
    for policy in ("critical_first", "fcfs"):
        t = Trace(scheduler(peak, policy), [wide("A")])  # a budget that covers its peak: never binds
        assert t.reqs[0].max_width == full and t.reqs[0].steps == alone.reqs[0].steps
    t = Trace(scheduler(3, "critical_first"), [wide("A")])  # alone under a binding budget: it takes all of it
    for s in t.steps[1:]:  # (the first step admits it)
        assert s["tokens"] >= min(3, s["demand"]["A"])


def test_the_width_shrinks_under_load_and_grows_back_as_the_batch_drains():
    t = Trace(scheduler(4, "critical_first"), [wide("A"), plain("B", 6), plain("C", 6)])
    others_running = [s for s in t.steps[2:] if {"B", "C"} & set(s["before"])]
    alone = [s for s in t.steps if set(s["before"]) == {"A"}]
    assert others_running and alone
    for s in others_running:  # the budget left after the other main threads' tokens
        others = {"B", "C"} & set(s["before"])
        assert s["sampling"].get("A", 0) <= 4 - len(others)
    both = [s for s in others_running if {"B", "C"} <= set(s["before"])]
    assert both and max(s["sampling"].get("A", 0) for s in both) == 2  # with both others running
    assert all(rid in s["ran"] for s in others_running for rid in {"B", "C"} & set(s["before"]))
    assert max(s["sampling"].get("A", 0) for s in alone) == 4  # its full width again


def test_while_the_main_thread_waits_the_longest_promise_is_critical():
    """At the sync (the main thread waits) the child with the longest remaining promise is the
    critical thread and runs every step, while a budget of 3 is shared with another request."""
    t = Trace(scheduler(3, "critical_first"), [forky("A"), plain("B", 30)])
    at_sync = [s for s in t.steps if "A" in s["before"] and s["before"]["A"][1] not in (None, 0)]
    assert len(at_sync) >= 5
    assert at_sync[0]["before"]["A"][1] == 2  # the child promised 9 tokens (its siblings: 2 and 5)
    for s in at_sync:
        _, crit, _, _ = s["before"]["A"]
        assert crit in s["ran"]["A"] and 0 in s["ran"]["B"]
        assert sum(1 for tid in s["ran"]["A"] if tid != crit) <= 1  # the one token left after the two critical ones


# --------------------------------------------------------------------------- fcfs kept


def fcfs_rule(sched: Scheduler, ops: dict[str, set[int]]) -> list[tuple[str, int, int]]:
    """The policy before issue 33, written out: requests in running order, each one's demand in
    the interpreter's order (every flush, at most max_width sampling threads), each thread
    ``min(pending, budget left)`` tokens (all of them for a thread a fork or join needs), a
    request reached with no budget left runs nothing."""
    budget = sched.max_num_batched_tokens
    out = []
    for r in sched.running:
        if budget <= 0:
            continue
        width = r.interp.max_width
        for s in r.interp.runnable_threads():
            if s.sample:
                if width is not None and width <= 0:
                    continue
                width = None if width is None else width - 1
            n = len(s.tokens) if s.tid in ops.get(r.request_id, set()) else min(len(s.tokens), budget)
            if n > 0:
                out.append((r.request_id, s.tid, n))
                budget -= n
    return out


@pytest.mark.parametrize("budget", [1, 2, 4, 7])
def test_fcfs_picks_exactly_what_the_old_rule_picks(budget):
    sched = scheduler(budget, "fcfs", max_running=3)
    reqs = [forky("A"), wide("B"), plain("C", 7), replayed("D", [PX, PY, PZ, A, SYNC, A, EOS],
                                                               [[A] * 3 + [CLOSE]] * 3, width=2)]
    for r in reqs:
        sched.add(r)
    steps = 0
    while sched.has_unfinished():
        ops = {r.request_id: must_tids(r) for r in sched.running}
        batch = sched.schedule()
        # the demand is unchanged by scheduling (only the KV operations were taken)
        assert [(st.request_id, st.step.tid, len(st.step.tokens)) for st in batch.threads] == \
            fcfs_rule(sched, ops)
        forced = [st.step.forced for st in batch.sampling]
        sched.postprocess(batch, SampledTokens(forced, [0.0] * len(forced)))
        steps += 1
    assert steps > 10 and all(r.finish_reason == "stop" for r in reqs)


def test_fcfs_starves_a_main_thread_that_critical_first_serves():
    """Budget 4: under fcfs the forking request admitted first takes all four tokens (its main
    thread and three children) and the plain request's main thread waits; critical_first runs it
    every step."""
    def starved(policy: str) -> int:
        t = Trace(scheduler(4, policy), [wide("A"), plain("B", 12)])
        return sum(1 for s in t.steps[1:] if "B" in s["before"] and 0 not in s["ran"].get("B", {}))

    assert starved("fcfs") >= 3
    assert starved("critical_first") == 0


# --------------------------------------------------------------------------- settings


def test_the_policy_is_validated_and_critical_first_is_the_default():
    assert EngineConfig().thread_policy == "critical_first"
    assert EngineConfig(thread_policy="fcfs").thread_policy == "fcfs"
    for bad in ("lifo", "", None, 1):
        with pytest.raises(ParameterError, match="thread_policy") as e:
            EngineConfig(thread_policy=bad)
        assert e.value.param == "thread_policy" and e.value.value == bad
    with pytest.raises(ValueError, match="thread_policy='lifo'"):
        Scheduler(BlockManager(8, 4), thread_policy="lifo")
    assert Scheduler(BlockManager(8, 4)).thread_policy == "critical_first"


def test_the_thread_policy_flag_reaches_the_engine(tiny_llama, capsys):
    from pasta_engine.entrypoints.args import build_engine
    from pasta_engine.entrypoints.cli import build_parser

    parser = build_parser()
    assert parser.parse_args(["serve"]).thread_policy == "critical_first"
    assert parser.parse_args(["bench", "speedup", "--out", "x", "--thread-policy", "fcfs"]).thread_policy == "fcfs"
    with pytest.raises(SystemExit) as e:
        parser.parse_args(["serve", "--thread-policy", "lifo"])
    assert e.value.code == 2 and "--thread-policy" in capsys.readouterr().err
    args = parser.parse_args(["generate", "--model", str(tiny_llama), "--kv-cache-mb", "4", "--no-adapter",
                              "--max-num-batched-tokens", "8", "--thread-policy", "fcfs"])
    engine, settings = build_engine(args)
    assert engine.scheduler.thread_policy == engine.config.thread_policy == settings["thread_policy"] == "fcfs"


# --------------------------------------------------------------------------- outputs (a tiny model)

LONG = [5 + (7 * i) % 50 for i in range(13)]
TRACES = ['Tips: <promise topic="a" tokens="10"/><async>Sleep well.</async> <promise topic="b" tokens="10"/>'
          '<async>Walk.</async><sync/> Done.',
          'Two: <promise topic="c" tokens="4"/><async>First thing, done slowly and well.</async> '
          '<promise topic="d" tokens="12"/><async>Second.</async> End of it.']
GREEDY = SamplingParams(max_new_tokens=10, temperature=0.0, return_logprobs=True)


@pytest.fixture(scope="module")
def engine(tiny_llama):
    return Engine.from_pretrained(tiny_llama, kv_cache_bytes=8 * 2**20, page_size=4, max_running_requests=4,
                                  limits=Limits(max_threads=None), enable_prefix_caching=False)


def outputs(engine: Engine, budget: int | None, policy: str):
    engine.scheduler.max_num_batched_tokens, engine.scheduler.thread_policy = budget, policy
    try:
        gen = engine.generate([LONG, LONG[:5], LONG[3:9]], GREEDY, mode="sequential")
        rep = engine.replay([LONG, LONG[:4]], TRACES, mode="pasta")
    finally:
        engine.scheduler.max_num_batched_tokens, engine.scheduler.thread_policy = None, "critical_first"
    assert engine.stats()["kv_pages_free"] == engine.stats()["kv_pages_total"]
    return gen + rep


@pytest.mark.parametrize("budget", [2, 5])
def test_greedy_outputs_equal_the_unconstrained_run_under_both_policies(engine, budget):
    base = outputs(engine, None, "critical_first")
    assert [o.stats.forks for o in base[3:]] == [2, 2]
    for policy in ("critical_first", "fcfs"):
        got = outputs(engine, budget, policy)
        for a, b in zip(got, base):
            assert a.token_ids == b.token_ids and a.text == b.text
            assert a.logprobs == pytest.approx(b.logprobs, abs=1e-4)
            assert a.stats.forks == b.stats.forks
