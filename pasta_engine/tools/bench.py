"""Speedup benchmarks: the content speedup, theoretical and realized, and the quality side.

Used by ``pasta-engine bench`` (:mod:`pasta_engine.entrypoints.cli`) and reusable from Python.
The headline figure is the **content speedup** (docs/DESIGN.md section 3): tag tokens are overhead,
so the sequential side decodes the answer's clean text (tags stripped, no tag tokens), not the
annotated response.

:func:`run_speedup`
    replays annotated traces (forced decoding) in pasta mode, and the pasta answer's clean text
    in sequential mode, one prompt at a time (batch 1, as in Jin et al., ICML 2025, arXiv
    2502.11517, section 5), and reports per prompt and in aggregate the content speedup
    (theoretical: content tokens / critical path; realized: wall time of the clean text decoded
    sequentially / of the pasta replay) and realized/theoretical ratio, then token parallelism,
    tag tokens, decode steps and critical path; aggregates are geometric means over prompts, as
    in the paper. Definitions: :mod:`pasta_engine.metrics`.
:func:`run_pareto`
    generate mode on a real model: each prompt answered sequentially and with PASTA; the pasta
    answer's content speedup (its clean text also replayed sequentially for the realized one),
    the end-to-end speedup with the length ratio of the two answers and the answers cut by the
    token budget, fork statistics per prompt, plus both modes' responses in AlpacaEval's
    ``model_outputs.json`` format, so that a judge can compute length-controlled win rates the
    paper's way (quality versus speedup).
:func:`annotate_rows`
    trace rows from prompts and answers with an annotator of :mod:`pasta_engine.tools.annotate`.

The runners write what they measure as they go (``prompts.jsonl`` grows one line per prompt),
then ``summary.json`` with the aggregates and the run's settings (also after an interruption,
marked ``complete: false``); ``resume=True`` keeps the rows of an earlier run of the same inputs
(prompts, and each row's trace, annotator and dialect, or sampling settings, and the model and its
settings, ``model_inputs``: :func:`resumed_rows`)
and runs the rest. Before timing, ``warmup`` untimed runs in each mode prepare the engine
(speedup: the first trace and the one with the most forks, so that every thread-count bucket
the run reaches, e.g. its CUDA graphs, exists before the clock starts). Each prompt then runs
once untimed on every side (its prompt enters the prefix cache, so that no timed run pays a
prefill the other side skips), then ``repeats`` times per side, interleaved (:func:`timed_runs`):
the fastest run of each side counts, and the spread of the runs is recorded beside it
(:data:`TIMING_STATISTIC`, :func:`timing_record`); a realized speedup above its ideal (the step
speedup: sequential / pasta decode steps) by more than that spread, and a geomean realized
speedup over answers that never forked, are warnings in the summary. Every mean of a summary is
over the same answers: those with content (and, for the end-to-end figures, a sequential answer
with content too). Progress goes to stderr.
"""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
import json
import os
import platform
import sys
from pathlib import Path
from typing import Any, Callable, Sequence

from ..config import SamplingParams
from ..lang.tags import clean_text
from ..metrics import (cut_fraction, geomean_positive, length_ratio, realized_over_theoretical, realized_speedup,
                       step_speedup, tag_token_fraction)
from .annotate import annotate, annotate_with_model, approx_token_count
from .traces import PromptRow, TraceRow, write_traces

__all__ = [
    "BenchError",
    "annotate_rows",
    "annotate_rows_in_dialect",
    "dialect_annotator",
    "run_speedup",
    "run_pareto",
    "clean_text_replay",
    "speedup_row",
    "summarize_speedup",
    "pareto_row",
    "summarize_pareto",
    "plot_speedup",
    "device_name",
    "run_info",
    "TIMING_STATISTIC",
    "DEFAULT_REPEATS",
    "timed_runs",
    "timing_record",
    "timing_summary",
    "realized_beyond_theoretical",
    "fork_warnings",
    "summary_warnings",
    "trace_forks",
    "trace_sha256",
    "sampling_record",
    "resumed_rows",
    "check_resumed_inputs",
    "check_prompts",
]


class BenchError(ValueError):
    """Bad input to a benchmark (the message says what and where)."""


# --------------------------------------------------------------------------- helpers


def device_name(device: str) -> str:
    """The GPU's name, or the CPU's model with its core and torch-thread counts."""
    import torch

    if str(device).startswith("cuda") and torch.cuda.is_available():
        return torch.cuda.get_device_name(torch.device(device))
    name = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                name = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{name} ({os.cpu_count()} CPUs, {torch.get_num_threads()} torch threads)"


def run_info(command_line: str) -> dict[str, Any]:
    """What to record about a run: the command line, versions, platform, start time."""
    from .. import __version__

    return {
        "command_line": command_line,
        "pasta_engine_version": __version__,
        "python_version": platform.python_version(),
        "platform": platform.platform(),
        "started_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }


def _bar(total: int, desc: str, disable: bool = False):
    from tqdm import tqdm

    return tqdm(total=total, unit="prompt", desc=desc, file=sys.stderr, dynamic_ncols=True, disable=disable)


def _write_json(path: Path, obj: Any) -> None:
    path.write_text(json.dumps(obj, indent=2) + "\n")


def _geo(values: Sequence[float | None]) -> float | None:
    """Geometric mean of the positive values (an answer without content has content speedup 0
    and is left out: summaries count those as ``empty_answers``), None when there is none."""
    return geomean_positive(values)


def count_tokens_fn(tokenizer: Any) -> Callable[[str], int]:
    """Token counter for promise lengths: the tokenizer's, or :func:`approx_token_count`."""
    if tokenizer is None:
        return approx_token_count
    return lambda text: len(tokenizer.encode(text, add_special_tokens=False))


def annotate_rows(rows: Sequence[PromptRow], name: str, count_tokens: Callable[[str], int] | None = None,
                  engine: Any = None, params: SamplingParams | None = None, endpoint: Any = None) -> list[TraceRow]:
    """Trace rows for ``rows`` annotated with ``name`` (``sot``/``apar``/``mixed`` annotate each
    row's ``output``, which must be present; ``model`` lets ``engine``'s model answer in pasta
    mode with ``params``; ``endpoint`` has the model behind ``endpoint``, a
    :class:`~pasta_engine.tools.endpoint.ChatEndpoint`, annotate each ``output``, and a row whose
    annotation fails the check keeps its answer unannotated with the reason in ``note``).
    Raises BenchError for a missing engine, endpoint or ``output``; the endpoint's EndpointError."""
    out: list[TraceRow] = []
    if name == "endpoint" and endpoint is None:
        raise BenchError("the endpoint annotator needs an endpoint (--endpoint-url and --endpoint-model)")
    if name == "model":
        if engine is None:
            raise BenchError("the model annotator needs an engine")
        anns = annotate_with_model(engine, [r.instruction for r in rows], params, progress=True)
        for i, (r, a) in enumerate(zip(rows, anns)):
            out.append(TraceRow(r.instruction, a.annotated, "model", response=clean_text(a.annotated),
                                promises=a.promises, index=i, dataset=r.dataset, note=a.note))
        return out
    bar = _bar(len(rows), f"annotating ({name})")
    try:
        for i, r in enumerate(rows):
            if r.output is None:
                raise BenchError(f"row {i} has no 'output' to annotate")
            if name == "endpoint":
                from .annotate_endpoint import annotate_with_endpoint

                a = annotate_with_endpoint(endpoint, r.instruction, r.output, count_tokens or approx_token_count)
            else:
                a = annotate(r.output, name, count_tokens or approx_token_count)
            out.append(TraceRow(r.instruction, a.annotated, name, response=r.output, promises=a.promises,
                                index=i, dataset=r.dataset, note=a.note))
            bar.update(1)
    finally:
        bar.close()
    return out


def dialect_annotator(dialect: str) -> Callable[[str, Callable[[str], int]], str]:
    """The annotator that writes dialect ``dialect`` (not ``pasta``, whose annotators are
    :data:`~pasta_engine.tools.annotate.ANNOTATORS`, ``--annotator``): ``apar``:
    :func:`pasta_engine.tools.annotate_apar.apar_trace` (the APAR dialect's ``[Fork]`` markers,
    not PASTA-LANG's ``--annotator apar``); ``multiverse``:
    :func:`pasta_engine.tools.annotate_multiverse.multiverse_trace`. Each is ``(text,
    count_tokens) -> annotated`` whose clean text is ``text``.

    Raises BenchError naming ``--dialect`` for ``pasta``, an unknown name, or an annotator whose
    module is not installed."""
    if dialect == "apar":
        from .annotate_apar import apar_trace

        return apar_trace
    if dialect == "multiverse":
        try:
            from .annotate_multiverse import multiverse_trace
        except ImportError as e:
            raise BenchError(f"--dialect multiverse needs pasta_engine.tools.annotate_multiverse, which cannot be "
                             f"imported ({e}); use --traces FILE with Multiverse traces, or another --dialect") from None
        return multiverse_trace
    raise BenchError(f"--dialect {dialect!r} has no dialect annotator (pasta annotates with --annotator; "
                     "dialects with one: apar, multiverse)")


def annotate_rows_in_dialect(rows: Sequence[PromptRow], dialect: str,
                             count_tokens: Callable[[str], int] | None = None) -> list[TraceRow]:
    """Trace rows for ``rows`` (each with an ``output``) annotated by :func:`dialect_annotator`
    (``dialect``): the trace's ``annotator`` is ``dialect:NAME`` and ``promises`` its forks (the
    threads a replay forks: :func:`trace_forks`; a Multiverse block forks one per path).
    Raises BenchError for a row without ``output`` and as :func:`dialect_annotator`."""
    annotate_fn = dialect_annotator(dialect)
    count = count_tokens or approx_token_count
    out: list[TraceRow] = []
    bar = _bar(len(rows), f"annotating (dialect {dialect})")
    try:
        for i, r in enumerate(rows):
            if r.output is None:
                raise BenchError(f"row {i} has no 'output' to annotate")
            annotated = annotate_fn(r.output, count)
            forks = trace_forks(annotated, dialect)
            out.append(TraceRow(r.instruction, annotated, f"dialect:{dialect}", response=r.output, promises=forks,
                                index=i, dataset=r.dataset,
                                note=None if forks else f"dialect {dialect}: left unannotated"))
            bar.update(1)
    finally:
        bar.close()
    return out


def trace_forks(annotated: str, dialect: str = "pasta") -> int:
    """The threads a pasta replay of ``annotated`` (written in ``dialect``) forks at unlimited
    width and depth: every branch of every fork that has a chunk in the trace, nested ones
    included (a Multiverse block forks one thread per path, inside a path too; a PASTA-LANG or
    APAR fork marker without its chunk forks none), as
    :func:`pasta_engine.core.replay.replay_script` counts them. Never raises on content;
    raises ValueError for an unknown dialect name (:func:`~pasta_engine.lang.dialect.get_dialect`)."""
    from ..lang.dialect import TraceFork, get_dialect

    lang = get_dialect(dialect)
    tree = lang.split_tree(annotated)
    if tree is None:  # a flat dialect: one thread per fork marker with a chunk
        return sum(1 for c in lang.split_threads(annotated).chunks if c.content is not None)

    def forks(t: Any) -> int:
        return sum(1 + forks(b) for it in t.items if isinstance(it, TraceFork) for b in it.branches if b is not None)

    return forks(tree)


def trace_sha256(annotated: str) -> str:
    """SHA-256 hex digest of an annotated response's UTF-8 text: what identifies a ``bench
    speedup`` row's input (``annotated_sha256``, checked by ``--resume``)."""
    return hashlib.sha256(annotated.encode("utf-8", "surrogatepass")).hexdigest()


def sampling_record(params: SamplingParams) -> dict[str, Any]:
    """``params``' fields as JSON values (tuples as lists): what identifies a ``bench pareto``
    row's input besides its prompt (``sampling``, checked by ``--resume``)."""
    return json.loads(json.dumps({f.name: getattr(params, f.name) for f in dataclasses.fields(params)}, default=str))


def _fastest(results: Sequence[Any]) -> Any:
    """The run with the least wall time among repeats of the same request (the minimum is
    the estimate least disturbed by other work on the machine)."""
    return min(results, key=lambda r: r.stats.wall_s)


# --------------------------------------------------------------------------- repeats and spread

#: What a mode-comparing command reports of its repeated runs (every one of them: ``generate`` and
#: ``replay --mode both``, ``bench speedup``, ``bench pareto``): each side's fastest run (the
#: estimate least disturbed by other work on the machine), the realized speedup as the ratio of
#: the two fastest wall times, and beside it the spread: min / median / max of each side's wall
#: times and of the per-repeat realized speedups (run i of one side over run i of the other).
TIMING_STATISTIC = "fastest of the repeats per side; spread: min/median/max of the runs"

#: Repeats of each side when nobody says: enough for a spread (a median and a range), few enough
#: for a CPU.
DEFAULT_REPEATS = 3


def spread(values: Sequence[float]) -> dict[str, float]:
    """``{"min", "median", "max"}`` of ``values`` (at least one)."""
    import statistics

    return {"min": min(values), "median": statistics.median(values), "max": max(values)}


def timed_runs(repeats: int, pasta: Callable[[], Any], clean: Callable[[Any], Any],
               sequential: Callable[[], Any] | None = None,
               replay: Callable[[Any], Any] | None = None,
               prime: Callable[[], Any] | None = None) -> dict[str, list[Any]]:
    """``repeats`` runs of each side of one prompt, interleaved (run i of every side one after
    the other, so a change in the machine's other load falls on all sides alike): ``pasta()``
    (a replay, or a generation), then ``replay(first pasta result)`` when given (a generated
    answer's annotated text replayed in pasta mode), then ``clean(first pasta result)`` (its
    clean text decoded sequentially), then ``sequential()`` when given (a sequential answer of
    its own, for the end-to-end speedup).

    First, untimed, ``prime()`` (default: one run of every side, in the same order, its results
    dropped): with prefix caching on (the engine's default) the first run of a prompt prefills
    it and every later run reads it from the cache, so without this run the first pasta run
    alone would pay the prompt's prefill. ``prime`` must leave the prompt in the cache of every
    engine and mode the sides run (e.g. short generations of each mode, as a warm-up does).

    Give ``replay`` whenever ``pasta`` samples: the realized content speedup then sets the
    replay against the clean text's replay, both forced, so both sides do the same work (a
    sampled generation against a forced replay charges temperature, top-p, penalties and
    grammar masks to the pasta side alone; answers that never forked read 0.77-0.83x).

    Returns ``{"pasta": [...], "pasta_replay": [...], "clean_text_sequential": [...],
    "sequential": [...]}`` (``pasta_replay`` only with ``replay``, ``sequential`` only with
    ``sequential``): :class:`~pasta_engine.RequestResult` lists, one per repeat."""
    runs: dict[str, list[Any]] = {"pasta": []}
    if replay is not None:
        runs["pasta_replay"] = []
    runs["clean_text_sequential"] = []
    if sequential is not None:
        runs["sequential"] = []
    if prime is not None:
        prime()
    else:
        first = pasta()
        if replay is not None:
            replay(first)
        clean(first)
        if sequential is not None:
            sequential()
    for _ in range(repeats):
        runs["pasta"].append(pasta())
        if replay is not None:
            runs["pasta_replay"].append(replay(runs["pasta"][0]))
        runs["clean_text_sequential"].append(clean(runs["pasta"][0]))
        if sequential is not None:
            runs["sequential"].append(sequential())
    return runs


def content_side(runs: dict[str, list[Any]]) -> str:
    """The side of :func:`timed_runs` the realized content speedup sets against the clean
    text: ``pasta_replay`` when there is one, else ``pasta`` (already a replay)."""
    return "pasta_replay" if "pasta_replay" in runs else "pasta"


def realized_beyond_theoretical(realized: float, theoretical: float, paired: Sequence[float],
                                ideal: float | None = None) -> str | None:
    """A warning when the realized content speedup exceeds its ideal by more than the measured
    spread (max - min of the per-repeat realized speedups ``paired``; 0 with one run). The ideal
    is ``ideal``, the step speedup (sequential / pasta decode steps: what the realized speedup
    is when every step costs the same), or the theoretical content speedup ``theoretical`` when
    no step counts are given. The step speedup is a little above the theoretical one: the
    sequential side also decodes its end-of-sequence step, (content tokens + 1) / critical path
    at unlimited width. No engine runs faster than its steps allow, so a figure beyond it
    measures something else (a cold first run, other load on the machine). None when it does
    not exceed it (or there is no theoretical speedup: an answer without content)."""
    if not theoretical or theoretical <= 0:
        return None
    ceiling = theoretical if ideal is None else ideal
    width = max(paired) - min(paired) if paired else 0.0
    if realized - ceiling <= width:
        return None
    what = (f"its ideal {ceiling:.2f}x (the step speedup, sequential / pasta decode steps; theoretical "
            f"{theoretical:.2f}x)" if ideal is not None else f"the theoretical {theoretical:.2f}x")
    return (f"realized content speedup {realized:.2f}x exceeds {what} by more than the measured spread "
            f"({min(paired):.2f}x to {max(paired):.2f}x over {len(paired)} runs): the timing is disturbed (other load, a "
            "cold engine); rerun with more --repeats or on a quiet machine")


#: What :func:`realized_beyond_theoretical`'s warnings say (this version's and the earlier
#: "exceeds the theoretical"), for :func:`timing_summary` to find them in a row's ``timing``.
_BEYOND = ("exceeds its ideal", "exceeds the theoretical")


def _step_speedup_of(clean: Any, pasta: Any) -> float | None:
    """Sequential / pasta decode steps of two results, None when either has no step count
    (``stats.decode_steps``)."""
    try:
        return step_speedup(clean.stats.decode_steps, pasta.stats.decode_steps)
    except (AttributeError, TypeError, ValueError):
        return None


def timing_record(runs: dict[str, list[Any]], theoretical: float) -> tuple[dict[str, Any], dict[str, Any]]:
    """The fastest result of each side of :func:`timed_runs`, and the row's ``timing`` record:
    ``statistic``, ``runs``, ``wall_s`` (every run, per side), ``wall_s_spread`` and
    ``realized_content_speedup_spread`` (:func:`spread`; per-repeat ratios of the clean text's
    run over the :func:`content_side`'s in ``realized_content_speedup_runs``; ``theoretical``
    is that side's content speedup), ``step_speedup`` (the fastest runs' sequential / pasta
    decode steps: the ideal realized speedup; None when the results carry no step counts),
    ``cached_tokens`` and ``prefill_tokens`` (every run's prompt tokens read from the prefix
    cache and tokens prefilled, per side; only when the results carry them),
    ``end_to_end_speedup_spread`` with a sequential side (``pasta`` against ``sequential``),
    ``same_tokens`` (every repeat decoded the same tokens; False: the fastest may be another
    answer) and ``warnings`` (:func:`realized_beyond_theoretical` against the step speedup when
    known, else the theoretical one; differing repeats)."""
    fastest = {side: _fastest(rs) for side, rs in runs.items()}
    side = content_side(runs)
    paired = [realized_speedup(c.stats.wall_s, p.stats.wall_s)
              for p, c in zip(runs[side], runs["clean_text_sequential"])]
    realized = realized_speedup(fastest["clean_text_sequential"].stats.wall_s, fastest[side].stats.wall_s)
    ideal = _step_speedup_of(fastest["clean_text_sequential"], fastest[side])
    record: dict[str, Any] = {
        "statistic": TIMING_STATISTIC,
        "runs": len(runs["pasta"]),
        "wall_s": {side: [r.stats.wall_s for r in rs] for side, rs in runs.items()},
        "wall_s_spread": {side: spread([r.stats.wall_s for r in rs]) for side, rs in runs.items()},
        "realized_content_speedup_runs": paired,
        "realized_content_speedup_spread": spread(paired),
        "step_speedup": ideal,
    }
    for key in ("cached_tokens", "prefill_tokens"):
        if all(hasattr(r.stats, key) for rs in runs.values() for r in rs):
            record[key] = {side: [getattr(r.stats, key) for r in rs] for side, rs in runs.items()}
    if "sequential" in runs:
        record["end_to_end_speedup_spread"] = spread([realized_speedup(q.stats.wall_s, p.stats.wall_s)
                                                      for p, q in zip(runs["pasta"], runs["sequential"])])
    record["same_tokens"] = all(r.token_ids == rs[0].token_ids for rs in runs.values() for r in rs)
    warnings = [w for w in [realized_beyond_theoretical(realized, theoretical, paired, ideal)] if w]
    if not record["same_tokens"]:
        warnings.append("the repeats decoded different tokens (sampling without a fixed seed?): the fastest run of a "
                        "side may be a shorter answer")
    record["warnings"] = warnings
    return fastest, record


def fork_warnings(answers: int, forked: int, geo_all: float | None, geo_forked: float | None) -> list[str]:
    """Warnings for a summary's geomean realized content speedup taken over answers that never
    forked (a PASTA answer without a promise ran no thread in parallel: its realized speedup is
    noise and overhead, not PASTA): none forked, or some did not (with the forked-only figure)."""
    if not answers or geo_all is None:
        return []
    if forked == 0:
        return [f"none of the {answers} answers forked: the geomean realized content speedup {geo_all:.2f}x measures no "
                "parallel decoding (noise and the engine's overhead only)"]
    if forked < answers:
        only = "n/a" if geo_forked is None else f"{geo_forked:.2f}x"
        return [f"{answers - forked} of {answers} answers never forked: the geomean realized content speedup over all "
                f"answers ({geo_all:.2f}x) counts them; over the {forked} forked answers alone it is {only}"]
    return []


def timing_summary(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Aggregates of the rows' ``timing`` records (rows without one are left out): the geometric
    means over prompts of each prompt's min / median / max per-repeat realized content speedup,
    the median over prompts of each side's relative wall-time spread ((max - min) / min), and
    the rows whose realized speedup exceeded its ideal beyond their spread
    (:func:`realized_beyond_theoretical`). A summary passes the rows its means are over."""
    import statistics

    timed = [r for r in rows if r.get("timing")]
    if not timed:
        return {}
    sides = list(timed[0]["timing"]["wall_s_spread"])
    return {
        "statistic": TIMING_STATISTIC,
        "runs_per_side": timed[0]["timing"]["runs"],
        "geomean_realized_content_speedup_spread": {
            k: geomean_positive(r["timing"]["realized_content_speedup_spread"][k] for r in timed)
            for k in ("min", "median", "max")},
        "median_relative_wall_spread": {
            side: statistics.median((s["max"] - s["min"]) / s["min"] if s["min"] > 0 else 0.0
                                    for s in (r["timing"]["wall_s_spread"][side] for r in timed))
            for side in sides},
        "realized_beyond_theoretical": [r.get("index", i) for i, r in enumerate(timed)
                                        if any(b in w for w in r["timing"]["warnings"] for b in _BEYOND)],
    }


def _has(row: Any, dotted: str) -> bool:
    """Whether ``row`` has the key path ``dotted`` (``"a.b"``: ``row["a"]["b"]``)."""
    for key in dotted.split("."):
        if not isinstance(row, dict) or key not in row:
            return False
        row = row[key]
    return True


#: What a resumed row's input key is set by, for the error that refuses another (:func:`resumed_rows`).
_INPUT_FLAGS = {
    "sampling": "sampling flags",
    "run_inputs": "adapter, lora scale, sampling flags and baseline",
    "model_inputs": "model flags (--model or --preset, --dtype, --adapter, --lora-scale, --baseline and the PASTA "
                    "flags)",
}


def _read_rows(path: Path) -> list[dict[str, Any]]:
    """The rows of a ``prompts.jsonl`` (a truncated last line, the one an interrupted run was
    writing, is dropped; so is every line after it)."""
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            break  # the line an interrupted run was writing
    return rows


def _check_row_inputs(path: Path, i: int, row: dict[str, Any], inputs: dict[str, Any]) -> None:
    """Raise BenchError unless row ``i`` (0-based) of ``path`` holds every key of ``inputs``
    with that value (see :func:`resumed_rows`)."""
    for key, want in inputs.items():
        if key not in row:
            raise BenchError(f"--resume: {path} row {i + 1} has no {key!r}: it was written by an older pasta-engine "
                             "that did not record its inputs, so this run cannot tell whether they are its own; "
                             f"remove {path} (or run into another --out) to measure again")
        if row[key] != want:
            same = _INPUT_FLAGS.get(key, "traces, annotator and --dialect")
            raise BenchError(f"--resume: {path} row {i + 1} was measured with other inputs than this run's prompt "
                             f"{i + 1} ({_difference(key, row[key], want)}): remove {path} (or run into another "
                             f"--out) to measure these inputs, or resume with the same {same}")


def check_resumed_inputs(out: Path, resume: bool, inputs: dict[str, Any]) -> None:
    """With ``resume``: refuse the rows of ``out/prompts.jsonl`` unless each holds ``inputs``,
    the inputs every row of a run shares (``model_inputs``: the model and the settings that
    change what is measured). A command calls it before its model loads, so that a resume with
    another model is refused before any work; :func:`resumed_rows` checks the same again with
    each row's own inputs. Raises BenchError as :func:`resumed_rows` does (naming the file, the
    row and, for ``model_inputs``, each flag that differs with both values)."""
    path = out / "prompts.jsonl"
    if not resume or not path.exists():
        return
    for i, row in enumerate(_read_rows(path)):
        _check_row_inputs(path, i, row, inputs)


def resumed_rows(out: Path, prompts: Sequence[str], resume: bool, need: str | None = None,
                 inputs: Sequence[dict[str, Any]] | None = None) -> list[dict[str, Any]]:
    """With ``resume``: the rows of ``out/prompts.jsonl`` from an earlier run of the same
    prompts (checked in order; a truncated last line is dropped) and, with ``inputs`` (one dict
    per prompt), the same inputs: row i must hold every key of ``inputs[i]`` with that value
    (``bench speedup``: ``annotated_sha256``, :func:`trace_sha256`, ``annotator`` and
    ``dialect``; ``bench pareto``: ``sampling``, :func:`sampling_record`; both, from the
    command line: ``model_inputs``, the model and the settings that change what is measured).

    Raises BenchError naming the file and row, and saying to remove the file (or use another
    ``--out``) or to resume with the same inputs: when a row is for another prompt; when it
    lacks the key path ``need`` (``"a.b"`` for a nested key) or a key of ``inputs[i]`` (a row
    written by an older version, whose figures this one does not compute the same way or whose
    inputs it did not record); when an input differs (naming the fields that differ, with both
    values)."""
    path = out / "prompts.jsonl"
    if not resume or not path.exists():
        return []
    rows = _read_rows(path)
    if len(rows) > len(prompts):
        raise BenchError(f"--resume: {path} has {len(rows)} rows but this run has {len(prompts)} prompts")
    for i, row in enumerate(rows):
        got = row.get("prompt", row.get("instruction"))
        if got != prompts[i]:
            raise BenchError(f"--resume: {path} row {i + 1} is for another prompt than this run's prompt {i + 1}")
        if need is not None and not _has(row, need):
            raise BenchError(f"--resume: {path} row {i + 1} has no {need!r} (written by an older pasta-engine); "
                             "run again without --resume or into another --out")
        _check_row_inputs(path, i, row, inputs[i] if inputs is not None else {})
    return rows


def check_prompts(engine: Any, prompts: Sequence[Any], mode: str, *, params: SamplingParams | None = None,
               responses: Sequence[str] | None = None, dialect: Any = "pasta",
               indices: Sequence[int | None] | None = None) -> None:
    """Make every check ``engine.add_request`` would make of each prompt (with ``responses``:
    each a replay of its response) in ``mode`` and take nothing
    (:meth:`~pasta_engine.Engine.check_request`): a run calls it before its first decode, so a
    prompt too long for the model's context (or the KV cache) is refused before any row is
    measured or any file written, naming its place in the list (``indices[i]``, default ``i``;
    0-based, as the rows' ``index``). Raises ContextLengthError (a ParameterError) or
    ParameterError, naming ``prompt {index}``."""
    from ..engine.input_processor import RequestInputs

    for i, prompt in enumerate(prompts):
        index = indices[i] if indices is not None and indices[i] is not None else i
        engine.check_request(RequestInputs(prompt, params, mode, annotated_response=None if responses is None
                                           else responses[i], dialect=dialect, index=index))


def _difference(key: str, there: Any, here: Any) -> str:
    """What differs between a resumed row's input ``key`` (``there``) and this run's (``here``),
    in a few words (the fields that differ, for a dict; a digest's first 12 characters)."""
    if isinstance(there, dict) and isinstance(here, dict):
        def flat(d: dict, at: str = "") -> dict:  # nested fields as dotted names (sampling.max_new_tokens)
            return {k2: v2 for k, v in d.items()
                    for k2, v2 in (flat(v, f"{at}{k}.") if isinstance(v, dict) else {f"{at}{k}": v}).items()}

        ft, fh = flat(there), flat(here)
        fields = [k for k in dict.fromkeys([*ft, *fh]) if ft.get(k) != fh.get(k)]
        return f"{key}: " + ", ".join(f"{k} {ft.get(k)!r} there, {fh.get(k)!r} here" for k in fields)
    if key.endswith("sha256") and isinstance(there, str) and isinstance(here, str):
        return f"{key} {there[:12]}... there, {here[:12]}... here: another annotated response"
    return f"{key} {there!r} there, {here!r} here"


def warmup_traces(traces: Sequence[TraceRow], dialect: str = "pasta") -> list[TraceRow]:
    """The first trace and the one with the most forks (read in ``dialect``, counted as a replay
    forks: :func:`trace_forks`): replaying both before timing warms up whatever the engine
    prepares per shape or per thread count (kernel compilation, CUDA graph capture for each
    bucket of live threads up to the widest the run reaches)."""
    widest = max(traces, key=lambda t: trace_forks(t.annotated_response, dialect))
    return [traces[0]] if widest is traces[0] else [traces[0], widest]


def _measure_rows(out: Path, items: Sequence[Any], rows: list[dict[str, Any]],
                  measure: Callable[[int, Any], dict[str, Any]], desc: str,
                  postfix: Callable[[dict[str, Any]], dict[str, str]], progress: bool = True) -> None:
    """Measure the items after the ``rows`` already kept, appending each new row to ``rows``
    and to ``out/prompts.jsonl`` as soon as it is measured (the file first gets the kept rows;
    a killed run leaves at most a truncated last line, which resume drops). The bar (off
    without ``progress``) shows ``postfix(row)`` and the pasta runs' tokens decoded per second
    (the fastest run of each prompt measured so far)."""
    bar = _bar(len(items), desc, disable=not progress)
    bar.update(len(rows))
    tokens, wall = 0, 0.0
    try:
        with (out / "prompts.jsonl").open("w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
            f.flush()
            for i, item in list(enumerate(items))[len(rows):]:
                row = measure(i, item)
                rows.append(row)
                f.write(json.dumps(row) + "\n")
                f.flush()
                tokens += row.get("tokens_decoded", row.get("tokens_pasta", 0))
                wall += row.get("wall_s", 0.0)
                bar.update(1)
                bar.set_postfix(**postfix(row), tok_s=f"{tokens / wall:.1f}" if wall > 0 else "n/a")
    finally:
        bar.close()


# --------------------------------------------------------------------------- speedup (replay)


def clean_text_replay(engine: Any, prompt: Any, pasta: Any, repeats: int = 1, dialect: str = "pasta") -> Any:
    """The sequential side of the realized content speedup: the pasta answer's clean text
    (``pasta.text``: tags stripped, no tag tokens) replayed in sequential mode on ``engine``
    (same weights, same prompt, read in ``dialect``), the fastest of ``repeats`` runs."""
    return _fastest([engine.replay([prompt], [pasta.text], mode="sequential", dialect=dialect)[0]
                     for _ in range(repeats)])


def speedup_row(seq: Any, pasta: Any) -> dict[str, Any]:
    """Per-prompt numbers from a pasta replay of a trace (``pasta``) and a sequential replay of
    its clean text (``seq``, :func:`clean_text_replay`), :class:`~pasta_engine.RequestResult`
    each (docs/DESIGN.md section 3).

    ``content_tokens``: tokens of the clean text (no tags, no EOS; the sequential replay takes
    one more step, its EOS); ``content_speedup``: content tokens / critical path (theoretical);
    ``realized_content_speedup``: sequential (clean text) / pasta wall seconds;
    ``realized_over_theoretical``: realized / theoretical content speedup; ``step_speedup``:
    sequential / pasta decode steps; ``tokens_decoded``: tokens sampled by all threads in pasta
    mode, tags and EOS included; ``tag_tokens``: those that are not content (nor EOS);
    ``token_parallelism``: tokens decoded / critical path; ``prefill_tokens`` and
    ``cached_tokens`` (``_sequential`` for the other side): tokens prefilled, and prompt tokens
    read from the prefix cache instead; ``same_text``: the sequential replay's text equals the
    pasta answer's."""
    s, q = pasta.stats, seq.stats
    realized = realized_speedup(q.wall_s, s.wall_s)
    return {
        "content_tokens": s.content_tokens,
        "content_speedup": s.content_speedup,
        "realized_content_speedup": realized,
        "realized_over_theoretical": realized_over_theoretical(realized, s.content_speedup) if s.content_speedup else None,
        "step_speedup": step_speedup(q.decode_steps, s.decode_steps),
        "tokens_decoded": s.tokens_decoded,
        "tag_tokens": s.tag_tokens,
        "token_parallelism": s.token_parallelism,
        "tokens_sequential": q.tokens_decoded,
        "decode_steps": s.decode_steps,
        "decode_steps_sequential": q.decode_steps,
        "critical_path": s.critical_path,
        "wall_s": s.wall_s,
        "wall_s_sequential": q.wall_s,
        "threads": s.threads,
        "forks": s.forks,
        "max_width": s.max_width,
        "prefill_tokens": s.prefill_tokens,
        "prefill_tokens_sequential": q.prefill_tokens,
        "cached_tokens": s.cached_tokens,
        "cached_tokens_sequential": q.cached_tokens,
        "preemptions": s.preemptions + q.preemptions,
        "same_text": seq.text == pasta.text,
        "diagnostics": list(pasta.diagnostics[:10]),
    }


def summarize_speedup(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Aggregates of :func:`speedup_row` rows: geometric means over prompts (the paper's
    aggregate, Jin et al. 2025, section 5) of the content speedups, the ratio, step speedup and
    token parallelism (answers without content left out and counted in ``empty_answers``); the
    tag-token fraction (tag tokens / tokens decoded, all prompts); totals and content
    throughputs (content tokens / second) per mode; the same geometric means over forked
    responses only; the spread of the repeats (``timing``, :func:`timing_summary`) and
    ``warnings`` (:func:`summary_warnings`). Every mean, spread and fork count beside the
    headline is over the same answers, those with content (:func:`_with_content`):
    ``forked_responses`` counts those that forked (the answers of ``forked_only``); the thread
    counts and totals are over every prompt. Raises ValueError for no rows."""
    if not rows:
        raise ValueError("no rows to summarize")
    full = _with_content(rows)
    forked = [r for r in full if r["forks"] > 0]

    def geos(rs: Sequence[dict[str, Any]]) -> dict[str, Any]:
        full = _with_content(rs)  # every mean over the same answers
        return {
            "geomean_content_speedup": _geo([r["content_speedup"] for r in full]),
            "geomean_realized_content_speedup": _geo([r["realized_content_speedup"] for r in full]),
            "geomean_realized_over_theoretical": _geo([r["realized_over_theoretical"] for r in full]),
            "geomean_step_speedup": _geo([r["step_speedup"] for r in full]),
            "geomean_token_parallelism": _geo([r["token_parallelism"] for r in full]),
            "tag_token_fraction": tag_token_fraction(sum(r["tag_tokens"] for r in rs),
                                                     sum(r["tokens_decoded"] for r in rs)),
        }

    wall_p = sum(r["wall_s"] for r in rows)
    wall_s = sum(r["wall_s_sequential"] for r in rows)
    content = sum(r["content_tokens"] for r in rows)
    return {
        "prompts": len(rows),
        "forked_responses": len(forked),
        "mean_threads": sum(r["threads"] for r in rows) / len(rows),
        "max_threads_seen": max(r["threads"] for r in rows),
        **geos(rows),
        "empty_answers": sum(1 for r in rows if r["content_tokens"] == 0),
        "content_tokens_total": content,
        "tokens_decoded_total": sum(r["tokens_decoded"] for r in rows),
        "wall_s_total": wall_p,
        "wall_s_total_sequential": wall_s,
        "content_tokens_per_s": content / wall_p if wall_p > 0 else None,
        "content_tokens_per_s_sequential": content / wall_s if wall_s > 0 else None,
        "text_mismatches": sum(1 for r in rows if not r["same_text"]),
        "forked_only": geos(forked) if forked else None,
        "timing": timing_summary(full),
        "warnings": _summary_warnings(rows),
    }


def summary_warnings(answers: int, forked: int, geo_all: float | None, geo_forked: float | None,
                     timing: dict[str, Any]) -> list[str]:
    """A summary's warnings: :func:`fork_warnings` of its geomean realized content speedup
    (``geo_all`` over ``answers``, ``geo_forked`` over the ``forked`` ones among them), and the
    prompts whose realized speedup exceeded its ideal (the step speedup) beyond their spread
    (``timing``: :func:`timing_summary`)."""
    out = fork_warnings(answers, forked, geo_all, geo_forked)
    beyond = timing.get("realized_beyond_theoretical") or []
    if beyond:
        shown = ", ".join(map(str, beyond[:10])) + (", ..." if len(beyond) > 10 else "")
        out.append(f"{len(beyond)} of {answers} prompts have a realized content speedup above its ideal (the step "
                   f"speedup, sequential / pasta decode steps) by more than their measured spread (prompts {shown}): "
                   "their timing is disturbed")
    return out


def _with_content(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The rows whose answer has content (content speedup > 0): every speedup mean of a summary
    is over these, the theoretical one's answers (the others count as ``empty_answers``)."""
    return [r for r in rows if r["content_speedup"] > 0]


def _both_answers(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The :func:`pareto_row` rows whose two answers both have content: the end-to-end speedup,
    the length ratio and the throughput ratio are taken over these (an empty answer has a
    length ratio of 0 or none, and its latency is no speedup)."""
    return [r for r in rows if r["content_tokens_pasta"] > 0 and r["content_tokens_sequential"] > 0]


def _summary_warnings(rows: Sequence[dict[str, Any]]) -> list[str]:
    """:func:`summary_warnings` of :func:`speedup_row` or :func:`pareto_row` rows, every input
    over the answers with content (the summary's means): their count, those that forked, both
    geomeans and the timing."""
    full = _with_content(rows)
    forked = [r for r in full if r["forks"] > 0]
    return summary_warnings(len(full), len(forked), _geo([r["realized_content_speedup"] for r in full]),
                            _geo([r["realized_content_speedup"] for r in forked]), timing_summary(full))


def plot_speedup(rows: Sequence[dict[str, Any]], path: Path, title: str = "") -> Path:
    """PNG with two panels: realized vs theoretical content speedup per prompt (y = x line),
    and a histogram of threads per response. The geomeans written on the first panel are the
    summary's (:func:`summarize_speedup`: over the answers with content, whose count it gives
    with the empty ones left out). Uses matplotlib's Agg canvas (no display, no global pyplot
    state). Raises ImportError with the install command when matplotlib is missing."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
        from matplotlib.ticker import MaxNLocator
    except ImportError as e:
        raise ImportError("the speedup plot needs matplotlib: pip install 'pasta-engine[bench]'") from e

    fig = Figure(figsize=(11, 4.5), layout="constrained")
    FigureCanvasAgg(fig)
    ax1, ax2 = fig.subplots(1, 2)
    th = [r["content_speedup"] for r in rows]
    re_ = [r["realized_content_speedup"] for r in rows]
    forked = [r["forks"] > 0 for r in rows]
    ax1.scatter([t for t, f in zip(th, forked) if f], [r for r, f in zip(re_, forked) if f], s=14, alpha=0.7,
                label="forked")
    ax1.scatter([t for t, f in zip(th, forked) if not f], [r for r, f in zip(re_, forked) if not f], s=14,
                alpha=0.7, marker="x", label="no promise")
    hi = max([1.0, *th, *re_]) * 1.05
    lo = min([1.0, *th, *re_]) * 0.95
    ax1.plot([lo, hi], [lo, hi], "k--", lw=1, label="y = x")
    ax1.set_xlabel("content speedup, theoretical (content tokens / critical path)")
    ax1.set_ylabel("content speedup, realized (clean text sequential / pasta wall time)")
    ax1.set_title("realized vs theoretical content speedup per prompt")
    full = _with_content(rows)  # the summary's answers
    geo_th = _geo([r["content_speedup"] for r in full])
    geo_re = _geo([r["realized_content_speedup"] for r in full])
    empty = len(rows) - len(full)
    ax1.text(0.98, 0.03, f"geomean: theoretical {geo_th or 0:.2f}x, realized {geo_re or 0:.2f}x\n{len(full)} prompts"
             + (f" ({empty} empty answers left out)" if empty else ""),
             transform=ax1.transAxes, ha="right", va="bottom", fontsize=8)
    ax1.legend(loc="upper left", fontsize=8)
    threads = [r["threads"] for r in rows]
    bins = [b - 0.5 for b in range(1, max(threads) + 2)]
    ax2.hist(threads, bins=bins, edgecolor="black")
    ax2.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax2.set_xlabel("threads per response (main + forks)")
    ax2.set_ylabel("responses")
    ax2.set_title("threads per response")
    if title:
        fig.suptitle(title, fontsize=9)
    fig.savefig(path, dpi=110)
    return path


def plot_or_warn(rows: Sequence[dict[str, Any]], path: Path, title: str) -> None:
    """:func:`plot_speedup`, or a warning on stderr when matplotlib is missing."""
    try:
        plot_speedup(rows, path, title)
    except ImportError as e:
        print(f"pasta-engine: warning: no plot written: {e}", file=sys.stderr)


def run_speedup(engine: Any, traces: Sequence[TraceRow], out: Path, settings: dict[str, Any], *, warmup: int = 1,
                repeats: int = DEFAULT_REPEATS, resume: bool = False, progress: bool = True,
                dialect: str = "pasta", model_inputs: dict[str, Any] | None = None,
                traces_file: Path | None = None) -> dict[str, Any]:
    """Replay every trace in pasta mode, and its clean text sequentially (see the module
    docstring); write ``prompts.jsonl``, ``summary.json`` and ``speedup.png`` into ``out``.

    Args:
        engine: a :class:`pasta_engine.Engine` (batch 1: ``max_running_requests=1`` for timing).
        traces: the annotated traces.
        out: output folder (created).
        settings: what to record about the run (model, device, command line, ...); updated.
        warmup: untimed replays of :func:`warmup_traces` in each mode first.
        repeats: runs per prompt and mode, interleaved, after one untimed run of each (:func:`timed_runs`:
            both sides then find the prompt in the prefix cache); the fastest counts and the
            spread is recorded (:func:`timing_record`, :data:`TIMING_STATISTIC`).
        resume: keep the rows of an earlier run in ``out`` and run the rest; raises BenchError
            when those rows were measured from other inputs (another trace, annotator,
            dialect or ``model_inputs``) or by a version that did not record them
            (:func:`resumed_rows`).
        progress: a tqdm bar on stderr (prompts, decoded tokens/s of the pasta runs, tags included).
        dialect: the language the traces are written in (a name of
            :data:`~pasta_engine.lang.dialect.DIALECT_NAMES`): both sides replay with it, and
            ``settings``, the summary and each row record it.
        model_inputs: what identifies the model and the settings that change what is measured
            (JSON values; the command line's: each flag and its value): each row records it, and
            ``resume`` refuses rows that recorded another (or none). None: not recorded nor
            checked.
        traces_file: where to write ``traces`` (JSONL, :func:`~pasta_engine.tools.traces.write_traces`;
            ``bench speedup --annotator``'s ``out/traces.jsonl``), once every check above has
            passed and before the first replay, so that a refused run (a trace too long, a
            resume of other inputs) leaves the file an earlier run wrote as it was. None: not
            written.

    Raises BenchError (no traces, a resume of other inputs) and, before any replay or file,
    ContextLengthError naming ``prompt {index}`` for a trace whose prompt and response cannot
    fit the model's context or the KV cache (:func:`check_prompts`).

    Returns ``{"summary": ..., "settings": ...}`` as written to ``summary.json``; the summary's
    ``warnings`` (answers that never forked, realized beyond theoretical) are also printed on
    stderr by the command."""
    if not traces:
        raise BenchError("no traces to run")
    check_prompts(engine, [t.prompt for t in traces], "pasta", responses=[t.annotated_response for t in traces],
                  dialect=dialect, indices=[t.index for t in traces])
    out.mkdir(parents=True, exist_ok=True)
    same = {} if model_inputs is None else {"model_inputs": model_inputs}
    rows = resumed_rows(out, [t.prompt for t in traces], resume, need="content_speedup",
                        inputs=[{"annotated_sha256": trace_sha256(t.annotated_response), "annotator": t.annotator,
                                 "dialect": dialect, **same} for t in traces])
    if traces_file is not None:
        from .traces import write_traces

        write_traces(traces_file, traces)
    settings.update(resumed_rows=len(rows), warmup=warmup, repeats=repeats, timing_statistic=TIMING_STATISTIC,
                    batch_size=1, annotators=sorted({t.annotator for t in traces}), dialect=dialect,
                    sequential_side="the pasta answer's clean text (no tag tokens), replayed")
    if warmup and len(rows) < len(traces):
        engine.model_runner.warm_up()  # the CPU GEMM choices, for every row count a step may have
    for t in warmup_traces(traces, dialect) * (warmup if len(rows) < len(traces) else 0):
        clean_text_replay(engine, t.prompt,
                          engine.replay([t.prompt], [t.annotated_response], mode="pasta", dialect=dialect)[0],
                          dialect=dialect)
    result: dict[str, Any] = {}

    def measure(i: int, t: TraceRow) -> dict[str, Any]:
        runs = timed_runs(repeats,
                          lambda: engine.replay([t.prompt], [t.annotated_response], mode="pasta", dialect=dialect)[0],
                          lambda pas: engine.replay([t.prompt], [pas.text], mode="sequential", dialect=dialect)[0])
        fastest, timing = timing_record(runs, runs["pasta"][0].stats.content_speedup)
        return {"index": t.index if t.index is not None else i, "prompt": t.prompt, "annotator": t.annotator,
                "dialect": dialect, "annotated_sha256": trace_sha256(t.annotated_response),
                "promises": t.promises, "note": t.note,
                **speedup_row(fastest["clean_text_sequential"], fastest["pasta"]), "timing": timing, **same}

    try:
        _measure_rows(out, traces, rows, measure, "bench speedup",
                      lambda row: dict(content=f"{row['content_speedup']:.2f}x",
                                       realized=f"{row['realized_content_speedup']:.2f}x"), progress)
    finally:
        if rows:  # an interrupted run still leaves the aggregates of what it measured
            settings.update(prompts_planned=len(traces), complete=len(rows) == len(traces))
            result = {"summary": {**summarize_speedup(rows), "dialect": dialect}, "settings": settings}
            _write_json(out / "summary.json", result)
    plot_or_warn(rows, out / "speedup.png",
                 f"{settings.get('model', '')} on {settings.get('device_name', '')} ({settings.get('dtype', '')})")
    return result


# --------------------------------------------------------------------------- pareto (generate)


def _count(diags: Sequence[str], needle: str) -> int:
    return sum(1 for d in diags if needle in d)


def pareto_row(seq: Any, pasta: Any, clean_seq: Any = None, pasta_replay: Any = None) -> dict[str, Any]:
    """Per-prompt numbers from generate-mode sequential and pasta responses to one prompt
    (different answers), and optionally ``clean_seq``: the pasta answer's clean text replayed
    sequentially (:func:`clean_text_replay`), and ``pasta_replay``: its annotated text replayed
    in pasta mode, for the realized content speedup (both forced: the same work on both sides).

    Content first (docs/DESIGN.md section 3): ``content_speedup``: the pasta answer's content tokens
    / critical path; ``realized_content_speedup``: ``clean_seq`` / ``pasta_replay`` wall seconds
    (the pasta generation's without ``pasta_replay``; None without ``clean_seq``). End to end: ``end_to_end_speedup``: sequential / pasta wall seconds
    (different answers: a latency ratio), with ``length_ratio``: pasta / sequential content
    tokens (None when the sequential answer has none) and each side's finish reason (``length``:
    cut by the token budget); ``text_length_ratio``: the same in characters;
    ``throughput_ratio``: pasta / sequential content tokens per second (= end-to-end speedup x
    length ratio). ``step_speedup``: decode steps of ``clean_seq`` / of ``pasta_replay`` (else
    of the pasta generation), the same text on both sides (None without ``clean_seq``);
    ``end_to_end_step_speedup``: the sequential generation's steps / the pasta generation's
    (different answers). Then token parallelism, tag tokens, fork statistics: forks, threads, chunks
    capped or cut off by the interpreter, malformed tags."""
    s, q = pasta.stats, seq.stats
    content_wall = (pasta_replay or pasta).stats.wall_s
    e2e = realized_speedup(q.wall_s, s.wall_s)
    ratio = length_ratio(s.content_tokens, q.content_tokens) if q.content_tokens else None
    return {
        "content_speedup": s.content_speedup,
        "realized_content_speedup": realized_speedup(clean_seq.stats.wall_s, content_wall) if clean_seq else None,
        "end_to_end_speedup": e2e,
        "length_ratio": ratio,
        "content_tokens_sequential": q.content_tokens,
        "content_tokens_pasta": s.content_tokens,
        "text_length_ratio": len(pasta.text) / len(seq.text) if seq.text else None,
        "throughput_ratio": e2e * ratio if ratio is not None else None,
        "tokens_sequential": q.tokens_decoded,
        "tokens_pasta": s.tokens_decoded,
        "tag_tokens": s.tag_tokens,
        "token_parallelism": s.token_parallelism,
        "decode_steps_sequential": q.decode_steps,
        "decode_steps": s.decode_steps,
        "critical_path": s.critical_path,
        # content: the same text on both sides (the clean text's sequential replay / the pasta run)
        "step_speedup": (step_speedup(clean_seq.stats.decode_steps, (pasta_replay or pasta).stats.decode_steps)
                         if clean_seq else None),
        "end_to_end_step_speedup": step_speedup(q.decode_steps, s.decode_steps),  # different answers
        "wall_s_sequential": q.wall_s,
        "wall_s": s.wall_s,
        "wall_s_clean_sequential": clean_seq.stats.wall_s if clean_seq else None,
        "wall_s_pasta_replay": pasta_replay.stats.wall_s if pasta_replay else None,
        "forks": s.forks,
        "threads": s.threads,
        "capped_chunks": _count(pasta.diagnostics, "reached its cap"),
        "cut_off_chunks": _count(pasta.diagnostics, "cut off by the request's end"),
        "malformed_tags": _count(pasta.diagnostics, "malformed tag"),
        "finish_reason_sequential": q.finish_reason,
        "finish_reason": s.finish_reason,
        "output_sequential": seq.text,
        "output_pasta": pasta.text,
        "annotated_pasta": pasta.annotated_text,
    }


def summarize_pareto(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Aggregates of :func:`pareto_row` rows (geometric means over prompts, as the paper): the
    content speedups first, then the end-to-end speedup with its length ratio and the fraction
    of answers cut by the token budget on each side, the tag-token fraction and fork statistics;
    the content and end-to-end figures over forked answers only (``forked_only``), the spread
    of the repeats (``timing``) and ``warnings`` (:func:`summary_warnings`).

    Each mean is over the same answers as the figure it sits beside: the content figures
    (speedups, token parallelism, step speedup, the spread of the repeats, the warnings' inputs
    and ``forked_responses``, the answers of ``forked_only``) over the pasta answers with content
    (the others counted in ``empty_answers``); the end-to-end speedup, the length ratio and the
    throughput ratio together over the prompts where both answers have content (``end_to_end_prompts``;
    ``end_to_end_left_out`` counts the rest). Cut fractions, finish reasons, fork rate, mean
    forks and threads, chunk counts and throughputs are over every prompt. Raises ValueError for
    no rows."""
    if not rows:
        raise ValueError("no rows to summarize")
    n = len(rows)
    wall_p = sum(r["wall_s"] for r in rows)
    wall_s = sum(r["wall_s_sequential"] for r in rows)
    full = _with_content(rows)
    both = _both_answers(rows)
    forked = [r for r in full if r["forks"] > 0]
    forked_both = _both_answers(forked)
    return {
        "prompts": n,
        "geomean_content_speedup": _geo([r["content_speedup"] for r in full]),
        "geomean_realized_content_speedup": _geo([r["realized_content_speedup"] for r in full]),
        "geomean_end_to_end_speedup": _geo([r["end_to_end_speedup"] for r in both]),
        "geomean_length_ratio": _geo([r["length_ratio"] for r in both]),
        "end_to_end_prompts": len(both),
        "end_to_end_left_out": n - len(both),
        "cut_fraction_sequential": cut_fraction(r["finish_reason_sequential"] for r in rows),
        "cut_fraction_pasta": cut_fraction(r["finish_reason"] for r in rows),
        "empty_answers": {"sequential": sum(1 for r in rows if r["content_tokens_sequential"] == 0),
                          "pasta": sum(1 for r in rows if r["content_tokens_pasta"] == 0)},
        "geomean_throughput_ratio": _geo([r["throughput_ratio"] for r in both]),
        "tag_token_fraction": tag_token_fraction(sum(r["tag_tokens"] for r in rows),
                                                 sum(r["tokens_pasta"] for r in rows)),
        "geomean_token_parallelism": _geo([r["token_parallelism"] for r in full]),
        "geomean_step_speedup": _geo([r["step_speedup"] for r in full]),
        "geomean_end_to_end_step_speedup": _geo([r.get("end_to_end_step_speedup") for r in both]),
        "forked_responses": len(forked),
        "fork_rate": sum(1 for r in rows if r["forks"] > 0) / n,
        "mean_forks": sum(r["forks"] for r in rows) / n,
        "mean_threads": sum(r["threads"] for r in rows) / n,
        "capped_chunks": sum(r["capped_chunks"] for r in rows),
        "cut_off_chunks": sum(r["cut_off_chunks"] for r in rows),
        "malformed_tags": sum(r["malformed_tags"] for r in rows),
        "content_tokens_per_s": sum(r["content_tokens_pasta"] for r in rows) / wall_p if wall_p > 0 else None,
        "content_tokens_per_s_sequential": (sum(r["content_tokens_sequential"] for r in rows) / wall_s
                                            if wall_s > 0 else None),
        "finish_reasons": {m: _tally(r[k] for r in rows) for m, k in (("sequential", "finish_reason_sequential"),
                                                                      ("pasta", "finish_reason"))},
        "forked_only": {
            "prompts": len(forked),
            "geomean_content_speedup": _geo([r["content_speedup"] for r in forked]),
            "geomean_realized_content_speedup": _geo([r["realized_content_speedup"] for r in forked]),
            "geomean_end_to_end_speedup": _geo([r["end_to_end_speedup"] for r in forked_both]),
            "geomean_length_ratio": _geo([r["length_ratio"] for r in forked_both]),
            "end_to_end_left_out": len(forked) - len(forked_both),
        } if forked else None,
        "timing": timing_summary(full),
        "warnings": _summary_warnings(rows),
    }


def _tally(values: Any) -> dict[str, int]:
    out: dict[str, int] = {}
    for v in values:
        out[v] = out.get(v, 0) + 1
    return out


def export_row(instruction: str, output: str, mode: str, label: str, dataset: str | None) -> dict[str, str]:
    """One entry of AlpacaEval's ``model_outputs.json``."""
    return {"instruction": instruction, "output": output, "generator": f"pasta-engine-{mode} ({label})",
            "dataset": dataset or "pasta-engine"}


def run_pareto(engine: Any, prompts: Sequence[PromptRow], params: SamplingParams, out: Path,
               settings: dict[str, Any], *, warmup: int = 1, repeats: int = DEFAULT_REPEATS, resume: bool = False,
               sequential_engine: Any = None, progress: bool = True,
               model_inputs: dict[str, Any] | None = None) -> dict[str, Any]:
    """Answer every prompt sequentially and with PASTA (see the module docstring); write
    ``prompts.jsonl``, ``summary.json``, ``model_outputs_sequential.json`` and
    ``model_outputs_pasta.json`` (AlpacaEval format) into ``out``.

    Args: as :func:`run_speedup`, with the prompts and the :class:`SamplingParams` of both
    modes; ``sequential_engine``: the engine of the sequential answers (default ``engine``:
    the same weights; another, e.g. the base model's, for the end-to-end comparison against
    it). The clean-text replay of the content speedup always runs on ``engine``. Before the
    timed runs of each prompt, short untimed answers of it in both modes (and a replay of the
    pasta one's clean text) put it in the prefix cache of every engine, so that no timed run
    pays a prefill the others skip. Each row records the sampling settings (``sampling``) and
    ``model_inputs`` (as :func:`run_speedup`'s); ``resume`` refuses rows measured with other
    ones (:func:`resumed_rows`). Before any answer or file, every prompt is checked to fit the
    context and the KV cache in both modes with ``params`` (:func:`check_prompts`:
    ContextLengthError naming ``prompt {index}``). Returns ``{"summary": ..., "settings": ...}``."""
    seq_engine = engine if sequential_engine is None else sequential_engine
    if not prompts:
        raise BenchError("no prompts to run")
    check_prompts(engine, [p.instruction for p in prompts], "pasta", params=params)
    check_prompts(seq_engine, [p.instruction for p in prompts], "sequential", params=params)
    out.mkdir(parents=True, exist_ok=True)
    sampling = sampling_record(params)
    same = {} if model_inputs is None else {"model_inputs": model_inputs}
    rows = resumed_rows(out, [p.instruction for p in prompts], resume, need="content_speedup",
                        inputs=[{"sampling": sampling, **same}] * len(prompts))
    settings.update(resumed_rows=len(rows), warmup=warmup, repeats=repeats, timing_statistic=TIMING_STATISTIC,
                    batch_size=1)
    if warmup and len(rows) < len(prompts):
        for e in {id(engine): engine, id(seq_engine): seq_engine}.values():
            e.model_runner.warm_up()  # the CPU GEMM choices, for every row count a step may have
    short = SamplingParams(max_new_tokens=min(8, params.max_new_tokens or 8))

    def prime(prompt: str) -> None:
        """Short untimed answers of ``prompt`` on every engine and mode the sides run: each
        caches the prompt (a warm-up's first prompt gets them too)."""
        seq_engine.generate([prompt], short, mode="sequential")
        res = engine.generate([prompt], short, mode="pasta")[0]
        clean_text_replay(engine, prompt, res)

    for _ in range(warmup if len(rows) < len(prompts) else 0):
        prime(prompts[0].instruction)
    label = settings.get("model", "")
    exports: dict[str, list[dict[str, str]]] = {
        mode: [export_row(r["instruction"], r[key], mode, label, r.get("dataset")) for r in rows]
        for mode, key in (("sequential", "output_sequential"), ("pasta", "output_pasta"))
    }
    result: dict[str, Any] = {}

    def measure(i: int, p: PromptRow) -> dict[str, Any]:
        runs = timed_runs(repeats, lambda: engine.generate([p.instruction], params, mode="pasta")[0],
                          lambda pas: engine.replay([p.instruction], [pas.text], mode="sequential")[0],
                          lambda: seq_engine.generate([p.instruction], params, mode="sequential")[0],
                          replay=lambda pas: engine.replay([p.instruction], [pas.annotated_text], mode="pasta")[0],
                          prime=lambda: prime(p.instruction))
        fastest, timing = timing_record(runs, runs["pasta_replay"][0].stats.content_speedup)
        seq, pas = fastest["sequential"], fastest["pasta"]
        for mode, res in (("sequential", seq), ("pasta", pas)):
            exports[mode].append(export_row(p.instruction, res.text, mode, label, p.dataset))
        return {"index": i, "instruction": p.instruction, "dataset": p.dataset,
                **pareto_row(seq, pas, fastest["clean_text_sequential"], fastest["pasta_replay"]), "sampling": sampling,
                "timing": timing, **same}

    try:
        _measure_rows(out, prompts, rows, measure, "bench pareto",
                      lambda row: dict(content=f"{row['content_speedup']:.2f}x",
                                       e2e=f"{row['end_to_end_speedup']:.2f}x", forks=row["forks"]), progress)
    finally:
        for mode, items in exports.items():  # what was decoded is never lost
            if items:
                _write_json(out / f"model_outputs_{mode}.json", items)
        if rows:
            settings.update(prompts_planned=len(prompts), complete=len(rows) == len(prompts))
            result = {"summary": summarize_pareto(rows), "settings": settings}
            _write_json(out / "summary.json", result)
    return result
