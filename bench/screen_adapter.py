"""Screen an adapter (or the base model) on the evaluation split, batched and untimed: the
answers for a blind pairwise reading, their theoretical content speedup, and the forks' checks.

The 80 vicuna prompts (never trained on) through the engine, ``--max-running-requests`` at a
time, greedy with repetition penalty 1.1, 512 tokens, CPU float32 (the evaluation's settings;
batching changes no greedy answer: the stage 3 screen reproduced its batch-1 evaluation figure
for figure). Optionally at a fork threshold (``Limits.fork_threshold``). ``--split`` screens
another ``dataset`` of ``--prompts`` instead (``all``: every row), e.g. prompts that no stage of
an adapter trained on, as a check that a choice made on the vicuna readings holds elsewhere.
Writes to ``--out``:

- ``model_outputs.json``: the clean answers in AlpacaEval's format (for ``bench/judge_pairs.py``);
- ``rows.jsonl``: per prompt the annotated answer, forks, threads, content tokens, critical path,
  theoretical content speedup, tag tokens, finish reason, and each fork's independence check
  (:func:`pasta_engine.tools.annotate_independent.check_forks` with the lexical measure);
- ``summary.json``: geomean theoretical content speedup (all answers, and the forked ones), fork
  rate, mean threads, tag-token fraction, the text proxies, the fraction of forks that pass the
  independence test and of chunks that open with their own topic, settings and command.

No timing: realized speedup comes from ``pasta-engine bench learned`` (batch 1, warm, repeats).

    python bench/screen_adapter.py --prompts ../shared/data/alpaca_eval/instructions.json \\
        --adapter runs/sft-indep/adapter --out bench/results/screen-x [--fork-threshold 0.2]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from pasta_engine.entrypoints.args import nonneg_int, positive_int


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", required=True, type=Path,
                    help="AlpacaEval JSON (its rows of the --split dataset are used)")
    ap.add_argument("--split", default="vicuna",
                    help="the rows' `dataset` value to screen (default vicuna, the evaluation split); "
                         "'all' for every row of --prompts")
    ap.add_argument("--model", default=None,
                    help="base model the adapter was trained on (checkpoint folder); default the embedded SmolLM2-135M")
    ap.add_argument("--adapter", default="auto", help="adapter folder; 'none' for the base model; default the shipped")
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--mode", default="pasta", choices=("pasta", "sequential", "inline"),
                    help="inline: tags acted on, each chunk decoded in place in the same thread (no fork): the "
                    "same weights sequentially")
    ap.add_argument("--fork-threshold", type=float, default=None)
    ap.add_argument("--lora-scale", type=float, default=None,
                    help="Engine.from_pretrained(lora_scale=...): the fraction of the adapter's low-rank deltas merged "
                    "(default: the adapter manifest's)")
    ap.add_argument("--max-forks", type=int, default=None, help="Limits.max_forks (default: the engine's)")
    ap.add_argument("--distinct-topics", action=argparse.BooleanOptionalAction, default=True,
                    help="Limits.distinct_topics: a topic may not repeat one already promised (default on)")
    ap.add_argument("--chunk-clean-end", action=argparse.BooleanOptionalAction, default=True,
                    help="Limits.chunk_clean_end: a chunk may not end empty or at a colon, comma or semicolon; "
                    "one at its cap mid-sentence may finish it (default on)")
    ap.add_argument("--independent-topics", action=argparse.BooleanOptionalAction, default=False,
                    help="Limits.independent_topics: a topic may not open with a leaning word (default off)")
    ap.add_argument("--fork-headroom-tokens", type=nonneg_int, default=None, metavar="N",
                    help="Limits.fork_headroom_tokens: a promise opens only while the tokens left cover the running "
                    "chunks' promised tokens plus N (default off)")
    ap.add_argument("--max-new-tokens", type=positive_int, default=512)
    ap.add_argument("--repetition-penalty", type=float, default=1.1)
    ap.add_argument("--max-running-requests", type=positive_int, default=16)
    # >= 0 here; 0 (no row to screen) is refused below with the prompts file's name
    ap.add_argument("--limit", type=nonneg_int, default=None, help="screen only the first N rows of the split")
    args = ap.parse_args()
    refuse_sequential_knobs(args)

    from pasta_engine.errors import ParameterError

    try:
        screen(args)
    except ParameterError as e:  # a bad flag value (Limits, SamplingParams, the engine): one line naming the flag
        print(f"screen_adapter: error: {flag_of(e, args)}{e}", file=sys.stderr)
        sys.exit(2)


#: The flags that act only while the model samples in pasta (or inline) mode, each with the value
#: that leaves it out: in ``--mode sequential`` nothing reads them (no tag is acted on), so one set
#: there is refused rather than recorded in the settings as if applied.
PASTA_ONLY_FLAGS = {"fork_threshold": None, "max_forks": None, "independent_topics": False,
                    "fork_headroom_tokens": None,
                    "distinct_topics": True, "chunk_clean_end": True}


def refuse_sequential_knobs(args: argparse.Namespace) -> None:
    """Exit 2 with one line naming the first flag of :data:`PASTA_ONLY_FLAGS` set in ``--mode
    sequential`` (before the model loads), as the package CLI refuses them."""
    if args.mode != "sequential":
        return
    for name, off in PASTA_ONLY_FLAGS.items():
        value = getattr(args, name)
        if value != off:
            flag = "--" + ("no-" if value is False else "") + name.replace("_", "-")
            shown = flag if isinstance(value, bool) else f"{flag} {value}"
            print(f"screen_adapter: error: {shown} acts while the model samples in pasta mode, and this screen "
                  "decodes sequentially (--mode sequential): leave it out", file=sys.stderr)
            sys.exit(2)


def flag_of(e: Exception, args: argparse.Namespace) -> str:
    """``"--flag: "`` for a ParameterError's field when it is one of this script's flags (the
    field's name as a flag), else ``""``."""
    param = getattr(e, "param", None)
    if isinstance(param, str) and param.startswith("--"):
        return ""  # already a flag (its message names it)
    return f"--{param.replace('_', '-')}: " if isinstance(param, str) and hasattr(args, param) else ""


def screen(args: argparse.Namespace) -> None:
    import torch

    from pasta_engine import Engine, Limits, SamplingParams
    from pasta_engine.metrics import geomean_positive, summarize_text_proxies
    from pasta_engine.tools.annotate_independent import LexicalDependence, check_forks

    rows = [r for r in json.loads(args.prompts.read_text())
            if args.split == "all" or r.get("dataset") == args.split][: args.limit]
    if not rows:  # before the model loads and anything is written
        raise SystemExit(f"screen_adapter: --split {args.split!r}: {args.prompts} has no row with that dataset"
                         + (f" within --limit {args.limit}" if args.limit is not None else ""))
    adapter = None if args.adapter == "none" else args.adapter
    # both checked before the model loads: a bad value is a ParameterError naming its field
    limits = Limits(fork_threshold=args.fork_threshold, distinct_topics=args.distinct_topics,
                    chunk_clean_end=args.chunk_clean_end, independent_topics=args.independent_topics,
                    fork_headroom_tokens=args.fork_headroom_tokens,
                    **({} if args.max_forks is None else {"max_forks": args.max_forks}))
    params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=0.0,
                            repetition_penalty=args.repetition_penalty)
    engine = Engine.from_pretrained(args.model, adapter=adapter, max_running_requests=args.max_running_requests,
                                    limits=limits, lora_scale=args.lora_scale)
    t0 = time.time()
    results = engine.generate([r["instruction"] for r in rows], params, mode=args.mode, progress=True)
    seconds = time.time() - t0
    out_rows, checks = [], []
    for r, res in zip(rows, results):
        st = res.stats
        forks = check_forks(res.annotated_text, LexicalDependence(r["instruction"])) if st.forks else []
        checks += forks
        out_rows.append({"instruction": r["instruction"], "text": res.text, "annotated": res.annotated_text,
                         "forks": st.forks, "threads": st.forks + 1, "content_tokens": st.content_tokens,
                         "critical_path": st.critical_path, "content_speedup": st.content_speedup,
                         "tag_tokens": st.tag_tokens, "tokens_decoded": st.tokens_decoded,
                         "finish_reason": st.finish_reason, "error": res.error,
                         "fork_checks": [{"topic": c.topic, "dependence": round(c.dependence, 3), "passes": c.passes,
                                          "opens_with_topic": c.opens_with_topic} for c in forks]})
    label = f"adapter={args.adapter} mode={args.mode} fork_threshold={args.fork_threshold}"
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "model_outputs.json").write_text(json.dumps(
        [{"instruction": r["instruction"], "output": o["text"], "generator": label,
          "dataset": r.get("dataset", args.split)} for r, o in zip(rows, out_rows)], indent=1) + "\n")
    (args.out / "rows.jsonl").write_text("".join(json.dumps(o) + "\n" for o in out_rows))
    forked = [o for o in out_rows if o["forks"]]
    decoded = sum(o["tokens_decoded"] for o in out_rows)
    summary = {
        "what": f"untimed screen on the {args.split} split of {args.prompts.name} (see bench/screen_adapter.py)",
        "label": label, "prompts": len(out_rows),
        # an answer without content has no speedup: left out of the means, counted in empty_answers
        "geomean_content_speedup": geomean_positive(o["content_speedup"] for o in out_rows),
        "geomean_content_speedup_forked": geomean_positive(o["content_speedup"] for o in forked),
        "empty_answers": sum(o["content_speedup"] <= 0 for o in out_rows),
        "forked": len(forked), "fork_rate": len(forked) / len(out_rows),
        "mean_threads": sum(o["threads"] for o in out_rows) / len(out_rows),
        "tag_token_fraction": sum(o["tag_tokens"] for o in out_rows) / decoded if decoded else 0.0,
        "errors": sum(o["error"] is not None for o in out_rows),
        "forks_checked": len(checks),
        "forks_passing_independence": sum(c.passes for c in checks) / len(checks) if checks else None,
        "chunks_opening_with_topic": sum(c.opens_with_topic for c in checks) / len(checks) if checks else None,
        "proxies": summarize_text_proxies([o["text"] for o in out_rows], [o["finish_reason"] for o in out_rows],
                                          [o["annotated"] for o in out_rows]),
        "settings": {"split": args.split, "max_new_tokens": args.max_new_tokens, "temperature": 0.0,
                     "repetition_penalty": args.repetition_penalty, "mode": args.mode,
                     "fork_threshold": args.fork_threshold, "distinct_topics": args.distinct_topics,
                     "chunk_clean_end": args.chunk_clean_end, "independent_topics": args.independent_topics,
                     "fork_headroom_tokens": args.fork_headroom_tokens, "max_forks": limits.max_forks,
                     "max_running_requests": args.max_running_requests,
                     "adapter": args.adapter, "lora_scale": engine.lora_scale, "torch_threads": torch.get_num_threads(), "device": "cpu",
                     "dtype": "float32", "seconds": round(seconds, 1)},
        "command": "python " + " ".join(sys.argv),
    }
    (args.out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    print(json.dumps({k: v for k, v in summary.items() if k not in ("proxies", "settings")}, indent=1))


if __name__ == "__main__":
    main()
