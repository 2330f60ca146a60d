"""Quality proxies of a stored ``bench learned`` run, side by side, recomputed from its answers.

Usage: ``python bench/quality_proxies.py bench/results/learned-smollm2-cpu``.

Reads ``RUN/prompts.jsonl`` and decodes nothing: per side (base model sequential, adapter in
pasta mode, base model in pasta mode when the run has it) the text-only proxies of the stored
clean answers (``pasta_engine.metrics.summarize_text_proxies``: repeated lines, distinct-2,
answers cut by the token budget, empty list items, tag text in the clean output) and the mean of
the stored likelihood proxy. The same table as ``bench learned``'s ``summary.json``
(``quality_proxies``), for runs written before it had one. Prints one JSON object; the one-line
form goes to stderr.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from pasta_engine.train.evaluate import format_quality_proxies, quality_proxies


def read_rows(path: Path) -> list[dict]:
    """The rows of a run's ``prompts.jsonl``. Raises ValueError naming the file when it is missing
    (not a ``bench learned`` output folder), holds no row, or a line that is not a JSON object."""
    if not path.is_file():
        raise ValueError(f"{path} not found: RUN must be a bench learned output folder (with prompts.jsonl)")
    rows = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError:
            row = None
        if not isinstance(row, dict):
            raise ValueError(f"{path} line {n} is not a JSON object: {line[:80]!r}")
        rows.append(row)
    if not rows:
        raise ValueError(f"{path} holds no row: the run wrote no answer to summarize")
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run", type=Path, help="a bench learned output folder (with prompts.jsonl)")
    args = ap.parse_args(argv)
    path = args.run / "prompts.jsonl"
    try:
        rows = read_rows(path)
        table = quality_proxies(rows)
    except (OSError, ValueError) as e:
        print(f"quality_proxies: error: {e}", file=sys.stderr)
        return 2
    print(format_quality_proxies(table), file=sys.stderr)
    print(json.dumps({"run": str(args.run), "prompts": len(rows), "quality_proxies": table}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
