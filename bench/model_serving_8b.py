"""Load curves at the Llama-3-8B shape on an H100, from decode steps and MODELLED step costs
(issue 33 item 3; no GPU run: every time here is computed, none is measured).

The evaluation traces of the stage-5 adapter (shipped from 2026-11-27; its pasta-mode answers to the 80 vicuna prompts,
``bench/results/nosys-smollm2-cpu/screen/rows.jsonl``, and the base model's sequential answers to
the same prompts, ``bench/results/learned-smollm2-tags-cpu-stage4-repeats2/
model_outputs_base_sequential.json``) are replayed (forced decoding, docs/DESIGN.md section 3)
through the real :class:`~pasta_engine.Engine`: its scheduler (admission, the thread policy, the
token budget, chunked prefill, preemption), block manager (pages, forks, joins, the prefix
cache), interpreters and renderer all run as in ``pasta-engine serve``. Only the model is a
stand-in: a 1-layer, hidden-32 random Llama (``bench/bench_host.py``'s near-zero-cost model,
built by :func:`pasta_engine.tools.presets.build_checkpoint`) whose vocabulary holds the adapter's
tokenizer; its forward runs, but replay forces every token, so the schedule is what the 8B model
would get (the scheduler never reads a model's shape: only the page count, which is set to the
pages an H100 holds at the 8B shape, :func:`h100_kv_pages`). Each step's work is recorded from
the scheduled batch (:func:`step_work`: rows, tokens forwarded, rows sampled, distinct KV tokens
read, query-key pairs of attention) and priced by the step-cost model below; a clock advanced by
those modelled step times gives each request's arrival, first content, content chunks and end,
from which the figures of ``bench/bench_serving.py`` follow with its own arithmetic
(:func:`bench_serving.summarize`): TTFT, ITL, TPOT and end-to-end latency (mean, p50, p90, p99),
content tokens per second, requests per second and goodput under a named objective.

Step-cost model (one H100 SXM, Llama-3-8B in bfloat16; :func:`step_cost`):

    t_step = max(bytes / B, flops / F) + h0 + h1 * rows

* ``bytes``: the weights read once per step (every linear layer, the norms and the LM head:
  15.01e9 bytes; the embedding is a gather of the step's rows, ``tokens x hidden x 2``), plus the
  KV cache read (distinct KV tokens x 131072 bytes: the tree-attention kernel reads each shared
  page once per step, docs/DESIGN.md section 4, "Tree attention"; the plain per-row sum is
  recorded too) and written (tokens x 131072). Per KV token: 2 (K, V) x 32 layers x 8 KV heads x
  128 x 2 bytes. Shapes: ``tools/presets.py`` ``llama-3-8b`` (Meta's published config).
* ``flops``: 2 x linear-layer parameters x tokens forwarded, 2 x LM-head parameters x rows
  sampled (logits only for sampling rows, ``ModelRunner.run``), and attention 4 x heads x
  head_dim x layers x query-key pairs (QK^T and PV; a prefill piece's causal triangle counted
  exactly).
* ``B`` = 3.35e12 bytes/s: H100 SXM HBM3 bandwidth (NVIDIA H100 Tensor Core GPU datasheet;
  docs/DESIGN.md section 5 quotes the same figure). ``F`` = 989.4e12 FLOP/s: H100 SXM dense BF16
  tensor-core peak (same datasheet: 1,979 TFLOPS is the figure with 2:4 sparsity; dense is half).
* ``h0 + h1 * rows``: the engine's host time per step not hidden under the device (scheduler,
  interpreters, attention plan, sampling, outputs): ``h0`` = 58 us, ``h1`` = 5 us per row,
  fitted to ``docs/host_overhead.md``'s table (step without profile minus forward: 63, 85, 137
  and 370 us at 1, 4, 16 and 64 threads, measured on this repository's 2-core CPU) and counted
  fully serial with the device (pessimistic: on CUDA the sampled tokens are read after the
  postprocess work that needs none).

What the model leaves out (each would change the figures; see the README of the results): the
achieved fraction of the datasheet bandwidth (issue 22's targets are a step <= 1.15x the roofline
at 1 thread and <= 1.25x at 16; typically 70-85% of peak HBM bandwidth is reached), kernel launch
gaps inside a CUDA graph, the host CPU of a real server (faster than this 2-core VM), eager
(non-graphed) mixed steps, and the tokenizer: the traces are tokenized with the adapter's SmolLM2
tokenizer (Llama 3's cannot be built offline, ``tools/presets.py``), so token counts are SmolLM2's.

Usage (from the repository root; resumable: a load point whose raw file exists with the same
settings is read back, not replayed)::

    bash bench/results/serving-llama3-8b-modelled/run.sh     # what the committed results ran: it snapshots
    # HEAD's pasta_engine/ and runs, with PYTHONPATH at the snapshot,
    nice -n 19 .venv/bin/python bench/model_serving_8b.py --num-prompts 80 --concurrency 1 2 4 8 16 \\
        --request-rate 4 8 16 32 --budget 32 --slo-ttft-s 0.25 --slo-tpot-s 0.010 \\
        --out bench/results/serving-llama3-8b-modelled

Writes ``summary.json`` (settings, the cost model's constants, every point's figures),
``table.md`` and ``curves.png`` (``curves_rates.png`` with Poisson points) under ``--out``, and
``<curve>__<point>.json.gz`` (every request's record and every step's work and modelled time)
under ``--raw`` (default ``runs/serving-llama3-8b-modelled/raw``, outside git).
"""

from __future__ import annotations

import argparse
import gzip
import json
import math
import os
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_serving  # noqa: E402  (the load benchmark's arithmetic: percentiles, goodput)

ROOT = Path(__file__).resolve().parents[1]
#: The shipped adapter's pasta-mode answers to the 80 vicuna prompts (its screen, greedy, penalty 1.1, 512 tokens).
PASTA_TRACES = ROOT / "bench/results/nosys-smollm2-cpu/screen/rows.jsonl"
#: The base model's sequential answers to the same 80 prompts (AlpacaEval format).
BASE_ANSWERS = ROOT / "bench/results/learned-smollm2-tags-cpu-stage4-repeats2/model_outputs_base_sequential.json"

# --------------------------------------------------------------------------- the step-cost model (no torch)


@dataclass(frozen=True)
class ModelShape:
    """A decoder's shape (the fields of a ``tools/presets.py`` preset) and its storage bytes per
    value (``dtype_bytes``: 2 for bfloat16)."""

    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    dtype_bytes: int = 2

    @classmethod
    def from_preset(cls, name: str = "llama-3-8b", dtype_bytes: int = 2) -> "ModelShape":
        """The shape of preset ``name`` of :data:`pasta_engine.tools.presets.PRESETS` (Meta's
        published Llama-3-8B config for the default). Dense Llama-family MLPs only (gate, up,
        down)."""
        from pasta_engine.tools.presets import PRESETS

        p = PRESETS[name]
        return cls(p["hidden_size"], p["intermediate_size"], p["num_hidden_layers"], p["num_attention_heads"],
                   p["num_key_value_heads"], p["head_dim"], p["vocab_size"], dtype_bytes)

    @property
    def layer_linear_params(self) -> int:
        """Parameters of one layer's linear maps: q, k, v, o and the gated MLP (gate, up, down)."""
        q = self.hidden * self.heads * self.head_dim
        kv = 2 * self.hidden * self.kv_heads * self.head_dim
        o = self.heads * self.head_dim * self.hidden
        mlp = 3 * self.hidden * self.intermediate
        return q + kv + o + mlp

    @property
    def linear_params(self) -> int:
        """Every layer's linear parameters (not the LM head)."""
        return self.layers * self.layer_linear_params

    @property
    def lm_head_params(self) -> int:
        """The LM head's parameters (vocab x hidden; untied for Llama-3-8B)."""
        return self.vocab * self.hidden

    @property
    def norm_params(self) -> int:
        """RMSNorm weights: two per layer and the final one."""
        return (2 * self.layers + 1) * self.hidden

    @property
    def weight_bytes_per_step(self) -> int:
        """Bytes of weights a step reads once whatever its rows: linear layers, norms, LM head
        (the embedding is a gather of the step's rows: :func:`step_bytes`)."""
        return (self.linear_params + self.norm_params + self.lm_head_params) * self.dtype_bytes

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of K and V of one token over all layers (as ``layers/kv_cache.py``'s
        ``kv_bytes_per_token``)."""
        return 2 * self.layers * self.kv_heads * self.head_dim * self.dtype_bytes


@dataclass(frozen=True)
class Hardware:
    """The device a step is priced on. Defaults: one H100 SXM (NVIDIA H100 Tensor Core GPU
    datasheet: 3.35 TB/s HBM3, 989.4 TFLOP/s dense BF16 tensor core, 80 GB) and the engine's
    host time per step fitted to docs/host_overhead.md (see the module docstring).

    Attributes:
        name: a label.
        hbm_bytes_per_s: memory bandwidth in bytes per second.
        flops_per_s: dense tensor-core rate in FLOP per second at the model's dtype.
        host_fixed_s: seconds of host work per step, whatever its rows.
        host_per_row_s: seconds of host work per row (thread) of a step.
        memory_bytes: device memory in bytes (for the KV page count, :func:`h100_kv_pages`)."""

    name: str = "H100 SXM (datasheet)"
    hbm_bytes_per_s: float = 3.35e12
    flops_per_s: float = 989.4e12
    host_fixed_s: float = 58e-6
    host_per_row_s: float = 5e-6
    memory_bytes: int = 80 * 10**9


@dataclass(frozen=True)
class StepWork:
    """One step's work, read from the scheduled batch (:func:`step_work`).

    Attributes:
        rows: sequences forwarded (one per thread that ran: decode rows and prefill pieces).
        sampled: rows that sample a token after the forward.
        tokens: tokens forwarded (what the token budget counts).
        kv_tokens: distinct KV tokens the step's attention reads (a segment shared by several
            rows counted once, as the tree kernel reads it; the new tokens included).
        kv_tokens_plain: the same summed over rows (per-row paged attention reads).
        attn_pairs: query-key pairs of attention summed over rows (a row with ``q`` new tokens
            over a view of ``v`` tokens, the new ones included: ``q (v - q) + q (q + 1) / 2``)."""

    rows: int
    sampled: int
    tokens: int
    kv_tokens: int
    kv_tokens_plain: int
    attn_pairs: int


def attention_pairs(q: int, view: int) -> int:
    """Query-key pairs of ``q`` new tokens at the end of a view of ``view`` tokens under a causal
    mask: the i-th new token (1-based) sees ``view - q + i`` keys. Raises ValueError unless
    ``0 <= q <= view``."""
    if not 0 <= q <= view:
        raise ValueError(f"q={q}, view={view}: expected 0 <= q <= view")
    return q * (view - q) + q * (q + 1) // 2


def step_bytes(shape: ModelShape, work: StepWork) -> int:
    """Bytes a step moves: the weights once (:attr:`ModelShape.weight_bytes_per_step`), the
    embedding rows of its tokens, the distinct KV tokens read and the new KV tokens written."""
    embed = work.tokens * shape.hidden * shape.dtype_bytes
    kv = (work.kv_tokens + work.tokens) * shape.kv_bytes_per_token
    return shape.weight_bytes_per_step + embed + kv


def step_flops(shape: ModelShape, work: StepWork) -> int:
    """FLOPs of a step: 2 per linear parameter per token forwarded, 2 per LM-head parameter per
    sampled row, and attention's QK^T and PV, 4 x heads x head_dim per query-key pair per layer."""
    linear = 2 * shape.linear_params * work.tokens
    head = 2 * shape.lm_head_params * work.sampled
    attn = 4 * shape.heads * shape.head_dim * shape.layers * work.attn_pairs
    return linear + head + attn


def step_cost(shape: ModelShape, hw: Hardware, work: StepWork) -> dict[str, float]:
    """The modelled seconds of one step: ``max(bytes / bandwidth, flops / peak) + host_fixed +
    host_per_row x rows`` (module docstring). Returns ``{"time_s", "memory_s", "compute_s",
    "host_s", "bytes", "flops"}``; an empty step (no row) costs nothing."""
    if work.rows == 0:
        return {"time_s": 0.0, "memory_s": 0.0, "compute_s": 0.0, "host_s": 0.0, "bytes": 0, "flops": 0}
    b, f = step_bytes(shape, work), step_flops(shape, work)
    mem, comp = b / hw.hbm_bytes_per_s, f / hw.flops_per_s
    host = hw.host_fixed_s + hw.host_per_row_s * work.rows
    return {"time_s": max(mem, comp) + host, "memory_s": mem, "compute_s": comp, "host_s": host, "bytes": b,
            "flops": f}


def h100_kv_pages(shape: ModelShape, hw: Hardware, page_size: int = 16, fraction: float = 0.4) -> int:
    """KV pages the engine would allocate on ``hw`` at ``shape``: ``fraction`` of the memory the
    weights leave free (EngineConfig's default KV budget on CUDA is 40% of free GPU memory) over
    the bytes of one page (``page_size`` tokens x :attr:`ModelShape.kv_bytes_per_token`). The
    weights are counted whole (embedding included)."""
    weights = shape.weight_bytes_per_step + shape.vocab * shape.hidden * shape.dtype_bytes
    free = hw.memory_bytes - weights
    return int(fraction * free) // (page_size * shape.kv_bytes_per_token)


def step_work(batch: Any) -> StepWork:
    """The work of a :class:`~pasta_engine.core.batch.ScheduledBatch` (:class:`StepWork`):
    each thread's tokens, whether it samples, and its KV view as runs ``(segment id, pages, page
    lengths)`` (the view ends with the step's new tokens)."""
    seg: dict[Any, int] = {}
    plain = pairs = tokens = sampled = 0
    for st in batch.threads:
        q = len(st.step.tokens)
        view = 0
        for run in st.runs:
            n = sum(run[2])
            view += n
            seg[run[0]] = max(seg.get(run[0], 0), n)
        tokens += q
        sampled += bool(st.step.sample)
        plain += view
        pairs += attention_pairs(q, view)
    return StepWork(len(batch.threads), sampled, tokens, sum(seg.values()), plain, pairs)


# --------------------------------------------------------------------------- the workload


@dataclass(frozen=True)
class Job:
    """One request of a load point: the user's ``instruction`` and the ``response`` replayed
    (an annotated PASTA-LANG answer in pasta mode, plain text in sequential mode)."""

    instruction: str
    response: str


#: Curves' workloads: what each replays, in which mode.
WORKLOADS = {
    "pasta": "the shipped adapter's annotated answers, pasta mode",
    "sequential": "the same answers' clean text (tags stripped), sequential mode: the same content",
    "base": "the base model's own sequential answers to the same prompts, sequential mode",
}


def load_jobs(workload: str, n: int, traces: Path = PASTA_TRACES, base: Path = BASE_ANSWERS) -> list[Job]:
    """The first ``n`` prompts of the stage-5 adapter's screen (``traces``, JSON lines with
    ``instruction`` and ``annotated``) as jobs of ``workload`` (a key of :data:`WORKLOADS`); the
    base model's answers (``base``, AlpacaEval format) are matched by instruction.

    Raises ValueError for an unknown workload, too few traces, or a prompt without a base answer."""
    from pasta_engine.lang.tags import clean_text

    if workload not in WORKLOADS:
        raise ValueError(f"workload {workload!r}: expected one of {sorted(WORKLOADS)}")
    rows = [json.loads(line) for line in Path(traces).read_text(encoding="utf-8").splitlines() if line.strip()]
    if len(rows) < n:
        raise ValueError(f"{traces}: {len(rows)} traces, fewer than the {n} asked for")
    rows = rows[:n]
    if workload == "pasta":
        return [Job(r["instruction"], r["annotated"]) for r in rows]
    if workload == "sequential":
        return [Job(r["instruction"], clean_text(r["annotated"])) for r in rows]
    answers = {a["instruction"]: a["output"] for a in json.loads(Path(base).read_text(encoding="utf-8"))}
    missing = [r["instruction"] for r in rows if r["instruction"] not in answers]
    if missing:
        raise ValueError(f"{base}: no base answer for {missing[0]!r}")
    return [Job(r["instruction"], answers[r["instruction"]]) for r in rows]


# --------------------------------------------------------------------------- the replay through the real engine

#: The stand-in model: bench_host.py's near-zero-cost Llama (1 layer, hidden 32), with a
#: vocabulary that holds the adapter's tokenizer and the 8B preset's context length.
STUB_OVERRIDES = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                      num_key_value_heads=1, head_dim=16, max_position_embeddings=8192)


class ModelledServer:
    """Builds engines whose scheduler, block manager, interpreters and renderer are real and
    whose model is the stand-in (module docstring), with the adapter's tokenizer and PASTA-LANG
    prompt, and a KV page pool of ``kv_pages`` pages (the 8B shape's on the modelled device).

    Args:
        kv_pages: pages of ``page_size`` tokens in the block manager's pool.
        stub_dir: where the stand-in checkpoint is built (default: the package's cache)."""

    def __init__(self, kv_pages: int, page_size: int = 16, stub_dir: Path | None = None):
        import torch

        from pasta_engine.lang.prompts import PastaPrompt
        from pasta_engine.models.loader import (add_adapter_tokens, cache_root, embedded_model_dir, load_model,
                                                load_tokenizer, resolve_adapter)
        from pasta_engine.tools.presets import build_checkpoint

        torch.set_num_threads(1)
        adapter_dir, manifest = resolve_adapter(None, "auto")
        self.tokenizer = load_tokenizer(embedded_model_dir())
        add_adapter_tokens(self.tokenizer, adapter_dir)
        self.pasta_prompt = PastaPrompt.from_dict((manifest or {}).get("pasta_prompt") or {})
        vocab = 64 * math.ceil(len(self.tokenizer) / 64)
        path = build_checkpoint("tiny-llama", stub_dir or cache_root() / "presets" / "serving-replay-stub",
                                overrides={**STUB_OVERRIDES, "vocab_size": vocab})
        self.model, _, self.hf_config = load_model(path, device="cpu", dtype=torch.float32, with_tokenizer=False)
        c = self.model.config
        self.stub_kv_bytes_per_token = 2 * c.num_layers * c.num_kv_heads * c.head_dim * 4
        self.kv_pages, self.page_size = kv_pages, page_size
        self.adapter = str(adapter_dir)

    def engine(self, *, budget: int | None, policy: str, max_running: int) -> Any:
        """A fresh engine (empty prefix cache, counters at 0) whose model runner records each
        scheduled batch's :class:`StepWork` in ``engine.recorded`` before running it."""
        from pasta_engine import Engine
        from pasta_engine.config import EngineConfig

        cfg = EngineConfig.from_kwargs(
            kv_cache_bytes=self.kv_pages * self.page_size * self.stub_kv_bytes_per_token, page_size=self.page_size,
            max_running_requests=max_running, max_num_batched_tokens=budget, thread_policy=policy,
            pasta_prompt=self.pasta_prompt)
        eng = Engine(self.model, self.tokenizer, self.hf_config, config=cfg)
        if eng.block_manager.num_pages != self.kv_pages:
            raise RuntimeError(f"the engine holds {eng.block_manager.num_pages} KV pages, not {self.kv_pages}")
        return record_steps(eng)


def record_steps(engine: Any) -> Any:
    """Make ``engine``'s model runner note each scheduled batch's :class:`StepWork` in
    ``engine.recorded`` (a list) before running it as before; returns ``engine``."""
    engine.recorded = []
    run = engine.model_runner.run

    def recording_run(batch):  # the real runner, after noting the batch's work
        engine.recorded.append(step_work(batch))
        return run(batch)

    engine.model_runner.run = recording_run
    return engine


@dataclass
class Clock:
    """The modelled time in seconds and what each step cost."""

    t: float = 0.0
    steps: list[list[float]] = field(default_factory=list)


STEP_COLUMNS = ("end_s", "rows", "sampled", "tokens", "kv_tokens", "kv_tokens_plain", "attn_pairs", "time_s",
                "memory_s", "compute_s")


def run_point(engine: Any, jobs: Sequence[Job], mode: str, shape: ModelShape, hw: Hardware, *,
              concurrency: int | None = None, rate: float | None = None, seed: int = 0,
              progress: bool = False, desc: str = "") -> tuple[list[dict[str, Any]], list[list[float]], float]:
    """Replay ``jobs`` through ``engine`` (from :meth:`ModelledServer.engine`) at one load point
    on the modelled clock: at most ``concurrency`` requests in flight (closed loop: the next job
    is sent the moment one ends), or Poisson arrivals at ``rate`` requests per second
    (:func:`bench_serving.poisson_arrivals`, seeded). A request sent during a step joins the next
    one; each step lasts :func:`step_cost` of its batch. A request's outputs at a step's end give
    its first content (TTFT), the gaps between its content chunks (ITL) and its end (e2e).

    Returns ``(records, steps, duration_s)``: :class:`bench_serving.RequestRecord` fields as dicts
    (plus ``prompt_tokens``, ``cached_tokens``, ``critical_path``, ``first_step``, ``last_step``,
    ``sent_step``), one row of :data:`STEP_COLUMNS` per step, and seconds from the first send to
    the last end. Raises RuntimeError when the engine idles with requests outstanding or a
    request's streamed text differs from its final text."""
    from tqdm import tqdm

    if (concurrency is None) == (rate is None):
        raise ValueError("give exactly one of concurrency and rate")
    n = len(jobs)
    arrivals = bench_serving.poisson_arrivals(n, rate, seed) if rate is not None else None
    clock = Clock()
    records: list[dict[str, Any] | None] = [None] * n
    live: dict[str, tuple[int, bench_serving.RequestRecord, dict[str, Any]]] = {}
    nxt = 0
    done = 0
    bar = tqdm(total=n, desc=desc or "requests", unit="req", disable=not progress, file=sys.stderr, leave=False)

    def send(i: int, at: float) -> None:
        rid = engine.add_request(jobs[i].instruction, mode=mode, annotated_response=jobs[i].response)
        rec = bench_serving.RequestRecord(index=i, prompt_index=i, sent_s=at)
        live[rid] = (i, rec, {"last": None, "sent_step": len(clock.steps)})

    if concurrency is not None:
        while nxt < min(concurrency, n):
            send(nxt, 0.0)
            nxt += 1
    while done < n:
        if arrivals is not None:
            if not live and nxt < n and arrivals[nxt] > clock.t:
                clock.t = arrivals[nxt]  # idle until the next arrival
            while nxt < n and arrivals[nxt] <= clock.t:
                send(nxt, arrivals[nxt])
                nxt += 1
        outs = engine.step()
        work = engine.recorded.pop() if engine.recorded else None
        if engine.recorded:
            raise RuntimeError("more than one batch recorded in one step")
        if work is None and not outs:
            raise RuntimeError(f"the engine ran no step with {len(live)} requests outstanding")
        if work is not None:
            cost = step_cost(shape, hw, work)
            clock.t += cost["time_s"]
            clock.steps.append([clock.t, work.rows, work.sampled, work.tokens, work.kv_tokens, work.kv_tokens_plain,
                                work.attn_pairs, cost["time_s"], cost["memory_s"], cost["compute_s"]])
        t = clock.t
        for out in outs:
            i, rec, st = live[out.request_id]
            if out.delta_text:
                if rec.ttft_s is None:
                    rec.ttft_s = t - rec.sent_s
                    st["first_step"] = len(clock.steps) - 1
                else:
                    rec.itl_s.append(t - st["last"])
                st["last"] = t
                rec.chunks += 1
                rec.text += out.delta_text
            if out.finished:
                res = out.result
                s = res.stats
                if rec.text != res.text:
                    raise RuntimeError(f"request {i}: the streamed text differs from the final text")
                rec.e2e_s = t - rec.sent_s
                rec.finish_reason, rec.error = s.finish_reason, out.error
                rec.completion_tokens, rec.content_tokens = s.tokens_decoded, s.content_tokens
                rec.decode_steps, rec.forks = s.decode_steps, s.forks
                rec.text = ""  # the text is the trace's: not stored again
                records[i] = {**asdict(rec), "prompt_tokens": s.prefill_tokens, "cached_tokens": s.cached_tokens,
                              "critical_path": s.critical_path, "tag_tokens": s.tag_tokens,
                              "sent_step": st["sent_step"], "first_step": st.get("first_step"),
                              "last_step": len(clock.steps) - 1}
                del live[out.request_id]
                done += 1
                bar.update(1)
                if concurrency is not None and nxt < n:
                    send(nxt, t)
                    nxt += 1
    bar.close()
    return records, clock.steps, clock.t


# --------------------------------------------------------------------------- curves, load points, figures


@dataclass(frozen=True)
class Curve:
    """One curve: a workload (:data:`WORKLOADS`) replayed in ``mode`` on a server with token
    budget ``budget`` (None: no budget) and thread policy ``policy``. ``name`` names its files."""

    name: str
    label: str
    workload: str
    mode: str
    budget: int | None
    policy: str


def default_curves(budget: int) -> list[Curve]:
    """The curves of the results: pasta under both thread policies with a token budget that binds
    (``budget``), the same content decoded sequentially and the base model's own answers under
    the same budget; then pasta and sequential with no budget (where both policies are the same)."""
    b = f"budget {budget}"
    return [
        Curve("pasta_critical_first", f"pasta, critical_first, {b}", "pasta", "pasta", budget, "critical_first"),
        Curve("pasta_fcfs", f"pasta, fcfs, {b}", "pasta", "pasta", budget, "fcfs"),
        Curve("sequential", f"sequential, same content, {b}", "sequential", "sequential", budget, "critical_first"),
        Curve("base_sequential", f"base model, sequential, {b}", "base", "sequential", budget, "critical_first"),
        Curve("pasta_no_budget", "pasta, no budget", "pasta", "pasta", None, "critical_first"),
        Curve("sequential_no_budget", "sequential, same content, no budget", "sequential", "sequential", None,
              "critical_first"),
    ]


def step_stats(steps: Sequence[Sequence[float]], budget: int | None) -> dict[str, Any]:
    """A load point's step figures from its :data:`STEP_COLUMNS` rows: steps, rows (threads) per
    step (mean, p50, p90, max), tokens per step (mean, max), the fraction of steps whose tokens
    filled the budget (None without one), KV tokens read per step (mean), the modelled step
    time in milliseconds (mean, p50, p99) and the fraction of steps whose roofline term is the
    memory one."""
    import numpy as np

    if not steps:
        return {"count": 0}
    a = np.asarray(steps, dtype=float)
    col = {c: a[:, i] for i, c in enumerate(STEP_COLUMNS)}
    return {
        "count": int(len(a)),
        "rows_mean": float(col["rows"].mean()), "rows_p50": float(np.percentile(col["rows"], 50)),
        "rows_p90": float(np.percentile(col["rows"], 90)), "rows_max": int(col["rows"].max()),
        "tokens_mean": float(col["tokens"].mean()), "tokens_max": int(col["tokens"].max()),
        "budget_bound_fraction": None if budget is None else float((col["tokens"] >= budget).mean()),
        "kv_tokens_mean": float(col["kv_tokens"].mean()),
        "step_ms_mean": 1e3 * float(col["time_s"].mean()), "step_ms_p50": 1e3 * float(np.percentile(col["time_s"], 50)),
        "step_ms_p99": 1e3 * float(np.percentile(col["time_s"], 99)),
        "memory_bound_fraction": float((col["memory_s"] >= col["compute_s"]).mean()),
    }


def point_summary(raw: Mapping[str, Any], slo: bench_serving.Slo) -> dict[str, Any]:
    """A load point's figures from its raw file: :func:`bench_serving.summarize` (latencies,
    throughputs, goodput under ``slo``) plus :func:`step_stats` (``steps``), the mean decode steps
    and critical path per request, and the preemptions and KV pages still held when idle."""
    recs = raw["records"]
    s = bench_serving.summarize(recs, raw["duration_s"], slo)
    s["steps"] = step_stats(raw["steps"]["rows"], raw["curve"]["budget"])
    n = max(1, len(recs))
    s["decode_steps_mean"] = sum(r["decode_steps"] or 0 for r in recs) / n
    s["critical_path_mean"] = sum(r["critical_path"] or 0 for r in recs) / n
    st = raw.get("engine_stats") or {}
    s["preemptions"] = st.get("preemptions")
    s["kv_pages_held_idle"] = None if not st else st["kv_pages_total"] - st["kv_pages_free"]
    return s


def engine_source() -> dict[str, Any]:
    """Which engine ran the replay: the package's folder and its commit (``git rev-parse HEAD``
    there, else a ``COMMIT`` file beside the package, as ``run.sh``'s snapshot writes), and
    whether the package's files differ from that commit (``dirty``; None when unknown)."""
    import subprocess

    import pasta_engine

    top = Path(pasta_engine.__file__).resolve().parents[1]
    out: dict[str, Any] = {"path": str(top), "commit": None, "dirty": None}
    try:
        r = subprocess.run(["git", "-C", str(top), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=30)
        if r.returncode == 0 and Path(top, ".git").exists():
            out["commit"] = r.stdout.strip()
            d = subprocess.run(["git", "-C", str(top), "status", "--porcelain", "--", "pasta_engine"],
                               capture_output=True, text=True, timeout=30)
            out["dirty"] = bool(d.stdout.strip())
            return out
    except (OSError, subprocess.TimeoutExpired):
        pass
    if (top / "COMMIT").exists():
        out["commit"] = (top / "COMMIT").read_text().strip()
        out["dirty"] = False  # a snapshot written by git archive
    return out


def raw_path(raw_dir: Path, curve: Curve, key: str) -> Path:
    """Where a load point's raw file goes: ``raw_dir/<curve>__<key>.json.gz``."""
    return raw_dir / f"{curve.name}__{key.replace('=', '-')}.json.gz"


def read_raw(path: Path) -> dict[str, Any]:
    """A raw file's contents (gzipped JSON)."""
    with gzip.open(path, "rt", encoding="utf-8") as f:
        return json.load(f)


def write_raw(path: Path, data: Mapping[str, Any]) -> None:
    """Write a raw file atomically (a partial file never looks like a finished point)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    with gzip.open(tmp, "wt", encoding="utf-8") as f:
        json.dump(data, f, separators=(",", ":"))
    os.replace(tmp, path)


def _rounded(x: Any) -> Any:
    """``x`` with every float rounded to 9 decimals (nanoseconds): smaller raw files."""
    if isinstance(x, float):
        return round(x, 9)
    if isinstance(x, dict):
        return {k: _rounded(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_rounded(v) for v in x]
    return x


def _fmt(v: float | None, scale: float = 1.0, digits: int = 1) -> str:
    return "-" if v is None else f"{v * scale:.{digits}f}"


def markdown_table(curves: Sequence[Mapping[str, Any]], kind: str) -> str:
    """The figures of every curve's points of ``kind`` (``concurrency`` or ``rate``) as a markdown
    table: content tokens/s, requests/s, goodput, end-to-end p50/p90/p99, TTFT p50/p99, ITL p50,
    TPOT p50 (milliseconds), steps, rows per step and the fraction of steps at the budget."""
    head = ("| curve | load | content tok/s | req/s | goodput req/s | e2e p50 (ms) | e2e p90 | e2e p99 | "
            "TTFT p50 (ms) | TTFT p99 | ITL p50 (ms) | TPOT p50 (ms) | steps | rows/step | steps at budget |\n"
            "|---|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|\n")
    lines = []
    for c in curves:
        for p in c["points"]:
            if p["load"]["kind"] != kind:
                continue
            s = p["summary"]
            st = s["steps"]
            bound = st.get("budget_bound_fraction")
            lines.append(
                f"| {c['label']} | {p['key'].replace('concurrency=', 'c=').replace('rate=', 'r=')} | "
                f"{s['content_throughput_tps']:.0f} | {s['request_throughput_rps']:.2f} | "
                f"{_fmt(s['goodput_rps'], digits=2)} | {_fmt(s['e2e_s']['p50'], 1e3, 0)} | "
                f"{_fmt(s['e2e_s']['p90'], 1e3, 0)} | {_fmt(s['e2e_s']['p99'], 1e3, 0)} | "
                f"{_fmt(s['ttft_s']['p50'], 1e3)} | {_fmt(s['ttft_s']['p99'], 1e3)} | "
                f"{_fmt(s['itl_s']['p50'], 1e3, 2)} | "
                f"{_fmt(s['tpot_s']['p50'], 1e3, 2)} | {st['count']} | {st.get('rows_mean', 0):.1f} | "
                f"{'-' if bound is None else f'{100 * bound:.0f}%'} |")
    return head + "\n".join(lines) + "\n"


def ratio_lines(curves: Sequence[Mapping[str, Any]]) -> str:
    """Pasta against sequential serving of the same content, per load point and budget: the
    content-throughput ratio and the p50 end-to-end latency ratio (pasta / sequential)."""
    by = {c["name"]: {p["key"]: p["summary"] for p in c["points"]} for c in curves}
    pairs = [("pasta_critical_first", "sequential"), ("pasta_fcfs", "sequential"),
             ("pasta_critical_first", "base_sequential"), ("pasta_no_budget", "sequential_no_budget")]
    labels = {c["name"]: c["label"] for c in curves}
    out = ["| pasta curve | against | load | content throughput x | e2e p50 x | TTFT p50 x |",
           "|---|---|---|--:|--:|--:|"]
    for a, b in pairs:
        if a not in by or b not in by:
            continue
        for key, sa in by[a].items():
            sb = by[b].get(key)
            if sb is None:
                continue
            out.append(f"| {labels[a]} | {labels[b]} | {key.replace('concurrency=', 'c=').replace('rate=', 'r=')} | "
                       f"{sa['content_throughput_tps'] / sb['content_throughput_tps']:.2f} | "
                       f"{sa['e2e_s']['p50'] / sb['e2e_s']['p50']:.2f} | "
                       f"{sa['ttft_s']['p50'] / sb['ttft_s']['p50']:.2f} |")
    return "\n".join(out) + "\n"


def plot_modelled(curves: Sequence[Mapping[str, Any]], kind: str, path: Path) -> Path:
    """Latency against content throughput for the points of ``kind`` of every curve (as
    ``bench_serving.plot_curves`` draws them, its legend below the panels): end-to-end latency
    p50 (solid) and p90 (dotted), and TTFT p50 and p99 (dotted), in milliseconds. Writes a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(13, 5.6))
    for j, c in enumerate(curves):
        pts = sorted((p for p in c["points"] if p["load"]["kind"] == kind),
                     key=lambda p: p["summary"]["content_throughput_tps"])
        x = [p["summary"]["content_throughput_tps"] for p in pts]
        color = f"C{j % 10}"
        for ax, metric, (q1, q2) in ((axes[0], "e2e_s", ("p50", "p90")), (axes[1], "ttft_s", ("p50", "p99"))):
            y1 = [1e3 * p["summary"][metric][q1] for p in pts]
            ax.plot(x, y1, "-o", color=color, label=c["label"] if ax is axes[0] else None)
            ax.plot(x, [1e3 * p["summary"][metric][q2] for p in pts], ":", color=color)
            for xi, yi, p in zip(x, y1, pts):
                ax.annotate(p["key"].replace("concurrency=", "c=").replace("rate=", "r="), (xi, yi),
                            textcoords="offset points", xytext=(3, 3), fontsize=6, color=color)
    for ax, title in ((axes[0], "end-to-end latency, p50 (solid) and p90 (dotted)"),
                      (axes[1], "time to first token, p50 (solid) and p99 (dotted)")):
        ax.set_xlabel("content tokens per second, all requests (modelled)")
        ax.set_ylabel("ms (modelled)")
        ax.set_title(title, fontsize=10)
        ax.grid(alpha=0.3)
    axes[1].set_yscale("log")
    fig.suptitle("Llama-3-8B shape on one H100: MODELLED step costs over the real scheduler's steps "
                 f"({'closed loop' if kind == 'concurrency' else 'Poisson arrivals'}; no GPU run)", fontsize=10)
    fig.legend(loc="lower center", ncol=3, fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0.1, 1, 0.95))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# --------------------------------------------------------------------------- command line


def build_parser() -> argparse.ArgumentParser:
    """The command's flags."""
    from pasta_engine.entrypoints.args import nonneg_int, positive_int

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    w = ap.add_argument_group("workload")
    w.add_argument("--traces", type=Path, default=PASTA_TRACES,
                   help=f"the adapter's annotated answers (default {PASTA_TRACES.relative_to(ROOT)})")
    w.add_argument("--base-answers", type=Path, default=BASE_ANSWERS, help="the base model's sequential answers")
    w.add_argument("--num-prompts", type=positive_int, default=80,
                   help="requests per load point: the first N (default 80)")
    w.add_argument("--concurrency", type=positive_int, nargs="*", default=[1, 2, 4, 8, 16], metavar="C",
                   help="closed-loop load points (default 1 2 4 8 16)")
    w.add_argument("--request-rate", type=bench_serving._rate, nargs="*", default=[], metavar="R",
                   help="Poisson load points in requests per second (default none)")
    w.add_argument("--seed", type=nonneg_int, default=0, help="seed of the Poisson arrivals (default 0)")
    w.add_argument("--curves", nargs="+", default=None, metavar="NAME",
                   help="run only these curves (default all: " + ", ".join(c.name for c in default_curves(32)) + ")")
    s = ap.add_argument_group("server (the real scheduler)")
    s.add_argument("--budget", type=positive_int, default=32,
                   help="max_num_batched_tokens of the budgeted curves (default 32: binds at 8 and 16 concurrent "
                   "pasta requests)")
    s.add_argument("--max-running", type=positive_int, default=16, help="max_running_requests (default 16, serve's)")
    h = ap.add_argument_group("step-cost model (defaults: H100 SXM datasheet, docs/host_overhead.md)")
    h.add_argument("--preset", default="llama-3-8b", help="model shape from tools/presets.py (default llama-3-8b)")
    h.add_argument("--bandwidth", type=float, default=Hardware.hbm_bytes_per_s, help="HBM bytes/s (default 3.35e12)")
    h.add_argument("--flops", type=float, default=Hardware.flops_per_s, help="dense bf16 FLOP/s (default 989.4e12)")
    h.add_argument("--host-fixed-us", type=float, default=1e6 * Hardware.host_fixed_s,
                   help="host us per step (default 58)")
    h.add_argument("--host-per-row-us", type=float, default=1e6 * Hardware.host_per_row_s,
                   help="host us per row (default 5)")
    o = ap.add_argument_group("objective and output")
    o.add_argument("--slo-ttft-s", type=bench_serving._seconds, default=0.25,
                   help="goodput's TTFT bound (default 0.25 s)")
    o.add_argument("--slo-tpot-s", type=bench_serving._seconds, default=0.010,
                   help="goodput's TPOT bound, seconds per content token (default 0.010)")
    o.add_argument("--out", type=Path, default=ROOT / "bench/results/serving-llama3-8b-modelled", help="results folder")
    o.add_argument("--raw", type=Path, default=ROOT / "runs/serving-llama3-8b-modelled/raw",
                   help="folder of the raw files (every request and step; what a resumed run reads back; default "
                   "runs/serving-llama3-8b-modelled/raw, not committed)")
    o.add_argument("--overwrite", action="store_true", help="replay every point again (default: read back points done)")
    o.add_argument("--no-progress", action="store_true", help="no progress bars")
    return ap


def _rel(p: Path) -> str:
    """``p`` relative to the repository root when it is inside it (settings compare across checkouts)."""
    r = Path(p).resolve()
    return str(r.relative_to(ROOT)) if r.is_relative_to(ROOT) else str(p)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    shape = ModelShape.from_preset(args.preset)
    hw = Hardware(hbm_bytes_per_s=args.bandwidth, flops_per_s=args.flops, host_fixed_s=args.host_fixed_us * 1e-6,
                  host_per_row_s=args.host_per_row_us * 1e-6)
    curves = default_curves(args.budget)
    if args.curves:
        unknown = set(args.curves) - {c.name for c in curves}
        if unknown:
            raise SystemExit(f"--curves: unknown {sorted(unknown)}; known {[c.name for c in curves]}")
        curves = [c for c in curves if c.name in args.curves]
    slo = bench_serving.Slo(ttft_s=args.slo_ttft_s, tpot_s=args.slo_tpot_s)
    points = bench_serving.load_points(args.concurrency, args.request_rate)
    kv_pages = h100_kv_pages(shape, hw)
    settings = {"num_prompts": args.num_prompts, "traces": _rel(args.traces), "base_answers": _rel(args.base_answers),
                "shape": {"preset": args.preset, **asdict(shape)}, "hardware": asdict(hw), "kv_pages": kv_pages,
                "page_size": 16, "max_running_requests": args.max_running, "seed": args.seed,
                "stand_in_model": STUB_OVERRIDES}
    source = engine_source()
    server = None
    jobs: dict[str, list[Job]] = {}
    out_curves = []
    for curve in curves:
        res_points = []
        for kind, value in points:
            key = bench_serving.load_key(kind, value)
            path = raw_path(args.raw, curve, key)
            raw = None
            if path.exists() and not args.overwrite:
                raw = read_raw(path)
                if raw["settings"] != settings or raw["curve"] != asdict(curve):
                    raise SystemExit(f"{path} was replayed with other settings: --overwrite to replay it again")
                print(f"{curve.name} {key}: read back from {path}", file=sys.stderr)
            else:
                if server is None:
                    server = ModelledServer(kv_pages)
                if curve.workload not in jobs:
                    jobs[curve.workload] = load_jobs(curve.workload, args.num_prompts, args.traces, args.base_answers)
                eng = server.engine(budget=curve.budget, policy=curve.policy, max_running=args.max_running)
                records, steps, duration = run_point(
                    eng, jobs[curve.workload], curve.mode, shape, hw,
                    concurrency=int(value) if kind == "concurrency" else None,
                    rate=value if kind == "rate" else None, seed=args.seed, progress=not args.no_progress,
                    desc=f"{curve.name} {key}")
                raw = {"curve": asdict(curve), "key": key,
                       "load": {"kind": kind, "value": value if math.isfinite(value) else "inf"},
                       "settings": settings, "engine": source, "time": time.strftime("%Y-%m-%d %H:%M:%S"),
                       "duration_s": round(duration, 9), "engine_stats": eng.stats(),
                       # rounded as the file holds them, so a resumed run summarizes the same numbers
                       "records": _rounded(records), "steps": {"columns": list(STEP_COLUMNS), "rows": _rounded(steps)}}
                write_raw(path, raw)
            s = point_summary(raw, slo)
            res_points.append({"key": key, "load": raw["load"], "summary": s, "engine": raw["engine"]})
            print(f"{curve.name} {key}: {s['content_throughput_tps']:.0f} content tok/s, e2e p50 "
                  f"{1e3 * s['e2e_s']['p50']:.0f} ms, TTFT p50 {1e3 * s['ttft_s']['p50']:.1f} ms, "
                  f"{s['steps']['count']} steps, {s['steps']['rows_mean']:.1f} rows/step", file=sys.stderr)
        out_curves.append({**asdict(curve), "points": res_points})
    write_outputs(args.out, out_curves, settings, slo, argv)
    return 0


def write_outputs(out: Path, curves: list[dict[str, Any]], settings: Mapping[str, Any], slo: bench_serving.Slo,
                  argv: Sequence[str] | None) -> None:
    """``summary.json``, ``table.md`` and the plots (``curves.png``: closed loop; ``curves_rates.png``:
    Poisson points, when any) under ``out``."""
    commits = sorted({str(p["engine"].get("commit")) for c in curves for p in c["points"]})
    summary = {
        "what": "MODELLED step costs (no GPU run): the real scheduler's steps for the shipped adapter's traces at "
                "the llama-3-8b shape, each priced by a roofline step-cost model of an H100 SXM",
        "command": " ".join(["python", "bench/model_serving_8b.py", *(sys.argv[1:] if argv is None else argv)]),
        "updated": time.strftime("%Y-%m-%d %H:%M:%S"), "engine_commits": commits, "settings": dict(settings),
        "slo": asdict(slo),
        "cost_model": {"formula": "max(bytes / hbm_bytes_per_s, flops / flops_per_s) + host_fixed_s "
                                  "+ host_per_row_s * rows",
                       "sources": {"hbm_bytes_per_s": "NVIDIA H100 SXM datasheet (3.35 TB/s HBM3)",
                                   "flops_per_s": "NVIDIA H100 SXM datasheet (1,979 TFLOPS BF16 with "
                                                  "sparsity; dense half)",
                                   "host": "fit to docs/host_overhead.md (step without profile minus forward)",
                                   "shape": "pasta_engine/tools/presets.py llama-3-8b"}},
        "curves": curves,
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    kinds = [k for k in ("concurrency", "rate") if any(p["load"]["kind"] == k for c in curves for p in c["points"])]
    parts = [f"<!-- written by bench/model_serving_8b.py; MODELLED step costs, no GPU run -->\n"]
    for k in kinds:
        title = "Closed loop (concurrency)" if k == "concurrency" else "Poisson arrivals (rate, req/s)"
        parts.append(f"### {title}\n\n")
        parts.append(markdown_table(curves, k) + "\n")
    parts.append("### Pasta against sequential serving (ratios)\n\n" + ratio_lines(curves))
    (out / "table.md").write_text("".join(parts))
    for k in kinds:
        plot_modelled(curves, k, out / ("curves.png" if k == "concurrency" else "curves_rates.png"))
    print(f"wrote {out / 'summary.json'}, {out / 'table.md'} and the plots", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
