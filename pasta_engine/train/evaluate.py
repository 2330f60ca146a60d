"""``bench learned``: does the learned adapter fork, and is it faster, on prompts it never saw?

On the evaluation split (AlpacaEval's ``vicuna`` subset), greedy, one prompt at a time (batch 1),
for the **base model** (pasta mode with the long PASTA-LANG system prompt, and sequential with a
plain prompt) and the **adapter** (pasta mode with its one-line prompt):

* the content speedup first (docs/DESIGN.md section 3; tag tokens are overhead, not content):
  theoretical (content tokens / critical path) and realized (the pasta answer's clean text
  replayed sequentially vs the annotated answer replayed in pasta mode, same engine: a wall
  time ratio); then fork statistics (responses that forked, mean threads), token parallelism
  and the tag-token fraction;
* end to end: the base model answering sequentially vs the adapter in pasta mode (wall time
  ratio), with the length ratio of the two answers (content tokens) and the fraction of answers
  cut by the token budget on each side;
* the quality proxies of each side, side by side (:func:`quality_proxies`): repeated lines,
  distinct-2, answers cut by the token budget, empty list items, tag text in the clean output
  (text only: :func:`pasta_engine.metrics.text_proxies`) and the likelihood proxy
  (:mod:`pasta_engine.train.quality`);
* AlpacaEval-format ``model_outputs`` of the base model's sequential answers and the adapter's
  pasta answers (``instruction``, ``output``: the clean text of ``RequestResult.text``,
  ``generator``, ``dataset``), for a judge's win rate with the ``alpaca_eval`` package (docs/learning.md,
  "Judging quality with alpaca_eval").

Everything goes to ``OUT/prompts.jsonl`` (resumable), ``OUT/summary.json`` and ``OUT/learned.png``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any, Sequence

from ..config import SamplingParams
from ..metrics import (cut_fraction, geomean_positive, length_ratio, realized_speedup, summarize_text_proxies,
                       tag_token_fraction, text_proxies)
from ..tools.bench import export_row, resumed_rows, summary_warnings, timed_runs, timing_record, timing_summary
from ..tools.traces import PromptRow
from .quality import LikelihoodQuality

__all__ = ["evaluate_learned", "learned_row", "summarize_learned", "quality_proxies", "format_quality_proxies",
           "plot_learned"]

#: The sides of a ``bench learned`` row, in the order the proxies are reported.
SIDES = ("base_sequential", "adapter_pasta", "base_pasta")


def _content(engine: Any, prompt: str, res: Any, repeats: int) -> dict[str, Any]:
    """The content figures of a pasta answer ``res``: its content speedup, theoretical and
    realized (its clean text replayed sequentially / its annotated text replayed in pasta mode,
    both on ``engine``, ``repeats`` runs each, interleaved, the fastest of each side counting),
    with both wall times (seconds) and the runs' ``timing`` record (every wall time, the spread of
    the per-run realized speedups, and a warning when the realized speedup exceeds its ideal, the
    step speedup, by more than that spread: :func:`pasta_engine.tools.bench.timing_record`). No
    untimed round first: ``res`` was generated on ``engine`` from this prompt, which is in its
    prefix cache for both sides already."""
    runs = timed_runs(repeats, lambda: engine.replay([prompt], [res.annotated_text], mode="pasta")[0],
                      lambda _: engine.replay([prompt], [res.text], mode="sequential")[0], prime=lambda: None)
    fastest, timing = timing_record(runs, res.stats.content_speedup)
    pas, seq = fastest["pasta"], fastest["clean_text_sequential"]
    return {"content_tokens": res.stats.content_tokens, "content_speedup": res.stats.content_speedup,
            "realized_content_speedup": realized_speedup(seq.stats.wall_s, pas.stats.wall_s),
            "clean_text_sequential_wall_s": seq.stats.wall_s, "pasta_replay_wall_s": pas.stats.wall_s,
            "tag_tokens": res.stats.tag_tokens, "token_parallelism": res.stats.token_parallelism, "timing": timing}


def learned_row(prompt: str, base_engine: Any, adapter_engine: Any, params: SamplingParams, quality: Any,
                repeats: int = 1, base_pasta: bool = True) -> dict[str, Any]:
    """Every measure of one evaluation prompt (see the module docstring).

    Args:
        prompt: the user prompt (the chat template is the engines'); params: greedy or sampled
            settings for every generation; quality: ``(prompt, clean text) -> float`` (the
            proxy, nats per token); repeats: replays per mode, the fastest counts;
            base_pasta: also answer with the base model in pasta mode.

    Returns a JSON-ready dict: per side its text, content tokens, tokens decoded (``tokens``),
    wall seconds, finish reason (``length``: cut by the token budget), quality and the text-only
    proxies (:func:`pasta_engine.metrics.text_proxies`: repeated lines, distinct-2, empty list
    items, tag text); for the pasta sides first the content figures (:func:`_content`: content speedup,
    realized content speedup with both wall times in seconds, tag tokens, token parallelism),
    then forks, threads, decode steps and critical path; ``end_to_end_speedup`` (base sequential
    wall / adapter pasta wall) and ``length_ratio`` (adapter content tokens / base content
    tokens, None when the base answer has none). Raises what the engines raise."""
    seq = base_engine.generate([prompt], params, mode="sequential")[0]
    ad = adapter_engine.generate([prompt], params, mode="pasta")[0]
    s = seq.stats
    row: dict[str, Any] = {
        "base_sequential": {"text": seq.text, "content_tokens": s.content_tokens, "tokens": s.tokens_decoded,
                            "wall_s": s.wall_s, "finish_reason": s.finish_reason, "quality": quality(prompt, seq.text),
                            **text_proxies(seq.text)},
        "adapter_pasta": {**_content(adapter_engine, prompt, ad, repeats), "text": ad.text,
                          "annotated": ad.annotated_text, "tokens": ad.stats.tokens_decoded, "wall_s": ad.stats.wall_s,
                          "finish_reason": ad.stats.finish_reason, "forks": ad.stats.forks,
                          "threads": ad.stats.threads, "decode_steps": ad.stats.decode_steps,
                          "critical_path": ad.stats.critical_path, "quality": quality(prompt, ad.text),
                          **text_proxies(ad.text)},
        "end_to_end_speedup": realized_speedup(s.wall_s, ad.stats.wall_s),
        "length_ratio": length_ratio(ad.stats.content_tokens, s.content_tokens) if s.content_tokens else None,
    }
    if base_pasta:
        bp = base_engine.generate([prompt], params, mode="pasta")[0]
        row["base_pasta"] = {**_content(base_engine, prompt, bp, repeats), "text": bp.text,
                             "annotated": bp.annotated_text, "tokens": bp.stats.tokens_decoded,
                             "wall_s": bp.stats.wall_s, "finish_reason": bp.stats.finish_reason,
                             "forks": bp.stats.forks, "threads": bp.stats.threads, "quality": quality(prompt, bp.text),
                             **text_proxies(bp.text),
                             "end_to_end_speedup": realized_speedup(s.wall_s, bp.stats.wall_s),
                             "length_ratio": (length_ratio(bp.stats.content_tokens, s.content_tokens)
                                              if s.content_tokens else None)}
    return row


def quality_proxies(rows: Sequence[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """The quality proxies of each side present in ``rows`` (``bench learned`` rows, as in
    ``prompts.jsonl``), side by side: :func:`pasta_engine.metrics.summarize_text_proxies` of the
    side's clean texts and finish reasons (recomputed from the text, so rows written before a
    proxy existed get it too), plus ``mean_likelihood_proxy`` (the mean of the stored
    ``quality``). Raises ValueError for no rows."""
    if not rows:
        raise ValueError("no rows to summarize")
    out: dict[str, dict[str, Any]] = {}
    for key in SIDES:
        xs = [r[key] for r in rows if key in r]
        if xs:
            annotated = [x["annotated"] for x in xs] if all("annotated" in x for x in xs) else None
            out[key] = {**summarize_text_proxies([x["text"] for x in xs], [x.get("finish_reason", "stop") for x in xs],
                                                 annotated),
                        "mean_likelihood_proxy": sum(x["quality"] for x in xs) / len(xs)}
    return out


def format_quality_proxies(table: dict[str, dict[str, Any]]) -> str:
    """One line of :func:`quality_proxies`' table, the sides as ``a / b / c`` in its order."""
    sides = list(table)

    def each(key: str, fmt: str) -> str:
        return " / ".join(format(table[s][key], fmt) for s in sides)

    return (f"quality proxies ({' / '.join(sides)}): repeated lines {each('mean_repeated_lines', '.1%')}, distinct-2 "
            f"{each('mean_distinct_2', '.3f')}, cut by the token budget {each('cut_fraction', '.0%')}, answers with empty "
            f"list items {each('answers_with_empty_list_items', 'd')}, with tag text {each('answers_with_tag_text', 'd')}, "
            f"likelihood {each('mean_likelihood_proxy', '.3f')} nats/token (of {table[sides[0]]['answers']} answers)")


def summarize_learned(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Aggregates over prompts (geometric means of ratios, as the paper, answers without content
    left out of the content figures; arithmetic means of the quality proxy): per side the content
    speedups first, the tag-token fraction (tag tokens / tokens decoded) and the fraction cut by
    the token budget; the end-to-end speedup with its length ratio; the quality proxies side by
    side (:func:`quality_proxies`). Raises ValueError for no rows."""
    if not rows:
        raise ValueError("no rows to summarize")
    n = len(rows)

    def side(key: str) -> dict[str, Any]:
        xs = [r[key] for r in rows if key in r]
        if not xs:
            return {}
        out: dict[str, Any] = {"responses": len(xs)}
        if "content_speedup" in xs[0]:
            # every speedup figure over the same answers: those with content (an empty answer has no
            # content speedup; its realized one, a replay of nothing, would still count otherwise)
            full = [x for x in xs if x["content_speedup"] > 0]
            out["geomean_content_speedup"] = geomean_positive(x["content_speedup"] for x in full)
            out["geomean_realized_content_speedup"] = geomean_positive(x["realized_content_speedup"] for x in full)
            out["realized_content_speedup_spread"] = (_spread([x["realized_content_speedup"] for x in full])
                                                      if full else None)
            out["tag_token_fraction"] = tag_token_fraction(sum(x["tag_tokens"] for x in xs),
                                                           sum(x["tokens"] for x in xs))
            out["geomean_token_parallelism"] = geomean_positive(x["token_parallelism"] for x in full)
            timed = [{**r[key], "index": r.get("index", i)} for i, r in enumerate(rows)
                     if r.get(key, {}).get("timing") and r[key]["content_speedup"] > 0]
            forked = [x for x in full if x.get("forks", 0) > 0]
            out["timing"] = timing_summary(timed)
            out["warnings"] = summary_warnings(
                len(full), len(forked), out["geomean_realized_content_speedup"],
                geomean_positive(x["realized_content_speedup"] for x in forked) if forked else None, out["timing"])
        out.update({
            "forked": sum(1 for x in xs if x.get("forks", 0) > 0),
            "fork_rate": sum(1 for x in xs if x.get("forks", 0) > 0) / len(xs),
            "mean_threads": sum(x.get("threads", 1) for x in xs) / len(xs),
            "mean_tokens": sum(x["tokens"] for x in xs) / len(xs),
            "mean_quality": sum(x["quality"] for x in xs) / len(xs),
            "finished_by_eos": sum(1 for x in xs if x.get("finish_reason", "stop") == "stop"),
            "cut_fraction": cut_fraction(x.get("finish_reason", "stop") for x in xs),
            "empty_answers": sum(1 for x in xs if x.get("content_tokens", 1) == 0),
        })
        if "repeated_lines" in xs[0]:
            out["mean_repeated_lines"] = sum(x["repeated_lines"] for x in xs) / len(xs)
        if "end_to_end_speedup" in xs[0]:
            out["geomean_end_to_end_speedup_vs_base_sequential"] = geomean_positive(x["end_to_end_speedup"] for x in xs)
            out["geomean_length_ratio_vs_base_sequential"] = geomean_positive(x["length_ratio"] for x in xs)
        return out

    return {
        "prompts": n,
        "base_sequential": side("base_sequential"),
        "base_pasta": side("base_pasta"),
        "adapter_pasta": side("adapter_pasta"),
        "geomean_end_to_end_speedup": geomean_positive(r["end_to_end_speedup"] for r in rows),
        "geomean_length_ratio": geomean_positive(r["length_ratio"] for r in rows),
        "cut_fraction_base_sequential": cut_fraction(r["base_sequential"]["finish_reason"] for r in rows),
        "cut_fraction_adapter_pasta": cut_fraction(r["adapter_pasta"]["finish_reason"] for r in rows),
        "quality_proxy": "base model mean log-likelihood per token of the clean answer given the plain prompt, "
                         "minus 2.0 x the fraction of repeated lines (nats per token; higher is better; a proxy)",
        "quality_proxies": quality_proxies(rows),
    }


def _spread(values: Sequence[float]) -> dict[str, float]:
    """Min, 10th percentile, median, 90th percentile and max of per-prompt values (nearest rank)."""
    v = sorted(values)
    at = lambda q: v[min(len(v) - 1, max(0, round(q * (len(v) - 1))))]  # noqa: E731
    return {"min": v[0], "p10": at(0.1), "median": at(0.5), "p90": at(0.9), "max": v[-1]}


def plot_learned(rows: Sequence[dict[str, Any]], path: Path) -> Path | None:
    """PNG: per prompt, the adapter's theoretical vs realized content speedup (y = x), and
    the quality proxy of the base model's sequential answer vs the adapter's."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        return None
    fig = Figure(figsize=(11, 4.5), layout="constrained")
    FigureCanvasAgg(fig)
    ax1, ax2 = fig.subplots(1, 2)
    th = [r["adapter_pasta"]["content_speedup"] for r in rows]
    re_ = [r["adapter_pasta"]["realized_content_speedup"] for r in rows]
    ax1.scatter(th, re_, s=14, alpha=0.7)
    hi, lo = max([1.0, *th, *re_]) * 1.05, min([1.0, *th, *re_]) * 0.95
    ax1.plot([lo, hi], [lo, hi], "k--", lw=1, label="y = x")
    ax1.set_xlabel("content speedup, theoretical (content tokens / critical path)")
    ax1.set_ylabel("content speedup, realized (clean text sequential / pasta)")
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
                     out: Path, settings: dict[str, Any], params: SamplingParams, *, repeats: int = 3,
                     warmup: int = 1, base_pasta: bool = True, resume: bool = False,
                     model: str | None = None) -> dict[str, Any]:
    """Run :func:`learned_row` over ``prompts`` (resumable), then write the summary, the plot and
    the AlpacaEval exports. ``repeats``: timed replays per side (the fastest counts, the spread is
    reported); ``warmup``: untimed short answers in each mode on each engine first (0: none);
    ``model``: what names the base checkpoint (``--model``'s absolute path; None: the embedded
    model). Each row records ``run_inputs`` (the model, the adapter, its lora_scale, the
    sampling, whether the base model answers in pasta mode too), and ``resume`` refuses rows that
    recorded others (:func:`~pasta_engine.tools.bench.resumed_rows`: BenchError naming the row
    and the fields that differ). Returns ``{"summary": ..., "settings": ...}``."""
    from tqdm import tqdm

    from ..tools.bench import sampling_record

    out.mkdir(parents=True, exist_ok=True)
    # what a row was measured with: --resume refuses rows of another model, adapter, sampling or baseline
    run_inputs = {"model": model, "adapter": str(adapter_engine.adapter), "lora_scale": getattr(adapter_engine, "lora_scale", None),
                  "sampling": sampling_record(params), "base_pasta": bool(base_pasta)}
    run_inputs = json.loads(json.dumps(run_inputs, default=str))
    rows = resumed_rows(out, [p.instruction for p in prompts], resume, need="adapter_pasta.content_speedup",
                        inputs=[{"run_inputs": run_inputs}] * len(prompts))
    # warm-up (untimed): short answers in each mode on each engine
    warm = SamplingParams(max_new_tokens=8)
    for engine, modes in ((base_engine, ("sequential", "pasta")), (adapter_engine, ("pasta",))):
        if warmup:
            engine.model_runner.warm_up()  # the CPU GEMM choices, for every row count a step may have
        for _ in range(warmup):
            for m in modes:
                engine.generate([prompts[0].instruction], warm, mode=m)
    bar = tqdm(total=len(prompts), initial=len(rows), desc="bench learned", unit="prompt", file=sys.stderr)
    with (out / "prompts.jsonl").open("w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
        for i, p in list(enumerate(prompts))[len(rows):]:
            row = {"index": i, "instruction": p.instruction, "dataset": p.dataset, "run_inputs": run_inputs,
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
