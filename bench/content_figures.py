"""Content figures (docs/DESIGN.md section 3) of a stored ``bench learned`` run, recomputed from its answers.

Usage: ``python bench/content_figures.py bench/results/learned-smollm2-cpu [--model DIR]``.

Runs written before the content speedup existed (their rows carry the tag-inclusive
``theoretical_speedup``) still hold each answer's clean text, tokens decoded, critical path and
finish reason, so the theoretical content speedup, the tag-token fraction, the length ratio in
content tokens and the answers cut by the token budget follow without decoding anything again:
content tokens = ``len(encode_text(tokenizer, text))``; tag tokens = tokens decoded - EOS (one
when the answer stopped by itself) - content tokens, at least 0. The realized content speedup
needs the clean text decoded again (``pasta-engine bench learned``). Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from pasta_engine.lang.tokenization import encode_text
from pasta_engine.metrics import content_speedup, cut_fraction, geomean_positive, length_ratio, tag_token_fraction, tag_tokens


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run", type=Path, help="a bench learned output folder (with prompts.jsonl)")
    ap.add_argument("--model", default=None, help="the tokenizer's model folder (default: the embedded SmolLM2)")
    args = ap.parse_args()
    from transformers import AutoTokenizer

    from pasta_engine.models.loader import resolve_model_path

    tok = AutoTokenizer.from_pretrained(resolve_model_path(args.model)[0])
    rows = [json.loads(line) for line in (args.run / "prompts.jsonl").read_text().splitlines() if line.strip()]
    speedups, ratios, tags, decoded = [], [], 0, 0
    for r in rows:
        a, b = r["adapter_pasta"], r["base_sequential"]
        content = len(encode_text(tok, a["text"]))
        base = len(encode_text(tok, b["text"]))
        speedups.append(content_speedup(content, a["critical_path"]))
        ratios.append(length_ratio(content, base) if base else None)
        tags += tag_tokens(a["tokens"], content, 1 if a["finish_reason"] == "stop" else 0)
        decoded += a["tokens"]
    forked = [s for s, r in zip(speedups, rows) if r["adapter_pasta"]["forks"] > 0]
    old = [r["adapter_pasta"].get("theoretical_speedup") for r in rows]
    print(json.dumps({
        "run": str(args.run),
        "prompts": len(rows),
        "adapter_geomean_content_speedup": geomean_positive(speedups),
        "adapter_geomean_content_speedup_forked_only": geomean_positive(forked),
        "adapter_tag_token_fraction": tag_token_fraction(tags, decoded),
        "geomean_length_ratio_content_tokens": geomean_positive(ratios),
        "cut_fraction_base_sequential": cut_fraction(r["base_sequential"]["finish_reason"] for r in rows),
        "cut_fraction_adapter_pasta": cut_fraction(r["adapter_pasta"]["finish_reason"] for r in rows),
        "stored_tag_inclusive_geomean": geomean_positive(old) if all(v is not None for v in old) else None,
    }, indent=2))


if __name__ == "__main__":
    main()
