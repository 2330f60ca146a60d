"""Model runner: the one place where scheduled threads become tensors.

After nano-vllm's ``ModelRunner``: it owns the KV tensor, the attention backend (and its
per-step plan), the CUDA graphs (captured once, at start) and the sampler call. A step is three
verbs, :meth:`ModelRunner.run` calling them in turn:

* :meth:`~ModelRunner.prepare`: the scheduler's :class:`~pasta_engine.core.batch.ScheduledBatch`
  laid out as one mixed batch, host-side (:class:`~pasta_engine.worker.forward.StepInputs`:
  token ids, logical positions, KV slots, views, the rows to sample);
* :meth:`~ModelRunner.execute`: the one forward recipe (a captured graph when the step is pure
  decode and fits a bucket, else plan, upload, record positions, forward); with tensor
  parallelism rank 0 broadcasts the inputs and every rank's runner executes them
  (:mod:`pasta_engine.distributed`);
* :meth:`~ModelRunner.sample`: every sampling thread's token from the logits and the step's
  :class:`~pasta_engine.layers.sampler.SamplingBatch` (packed from the scheduler's sampling
  rows), brought back in one device-to-host transfer.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from ..config import EngineConfig
from ..errors import ParameterError
from ..layers.attention import AttentionBackend, AttentionMetadata
from ..layers.backends import backend_info, get_backend, graph_backend_names
from ..layers.kv_cache import KVCache, kv_bytes_per_token
from ..lang.grammar import GrammarState
from ..layers.sampler import SamplingBatch
from ..models.protocol import CausalLM
from ..core.batch import SampledTokens, SamplingRow, ScheduledBatch
from .forward import StepInputs, forward_step

__all__ = ["ModelRunner", "StepProfile", "StepInputs", "kv_bytes_per_token", "default_kv_cache_bytes", "kv_pages",
           "check_cuda_graphs", "check_attention_backend"]

#: How tensor parallelism runs a step on every rank: called as ``executor(execute, inputs)`` on
#: rank 0 (broadcast ``inputs``, run ``execute(inputs)`` here as every rank does, exchange the
#: ranks' status), returning rank 0's logits.
Executor = Callable[[Callable[[StepInputs], torch.Tensor], StepInputs], torch.Tensor]


def default_kv_cache_bytes(device: torch.device) -> int:
    """The KV budget when none is given: 40% of the free GPU memory on CUDA, 512 MiB on a CPU."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free * 0.4)
    return 512 * 2**20


def kv_pages(budget: int, page_size: int, num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    """KV pages of ``page_size`` tokens that ``budget`` bytes hold for a model of these sizes (per
    tensor-parallel rank: its KV heads). Raises ParameterError naming ``kv_cache_bytes`` (and
    ``--kv-cache-mb``) when it holds none."""
    per_page = page_size * kv_bytes_per_token(num_layers, num_kv_heads, head_dim, dtype)
    if budget // per_page < 1:
        raise ParameterError("kv_cache_bytes", budget, message=(
            f"a KV cache budget of {budget} bytes holds no page of {page_size} tokens ({per_page} bytes per page): "
            "raise kv_cache_bytes (--kv-cache-mb) or lower page_size (--page-size)"))
    return budget // per_page


def check_cuda_graphs(cuda_graphs: bool | None, device: torch.device, backend: AttentionBackend | str) -> None:
    """Raise ParameterError naming ``cuda_graphs`` (and ``--cuda-graphs``) when ``cuda_graphs=True``
    asks for graphs where they cannot run: a model not on a CUDA device, an attention backend (a
    registered name or an instance) that cannot be captured. Known before anything is loaded."""
    if not cuda_graphs:
        return
    if isinstance(backend, AttentionBackend):
        name, can = backend.name, backend.supports_cuda_graphs
    else:
        name, can = backend, backend_info(backend).cuda_graphs
    graph_names = " or ".join(graph_backend_names())
    needs, flags = [], []
    if torch.device(device).type != "cuda":
        needs.append("the model on a CUDA device")
        flags.append("--device cuda")
    if not can:
        needs.append(f"an attention backend that runs inside CUDA graphs ({graph_names}, not {name!r})")
        flags.append(f"--attention-backend {graph_names}")
    if needs:
        raise ParameterError("cuda_graphs", True, message=(
            f"cuda_graphs=True needs {' and '.join(needs)}: on the command line, --cuda-graphs on needs "
            f"{' and '.join(flags)} (--cuda-graphs auto uses graphs where they run)"))


def check_attention_backend(value: Any) -> None:
    """Raise ParameterError naming ``attention_backend`` and the registered backends unless
    ``value`` is a registered name (:func:`~pasta_engine.layers.backends.backend_info`, which
    imports no backend module) or an :class:`~pasta_engine.layers.attention.AttentionBackend`
    instance. ``Engine.from_pretrained`` calls it before any weight loads (the config, below
    the registry, checks only that a name is not empty)."""
    if not isinstance(value, AttentionBackend):
        backend_info(value)


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
        logits_hook: testing aid, called as ``hook(row, thread_id, logits_row)`` for every
            sampled row (``row``: the thread's :class:`~pasta_engine.core.batch.SamplingRow`,
            with its ``request_id`` and ``params``; ``logits_row``: float32 ``[vocab]``) before
            sampling; the hook may change the logits in place (bias the model: the grammar mask
            still applies after it).
        profile: a list to append one :class:`StepProfile` per step to (benchmarks; it adds
            one device synchronization per step to split host time from GPU time).
        executor: tensor parallelism (:mod:`pasta_engine.distributed`): None (one process), or
            how rank 0 runs :meth:`execute` on every rank (see :data:`Executor`); set when the
            ranks attach.
        config: the :class:`~pasta_engine.config.EngineConfig` it was built with.

    With ``config.tensor_parallel_size > 1`` the CUDA graphs are captured by
    :meth:`capture_graphs` when the ranks attach (every rank at once: the graphs hold the
    all-reduces), not here.

    Raises ParameterError when CUDA graphs are asked for where they cannot run
    (:func:`check_cuda_graphs`) or the KV budget holds no page (:func:`kv_pages`), before the KV
    cache is allocated."""

    def __init__(self, model: CausalLM, config: EngineConfig):
        c = model.config
        self.config = config
        self.model = model
        self.device = model.device
        self.backend = get_backend(config.attention_backend)
        self.backend.configure(c.num_heads, c.num_kv_heads, model.device, c.head_dim)
        want_graphs = config.cuda_graphs
        check_cuda_graphs(want_graphs, model.device, self.backend)  # before anything is allocated
        can_graph = model.device.type == "cuda" and self.backend.supports_cuda_graphs
        self.page_size = config.page_size
        budget = config.kv_cache_bytes if config.kv_cache_bytes is not None else default_kv_cache_bytes(model.device)
        self.num_pages = kv_pages(budget, config.page_size, c.num_layers, c.num_kv_heads, c.head_dim, model.dtype)
        self.kv_cache_bytes = budget
        self.kv_cache = KVCache(c.num_layers, self.num_pages, config.page_size, c.num_kv_heads, c.head_dim,
                                model.dtype, model.device,
                                track_positions=any(w is not None for w in c.sliding_windows))
        self.cuda_graphs = None
        self.wants_graphs = bool(want_graphs or (want_graphs is None and can_graph))
        if self.wants_graphs and config.tensor_parallel_size == 1:
            self.capture_graphs()
        self.logits_hook: Callable[[SamplingRow, int, torch.Tensor], None] | None = None
        self.grammar_masks: torch.Tensor | None = None  # [states, vocab] bool: True = masked (set_grammar)
        self.fork_token: int | None = None  # the promise piece's id, for Limits.fork_threshold (set_grammar)
        self.profile: list[StepProfile] | None = None
        self.steps = 0  # steps run (the attention plan is updated, not rebuilt, from one step to the next)
        self.executor: Executor | None = None
        self._graphed = False  # whether the last execute replayed a graph (the step profile)
        self._t_executed = self._t_planned = 0.0  # when the last execute began / had planned (perf_counter s)

    def capture_graphs(self) -> None:
        """Capture the CUDA graphs (:class:`~pasta_engine.worker.cuda_graphs.CudaGraphs`, one per
        bucket) when this runner wants them, once. Called by the constructor, or, with tensor
        parallelism, on every rank at once when the ranks attach. Raises what capture raises."""
        if self.wants_graphs and self.cuda_graphs is None:
            from .cuda_graphs import CudaGraphs

            self.cuda_graphs = CudaGraphs(self.model, self.kv_cache, self.backend)

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
        them); a sampling thread whose :class:`~pasta_engine.core.interpreter.ThreadStep`
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
        """One step: :meth:`prepare`, :meth:`execute` (on every rank, with tensor parallelism),
        :meth:`sample`. Returns :class:`~pasta_engine.core.batch.SampledTokens` in the batch's
        sampling order, read lazily (see :meth:`sample`). Exceptions from the forward propagate
        (they belong to no single request)."""
        t_start = time.perf_counter()
        inputs = self.prepare(batch)
        logits = self.execute(inputs) if self.executor is None else self.executor(self.execute, inputs)
        t_sample, gpu_wait = self._forward_done()
        sampled = self.sample(logits, self.sampling_batch(batch.rows, logits.shape[-1]))
        if self.profile is not None:
            self._record(inputs, t_start, t_sample, gpu_wait, sampled)
        return sampled

    def prepare(self, batch: ScheduledBatch) -> StepInputs:
        """Lay ``batch`` out as one mixed batch (one sequence per thread, its tokens consecutive)
        and number the step. Host lists only: no tensor is made here."""
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
        self.steps += 1
        meta = AttentionMetadata(page_size=self.page_size, q_lens=q_lens, runs=runs, slots=slots, step=self.steps)
        return StepInputs(meta, ids, positions, logits_indices)

    def execute(self, inputs: StepInputs) -> torch.Tensor:
        """The forward recipe, on every tensor-parallel rank: replay a captured graph when the step
        fits one, else plan, upload ids/positions/slots, record positions, forward (:func:`forward_step`).
        Returns float32 logits ``[S, vocab]`` of the ``S`` sampled rows (launched, not waited
        for, on CUDA). Raises what the forward raises."""
        self._t_executed = time.perf_counter()
        graphed = self.cuda_graphs.replay(inputs) if self.cuda_graphs is not None else None
        self._graphed = graphed is not None
        if graphed is not None:
            return graphed if inputs.all_sample else graphed.index_select(0, inputs.logits_rows(self.device))
        self.backend.plan(inputs.meta)
        self._t_planned = time.perf_counter()
        ids, positions, slots = inputs.upload(self.device)
        return forward_step(self.model, self.kv_cache, self.backend, ids, positions, slots,
                            inputs.logits_rows(self.device))

    def forward_rows(self, inputs: StepInputs) -> int:
        """Rows the forward of ``inputs`` runs: its graph bucket when a graph replays it, else
        its ``T`` tokens (the rows of each all-reduce, for a tensor-parallel rank whose part
        failed and completes the others' all-reduces). Once a replay of ``inputs`` was tried,
        what it ran: its bucket, or ``T`` where a plan over the bucket's capacity sent it to the
        eager forward (as on every rank: the plan is the same)."""
        g = self.cuda_graphs
        if g is None:
            rows = None
        elif g.last is not None and g.last[0] is inputs:
            rows = g.last[1]
        else:
            rows = g.rows(inputs)
        return rows if rows is not None else len(inputs.input_ids)

    def sampling_batch(self, rows: Sequence[SamplingRow], vocab: int) -> SamplingBatch:
        """The step's :class:`~pasta_engine.layers.sampler.SamplingBatch`, packed from the
        scheduler's sampling rows with this runner's grammar masks and fork token."""
        return SamplingBatch.from_rows(rows, vocab, self.device, self.grammar_masks, self.fork_token, GrammarState.MAIN)

    def sample(self, logits: torch.Tensor, sb: SamplingBatch) -> SampledTokens:
        """Each sampling row's token from ``logits`` (float32 ``[N, vocab]``, row ``i`` for
        ``sb.rows[i]``): the logits hook, penalties and masks (:meth:`SamplingBatch.process`),
        forced or sampled tokens (each request's noise from its own stream, so its tokens do not
        depend on the batch), logprobs, then one transfer back. Returns
        :class:`~pasta_engine.core.batch.SampledTokens` whose first read waits for it (the
        step's one host-device sync); a request whose part failed is named in its ``errors``."""
        n = len(sb.rows)
        if n == 0:
            return SampledTokens([], [], {})
        if sb.all_forced and not any(sb.logprobs) and self.logits_hook is None and logits.device.type != "cuda":
            return SampledTokens(list(sb.forced), [0.0] * n, {})  # a CPU replay step: nothing to sample or bring back
        logits, errors = self._hooked(logits, sb)
        logits = sb.process(logits)
        tokens, bad = sb.pick(logits, errors)
        return _copy_back(tokens, sb.logprobs_of(logits, tokens), bad, errors, sb.request_ids)

    def _hooked(self, logits: torch.Tensor, sb: SamplingBatch) -> tuple[torch.Tensor, dict[str, str]]:
        """The logits after the logits hook (a copy, changed in place by the hook; the logits
        themselves when there is no hook), and the requests whose hook raised."""
        errors: dict[str, str] = {}
        if self.logits_hook is None:
            return logits, errors
        logits = logits.clone()  # a normal tensor: a hook may change its row in place (bias the model)
        for a, m, _, _ in sb.groups:
            try:
                for row, x in zip(sb.rows[a : a + m], logits[a : a + m]):
                    self.logits_hook(row, row.tid, x)
            except Exception as e:  # noqa: BLE001  (the failure belongs to this request only)
                errors[sb.request_ids[a]] = f"sampling failed: {type(e).__name__}: {e}"
        return logits, errors

    def _forward_done(self) -> tuple[float, float]:
        """``(now, seconds waited for the device)``: with a profile on CUDA, waits for the
        forward so the profile splits host from device time (else 0.0 waited)."""
        t = time.perf_counter()
        if self.profile is None or self.device.type != "cuda":
            return t, 0.0
        torch.cuda.synchronize(self.device)
        return time.perf_counter(), time.perf_counter() - t

    def _record(self, inputs: StepInputs, t_start: float, t_sample: float, gpu_wait: float,
                sampled: SampledTokens) -> None:
        """Append the step's :class:`StepProfile` (waits for the sampled tokens)."""
        sampled.errors  # noqa: B018  (waits: the profile splits host time from device time)
        t_end = time.perf_counter()
        total = t_end - t_start
        meta = inputs.meta
        t_fwd = self._t_executed if self._graphed else self._t_planned  # graphed: planned inside the replay
        self.profile.append(StepProfile(
            len(meta.q_lens), len(inputs.logits_indices), self._graphed, total - gpu_wait, gpu_wait, total,
            _distinct_kv_tokens(meta.runs), len(inputs.input_ids), plan_s=t_fwd - self._t_executed,
            forward_s=t_sample - gpu_wait - t_fwd, sample_s=t_end - t_sample))

    @property
    def weight_bytes(self) -> int:
        """Bytes of the model's weights (read once per forward)."""
        return self.model.weight_bytes

    def describe(self) -> dict[str, Any]:
        """The runner's settings, for benchmark records."""
        return {"kv_cache_bytes": self.kv_cache_bytes, "kv_cache_pages": self.num_pages, "page_size": self.page_size,
                "attention_backend": self.backend.name, "cuda_graphs": self.cuda_graphs is not None}


def _copy_back(tokens: torch.Tensor, logprobs: torch.Tensor, bad: torch.Tensor | None, errors: dict[str, str],
               request_ids: list[str]) -> SampledTokens:
    """``tokens`` and ``logprobs`` (``[N]``) brought back in one transfer (asynchronous into
    pinned memory on CUDA), waited for on the first read of the result; rows flagged ``bad``
    (non-finite logits) fail their request (``errors``, keyed by ``request_ids[i]``)."""
    out = torch.stack([tokens.double(), logprobs.double()] + ([bad.double()] if bad is not None else []))
    if out.device.type == "cuda":
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
        if bad is not None and any(values[2]):
            for rid, b in zip(request_ids, values[2]):
                if b and rid not in errors:
                    errors[rid] = ("sampling failed: the logits hold NaN or inf (weights that are not finite, or "
                                   "sampling values that overflow them), or the masks left no token: this request "
                                   "ends here, the others go on")
        return [int(t) for t in values[0]], values[1], errors

    return SampledTokens(wait=wait)


def _distinct_kv_tokens(runs: list[list]) -> int:
    """Distinct KV tokens a step's attention reads (shared segments counted once)."""
    used = {run[0]: run[2] for row_runs in runs for run in row_runs}
    return sum(map(sum, used.values()))
