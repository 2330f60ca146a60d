"""Independence by a reader's judgement: the training answers' pieces for a reader to label, and
the labels as a dependence table that ``train sft --annotator independent --independence-labels``
reads.

``make``: every training answer (cut as ``train sft`` cuts it, answers with a repeated line left
out) is walked by the ``independent`` annotator with an infinite threshold; each fork candidate
is marked ``[[Pk]]...[[/Pk]]`` and each piece of main-thread text after a candidate
``[[Mk]]...[[/Mk]]``. A reader says, for every marked piece after the first candidate, whether it
depends on the earlier ``P`` pieces (which its writer would not see). Writes ``answers_<i>.jsonl``
in ``--parts`` files (one reader each) and ``pieces.json`` (the key: each piece's character span).

``collect``: joins the readers' ``labels_<i>.jsonl`` (``answer``, ``labels``: {piece id:
"dependent"|"independent"}) with the key into ``independence_labels.jsonl``: one row per answer,
``instruction``, ``response`` (the cut answer the offsets are in) and ``pieces`` (``start``,
``dependence``: 1.0 dependent, 0.0 independent).

    python bench/reader_independence.py make --answers runs/answers/answers.json --out DIR --parts 8
    python bench/reader_independence.py collect --out DIR
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path


def make(answers: Path, out: Path, parts: int, max_response_tokens: int) -> None:
    from pasta_engine.tools.annotate_independent import annotate_independent
    from pasta_engine.tools.bench import count_tokens_fn
    from pasta_engine.tools.traces import read_prompts
    from pasta_engine.train.common import load_tokenizer
    from pasta_engine.train.data import cut_response, split_rows
    from pasta_engine.train.quality import repeated_line_fraction

    rows = split_rows(read_prompts(answers, need_output=True), "train")
    count = count_tokens_fn(load_tokenizer(None))
    key, shown = [], []
    for r in rows:
        cut = cut_response(r.output, count, max_response_tokens) if r.output else None
        if not cut or repeated_line_fraction(cut) > 0:
            continue
        measured: list[int] = []
        _, scores = annotate_independent(cut, lambda s, a, p: measured.append(len(s)) or 0.0, count,
                                         threshold=math.inf)
        if not measured:
            continue
        pieces, text, at, kp, km = [], [], 0, 0, 0
        for s in scores:
            if s.candidate:
                kp += 1
                pid = f"P{kp}"
            else:
                km += 1
                pid = f"M{km}"
            text += [cut[at:s.start], f"[[{pid}]]", cut[s.start:s.end], f"[[/{pid}]]"]
            at = s.end
            pieces.append({"id": pid, "start": s.start, "end": s.end, "ask": s.start in measured})
        text.append(cut[at:])
        i = len(key)
        key.append({"answer": i, "instruction": r.instruction, "response": cut, "pieces": pieces})
        shown.append({"answer": i, "question": r.instruction, "text": "".join(text),
                      "label_these": [p["id"] for p in pieces if p["ask"]]})
    out.mkdir(parents=True, exist_ok=True)
    (out / "pieces.json").write_text(json.dumps(key) + "\n")
    for k in range(parts):
        (out / f"answers_{k}.jsonl").write_text("".join(json.dumps(s) + "\n" for s in shown[k::parts]))
    print(f"{len(shown)} answers, {sum(len(s['label_these']) for s in shown)} pieces to label, in {parts} parts")


def collect(out: Path) -> None:
    key = {k["answer"]: k for k in json.loads((out / "pieces.json").read_text())}
    labels: dict[int, dict[str, str]] = {}
    for f in sorted(out.glob("labels_*.jsonl")):
        for line in f.read_text().splitlines():
            if line.strip():
                row = json.loads(line)
                labels[int(row["answer"])] = row["labels"]
    rows, n, dep = [], 0, 0
    for a, k in key.items():
        if a not in labels:
            continue
        got = labels[a]
        pieces = []
        for p in k["pieces"]:
            if p["ask"] and p["id"] in got:
                d = 1.0 if str(got[p["id"]]).lower().startswith("dep") else 0.0
                pieces.append({"start": p["start"], "dependence": d})
                n += 1
                dep += d == 1.0
        rows.append({"instruction": k["instruction"], "response": k["response"], "pieces": pieces})
    (out / "independence_labels.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    print(f"{len(rows)} answers labelled of {len(key)}; {n} pieces, {dep} dependent ({dep / max(1, n):.0%})")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("make")
    m.add_argument("--answers", type=Path, required=True, help="AlpacaEval-format answers (train answers' output)")
    m.add_argument("--out", type=Path, required=True)
    m.add_argument("--parts", type=int, default=8)
    m.add_argument("--max-response-tokens", type=int, default=256)
    c = sub.add_parser("collect")
    c.add_argument("--out", type=Path, required=True)
    a = p.parse_args()
    make(a.answers, a.out, a.parts, a.max_response_tokens) if a.cmd == "make" else collect(a.out)


if __name__ == "__main__":
    main()
