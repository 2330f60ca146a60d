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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run", type=Path, help="a bench learned output folder (with prompts.jsonl)")
    args = ap.parse_args(argv)
    rows = [json.loads(line) for line in (args.run / "prompts.jsonl").read_text().splitlines() if line.strip()]
    table = quality_proxies(rows)
    print(format_quality_proxies(table), file=sys.stderr)
    print(json.dumps({"run": str(args.run), "prompts": len(rows), "quality_proxies": table}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
