"""Scheduler: which threads of which requests run this step (no torch).

After nano-vllm's scheduler: :meth:`Scheduler.schedule` admits waiting requests, asks each
running request's :class:`~pasta_engine.engine.interpreter.Interpreter` for its thread steps,
makes sure the KV pages they can take are free (preempting the newest request if not), and
returns a :class:`ScheduledBatch`: per thread, its tokens, logical positions, KV slots and KV
view. The model runner turns that into tensors and samples; :meth:`Scheduler.postprocess` hands
the tokens back to the interpreters and applies their KV operations (append, fork, join,
release) to the :class:`~pasta_engine.engine.block_manager.BlockManager`.

KV memory: before a step the scheduler checks that the free pages cover the worst case the
step can allocate; if not, it preempts the most recently admitted request (its pages are freed
and it restarts from its prompt later, with the same seed, so its output is unchanged). A
request that cannot get a page even alone ends with ``finish_reason="error"``; the others go
on. Every way a request ends (finish, abort, error, an exception escaping a step) releases
every page it held.

Prefix caching (when the block manager has it on): at admission the main thread's view starts
with the cached pages of the prompt's longest cached prefix of whole pages, and the interpreter
forwards only the rest (:meth:`~pasta_engine.engine.interpreter.Interpreter.skip_cached_prompt`);
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

from ..errors import KVCacheExhausted
from .block_manager import BlockManager, KVView, Run
from .interpreter import KVAppend, KVFork, KVJoin, KVRelease, ThreadStep
from .request import Request, RequestStatus

__all__ = ["Scheduler", "ScheduledThread", "ScheduledBatch", "SampledTokens"]


@dataclass(slots=True)
class ScheduledThread:
    """One thread's work this step: its interpreter step, the KV slots its tokens are written
    to, and its KV view as attention metadata runs (the view ends with those slots)."""

    request: Request
    step: ThreadStep
    slots: list[int]
    runs: list[Run]


@dataclass
class ScheduledBatch:
    """Every thread that runs this step, grouped by request in running order."""

    threads: list[ScheduledThread] = field(default_factory=list)

    @property
    def sampling(self) -> list[ScheduledThread]:
        """The threads that sample a token after their forward, in batch order."""
        return [t for t in self.threads if t.step.sample]

    def __bool__(self) -> bool:
        return bool(self.threads)


class SampledTokens:
    """What the model runner picked: ``token_ids[i]`` and ``logprobs[i]`` for the i-th sampling
    thread of the batch (logprobs are 0.0 when the request did not ask for them), and
    ``errors``: request id -> message for requests whose sampling failed (their entries are
    placeholders).

    The values may still be on their way from the device: ``wait`` (when given) is called once,
    on the first read of any field, and returns ``(token_ids, logprobs, errors)``; that read is
    the step's one host-device sync, so readers do the work that needs no token first."""

    def __init__(self, token_ids: list[int] | None = None, logprobs: list[float] | None = None,
                 errors: dict[str, str] | None = None, wait: Callable[[], tuple] | None = None):
        self._values = None if wait is not None else (token_ids or [], logprobs or [], errors or {})
        self._wait = wait

    def _get(self) -> tuple[list[int], list[float], dict[str, str]]:
        if self._values is None:
            self._values = self._wait()
            self._wait = None
        return self._values

    @property
    def token_ids(self) -> list[int]:
        return self._get()[0]

    @property
    def logprobs(self) -> list[float]:
        return self._get()[1]

    @property
    def errors(self) -> dict[str, str]:
        return self._get()[2]


class Scheduler:
    """Continuous batching of PASTA requests over one block manager.

    Args:
        block_manager: the KV cache's pages.
        max_running_requests: requests decoded together (>= 1)."""

    def __init__(self, block_manager: BlockManager, max_running_requests: int = 8, lookahead_steps: int = 8):
        self.block_manager = block_manager
        self.max_running = max_running_requests
        self.lookahead_steps = lookahead_steps
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.ended: list[Request] = []  # ended outside postprocess (abort, error) since take_ended()
        self.total_steps = 0
        self.preemptions = 0
        self._last_victim: Request | None = None

    # ------------------------------------------------------------------ requests

    def check_fits(self, req: Request) -> str | None:
        """Why ``req`` could never run in this KV cache (None when it could): its prompt alone
        needs more pages than the cache has."""
        bm = self.block_manager
        n = len(req.interp.prompt_ids)
        pages = math.ceil(n / bm.page_size) + 1
        if pages > bm.num_pages:
            return (f"the prompt's {n} tokens need {pages} KV pages but the cache has {bm.describe()}; "
                    f"raise kv_cache_bytes or shorten the prompt")
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
        req.pending_slots.clear()

    def _end(self, req: Request, reason: str, error: str | None = None) -> None:
        self._free(req)
        if not req.interp.done:
            req.interp.cancel(reason)
            req.interp.take_kv_ops()  # the pages are freed above
        if req in self.running:
            self.running.remove(req)
            req.wall_s = time.perf_counter() - req.start_s
        elif req in self.waiting:
            self.waiting.remove(req)
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason
        req.error = error

    # ------------------------------------------------------------------ admission, preemption

    def _growth(self, threads: int) -> int:
        """Pages ``threads`` live threads can take over the next ``lookahead_steps`` steps."""
        return threads * (math.ceil(self.lookahead_steps / self.block_manager.page_size) + 1)

    @staticmethod
    def _pages_held(req: Request) -> int:
        return len({p for view in req.views.values() for p in view.pages})

    def _worst_pages(self, req: Request) -> int:
        """Pages ``req`` can hold at most over its whole life: its prompt, every token it may
        sample, the ``<async>`` tags of its forks, and two partly filled pages per fork (the
        parent's page sealed at the fork, the child's last page)."""
        it = req.interp
        forks = len(it._forced_chunks) if it.replay else min(it.limits.max_forks, it.max_new_tokens)
        forks = forks if it.mode == "pasta" else 0
        tokens = len(it.prompt_ids) + it.max_new_tokens + forks * len(it.open_ids)
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
            try:
                self._reuse_prefix(req)
                self._apply_kv_ops(req)
            except KVCacheExhausted as e:
                self.fail(req, str(e))

    def _reuse_prefix(self, req: Request) -> None:
        """Start the main thread's view of a request being admitted with the prompt's cached
        prefix pages (none with prefix caching off), before its prompt's KV append."""
        it = req.interp
        view = req.views[it.main.tid] = KVView()  # in the request's views first: freed whatever happens next
        n = self.block_manager.reuse_prefix(view, it.prompt_ids)
        if n:
            it.skip_cached_prompt(n)
        req.cached_tokens = n

    def _preempt(self, req: Request) -> None:
        """Free every page of ``req`` and queue it to restart from its prompt (first in line;
        it is admitted again once its whole worst case fits)."""
        self._free(req)
        self.running.remove(req)
        req.preemptions += 1
        self.preemptions += 1
        self._last_victim = req
        req.reset()
        req.status = RequestStatus.WAITING
        self.waiting.appendleft(req)

    def _victim(self, work: list[tuple[Request, list[ThreadStep]]]) -> int:
        """Index in ``work`` of the request to preempt: the newest among those restarted least
        often, never the last victim while another could go instead (a restarted request runs
        with its worst case reserved, so it is not thrashed)."""
        order = sorted(range(len(work)), key=lambda i: (work[i][0].preemptions, -i))
        for i in order:
            if work[i][0] is not self._last_victim:
                return i
        return order[0]

    def _pages_bound(self, req: Request, steps: list[ThreadStep]) -> int:
        """Pages the postprocess of a step can take for ``req`` at most: per sampled token, the
        page its slot needs (none while the thread's last page has room), plus, on the main
        thread while a fork is still possible, a forked child's inserted tag (two promises per
        token at most). A replay forks only for the chunks its trace still holds, so once they
        are forked its bound is exact and a replay that fits the cache is never refused."""
        it = req.interp
        bm = self.block_manager
        forks_left = 0
        if it.mode == "pasta":
            forks_left = min(2, it.limits.max_forks - it.n_forks)
            if it.replay:
                forks_left = min(forks_left, len(it._forced_chunks) - it.n_promises)
        open_pages = math.ceil(len(it.open_ids) / bm.page_size) * max(0, forks_left)
        views = req.views
        return sum(bm.pages_needed(views[s.tid], 1) + (open_pages if s.tid == 0 else 0) for s in steps if s.sample)

    # ------------------------------------------------------------------ KV operations

    def _apply_kv_ops(self, req: Request) -> None:
        """Apply the interpreter's KV operations to the block manager. Raises
        KVCacheExhausted when an append finds no page (the caller fails the request)."""
        bm = self.block_manager
        views, pending = req.views, req.pending_slots
        for op in req.interp.take_kv_ops():
            if type(op) is KVAppend:
                view = views.get(op.tid)
                if view is None:
                    view = views[op.tid] = KVView()
                slots = bm.append(view, op.n)
                have = pending.get(op.tid)
                if have is None:
                    pending[op.tid] = slots
                else:
                    have.extend(slots)
            elif isinstance(op, KVFork):
                req.views[op.child] = bm.fork(req.views[op.parent])
            elif isinstance(op, KVJoin):
                bm.join(req.views[op.parent], [req.views[c] for c in op.children])
            elif isinstance(op, KVRelease):
                view = req.views.pop(op.tid, None)
                if view is not None:
                    bm.release(view)
                req.pending_slots.pop(op.tid, None)

    # ------------------------------------------------------------------ stepping

    def schedule(self) -> ScheduledBatch:
        """Admit, check pages (preempting or failing requests that cannot get them), and
        return the threads that run this step (an empty batch when none has work)."""
        self._admit()
        work: list[tuple[Request, list[ThreadStep]]] = [(r, r.interp.schedule_threads()) for r in self.running]
        bm = self.block_manager
        while work:
            need = sum(self._pages_bound(r, steps) for r, steps in work)
            if need <= bm.num_free:
                break
            if len(work) == 1:
                req = work.pop()[0]
                self.fail(req, f"KV cache exhausted: request {req.request_id} needs up to {need} more pages but only "
                               f"{bm.num_free} of {bm.describe()} are free; raise kv_cache_bytes or lower "
                               f"max_new_tokens / max_threads")
                break
            self._preempt(work.pop(self._victim(work))[0])
        batch = ScheduledBatch()
        out = batch.threads
        runs = BlockManager.runs
        for req, steps in work:
            pending, views = req.pending_slots, req.views
            for s in steps:
                slots = pending.get(s.tid, [])
                if len(slots) != len(s.tokens):
                    raise RuntimeError(f"request {req.request_id} thread {s.tid}: {len(s.tokens)} pending tokens but "
                                       f"{len(slots)} reserved KV slots")
                out.append(ScheduledThread(req, s, slots, runs(views[s.tid])))
        return batch

    def postprocess(self, batch: ScheduledBatch,
                    sampled: SampledTokens | None) -> list[tuple[Request, list[tuple[int, int]]]]:
        """Hand the sampled tokens to the interpreters, apply their KV operations, and end the
        requests that finished.

        Returns ``(request, [(thread id, token id), ...])`` for every request that ran this
        step, in batch order, with the tokens its interpreter took (a token sampled after the
        request ended within the step, e.g. at ``max_new_tokens``, is not taken; a request that
        failed here comes back too, finished with an error)."""
        self.total_steps += 1
        by_req: dict[int, tuple[Request, list[ScheduledThread]]] = {}
        for st in batch.threads:
            by_req.setdefault(id(st.request), (st.request, []))[1].append(st)
        # first what needs no sampled token (the device may still be running the step)
        bm = self.block_manager
        for req, threads in by_req.values():
            if req.finished:
                continue
            pending = req.pending_slots
            steps = [st.step for st in threads]
            it = req.interp
            main, n_prompt = it.main.tid, len(it.prompt_ids)
            for s in steps:
                pending.pop(s.tid, None)
                if s.tid == main and s.positions and s.positions[0] < n_prompt and bm.prefix_caching:
                    # the step wrote (the rest of) the prompt's KV: its whole pages enter the cache
                    bm.cache_prefix(req.views[main], it.prompt_ids, min(n_prompt, s.positions[-1] + 1))
            it.step_done(steps)
        at = 0
        out: list[tuple[Request, list[tuple[int, int]]]] = []
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
            if req.finished:
                continue
            if req.request_id in errors:
                self.fail(req, errors[req.request_id])
                self.ended.remove(req)
                out.append((req, []))
                continue
            it = req.interp
            taken: list[tuple[int, int]] = []
            if sampling:
                req.steps += 1
                req.max_width = max(req.max_width, n_sample)
                its = it.threads
                req.prefill_tokens += sum(len(s.tokens) for s in sampling if not its[s.tid].n_sampled)
                on_token = it.on_token
                keep_lps = req.params.return_logprobs
                for s, tok, lp in zip(sampling, toks, lps if keep_lps else toks):
                    before = it.total_sampled
                    on_token(s.tid, tok, lp if keep_lps else None)
                    if it.total_sampled != before:
                        taken.append((s.tid, tok))
            try:
                self._apply_kv_ops(req)
            except KVCacheExhausted as e:
                self.fail(req, str(e))
                self.ended.remove(req)
                out.append((req, taken))
                continue
            if it.done:
                self._end(req, it.finish)
            out.append((req, taken))
        return out
