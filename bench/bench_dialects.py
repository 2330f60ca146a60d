"""Three learned-parallel decoding languages on one engine (issue 23): the same AlpacaEval answers
written in PASTA-LANG (``pasta``, Jin et al. 2025), APAR (``apar``, Liu et al. 2024, arXiv
2401.06761) and Multiverse (``multiverse``, Yang et al. 2025, arXiv 2506.09991), each by its own
annotator, and their content speedups side by side (docs/DESIGN.md section 3: content tokens of
the clean text / decode steps; tag tokens are overhead).

* **theoretical**, on every answer (``--limit``): content tokens / the critical path of the
  trace's replay (:func:`pasta_engine.core.replay.replay_script`, tree forks and scoped joins
  included), under the model's tokenizer with every dialect's tags as text. No model runs.
* **realized**, on the first ``--realized`` answers: ``pasta-engine bench speedup --dialect D
  --traces ...`` on the model (default the ``smollm2-135m`` preset: SmolLM2-135M's shapes, seeded
  random weights, CPU, float32): the clean text replayed sequentially vs the trace replayed in
  pasta mode, wall seconds, same weights. Its outputs are kept under ``<out stem>/<dialect>/``.

The annotators fork at list items (PASTA: ``sot``, a promise per item; APAR: ``[Fork]`` after
each item's header; Multiverse: one ``<Parallel>`` block over the answer's largest list) and
leave an answer without a list unforked; each trace's clean text is its answer exactly.

    python bench/bench_dialects.py --responses ../shared/data/alpaca_eval/gpt4_1106_preview_outputs.json \\
        --limit 50 --realized 10 --out bench/results/dialects-smollm2-cpu.json

Writes the JSON (never over an existing one unless ``--overwrite``: ``-2``, ``-3``, ... beside it)
and a PNG with the same stem; the realized runs' own outputs go to a folder of that stem.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from pasta_engine.core.replay import trace_content_figures
from pasta_engine.lang.dialect import DIALECT_NAMES, get_dialect
from pasta_engine.lang.tokenization import eos_token_ids, replay_eos_id
from pasta_engine.metrics import content_speedup, geomean
from pasta_engine.tools.bench import annotate_rows, annotate_rows_in_dialect, count_tokens_fn
from pasta_engine.tools.presets import PRESETS, preset_tokenizer
from pasta_engine.tools.traces import read_prompts, write_traces

from common import new_path  # bench/common.py: a rerun never replaces a committed result

#: PASTA-LANG's annotator here: a promise per list item, as the other two dialects fork.
PASTA_ANNOTATOR = "sot"


def traces_for(rows: list[Any], dialect: str, count) -> list[Any]:
    """Trace rows of ``rows`` in ``dialect``, by its annotator."""
    if dialect == "pasta":
        return annotate_rows(rows, PASTA_ANNOTATOR, count)
    return annotate_rows_in_dialect(rows, dialect, count)


def theoretical(tokenizer: Any, dialect: str, annotated: str) -> dict[str, Any]:
    """One trace's structure and theoretical content speedup (tokens / steps) in ``dialect``."""
    content, cp, forks = trace_content_figures(tokenizer, annotated, replay_eos_id(tokenizer, eos_token_ids(tokenizer)),
                                               get_dialect(dialect))
    return {"content_tokens": content, "critical_path": cp, "forks": forks, "content_speedup": content_speedup(content, cp)}


def realized_command(traces: list[Any], dialect: str, out: Path, args: argparse.Namespace) -> list[str]:
    """Write ``traces`` under ``out`` and return the ``pasta-engine bench speedup --dialect``
    command that replays them (one torch thread: runs may go side by side, one per core)."""
    out.mkdir(parents=True, exist_ok=True)
    path = out / "traces.jsonl"
    write_traces(path, traces)
    return [sys.executable, "-m", "pasta_engine.entrypoints.cli", "bench", "speedup", "--dialect", dialect,
            "--traces", str(path), "--out", str(out / "speedup"), "--threads", "1", "--no-progress",
            *(["--preset", args.preset] if args.preset else ["--model", args.model]), *args.speedup_args]


def run_all(commands: dict[str, list[str]], jobs: int) -> dict[str, float]:
    """Run the commands, ``jobs`` at a time; wall seconds of each. Raises CalledProcessError
    for a command that fails."""
    pending = list(commands.items())
    running: dict[str, tuple[subprocess.Popen, float]] = {}
    wall: dict[str, float] = {}
    while pending or running:
        while pending and len(running) < jobs:
            name, cmd = pending.pop(0)
            running[name] = (subprocess.Popen(cmd, env={**os.environ, "OMP_NUM_THREADS": "1"}), time.perf_counter())
        time.sleep(0.5)
        for name, (proc, t0) in list(running.items()):
            if proc.poll() is not None:
                del running[name]
                if proc.returncode:
                    raise subprocess.CalledProcessError(proc.returncode, commands[name])
                wall[name] = time.perf_counter() - t0
    return wall


def plot(result: dict[str, Any], path: Path) -> None:
    """Bars per dialect: geomean theoretical content speedup (all answers, and the realized
    subset) and realized content speedup (the subset)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    names = list(result["dialects"])
    fig = Figure(figsize=(7.5, 4), layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    keys = (("theoretical_all", f"theoretical ({result['answers']} answers)"),
            ("theoretical_realized_subset", f"theoretical ({result['realized_answers']} answers)"),
            ("realized", f"realized ({result['realized_answers']} answers)"))
    w = 0.26
    for j, (key, label) in enumerate(keys):
        ys = [result["dialects"][n].get(key) or 0.0 for n in names]
        ax.bar([i + (j - 1) * w for i in range(len(names))], ys, w, label=label)
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_xticks(range(len(names)), names)
    ax.set_ylabel("geomean content speedup (x)")
    ax.set_title(f"Dialects on one engine: {result['model']}, CPU")
    ax.legend(fontsize=8)
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    default_data = Path(os.environ.get("PASTA_SHARED_DATA", Path(__file__).resolve().parents[2] / "shared" / "data"))
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--responses", type=Path,
                   default=default_data / "alpaca_eval" / "gpt4_1106_preview_outputs.json",
                   help="AlpacaEval JSON with outputs (default: $PASTA_SHARED_DATA/alpaca_eval/...)")
    p.add_argument("--limit", type=int, default=50, help="answers (the first N)")
    p.add_argument("--realized", type=int, default=10, help="of those, the first N are run on the model (0: none)")
    p.add_argument("--dialects", default=",".join(DIALECT_NAMES), help="comma-separated dialect names")
    p.add_argument("--preset", default="smollm2-135m", help="model preset of the realized runs ('' to use --model)")
    p.add_argument("--model", default=None, help="checkpoint of the realized runs when --preset is ''")
    p.add_argument("--overwrite", action="store_true", help="replace --out instead of writing beside it")
    p.add_argument("--jobs", type=int, default=1, help="realized runs side by side (one torch thread each)")
    p.add_argument("--out", type=Path, required=True, help="JSON to write (a PNG beside it)")
    p.add_argument("speedup_args", nargs="*", help="extra `bench speedup` flags, after --")
    args = p.parse_args(argv)
    dialects = [d.strip() for d in args.dialects.split(",") if d.strip()]
    for d in dialects:
        get_dialect(d)  # ValueError naming a bad name
    if args.preset and args.preset not in PRESETS:
        p.error(f"--preset {args.preset!r} is not one of {', '.join(PRESETS)}")
    if not args.responses.exists():
        p.error(f"--responses {args.responses} does not exist (set PASTA_SHARED_DATA or pass the file)")
    if not 0 <= args.realized <= args.limit:
        p.error(f"--realized {args.realized} must be between 0 and --limit {args.limit}")
    rows = read_prompts(args.responses, need_output=True)[: args.limit]
    tokenizer = preset_tokenizer(args.preset) if args.preset else None
    if tokenizer is None:
        from pasta_engine.models.loader import load_tokenizer

        tokenizer = load_tokenizer(args.model)
    count = count_tokens_fn(tokenizer)
    out = new_path(args.out, args.overwrite)
    work = out.with_suffix("")
    result: dict[str, Any] = {
        "command": "python bench/bench_dialects.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "responses": str(args.responses), "answers": len(rows), "realized_answers": args.realized,
        "model": f"preset {args.preset}" if args.preset else str(args.model),
        "pasta_annotator": PASTA_ANNOTATOR, "machine": platform.platform(), "cpus": os.cpu_count(),
        "load_average_start": os.getloadavg(), "jobs": args.jobs, "dialects": {},
    }
    commands: dict[str, list[str]] = {}
    for d in dialects:
        traces = traces_for(rows, d, count)
        per = [theoretical(tokenizer, d, t.annotated_response) for t in traces]
        result["dialects"][d] = {
            "forked_answers": sum(r["forks"] > 0 for r in per),
            "mean_forks": sum(r["forks"] for r in per) / len(per),
            "theoretical_all": geomean(r["content_speedup"] for r in per if r["content_tokens"]),
            "rows": per,
        }
        if args.realized:
            commands[d] = realized_command(traces[: args.realized], d, work / d, args)
    wall = run_all(commands, args.jobs) if commands else {}
    for d, entry in result["dialects"].items():
        if d in commands:
            summary = json.loads((work / d / "speedup" / "summary.json").read_text())["summary"]
            rows_d = [json.loads(x) for x in (work / d / "speedup" / "prompts.jsonl").read_text().splitlines() if x.strip()]
            entry["theoretical_realized_subset"] = summary.get("geomean_content_speedup")
            entry["realized"] = summary.get("geomean_realized_content_speedup")
            entry["realized_over_theoretical"] = summary.get("geomean_realized_over_theoretical")
            entry["realized_run"] = {"command": " ".join(commands[d][2:]), "wall_s": wall[d]}
            entry["realized_rows"] = [{k: r.get(k) for k in ("content_speedup", "realized_content_speedup", "forks",
                                                              "critical_path", "same_text")} for r in rows_d]
        print(f"{d}: forked {entry['forked_answers']}/{args.limit}, theoretical {entry['theoretical_all']:.2f}x"
              + (f", realized {entry['realized']:.2f}x on {args.realized}" if d in commands else ""), file=sys.stderr)
    result["load_average_end"] = os.getloadavg()
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    plot(result, out.with_suffix(".png"))
    print(f"wrote {out} and {out.with_suffix('.png')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
