"""Model runner: the one place where scheduled threads become tensors.

After nano-vllm's ``ModelRunner``: it owns the KV tensor, the attention backend (and its
per-step plan), the CUDA graphs (captured once, at start) and the sampler call. Each step
:meth:`ModelRunner.run` takes the scheduler's :class:`~pasta_engine.engine.batch.ScheduledBatch`,
lays the threads' tokens, logical positions, KV slots and views out as one mixed batch, runs
the model once (a captured graph when the step is pure decode and fits a bucket), picks every
sampling thread's token (the forced token in replay), and brings all tokens back in one
device-to-host transfer.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from itertools import groupby
from typing import Any, Callable, Sequence

import torch

from ..config import EngineConfig
from ..errors import ParameterError
from ..layers.attention import AttentionMetadata
from ..layers.backends import get_backend, graph_backend_names
from ..layers.kv_cache import KVCache, kv_bytes_per_token
from ..lang.grammar import GrammarState
from ..layers.sampler import (MIN_TOP_P, apply_fork_threshold, apply_output_penalties, apply_repetition_penalty,
                              draw_noise, logprobs_of, mask_tokens, sample_batch)
from ..layers.utils import to_device
from ..models.protocol import CausalLM
from .batch import SampledTokens, ScheduledBatch, ScheduledThread
from .request import Request

__all__ = ["ModelRunner", "StepProfile", "kv_bytes_per_token", "default_kv_cache_bytes"]


def default_kv_cache_bytes(device: torch.device) -> int:
    """The KV budget when none is given: 40% of the free GPU memory on CUDA, 512 MiB on a CPU."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free * 0.4)
    return 512 * 2**20


@dataclass
class StepProfile:
    """One step's numbers: sequences forwarded (one per running thread), threads sampled,
    whether a CUDA graph ran, host seconds (everything but waiting for the device), device-wait
    seconds, total seconds, the distinct KV tokens the step's attention read, and the tokens
    forwarded; then the split of the step's wall seconds: the attention plan (``plan_s``), the
    forward (``forward_s``: launching it on CUDA, a graph's planning and copies included),
    sampling and the copy back (``sample_s``), and, filled in by the engine, the scheduler
    (``schedule_s``) and handing the tokens to the interpreters (``interp_s``)."""

    sequences: int
    sampled: int
    graphed: bool
    host_s: float
    gpu_wait_s: float
    total_s: float
    kv_tokens: int
    tokens: int
    plan_s: float = 0.0
    forward_s: float = 0.0
    sample_s: float = 0.0
    schedule_s: float = 0.0
    interp_s: float = 0.0


class ModelRunner:
    """Runs the model for the scheduler's batches.

    Args:
        model: a :class:`~pasta_engine.models.protocol.CausalLM` (what
            :func:`~pasta_engine.models.loader.load_model` returns).
        config: the engine's :class:`~pasta_engine.config.EngineConfig` (backend, KV budget,
            page size, CUDA graphs).

    Attributes:
        num_pages: KV pages the budget holds (the block manager's pool).
        kv_cache: the :class:`~pasta_engine.layers.kv_cache.KVCache` (``[num_layers, 2,
            num_pages, page_size, Hkv, D]`` in the model's dtype, with the per-slot key
            positions when a layer has a sliding window).
        logits_hook: testing aid, called as ``hook(request, thread_id, logits_row)`` for every
            sampled row (float32 ``[vocab]``) before sampling; the hook may change the row in
            place (bias the model: the grammar mask still applies after it).
        profile: a list to append one :class:`StepProfile` per step to (benchmarks; it adds
            one device synchronization per step to split host time from GPU time).
        step_hook: tensor parallelism (:mod:`pasta_engine.distributed`): None, or called as
            ``hook(meta, ids, positions, slots)`` right before every eager forward with the
            step's :class:`~pasta_engine.layers.attention.AttentionMetadata` and its ``T`` token
            ids, logical positions and KV slots (host ints), so the other ranks run the same step.

    Raises ParameterError when the KV budget holds no page or CUDA graphs are asked for where
    they cannot run."""

    def __init__(self, model: CausalLM, config: EngineConfig):
        c = model.config
        self.model = model
        self.device = model.device
        self.backend = get_backend(config.attention_backend)
        self.backend.configure(c.num_heads, c.num_kv_heads, model.device, c.head_dim)
        self.page_size = config.page_size
        budget = config.kv_cache_bytes if config.kv_cache_bytes is not None else default_kv_cache_bytes(model.device)
        per_page = config.page_size * kv_bytes_per_token(c.num_layers, c.num_kv_heads, c.head_dim, model.dtype)
        self.num_pages = budget // per_page
        if self.num_pages < 1:
            raise ParameterError("kv_cache_bytes", budget,
                                 message=f"a KV cache budget of {budget} bytes holds no page of {config.page_size} "
                                         f"tokens ({per_page} bytes per page): raise kv_cache_bytes")
        self.kv_cache_bytes = budget
        self.kv_cache = KVCache(c.num_layers, self.num_pages, config.page_size, c.num_kv_heads, c.head_dim,
                                model.dtype, model.device,
                                track_positions=any(w is not None for w in c.sliding_windows))
        want_graphs = config.cuda_graphs
        can_graph = model.device.type == "cuda" and self.backend.supports_cuda_graphs
        if want_graphs and not can_graph:
            needs = ([] if model.device.type == "cuda" else ["the model on a CUDA device"]) + (
                [] if self.backend.supports_cuda_graphs else
                [f"an attention backend that runs inside CUDA graphs ({' or '.join(graph_backend_names())}, "
                 f"not {self.backend.name!r})"])
            raise ParameterError("cuda_graphs", True, message=f"cuda_graphs=True needs {' and '.join(needs)}")
        self.cuda_graphs = None
        if want_graphs or (want_graphs is None and can_graph):
            from .cuda_graphs import CudaGraphs

            self.cuda_graphs = CudaGraphs(model, self.kv_cache, self.backend)
        self.logits_hook: Callable[[Request, int, torch.Tensor], None] | None = None
        self.grammar_masks: torch.Tensor | None = None  # [states, vocab] bool: True = masked (set_grammar)
        self.fork_token: int | None = None  # the promise piece's id, for Limits.fork_threshold (set_grammar)
        self.profile: list[StepProfile] | None = None
        self.steps = 0  # steps run (the attention plan is updated, not rebuilt, from one step to the next)
        self.step_hook: Callable[[AttentionMetadata, list[int], list[int], list[int]], None] | None = None

    def warm_up(self) -> int:
        """On a CPU, make :func:`~pasta_engine.layers.linear.linear`'s per-shape GEMM choice for
        every projection and every decode row count now (else each is made, once, by the first
        step with that many rows); benchmarks call it before timing. Returns the number of
        choices made (0 on CUDA)."""
        if self.device.type != "cpu":
            return 0
        from ..layers.linear import prepare

        return prepare(self.model.projection_weights())

    def set_grammar(self, masks: Sequence[tuple[bool, Sequence[int]]] | None, fork_token: int | None = None) -> None:
        """Enforce a token grammar in the sampler: ``masks[state]`` is ``(allow, ids)`` as
        :func:`pasta_engine.lang.grammar.state_masks` returns it (allow only ``ids``, or forbid
        them); a sampling thread whose :class:`~pasta_engine.engine.interpreter.ThreadStep`
        says ``grammar=state`` gets every other token's logit set to ``-inf`` before sampling
        (one ``[rows, vocab]`` gather and ``masked_fill`` per step). None: no grammar.
        ``fork_token``: the promise piece's id, which a request's ``Limits.fork_threshold``
        decides on in the ``MAIN`` state (None: no request may set one).

        Raises ValueError for an id outside the model's ``config.vocab_size`` rows."""
        if masks is None:
            self.grammar_masks = None
            self.fork_token = None
            return
        vocab = self.model.config.vocab_size
        if fork_token is not None and not 0 <= fork_token < vocab:
            raise ValueError(f"fork_token {fork_token} is outside the vocabulary of {vocab}")
        self.fork_token = fork_token
        table = torch.zeros((len(masks), vocab), dtype=torch.bool)
        for row, (allow, ids) in enumerate(masks):
            if any(not 0 <= i < vocab for i in ids):
                raise ValueError(f"grammar state {row} names a token id outside the vocabulary of {vocab}")
            if allow:
                table[row] = True
                table[row, list(ids)] = False
            elif ids:
                table[row, list(ids)] = True
        self.grammar_masks = table.to(self.device)

    # ------------------------------------------------------------------ one step

    def run(self, batch: ScheduledBatch) -> SampledTokens:
        """Forward every thread of ``batch`` once and pick each sampling thread's token.

        Returns :class:`~pasta_engine.engine.batch.SampledTokens` in the batch's sampling
        order; a request whose sampling raised is named in its ``errors`` (its tokens are
        placeholders). On CUDA the step is only launched: the tokens come back by one
        asynchronous copy into pinned memory, waited for on the first read of the result (so
        the caller does its token-independent host work while the device runs); on a CPU the
        same code runs synchronously. Exceptions from the forward itself propagate (they
        belong to no single request)."""
        t_start = time.perf_counter()
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        q_lens: list[int] = []
        runs: list[list] = []
        logits_indices: list[int] = []
        for st in batch.threads:
            step = st.step
            ids += step.tokens
            positions += step.positions
            slots += st.slots
            q_lens.append(len(step.tokens))
            runs.append(st.runs)
            if step.sample:
                logits_indices.append(len(ids) - 1)
        dev = self.device
        self.steps += 1
        meta = AttentionMetadata(page_size=self.page_size, q_lens=q_lens, runs=runs, slots=slots, step=self.steps)
        logits = None
        graphed = False
        t_plan = t_fwd = time.perf_counter()
        if self.cuda_graphs is not None:
            every_seq = self.cuda_graphs.run(meta, ids, positions, slots)
            if every_seq is not None:
                graphed = True
                all_sample = len(logits_indices) == len(q_lens)
                logits = every_seq if all_sample else every_seq.index_select(0, to_device(logits_indices, torch.long, dev))
        if logits is None:
            self.backend.plan(meta)
            t_fwd = time.perf_counter()
            all_sample = len(logits_indices) == len(ids)
            # the three int64 inputs in one transfer, as rows of one [3, T] tensor
            ids_t, positions_t, slots_t = to_device(ids + positions + slots, torch.long, dev).view(3, -1).unbind(0)
            self.kv_cache.record_positions(slots_t, positions_t)
            if self.step_hook is not None:
                self.step_hook(meta, ids, positions, slots)
            logits = self.model.forward(
                ids_t, positions_t, slots_t, self.kv_cache, self.backend,
                None if all_sample else to_device(logits_indices, torch.long, dev),
            )
        t_sample = time.perf_counter()
        gpu_wait = 0.0
        if self.profile is not None and dev.type == "cuda":
            torch.cuda.synchronize(dev)
            gpu_wait = time.perf_counter() - t_sample
            t_sample = time.perf_counter()
        sampled = self._sample(batch.sampling, logits)
        if self.profile is not None:
            sampled.errors  # noqa: B018  (waits: the profile splits host time from device time)
            t_end = time.perf_counter()
            total = t_end - t_start
            self.profile.append(StepProfile(
                len(q_lens), len(logits_indices), graphed, total - gpu_wait, gpu_wait, total,
                _distinct_kv_tokens(runs), len(ids), plan_s=t_fwd - t_plan,
                forward_s=t_sample - t_fwd - gpu_wait,  # graphed: t_fwd == t_plan (the graph plans inside)
                sample_s=t_end - t_sample))
        return sampled

    def _sample(self, sampling: list[ScheduledThread], logits: torch.Tensor) -> SampledTokens:
        """Every sampling thread's token in one batched call (:func:`~pasta_engine.layers.sampler.sample_batch`),
        then one transfer back, waited for on the first read of the result.

        Per request (rows of one request are consecutive): the logits hook, forced tokens (a
        request whose rows are all forced samples nothing), and its random numbers, drawn from
        its own seeded generator for all its rows (:func:`~pasta_engine.layers.sampler.draw_noise`)
        as the per-request :func:`~pasta_engine.layers.sampler.sample` does, so a request's
        tokens do not depend on the others in the batch. A failure in one request's part names
        that request in ``errors``.

        Per thread, before sampling (one batched tensor operation each, for the rows that need
        it; forced rows untouched): the repetition penalty over the tokens the thread sees, the
        presence and frequency penalties over the response tokens it sees, ``-inf`` on the end
        tokens ``ignore_eos``/``min_tokens`` forbid now, then the grammar's mask; min-p is a
        per-row parameter of :func:`~pasta_engine.layers.sampler.sample_batch`."""
        n = len(sampling)
        if n == 0:
            return SampledTokens([], [], {})
        dev = logits.device
        if self.logits_hook is None and dev.type != "cuda":
            # a CPU replay step without logprobs: nothing to sample and nothing to bring back (on
            # CUDA the copy back stays: it is the step's one sync, which keeps the host from
            # refilling pinned inputs still being copied; with a hook the general path runs it)
            forced_fast = [st.step.forced for st in sampling]
            if None not in forced_fast and not any(st.request.params.return_logprobs for st in sampling):
                return SampledTokens(forced_fast, [0.0] * n, {})
        if self.logits_hook is not None:
            logits = logits.clone()  # a normal tensor: a hook may change its row in place (bias the model)
        errors: dict[str, str] = {}
        forced: list[int] = []
        want_lp: list[bool] = []
        groups: list[tuple[int, int, Request, bool]] = []  # (first row, rows, request, samples)
        at = 0
        for _, group_iter in groupby(sampling, key=lambda st: id(st.request)):
            group = list(group_iter)
            req = group[0].request
            m = len(group)
            prm = req.params
            if self.logits_hook is not None:
                try:
                    for st, row in zip(group, logits[at : at + m]):
                        self.logits_hook(req, st.step.tid, row)
                except Exception as e:  # noqa: BLE001  (the failure belongs to this request only)
                    errors[req.request_id] = f"sampling failed: {type(e).__name__}: {e}"
            fr = [st.step.forced for st in group]
            forced += [-1 if f is None else f for f in fr]
            want_lp += [prm.return_logprobs] * m
            groups.append((at, m, req, not prm.greedy and any(f is None for f in fr)))
            at += m
        pen = [(k, st) for k, st in enumerate(sampling)
               if st.request.params.repetition_penalty != 1.0 and st.step.forced is None]
        if pen:  # the tokens each thread sees, penalised (before the grammar: a masked token stays masked)
            logits = apply_repetition_penalty(
                logits, [k for k, _ in pen], [st.request.interp.seen_tokens(st.step.tid) for _, st in pen],
                [st.request.params.repetition_penalty for _, st in pen])
        pf = [(k, st) for k, st in enumerate(sampling) if st.request.params.penalised and st.step.forced is None]
        if pf:  # presence and frequency: over the response tokens the thread sees (vLLM: output tokens)
            logits = apply_output_penalties(
                logits, [k for k, _ in pf], [_response_seen(st) for _, st in pf],
                [st.request.params.presence_penalty for _, st in pf],
                [st.request.params.frequency_penalty for _, st in pf])
        ends = [(k, ids) for k, st in enumerate(sampling) if st.step.forced is None
                for ids in [_masked_ends(st, logits.shape[-1])] if ids]
        if ends:  # ignore_eos, min_tokens: end tokens the thread may not sample now
            logits = mask_tokens(logits, [k for k, _ in ends], [ids for _, ids in ends])
        if self.grammar_masks is not None:
            states = [st.step.grammar for st in sampling]
            if any(states):  # the PASTA-LANG grammar: forbidden tokens get -inf (logprobs see the mask too)
                logits = logits.masked_fill(self.grammar_masks[to_device(states, torch.long, dev)], float("-inf"))
        knobs = [(a, m, t) for a, m, req, _ in groups
                 for t in [req.interp.limits.fork_threshold] if t is not None] if self.fork_token is not None else []
        if knobs:  # Limits.fork_threshold (requests that set it only): the promise piece's probability decides
            fk = [(k, t) for a, m, t in knobs for k in range(a, a + m)
                  if sampling[k].step.forced is None and sampling[k].step.grammar == GrammarState.MAIN]
            if fk:
                logits = apply_fork_threshold(logits, [k for k, _ in fk], [t for _, t in fk], self.fork_token)
        if all(f >= 0 for f in forced):  # replay: nothing to sample
            tokens, bad = to_device(forced, torch.long, dev), None
        else:
            vocab = logits.shape[-1]
            greedy: list[bool] = []
            temps: list[float] = []
            top_k: list[int] = []
            top_p: list[float] = []
            min_p: list[float] = []
            for _, m, req, samples in groups:
                prm = req.params
                greedy += [not samples] * m
                temps += [prm.temperature if samples else 1.0] * m
                top_k += [prm.top_k if samples and 0 < prm.top_k < vocab else vocab] * m
                top_p += [max(prm.top_p, MIN_TOP_P) if samples and prm.top_p < 1.0 else float("inf")] * m
                min_p += [prm.min_p if samples else 0.0] * m
            noise = None
            if any(g[3] for g in groups):
                noise = torch.ones_like(logits)
                for a, m, req, samples in groups:
                    if not samples:
                        continue
                    try:
                        if req.sampler_state is None:
                            gen = torch.Generator(device=dev)
                            gen.manual_seed(req.params.seed)
                            req.sampler_state = gen
                        draw_noise(noise[a : a + m], req.sampler_state)
                    except Exception as e:  # noqa: BLE001  (the failure belongs to this request only)
                        errors[req.request_id] = f"sampling failed: {type(e).__name__}: {e}"
            kmask = any(k < vocab for k in top_k)
            pmask = any(p < 1.0 for p in top_p)
            mpmask = any(p > 0.0 for p in min_p)
            params = to_device(temps + top_p + (min_p if mpmask else []), torch.float32, dev).view(-1, n, 1)
            tokens, bad = sample_batch(
                logits, to_device(greedy, torch.bool, dev), params[0],
                to_device(top_k, torch.long, dev).view(n, 1) if kmask else None, params[1] if pmask else None, noise,
                params[2] if mpmask else None)
            if any(f >= 0 for f in forced):
                f = to_device(forced, torch.long, dev)
                tokens = torch.where(f >= 0, f, tokens)
        if any(want_lp):
            lps = logprobs_of(logits, tokens)
            if not all(want_lp):
                lps = torch.where(to_device(want_lp, torch.bool, dev), lps, 0.0)
        else:
            lps = torch.zeros(n, device=dev)
        rows = [tokens.double(), lps.double()] + ([bad.double()] if bad is not None else [])
        out = torch.stack(rows)
        if dev.type == "cuda":
            host = torch.empty(out.shape, dtype=out.dtype, pin_memory=True)
            host.copy_(out, non_blocking=True)
            done = torch.cuda.Event()
            done.record()
        else:
            host, done = out, None

        def wait() -> tuple[list[int], list[float], dict[str, str]]:
            if done is not None:
                done.synchronize()
            values = host.tolist()
            toks = [int(t) for t in values[0]]
            if bad is not None and any(values[2]):
                for st, b in zip(sampling, values[2]):
                    if b and st.request.request_id not in errors:
                        errors[st.request.request_id] = (
                            "sampling failed: the logits hold NaN or inf (weights that are not finite, or sampling "
                            "values that overflow them): this request ends here, the others go on")
            return toks, values[1], errors

        return SampledTokens(wait=wait)

    @property
    def weight_bytes(self) -> int:
        """Bytes of the model's weights (read once per forward)."""
        return self.model.weight_bytes

    def describe(self) -> dict[str, Any]:
        """The runner's settings, for benchmark records."""
        return {"kv_cache_bytes": self.kv_cache_bytes, "kv_cache_pages": self.num_pages, "page_size": self.page_size,
                "attention_backend": self.backend.name, "cuda_graphs": self.cuda_graphs is not None}


def _response_seen(st: ScheduledThread) -> list[int]:
    """The response tokens thread ``st`` sees: the repetition penalty's tokens without the
    prompt (the tokens vLLM's presence and frequency penalties count)."""
    it = st.request.interp
    return it.seen_tokens(st.step.tid)[len(it.prompt_ids):]


def _masked_ends(st: ScheduledThread, vocab: int) -> list[int]:
    """The end tokens thread ``st`` may not sample in this step: the end-of-sequence and stop
    tokens while its request has sampled fewer than ``min_tokens`` (all threads together), and
    the end-of-sequence tokens that are not stop tokens under ``ignore_eos``. Ids at or past
    ``vocab`` (the logits' width) are left out: they are never sampled."""
    prm = st.request.params
    if not prm.ignore_eos and not prm.min_tokens:
        return []
    it = st.request.interp
    if prm.min_tokens and it.total_sampled < prm.min_tokens:
        ids = set(it.eos_ids) | set(prm.stop_token_ids)
    elif prm.ignore_eos:
        ids = set(it.eos_ids) - set(prm.stop_token_ids)
    else:
        return []
    return sorted(i for i in ids if 0 <= i < vocab)


def _distinct_kv_tokens(runs: list[list]) -> int:
    """Distinct KV tokens a step's attention reads (shared segments counted once)."""
    used = {run[0]: run[2] for row_runs in runs for run in row_runs}
    return sum(map(sum, used.values()))
