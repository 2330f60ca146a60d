"""The speed-quality frontier (the paper's Figure 4, Jin et al., ICML 2025, arXiv 2502.11517):
operating points of learned PASTA, each with its theoretical and realized content speedup and its
win rate against the base model's sequential answers (a blind pairwise reading by an LLM judge,
both orders, ties half) with a bootstrap interval over prompts.

Reads stored rows only, so the table and the plot can be redrawn without running anything. The
points file is a JSON list of ``{"label", "screen", "judge", "timed"?}``: ``screen`` a folder of
``bench/screen_adapter.py`` (theoretical content speedup, fork rate, independence checks),
``judge`` a folder of ``bench/judge_pairs.py join`` (``summary.json``), ``timed`` (optional) a
``bench speedup`` or ``bench learned`` summary.json with the realized content speedup. Writes
``frontier.json``, ``frontier.md`` (the table) and ``frontier.png`` to ``--out``.

    python bench/frontier.py --points bench/results/frontier-smollm2-cpu/points.json \\
        --out bench/results/frontier-smollm2-cpu
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _score(outcome: str | None) -> float | None:
    return {"win": 1.0, "tie": 0.5, "loss": 0.0}.get(outcome) if outcome else None


def win_rate_interval(rows: list[dict], draws: int = 2000, seed: int = 0) -> tuple[float, float, float]:
    """Mean win rate over both orders (ties half) and its 95% bootstrap interval over prompts
    (each prompt's two verdicts stay together).

    Each order must be judged on every row or on none (an order nobody has judged yet leaves the
    other's rate): then the mean over prompts is the summary's ``mean_win_rate``, the mean of the
    two orders' rates. Raises ValueError naming the order and how many rows it misses when it
    judged only some rows (a reading that skipped rows would give a figure that is neither)."""
    for order in ("first_order", "reversed_order"):
        judged = sum(r.get(order) is not None for r in rows)
        if 0 < judged < len(rows):
            raise ValueError(f"{order} judged {judged} of {len(rows)} rows: the win rate over both orders needs "
                             "each order judged on every row (or not at all)")
    per = []
    for r in rows:
        s = [x for x in (_score(r.get("first_order")), _score(r.get("reversed_order"))) if x is not None]
        if s:
            per.append(sum(s) / len(s))
    if not per:
        raise ValueError("no judged rows")
    rng = random.Random(seed)
    means = sorted(sum(rng.choice(per) for _ in per) / len(per) for _ in range(draws))
    return sum(per) / len(per), means[int(0.025 * draws)], means[int(0.975 * draws) - 1]


def _realized(timed: Path) -> dict | None:
    """The realized content speedup of a timed run's summary (``bench learned``'s adapter side, or
    ``bench speedup``'s), with ``realized_spread_over_repeats`` (the geomean's min / median / max
    over the timed repeats, from the summary's ``timing``) and, where the summary has it,
    ``realized_spread_over_prompts`` (per-prompt percentiles); None without a realized figure."""
    s = json.loads(timed.read_text())
    s = s.get("summary", s)
    if "adapter_pasta" in s:  # bench learned
        a = s["adapter_pasta"]
        return {"realized": a.get("geomean_realized_content_speedup"),
                "realized_spread_over_repeats": (a.get("timing") or {}).get("geomean_realized_content_speedup_spread"),
                "realized_spread_over_prompts": a.get("realized_content_speedup_spread"),
                "theoretical_timed": a.get("geomean_content_speedup"), "prompts": s.get("prompts")}
    for key in ("geomean_realized_content_speedup", "realized_content_speedup"):
        if key in s:
            return {"realized": s[key],
                    "realized_spread_over_repeats": (s.get("timing") or {}).get("geomean_realized_content_speedup_spread"),
                    "realized_spread_over_prompts": s.get("realized_content_speedup_spread"),
                    "theoretical_timed": s.get("geomean_content_speedup"),
                    "prompts": s.get("answers", s.get("traces", s.get("prompts")))}
    return None


def point(p: dict, base: Path) -> dict:
    screen = json.loads((base / p["screen"] / "summary.json").read_text())
    judge = json.loads((base / p["judge"] / "summary.json").read_text())
    try:
        mean, lo, hi = win_rate_interval(judge["rows"])
    except ValueError as e:
        raise ValueError(f"{base / p['judge'] / 'summary.json'}: {e}") from None
    out = {"label": p["label"], "theoretical_content_speedup": screen["geomean_content_speedup"],
           "fork_rate": screen["fork_rate"], "mean_threads": screen["mean_threads"],
           "forks_passing_independence": screen.get("forks_passing_independence"),
           "win_rate": mean, "win_rate_ci95": [lo, hi], "win_rate_first_order": judge["first_order"]["win_rate"],
           "win_rate_reversed_order": judge["reversed_order"]["win_rate"],
           "wins_losses_ties": [judge["first_order"]["wins"] + judge["reversed_order"]["wins"],
                                judge["first_order"]["losses"] + judge["reversed_order"]["losses"],
                                judge["first_order"]["ties"] + judge["reversed_order"]["ties"]],
           "screen": p["screen"], "judge": p["judge"]}
    if p.get("timed"):
        out.update(_realized(base / p["timed"]) or {})
        out["timed"] = p["timed"]
    return out


def table(points: list[dict]) -> str:
    lines = ["| operating point | theoretical | realized | forked | win rate (both orders) | 95% interval | "
             "first / reversed | W-L-T |", "|---|---|---|---|---|---|---|---|"]
    def pct(v: float | None) -> str:
        return "-" if v is None else f"{v:.1%}"  # an order nobody has judged yet

    for q in points:
        real = f"{q['realized']:.2f}x" if q.get("realized") else "-"
        theo = q["theoretical_content_speedup"]  # None: every answer of the screen was empty
        theo = "-" if theo is None else f"{theo:.2f}x"
        lines.append(f"| {q['label']} | {theo} | {real} | {q['fork_rate']:.0%} | "
                     f"{q['win_rate']:.1%} | {q['win_rate_ci95'][0]:.1%}-{q['win_rate_ci95'][1]:.1%} | "
                     f"{pct(q['win_rate_first_order'])} / {pct(q['win_rate_reversed_order'])} | "
                     f"{'-'.join(map(str, q['wins_losses_ties']))} |")
    return "\n".join(lines) + "\n"


def plot(points: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for q in points:
        x = q["theoretical_content_speedup"]
        if x is None:  # no answer with content: no speedup to place it at (the table shows "-")
            continue
        y = 100 * q["win_rate"]
        lo, hi = (100 * v for v in q["win_rate_ci95"])
        ax.errorbar([x], [y], yerr=[[y - lo], [hi - y]], fmt="o", capsize=3)
        if q.get("realized"):
            ax.plot([q["realized"]], [y], marker="x", color="gray")
        ax.annotate(q["label"], (x, y), textcoords="offset points", xytext=(5, 5), fontsize=8)
    ax.axhline(50, color="k", lw=0.8, ls="--")
    ax.set_xlabel("content speedup (o theoretical, x realized on CPU)")
    ax.set_ylabel("win rate vs base model, sequential (%)")
    ax.set_title("PASTA speed-quality frontier (SmolLM2-135M, vicuna 80)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--points", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--base", type=Path, default=ROOT, help="folder the points' paths are relative to")
    a = ap.parse_args()
    try:
        points = [point(p, a.base) for p in json.loads(a.points.read_text())]
    except (OSError, ValueError, KeyError) as e:  # a missing file, a partial reading, a point without a field
        what = f"cannot read {e.filename}: {e.strerror}" if isinstance(e, OSError) and e.filename else \
            f"a point has no {e}" if isinstance(e, KeyError) else str(e)
        raise SystemExit(f"frontier: {what}") from None
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "frontier.json").write_text(json.dumps({"points": points, "command": "python bench/frontier.py "
                                                     f"--points {a.points} --out {a.out}"}, indent=1) + "\n")
    (a.out / "frontier.md").write_text(table(points))
    plot(points, a.out / "frontier.png")
    print(table(points))


if __name__ == "__main__":
    main()
