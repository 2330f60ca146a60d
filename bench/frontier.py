"""The speed-quality frontier (the paper's Figure 4, Jin et al., ICML 2025, arXiv 2502.11517):
operating points of learned PASTA, each with its theoretical and realized content speedup and its
win rate against the base model's sequential answers (a blind pairwise reading by an LLM judge,
both orders, ties half) with a bootstrap interval over prompts.

Reads stored rows only, so the table and the plot can be redrawn without running anything. The
points file is a JSON list of ``{"label", "screen", "judge", "timed"?}``: ``screen`` a folder of
``bench/screen_adapter.py`` (theoretical content speedup, fork rate, independence checks),
``judge`` a folder of ``bench/judge_pairs.py join`` (``summary.json``), or a list of such folders
(independent readings of the same answers, by other readers in another order: each prompt's
verdicts are pooled, so the bootstrap interval is over prompts with every reader's verdicts on
each), ``timed`` (optional) a
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


def _check_whole_orders(rows: list[dict]) -> None:
    """Raises ValueError naming the order and how many rows it judged when an order of one reading
    judged only some of its rows (a figure over such a reading would be neither order's)."""
    for order in ("first_order", "reversed_order"):
        judged = sum(r.get(order) is not None for r in rows)
        if 0 < judged < len(rows):
            raise ValueError(f"{order} judged {judged} of {len(rows)} rows: the win rate over both orders needs "
                             "each order judged on every row (or not at all)")


def win_rate_interval(rows: list[dict], draws: int = 2000, seed: int = 0) -> tuple[float, float, float]:
    """Mean win rate over both orders (ties half) and its 95% bootstrap interval over prompts
    (each prompt's two verdicts stay together): :func:`pooled_win_rate_interval` of one reading.

    Each order must be judged on every row or on none (an order nobody has judged yet leaves the
    other's rate): then the mean over prompts is the summary's ``mean_win_rate``, the mean of the
    two orders' rates. Raises ValueError naming the order and how many rows it misses when it
    judged only some rows (a reading that skipped rows would give a figure that is neither)."""
    return pooled_win_rate_interval([rows], draws, seed)


def pooled_win_rate_interval(readings: list[list[dict]], draws: int = 2000,
                             seed: int = 0) -> tuple[float, float, float]:
    """Mean win rate (ties half) over several readings of the same answers (each a ``join``
    summary's ``rows``: ``id``, ``first_order``, ``reversed_order``) and its 95% bootstrap
    interval over prompts: each prompt's score is the mean of all its verdicts, so a prompt's
    verdicts stay together. Raises ValueError when an order of a reading judged only some rows
    (:func:`_check_whole_orders`), when the readings judge different prompts, or when no row is
    judged."""
    for rows in readings:
        _check_whole_orders(rows)
    ids = [sorted(r["id"] for r in rows) for rows in readings]
    if any(i != ids[0] for i in ids):
        raise ValueError("the readings of one point must judge the same prompts")
    verdicts: dict = {i: [] for i in ids[0]}
    for rows in readings:
        for r in rows:
            verdicts[r["id"]] += [_score(r.get("first_order")), _score(r.get("reversed_order"))]
    per = []
    for v in verdicts.values():
        s = [x for x in v if x is not None]
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
    folders = p["judge"] if isinstance(p["judge"], list) else [p["judge"]]
    where = [base / f / "summary.json" for f in folders]
    readings = [json.loads(w.read_text()) for w in where]
    for j, w in zip(readings, where):
        try:
            _check_whole_orders(j["rows"])  # each reading whole in each order it has
        except ValueError as e:
            raise ValueError(f"{w}: {e}") from None
    try:
        mean, lo, hi = pooled_win_rate_interval([j["rows"] for j in readings])
    except ValueError as e:
        raise ValueError(f"{', '.join(map(str, where))}: {e}") from None

    def avg(order: str) -> float | None:
        rates = [j[order]["win_rate"] for j in readings]
        return None if None in rates else sum(rates) / len(rates)

    out = {"label": p["label"], "theoretical_content_speedup": screen["geomean_content_speedup"],
           "fork_rate": screen["fork_rate"], "mean_threads": screen["mean_threads"],
           "forks_passing_independence": screen.get("forks_passing_independence"),
           "win_rate": mean, "win_rate_ci95": [lo, hi], "win_rate_first_order": avg("first_order"),
           "win_rate_reversed_order": avg("reversed_order"),
           "wins_losses_ties": [sum(j[o][k] for j in readings for o in ("first_order", "reversed_order"))
                                for k in ("wins", "losses", "ties")],
           "screen": p["screen"], "judge": p["judge"]}
    if len(readings) > 1:
        out["readings"] = [{"first_order": j["first_order"]["win_rate"],
                            "reversed_order": j["reversed_order"]["win_rate"]} for j in readings]
    if p.get("timed"):
        out.update(_realized(base / p["timed"]) or {})
        out["timed"] = p["timed"]
    return out


def table(points: list[dict]) -> str:
    lines = ["| operating point | theoretical | realized | forked | win rate (both orders) | 95% interval | "
             "first / reversed (per reading) | W-L-T |", "|---|---|---|---|---|---|---|---|"]
    def pct(v: float | None) -> str:
        return "-" if v is None else f"{v:.1%}"  # an order nobody has judged yet

    for q in points:
        real = f"{q['realized']:.2f}x" if q.get("realized") else "-"
        theo = q["theoretical_content_speedup"]  # None: every answer of the screen was empty
        timed = q.get("theoretical_timed")  # a subset's realized figure is read against that subset's theoretical
        if q.get("realized") and timed and (theo is None or abs(timed - theo) >= 0.005):
            real += f" ({timed:.2f}x theoretical on the {q.get('prompts') or '?'} timed)"
        theo = "-" if theo is None else f"{theo:.2f}x"
        orders = "; ".join(f"{pct(r['first_order'])} / {pct(r['reversed_order'])}"  # each reading's two orders
                           for r in q.get("readings", [{"first_order": q["win_rate_first_order"],
                                                        "reversed_order": q["win_rate_reversed_order"]}]))
        lines.append(f"| {q['label']} | {theo} | {real} | {q['fork_rate']:.0%} | "
                     f"{q['win_rate']:.1%} | {q['win_rate_ci95'][0]:.1%}-{q['win_rate_ci95'][1]:.1%} | "
                     f"{orders} | "
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
