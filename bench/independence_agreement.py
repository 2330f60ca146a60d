"""How well each independence measure agrees with a reader's labels (issue 30, item 2): the
base model's context-removal likelihood change and the lexical measure, as the area under the
ROC curve of the measure for the reader's "dependent" against "independent" pieces (0.5 is
chance), and precision and recall at the lexical measure's threshold.

Reads the stored label sets in ``bench/results/independence-smollm2-cpu/`` (or ``--dir``):
``reader_labels*`` (48 pieces, the calibration set, with the likelihood probe's per-token gains),
``validation_*`` (60 fresh pieces) and ``train-reader/`` (1352 pieces of the training answers,
eight readers); writes ``agreement.json`` there.

    python bench/independence_agreement.py
"""

from __future__ import annotations

import argparse
import json
import math
import re
from pathlib import Path

HERE = Path(__file__).resolve().parent / "results" / "independence-smollm2-cpu"


def auc(pos: list[float], neg: list[float]) -> float:
    """P(a dependent piece scores above an independent one), ties half (Mann-Whitney)."""
    return sum(1.0 if p > n else 0.5 if p == n else 0.0 for p in pos for n in neg) / (len(pos) * len(neg))


def at_threshold(pos: list[float], neg: list[float], t: float) -> dict:
    tp, fp = sum(x > t for x in pos), sum(x > t for x in neg)
    return {"threshold": t, "recall": tp / len(pos), "precision": tp / max(1, tp + fp),
            "accuracy": (tp + len(neg) - fp) / (len(pos) + len(neg))}


def _lexical_on_items(items: dict, question_key: str = "question") -> dict[int, float]:
    from pasta_engine.tools.annotate_independent import LexicalDependence

    out = {}
    for i, it in items.items():
        ctx = it["context_before_target"]
        seen = ctx.replace("[[HIDDEN START]]", "").replace("[[HIDDEN END]]", "")
        alone = re.sub(r"\[\[HIDDEN START\]\].*?\[\[HIDDEN END\]\]", "", ctx, flags=re.S)
        out[i] = LexicalDependence(it[question_key])(seen, alone, it["target"])
    return out


def _jsonl(path: Path) -> dict[int, dict]:
    rows = [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
    return {int(r["id"]): r for r in rows}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", type=Path, default=HERE)
    d = ap.parse_args().dir
    from pasta_engine.tools.annotate_independent import DEFAULT_THRESHOLD

    report: dict = {"threshold": DEFAULT_THRESHOLD}
    # calibration set: both measures
    items, labels = _jsonl(d / "reader_items.jsonl"), _jsonl(d / "reader_labels.jsonl")
    key = {int(k["id"]): k for k in json.loads((d / "reader_labels_key.json").read_text())}
    dep = [i for i in items if labels[i]["label"] == "dependent"]
    ind = [i for i in items if labels[i]["label"] == "independent"]
    ll = {i: sum(key[i]["token_gains"]) / len(key[i]["token_gains"]) for i in items}
    lex = _lexical_on_items(items)
    report["calibration"] = {
        "pieces": len(items), "dependent": len(dep), "independent": len(ind),
        "likelihood_probe_auc": auc([ll[i] for i in dep], [ll[i] for i in ind]),
        "lexical_auc": auc([lex[i] for i in dep], [lex[i] for i in ind]),
        "lexical_at_threshold": at_threshold([lex[i] for i in dep], [lex[i] for i in ind], DEFAULT_THRESHOLD),
        "note": "the lexical measure's signals and threshold were chosen on this set",
    }
    # validation set: fresh pieces, the lexical measure as stored when they were drawn
    vkey = {int(k["id"]): k for k in json.loads((d / "validation_key.json").read_text())}
    vlab = _jsonl(d / "validation_labels.jsonl")
    vd = [vkey[i]["lexical_dependence"] for i in vkey if vlab[i]["label"] == "dependent"]
    vi = [vkey[i]["lexical_dependence"] for i in vkey if vlab[i]["label"] == "independent"]
    report["validation"] = {"pieces": len(vkey), "dependent": len(vd), "independent": len(vi),
                            "lexical_auc": auc(vd, vi),
                            "lexical_at_threshold": at_threshold(vd, vi, DEFAULT_THRESHOLD)}
    # the training answers' pieces, eight readers
    tr = d / "train-reader"
    if (tr / "independence_labels.jsonl").exists():
        from pasta_engine.tools.annotate import approx_token_count
        from pasta_engine.tools.annotate_independent import LexicalDependence, annotate_independent

        rows = [json.loads(x) for x in (tr / "independence_labels.jsonl").read_text().splitlines() if x.strip()]
        pos, neg = [], []
        for r in rows:
            want = {p["start"]: p["dependence"] for p in r["pieces"]}
            got: dict[int, float] = {}
            lexd = LexicalDependence(r["instruction"])

            def dep_fn(s, a, p, lexd=lexd, got=got):
                got[len(s)] = v = lexd(s, a, p)
                return v

            # the pieces as make() found them: the training tokenizer's counts decide which are
            # long enough; approx counts can differ, so only pieces measured here are compared
            annotate_independent(r["response"], dep_fn, approx_token_count, threshold=math.inf)
            for st, w in want.items():
                if st in got:
                    (pos if w == 1.0 else neg).append(got[st])
        report["training_answers"] = {"pieces_compared": len(pos) + len(neg), "dependent": len(pos),
                                      "independent": len(neg), "lexical_auc": auc(pos, neg),
                                      "lexical_at_threshold": at_threshold(pos, neg, DEFAULT_THRESHOLD)}
    (d / "agreement.json").write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
