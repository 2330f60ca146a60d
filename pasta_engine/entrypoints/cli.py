"""Command line: ``pasta-engine generate | replay | bench {speedup, pareto, annotate}``.

Human-readable output goes to stdout (or one JSON object per prompt with ``--json``); the
progress bar and the run's summary go to stderr. Any error a user can cause (a bad flag, file,
model path or device) is one line on stderr and exit status 2.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any, Sequence

from ..lang.prompts import SAMPLE_PROMPT

#: ``generate``'s sampling defaults: temperature 0.2 and top-p 0.9 are what the embedded model's card
#: (HuggingFaceTB/SmolLM2-135M-Instruct, "How to use") samples with (its generation_config.json sets
#: none); repetition penalty 1.1 is the setting of the model's own answers the shipped adapter was
#: trained on (``train answers``), without which a 135M model loops its headings; 512 tokens is the
#: budget the shipped adapter was evaluated and read blind at (no answer of the 80 cut there): its
#: forked answers run to about five threads, whose chunks together often pass the engine's 256.
GENERATE_SAMPLING = {"max_new_tokens": 512, "temperature": 0.2, "top_p": 0.9, "repetition_penalty": 1.1}
from ..lang.dialect import DIALECT_NAMES
from ..tools.annotate import ANNOTATORS
from .args import (
    DEFAULT_WARMUP,
    adapter_choice,
    add_baseline_arg,
    add_endpoint_args,
    add_model_args,
    add_pasta_args,
    add_run_args,
    add_sampling_args,
    build_engine,
    command_line,
    endpoint_from_args,
    loads_adapter,
    nonneg_int,
    positive_int,
    sampling_params,
)

__all__ = ["build_parser", "main"]


def build_parser() -> argparse.ArgumentParser:
    """The ``pasta-engine`` argument parser (generate, replay, bench)."""
    from .. import __version__

    ap = argparse.ArgumentParser(prog="pasta-engine", description="PASTA learned asynchronous decoding")
    ap.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = ap.add_subparsers(dest="command", required=True)

    def add_dialect_arg(p: argparse.ArgumentParser, what: str) -> None:
        p.add_argument("--dialect", choices=DIALECT_NAMES, default="pasta",
                       help=f"the decoding language {what} (docs/DESIGN.md section 2, Dialects): pasta (PASTA-LANG, "
                       "default), apar (the APAR dialect: [Fork] after a list item's header; not PASTA-LANG's "
                       "--annotator apar), multiverse; both modes replay with it and the results record it")

    def add_output_args(p: argparse.ArgumentParser) -> None:
        p.add_argument("--mode", choices=("pasta", "sequential", "inline", "both"), default="pasta",
                       help="inline: act on tags like pasta, but decode each promise's chunk in place in the same "
                       "thread (no fork): the same weights sequentially, the baseline for realized speedup of a "
                       "PASTA-LANG model (sequential writes tag-like text after a promise: the model never writes "
                       "<async> itself). both: run each prompt with PASTA and sequentially, after --warmup and --repeats times, and "
                       "report the content speedup (the pasta answer's clean text decoded sequentially with the same "
                       "weights vs the pasta run; generate also reports the end-to-end speedup against the sequential "
                       "answer, with the length ratio)")
        p.add_argument("--json", action="store_true", help="one JSON object per prompt on stdout")

    g = sub.add_parser("generate", help="decode responses to prompts")
    g.add_argument("prompt", nargs="?", default=None, help=f"the prompt (default: {SAMPLE_PROMPT!r})")
    g.add_argument("--prompts-file", type=Path, default=None,
                   help="one prompt per line, or JSON: a list of strings or AlpacaEval objects with 'instruction'")
    add_output_args(g)
    g.add_argument("--compare-transformers", action="store_true",
                   help="also time transformers' greedy generate of the base checkpoint on the same prompt ids and "
                   "check it gives the same tokens (sequential mode, or both; needs a greedy sequential answer from "
                   "the base weights: --temperature 0 --repetition-penalty 1, and --no-adapter or --baseline base)")
    add_baseline_arg(g)
    add_sampling_args(g, **GENERATE_SAMPLING)
    add_model_args(g)
    add_pasta_args(g)
    add_run_args(g, timing=True, resume=False, progress=True)

    r = sub.add_parser("replay", help="forced decoding of annotated traces (JSONL: prompt, annotated response)")
    r.add_argument("--traces", type=Path, required=True,
                   help="JSONL, one object per line with 'prompt' and 'annotated_response' (or 'annotated'/'response')")
    add_output_args(r)
    add_dialect_arg(r, "the traces' annotated responses are written in")
    add_model_args(r)
    add_pasta_args(r)
    add_run_args(r, timing=True, resume=False, progress=True)

    from .serve_command import add_serve_parser

    add_serve_parser(sub)

    b = sub.add_parser("bench", help="speedup benchmarks: speedup (replay), pareto (generate), annotate (traces)")
    bsub = b.add_subparsers(dest="bench_command", required=True)
    s = bsub.add_parser(
        "speedup", help="content speedup, realized vs theoretical: replay annotated traces in pasta mode and their "
        "clean text sequentially",
        description="Replay each annotated response in pasta mode and its clean text (tags stripped, no tag tokens) in "
        "sequential mode (same model, same prompt), one prompt at a time; the content speedup is the headline "
        "(docs/DESIGN.md section 3); write summary.json, prompts.jsonl and speedup.png into --out.",
    )
    src = s.add_mutually_exclusive_group()
    src.add_argument("--traces", type=Path, help="trace file (JSONL: prompt, annotated_response, annotator), written in "
                     "--dialect")
    src.add_argument("--annotator", choices=ANNOTATORS,
                     help="annotate --responses on the fly with this PASTA-LANG annotator (--dialect pasta only)")
    s.add_argument("--responses", type=Path, default=None,
                   help="AlpacaEval-format JSON (list of {instruction, output}) to annotate: with --annotator for "
                   "--dialect pasta, with the dialect's own annotator for apar and multiverse")
    add_dialect_arg(s, "the traces are written in (with --responses: which annotator writes them)")
    s.add_argument("--out", type=Path, required=True, help="output folder")
    add_sampling_args(s)  # the model annotator's
    add_model_args(s)
    add_pasta_args(s)
    add_run_args(s, timing=True, progress=True)

    p = bsub.add_parser(
        "pareto", help="generate mode: sequential vs pasta on the same prompts; speedup, length ratio, AlpacaEval exports",
        description="Answer each prompt sequentially and with PASTA (generate mode); write summary.json, "
        "prompts.jsonl, model_outputs_sequential.json and model_outputs_pasta.json (AlpacaEval format) into --out.",
    )
    p.add_argument("--prompts", type=Path, required=True,
                   help="AlpacaEval JSON (a list of objects with 'instruction') or a text file with one prompt per line")
    p.add_argument("--out", type=Path, required=True, help="output folder")
    add_baseline_arg(p)
    add_sampling_args(p)
    add_model_args(p)
    add_pasta_args(p)
    add_run_args(p, timing=True, progress=True)

    a = bsub.add_parser(
        "annotate", help="write a trace file: annotate AlpacaEval responses with sot, apar or the model",
        description="Annotate each response of --responses with PASTA-LANG and write one JSONL row per prompt "
        "(prompt, annotated_response, annotator, response, promises, note) to --out.",
    )
    a.add_argument("--annotator", choices=ANNOTATORS, required=True)
    a.add_argument("--responses", type=Path, required=True, help="AlpacaEval-format JSON (list of {instruction, output})")
    a.add_argument("--out", type=Path, required=True, help="trace file to write (JSONL)")
    a.add_argument("--tokenizer", default=None,
                   help="sot/apar: tokenizer (HF dir) for promise lengths, or 'approx' (default: --model/--preset's, "
                   "else the embedded model's, else approx)")
    add_endpoint_args(a, "endpoint", "annotates with --annotator endpoint (the paper's stage 1 annotates with a large "
                      "model; the prompt is in docs/annotation_prompt.md)")
    add_sampling_args(a)  # the model annotator's
    add_model_args(a)
    add_run_args(a)

    kb = bsub.add_parser(
        "kernels", help="check and time the tree decode attention kernel at the shapes you set",
        description="One request: a shared --prefix, then --threads threads with --suffix private tokens each, one "
        "query per thread, in a paged KV cache. Checks the tree kernel, the same kernel per thread (plain), SDPA per "
        "thread and (GPU) FlashInfer's cascade against a float32 reference, then times each: median, p10, p90 "
        "microseconds, the tree kernel's bytes and its fraction of the measured copy bandwidth (the physical limit). "
        "On a CPU the kernels run under Triton's interpreter: a correctness check at small shapes, times not a "
        "performance figure. Writes --out (JSON).",
    )
    kb.add_argument("--threads", type=positive_int, nargs="+", default=[8], help="threads (rows); several: one case each")
    kb.add_argument("--prefix", type=nonneg_int, nargs="+", default=[4096], help="shared prefix tokens; several: one case each")
    kb.add_argument("--suffix", type=nonneg_int, nargs="+", default=[128], help="private tokens per thread; several: one "
                    "case each")
    kb.add_argument("--heads", type=positive_int, default=32, help="query heads (default: Llama-3-8B's)")
    kb.add_argument("--kv-heads", type=positive_int, default=8, help="KV heads (GQA)")
    kb.add_argument("--head-dim", type=positive_int, default=128)
    kb.add_argument("--page-size", type=positive_int, default=16, help="KV page size in tokens")
    kb.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default=None,
                    help="default bfloat16 on a GPU, float16 on the CPU (the interpreter's bf16 tl.dot is wrong)")
    kb.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto")
    kb.add_argument("--warmup", type=nonneg_int, default=3, help="calls before timing (GPU: do_bench's warm-up in ms)")
    kb.add_argument("--repeats", type=positive_int, default=20, help="timed calls (GPU: do_bench's repetition in ms)")
    kb.add_argument("--no-peers", action="store_true", help="only our kernel (tree and plain plans)")
    kb.add_argument("--out", type=Path, default=None, help="JSON file to write (default: print only)")

    from .train_commands import add_learned_parser, add_train_parser

    add_learned_parser(bsub)
    add_train_parser(sub)
    return ap


# --------------------------------------------------------------------------- generate / replay


def _print_result(res: Any, label: str) -> None:
    s = res.stats
    print(f"--- {label} ---")
    print(res.text.strip())
    if res.mode != "sequential" and res.annotated_text != res.text:  # pasta and inline act on tags
        print(f"--- {label}: annotated ---")
        print(res.annotated_text.strip())
    print(
        f"[{label}] content tokens {s.content_tokens}, content speedup {s.content_speedup:.2f}x (content tokens / "
        f"critical path {s.critical_path}); tokens decoded {s.tokens_decoded} ({s.tag_tokens} tag tokens), token "
        f"parallelism {s.token_parallelism:.2f}x, decode steps {s.decode_steps}, threads {s.threads}, "
        f"{s.wall_s:.2f} s ({s.tokens_decoded / max(s.wall_s, 1e-9):.1f} tokens/s), finish {s.finish_reason}"
    )
    if res.error:
        print(f"[{label}] error: {res.error}")
    for d in res.diagnostics[:10]:
        print(f"[{label}] note: {d}")
    if len(res.diagnostics) > 10:
        print(f"[{label}] ... {len(res.diagnostics) - 10} more notes")


def _hf_generate(engine: Any, prompt_ids: list[int], max_new_tokens: int) -> dict[str, Any]:
    """transformers' greedy generate on the same checkpoint, for a side-by-side speed
    comparison (loaded once, cached on the engine)."""
    import torch
    from transformers import AutoModelForCausalLM

    from ..models.loader import resolve_model_path

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


def _summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Aggregates over prompts, the content figures first (docs/DESIGN.md section 3): geometric means
    of the content speedups (answers without content left out), then token parallelism, the
    tag-token fraction, and the end-to-end speedup with its length ratio and answers cut by the
    token budget (generate --mode both); with ``--mode both`` also the same over forked answers
    only (``forked_only``), the repeats' spread (``timing``) and ``warnings``."""
    from ..metrics import cut_fraction, geomean_positive, realized_over_theoretical, tag_token_fraction
    from ..tools.bench import summary_warnings, timing_summary

    out: dict[str, Any] = {"prompts": len(rows)}
    pasta = [r["pasta"] for r in rows if "pasta" in r]
    seq = [r["sequential"] for r in rows if "sequential" in r]
    # every mean over the answers with content (an empty answer's timing is noise)
    both = [r for r in rows if "realized_content_speedup" in r and r["pasta"]["stats"]["content_tokens"] > 0]
    if pasta:
        out["geomean_content_speedup"] = geomean_positive(p["stats"]["content_speedup"] for p in pasta)
    if both:
        out["geomean_realized_content_speedup"] = geomean_positive(r["realized_content_speedup"] for r in both)
        out["geomean_realized_over_theoretical"] = geomean_positive(
            realized_over_theoretical(r["realized_content_speedup"], r["pasta"]["stats"]["content_speedup"])
            for r in both if r["pasta"]["stats"]["content_speedup"] > 0
        )
    e2e = [r for r in rows if "end_to_end_speedup" in r]
    if e2e:
        out["geomean_end_to_end_speedup"] = geomean_positive(r["end_to_end_speedup"] for r in e2e)
        out["geomean_length_ratio"] = geomean_positive(r["length_ratio"] for r in e2e)
        out["cut_fraction_sequential"] = cut_fraction(r["sequential"]["stats"]["finish_reason"] for r in e2e)
        out["cut_fraction_pasta"] = cut_fraction(r["pasta"]["stats"]["finish_reason"] for r in e2e)
    if pasta:
        out["empty_answers"] = sum(1 for p in pasta if p["stats"]["content_tokens"] == 0)
        # over the answers with content, as the speedup means above
        out["forked_responses"] = sum(1 for p in pasta if p["stats"]["forks"] > 0 and p["stats"]["content_tokens"] > 0)
        out["mean_threads"] = sum(p["stats"]["threads"] for p in pasta) / len(pasta)
        out["geomean_token_parallelism"] = geomean_positive(p["stats"]["token_parallelism"] for p in pasta)
        out["tag_token_fraction"] = tag_token_fraction(sum(p["stats"]["tag_tokens"] for p in pasta),
                                                       sum(p["stats"]["tokens_decoded"] for p in pasta))
        out["pasta_tokens_per_s"] = sum(p["stats"]["tokens_decoded"] for p in pasta) / sum(p["stats"]["wall_s"] for p in pasta)
    if seq:
        out["sequential_tokens_per_s"] = sum(s["stats"]["tokens_decoded"] for s in seq) / sum(s["stats"]["wall_s"] for s in seq)
    hf = [r["transformers"] for r in rows if "transformers" in r]
    if hf:
        out["transformers_tokens_per_s"] = sum(h["tokens"] for h in hf) / sum(h["wall_s"] for h in hf)
        out["transformers_same_tokens"] = sum(1 for r in rows if r["transformers"]["same_tokens"])
    if both:
        forked = [r for r in both if r["pasta"]["stats"]["forks"] > 0]
        out["forked_only"] = {
            "prompts": len(forked),
            "geomean_content_speedup": geomean_positive(r["pasta"]["stats"]["content_speedup"] for r in forked),
            "geomean_realized_content_speedup": geomean_positive(r["realized_content_speedup"] for r in forked),
            **({"geomean_end_to_end_speedup": geomean_positive(r["end_to_end_speedup"] for r in forked),
                "geomean_length_ratio": geomean_positive(r["length_ratio"] for r in forked)} if e2e else {}),
        }
        out["timing"] = timing_summary(both)
        out["warnings"] = summary_warnings(len(both), len(forked), out["geomean_realized_content_speedup"],
                                           out["forked_only"]["geomean_realized_content_speedup"], out["timing"])
    return out


def _run(args: argparse.Namespace, prompts: Sequence[str], responses: Sequence[str] | None) -> int:
    """``generate`` (``responses`` None) or ``replay`` of ``prompts``: each prompt decoded in
    ``--mode`` (both: :func:`_compare`), printed as it ends. Every prompt is checked first, in
    every mode it runs in, against the model's context and the KV cache, so that a prompt that
    cannot fit is refused (ContextLengthError naming ``prompt {index}``, 0-based as the printed
    results) before any is decoded. Returns the exit status (:func:`_exit_status`)."""
    from ..config import SamplingParams
    from ..tools.bench import check_prompts

    if args.limit is not None:
        prompts, responses = prompts[: args.limit], (responses[: args.limit] if responses is not None else None)
    generated = responses is None
    params = sampling_params(args) if generated else SamplingParams(max_new_tokens=1)
    both = args.mode == "both"
    modes = ["pasta", "sequential"] if both else [args.mode]
    # one engine, the same weights in both modes (as the server's mode), unless generate's
    # --baseline base gives the sequential answers the base model's weights; replay forces the
    # same content on one engine
    engines: dict[Any, Any] = {}
    per_mode = {}
    for mode in modes:
        choice = adapter_choice(args, mode if generated else "pasta")
        key = str(choice)
        if key not in engines:
            engines[key] = build_engine(args, adapter=choice)[0]
        per_mode[mode] = engines[key]
    dialect = None if generated else args.dialect
    for mode in modes:  # replay --mode both: the sequential side replays the pasta answer's clean text, made later
        if generated or not both or mode == "pasta":
            check_prompts(per_mode[mode], prompts, mode, params=params, responses=responses, dialect=dialect)
    if both and args.warmup:
        _warm_up(args, per_mode, prompts, params, responses)
    bar = None
    if len(prompts) > 1 and not args.no_progress:
        from tqdm import tqdm

        bar = tqdm(total=len(prompts), unit="prompt", file=sys.stderr, dynamic_ncols=True)
    rows = []
    tokens, wall = 0, 0.0
    for i, prompt in enumerate(prompts):
        row: dict[str, Any] = {"index": i, "prompt": prompt}
        if not generated:
            row["dialect"] = args.dialect
        response = None if generated else responses[i]
        if both:
            row = _compare(args, per_mode, row, params, response)
        else:
            res = _decode(per_mode[args.mode], args, row, args.mode, params, response)
            row[args.mode] = res.to_dict()
            if not args.json:
                _print_result(res, f"prompt {i} {args.mode}")
            if args.mode == "sequential" and getattr(args, "compare_transformers", False):
                _transformers(per_mode["sequential"], args, row, res)
        if args.json:
            print(json.dumps(row), flush=True)
        rows.append(row)
        if bar is not None:
            stats = row[modes[0]]["stats"]
            tokens += stats["tokens_decoded"]
            wall += stats["wall_s"]
            bar.update(1)
            bar.set_postfix(tok_s=f"{tokens / wall:.1f}" if wall > 0 else "n/a")
    if bar is not None:
        bar.close()
    summary = _summary(rows)
    if not generated:
        summary["dialect"] = args.dialect
    print("summary: " + json.dumps(summary), file=sys.stderr)
    _print_warnings(summary)
    return _exit_status(rows, modes)


def _warm_up(args: argparse.Namespace, per_mode: dict[str, Any], prompts: Sequence[str], params: Any,
             responses: Sequence[str] | None) -> None:
    """``--warmup`` untimed runs in each mode before ``--mode both`` times anything (the engines'
    CPU GEMM choices first): of the first prompt (a short answer), and in replay of the first
    trace and of the one with the most promises (every thread-count bucket the run reaches, e.g.
    its CUDA graphs, then exists before the clock starts). A cold first run is not a measurement."""
    from ..config import SamplingParams
    from ..lang.dialect import get_dialect
    from ..tools.bench import trace_forks

    for engine in {id(e): e for e in per_mode.values()}.values():
        engine.model_runner.warm_up()
    pas, seq = per_mode["pasta"], per_mode["sequential"]
    for _ in range(args.warmup):
        if responses is None:
            short = SamplingParams(max_new_tokens=min(16, params.max_new_tokens), seed=params.seed)
            seq.generate([prompts[0]], short, mode="sequential")
            res = pas.generate([prompts[0]], short, mode="pasta")[0]
            pas.replay([prompts[0]], [res.text], mode="sequential")
            continue
        lang = get_dialect(args.dialect)
        # forks as a replay forks them (a Multiverse block forks one thread per path, nested too)
        widest = max(range(len(responses)), key=lambda j: trace_forks(responses[j], args.dialect))
        for j in dict.fromkeys((0, widest)):
            res = pas.replay([prompts[j]], [responses[j]], mode="pasta", dialect=lang)[0]
            pas.replay([prompts[j]], [res.text], mode="sequential", dialect=lang)


def _compare(args: argparse.Namespace, per_mode: dict[str, Any], row: dict[str, Any], params: Any,
             response: str | None) -> dict[str, Any]:
    """One prompt of ``--mode both``: ``--repeats`` interleaved runs of each side
    (:func:`~pasta_engine.tools.bench.timed_runs`). The content speedup sets the pasta answer's
    annotated text replayed in pasta mode against its clean text replayed sequentially (same
    engine, same weights, same prompt, both forced: the same work on both sides; in generate the
    answer is generated first and then replayed). In generate the end-to-end speedup sets the
    pasta generation against the sequential answer (``--baseline``'s weights), both sampling,
    with the length ratio and each side's finish reason. Each side's fastest run counts; the
    spread and any warning are in the row's ``timing`` (printed too)."""
    from ..config import SamplingParams
    from ..metrics import length_ratio, realized_speedup
    from ..tools.bench import content_side, timed_runs, timing_record

    i, prompt = row["index"], row["prompt"]
    generated = response is None
    pas_engine = per_mode["pasta"]
    forced = SamplingParams(max_new_tokens=1)
    runs = timed_runs(
        args.repeats,
        lambda: _decode(pas_engine, args, row, "pasta", params, response),
        lambda pas: _decode(pas_engine, args, row, "sequential", forced, pas.text),
        (lambda: _decode(per_mode["sequential"], args, row, "sequential", params)) if generated else None,
        (lambda pas: _decode(pas_engine, args, row, "pasta", forced, pas.annotated_text)) if generated else None,
    )
    side = content_side(runs)
    fastest, timing = timing_record(runs, runs[side][0].stats.content_speedup)
    pas, clean = fastest["pasta"], fastest["clean_text_sequential"]
    out: dict[str, Any] = {
        "content_speedup": pas.stats.content_speedup,  # of the answer the user got
        "realized_content_speedup": realized_speedup(clean.stats.wall_s, fastest[side].stats.wall_s),
        "clean_text_sequential_wall_s": clean.stats.wall_s,
        "pasta_replay_wall_s": fastest[side].stats.wall_s,
    }
    results = {"pasta": pas, "sequential": fastest["sequential"] if generated else clean}
    if generated:
        seq = results["sequential"].stats
        out.update(end_to_end_speedup=realized_speedup(seq.wall_s, pas.stats.wall_s),
                   length_ratio=length_ratio(pas.stats.content_tokens, seq.content_tokens) if seq.content_tokens else None,
                   finish_reasons={"sequential": seq.finish_reason, "pasta": pas.stats.finish_reason},
                   baseline=args.baseline)
    out.update(row)
    for mode in ("sequential", "pasta"):
        out[mode] = results[mode].to_dict()
        if not args.json:
            _print_result(results[mode], f"prompt {i} {mode}" + ("" if generated or mode == "pasta" else " (clean text)"))
    out["timing"] = timing
    if generated and getattr(args, "compare_transformers", False):
        _transformers(per_mode["sequential"], args, out, results["sequential"])
    if not args.json:
        _print_speedups(out, f"prompt {i}")
    for w in timing["warnings"]:
        print(f"pasta-engine: warning: prompt {i}: {w}", file=sys.stderr)
    return out


def _transformers(engine: Any, args: argparse.Namespace, row: dict[str, Any], res: Any) -> None:
    """``--compare-transformers``: transformers' greedy generate on the sequential answer's prompt ids."""
    hf = _hf_generate(engine, res.prompt_ids, args.max_new_tokens)
    hf["same_tokens"] = hf.pop("token_ids") == res.token_ids
    row["transformers"] = hf
    if not args.json:
        print(f"[prompt {row['index']} transformers] {hf['tokens']} tokens in {hf['wall_s']:.2f} s "
              f"({hf['tokens_per_s']:.1f} tokens/s), same tokens: {hf['same_tokens']}")


class _Interrupted(Exception):
    """Ctrl-C stopped a run; what the interrupted request had decoded is printed already."""


def _decode(engine: Any, args: argparse.Namespace, row: dict[str, Any], mode: str, params: Any,
            response: str | None = None) -> Any:
    """One request (a replay of ``response`` when given) through the engine's step loop, the
    same loop ``Engine.generate`` runs: its result. On Ctrl-C the request is aborted (its pages
    freed), what it decoded so far is printed (as the row's JSON with ``"interrupted": true``
    under ``--json``) and :class:`_Interrupted` is raised."""
    # only the final output is read: output_kind="final" spares the per-step rendering
    rid = engine.add_request(row["prompt"], params, mode=mode, annotated_response=response, output_kind="final",
                             dialect=getattr(args, "dialect", "pasta"))
    try:
        while True:
            for out in engine.step():
                if out.request_id == rid and out.finished:
                    return out.result
    except KeyboardInterrupt:
        engine.abort(rid)  # a Ctrl-C inside a step has ended it already (with its pages freed)
        res = next((o.result for o in engine.step() if o.request_id == rid and o.finished), None)
        if res is not None:
            if args.json:
                print(json.dumps({**row, mode: res.to_dict(), "interrupted": True}), flush=True)
            else:
                _print_result(res, f"prompt {row['index']} {mode} (interrupted)")
        raise _Interrupted() from None


def _exit_status(rows: list[dict[str, Any]], modes: Sequence[str]) -> int:
    """0, or 1 (named on stderr) when a request ended with ``finish_reason="error"``."""
    failed = [f"prompt {r['index']} {m}" for r in rows for m in modes
              if r.get(m, {}).get("stats", {}).get("finish_reason") == "error"]
    if not failed:
        return 0
    print(f"pasta-engine: error: {len(failed)} of {len(rows) * len(modes)} runs ended with an error "
          f"({', '.join(failed[:5])}{', ...' if len(failed) > 5 else ''}; the message is in each result)",
          file=sys.stderr)
    return 1


def _print_speedups(row: dict[str, Any], label: str) -> None:
    t = row["timing"]
    r = t["realized_content_speedup_spread"]
    line = (f"[{label}] content speedup {row['content_speedup']:.2f}x theoretical, "
            f"{row['realized_content_speedup']:.2f}x realized (clean text decoded sequentially / pasta wall time, "
            f"fastest of {t['runs']} runs each; per run {r['min']:.2f}x / {r['median']:.2f}x / {r['max']:.2f}x "
            f"min / median / max)")
    if "end_to_end_speedup" in row:
        ratio = row["length_ratio"]
        who = "the base model's" if row.get("baseline") == "base" else "the same weights'"
        line += (f"; end to end {row['end_to_end_speedup']:.2f}x vs {who} sequential answer (length ratio "
                 f"{'n/a' if ratio is None else f'{ratio:.2f}'}, finish {row['finish_reasons']['sequential']} / "
                 f"{row['finish_reasons']['pasta']})")
    print(line)


# --------------------------------------------------------------------------- bench


def _x(value: float | None, unit: str = "x") -> str:
    """A summary figure for a line of text (``n/a`` when there was nothing to average)."""
    return "n/a" if value is None else f"{value:.3f}{unit}"


def _spread_text(summary: dict[str, Any]) -> str:
    """``; per run min / median / max ...`` of a summary's repeats, or nothing."""
    t = summary.get("timing") or {}
    g = t.get("geomean_realized_content_speedup_spread")
    if not g or g["min"] is None:
        return ""
    return (f"; fastest of {t['runs_per_side']} runs each, per run {_x(g['min'])} / {_x(g['median'])} / "
            f"{_x(g['max'])} min / median / max")


def _forked_text(summary: dict[str, Any]) -> str:
    """``; forked answers only ...`` beside the all-answers figures, or nothing."""
    f = summary.get("forked_only")
    if not f or summary.get("forked_responses") == summary.get("prompts"):
        return ""
    return (f"; over the {summary['forked_responses']} forked answers only {_x(f['geomean_content_speedup'])} "
            f"theoretical, {_x(f['geomean_realized_content_speedup'])} realized")


def _print_warnings(summary: dict[str, Any]) -> None:
    for w in summary.get("warnings", []):
        print(f"pasta-engine: warning: {w}", file=sys.stderr)


def _limit(rows: list, limit: int | None) -> list:
    return rows[:limit] if limit is not None else rows


def _out_folder(out: Path) -> Path:
    """``--out``, the output folder, created now (before any model loads; :func:`_main` removes
    it again when the command then fails with it still empty and this run created it). Raises
    ParameterError naming it when it is a file or cannot be created."""
    from ..errors import ParameterError

    if out.exists() and not out.is_dir():
        raise ParameterError("--out", str(out), message=f"--out {out} is a file, not a folder: name a folder (it is "
                             "created when missing)")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ParameterError("--out", str(out), message=f"--out {out}: cannot create the folder "
                             f"({e.strerror or e})") from None
    return out


def _model_inputs(args: argparse.Namespace) -> dict[str, Any]:
    """What a ``bench speedup`` or ``bench pareto`` row was measured with besides its prompt,
    trace and sampling: the model (``--model``'s absolute path, or ``--preset`` and
    ``--preset-seed``; both None: the embedded model), ``--dtype`` (resolved: the default is the
    device's), the adapter of the pasta side (``--adapter``'s absolute path, the shipped one's
    for the default, None for none), ``--lora-scale``, pareto's ``--baseline`` and every PASTA
    flag (``add_pasta_args``), keyed by flag. Read from the flags before any model loads (a bad
    ``--device`` raises ParameterError naming it), so that ``--resume`` refuses another model's
    rows before any work (:func:`~pasta_engine.tools.bench.check_resumed_inputs`)."""
    from ..config import Limits, PositionPolicy
    from ..models.adapter import shipped_adapter
    from .args import _dtype_name

    choice = adapter_choice(args, "pasta")
    if not loads_adapter(args, choice):
        adapter = None
    elif choice == "auto":
        adapter = str(shipped_adapter().resolve())
    else:
        adapter = str(Path(choice).expanduser().resolve())
    record: dict[str, Any] = {
        "--model": str(Path(args.model).expanduser().resolve()) if args.model else None,
        "--preset": args.preset, "--preset-seed": args.preset_seed if args.preset else None,
        "--dtype": _dtype_name(args), "--adapter": adapter, "--lora-scale": args.lora_scale,
    }
    if hasattr(args, "baseline"):
        record["--baseline"] = args.baseline
    for name in [*getattr(args, "pasta_defaults", {}), *Limits.GRAMMAR_KNOBS]:
        value = getattr(args, name)
        record["--" + name.replace("_", "-")] = str(PositionPolicy.parse(value)) if name == "position_policy" else value
    return record


def _bench_speedup(args: argparse.Namespace, argv: Sequence[str] | None) -> int:
    from ..tools.bench import (BenchError, annotate_rows, annotate_rows_in_dialect, check_resumed_inputs,
                               dialect_annotator, run_speedup)
    from ..tools.traces import read_prompts, read_traces

    pasta = args.dialect == "pasta"
    if args.traces is not None:
        if args.responses is not None:
            raise BenchError("--responses goes with --annotator (or a --dialect with its own annotator), not with "
                             "--traces")
        traces, to_annotate = _limit(read_traces(args.traces), args.limit), None
    elif pasta:
        if args.annotator is None:
            raise BenchError("give --traces FILE, or --annotator NAME with --responses FILE (AlpacaEval JSON)")
        if args.responses is None:
            raise BenchError(f"--annotator {args.annotator} needs --responses FILE (AlpacaEval JSON)")
        traces, to_annotate = None, _limit(read_prompts(args.responses, need_output=args.annotator != "model"),
                                           args.limit)
    else:
        if args.annotator is not None:
            raise BenchError(f"--annotator {args.annotator} writes PASTA-LANG; --dialect {args.dialect} annotates "
                             "--responses with its own annotator: drop --annotator")
        if args.responses is None:
            raise BenchError(f"--dialect {args.dialect} needs --traces FILE or --responses FILE (AlpacaEval JSON)")
        dialect_annotator(args.dialect)  # a missing annotator fails before the model loads
        traces, to_annotate = None, _limit(read_prompts(args.responses, need_output=True), args.limit)
    params = sampling_params(args)  # the model annotator's: a bad flag fails before the model loads
    model_inputs = _model_inputs(args)
    out: Path = _out_folder(args.out)
    check_resumed_inputs(out, args.resume, {"model_inputs": model_inputs})  # another model's rows: before any work
    engine, settings = build_engine(args)
    traces_file = None
    if traces is None:
        count = lambda text: len(engine.encode(text))  # noqa: E731
        if pasta:
            traces = annotate_rows(to_annotate, args.annotator, count, engine=engine, params=params)
        else:
            traces = annotate_rows_in_dialect(to_annotate, args.dialect, count)
        # written by run_speedup once its checks pass: a refused run (a trace too long for the
        # context, a resume of other traces) leaves an earlier run's traces.jsonl as it was
        traces_file = out / "traces.jsonl"
    from ..tools.bench import run_info

    settings.update(run_info(command_line(argv)), limit=args.limit,
                    traces=str(args.traces) if args.traces else str(out / "traces.jsonl"),
                    responses=str(args.responses) if args.responses else None)
    result = run_speedup(engine, traces, out, settings, warmup=args.warmup, repeats=args.repeats, resume=args.resume,
                         progress=not args.no_progress, dialect=args.dialect, model_inputs=model_inputs,
                         traces_file=traces_file)
    s = result["summary"]
    print(f"bench speedup (dialect {args.dialect}): {s['prompts']} prompts, {s['forked_responses']} forked; geomean content speedup "
          f"{_x(s['geomean_content_speedup'])} theoretical, {_x(s['geomean_realized_content_speedup'])} realized "
          f"(clean text sequential / pasta wall{_spread_text(s)}), realized/theoretical "
          f"{_x(s['geomean_realized_over_theoretical'], '')}{_forked_text(s)}; token parallelism "
          f"{_x(s['geomean_token_parallelism'])}, tag tokens {s['tag_token_fraction']:.0%} of those decoded",
          file=sys.stderr)
    _print_warnings(s)
    print(f"wrote {out / 'summary.json'}, {out / 'prompts.jsonl'}, {out / 'speedup.png'}")
    return 0


def _bench_pareto(args: argparse.Namespace, argv: Sequence[str] | None) -> int:
    from ..tools.bench import check_resumed_inputs, run_info, run_pareto, sampling_record
    from ..tools.traces import read_prompts

    prompts = _limit(read_prompts(args.prompts), args.limit)
    params = sampling_params(args)
    model_inputs = _model_inputs(args)
    _out_folder(args.out)
    # rows of another model or sampling: refused before any work
    check_resumed_inputs(args.out, args.resume, {"sampling": sampling_record(params), "model_inputs": model_inputs})
    engine, settings = build_engine(args)
    seq_choice = adapter_choice(args, "sequential")
    seq_engine = None
    if str(seq_choice) != str(adapter_choice(args, "pasta")):  # --baseline base: the base model's weights
        seq_engine = build_engine(args, adapter=seq_choice)[0]
    settings.update(run_info(command_line(argv)), prompts_file=str(args.prompts), limit=args.limit,
                    max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                    top_k=args.top_k, seed=args.seed, baseline=args.baseline,
                    sequential_adapter=None if (seq_engine or engine).adapter is None
                    else str((seq_engine or engine).adapter))
    result = run_pareto(engine, prompts, params, args.out, settings, warmup=args.warmup, repeats=args.repeats,
                        resume=args.resume, sequential_engine=seq_engine, progress=not args.no_progress,
                        model_inputs=model_inputs)
    s = result["summary"]
    who = "the base model's" if seq_engine is not None else "the same weights'"
    print(f"bench pareto: {s['prompts']} prompts, {s['forked_responses']} forked; geomean content speedup "
          f"{_x(s['geomean_content_speedup'])} theoretical, {_x(s['geomean_realized_content_speedup'])} realized"
          f"{_spread_text(s)}{_forked_text(s)}; end to end vs {who} sequential answers "
          f"{_x(s['geomean_end_to_end_speedup'])} with length ratio {_x(s['geomean_length_ratio'], '')}, cut by the "
          f"token budget {s['cut_fraction_sequential']:.0%} sequential / {s['cut_fraction_pasta']:.0%} pasta; tag "
          f"tokens {s['tag_token_fraction']:.0%} of those decoded", file=sys.stderr)
    _print_warnings(s)
    out = args.out
    print(f"wrote {out / 'summary.json'}, {out / 'prompts.jsonl'}, {out / 'model_outputs_sequential.json'}, "
          f"{out / 'model_outputs_pasta.json'}")
    return 0


def _annotate_tokenizer(args: argparse.Namespace) -> tuple[Any, str]:
    """The tokenizer that measures promise lengths for sot/apar, and its label."""
    from transformers import AutoTokenizer

    from ..tools.bench import BenchError

    if args.tokenizer == "approx":
        return None, "approx"
    if args.tokenizer:
        try:
            return AutoTokenizer.from_pretrained(args.tokenizer), str(args.tokenizer)
        except (OSError, ValueError) as e:
            raise BenchError(f"cannot load tokenizer {args.tokenizer!r}: {e}") from None
    if args.preset:
        from ..tools.presets import preset_tokenizer

        return preset_tokenizer(args.preset), f"preset {args.preset}"
    from ..models.loader import resolve_model_path

    try:
        path, gguf = resolve_model_path(args.model)
    except FileNotFoundError:
        if args.model is not None:
            raise
        return None, "approx (embedded model not installed)"
    kw = {"gguf_file": gguf} if gguf else {}
    return AutoTokenizer.from_pretrained(path, **kw), str(args.model or "embedded model")


def _trace_file(out: Path) -> Path:
    """``bench annotate --out``, the trace file (JSONL) to write, checked before anything is
    read or annotated: not a folder (an empty ``--out`` is the current folder), and its nearest
    existing parent a folder (the missing ones are made when the file is written). Raises
    ParameterError naming ``--out`` and its value."""
    from ..errors import ParameterError

    if out.is_dir():
        shown = "'' or '.' (the current folder)" if str(out) == "." else str(out)
        raise ParameterError("--out", str(out), message=f"--out {shown} is a folder: name the trace file to write "
                             "(JSONL), e.g. traces.jsonl")
    parent = out.absolute().parent
    while not parent.exists() and parent.parent != parent:
        parent = parent.parent
    if not parent.is_dir():
        raise ParameterError("--out", str(out), message=f"--out {out}: {parent} is a file, not a folder: the trace "
                             "file cannot be made under it")
    return out


def _bench_annotate(args: argparse.Namespace, argv: Sequence[str] | None) -> int:
    """``bench annotate``: annotate ``--responses`` with ``--annotator`` and write the trace
    file ``--out`` (JSONL; checked first, :func:`_trace_file`). Returns 0; raises
    ParameterError naming a bad flag before any response is annotated."""
    from ..errors import ParameterError
    from ..tools.bench import annotate_rows, count_tokens_fn
    from ..tools.traces import read_prompts, write_traces

    _trace_file(args.out)
    rows = _limit(read_prompts(args.responses, need_output=args.annotator != "model"), args.limit)
    endpoint = endpoint_from_args(args, "endpoint")
    if (endpoint is not None) != (args.annotator == "endpoint"):
        flag = "--annotator" if endpoint is not None else "--endpoint-url"
        raise ParameterError(flag, args.annotator if endpoint is not None else None,
                             message="--annotator endpoint goes with --endpoint-url and --endpoint-model, and they "
                             "with it")
    if args.annotator == "model":
        params = sampling_params(args)  # a bad flag fails before the model loads
        engine, settings = build_engine(args)
        traces = annotate_rows(rows, "model", engine=engine, params=params)
        source = settings["model"]
    elif endpoint is not None:
        tok, source = _annotate_tokenizer(args)
        traces = annotate_rows(rows, "endpoint", count_tokens_fn(tok), endpoint=endpoint)
        source = f"{source}; tags by {endpoint.name}"
    else:
        tok, source = _annotate_tokenizer(args)
        traces = annotate_rows(rows, args.annotator, count_tokens_fn(tok))
    n = write_traces(args.out, traces)
    forked = sum(1 for t in traces if (t.promises or 0) > 0)
    left = sum(1 for t in traces if t.note and ("left unannotated" in t.note or "annotation discarded" in t.note))
    print(f"bench annotate: {n} rows ({args.annotator}, tokens from {source}): {forked} with promises, "
          f"{sum(t.promises or 0 for t in traces)} promises, {left} left unannotated", file=sys.stderr)
    print(f"wrote {args.out}")
    return 0


def _bench_kernels(args: argparse.Namespace, argv: Sequence[str] | None) -> int:
    import itertools

    import torch

    from ..tools.bench_kernels import KernelShape, bench_tree_attention

    gpu = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    dtype = args.dtype or ("bfloat16" if gpu else "float16")
    shapes = [KernelShape(t, p, s, args.heads, args.kv_heads, args.head_dim, args.page_size, dtype)
              for t, p, s in itertools.product(args.threads, args.prefix, args.suffix)]  # a bad one fails first
    rows = []
    for shape in shapes:
        r = bench_tree_attention(shape, device=args.device, warmup=args.warmup, repeats=args.repeats,
                                 peers=not args.no_peers)
        rows.append(r)
        ks = r["kernels"]
        peers = ", ".join(f"{n} {k['median_us']:.1f}" for n, k in ks.items() if n != "tree")
        limit = (f" = {100 * r['tree_fraction_of_copy_bandwidth']:.0f}% of copy bandwidth (limit "
                 f"{r['physical_limit_us']:.1f} us)" if r["physical_limit_us"] else " (interpreter)")
        print(f"T={shape.threads} P={shape.prefix} S={shape.suffix} {dtype}: tree {ks['tree']['median_us']:.1f} us "
              f"[p10 {ks['tree']['p10_us']:.1f}, p90 {ks['tree']['p90_us']:.1f}]{limit}; {peers}; max abs error "
              f"{max(k['max_abs_error'] for k in ks.values()):.2g}", flush=True)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"command": command_line(argv), "time": time.strftime("%Y-%m-%d %H:%M:%S"),
                                        "rows": rows}, indent=1) + "\n")
        print(f"wrote {args.out}")
    return 0


# --------------------------------------------------------------------------- main


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``pasta-engine`` command. Returns the exit status: 0; 2 for any error
    a user can cause (a flag, a file, a model, an address), printed on one stderr line that names
    it; 1 when a run completed but a request in it ended with an error; 130 after Ctrl-C (what
    the interrupted request decoded is printed first; no traceback)."""
    try:
        return _main(argv)
    except (KeyboardInterrupt, _Interrupted):
        print("pasta-engine: interrupted", file=sys.stderr)
        return 130


def _main(argv: Sequence[str] | None) -> int:
    """Parse ``argv`` and run the command; a run that fails (exit status other than 0, an
    exception, Ctrl-C) leaves no ``--out`` folder behind that it created and wrote nothing into."""
    args = build_parser().parse_args(argv)
    fresh = _new_folders(getattr(args, "out", None))
    rc: int | None = None
    try:
        rc = _dispatch(args, argv)
        return rc
    finally:
        if rc != 0:  # failed, refused or interrupted: what this run created for --out and left empty goes
            _remove_empty_folders(fresh)


def _new_folders(out: Path | None) -> list[Path]:
    """The folders that ``--out`` (``out``: a folder, or a file whose folders are made for it)
    would create: ``out`` and each parent of it that does not exist yet, deepest first (none
    when ``out`` is None or exists)."""
    if out is None:
        return []
    new: list[Path] = []
    p = Path(out).absolute()
    while not os.path.lexists(p) and p.parent != p:
        new.append(p)
        p = p.parent
    return new


def _remove_empty_folders(folders: Sequence[Path]) -> None:
    """Remove each of ``folders`` (deepest first: :func:`_new_folders` of a run that failed)
    that is now an empty folder; stop at the first that is not empty (its parents hold it). A
    folder that existed before the run is never in ``folders``, so never removed; nothing is
    removed that holds a file. Raises nothing."""
    for p in folders:
        if not p.is_dir() or p.is_symlink():
            continue  # never made (the run failed first), or a file's name
        try:
            p.rmdir()  # only an empty folder
        except OSError:
            return


def _dispatch(args: argparse.Namespace, argv: Sequence[str] | None) -> int:
    """Run the parsed command (see :func:`main` for the exit status)."""
    from ..errors import KVCacheExhausted, PastaEngineError, UnsupportedModelError
    from ..tools.bench import BenchError
    from ..tools.traces import TraceFileError, read_prompts, read_traces

    try:
        _refuse_unused_pasta_flags(args)
        _refuse_unused_limits(args)
        _refuse_unused_flags(args)
        if args.command == "train":
            from .train_commands import run_train

            return run_train(args, argv)
        if args.command == "bench" and args.bench_command == "learned":
            from .train_commands import run_learned

            return run_learned(args, argv)
        if args.command == "bench":
            commands = {"speedup": _bench_speedup, "pareto": _bench_pareto, "annotate": _bench_annotate,
                        "kernels": _bench_kernels}
            return commands[args.bench_command](args, argv)
        if args.command == "generate":
            if args.prompts_file is not None:
                prompts = [r.instruction for r in read_prompts(args.prompts_file)]
            else:
                if args.prompt is not None and not args.prompt.strip():
                    raise ValueError(f"the prompt argument {args.prompt!r} is empty: give a prompt, or leave it out "
                                     f"for the sample prompt")
                prompts = [SAMPLE_PROMPT if args.prompt is None else args.prompt]
                _check_utf8(prompts[0], "the prompt argument")
            return _run(args, prompts, None)
        if args.command == "serve":
            from .serve_command import run_serve

            try:
                return run_serve(args)
            except (OSError, OverflowError) as e:
                why = _listen_error(e)
                if why is None:
                    raise
                print(f"pasta-engine: error: cannot listen on --host {args.host} --port {args.port}: {why}",
                      file=sys.stderr)
                return 2
        rows = read_traces(args.traces)
        return _run(args, [r.prompt for r in rows], [r.annotated_response for r in rows])
    except (OSError, UnsupportedModelError, KVCacheExhausted, PastaEngineError, TraceFileError, BenchError,
            ValueError) as e:  # OSError: a file or folder that cannot be read or written (FileNotFoundError too)
        print(f"pasta-engine: error: {e}", file=sys.stderr)
        return 2


def _refuse_unused_pasta_flags(args: argparse.Namespace) -> None:
    """Refuse a grammar knob's flag (``Limits.GRAMMAR_KNOBS``: ``--fork-threshold``,
    ``--independent-topics``, ``--fork-headroom-tokens``) set away from off in a command that only replays annotated
    responses, or generates sequentially only: it would be ignored there, as the engine's default
    (the engine refuses the same fields of a request's ``Limits`` there); and where the pasta
    weights are known to have no PASTA-LANG tag tokens (the embedded model with
    ``--no-adapter``, a ``--preset`` without ``--adapter``), which the engine would refuse once
    loaded. ParameterError naming the flag, before any model loads."""
    from ..config import Limits
    from ..errors import ParameterError

    replays = args.command == "replay" or (args.command == "bench" and args.bench_command == "speedup")
    sequential = args.command == "generate" and getattr(args, "mode", "pasta") == "sequential"
    generates = args.command == "generate" or (args.command == "bench" and args.bench_command == "pareto")
    untagged = generates and args.model is None and not loads_adapter(args, adapter_choice(args, "pasta"))
    if not (replays or sequential or untagged):
        return
    if replays or sequential:
        what = "replays the annotated responses' tokens" if replays else "decodes sequentially (--mode sequential)"
        why = f"acts while the model samples in pasta mode, and this command {what}: leave it out"
    else:
        weights = "--no-adapter loads the embedded model's base weights" if args.no_adapter else \
            f"--preset {args.preset} without --adapter has none"
        why = ("needs a model whose tokenizer has the PASTA-LANG pieces as tokens (an adapter trained with "
               f"--tag-tokens, such as the shipped one), and {weights}: leave it out, or load such an adapter")
    for name, off in Limits.GRAMMAR_KNOBS.items():
        value = getattr(args, name, off)
        if value != off:
            flag = "--" + name.replace("_", "-")
            shown = f"{flag} {value}" if off is None else flag  # a value flag, or a switch
            raise ParameterError(flag, value, message=f"{shown} {why}")


def _refuse_unused_limits(args: argparse.Namespace) -> None:
    """Refuse a PASTA flag (``add_pasta_args``: ``--position-policy``, ``--max-threads``,
    ``--max-forks``, ``--max-fork-depth``, ``--length-cut``, ``--no-distinct-topics``,
    ``--no-chunk-clean-end``) set where nothing reads it, as the grammar knobs are
    (:func:`_refuse_unused_pasta_flags`): ``--position-policy oracle`` where the command
    generates (no true chunk lengths there), and every flag
    :func:`~pasta_engine.config.limits_without_effect` names for the command's mode, dialect and
    whether it replays (the rule the server's ``pasta`` fields follow too; ``--mode both``: its
    pasta side). Not ``serve``'s: they are the defaults of requests that each choose their own
    mode, dialect and replay. ParameterError naming the flag, before any model loads."""
    from ..config import PositionPolicy, limits_without_effect
    from ..errors import ParameterError
    from ..lang.dialect import get_dialect

    defaults = getattr(args, "pasta_defaults", None)
    if defaults is None or args.command == "serve":  # serve's are the defaults of requests, which each
        # set their own mode, dialect and replay: what has no effect is refused per request
        return

    def set_flags(names: Sequence[str]) -> list[tuple[str, str, Any]]:
        """``(flag as typed, name, value)`` of each of ``names`` set away from its default."""
        out = []
        for name in names:
            value, default = getattr(args, name), defaults[name]
            if name == "position_policy":
                changed = PositionPolicy.parse(value) != PositionPolicy.parse(default)  # a bad spec: named here
            else:
                changed = value != default
            if changed:
                flag = "--" + ("no-" if value is False else "") + name.replace("_", "-")
                out.append((flag if isinstance(value, bool) else f"{flag} {value}", name, value))
        return out

    def refuse(shown: str, value: Any, why: str) -> None:
        raise ParameterError(shown.split()[0], value, message=f"{shown} {why}: leave it out")

    generates = args.command == "generate" or (args.command == "bench" and args.bench_command == "pareto")
    if generates and PositionPolicy.parse(args.position_policy).kind == "oracle":
        raise ParameterError("--position-policy", args.position_policy, message=(
            f"--position-policy {args.position_policy} needs each chunk's true length, known only when an "
            "annotated trace is replayed (replay, bench speedup), and this command generates: use predicted, "
            "constant:K or none"))
    mode = getattr(args, "mode", None) or "pasta"
    dialect = getattr(args, "dialect", None)
    unused = limits_without_effect("pasta" if mode == "both" else mode,  # --mode both: its pasta side reads them
                                   nesting=dialect is not None and get_dialect(dialect).nesting,
                                   replay=not generates, dialect=dialect or "pasta")
    for shown, name, value in set_flags([n for n in defaults if n in unused]):
        refuse(shown, value, f"has no effect in {unused[name]}")


def _refuse_unused_flags(args: argparse.Namespace) -> None:
    """Refuse a flag set in a command, or a mode, where nothing reads it (ParameterError naming
    it, before any model loads): a prompt with ``--prompts-file``; ``--limit`` in ``generate``
    without ``--prompts-file`` (it answers one prompt); ``--compare-transformers``
    outside ``--mode sequential`` and ``both``; ``--baseline base`` in pasta or inline mode (it
    gives the sequential side the base weights); ``--warmup`` or ``--repeats`` outside ``--mode
    both`` (``generate``, ``replay``); sampling flags in ``bench speedup`` and ``bench annotate``
    unless ``--annotator model`` samples the traces; ``--tokenizer`` in ``bench annotate
    --annotator model`` (the model's own tokenizer counts there); in ``bench annotate`` with an
    annotator other than ``model`` (no engine is built), every model and engine flag
    (``add_model_args``) set away from its default but ``--model`` and ``--preset``, which pick
    the tokenizer of promise lengths, and those two as well beside ``--tokenizer``, which picks
    it instead; ``--compare-transformers`` where its comparison cannot hold
    (:func:`_refuse_compare_transformers`)."""
    from ..errors import ParameterError
    from ..tools.bench import DEFAULT_REPEATS

    def refuse(flag: str, value: Any, why: str) -> None:
        raise ParameterError(flag, value, message=f"{flag} {value} {why}: leave it out")

    if args.command == "generate" and args.prompt is not None and args.prompts_file is not None:
        refuse("prompt", repr(args.prompt), f"and --prompts-file {args.prompts_file} both give the prompts")
    if args.command == "generate" and args.prompts_file is None and args.limit is not None:
        refuse("--limit", args.limit, "takes the first N prompts of --prompts-file, and this run answers one prompt")
    mode = getattr(args, "mode", None)
    if args.command in ("generate", "replay"):
        if getattr(args, "compare_transformers", False) and mode not in ("sequential", "both"):
            raise ParameterError("--compare-transformers", True, message=f"--compare-transformers times transformers "
                                 f"against the sequential answer, and --mode {mode} decodes none: use --mode "
                                 "sequential or both")
        _refuse_compare_transformers(args)
        if getattr(args, "baseline", "same") != "same" and mode not in ("sequential", "both"):
            refuse("--baseline", args.baseline,
                   f"chooses the sequential answer's weights, and --mode {mode} decodes none")
        if mode != "both":
            for flag, default in (("warmup", DEFAULT_WARMUP), ("repeats", DEFAULT_REPEATS)):
                if getattr(args, flag, default) != default:
                    refuse("--" + flag, getattr(args, flag), f"times the two sides of --mode both, and this run is "
                           f"--mode {mode}")
    if args.command == "bench" and args.bench_command in ("speedup", "annotate") and args.annotator != "model":
        what = "replays them" if args.bench_command == "speedup" else f"annotates with --annotator {args.annotator}"
        for name, default in getattr(args, "sampling_defaults", {}).items():
            if getattr(args, name) != default:
                flag = "--" + name.replace("_", "-")
                refuse(flag, getattr(args, name), f"acts only where --annotator model samples the traces; this run "
                       f"{what}")
    if args.command == "bench" and args.bench_command == "annotate" and args.annotator == "model" \
            and args.tokenizer is not None:
        refuse("--tokenizer", args.tokenizer, "sets how sot, apar and endpoint annotations count promise lengths; "
               "--annotator model counts with the model's own tokenizer")
    if args.command == "bench" and args.bench_command == "annotate" and args.annotator != "model":
        _refuse_engine_flags(args)


def _refuse_engine_flags(args: argparse.Namespace) -> None:
    """``bench annotate`` with ``--annotator`` sot, apar or endpoint builds no engine: refuse
    each model or engine flag (``add_model_args``) set away from its default, except
    ``--model`` and ``--preset`` (their tokenizer counts promise lengths) when ``--tokenizer``
    is not given. ParameterError naming the flag and its value, before anything is read."""
    from ..errors import ParameterError
    from .args import add_model_args

    reference = argparse.ArgumentParser(add_help=False)
    add_model_args(reference)
    tokenizer_flags = ("model", "preset")
    for action in reference._actions:
        if not action.option_strings or action.dest not in vars(args):
            continue
        value = getattr(args, action.dest)
        if value == action.default:
            continue
        flag = action.option_strings[0]
        shown = flag if action.nargs == 0 else f"{flag} {value}"  # a switch, or a flag with a value
        if action.dest in tokenizer_flags:
            if args.tokenizer is None:
                continue  # it picks the tokenizer that counts promise lengths
            why = (f"picks the tokenizer of promise lengths, and --tokenizer {args.tokenizer} picks it already "
                   f"(--annotator {args.annotator} runs no model)")
        else:
            why = (f"sets the model or engine that --annotator model runs, and --annotator {args.annotator} runs "
                   "none (only --model or --preset is read: its tokenizer counts promise lengths)")
        raise ParameterError(flag, value, message=f"{shown} {why}: leave it out")


def _refuse_compare_transformers(args: argparse.Namespace) -> None:
    """``--compare-transformers`` runs transformers' greedy generate (no penalty) on the base
    checkpoint: its tokens can equal the sequential answer's only when that answer is greedy
    without a repetition penalty or ``--ignore-eos`` and comes from the base weights (no adapter
    merged: transformers would load the checkpoint without it). Otherwise ParameterError naming
    the flag that breaks it, before any model loads."""
    from ..config import GREEDY_TEMPERATURE
    from ..errors import ParameterError

    if not getattr(args, "compare_transformers", False) or args.mode not in ("sequential", "both"):
        return
    why = "--compare-transformers sets transformers' greedy generate (no penalty) of the base checkpoint against " \
          "the sequential answer"
    if loads_adapter(args, adapter_choice(args, "sequential")):
        raise ParameterError("--compare-transformers", True, message=(
            f"{why}, and this run's sequential answer comes from the weights with an adapter merged (the shipped "
            "adapter by default, or --adapter): add --no-adapter" + (" (or --baseline base)" if args.mode == "both"
                                                                        else "")))
    for flag, value, ok in (("--temperature", args.temperature, args.temperature < GREEDY_TEMPERATURE),
                            ("--repetition-penalty", args.repetition_penalty, args.repetition_penalty == 1.0),
                            ("--ignore-eos", True, not args.ignore_eos)):
        if not ok:
            shown = flag if value is True else f"{flag} {value:g}"
            raise ParameterError(flag, value, message=(
                f"{why}, and {shown} samples otherwise: run it with --temperature 0 --repetition-penalty 1 and "
                "without --ignore-eos"))


def _check_utf8(text: str, what: str) -> None:
    """Raise ValueError naming ``what`` when ``text`` holds bytes that were not UTF-8 (Python
    keeps them in a command line as lone surrogates, which no tokenizer can encode)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raw = text[e.start].encode("utf-8", "surrogateescape") if "\udc80" <= text[e.start] <= "\udcff" else None
        shown = f"byte 0x{raw.hex()}" if raw else repr(text[e.start])
        raise ValueError(f"{what} is not UTF-8 text ({shown} at character {e.start}): pass UTF-8, or a --prompts-file "
                         "in UTF-8") from None


def _listen_error(e: BaseException) -> str | None:
    """Why the server could not listen, when ``e`` is that kind of error (None otherwise): an
    address in use or not on this machine, a port out of range or reserved, an unknown host."""
    import errno
    import socket

    if isinstance(e, OverflowError):
        return str(e) if "port" in str(e) else None
    if isinstance(e, socket.gaierror):
        return f"unknown host ({e.strerror or e})"
    if isinstance(e, OSError) and e.filename is None and e.errno in (errno.EADDRINUSE, errno.EADDRNOTAVAIL, errno.EACCES):
        return {errno.EADDRINUSE: "the address is already in use (pick another --port, or 0 for any free one)",
                errno.EADDRNOTAVAIL: "the address is not on this machine",
                errno.EACCES: "permission denied (ports below 1024 need privileges)"}[e.errno]
    return None


if __name__ == "__main__":
    sys.exit(main())
