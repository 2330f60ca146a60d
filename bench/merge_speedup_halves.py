"""Merge ``bench speedup`` runs over disjoint halves of a trace file (run at once, one process
pinned per core) into one summary: the rows of every half's ``prompts.jsonl`` and
:func:`pasta_engine.tools.bench.summarize_speedup` over them, with each half's settings.

    python bench/merge_speedup_halves.py --out DIR HALF_DIR [HALF_DIR ...]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("halves", type=Path, nargs="+")
    a = ap.parse_args()
    from pasta_engine.tools.bench import summarize_speedup

    rows, settings = [], []
    for h in a.halves:
        rows += [json.loads(x) for x in (h / "prompts.jsonl").read_text().splitlines() if x.strip()]
        settings.append(json.loads((h / "summary.json").read_text())["settings"])
    rows.sort(key=lambda r: r["index"])
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    summary = {"summary": summarize_speedup(rows), "settings": {"halves": [str(h) for h in a.halves],
                                                                "per_half": settings}}
    (a.out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    s = summary["summary"]
    print(f"{s['prompts']} prompts: theoretical {s['geomean_content_speedup']:.3f}x, realized "
          f"{s['geomean_realized_content_speedup']:.3f}x")


if __name__ == "__main__":
    main()
