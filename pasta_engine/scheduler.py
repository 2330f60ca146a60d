"""Scheduler: one forward per step for every live thread of every running request.

The only place where the interpreter (threads, tags) and the tensors (KV pages, model) meet:
it asks each request's :class:`~pasta_engine.interpreter.Interpreter` for its rows, turns them
into one mixed batch (token ids, logical positions, KV slots, per-sequence page views), runs
the model once, samples (or takes the forced replay token), hands the tokens back, and applies
the interpreter's KV events (append, fork, join, release) to the :class:`KVCache`.

KV memory: before a step the scheduler checks that the free pages cover the worst case the
step can allocate; if not, it preempts the most recently admitted request (its pages are
freed and it restarts from its prompt later, with the same seed, so its output is unchanged).
A single request that does not fit alone raises :class:`KVCacheExhausted` naming the budget.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from .attention import AttentionBackend, AttentionMetadata, to_device
from .interpreter import Append, Fork, Interpreter, Join, Release, Row, Thread
from .kv_cache import KVCache, KVCacheExhausted, KVView
from .model import LlamaModel
from .sampling import SamplingParams, sample

__all__ = ["Request", "Scheduler", "StepProfile"]


@dataclass
class StepProfile:
    """One step's numbers: rows forwarded, rows sampled, whether a CUDA graph ran, host
    seconds (everything but waiting for the device), device-wait seconds, total seconds, the
    distinct KV tokens the step's attention read, and the tokens forwarded."""

    rows: int
    sampled: int
    graphed: bool
    host_s: float
    gpu_wait_s: float
    total_s: float
    kv_tokens: int
    tokens: int


@dataclass(eq=False)
class _ThreadKV:
    view: KVView
    pending_slots: list[int] = field(default_factory=list)


@dataclass(eq=False)
class Request:
    """A request in flight. ``make_interpreter`` builds a fresh interpreter (used again after
    a preemption). Filled in by the scheduler: ``steps`` (forward passes that sampled for it),
    ``prefill_tokens`` (tokens forwarded without being sampled: prompt and inserted tags),
    ``max_width`` (most threads sampling in one step), ``wall_s`` and ``preemptions``."""

    index: int
    params: SamplingParams
    make_interpreter: Callable[[], Interpreter]
    interp: Interpreter | None = None
    generator: torch.Generator | None = None
    steps: int = 0
    prefill_tokens: int = 0
    max_width: int = 0
    preemptions: int = 0
    t_start: float = 0.0
    wall_s: float = 0.0


class Scheduler:
    """Runs requests to completion with continuous batching.

    Args:
        model: the :class:`LlamaModel`.
        kv: the :class:`KVCache` (its page size is the backend's).
        backend: attention backend.
        max_running_requests: requests decoded together (>= 1).
        logits_hook: testing aid, called as ``hook(request, thread, logits_row)`` for every
            sampled row (float32 ``[vocab]``) before sampling.
        graphs: a :class:`~pasta_engine.graphs.CudaGraphRunner` to replay pure decode steps
            (None: every step runs eagerly).
        profile: a list to append one :class:`StepProfile` per step to (benchmarks; it adds
            one device synchronization per step to split host time from GPU time).
    """

    def __init__(
        self,
        model: LlamaModel,
        kv: KVCache,
        backend: AttentionBackend,
        max_running_requests: int = 8,
        logits_hook: Callable | None = None,
        graphs: Any = None,
        profile: list | None = None,
    ):
        if max_running_requests < 1:
            raise ValueError(f"max_running_requests must be >= 1, got {max_running_requests}")
        self.model = model
        self.kv = kv
        self.backend = backend
        self.max_running = max_running_requests
        self.logits_hook = logits_hook
        self.graphs = graphs
        self.profile = profile
        self.device = model.device
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.total_steps = 0

    # ------------------------------------------------------------------ requests

    def add(self, req: Request) -> None:
        """Queue a request. Raises KVCacheExhausted if its prompt alone exceeds the cache."""
        req.interp = req.make_interpreter()
        prompt_pages = math.ceil(len(req.interp.prompt_ids) / self.kv.page_size)
        if prompt_pages + 1 > self.kv.num_pages:
            raise KVCacheExhausted(
                f"prompt of request {req.index} ({len(req.interp.prompt_ids)} tokens) does not fit in the "
                f"KV cache: {self.kv.describe()}; raise kv_cache_bytes"
            )
        self.waiting.append(req)

    @property
    def idle(self) -> bool:
        return not self.waiting and not self.running

    def _admit(self) -> None:
        while self.waiting and len(self.running) < self.max_running:
            req = self.waiting[0]
            need = math.ceil(len(req.interp.prompt_ids) / self.kv.page_size) + 2 * (len(self.running) + 1)
            if self.running and need > self.kv.pool.num_free:
                return
            self.waiting.pop(0)
            req.generator = self._generator(req.params.seed)
            req.t_start = time.perf_counter()
            self.running.append(req)
            self._apply_events(req)

    def _generator(self, seed: int) -> torch.Generator:
        g = torch.Generator(device=self.device)
        g.manual_seed(seed)
        return g

    def _preempt(self, req: Request) -> None:
        """Free every page of ``req`` and queue it to restart from its prompt."""
        for t in req.interp.threads:
            if t.kv is not None and not t.released:
                self.kv.release(t.kv.view)
        self.running.remove(req)
        req.preemptions += 1
        req.interp = req.make_interpreter()
        req.steps = req.prefill_tokens = req.max_width = 0
        self.waiting.insert(0, req)

    # ------------------------------------------------------------------ KV events

    def _apply_events(self, req: Request) -> None:
        for ev in req.interp.take_events():
            if isinstance(ev, Append):
                if ev.thread.kv is None:
                    ev.thread.kv = _ThreadKV(KVView())
                rec: _ThreadKV = ev.thread.kv
                rec.pending_slots += self.kv.append(rec.view, ev.n)
            elif isinstance(ev, Fork):
                ev.child.kv = _ThreadKV(self.kv.fork(ev.parent.kv.view))
            elif isinstance(ev, Join):
                self.kv.join(ev.parent.kv.view, [c.kv.view for c in ev.children])
            elif isinstance(ev, Release):
                if ev.thread.kv is not None:
                    self.kv.release(ev.thread.kv.view)

    def _pages_bound(self, req: Request, rows: list[Row]) -> int:
        """Pages the apply phase of a step can take for ``req`` at most: one per sampled
        token, plus a forked child's inserted tag (two promises per token at most)."""
        open_pages = math.ceil(len(req.interp.open_ids) / self.kv.page_size) if req.interp.mode == "pasta" else 0
        return sum(1 + (2 * open_pages if r.thread.is_main else 0) for r in rows if r.sample)

    # ------------------------------------------------------------------ stepping

    def step(self) -> list[Request]:
        """Run one forward for all running requests; return the requests that finished."""
        t_start = time.perf_counter()
        self._admit()
        work: list[tuple[Request, list[Row]]] = [(r, r.interp.rows()) for r in self.running]
        while True:
            need = sum(self._pages_bound(r, rows) for r, rows in work)
            if need <= self.kv.pool.num_free:
                break
            if len(work) == 1:
                raise KVCacheExhausted(
                    f"KV cache exhausted: request {work[0][0].index} needs up to {need} more pages but only "
                    f"{self.kv.pool.num_free} of {self.kv.describe()} are free; raise kv_cache_bytes "
                    f"or lower max_new_tokens / max_threads"
                )
            victim = work.pop()[0]
            self._preempt(victim)
        work = [(r, rows) for r, rows in work if rows]
        if not work:
            return self._collect_finished()

        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        q_lens: list[int] = []
        runs: list[list[tuple[int, list[int], list[int]]]] = []
        logits_rows: list[int] = []
        for _, rows in work:
            for row in rows:
                rec: _ThreadKV = row.thread.kv
                n = len(row.tokens)
                if len(rec.pending_slots) != n:
                    raise RuntimeError(
                        f"thread {row.thread.tid}: {n} pending tokens but {len(rec.pending_slots)} reserved slots"
                    )
                ids += row.tokens
                positions += row.positions
                slots += rec.pending_slots
                q_lens.append(n)
                runs.append([(seg.id, seg.pages, seg.lens) for seg in rec.view.segments])
                if row.sample:
                    logits_rows.append(len(ids) - 1)
        dev = self.device
        meta = AttentionMetadata(page_size=self.kv.page_size, q_lens=q_lens, runs=runs)
        logits = None
        graphed = False
        if self.graphs is not None:
            every_row = self.graphs.run(meta, ids, positions, slots)
            graphed = every_row is not None
            if every_row is not None:
                sampled_all = len(logits_rows) == len(q_lens)
                logits = every_row if sampled_all else every_row.index_select(0, to_device(logits_rows, torch.long, dev))
        if logits is None:
            meta.positions = to_device(positions, torch.long, dev)
            meta.slot_mapping = to_device(slots, torch.long, dev)
            self.backend.plan(meta, dev)
            logits = self.model.forward(
                to_device(ids, torch.long, dev), meta, self.kv.kv, self.backend, to_device(logits_rows, torch.long, dev)
            )
        self.total_steps += 1
        kv_tokens = 0
        if self.profile is not None:  # distinct KV tokens the step read (before the views grow)
            used: dict[int, int] = {}
            for row_runs in runs:
                for _, pl, ln in row_runs:
                    used.update(zip(pl, ln))
            kv_tokens = sum(used.values())
        gpu_wait = 0.0
        if self.profile is not None and dev.type == "cuda":
            t_launched = time.perf_counter()
            torch.cuda.synchronize(dev)
            gpu_wait = time.perf_counter() - t_launched

        # choose every request's tokens on the device, then bring them back in one transfer
        at = 0
        chosen: list[tuple[Request, list[Row], list[Row]]] = []
        picks: list[torch.Tensor] = []
        for req, rows in work:
            for row in rows:
                row.thread.kv.pending_slots = []
            sampling = [r for r in rows if r.sample]
            chosen.append((req, rows, sampling))
            if not sampling:
                continue
            lg = logits[at : at + len(sampling)]
            at += len(sampling)
            tokens = self._choose(req, sampling, lg)
            lps = torch.log_softmax(lg, dim=-1).gather(1, tokens[:, None]).squeeze(1) if req.params.return_logprobs \
                else torch.zeros(len(sampling), device=lg.device)
            picks.append(torch.stack([tokens.double(), lps.double()]))
        host = torch.cat(picks, dim=1).tolist() if picks else [[], []]
        at = 0
        for req, rows, sampling in chosen:
            req.interp.step_done(rows)
            if sampling:
                req.steps += 1
                req.max_width = max(req.max_width, len(sampling))
                req.prefill_tokens += sum(len(r.tokens) for r in sampling if not r.thread.n_sampled)
                want_lp = req.params.return_logprobs
                for row, tok, lp in zip(sampling, host[0][at:], host[1][at:]):
                    req.interp.on_token(row.thread, int(tok), lp if want_lp else None)
                at += len(sampling)
            self._apply_events(req)
        if self.profile is not None:
            total = time.perf_counter() - t_start
            self.profile.append(StepProfile(len(q_lens), len(logits_rows), graphed, total - gpu_wait, gpu_wait, total,
                                            kv_tokens, sum(q_lens)))
        return self._collect_finished()

    def _choose(self, req: Request, rows: list[Row], logits: torch.Tensor) -> torch.Tensor:
        if self.logits_hook is not None:
            for row, lg in zip(rows, logits):
                self.logits_hook(req, row.thread, lg)
        forced = [req.interp.forced_token(r.thread) for r in rows]
        if all(f is not None for f in forced):
            return to_device(forced, torch.long, logits.device)
        tokens = sample(logits, req.params, req.generator)
        if any(f is not None for f in forced):
            is_forced = to_device([f is not None for f in forced], torch.bool, logits.device)
            tokens = torch.where(is_forced, to_device([f or 0 for f in forced], torch.long, logits.device), tokens)
        return tokens

    def _collect_finished(self) -> list[Request]:
        done = [r for r in self.running if r.interp.done]
        now = time.perf_counter()
        for r in done:
            r.wall_s = now - r.t_start
            self.running.remove(r)
        return done

    def run(self, on_finish: Callable[[Request], None] | None = None) -> None:
        """Step until every queued request has finished."""
        while not self.idle:
            for r in self.step():
                if on_finish is not None:
                    on_finish(r)
