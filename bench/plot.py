"""Render benchmark JSON (bench/results/*.json) as PNG plots next to it (matplotlib).

Usage: ``python bench/plot.py [FILE.json ...]`` (default: every JSON in bench/results); the kind
of plot follows the file name. GPU: tree_attention_*, decode_step_*. CPU: cpu_rows* (a step
against its row count, bench_cpu_rows.py), host_step_* (the host's split of a step against live
threads, bench_host.py), cpu_threads* (ms per step against torch threads, with and without a busy
process, bench_threads.py), server_load_* (time to first token and inter-token latency,
bench_server_load.py), cpu_micro* (pytest-benchmark medians, test_cpu_micro.py), *generate_both*
(realized against theoretical speedup per prompt of a ``generate --mode both`` run). A file of
another kind is skipped with a line saying so."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def plot_tree(data: dict, out: Path) -> None:
    """One panel per model shape: the tree kernel's speedup over the plain per-thread kernel
    against the threads decoding together, one line per shared prefix (tokens), at the longest
    private suffix; rows as bench_tree_attention.py writes them (``model_shape``, ``shape``)."""
    rows = data["rows"]
    suffix = max(r["shape"]["suffix"] for r in rows)
    shapes = sorted({r["model_shape"] for r in rows})
    fig, axes = plt.subplots(1, len(shapes), figsize=(6 * len(shapes), 4.5), squeeze=False)
    for ax, shape in zip(axes[0], shapes):
        mine = [r for r in rows if r["model_shape"] == shape and r["shape"]["suffix"] == suffix]
        for prefix in sorted({r["shape"]["prefix"] for r in mine}):
            sel = sorted((r for r in mine if r["shape"]["prefix"] == prefix), key=lambda r: r["shape"]["threads"])
            ax.plot([r["shape"]["threads"] for r in sel], [r["tree_speedup_vs_plain"] for r in sel], marker="o",
                    label=f"prefix {prefix}")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("threads")
        ax.set_ylabel(f"speedup of tree over plain per-thread (suffix {suffix})")
        ax.set_title(f"{shape} on {data['device'].get('device', '?')}")
        ax.legend()
    fig.tight_layout()
    fig.savefig(out)


def plot_decode(data: dict, out: Path) -> None:
    rows = [r for r in data["rows"] if "step_ms" in r]
    models = sorted({r["model"] for r in rows})
    fig, axes = plt.subplots(1, len(models), figsize=(6 * len(models), 4.5), squeeze=False)
    for ax, m in zip(axes[0], models):
        for graphs in (False, True):
            sel = sorted((r for r in rows if r["model"] == m and r["cuda_graphs"] == graphs), key=lambda r: r["width"])
            ax.plot([r["width"] for r in sel], [r["step_ms"] for r in sel], marker="o", label=f"graphs={graphs}")
        sel = sorted((r for r in rows if r["model"] == m and r["cuda_graphs"]), key=lambda r: r["width"])
        ax.plot([r["width"] for r in sel], [r["roofline_ms"] for r in sel], "k--", label="roofline")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("threads decoding together")
        ax.set_ylabel("ms per decode step")
        ax.set_title(m)
        ax.legend()
    fig.tight_layout()
    fig.savefig(out)


def _title(data: dict, what: str) -> str:
    where = data.get("machine") or data.get("device") or data.get("host") or ""
    if isinstance(where, dict):
        where = where.get("device", "")
    load = data.get("load_average_1m_start", data.get("load_average_1m"))
    return f"{what}\n{where}" + (f" (load average {load:.2f})" if isinstance(load, (int, float)) else "")


def plot_cpu_rows(data: dict, out: Path) -> None:
    rows = data["results"]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for key, label in (("f_linear_step_ms", "F.linear"), ("chosen_step_ms", "per-shape choice (layers/linear.py)")):
        ax.plot([r["rows"] for r in rows], [r[key] for r in rows], marker="o", label=label)
    if "floor_ms" in data:
        ax.axhline(data["floor_ms"], color="k", ls="--", lw=1, label="floor: weights / copy bandwidth")
    ax.set_xlabel("rows in the step (live threads)")
    ax.set_ylabel("ms per decode step (median)")
    ax.set_ylim(bottom=0)
    ax.set_title(_title(data, "CPU decode step against its row count"), fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out)


def plot_host_step(data: dict, out: Path) -> None:
    rows = data["results"]
    parts = [k for k in ("schedule_us", "interp_us", "plan_us", "forward_us", "sample_us", "other_us") if k in rows[0]]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    x = list(range(len(rows)))
    bottom = [0.0] * len(rows)
    for k in parts:
        vals = [r.get(k, 0.0) for r in rows]
        ax.bar(x, vals, bottom=bottom, label=k.removesuffix("_us"))
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax.set_xticks(x, [str(r["threads"]) for r in rows])
    ax.set_xlabel("live threads")
    ax.set_ylabel("us per step (median, split)")
    ax.set_title(_title(data, f"host time per step, {data.get('engine_kind', 'engine')}"), fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out)


def plot_cpu_threads(data: dict, out: Path) -> None:
    rows = data["results"]
    names = list(dict.fromkeys(r["threads"] for r in rows))
    busy = sorted({r["busy_processes_added"] for r in rows})
    fig, ax = plt.subplots(figsize=(7, 4.5))
    width = 0.8 / len(busy)
    for j, b in enumerate(busy):
        sel = {r["threads"]: r for r in rows if r["busy_processes_added"] == b}
        xs = [i + (j - (len(busy) - 1) / 2) * width for i, n in enumerate(names) if n in sel]
        med = [sel[n]["step_ms_median"] for n in names if n in sel]
        lo = [sel[n]["step_ms_median"] - sel[n]["step_ms_p10"] for n in names if n in sel]
        hi = [sel[n]["step_ms_p90"] - sel[n]["step_ms_median"] for n in names if n in sel]
        ax.bar(xs, med, width, yerr=[lo, hi], capsize=3, label=f"+{b} busy process{'es' if b != 1 else ''}")
    ax.set_xticks(range(len(names)), [f"{n} ({next(r['torch_threads'] for r in rows if r['threads'] == n)})"
                                      for n in names])
    ax.set_xlabel("torch threads (setting and count)")
    ax.set_ylabel("ms per decode step (median, p10-p90)")
    ax.set_title(_title(data, "sequential decode step against torch threads, under contention"), fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out)


def plot_server_load(data: dict, out: Path) -> None:
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(9, 4))
    for ax, key, what in ((a1, "ttft_s", "time to first token"), (a2, "itl_s", "inter-token latency")):
        vals = data[key]
        ks = [k for k in ("p50", "p99", "max") if k in vals]
        ax.bar(ks, [vals[k] for k in ks])
        ax.set_ylabel("seconds")
        ax.set_title(what, fontsize=9)
    fig.suptitle(_title(data, f"serve load: {data.get('requests')} requests, {data.get('tokens_per_s', 0):.1f} tokens/s"),
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(out)


def plot_pytest_benchmark(data: dict, out: Path) -> None:
    bench = data["benchmarks"]
    fig, ax = plt.subplots(figsize=(8, 0.6 * len(bench) + 1.5))
    med = [1e6 * b["stats"]["median"] for b in bench]
    iqr = [1e6 * b["stats"].get("iqr", 0.0) / 2 for b in bench]
    ax.barh([b["name"].removeprefix("test_") for b in bench], med, xerr=iqr, capsize=3)
    ax.set_xscale("log")
    ax.set_xlabel("us (median, half the IQR as error)")
    ax.set_title(data.get("machine_info", {}).get("cpu", {}).get("brand_raw", "CPU micro-benchmarks"), fontsize=9)
    fig.tight_layout()
    fig.savefig(out)


def plot_generate_both(data: dict, out: Path) -> None:
    rows = data["per_prompt"]

    def get(r: dict, *keys: str) -> float | None:
        for k in keys:
            for src in (r, r.get("pasta", {}), r.get("pasta", {}).get("stats", {})):
                if isinstance(src, dict) and src.get(k) is not None:
                    return src[k]
        return None

    th = [get(r, "content_speedup", "theoretical_speedup") for r in rows]
    re_ = [get(r, "realized_content_speedup", "realized_speedup") for r in rows]
    pts = [(t, x) for t, x in zip(th, re_) if t is not None and x is not None]
    fig, ax = plt.subplots(figsize=(6, 5))
    ax.scatter([t for t, _ in pts], [x for _, x in pts], s=16)
    hi = max([1.0] + [v for pt in pts for v in pt]) * 1.05
    ax.plot([0, hi], [0, hi], "k--", lw=1, label="y = x")
    ax.set_xlabel("theoretical speedup")
    ax.set_ylabel("realized speedup")
    ax.set_title(_title(data, f"generate --mode both, {len(pts)} prompts"), fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out)


#: (file-name test, plot function): the first that matches draws the file.
KINDS = (
    (lambda n: n.startswith("tree_attention"), plot_tree),
    (lambda n: n.startswith("decode_step"), plot_decode),
    (lambda n: n.startswith("cpu_rows"), plot_cpu_rows),
    (lambda n: n.startswith("host_step"), plot_host_step),
    (lambda n: n.startswith("cpu_threads"), plot_cpu_threads),
    (lambda n: n.startswith("server_load"), plot_server_load),
    (lambda n: n.startswith("cpu_micro"), plot_pytest_benchmark),
    (lambda n: "generate_both" in n, plot_generate_both),
)


def main(paths: list[str]) -> None:
    if not paths:
        paths = sorted(str(p) for p in (Path(__file__).resolve().parent / "results").glob("*.json"))
    for p in map(Path, paths):
        data = json.loads(p.read_text())
        out = p.with_suffix(".png")
        draw = next((fn for test, fn in KINDS if test(p.name)), None)
        if draw is None:
            print(f"skip {p} (no plot for this kind)")
            continue
        draw(data, out)
        plt.close("all")
        print(f"wrote {out}")


if __name__ == "__main__":
    main(sys.argv[1:])
