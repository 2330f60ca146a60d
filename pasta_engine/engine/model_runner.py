"""Model runner: the one place where scheduled threads become tensors.

After nano-vllm's ``ModelRunner``: it owns the KV tensor, the attention backend (and its
per-step plan), the CUDA graphs (captured once, at start) and the sampler call. Each step
:meth:`ModelRunner.run` takes the scheduler's :class:`~pasta_engine.engine.scheduler.ScheduledBatch`,
lays the threads' tokens, logical positions, KV slots and views out as one mixed batch, runs
the model once (a captured graph when the step is pure decode and fits a bucket), picks every
sampling thread's token (the forced token in replay), and brings all tokens back in one
device-to-host transfer.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from itertools import groupby
from typing import Any, Callable

import torch

from ..config import EngineConfig
from ..errors import ParameterError
from ..layers.attention import AttentionMetadata
from ..layers.backends import get_backend
from ..layers.sampler import logprobs_of, sample
from ..layers.utils import to_device
from ..models.llama import LlamaModel
from .request import Request
from .scheduler import SampledTokens, ScheduledBatch, ScheduledThread

__all__ = ["ModelRunner", "StepProfile", "kv_bytes_per_token", "default_kv_cache_bytes"]


def kv_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    """Bytes of K and V of one token across all layers."""
    return 2 * num_layers * num_kv_heads * head_dim * torch.tensor([], dtype=dtype).element_size()


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
    forwarded."""

    sequences: int
    sampled: int
    graphed: bool
    host_s: float
    gpu_wait_s: float
    total_s: float
    kv_tokens: int
    tokens: int


class ModelRunner:
    """Runs the model for the scheduler's batches.

    Args:
        model: the :class:`~pasta_engine.models.llama.LlamaModel`.
        config: the engine's :class:`~pasta_engine.config.EngineConfig` (backend, KV budget,
            page size, CUDA graphs).

    Attributes:
        num_pages: KV pages the budget holds (the block manager's pool).
        kv_cache: ``[num_layers, 2, num_pages, page_size, Hkv, D]`` in the model's dtype.
        logits_hook: testing aid, called as ``hook(request, thread_id, logits_row)`` for every
            sampled row (float32 ``[vocab]``) before sampling.
        profile: a list to append one :class:`StepProfile` per step to (benchmarks; it adds
            one device synchronization per step to split host time from GPU time).

    Raises ParameterError when the KV budget holds no page or CUDA graphs are asked for where
    they cannot run."""

    def __init__(self, model: LlamaModel, config: EngineConfig):
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
        self.kv_cache = torch.zeros((c.num_layers, 2, self.num_pages, config.page_size, c.num_kv_heads, c.head_dim),
                                    dtype=model.dtype, device=model.device)
        want_graphs = config.cuda_graphs
        can_graph = model.device.type == "cuda" and self.backend.supports_cuda_graphs
        if want_graphs and not can_graph:
            raise ParameterError("cuda_graphs", True, message="cuda_graphs=True needs the model on a CUDA device and "
                                 "attention_backend='triton'")
        self.cuda_graphs = None
        if want_graphs or (want_graphs is None and can_graph):
            from .cuda_graphs import CudaGraphs

            self.cuda_graphs = CudaGraphs(model, self.kv_cache, self.backend)
        self.logits_hook: Callable[[Request, int, torch.Tensor], None] | None = None
        self.profile: list[StepProfile] | None = None
        self.steps = 0  # steps run (the attention plan is updated, not rebuilt, from one step to the next)

    # ------------------------------------------------------------------ one step

    def run(self, batch: ScheduledBatch) -> SampledTokens:
        """Forward every thread of ``batch`` once and pick each sampling thread's token.

        Returns :class:`~pasta_engine.engine.scheduler.SampledTokens` in the batch's sampling
        order; a request whose sampling raised is named in its ``errors`` (its tokens are
        placeholders). Exceptions from the forward itself propagate (they belong to no single
        request)."""
        t_start = time.perf_counter()
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        q_lens: list[int] = []
        runs: list[list] = []
        logits_indices: list[int] = []
        for st in batch.threads:
            ids += st.step.tokens
            positions += st.step.positions
            slots += st.slots
            q_lens.append(len(st.step.tokens))
            runs.append(st.runs)
            if st.step.sample:
                logits_indices.append(len(ids) - 1)
        dev = self.device
        self.steps += 1
        meta = AttentionMetadata(page_size=self.page_size, q_lens=q_lens, runs=runs, slots=slots, step=self.steps)
        logits = None
        graphed = False
        if self.cuda_graphs is not None:
            every_seq = self.cuda_graphs.run(meta, ids, positions, slots)
            if every_seq is not None:
                graphed = True
                all_sample = len(logits_indices) == len(q_lens)
                logits = every_seq if all_sample else every_seq.index_select(0, to_device(logits_indices, torch.long, dev))
        if logits is None:
            self.backend.plan(meta)
            logits = self.model.forward(
                to_device(ids, torch.long, dev), to_device(positions, torch.long, dev),
                to_device(slots, torch.long, dev), self.kv_cache, self.backend, to_device(logits_indices, torch.long, dev),
            )
        gpu_wait = 0.0
        if self.profile is not None and dev.type == "cuda":
            t_launched = time.perf_counter()
            torch.cuda.synchronize(dev)
            gpu_wait = time.perf_counter() - t_launched
        sampled = self._sample(batch.sampling, logits)
        if self.profile is not None:
            total = time.perf_counter() - t_start
            self.profile.append(StepProfile(len(q_lens), len(logits_indices), graphed, total - gpu_wait, gpu_wait, total,
                                            _distinct_kv_tokens(runs), len(ids)))
        return sampled

    def _sample(self, sampling: list[ScheduledThread], logits: torch.Tensor) -> SampledTokens:
        """Every request's tokens chosen on the device, then one transfer back."""
        picks: list[torch.Tensor] = []
        errors: dict[str, str] = {}
        at = 0
        for _, group_iter in groupby(sampling, key=lambda st: id(st.request)):
            group = list(group_iter)
            req = group[0].request
            lg = logits[at : at + len(group)]
            at += len(group)
            try:
                tokens = self._choose(req, group, lg)
                if req.params.return_logprobs:
                    lps = logprobs_of(lg, tokens)
                else:
                    lps = torch.zeros(len(group), device=lg.device)
                picks.append(torch.stack([tokens.double(), lps.double()]))
            except Exception as e:  # noqa: BLE001  (the failure belongs to this request only)
                errors[req.request_id] = f"sampling failed: {type(e).__name__}: {e}"
                picks.append(torch.zeros(2, len(group), dtype=torch.float64, device=lg.device))
        host = torch.cat(picks, dim=1).tolist() if picks else [[], []]
        return SampledTokens([int(t) for t in host[0]], host[1], errors)

    def _choose(self, req: Request, group: list[ScheduledThread], logits: torch.Tensor) -> torch.Tensor:
        if self.logits_hook is not None:
            for st, row in zip(group, logits):
                self.logits_hook(req, st.step.tid, row)
        forced = [st.step.forced for st in group]
        dev = logits.device
        if all(f is not None for f in forced):
            return to_device(forced, torch.long, dev)
        if req.sampler_state is None:
            gen = torch.Generator(device=dev)
            gen.manual_seed(req.params.seed)
            req.sampler_state = gen
        tokens = sample(logits, req.params, req.sampler_state)
        if any(f is not None for f in forced):
            is_forced = to_device([f is not None for f in forced], torch.bool, dev)
            tokens = torch.where(is_forced, to_device([f or 0 for f in forced], torch.long, dev), tokens)
        return tokens

    @property
    def weight_bytes(self) -> int:
        """Bytes of the model's weights (read once per forward)."""
        return self.model.weight_bytes

    def describe(self) -> dict[str, Any]:
        """The runner's settings, for benchmark records."""
        return {"kv_cache_bytes": self.kv_cache_bytes, "kv_cache_pages": self.num_pages, "page_size": self.page_size,
                "attention_backend": self.backend.name, "cuda_graphs": self.cuda_graphs is not None}


def _distinct_kv_tokens(runs: list[list]) -> int:
    """Distinct KV tokens a step's attention reads (shared segments counted once)."""
    used: dict[int, int] = {}
    for row_runs in runs:
        for _, pages, lens in row_runs:
            used.update(zip(pages, lens))
    return sum(used.values())
