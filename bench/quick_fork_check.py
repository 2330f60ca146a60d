"""A quick look at an adapter in generate mode: every 10th vicuna prompt (8 of the 80, never
trained on), greedy, pasta mode. Prints per prompt forks, content speedup, tag tokens and the
start of the annotated text, then the fork count, the geomean content speedup, the tag-token
fraction and how many clean texts hold tag text. A sanity check between training stages, not the
evaluation (that is ``pasta-engine bench learned``).

    python bench/quick_fork_check.py --prompts instructions.json --adapter runs/sft/adapter
"""

from __future__ import annotations

import argparse
import json

from pasta_engine import Engine, SamplingParams
from pasta_engine.metrics import geomean


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", required=True, help="AlpacaEval JSON (its vicuna rows are used)")
    ap.add_argument("--adapter", required=True)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    args = ap.parse_args()
    rows = [r for r in json.load(open(args.prompts)) if r.get("dataset") == "vicuna"][0:80:10]
    engine = Engine.from_pretrained(None, adapter=args.adapter, max_running_requests=8)
    res = engine.generate([r["instruction"] for r in rows], SamplingParams(max_new_tokens=args.max_new_tokens),
                          mode="pasta")
    for r in res:
        print(r.stats.forks, round(r.stats.content_speedup, 2), r.stats.tag_tokens, r.stats.tokens_decoded,
              r.stats.finish_reason, repr(r.annotated_text[:300]))
    print("forked", sum(r.stats.forks > 0 for r in res), "of", len(res), "geomean content speedup",
          round(geomean(r.stats.content_speedup for r in res), 4), "tag-token fraction",
          round(sum(r.stats.tag_tokens for r in res) / sum(r.stats.tokens_decoded for r in res), 4),
          "clean texts with tag text", sum(any(t in r.text for t in ("<promise", "<async", "</async", "<sync"))
                                           for r in res))


if __name__ == "__main__":
    main()
