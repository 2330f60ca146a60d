"""``bench learned``: does the learned adapter fork, and is it faster, on prompts it never saw?

On the evaluation split (AlpacaEval's ``vicuna`` subset), greedy, one prompt at a time (batch 1),
for the **base model** (pasta mode with the long PASTA-LANG system prompt, and sequential with a
plain prompt) and the **adapter** (pasta mode with its one-line prompt):

* fork statistics: responses that forked, mean threads, geometric-mean theoretical speedup;
* realized speedup on the same content: the pasta response replayed sequentially vs in pasta
  mode on the same engine (wall time ratio; DESIGN.md section 3);
* end to end: the base model answering sequentially vs the adapter in pasta mode (wall time
  ratio), with the length ratio of the two answers;
* the quality proxy (:mod:`pasta_engine.train.quality`) of each answer, side by side;
* AlpacaEval-format ``model_outputs`` of the base model's sequential answers and the adapter's
  pasta answers, for a judge's length-controlled win rate.

Everything goes to ``OUT/prompts.jsonl`` (resumable), ``OUT/summary.json`` and ``OUT/learned.png``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any, Sequence

from ..config import SamplingParams
from ..metrics import geomean, realized_speedup
from ..tools.bench import export_row, resumed_rows
from ..tools.traces import PromptRow
from .quality import LikelihoodQuality, repeated_line_fraction

__all__ = ["evaluate_learned", "learned_row", "summarize_learned", "plot_learned"]


def _timed_replay(engine: Any, prompt: str, annotated: str, mode: str, repeats: int) -> Any:
    runs = [engine.replay([prompt], [annotated], mode=mode)[0] for _ in range(repeats)]
    return min(runs, key=lambda r: r.stats.wall_s)


def learned_row(prompt: str, base_engine: Any, adapter_engine: Any, params: SamplingParams, quality: Any,
                repeats: int = 1, base_pasta: bool = True) -> dict[str, Any]:
    """Every measure of one evaluation prompt (see the module docstring).

    Args:
        prompt: the user prompt (the chat template is the engines'); params: greedy or sampled
            settings for every generation; quality: ``(prompt, clean text) -> float`` (the
            proxy, nats per token); repeats: replays per mode, the fastest counts;
            base_pasta: also answer with the base model in pasta mode.

    Returns a JSON-ready dict: per side its text, tokens, wall seconds, finish reason, quality
    and repeated-line fraction; for the adapter also forks, threads, decode steps, critical
    path, theoretical speedup and the same-content realized speedup with both wall times
    (seconds); ``end_to_end_speedup`` (base sequential wall / adapter pasta wall) and
    ``length_ratio`` (adapter tokens / base tokens). Raises what the engines raise."""
    seq = base_engine.generate([prompt], params, mode="sequential")[0]
    ad = adapter_engine.generate([prompt], params, mode="pasta")[0]
    ad_seq = _timed_replay(adapter_engine, prompt, ad.annotated_text, "sequential", repeats)
    ad_pas = _timed_replay(adapter_engine, prompt, ad.annotated_text, "pasta", repeats)
    row: dict[str, Any] = {
        "base_sequential": {"text": seq.text, "tokens": seq.stats.tokens_decoded, "wall_s": seq.stats.wall_s,
                            "finish_reason": seq.stats.finish_reason, "quality": quality(prompt, seq.text),
                            "repeated_lines": repeated_line_fraction(seq.text)},
        "adapter_pasta": {"text": ad.text, "annotated": ad.annotated_text, "tokens": ad.stats.tokens_decoded,
                          "wall_s": ad.stats.wall_s, "finish_reason": ad.stats.finish_reason, "forks": ad.stats.forks,
                          "threads": ad.stats.threads, "decode_steps": ad.stats.decode_steps,
                          "critical_path": ad.stats.critical_path, "theoretical_speedup": ad.stats.theoretical_speedup,
                          "quality": quality(prompt, ad.text), "repeated_lines": repeated_line_fraction(ad.text),
                          "same_content_realized_speedup": realized_speedup(ad_seq.stats.wall_s, ad_pas.stats.wall_s),
                          "same_content_sequential_wall_s": ad_seq.stats.wall_s,
                          "same_content_pasta_wall_s": ad_pas.stats.wall_s},
        "end_to_end_speedup": realized_speedup(seq.stats.wall_s, ad.stats.wall_s),
        "length_ratio": ad.stats.tokens_decoded / seq.stats.tokens_decoded,
    }
    if base_pasta:
        bp = base_engine.generate([prompt], params, mode="pasta")[0]
        bp_seq = _timed_replay(base_engine, prompt, bp.annotated_text, "sequential", repeats)
        bp_pas = _timed_replay(base_engine, prompt, bp.annotated_text, "pasta", repeats)
        row["base_pasta"] = {"text": bp.text, "annotated": bp.annotated_text, "tokens": bp.stats.tokens_decoded,
                             "wall_s": bp.stats.wall_s, "forks": bp.stats.forks, "threads": bp.stats.threads,
                             "theoretical_speedup": bp.stats.theoretical_speedup, "quality": quality(prompt, bp.text),
                             "same_content_realized_speedup": realized_speedup(bp_seq.stats.wall_s, bp_pas.stats.wall_s),
                             "end_to_end_speedup": realized_speedup(seq.stats.wall_s, bp.stats.wall_s)}
    return row


def summarize_learned(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Aggregates over prompts (geometric means of ratios, as the paper; arithmetic means of the
    quality proxy). Raises ValueError for no rows."""
    if not rows:
        raise ValueError("no rows to summarize")
    n = len(rows)

    def side(key: str) -> dict[str, Any]:
        xs = [r[key] for r in rows if key in r]
        if not xs:
            return {}
        out = {
            "responses": len(xs),
            "forked": sum(1 for x in xs if x.get("forks", 0) > 0),
            "fork_rate": sum(1 for x in xs if x.get("forks", 0) > 0) / len(xs),
            "mean_threads": sum(x.get("threads", 1) for x in xs) / len(xs),
            "mean_tokens": sum(x["tokens"] for x in xs) / len(xs),
            "mean_quality": sum(x["quality"] for x in xs) / len(xs),
            "finished_by_eos": sum(1 for x in xs if x.get("finish_reason", "stop") == "stop"),
        }
        if "theoretical_speedup" in xs[0]:
            out["geomean_theoretical_speedup"] = geomean(x["theoretical_speedup"] for x in xs)
            out["geomean_same_content_realized_speedup"] = geomean(x["same_content_realized_speedup"] for x in xs)
        if "repeated_lines" in xs[0]:
            out["mean_repeated_lines"] = sum(x["repeated_lines"] for x in xs) / len(xs)
        if "end_to_end_speedup" in xs[0]:
            out["geomean_end_to_end_speedup_vs_base_sequential"] = geomean(x["end_to_end_speedup"] for x in xs)
        return out

    return {
        "prompts": n,
        "base_sequential": side("base_sequential"),
        "base_pasta": side("base_pasta"),
        "adapter_pasta": side("adapter_pasta"),
        "geomean_end_to_end_speedup": geomean(r["end_to_end_speedup"] for r in rows),
        "geomean_length_ratio": geomean(r["length_ratio"] for r in rows),
        "quality_proxy": "base model mean log-likelihood per token of the clean answer given the plain prompt, "
                         "minus 2.0 x the fraction of repeated lines (nats per token; higher is better; a proxy)",
    }


def plot_learned(rows: Sequence[dict[str, Any]], path: Path) -> Path | None:
    """PNG: per prompt, the adapter's theoretical vs same-content realized speedup (y = x), and
    the quality proxy of the base model's sequential answer vs the adapter's."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        return None
    fig = Figure(figsize=(11, 4.5), layout="constrained")
    FigureCanvasAgg(fig)
    ax1, ax2 = fig.subplots(1, 2)
    th = [r["adapter_pasta"]["theoretical_speedup"] for r in rows]
    re_ = [r["adapter_pasta"]["same_content_realized_speedup"] for r in rows]
    ax1.scatter(th, re_, s=14, alpha=0.7)
    hi = max([1.0, *th, *re_]) * 1.05
    ax1.plot([0.9, hi], [0.9, hi], "k--", lw=1, label="y = x")
    ax1.set_xlabel("theoretical speedup")
    ax1.set_ylabel("realized speedup, same content")
    ax1.set_title("adapter in pasta mode, per prompt")
    ax1.legend(fontsize=8)
    qb = [r["base_sequential"]["quality"] for r in rows]
    qa = [r["adapter_pasta"]["quality"] for r in rows]
    ax2.scatter(qb, qa, s=14, alpha=0.7)
    lo, hi2 = min(qb + qa), max(qb + qa)
    ax2.plot([lo, hi2], [lo, hi2], "k--", lw=1)
    ax2.set_xlabel("quality proxy: base model, sequential")
    ax2.set_ylabel("quality proxy: adapter, pasta")
    ax2.set_title("quality proxy (nats per token), per prompt")
    fig.savefig(path, dpi=110)
    return path


def evaluate_learned(prompts: Sequence[PromptRow], base_engine: Any, adapter_engine: Any, quality: LikelihoodQuality,
                     out: Path, settings: dict[str, Any], params: SamplingParams, *, repeats: int = 1,
                     base_pasta: bool = True, resume: bool = False) -> dict[str, Any]:
    """Run :func:`learned_row` over ``prompts`` (resumable), then write the summary, the plot and
    the AlpacaEval exports. Returns ``{"summary": ..., "settings": ...}``."""
    from tqdm import tqdm

    out.mkdir(parents=True, exist_ok=True)
    rows = resumed_rows(out, [p.instruction for p in prompts], resume)
    # warm-up (untimed): one short answer in each mode on each engine
    warm = SamplingParams(max_new_tokens=8)
    for engine, modes in ((base_engine, ("sequential", "pasta")), (adapter_engine, ("pasta",))):
        engine.model_runner.warm_up()  # the CPU GEMM choices, for every row count a step may have
        for m in modes:
            engine.generate([prompts[0].instruction], warm, mode=m)
    bar = tqdm(total=len(prompts), initial=len(rows), desc="bench learned", unit="prompt", file=sys.stderr)
    with (out / "prompts.jsonl").open("w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
        for i, p in list(enumerate(prompts))[len(rows):]:
            row = {"index": i, "instruction": p.instruction, "dataset": p.dataset,
                   **learned_row(p.instruction, base_engine, adapter_engine, params, quality, repeats, base_pasta)}
            rows.append(row)
            f.write(json.dumps(row) + "\n")
            f.flush()
            bar.update(1)
            bar.set_postfix(forks=row["adapter_pasta"]["forks"], e2e=f"{row['end_to_end_speedup']:.2f}x")
    bar.close()
    result = {"summary": summarize_learned(rows), "settings": {**settings, "prompts_planned": len(prompts),
                                                                "complete": len(rows) == len(prompts)}}
    (out / "summary.json").write_text(json.dumps(result, indent=2) + "\n")
    plot_learned(rows, out / "learned.png")
    for key, mode, label in (("base_sequential", "sequential", "base"), ("adapter_pasta", "pasta", "adapter")):
        items = [export_row(r["instruction"], r[key]["text"], mode, label, r.get("dataset")) for r in rows]
        (out / f"model_outputs_{label}_{mode}.json").write_text(json.dumps(items, indent=2) + "\n")
    return result
