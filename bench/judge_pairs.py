"""A blind pairwise reading by an LLM judge: pair files, their key, and the joined win rate.

``make``: from two AlpacaEval-format outputs files (a list of ``{instruction, output}``; the rows
are paired by instruction, in the candidate file's order), writes ``pairs.jsonl`` (``id``, ``question``, ``answer_a``, ``answer_b``: the two
answers in a seeded random order), ``pairs_reversed.jsonl`` (every order swapped) and ``key.json``
(which side is the candidate in each file). The judge sees only a pairs file; the key stays
with us.

``join``: reads the verdicts of the judge on both files (JSONL: ``id``, ``verdict`` A/B/tie,
``confidence``, ``score_a``, ``score_b``, ``reason``) and the key, and writes the candidate's
win rate (ties half) in each order and their mean, with wins, losses and ties, and a row per
question (both verdicts seen from the candidate's side) to ``summary.json``. A verdict file that
is there must judge every row of the key (else it stops naming the file and the ids it misses:
a mean of two orders over different rows is not the figure it claims); a file not there yet is
an order nobody has judged. A key without ``label``, ``candidate`` or ``baseline`` (BoNBoN's
training readings) joins with those fields null.

    python bench/judge_pairs.py make --candidate new.json --baseline base.json --out DIR --seed 0
    python bench/judge_pairs.py join --out DIR
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from pasta_engine.tools.judge import read_blind_sides, write_blind_pairs


#: What a reading leaves in its folder: a new ``make`` there would pair them with another key.
READING_FILES = ("verdicts.jsonl", "verdicts_reversed.jsonl", "summary.json")


def read_outputs(path: Path) -> list[dict]:
    """An AlpacaEval outputs file: a JSON list of objects whose ``instruction`` and ``output`` are
    strings. Raises SystemExit naming the file (and the row) when it is not."""
    try:
        rows = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise SystemExit(f"judge_pairs make: cannot read {path}: {e}") from None
    if not isinstance(rows, list):
        raise SystemExit(f"judge_pairs make: {path} must hold a JSON list of {{instruction, output}} objects, "
                         f"not a {type(rows).__name__}")
    for i, r in enumerate(rows):
        bad = [k for k in ("instruction", "output") if not isinstance(r, dict) or not isinstance(r.get(k), str)]
        if bad:
            raise SystemExit(f"judge_pairs make: {path} row {i} has no string {bad[0]!r} (each row is an object "
                             "with the instruction and the model's output as strings)")
    return rows


def make(candidate: Path, baseline: Path, out: Path, seed: int, label: str) -> None:
    """Write the pair files and their key into ``out`` (see the module docstring). Raises
    SystemExit naming the problem: an outputs file that is not a list of ``{instruction,
    output}`` strings, an instruction twice or in one file only, or a folder that already holds
    a reading (its verdicts would be joined against the new key)."""
    if out.exists() and not out.is_dir():
        raise SystemExit(f"judge_pairs make: --out {out} is a file, not a folder: give a folder (new or made by "
                         "make) for the pairs and their key")
    stale = [n for n in READING_FILES if (out / n).exists()]
    if stale:
        raise SystemExit(f"judge_pairs make: {out} already holds a reading ({', '.join(stale)}): its verdicts were "
                         "given on other pairs; make the new pairs in another folder")
    cand = read_outputs(candidate)
    base_rows = read_outputs(baseline)
    for path, rows in ((candidate, cand), (baseline, base_rows)):
        seen: set[str] = set()
        for r in rows:
            if r["instruction"] in seen:  # rows are paired by instruction: a repeat would pair wrongly
                raise SystemExit(f"{path} holds the instruction {r['instruction'][:60]!r} twice")
            seen.add(r["instruction"])
    by_instruction = {r["instruction"]: r for r in base_rows}
    if sorted(r["instruction"] for r in cand) != sorted(by_instruction):
        raise SystemExit("the two outputs files must hold the same instructions")
    base = [by_instruction[r["instruction"]] for r in cand]  # paired by instruction, in the candidate's order
    try:
        write_blind_pairs([r["instruction"] for r in cand], [r["output"] for r in cand], [b["output"] for b in base],
                          out, seed, {"candidate": str(candidate), "baseline": str(baseline), "label": label})
    except OSError as e:  # a parent that is a file, no permission, a full disk
        raise SystemExit(f"judge_pairs make: cannot write the pairs into --out {out}: {e}") from None


def join(out: Path) -> dict:
    rows = read_blind_sides(out, complete=True)  # checks key.json first: ValueError naming it
    key = json.loads((out / "key.json").read_text())

    def rate(xs: list) -> dict:
        xs = [x for x in xs if x is not None]
        w, l, t = xs.count("win"), xs.count("loss"), xs.count("tie")
        return {"judged": len(xs), "wins": w, "losses": l, "ties": t,
                "win_rate": (w + 0.5 * t) / len(xs) if xs else None}

    first, second = rate([r["first_order"] for r in rows]), rate([r["reversed_order"] for r in rows])
    both = [r for r in rows if r["first_order"] and r["reversed_order"]]
    agree = sum(r["first_order"] == r["reversed_order"] for r in both)
    summary = {"label": key.get("label"), "candidate": key.get("candidate"), "baseline": key.get("baseline"),
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
        try:
            s = join(a.out)
        except (ValueError, OSError) as e:  # OSError: no key.json (make first) or an unreadable file
            raise SystemExit(f"judge_pairs join: {e}") from None
        print(json.dumps({k: v for k, v in s.items() if k != "rows"}, indent=1))


if __name__ == "__main__":
    main()
