"""Command line: ``pasta-engine generate`` and ``pasta-engine replay``.

Human-readable output goes to stdout (or one JSON object per prompt with ``--json``); the
progress bar and the run's summary go to stderr.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any, Sequence

from .prompts import SAMPLE_PROMPT

def _add_common(p: argparse.ArgumentParser) -> None:
    from .bench import add_model_args

    add_model_args(p)  # --model/--preset, --device, --dtype, --attention-backend, --cuda-graphs, --kv-cache-mb
    p.add_argument("--mode", choices=("pasta", "sequential", "both"), default="pasta",
                   help="both: run each prompt sequentially, then with PASTA, and report realized speedup")
    p.add_argument("--position-policy", default="predicted", help="predicted | constant:K | none | oracle (replay only)")
    p.add_argument("--max-threads", type=int, default=16, help="threads of one request decoding together (0 = unlimited)")
    p.add_argument("--max-forks", type=int, default=64, help="forks per request; later promises are text")
    p.add_argument("--limit", type=int, default=None, help="use only the first N prompts")
    p.add_argument("--json", action="store_true", help="one JSON object per prompt on stdout")
    p.add_argument("--seed", type=int, default=0)


def build_parser() -> argparse.ArgumentParser:
    """The ``pasta-engine`` argument parser (generate, replay, bench)."""
    ap = argparse.ArgumentParser(prog="pasta-engine", description="PASTA learned asynchronous decoding")
    sub = ap.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="decode responses to prompts")
    g.add_argument("prompt", nargs="?", default=None, help=f"the prompt (default: {SAMPLE_PROMPT!r})")
    g.add_argument("--prompts-file", type=Path, default=None,
                   help="one prompt per line, or AlpacaEval JSON (a list of objects with 'instruction')")
    g.add_argument("--max-new-tokens", type=int, default=256)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--compare-transformers", action="store_true",
                   help="also time transformers' greedy generate on the same prompt ids (sequential mode)")
    _add_common(g)

    r = sub.add_parser("replay", help="forced decoding of annotated traces (JSONL: prompt, annotated response)")
    r.add_argument("--traces", type=Path, required=True,
                   help="JSONL, one object per line with 'prompt' and 'annotated_response' (or 'annotated'/'response')")
    _add_common(r)

    from .bench import add_bench_parser

    add_bench_parser(sub)
    return ap


def read_prompts(path: Path) -> list[str]:
    """Prompts from a text file (one per line, blank lines skipped) or an AlpacaEval JSON list.

    Raises SystemExit with a message naming the file when it cannot be read."""
    try:
        text = path.read_text()
    except OSError as e:
        raise SystemExit(f"pasta-engine: cannot read prompts file {path}: {e.strerror}")
    if path.suffix == ".json":
        try:
            rows = json.loads(text)
            return [row["instruction"] if isinstance(row, dict) else str(row) for row in rows]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise SystemExit(f"pasta-engine: {path} is not AlpacaEval JSON (a list of objects with 'instruction'): {e}")
    return [line for line in text.splitlines() if line.strip()]


def read_traces(path: Path) -> tuple[list[str], list[str]]:
    """(prompts, annotated responses) of a JSONL trace file (see
    :func:`pasta_engine.annotate.read_traces`). Raises SystemExit naming the file and line of
    a bad line."""
    from .annotate import TraceFileError
    from .annotate import read_traces as read_rows

    try:
        rows = read_rows(path)
    except TraceFileError as e:
        raise SystemExit(f"pasta-engine: {e}")
    return [r.prompt for r in rows], [r.annotated_response for r in rows]


def _print_result(res: Any, label: str) -> None:
    s = res.stats
    print(f"--- {label} ---")
    print(res.text.strip())
    if res.mode == "pasta" and res.annotated_text != res.text:
        print(f"--- {label}: annotated ---")
        print(res.annotated_text.strip())
    print(
        f"[{label}] tokens {s.tokens_decoded}, decode steps {s.decode_steps}, threads {s.threads}, "
        f"critical path {s.critical_path}, theoretical speedup {s.theoretical_speedup:.2f}x, "
        f"{s.wall_s:.2f} s ({s.tokens_decoded / max(s.wall_s, 1e-9):.1f} tokens/s), finish {s.finish_reason}"
    )
    for d in res.diagnostics[:10]:
        print(f"[{label}] note: {d}")
    if len(res.diagnostics) > 10:
        print(f"[{label}] ... {len(res.diagnostics) - 10} more notes")


def _hf_generate(engine: Any, prompt_ids: list[int], max_new_tokens: int) -> dict[str, Any]:
    """transformers' greedy generate on the same weights' checkpoint, for a side-by-side speed
    comparison (loaded once, cached on the engine)."""
    import torch
    from transformers import AutoModelForCausalLM

    from .model import resolve_model_path

    hf = getattr(engine, "_hf_model", None)
    if hf is None:
        path, gguf = resolve_model_path(engine.source)
        kw = {"gguf_file": gguf} if gguf else {}
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=engine.model.dtype, **kw).to(engine.model.device)
        hf.eval()
        engine._hf_model = hf
    ids = torch.tensor([prompt_ids], device=engine.model.device)
    t = time.perf_counter()
    with torch.inference_mode():
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                          do_sample=False, pad_token_id=engine.eos_ids[0])
    if ids.is_cuda:
        torch.cuda.synchronize()
    wall = time.perf_counter() - t
    toks = out[0, ids.shape[1]:].tolist()
    return {"wall_s": wall, "tokens": len(toks), "tokens_per_s": len(toks) / wall, "token_ids": toks}


def _summary(rows: list[dict[str, Any]], mode: str) -> dict[str, Any]:
    from .metrics import geomean

    out: dict[str, Any] = {"prompts": len(rows)}
    pasta = [r["pasta"] for r in rows if "pasta" in r]
    seq = [r["sequential"] for r in rows if "sequential" in r]
    if pasta:
        out["forked_responses"] = sum(1 for p in pasta if p["stats"]["forks"] > 0)
        out["mean_threads"] = sum(p["stats"]["threads"] for p in pasta) / len(pasta)
        out["geomean_theoretical_speedup"] = geomean(p["stats"]["theoretical_speedup"] for p in pasta)
        out["pasta_tokens_per_s"] = sum(p["stats"]["tokens_decoded"] for p in pasta) / sum(p["stats"]["wall_s"] for p in pasta)
    if seq:
        out["sequential_tokens_per_s"] = sum(s["stats"]["tokens_decoded"] for s in seq) / sum(s["stats"]["wall_s"] for s in seq)
    if pasta and seq:
        out["geomean_realized_speedup"] = geomean(r["realized_speedup"] for r in rows)
        out["geomean_realized_over_theoretical"] = geomean(
            r["realized_speedup"] / r["pasta"]["stats"]["theoretical_speedup"] for r in rows
        )
    hf = [r["transformers"] for r in rows if "transformers" in r]
    if hf:
        out["transformers_tokens_per_s"] = sum(h["tokens"] for h in hf) / sum(h["wall_s"] for h in hf)
        out["transformers_same_tokens"] = sum(1 for r in rows if r["transformers"]["same_tokens"])
    return out


def _run(args: argparse.Namespace, prompts: Sequence[str], responses: Sequence[str] | None) -> int:
    from . import SamplingParams
    from .metrics import realized_speedup

    if args.limit is not None:
        prompts, responses = prompts[: args.limit], (responses[: args.limit] if responses is not None else None)
    if not prompts:
        raise SystemExit("pasta-engine: no prompts")
    from .bench import build_engine

    engine, _ = build_engine(args)
    modes = ["sequential", "pasta"] if args.mode == "both" else [args.mode]
    if responses is None:
        params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                                top_p=args.top_p, top_k=args.top_k, seed=args.seed)
    else:
        params = SamplingParams(max_new_tokens=1, seed=args.seed)
    bar = None
    if len(prompts) > 1:
        from tqdm import tqdm

        bar = tqdm(total=len(prompts), unit="prompt", file=sys.stderr)
    rows = []
    for i, prompt in enumerate(prompts):
        row: dict[str, Any] = {"index": i, "prompt": prompt}
        for mode in modes:
            if responses is None:
                [res] = engine.generate([prompt], params, mode=mode)
            else:
                [res] = engine.replay([prompt], [responses[i]], mode=mode, params=params)
            row[mode] = res.to_dict()
            if not args.json:
                _print_result(res, f"prompt {i} {mode}")
            if mode == "sequential" and getattr(args, "compare_transformers", False):
                hf = _hf_generate(engine, res.prompt_ids, args.max_new_tokens)
                hf["same_tokens"] = hf.pop("token_ids") == res.token_ids
                row["transformers"] = hf
                if not args.json:
                    print(f"[prompt {i} transformers] {hf['tokens']} tokens in {hf['wall_s']:.2f} s "
                          f"({hf['tokens_per_s']:.1f} tokens/s), same tokens: {hf['same_tokens']}")
        if len(modes) == 2:
            row["realized_speedup"] = realized_speedup(row["sequential"]["stats"]["wall_s"], row["pasta"]["stats"]["wall_s"])
            if not args.json:
                print(f"[prompt {i}] realized speedup {row['realized_speedup']:.2f}x")
        if args.json:
            print(json.dumps(row), flush=True)
        rows.append(row)
        if bar is not None:
            bar.update(1)
    if bar is not None:
        bar.close()
    summary = _summary(rows, args.mode)
    print("summary: " + json.dumps(summary), file=sys.stderr)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``pasta-engine`` command."""
    from . import KVCacheExhausted, UnsupportedModelError

    args = build_parser().parse_args(argv)
    try:
        if args.command == "bench":
            from .bench import run_bench

            return run_bench(args, argv)
        if args.command == "generate":
            if args.prompts_file is not None:
                prompts = read_prompts(args.prompts_file)
            else:
                prompts = [args.prompt or SAMPLE_PROMPT]
            return _run(args, prompts, None)
        prompts, responses = read_traces(args.traces)
        return _run(args, prompts, responses)
    except (FileNotFoundError, UnsupportedModelError, KVCacheExhausted, ValueError) as e:
        print(f"pasta-engine: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
