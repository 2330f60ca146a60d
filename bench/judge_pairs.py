"""A blind pairwise reading by an LLM judge: pair files, their key, and the joined win rate.

``make``: from two AlpacaEval-format outputs files (a list of ``{instruction, output}``; the rows
are paired by instruction, in the candidate file's order), writes ``pairs.jsonl`` (``id``, ``question``, ``answer_a``, ``answer_b``: the two
answers in a seeded random order), ``pairs_reversed.jsonl`` (every order swapped) and ``key.json``
(which side is the candidate in each file). The judge sees only a pairs file; the key stays
with us.

``join``: reads the verdicts of the judge on both files (JSONL: ``id``, ``verdict`` A/B/tie,
``confidence``, ``score_a``, ``score_b``, ``reason``) and the key, and writes the candidate's
win rate (ties half) in each order and their mean, with wins, losses and ties, and a row per
question (both verdicts seen from the candidate's side) to ``summary.json``.

    python bench/judge_pairs.py make --candidate new.json --baseline base.json --out DIR --seed 0
    python bench/judge_pairs.py join --out DIR
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path


def make(candidate: Path, baseline: Path, out: Path, seed: int, label: str) -> None:
    cand = json.loads(candidate.read_text())
    by_instruction = {r["instruction"]: r for r in json.loads(baseline.read_text())}
    if sorted(r["instruction"] for r in cand) != sorted(by_instruction):
        raise SystemExit("the two outputs files must hold the same instructions")
    base = [by_instruction[r["instruction"]] for r in cand]  # paired by instruction, in the candidate's order
    rng = random.Random(seed)
    out.mkdir(parents=True, exist_ok=True)
    key, fwd, rev = [], [], []
    for i, (c, b) in enumerate(zip(cand, base)):
        cand_is_a = rng.random() < 0.5
        a, bb = (c["output"], b["output"]) if cand_is_a else (b["output"], c["output"])
        fwd.append({"id": i, "question": c["instruction"], "answer_a": a, "answer_b": bb})
        rev.append({"id": i, "question": c["instruction"], "answer_a": bb, "answer_b": a})
        key.append({"id": i, "candidate_in_pairs": "A" if cand_is_a else "B",
                    "candidate_in_pairs_reversed": "B" if cand_is_a else "A"})
    (out / "pairs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in fwd))
    (out / "pairs_reversed.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rev))
    (out / "key.json").write_text(json.dumps({"candidate": str(candidate), "baseline": str(baseline), "label": label,
                                              "seed": seed, "rows": key}, indent=1) + "\n")


def _verdicts(path: Path) -> dict[int, dict]:
    out = {}
    for line in path.read_text().splitlines():
        if line.strip():
            v = json.loads(line)
            out[int(v["id"])] = v
    return out


def _side(verdict: str, cand_letter: str) -> str:
    v = verdict.strip().upper()
    if v == "TIE":
        return "tie"
    return "win" if v == cand_letter else "loss"


def join(out: Path) -> dict:
    key = json.loads((out / "key.json").read_text())
    fwd, rev = _verdicts(out / "verdicts.jsonl"), _verdicts(out / "verdicts_reversed.jsonl")
    rows, tallies = [], {"pairs": [], "pairs_reversed": []}
    for k in key["rows"]:
        i = k["id"]
        a = _side(fwd[i]["verdict"], k["candidate_in_pairs"]) if i in fwd else None
        b = _side(rev[i]["verdict"], k["candidate_in_pairs_reversed"]) if i in rev else None
        tallies["pairs"].append(a)
        tallies["pairs_reversed"].append(b)
        rows.append({"id": i, "first_order": a, "reversed_order": b})

    def rate(xs: list) -> dict:
        xs = [x for x in xs if x is not None]
        w, l, t = xs.count("win"), xs.count("loss"), xs.count("tie")
        return {"judged": len(xs), "wins": w, "losses": l, "ties": t,
                "win_rate": (w + 0.5 * t) / len(xs) if xs else None}

    first, second = rate(tallies["pairs"]), rate(tallies["pairs_reversed"])
    both = [r for r in rows if r["first_order"] and r["reversed_order"]]
    agree = sum(r["first_order"] == r["reversed_order"] for r in both)
    summary = {"label": key["label"], "candidate": key["candidate"], "baseline": key["baseline"],
               "first_order": first, "reversed_order": second,
               "mean_win_rate": (first["win_rate"] + second["win_rate"]) / 2
               if first["win_rate"] is not None and second["win_rate"] is not None else None,
               "orders_agree": agree, "rows_judged_twice": len(both),
               "method": "a blind pairwise reading by an LLM judge (MT-bench/AlpacaEval pairwise style), each order "
                         "judged by a separate fresh reader; ties count half", "rows": rows}
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    return summary


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("make")
    m.add_argument("--candidate", type=Path, required=True)
    m.add_argument("--baseline", type=Path, required=True)
    m.add_argument("--out", type=Path, required=True)
    m.add_argument("--seed", type=int, default=0)
    m.add_argument("--label", default="")
    j = sub.add_parser("join")
    j.add_argument("--out", type=Path, required=True)
    a = p.parse_args()
    if a.cmd == "make":
        make(a.candidate, a.baseline, a.out, a.seed, a.label)
        print(f"wrote {a.out}/pairs.jsonl, pairs_reversed.jsonl, key.json")
    else:
        s = join(a.out)
        print(json.dumps({k: v for k, v in s.items() if k != "rows"}, indent=1))


if __name__ == "__main__":
    main()
