"""CUDA-graph decode steps: one graph per bucket of live-thread count, captured once at start.

A pure decode step (every sequence one token) of up to ``max(buckets)`` sequences replays the
graph of the smallest bucket that holds it. Everything the graph reads lives in static device
buffers sized for that bucket: token ids, logical positions, KV slots (padding sequences get slot
-1, which every KV write skips, and are in no attention row group, so they touch
nothing), and the attention plan, held by the bucket's graph-mode attention backend
(:meth:`~pasta_engine.layers.attention.AttentionBackend.for_cuda_graph`: its launch grid is a
capacity and its programs exit early past the device-side work count). Per step the host
only plans and copies in (from one pinned buffer, rewritten only once the previous step's
copies out of it are done: a step that samples nothing has no transfer back to wait on); the
sampled tokens are the one transfer back. Steps with
multi-token sequences (prompt prefill, forks' inserted tags), more sequences than the largest
bucket, or a plan over capacity run eagerly with the same code.

Nothing inside capture syncs with the host, autotunes, JIT-compiles (two warm-up forwards
compile each bucket's kernels first) or reads a Python value that changes between steps.
(After nano-vllm's ``capture_cudagraph``, vLLM's and SGLang's CUDA-graph runners, and gpt-fast's
``torch.compile`` decode.) Owned by the :class:`~pasta_engine.worker.model_runner.ModelRunner`.
The captured forward is :func:`~pasta_engine.worker.forward.forward_step`, the eager steps'
own; with tensor parallelism every rank's runner captures its graphs together (their
all-reduces are in the graphs) and replays the same bucket for the same
:class:`~pasta_engine.worker.forward.StepInputs`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..layers.attention import AttentionBackend, AttentionMetadata
from ..layers.backends import graph_backend_names
from ..layers.kv_cache import KVCache
from ..models.protocol import CausalLM
from .forward import StepInputs, forward_step

__all__ = ["CudaGraphs", "DEFAULT_BUCKETS"]

DEFAULT_BUCKETS = (1, 2, 4, 8, 16, 32, 64)


@dataclass
class _Entry:
    graph: torch.cuda.CUDAGraph
    logits: torch.Tensor
    backend: AttentionBackend


class CudaGraphs:
    """Captured decode steps, one per bucket.

    Args:
        model: a :class:`~pasta_engine.models.protocol.CausalLM` on a CUDA device.
        kv_cache: the model runner's :class:`~pasta_engine.layers.kv_cache.KVCache`.
        backend: an attention backend with ``supports_cuda_graphs``.
        buckets: live-thread counts to capture (ascending powers of two are typical).

    Raises ValueError when the model is not on a CUDA device or the backend cannot be captured."""

    def __init__(self, model: CausalLM, kv_cache: KVCache, backend: AttentionBackend,
                 buckets: tuple[int, ...] = DEFAULT_BUCKETS):
        if model.device.type != "cuda":
            raise ValueError("CUDA graphs need the model on a CUDA device")
        if not backend.supports_cuda_graphs:
            raise ValueError(f"CUDA graphs need an attention backend that supports them "
                             f"({' or '.join(graph_backend_names())}), not {backend.name!r}")
        self.model, self.kv_cache, self.backend = model, kv_cache, backend
        self.buckets = tuple(sorted(buckets))
        self.max_seqs = self.buckets[-1]
        self.page_size = kv_cache.page_size
        self.num_pages = kv_cache.num_pages
        dev = model.device
        self.input_ids = torch.zeros(self.max_seqs, dtype=torch.long, device=dev)
        self.positions = torch.zeros(self.max_seqs, dtype=torch.long, device=dev)
        self.slots = torch.full((self.max_seqs,), -1, dtype=torch.long, device=dev)
        self.logits_idx = torch.arange(self.max_seqs, dtype=torch.long, device=dev)
        self._host = torch.zeros(3, self.max_seqs, dtype=torch.long, pin_memory=True)
        # recorded after the last replay's copies out of _host: the next replay waits for it before
        # rewriting _host (a step that samples nothing has no sync of its own to order them)
        self._copied: torch.cuda.Event | None = None
        self.pool = torch.cuda.graph_pool_handle()
        self.replays = 0
        self.fallbacks = 0
        # the last replay attempt: (its inputs, the rows it forwarded: its bucket, or None when
        # it ran eagerly), for a tensor-parallel rank that pads the others' all-reduces
        self.last: tuple[StepInputs, int | None] | None = None
        # largest first, as nano-vllm: smaller graphs reuse the memory pool
        self.entries: dict[int, _Entry] = {b: self._capture(b) for b in reversed(self.buckets)}

    def bucket(self, n: int) -> int | None:
        """The smallest bucket holding ``n`` sequences (None when none does)."""
        return next((b for b in self.buckets if b >= n), None)

    def _capture(self, b: int) -> _Entry:
        gb = self.backend.for_cuda_graph(b, self.num_pages)
        meta = AttentionMetadata.from_pages(self.page_size, [1] * b, [[0]] * b, [[1]] * b)
        if not gb.plan(meta):
            raise RuntimeError(f"the graph-mode attention backend cannot plan a {b}-row warm-up step")

        def forward() -> torch.Tensor:
            return forward_step(self.model, self.kv_cache, gb, self.input_ids[:b], self.positions[:b],
                                self.slots[:b], self.logits_idx[:b])

        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):  # compile every kernel before capture
                forward()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            logits = forward()
        return _Entry(graph, logits, gb)

    def rows(self, inputs: StepInputs) -> int | None:
        """The rows a replay of ``inputs`` forwards (its bucket), or None when the step runs
        eagerly for its shape (not pure decode, more sequences than the largest bucket); a
        step whose plan is over the bucket's capacity also runs eagerly (:meth:`replay`, which
        records what it ran in :attr:`last`)."""
        meta = inputs.meta
        return self.bucket(len(meta.q_lens)) if meta.is_decode else None

    def replay(self, inputs: StepInputs) -> torch.Tensor | None:
        """The forward recipe inside a graph: plan into the bucket's static buffers, copy the
        token ids, positions and KV slots in (padding rows: id 0, position 0, slot -1) from the
        pinned host buffer (after waiting for the previous replay's copies out of it: an event,
        done already when a step since synced), replay.
        Returns float32 logits ``[n, vocab]`` of every sequence, or None when the step must run
        eagerly (see :meth:`rows`, or the plan is over capacity)."""
        b = self.rows(inputs)
        meta = inputs.meta
        if b is None or not self.entries[b].backend.plan(meta):
            self.fallbacks += 1
            self.last = (inputs, None)
            return None
        self.last = (inputs, b)
        n = len(meta.q_lens)
        host = self._host
        if self._copied is not None:
            self._copied.synchronize()  # the previous replay's copies have read _host
        host[:, :n] = torch.tensor([inputs.input_ids, inputs.positions, meta.slots], dtype=torch.long)
        host[0, n:b] = 0
        host[1, n:b] = 0
        host[2, n:b] = -1
        self.input_ids[:b].copy_(host[0, :b], non_blocking=True)
        self.positions[:b].copy_(host[1, :b], non_blocking=True)
        self.slots[:b].copy_(host[2, :b], non_blocking=True)
        self._copied = torch.cuda.Event()
        self._copied.record()
        entry = self.entries[b]
        entry.graph.replay()
        self.replays += 1
        return entry.logits[:n]
