"""How often each offline quality proxy agrees with the blind pairwise reading (issue 30, item 1).

For each prompt the reading gives the candidate's outcome in both orders (win 1, tie 0.5, loss
0; their mean). A proxy agrees on a prompt when it prefers the same side: its value for the
candidate is better than the baseline's where the reader preferred the candidate (mean above
0.5), worse where the reader preferred the baseline. Prompts the reader found even, and prompts
the proxy cannot separate (equal values), are left out and counted. Proxies: the base model's
mean log-likelihood per token of the clean answer (``--likelihood``; loads the embedded model),
distinct-2, repeated lines (fewer is better), empty list items (fewer is better), and answer
length in words (more is "better": the length bias a judge must avoid). Each summary row is
joined to its answers through its id's question in ``pairs.jsonl`` (never by position); a
question missing from either answers file, a missing file, or a reading with no verdict is an
error naming it. Rows no reader judged are left out and counted (``unread``).

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


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError as e:
        raise SystemExit(f"proxy_agreement: cannot read {path}: {e.strerror or e}") from None


def _read_json(path: Path):
    try:
        return json.loads(_read(path))
    except json.JSONDecodeError as e:
        raise SystemExit(f"proxy_agreement: {path} is not JSON: {e}") from None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--judge", type=Path, required=True, help="a bench/judge_pairs.py folder (joined)")
    ap.add_argument("--likelihood", action="store_true", help="also the base model's likelihood (loads the model)")
    a = ap.parse_args()
    from pasta_engine.metrics import distinct_n, empty_list_items, repeated_line_fraction

    s, key = _read_json(a.judge / "summary.json"), _read_json(a.judge / "key.json")
    question = {}
    for line in _read(a.judge / "pairs.jsonl").splitlines():
        if line.strip():
            row = json.loads(line)
            question[row["id"]] = row["question"]
    answers = {}
    for side in ("candidate", "baseline"):
        path = ROOT / key[side]
        answers[side] = {r["instruction"]: r for r in _read_json(path)}
    score = {"win": 1.0, "tie": 0.5, "loss": 0.0}
    reader, cand, base, unread = [], [], [], 0
    for r in s["rows"]:
        xs = [score[x] for x in (r["first_order"], r["reversed_order"]) if x]
        if not xs:
            unread += 1
            continue
        q = question.get(r["id"])
        if q is None:
            raise SystemExit(f"proxy_agreement: {a.judge / 'pairs.jsonl'} has no row {r['id']} of summary.json")
        for side, into in (("candidate", cand), ("baseline", base)):
            if q not in answers[side]:
                raise SystemExit(f"proxy_agreement: {key[side]} has no answer to pairs.jsonl row {r['id']}'s question "
                                 f"{q[:60]!r}: it is not the file this reading was made from")
            into.append(answers[side][q])
        reader.append(sum(xs) / len(xs))
    if not reader:
        raise SystemExit(f"proxy_agreement: {a.judge / 'summary.json'} joins no verdict: read the pairs first")
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
    out = {"judge": str(a.judge), "label": s.get("label"), "prompts": len(reader), "unread": unread,
           "reader_prefers_candidate": sum(r > 0.5 for r in reader), "reader_prefers_baseline": sum(r < 0.5 for r in reader),
           "proxies": {name: agreement(c, b, reader, hib) for name, (c, b, hib) in proxies.items()},
           "method": "share of the prompts the reader decided (mean of both orders not 0.5) on which the proxy prefers "
                     "the same side; 0.5 is chance"}
    (a.judge / "proxy_agreement.json").write_text(json.dumps(out, indent=1) + "\n")
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
