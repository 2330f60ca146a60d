"""Scheduler: which threads of which requests run this step (no torch).

After nano-vllm's scheduler: :meth:`Scheduler.schedule` admits waiting requests, reads each
running request's demand (its interpreter's
:meth:`~pasta_engine.core.interpreter.Interpreter.runnable_threads`: threads and their
pending tokens), picks the threads and how many tokens each runs under the token budget
(``max_num_batched_tokens``), makes sure the KV pages they take are free (preempting the newest
request if not), allocates their KV slots, and returns a
:class:`~pasta_engine.core.batch.ScheduledBatch`: per thread, its tokens, logical positions,
KV slots and KV view. The model runner turns that into tensors and samples;
:meth:`Scheduler.postprocess` hands what ran and the sampled tokens back to the interpreters.
The interpreter's KV operations (fork, join, release) are applied when its next step is
scheduled. :mod:`pasta_engine.core.batch` is the contract; the scheduler uses the
interpreter only through its public demand and bound methods.

Token budget and chunked prefill: threads are taken in running order (requests in admission
order, in each its interpreter's order) and each runs ``min(pending, budget left)`` tokens, so
a prompt longer than the budget is prefilled in budget-sized pieces over several steps while
the requests admitted before it keep decoding; a piece that is not the prompt's end samples
nothing. A request reached with no budget left waits for the next step. The few tokens a fork
or join must write in the same step as its child or parent (the promise's last token, a
child's last token) run together even past the budget. With no budget (None) every pending
token runs, one step per sampled token.

Threads under load (``thread_policy``, issue 33): when the budget binds (the step's demand, all
running requests' threads together, exceeds it), ``"critical_first"`` (the default) serves the
critical path first. A request's critical thread is its main thread, or, while the main thread
waits at a sync (or has ended and waits for its children), the sampling child whose remaining
promised length (its promise's ``tokens`` less what it has sampled) is longest. Each step:

1. every running request gets one token for its critical thread, least recently served request
   first (ties: running order), together with the threads a pending fork or join needs (all
   their tokens, even past the budget, as above);
2. the critical threads take the rest of their pending tokens (a prefill's next piece, a
   child's inserted tag), in the same order;
3. extra threads (flushes, then the other sampling children, longest remaining promise first)
   fill what is left, one thread per request per round, round-robin across requests (least
   recently given an extra thread first).

A request alone gets its full width (up to the budget), a request's width shrinks as the batch
fills and grows back as it drains, and no request starves: the request served least recently
is served first and the budget is at least one token, so a running request with work waits at
most ``R - 1`` steps in a row (R: running requests, at most ``max_running_requests``), and with
a budget of at least one token per running request (plus the tokens of its pending fork or join)
every critical thread advances every step. ``"fcfs"`` keeps the policy before it: requests in
running order, each request's threads in the interpreter's order, each taking ``min(pending,
budget left)``. Without a budget, or when it does not bind, both run every thread the same way;
outputs never depend on the policy (it changes when a thread runs, not what it samples). The
per-request width (``Limits.max_threads``) is applied first in both, in the interpreter's order
(main thread, then children in fork order), as :func:`~pasta_engine.metrics.simulate_steps`
models it; in a decode step a thread forwards one token, so the budget is also the step's rows.

KV memory: before a step the scheduler checks that the free pages cover the worst case the
step can allocate; if not, it preempts the most recently admitted among the requests restarted
least often, and not the last victim while another could go (its pages are freed and it restarts
from its prompt later, with the same seed, so its output is unchanged). A
request that cannot get a page even alone ends with ``finish_reason="error"``; the others go
on. Every way a request ends (finish, abort, error, an exception escaping a step) releases
every page it held.

Prefix caching (when the block manager has it on): at admission the main thread's view starts
with the cached pages of the prompt's longest cached prefix of whole pages, and the interpreter
forwards only the rest (:meth:`~pasta_engine.core.interpreter.Interpreter.skip_cached_prompt`);
after the step that wrote a prompt's KV, its whole pages enter the cache. A page enters the
cache only once its KV is written (in :meth:`Scheduler.postprocess`, after the forward), so a
step that fails caches nothing.
"""

from __future__ import annotations

import math
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

from ..config import THREAD_POLICIES
from ..errors import KVCacheExhausted
from .batch import (KVFork, KVJoin, KVRelease, RandomStream, SampledTokens, SamplingRow, ScheduledBatch, ScheduledThread,
                    SeenTokens, ThreadStep, thread_seed)
from .block_manager import BlockManager, KVView
from .request import Request, RequestStatus

__all__ = ["Scheduler", "ScheduledThread", "ScheduledBatch", "SampledTokens"]  # the batch types: re-exported


@dataclass(slots=True)
class _RequestSampling:
    """What the scheduler keeps per running request to fill its sampling rows: per thread its
    random stream (made at its first sampling row), and the tokens it sees, counted (only when
    a penalty applies)."""

    seed: int | None
    penalised: bool
    rngs: dict[int, RandomStream] = field(default_factory=dict)
    seen: dict[int, SeenTokens] = field(default_factory=dict)
    uncounted: dict[int, tuple[int, int] | None] = field(default_factory=dict)  # Thread.uncounted when counted


class Scheduler:
    """Continuous batching of PASTA requests over one block manager.

    Args:
        block_manager: the KV cache's pages.
        max_running_requests: requests decoded together (>= 1).
        lookahead_steps: steps of growth (tokens per live thread) kept free for the running
            requests when admitting another.
        max_num_batched_tokens: the token budget, tokens forwarded in one step (>= 1; None:
            no limit, every pending token runs).
        thread_policy: which threads run when the budget binds: ``"critical_first"`` (every
            running request's critical thread first, extra threads round-robin across requests)
            or ``"fcfs"`` (requests in admission order); see the module's docstring.

    Raises ValueError for a budget below 1 or an unknown thread policy."""

    def __init__(self, block_manager: BlockManager, max_running_requests: int = 8, lookahead_steps: int = 8,
                 max_num_batched_tokens: int | None = None, thread_policy: str = "critical_first"):
        if max_num_batched_tokens is not None and max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens={max_num_batched_tokens!r}: at least 1 token per step, "
                             f"or None for no limit")
        if thread_policy not in THREAD_POLICIES:
            raise ValueError(f"thread_policy={thread_policy!r}: expected one of {', '.join(THREAD_POLICIES)}")
        self.block_manager = block_manager
        self.max_running = max_running_requests
        self.max_num_batched_tokens = max_num_batched_tokens
        self.thread_policy = thread_policy
        # critical_first's fairness (see _stamp): request id -> the step at which its critical
        # thread last ran (the step before its first one, when it has not run yet), and the same
        # for its extra threads
        self._served: dict[str, int] = {}
        self._served_extra: dict[str, int] = {}
        self._stamps: tuple[list[str], list[str]] = ([], [])  # the last plan's (served, given an extra)
        self.lookahead_steps = lookahead_steps
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.ended: list[Request] = []  # ended outside postprocess (abort, error) since take_ended()
        self.total_steps = 0
        self.preemptions = 0
        self._last_victim: Request | None = None
        self._sampling: dict[str, _RequestSampling] = {}  # request id -> its sampling state (running requests)

    # ------------------------------------------------------------------ requests

    def check_fits(self, req: Request) -> tuple[str, int, str] | None:
        """Why ``req`` could never run in this KV cache, as ``(parameter, its value, why)``
        (None when it could): its prompt alone needs more pages than the cache has
        (``prompt``); it is a replay (its tokens are known, and a request keeps every page it
        wrote until it ends) whose KV tokens fill the cache's pages and more (``prompt``); or, in
        sequential mode, it must sample more tokens than the cache holds after its prompt:
        ``ignore_eos`` without a stop token or string runs to ``max_new_tokens``
        (``max_new_tokens``), and no request ends before ``min_tokens`` unless a stop string ends
        it (``min_tokens``), either up to the context length. (In pasta and inline modes forks
        reserve positions and tags are inserted, so the context length may end a request first:
        no floor is known, and one that runs out of pages fails alone then.) The failure
        model: it fails before it takes any resource, rather than decoding until the cache runs
        out. A replay's bound counts the trace's tokens as
        :meth:`~pasta_engine.core.interpreter.Interpreter.worst_case_kv` does, a little above
        what is written (the end-of-sequence token, each fork's tag), so the check allows two
        pages per fork and two more: a replay near the cache's size runs, and fails alone if it
        does not fit after all. A sampled request's floor is exact (every sampled token but the
        last is written; forks only add pages)."""
        bm = self.block_manager
        n = len(req.interp.prompt_ids)
        pages = math.ceil(n / bm.page_size)  # the prefill's; the first token needs no more
        if pages > bm.num_pages:
            return ("prompt", n, f"the prompt's {n} tokens need {pages} KV pages but the cache has {bm.describe()}; "
                    f"raise kv_cache_bytes or shorten the prompt")
        if req.interp.replay:
            tokens, forks = req.interp.worst_case_kv()
            least = math.ceil(tokens / bm.page_size)
            if least > bm.num_pages + 2 * forks + 2:
                return ("prompt", n, f"the replay's {tokens} KV tokens ({forks} forks) need about {least} KV pages but "
                        f"the cache has {bm.describe()}; raise kv_cache_bytes or replay a shorter response")
            return None
        prm = req.params
        it = req.interp
        if prm.stop or it.mode != "sequential":  # a stop string may end it at any token; so may the context
            # length in pasta and inline modes, where forks reserve positions and tags are inserted
            return None
        floor, param = prm.min_tokens, "min_tokens"
        if prm.ignore_eos and not prm.stop_token_ids and prm.max_new_tokens > floor:
            floor, param = prm.max_new_tokens, "max_new_tokens"
        if it.max_positions is not None:  # it ends at the context length: no token at a position past it
            floor = min(floor, it.max_positions - n)
        least = math.ceil((n + floor - 1) / bm.page_size) if floor > 0 else 0
        if least > bm.num_pages:
            why = "ignore_eos runs it to max_new_tokens" if param == "max_new_tokens" else "it samples at least min_tokens"
            return (param, floor, f"{param}={floor}: {why}, and with the prompt's {n} tokens that needs {least} KV "
                    f"pages but the cache has {bm.describe()}; raise kv_cache_bytes or lower {param}")
        return None

    def add(self, req: Request) -> None:
        """Queue a request (it takes no resource until admitted)."""
        req.status = RequestStatus.WAITING
        self.waiting.append(req)

    def has_unfinished(self) -> bool:
        """Whether a request is waiting or running."""
        return bool(self.waiting or self.running)

    def take_ended(self, request_ids: set[str] | None = None) -> list[Request]:
        """Requests that ended by abort or error outside a step's postprocess, since the last
        call; with ``request_ids``, only those (the others stay for the next call)."""
        if request_ids is None:
            out, self.ended = self.ended, []
            return out
        out = [r for r in self.ended if r.request_id in request_ids]
        self.ended = [r for r in self.ended if r.request_id not in request_ids]
        return out

    def get(self, request_id: str) -> Request | None:
        """The waiting or running request with that id (None when there is none)."""
        return self._find(request_id)

    def abort(self, request_id: str) -> Request | None:
        """End the request now with ``finish_reason="abort"``, freeing every page it holds.
        Returns it, or None when no unfinished request has that id."""
        req = self._find(request_id)
        if req is None:
            return None
        self._end(req, "abort")
        self.ended.append(req)
        return req

    def fail(self, req: Request, message: str) -> None:
        """End ``req`` with ``finish_reason="error"`` and ``message``, freeing its pages."""
        self._end(req, "error", message)
        self.ended.append(req)

    def fail_running(self, message: str) -> list[Request]:
        """End every running request with an error (after an exception escaped a step, so
        none of their pages is left behind). Waiting requests hold no page and stay queued."""
        failed = list(self.running)
        for req in failed:
            self.fail(req, message)
        return failed

    def _find(self, request_id: str) -> Request | None:
        for req in self.running:
            if req.request_id == request_id:
                return req
        for req in self.waiting:
            if req.request_id == request_id:
                return req
        return None

    def _free(self, req: Request) -> None:
        """Release every KV view ``req`` still holds (whatever its interpreter says)."""
        for view in req.views.values():
            self.block_manager.release(view)
        req.views.clear()

    def _end(self, req: Request, reason: str, error: str | None = None) -> None:
        """Free ``req``'s pages and take it out of the queues, then end its interpreter: the
        bookkeeping first, so an interpreter (or a request's own dialect) that raises while it
        is cancelled cannot leave the request running with its pages; its exception goes into
        the request's error."""
        self._free(req)
        self._sampling.pop(req.request_id, None)
        if req in self.running:
            self.running.remove(req)
            req.wall_s = time.perf_counter() - req.start_s
        elif req in self.waiting:
            self.waiting.remove(req)
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason
        req.error = error
        if not req.interp.done:
            try:
                req.interp.cancel(reason)
                req.interp.take_kv_ops()  # the pages are freed above
            except Exception as e:  # noqa: BLE001 - pinned on this request, never on the step
                req.error = (f"{error}; " if error else "") + f"ending the request's interpreter raised {e!r}"

    # ------------------------------------------------------------------ admission, preemption

    def _growth(self, threads: int) -> int:
        """Pages ``threads`` live threads can take over the next ``lookahead_steps`` steps."""
        return threads * (math.ceil(self.lookahead_steps / self.block_manager.page_size) + 1)

    @staticmethod
    def _pages_held(req: Request) -> int:
        return len({p for view in req.views.values() for p in view.pages})

    def _worst_pages(self, req: Request) -> int:
        """Pages ``req`` can hold at most over its whole life: the KV tokens its interpreter can
        write (:meth:`~pasta_engine.core.interpreter.Interpreter.worst_case_kv`) and two
        partly filled pages per fork (the parent's page sealed at the fork, the child's last
        page)."""
        tokens, forks = req.interp.worst_case_kv()
        return math.ceil(tokens / self.block_manager.page_size) + 2 * forks + 1

    def _reserve(self, req: Request) -> int:
        """Free pages a running request may still claim: a request that was preempted before
        keeps its whole worst case reserved (it must not be preempted twice); others, the
        growth of their live threads over the next steps."""
        if req.preemptions:
            return max(0, self._worst_pages(req) - self._pages_held(req))
        return self._growth(req.interp.live_threads)

    def _admit(self) -> None:
        """Admit waiting requests in arrival order while each one's worst-case growth fits:
        its prompt's pages and its own next steps' growth (for a request restarted after a
        preemption, its whole worst case), on top of what every running request may still
        claim. A request that does not fit waits (waiting is preferred to preempting), and so
        does every later one (no overtaking)."""
        bm = self.block_manager
        while self.waiting and len(self.running) < self.max_running:
            req = self.waiting[0]
            if req.preemptions:
                need = self._worst_pages(req)
            else:
                need = math.ceil(len(req.interp.prompt_ids) / bm.page_size) + self._growth(1)
            reserved = sum(self._reserve(r) for r in self.running)
            if self.running and need + reserved > bm.num_free:
                return
            self.waiting.popleft()
            req.status = RequestStatus.RUNNING
            req.start_s = time.perf_counter()
            self.running.append(req)
            self._reuse_prefix(req)

    def _reuse_prefix(self, req: Request) -> None:
        """Start the main thread's view of a request being admitted with the prompt's cached
        prefix pages (none with prefix caching off), before its prompt's prefill."""
        it = req.interp
        view = req.views[it.main.tid] = KVView()  # in the request's views first: freed whatever happens next
        n = self.block_manager.reuse_prefix(view, it.prompt_ids)
        if n:
            it.skip_cached_prompt(n)
        req.cached_tokens = n

    def _preempt(self, req: Request) -> None:
        """Free every page of ``req`` and queue it to restart from its prompt (first in line;
        it is admitted again once its whole worst case fits).

        The request's restart (:meth:`Request.reset`: keeping what it has written, a fresh
        interpreter) is prepared before anything here changes. When that raises, the request
        fails alone instead (``finish_reason="error"``, its pages freed, its final output in
        :meth:`take_ended`): an ``Exception`` is its own and goes no further; anything else
        (a KeyboardInterrupt) is raised again once the request has ended."""
        try:
            req.reset()
        except BaseException as e:
            self.fail(req, f"preempting request {req.request_id} to free KV pages failed: keeping what it had "
                           f"written for its restart raised {type(e).__name__}: {e}")
            if not isinstance(e, Exception):
                raise
            return
        self._free(req)
        self._sampling.pop(req.request_id, None)  # it restarts from its prompt: a new stream, seen tokens recounted
        self.running.remove(req)
        req.preemptions += 1
        self.preemptions += 1
        self._last_victim = req
        req.status = RequestStatus.WAITING
        self.waiting.appendleft(req)

    def _victim(self, work: list[tuple[Request, list[tuple[ThreadStep, int]], int]]) -> int:
        """Index in ``work`` of the request to preempt: the newest among those restarted least
        often, never the last victim while another could go instead (a restarted request runs
        with its worst case reserved, so it is not thrashed)."""
        order = sorted(range(len(work)), key=lambda i: (work[i][0].preemptions, -i))
        for i in order:
            if work[i][0] is not self._last_victim:
                return i
        return order[0]

    # ------------------------------------------------------------------ picking and allocating

    def _pick(self, req: Request, budget: float) -> list[tuple[ThreadStep, int]]:
        """The threads of ``req`` that run this step and how many of their pending tokens
        (each ``> 0``), from its interpreter's demand: every flush and at most ``max_width``
        sampling threads, each taking ``min(pending, budget left)`` tokens; a thread a pending
        fork or join needs in this step (the fork's parent, the join's children) takes all its
        pending tokens whatever the budget (the ``"fcfs"`` rule, for one request)."""
        cands, need_all = self._candidates(req)
        picks: list[tuple[ThreadStep, int]] = []
        for s in cands:
            n = len(s.tokens) if s.tid in need_all else min(len(s.tokens), budget)
            if n > 0:
                picks.append((s, int(n)))
                budget -= n
        return picks

    def _plan(self) -> list[tuple[Request, list[tuple[ThreadStep, int]], int]]:
        """Per running request: its picks this step (none when it has no work or the token
        budget was spent before its turn) and the new KV pages they take, under the thread
        policy (``"fcfs"``: requests served in running order; ``"critical_first"``:
        :meth:`_plan_critical_first`). Changes nothing."""
        if self.thread_policy == "critical_first" and self.max_num_batched_tokens is not None:
            picks = self._plan_critical_first(self.max_num_batched_tokens)
        else:
            self._stamps = ([], [])
            budget: float = math.inf if self.max_num_batched_tokens is None else self.max_num_batched_tokens
            picks = []
            for req in self.running:
                p = self._pick(req, budget) if budget > 0 else []
                budget -= sum(n for _, n in p)
                picks.append(p)
        bm = self.block_manager
        work = []
        empty = KVView()
        for req, p in zip(self.running, picks):
            views = req.views
            pages = sum(bm.pages_needed(views.get(s.tid, empty), n) for s, n in p)
            work.append((req, p, pages))
        return work

    # ------------------------------------------------------------------ critical_first

    def _candidates(self, req: Request) -> tuple[list[ThreadStep], set[int]]:
        """What ``req`` may run this step whatever the budget: its interpreter's demand with
        the width applied (every flush, at most ``max_width`` sampling threads, in the demand's
        order), and the ids of the threads a pending fork or join needs in this step."""
        it = req.interp
        need_all: set[int] = set()
        for op in it.peek_kv_ops():
            if type(op) is KVFork:
                need_all.add(op.parent)
            elif type(op) is KVJoin:
                need_all.update(op.children)
        width = it.max_width
        out: list[ThreadStep] = []
        for s in it.runnable_threads():
            if s.sample:
                if width is not None and width <= 0:
                    continue
                width = None if width is None else width - 1
            if s.tokens:
                out.append(s)
        return out, need_all

    @staticmethod
    def remaining_promised(req: Request, tid: int) -> int:
        """Tokens thread ``tid`` of ``req`` has still to sample by its promise: the promise's
        predicted length (``tokens``; without one, the thread's cap) less the tokens it has
        sampled, at least 0. The main thread has no promise: 0."""
        t = req.interp.threads[tid]
        promised = getattr(getattr(t, "promise", None), "tokens", None)
        if promised is None:
            promised = getattr(t, "cap", None) or 0
        return max(0, int(promised) - t.n_sampled)

    def _critical(self, req: Request, cands: list[ThreadStep]) -> ThreadStep | None:
        """The critical thread among ``cands`` (the request's candidates): its main thread when
        it samples; else (the main thread waits at a sync, or has ended and waits for its
        children) the sampling thread whose remaining promised length is longest (ties: the one
        forked first); a request with only flushes, its first flush; None without candidates."""
        main = req.interp.main.tid
        sampling = [s for s in cands if s.sample]
        for s in sampling:
            if s.tid == main:
                return s
        if sampling:
            rem = self.remaining_promised
            return max(sampling, key=lambda s: (rem(req, s.tid), -s.tid))
        return cands[0] if cands else None

    def _plan_critical_first(self, budget: int) -> list[list[tuple[ThreadStep, int]]]:
        """Per running request (running order), its picks under ``budget`` tokens: everything
        its candidates hold when that fits (the same picks as ``fcfs``), else the three phases
        of the module's docstring (critical threads' first tokens with the threads a fork or
        join needs, the critical threads' remaining tokens, extra threads round-robin). Each
        request's picks keep its interpreter's order. Records which requests were served (for
        :meth:`schedule` to stamp once the plan is final)."""
        now = self.total_steps
        reqs = self.running
        cands = [self._candidates(r) for r in reqs]
        counts: list[dict[int, int]] = [{} for _ in reqs]
        served: list[int] = []
        extra: set[int] = set()
        if sum(len(s.tokens) for c, _ in cands for s in c) <= budget:  # the budget does not bind
            for i, (c, _) in enumerate(cands):
                counts[i] = {s.tid: len(s.tokens) for s in c}
                if c:
                    served.append(i)
                    if len(c) > 1:
                        extra.add(i)
        else:
            crit = [self._critical(r, c) for r, (c, _) in zip(reqs, cands)]
            ids = [r.request_id for r in reqs]
            order = sorted((i for i in range(len(reqs)) if crit[i] is not None),
                           key=lambda i: (self._served.get(ids[i], now - 1), i))
            left = budget
            for i in order:  # 1: one token of each critical thread, with what a fork or join needs
                if left <= 0:
                    break
                c, need_all = cands[i]
                for s in c:
                    if s.tid in need_all:
                        counts[i][s.tid] = len(s.tokens)
                        left -= len(s.tokens)
                if crit[i].tid not in counts[i]:
                    counts[i][crit[i].tid] = 1
                    left -= 1
                served.append(i)
            for i in served:  # 2: the rest of the critical threads' tokens
                if left <= 0:
                    break
                s = crit[i]
                n = min(len(s.tokens) - counts[i][s.tid], left)
                if n > 0:
                    counts[i][s.tid] += n
                    left -= n
            queues: dict[int, deque[ThreadStep]] = {}
            for i in served:  # 3: extra threads, round-robin across requests
                rest = [s for s in cands[i][0] if s.tid not in counts[i]]
                flushes = [s for s in rest if not s.sample]
                children = sorted((s for s in rest if s.sample),
                                  key=lambda s: -self.remaining_promised(reqs[i], s.tid))  # stable: fork order
                if flushes or children:
                    queues[i] = deque(flushes + children)
            rr = sorted(queues, key=lambda i: (self._served_extra.get(ids[i], now - 1), i))
            while left > 0 and rr:
                for i in rr:
                    if left <= 0:
                        break
                    s = queues[i].popleft()
                    n = min(len(s.tokens), left)
                    counts[i][s.tid] = n
                    left -= n
                    extra.add(i)
                rr = [i for i in rr if queues[i]]
        self._stamps = ([reqs[i].request_id for i in served], [reqs[i].request_id for i in extra])
        return [[(s, counts[i][s.tid]) for s in c if counts[i].get(s.tid)] for i, (c, _) in enumerate(cands)]

    def _stamp(self) -> None:
        """Record this step's service (the final plan's): a request whose critical thread ran
        moves behind those that waited; the same for extra threads. A request seen for the first
        time counts as served the step before (behind every request that waited longer, ahead of
        none served now), which is what bounds a wait by the requests ahead of it. Requests no
        longer running are forgotten (one admitted again starts as new)."""
        now = self.total_steps
        running = {r.request_id for r in self.running}
        served, extra = self._stamps
        self._served = {rid: s for rid, s in self._served.items() if rid in running}
        self._served_extra = {rid: s for rid, s in self._served_extra.items() if rid in running}
        for rid in running:
            self._served.setdefault(rid, now - 1)
            self._served_extra.setdefault(rid, now - 1)
        for rid in served:
            if rid in running:
                self._served[rid] = now
        for rid in extra:
            if rid in running:
                self._served_extra[rid] = now
        self._stamps = ([], [])

    def _allocate(self, req: Request, picks: list[tuple[ThreadStep, int]], out: list[ScheduledThread]) -> None:
        """Apply the interpreter's KV operations and allocate the KV slots of ``picks``, in the
        order the views need: a fork's parent gets its slots before the fork (the child sees
        them), a join's children before the join. Appends one ScheduledThread per pick to
        ``out``. Raises KVCacheExhausted when an append finds no page (the caller fails the
        request; every page allocated so far is in one of its views)."""
        bm = self.block_manager
        views = req.views
        count = {s.tid: n for s, n in picks}
        slots: dict[int, list[int]] = {}

        def allocate(tid: int) -> None:
            if tid in slots:
                return
            n = count.get(tid)
            if n is None:
                raise RuntimeError(f"request {req.request_id}: thread {tid} must run with a fork or join but was "
                                   f"not picked")
            view = views.get(tid)
            if view is None:
                view = views[tid] = KVView()
            slots[tid] = bm.append(view, n)

        for op in req.interp.take_kv_ops():
            if type(op) is KVFork:
                allocate(op.parent)
                views[op.child] = bm.fork(views[op.parent])
            elif type(op) is KVJoin:
                for c in op.children:
                    if c in count:
                        allocate(c)
                bm.join(views[op.parent], [views[c] for c in op.children])
            elif type(op) is KVRelease:
                view = views.pop(op.tid, None)
                if view is not None:
                    bm.release(view)
        runs = BlockManager.runs
        it = req.interp
        threads = it.threads
        rid = req.request_id
        state = self._sampling.get(rid)
        if state is None:
            prm = req.params
            state = self._sampling[rid] = _RequestSampling(prm.seed, prm.repetition_penalty != 1.0 or prm.penalised)
        ends: tuple[int, ...] | None = None
        for s, n in picks:
            allocate(s.tid)
            if s.sample and not threads[s.tid].n_sampled:  # the prompt or a child's inserted tag, in pieces or not
                req.prefill_tokens += n
            step = s.first(n)
            seen = None
            if state.penalised:
                seen = state.seen.get(s.tid)
                uncounted = threads[s.tid].uncounted
                if seen is not None and state.uncounted[s.tid] == uncounted:  # counted: add what it forwards now
                    seen.add(step.tokens)
                elif step.sample or seen is not None:  # counted from its tokens (this step's included), then kept;
                    # again when an inline chunk opens or closes (its promise leaves the count, then returns)
                    seen = state.seen[s.tid] = SeenTokens.recount(it.seen_tokens(s.tid), len(it.prompt_ids))
                    state.uncounted[s.tid] = uncounted
            row = None
            if step.sample:
                if ends is None:
                    ends = _masked_ends(req)
                rng = state.rngs.get(s.tid)
                if rng is None:
                    rng = state.rngs[s.tid] = RandomStream(thread_seed(state.seed, s.tid))
                row = SamplingRow(rid, s.tid, req.params, step.forced, step.grammar, seen, ends,
                                  it.limits.fork_threshold, rng)
            out.append(ScheduledThread(rid, step, slots[s.tid], runs(views[s.tid]), row))

    # ------------------------------------------------------------------ stepping

    def schedule(self) -> ScheduledBatch:
        """Admit, pick the threads and token counts of this step under the token budget, check
        the pages they take (preempting or failing requests that cannot get them), allocate
        their KV slots, and return the batch (empty when no thread has work)."""
        self._admit()
        bm = self.block_manager
        while True:
            work = self._plan()
            need = sum(pages for _, _, pages in work)
            if need <= bm.num_free:
                break
            if len(work) == 1:
                req = work[0][0]
                self.fail(req, f"KV cache exhausted: request {req.request_id} needs up to {need} more pages but only "
                               f"{bm.num_free} of {bm.describe()} are free; raise kv_cache_bytes or lower "
                               f"max_new_tokens / max_threads")
                return ScheduledBatch()
            self._preempt(work[self._victim(work)][0])
        if self.thread_policy == "critical_first" and self.max_num_batched_tokens is not None:
            self._stamp()  # fairness state only this policy under a budget reads (no per-step work otherwise)
        batch = ScheduledBatch()
        for req, picks, _ in work:
            if not picks:
                continue
            try:
                self._allocate(req, picks, batch.threads)
            except KVCacheExhausted as e:
                batch.threads = [t for t in batch.threads if t.request_id != req.request_id]
                self.fail(req, str(e))
        return batch

    def postprocess(self, batch: ScheduledBatch,
                    sampled: SampledTokens | None) -> list[tuple[Request, list[tuple[int, int]]]]:
        """Tell the interpreters what ran, hand them the sampled tokens, and end the requests
        that finished (their KV operations are applied when they are next scheduled).

        Returns ``(request, [(thread id, token id), ...])`` for every request that ran this
        step, in batch order, with the tokens its interpreter took (a token sampled after the
        request ended within the step, e.g. at ``max_new_tokens``, is not taken; a request that
        failed here comes back too, finished with an error)."""
        self.total_steps += 1
        running = {r.request_id: r for r in self.running}
        by_req: dict[str, tuple[Request | None, list[ScheduledThread]]] = {}
        for st in batch.threads:
            entry = by_req.get(st.request_id)
            if entry is None:
                entry = by_req[st.request_id] = (running.get(st.request_id), [])
            entry[1].append(st)
        # first what needs no sampled token (the device may still be running the step)
        bm = self.block_manager
        for req, threads in by_req.values():
            if req is None or req.finished:
                continue
            steps = [st.step for st in threads]
            it = req.interp
            main, n_prompt = it.main.tid, len(it.prompt_ids)
            for s in steps:
                if s.tid == main and s.positions and s.positions[0] < n_prompt and bm.prefix_caching:
                    # the step wrote (the rest of) the prompt's KV: its whole pages enter the cache
                    bm.cache_prefix(req.views[main], it.prompt_ids, min(n_prompt, s.positions[-1] + 1))
            it.step_done(steps)
        out: list[tuple[Request, list[tuple[int, int]]]] = []
        try:
            self._take_sampled(by_req, sampled, out)
        except BaseException:
            # a request that ended in this step before the exception is no longer running, so
            # fail_running will not see it: its final output comes from take_ended instead
            self.ended.extend(r for r, _ in out if r.finished and r not in self.ended)
            # the tokens taken so far are the requests' own: their next output streams them
            # (nothing the model wrote is lost from the deltas)
            for r, taken in out:
                if r.renderer is not None and taken:
                    r.renderer.hold(r.interp, taken)
            raise
        return out

    def _take_sampled(self, by_req: dict[str, tuple[Request | None, list[ScheduledThread]]],
                      sampled: SampledTokens | None, out: list[tuple[Request, list[tuple[int, int]]]]) -> None:
        """Hand each request of ``by_req`` its sampled tokens, ending those that finished;
        append ``(request, taken tokens)`` to ``out`` as each starts (its list fills as it takes
        them, so an exception midway finds what each request has taken)."""
        at = 0
        if sampled is not None:
            errors, all_toks, all_lps = sampled.errors, sampled.token_ids, sampled.logprobs  # waits for the tokens
        else:
            errors, all_toks, all_lps = {}, [], []
        for req, threads in by_req.values():
            sampling = [st.step for st in threads if st.step.sample]
            n_sample = len(sampling)
            toks = all_toks[at : at + n_sample]
            lps = all_lps[at : at + n_sample]
            at += n_sample
            if req is None or req.finished:
                continue
            if req.request_id in errors:
                self.fail(req, errors[req.request_id])
                self.ended.remove(req)
                out.append((req, []))
                continue
            it = req.interp
            taken: list[tuple[int, int]] = []
            out.append((req, taken))
            if sampling:
                req.steps += 1
                on_token = it.on_token
                keep_lps = req.params.return_logprobs
                try:
                    for s, tok, lp in zip(sampling, toks, lps if keep_lps else toks):
                        before = it.total_sampled
                        on_token(s.tid, tok, lp if keep_lps else None)
                        if it.total_sampled != before:
                            taken.append((s.tid, tok))
                except Exception as e:  # noqa: BLE001 - e.g. a request's own dialect: it fails alone
                    self.fail(req, f"handling a sampled token raised {e!r}")
                    self.ended.remove(req)
                    continue
                # the threads whose tokens were kept (at the token budget the last step's other
                # samples are cut: a promised chunk that never ran is no width)
                req.max_width = max(req.max_width, len(taken))
            if it.done:
                self._end(req, it.finish)


def _masked_ends(req: Request) -> tuple[int, ...]:
    """The end tokens ``req``'s threads may not sample in this step: the end-of-sequence and
    stop tokens while it has sampled fewer than ``min_tokens`` (all threads together), and the
    end-of-sequence tokens that are not stop tokens under ``ignore_eos``; sorted (the sampler
    leaves out ids past the vocabulary)."""
    prm = req.params
    if not prm.ignore_eos and not prm.min_tokens:
        return ()
    it = req.interp
    if prm.min_tokens and it.total_sampled < prm.min_tokens:
        return tuple(sorted(set(it.eos_ids) | set(prm.stop_token_ids)))
    if prm.ignore_eos:
        return tuple(sorted(set(it.eos_ids) - set(prm.stop_token_ids)))
    return ()
