"""CUDA-graph decode steps: one captured graph per bucket of live-thread count.

A pure decode step (every row one token) of up to ``max(buckets)`` rows replays the graph of
the smallest bucket that holds it. Everything the graph reads lives in static device buffers
sized for that bucket: token ids, logical positions, KV slots (padding rows get slot -1, which
the KV-write kernel skips, and are in no attention row group, so they touch nothing), and the
tree-attention plan (:class:`~pasta_engine.triton_kernels.tree_attention.StaticDecodePlan`,
whose launch grid is a capacity and whose programs exit early past the device-side work
count). Per step the host only builds the plan lists and copies them in; the sampled tokens
are the one transfer back. Steps with multi-token rows (prompt prefill, forks' inserted tags),
more rows than the largest bucket, or a plan over capacity run eagerly with the same code.

Nothing inside capture syncs with the host, autotunes, JIT-compiles (a warm-up launch
compiles each bucket's kernels first) or reads a Python value that changes between steps.
(After vLLM's and SGLang's CUDA-graph runners, and gpt-fast's ``torch.compile`` decode.)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .attention import AttentionMetadata
from .attention_triton import TritonAttention, _Plan
from .kv_cache import KVCache
from .model import LlamaModel
from .triton_kernels.tree_attention import StaticDecodePlan, _Buffers, plan_lists

__all__ = ["CudaGraphRunner", "DEFAULT_BUCKETS"]

DEFAULT_BUCKETS = (1, 2, 4, 8, 16, 32, 64)


@dataclass
class _Entry:
    graph: torch.cuda.CUDAGraph
    logits: torch.Tensor
    static: StaticDecodePlan
    block_m: int


class CudaGraphRunner:
    """Captures and replays decode steps.

    Args:
        model, kv, backend: the engine's model, KV cache and :class:`TritonAttention`.
        buckets: live-thread counts to capture (ascending powers of two are typical).
        max_rows_per_item: rows of one tree-attention work item (as the eager plans use).

    Raises ValueError when the model is not on a CUDA device or the backend is not Triton."""

    def __init__(
        self,
        model: LlamaModel,
        kv: KVCache,
        backend: TritonAttention,
        buckets: tuple[int, ...] = DEFAULT_BUCKETS,
        max_rows_per_item: int = 16,
    ):
        if model.device.type != "cuda":
            raise ValueError("CUDA graphs need the model on a CUDA device")
        if not isinstance(backend, TritonAttention):
            raise ValueError("CUDA graphs need attention_backend='triton'")
        self.model, self.kv, self.backend = model, kv, backend
        self.buckets = tuple(sorted(buckets))
        self.max_rows = self.buckets[-1]
        self.rows_per_item = max_rows_per_item
        dev = model.device
        c = model.config
        self.hkv, self.group = c.num_kv_heads, c.num_heads // c.num_kv_heads
        sms = torch.cuda.get_device_properties(dev).multi_processor_count
        self.target_work = max(1, 4 * sms // self.hkv)
        self.max_work = self.target_work + 4 * self.max_rows
        self.max_slots = self.max_work * max_rows_per_item
        self.max_pages = 4 * kv.num_pages
        self.input_ids = torch.zeros(self.max_rows, dtype=torch.long, device=dev)
        self.positions = torch.zeros(self.max_rows, dtype=torch.long, device=dev)
        self.slots = torch.full((self.max_rows,), -1, dtype=torch.long, device=dev)
        self.logits_idx = torch.arange(self.max_rows, dtype=torch.long, device=dev)
        self._host = torch.zeros(3, self.max_rows, dtype=torch.long, pin_memory=True)
        self.pool = torch.cuda.graph_pool_handle()
        self.graphs: dict[int, _Entry] = {}
        self.replays = 0
        self.fallbacks = 0

    def bucket(self, n: int) -> int | None:
        """The smallest bucket holding ``n`` rows (None when none does)."""
        return next((b for b in self.buckets if b >= n), None)

    def _block_m(self, bucket: int) -> int:
        g2 = 1 << max(0, (self.group - 1).bit_length())
        rows = min(bucket, self.rows_per_item)
        return max(16, 1 << max(0, (rows * g2 - 1).bit_length()))

    def _capture(self, b: int) -> _Entry:
        dev = self.model.device
        bm = self._block_m(b)
        static = StaticDecodePlan(b, self.max_work, self.max_slots, self.max_pages, bm, dev)
        plan = _Plan(decode=static.plan, buffers=_Buffers())
        meta = AttentionMetadata.from_pages(self.kv.page_size, [1] * b, [[0]] * b, [[1]] * b,
                                            positions=self.positions[:b], slot_mapping=self.slots[:b], plan=plan)
        # size the partial buffers to capacity and compile every kernel before capture
        plan.buffers.get(self.max_slots, b, self.model.config.num_heads, self.hkv, self.model.config.head_dim, dev)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                self.model.forward(self.input_ids[:b], meta, self.kv.kv, self.backend, self.logits_idx[:b])
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            logits = self.model.forward(self.input_ids[:b], meta, self.kv.kv, self.backend, self.logits_idx[:b])
        entry = _Entry(graph, logits, static, bm)
        self.graphs[b] = entry
        return entry

    def run(
        self, meta: AttentionMetadata, input_ids: list[int], positions: list[int], slots: list[int]
    ) -> torch.Tensor | None:
        """Replay the decode step for ``meta`` (host lists of the rows' token ids, logical
        positions and KV slots); returns float32 logits ``[n, vocab]`` of every row, or None when
        the step must run eagerly (multi-token rows, too many rows, plan over capacity)."""
        n = len(meta.q_lens)
        b = self.bucket(n)
        if b is None or any(q != 1 for q in meta.q_lens):
            self.fallbacks += 1
            return None
        entry = self.graphs.get(b) or self._capture(b)
        arrays, info = plan_lists(
            meta.runs, group=self.group, num_kv_heads=self.hkv, device=self.model.device,
            mode=self.backend.decode_mode, target_work=self.target_work, max_rows_per_item=self.rows_per_item,
            block_m=entry.block_m,
        )
        if not entry.static.load(arrays, info):
            self.fallbacks += 1
            return None
        host = self._host
        host[:, :n] = torch.tensor([input_ids, positions, slots], dtype=torch.long)
        host[0, n:b] = 0
        host[1, n:b] = 0
        host[2, n:b] = -1
        self.input_ids[:b].copy_(host[0, :b], non_blocking=True)
        self.positions[:b].copy_(host[1, :b], non_blocking=True)
        self.slots[:b].copy_(host[2, :b], non_blocking=True)
        entry.graph.replay()
        self.replays += 1
        return entry.logits[:n]
