"""The paper's position ablation at small scale (Jin et al. 2025, the position-policy ablation of
section 5; issue 19 item 7): how the main thread's logical positions after a promise change what a
learned model writes and how fast.

For each position policy (:class:`pasta_engine.config.PositionPolicy`):

* ``predicted`` (Pred-10x, the default): the main thread skips the promise's predicted length;
* ``constant:K``: it skips K positions whatever the promise says;
* ``none``: it skips nothing (a chunk and the text after the join overlap in position);

the adapter answers the same held-out prompts (AlpacaEval's vicuna subset: never trained on) in
pasta mode, and the table reports the fork rate, the geometric-mean content speedup (content
tokens / critical path: tag tokens are overhead, docs/DESIGN.md section 3), the tag-token
fraction and the quality proxies (repeated lines, distinct-2, empty list items, tag text in the
clean output, answers cut by the token budget; the base model's likelihood of the clean text in
nats per token, a proxy and not a judge).

``oracle`` (each chunk's true length) exists only in replay: the ``predicted`` answers are
replayed with their own predicted positions and with the oracle's, and the table gives the mean
log-probability per token the adapter assigns to its own answer under each (how much the predicted
lengths' error costs the model; the paper's oracle row).

    python bench/bench_positions.py --prompts ../shared/data/alpaca_eval/instructions.json \\
        --adapter auto --limit 24 --out bench/results/positions-smollm2-cpu.json

Writes the JSON (never over an existing one: ``-2``, ``-3``, ... beside it) and a PNG with the
same stem.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

import torch

from pasta_engine import Engine, SamplingParams
from pasta_engine.metrics import geomean, summarize_text_proxies, text_proxies
from pasta_engine.train.common import load_base
from pasta_engine.train.quality import LikelihoodQuality

from common import new_path  # bench/common.py: a rerun never replaces a committed result

POLICIES = ("predicted", "constant:40", "none")


def vicuna_prompts(path: Path, limit: int) -> list[str]:
    """``limit`` vicuna instructions spread over the subset (every k-th of its rows)."""
    rows = [r["instruction"] for r in json.loads(Path(path).read_text()) if r.get("dataset") == "vicuna"]
    step = max(1, len(rows) // limit)
    return rows[::step][:limit]


def run_policy(adapter: str, policy: str, prompts: list[str], params: SamplingParams,
               quality: LikelihoodQuality) -> tuple[list[dict[str, Any]], list[Any]]:
    """Answer ``prompts`` in pasta mode under ``policy``; one row per prompt, and the results."""
    engine = Engine.from_pretrained(None, adapter=adapter, position_policy=policy, max_running_requests=8)
    t0 = time.perf_counter()
    results = engine.generate(prompts, params, mode="pasta")
    wall_s = time.perf_counter() - t0
    rows = []
    for p, r in zip(prompts, results):
        rows.append({"forks": r.stats.forks, "content_tokens": r.stats.content_tokens,
                     "content_speedup": r.stats.content_speedup, "tag_tokens": r.stats.tag_tokens,
                     "tokens_decoded": r.stats.tokens_decoded, "finish_reason": r.stats.finish_reason,
                     "quality_nats_per_token": quality(p, r.text), **text_proxies(r.text), "text": r.text,
                     "annotated": r.annotated_text})
    rows[0]["batch_wall_s"] = round(wall_s, 1)
    return rows, results


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Fork rate, geomean content speedup, tag-token fraction and the quality proxies of one policy."""
    decoded = sum(r["tokens_decoded"] for r in rows)
    return {
        "prompts": len(rows), "fork_rate": sum(r["forks"] > 0 for r in rows) / len(rows),
        "geomean_content_speedup": geomean(r["content_speedup"] for r in rows),
        "geomean_content_speedup_forked": geomean(r["content_speedup"] for r in rows if r["forks"] > 0)
        if any(r["forks"] > 0 for r in rows) else None,
        "tag_token_fraction": sum(r["tag_tokens"] for r in rows) / decoded if decoded else 0.0,
        "mean_quality_nats_per_token": sum(r["quality_nats_per_token"] for r in rows) / len(rows),
        **summarize_text_proxies([r["text"] for r in rows], [r["finish_reason"] for r in rows]),
    }


def oracle_rows(adapter: str, prompts: list[str], answers: list[str]) -> dict[str, Any]:
    """Replay the ``predicted`` policy's annotated answers under ``predicted`` and ``oracle``
    positions: the mean log-probability per token (nats) the adapter gives its own answer."""
    out = {}
    for policy in ("predicted", "oracle"):
        engine = Engine.from_pretrained(None, adapter=adapter, position_policy=policy, max_running_requests=8)
        res = engine.replay(prompts, answers, mode="pasta", params=SamplingParams(return_logprobs=True))
        per = []
        for r in res:
            lps = [x for x in (r.logprobs or []) if x is not None and math.isfinite(x)]
            per.append(sum(lps) / len(lps) if lps else None)
        vals = [v for v in per if v is not None]
        out[policy] = {"mean_replay_logprob_nats_per_token": sum(vals) / len(vals) if vals else None,
                       "per_prompt": per}
    return out


def plot(summary: dict[str, dict[str, Any]], path: Path) -> None:
    """Bars per policy: fork rate, geomean content speedup, repeated lines, distinct-2."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(summary)
    panels = [("fork_rate", "fork rate"), ("geomean_content_speedup", "geomean content speedup (x)"),
              ("mean_repeated_lines", "repeated lines (fraction)"), ("mean_distinct_2", "distinct-2")]
    fig, axes = plt.subplots(1, len(panels), figsize=(4 * len(panels), 3.2))
    for ax, (key, label) in zip(axes, panels):
        ax.bar(names, [summary[n][key] for n in names], color="#4878a8")
        ax.set_title(label, fontsize=9)
        ax.tick_params(axis="x", labelsize=8, rotation=15)
    fig.suptitle("position policy ablation (learned adapter, vicuna prompts, pasta mode)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", required=True, type=Path, help="AlpacaEval JSON (its vicuna rows are used)")
    ap.add_argument("--adapter", default="auto", help="adapter folder (default: the shipped one)")
    ap.add_argument("--limit", type=int, default=24, help="vicuna prompts, spread over the subset")
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--repetition-penalty", type=float, default=1.1)
    ap.add_argument("--policies", default=",".join(POLICIES), help="comma-separated PositionPolicy specs")
    ap.add_argument("--no-oracle", action="store_true", help="skip the oracle replay")
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results" / "positions.json")
    args = ap.parse_args()
    prompts = vicuna_prompts(args.prompts, args.limit)
    params = SamplingParams(max_new_tokens=args.max_new_tokens, repetition_penalty=args.repetition_penalty)
    hf, tok, _ = load_base(None)
    hf.eval()
    quality = LikelihoodQuality(hf, tok)
    per_policy, summary = {}, {}
    for policy in args.policies.split(","):
        rows, _ = run_policy(args.adapter, policy, prompts, params, quality)
        per_policy[policy] = rows
        summary[policy] = summarize(rows)
        s = summary[policy]
        print(f"{policy}: forks {s['fork_rate']:.0%}, geomean content speedup {s['geomean_content_speedup']:.2f}x, "
              f"tag tokens {s['tag_token_fraction']:.0%}, repeated lines {s['mean_repeated_lines']:.3f}, distinct-2 "
              f"{s['mean_distinct_2']:.3f}, quality {s['mean_quality_nats_per_token']:.3f} nats/token", flush=True)
    oracle = None
    if not args.no_oracle and "predicted" in per_policy:
        oracle = oracle_rows(args.adapter, prompts, [r["annotated"] for r in per_policy["predicted"]])
        print("oracle replay: mean logprob/token " + ", ".join(
            f"{k} {v['mean_replay_logprob_nats_per_token']:.3f}" for k, v in oracle.items()), flush=True)
    path = new_path(args.out)
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = {
        "what": "position-policy ablation (issue 19 item 7): the learned adapter answers held-out vicuna prompts in "
                "pasta mode under each policy; oracle = replay of the predicted answers with true chunk lengths",
        "command": " ".join(["python", *sys.argv]), "time": time.strftime("%Y-%m-%d %H:%M:%S"),
        "device": "cpu", "machine": platform.processor() or platform.machine(), "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(), "load_average": os.getloadavg(),
        "settings": {"adapter": args.adapter, "prompts": len(prompts), "max_new_tokens": args.max_new_tokens,
                     "temperature": 0.0, "repetition_penalty": args.repetition_penalty, "batch": 8},
        "summary": summary, "oracle_replay": oracle, "per_policy": per_policy,
    }
    path.write_text(json.dumps(payload, indent=1) + "\n")
    plot(summary, path.with_suffix(".png"))
    print(f"wrote {path} and {path.with_suffix('.png')}")


if __name__ == "__main__":
    main()
