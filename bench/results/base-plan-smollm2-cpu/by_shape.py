"""Win rate of stored readings split by the shape of the base model's answer (a diagnostic for
issue 30): "list" where the base model's sequential answer has two or more list lines
(`- `, `1. `, ...), "prose" otherwise. Rows are matched to answers by question (pairs.jsonl), the
win value of a row is the mean over both orders (1 win, 0.5 tie, 0 loss).

Usage: python by_shape.py BASE_OUTPUTS_JSON JUDGE_DIR [JUDGE_DIR ...]
"""
import json
import re
import sys

LIST_LINE = re.compile(r"(?m)^\s*(?:[-*+]|\d{1,3}[.)])\s+\S")
VALUE = {"win": 1.0, "tie": 0.5, "loss": 0.0}

base = {r["instruction"]: r["output"] for r in json.load(open(sys.argv[1]))}
for judge in sys.argv[2:]:
    summary = json.load(open(f"{judge}/summary.json"))
    question = {}
    for line in open(f"{judge}/pairs.jsonl"):
        row = json.loads(line)
        question[row["id"]] = row["question"]
    split = {"list": [], "prose": []}
    for r in summary["rows"]:
        shape = "list" if len(LIST_LINE.findall(base[question[r["id"]]])) >= 2 else "prose"
        split[shape].append((VALUE[r["first_order"]] + VALUE[r["reversed_order"]]) / 2)
    cells = "  ".join(f"{k} {sum(v) / len(v):.1%} ({len(v)})" for k, v in split.items() if v)
    print(f"{summary['mean_win_rate']:.1%}  {cells}  {judge}")
