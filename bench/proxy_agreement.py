"""How often each offline quality proxy agrees with the blind pairwise reading (issue 30, item 1).

For each prompt the reading gives the candidate's outcome in both orders (win 1, tie 0.5, loss
0; their mean). A proxy agrees on a prompt when it prefers the same side: its value for the
candidate is better than the baseline's where the reader preferred the candidate (mean above
0.5), worse where the reader preferred the baseline. Prompts the reader found even, and prompts
the proxy cannot separate (equal values), are left out and counted. Proxies: the base model's
mean log-likelihood per token of the clean answer (``--likelihood``; loads the embedded model),
distinct-2, repeated lines (fewer is better), empty list items (fewer is better), answer length
in words (more is "better": the length bias a judge must avoid), and cut by the token budget.

    python bench/proxy_agreement.py --judge bench/results/judge-vicuna-stage4 [--likelihood]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def agreement(cand: list[float], base: list[float], reader: list[float], higher_is_better: bool = True) -> dict:
    """Agreement of one proxy with the reader over prompts (see the module docstring)."""
    agree = disagree = even = unseparated = 0
    for c, b, r in zip(cand, base, reader):
        if r == 0.5:
            even += 1
            continue
        if c == b:
            unseparated += 1
            continue
        proxy_prefers_cand = (c > b) == higher_is_better
        if proxy_prefers_cand == (r > 0.5):
            agree += 1
        else:
            disagree += 1
    n = agree + disagree
    return {"agreement": agree / n if n else None, "decided": n, "reader_even": even, "proxy_even": unseparated}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--judge", type=Path, required=True, help="a bench/judge_pairs.py folder (joined)")
    ap.add_argument("--likelihood", action="store_true", help="also the base model's likelihood (loads the model)")
    a = ap.parse_args()
    from pasta_engine.metrics import distinct_n, empty_list_items, repeated_line_fraction

    s = json.loads((a.judge / "summary.json").read_text())
    key = json.loads((a.judge / "key.json").read_text())
    cand = json.loads((ROOT / key["candidate"]).read_text())
    by_instruction = {r["instruction"]: r for r in json.loads((ROOT / key["baseline"]).read_text())}
    base = [by_instruction[r["instruction"]] for r in cand]  # as judge_pairs.py paired them
    score = {"win": 1.0, "tie": 0.5, "loss": 0.0}
    reader = []
    for r in s["rows"]:
        xs = [score[x] for x in (r["first_order"], r["reversed_order"]) if x]
        reader.append(sum(xs) / len(xs))
    texts_c = [r["output"] for r in cand]
    texts_b = [r["output"] for r in base]
    proxies = {
        "distinct_2": ([distinct_n(t, 2) for t in texts_c], [distinct_n(t, 2) for t in texts_b], True),
        "repeated_lines": ([repeated_line_fraction(t) for t in texts_c], [repeated_line_fraction(t) for t in texts_b],
                           False),
        "empty_list_items": ([empty_list_items(t) for t in texts_c], [empty_list_items(t) for t in texts_b], False),
        "length_words": ([len(t.split()) for t in texts_c], [len(t.split()) for t in texts_b], True),
    }
    if a.likelihood:
        from pasta_engine.train.common import load_base
        from pasta_engine.train.quality import LikelihoodQuality

        hf, tok, _ = load_base(None)
        q = LikelihoodQuality(hf.eval(), tok)
        proxies["likelihood"] = ([q.mean_loglik(r["instruction"], r["output"]) for r in cand],
                                 [q.mean_loglik(r["instruction"], r["output"]) for r in base], True)
    out = {"judge": str(a.judge), "label": s.get("label"), "prompts": len(reader),
           "reader_prefers_candidate": sum(r > 0.5 for r in reader), "reader_prefers_baseline": sum(r < 0.5 for r in reader),
           "proxies": {name: agreement(c, b, reader, hib) for name, (c, b, hib) in proxies.items()},
           "method": "share of the prompts the reader decided (mean of both orders not 0.5) on which the proxy prefers "
                     "the same side; 0.5 is chance"}
    (a.judge / "proxy_agreement.json").write_text(json.dumps(out, indent=1) + "\n")
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
