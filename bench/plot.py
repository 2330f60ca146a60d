"""Render benchmark JSON (bench/results/*.json) as PNG plots next to it (matplotlib).

Usage: ``python bench/plot.py bench/results/tree_attention_NVIDIA_H100.json [...]``; the
kind of plot follows the file name (tree_attention_*, decode_step_*)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def plot_tree(data: dict, out: Path) -> None:
    rows = data["rows"]
    shapes = sorted({r["shape"] for r in rows})
    fig, axes = plt.subplots(1, len(shapes), figsize=(6 * len(shapes), 4.5), squeeze=False)
    for ax, shape in zip(axes[0], shapes):
        for prefix in sorted({r["prefix"] for r in rows}):
            sel = sorted((r for r in rows if r["shape"] == shape and r["prefix"] == prefix and r["suffix"] == max(
                x["suffix"] for x in rows)), key=lambda r: r["threads"])
            ax.plot([r["threads"] for r in sel], [r["speedup_vs_plain"] for r in sel], marker="o", label=f"prefix {prefix}")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("threads")
        ax.set_ylabel("speedup of tree over plain per-thread")
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


def main(paths: list[str]) -> None:
    for p in map(Path, paths):
        data = json.loads(p.read_text())
        out = p.with_suffix(".png")
        if p.name.startswith("tree_attention"):
            plot_tree(data, out)
        elif p.name.startswith("decode_step"):
            plot_decode(data, out)
        else:
            print(f"skip {p} (no plot for this kind)")
            continue
        print(f"wrote {out}")


if __name__ == "__main__":
    main(sys.argv[1:])
