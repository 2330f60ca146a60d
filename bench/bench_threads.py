"""Torch CPU threads against a busy machine: milliseconds per sequential decode step of the
embedded SmolLM2-135M (base weights, float32, torch backend) with ``torch.set_num_threads(N)``
for each N asked, on an otherwise unchanged machine and with one more busy process (a
``python -c "while True: pass"`` loop this script starts and kills).

Each measurement replays (forced decoding, sequential mode) a fixed text of about ``--tokens``
tokens, so every run takes the same steps; one short warm-up replay per setting comes first. The
settings run interleaved (round after round, each once), so a change in the machine's other load
falls on all of them alike. Reported per (busy, threads): the median, 10th and 90th percentile of
the decode steps' wall ms (the prefill step left out), each run's wall seconds, and the 1-minute
load average after each round; a replay is cut short after ``--max-run-s`` seconds (its steps
so far count) and no new round starts after ``--max-s`` seconds.

    python bench/bench_threads.py [--threads 1,2,default,4,auto] [--busy 0,1] [--tokens 64] [--repeats 3]

``default`` is torch's own thread count at start (unset ``OMP_NUM_THREADS`` for it to mean
anything); ``auto`` is the CLI's policy (:func:`pasta_engine.entrypoints.args.cpu_threads`).
Writes ``bench/results/<name>.json`` (a new ``<name>-2.json``, ... when it exists, unless
``--overwrite``) with the command, the machine, the load averages and every process's share of
the CPU at the start: on a shared machine these numbers are measured under contention.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

TEXT = ("To sleep better, keep a regular schedule: go to bed and get up at the same time every day, even on "
        "weekends. Avoid caffeine after noon and heavy meals late in the evening. Keep the bedroom dark, quiet "
        "and cool, and put screens away an hour before bed. Exercise during the day helps too.")


def busy_processes(limit: int = 6) -> list[str]:
    """The processes using the most CPU right now (``ps``), as lines: what else loads the machine."""
    try:
        out = subprocess.run(["ps", "-eo", "pid,pcpu,comm", "--sort=-pcpu"], capture_output=True, text=True,
                             timeout=10).stdout.splitlines()
    except (OSError, subprocess.TimeoutExpired):
        return []
    return [" ".join(line.split()) for line in out[1 : limit + 1]]


def clip_text(engine, tokens: int) -> str:
    """The first ``tokens`` tokens of :data:`TEXT` (repeated as needed), as text."""
    text = TEXT
    while len(engine.encode(text)) < tokens:
        text += " " + TEXT
    return engine.decode(engine.encode(text)[:tokens])


def decode_steps_ms(engine, text: str, max_run_s: float = float("inf")) -> tuple[list[float], float, bool]:
    """One sequential replay of ``text``: the wall ms of each decode step after the prefill, the
    run's wall seconds, and whether it was cut short (aborted after ``max_run_s`` seconds, so a
    collapsed setting costs little time; its steps so far still count)."""
    rid = engine.add_request("Give me tips for sleeping better.", mode="sequential", annotated_response=text)
    steps = []
    t0 = time.perf_counter()
    cut = False
    while engine.has_unfinished_requests():
        if time.perf_counter() - t0 > max_run_s:
            engine.abort(rid)
            cut = True
            break
        t = time.perf_counter()
        engine.step()
        steps.append(1e3 * (time.perf_counter() - t))
    wall = time.perf_counter() - t0
    if cut:
        engine.step()  # reports the abort (and frees the request's id)
    return steps[1:], wall, cut


def measure(engine, settings: dict[str, int], text: str, warm_text: str, repeats: int, max_s: float,
            max_run_s: float) -> dict[str, dict]:
    """Replays of ``text`` with each thread count of ``settings`` (name -> N), interleaved: round
    after round, each setting runs once, so a change in the machine's other load falls on all of
    them alike; up to ``repeats`` rounds, fewer when a round would pass ``max_s`` seconds in all."""
    import torch

    steps: dict[str, list[float]] = {k: [] for k in settings}
    walls: dict[str, list[float]] = {k: [] for k in settings}
    cut: dict[str, int] = {k: 0 for k in settings}
    loads = [os.getloadavg()[0]]
    for name, n in settings.items():
        torch.set_num_threads(n)
        decode_steps_ms(engine, warm_text)
    start = time.perf_counter()
    for _ in range(repeats):
        for name, n in settings.items():
            torch.set_num_threads(n)
            s, wall, short = decode_steps_ms(engine, text, max_run_s)
            steps[name] += s
            walls[name].append(wall)
            cut[name] += short
        loads.append(os.getloadavg()[0])
        per_round = (time.perf_counter() - start) / len(loads[1:])
        if time.perf_counter() - start + per_round > max_s:
            break
    out = {}
    for name, n in settings.items():
        q = statistics.quantiles(steps[name], n=10)
        out[name] = {"torch_threads": n, "runs": len(walls[name]), "runs_cut_short": cut[name],
                     "decode_steps_timed": len(steps[name]),
                     "step_ms_median": statistics.median(steps[name]), "step_ms_p10": q[0], "step_ms_p90": q[-1],
                     "run_wall_s": walls[name], "load_average_1m_per_round": loads}
    return out


def auto_threads() -> int:
    """The CLI's ``--threads auto`` count on this machine now."""
    from pasta_engine.entrypoints.args import cpu_threads

    return cpu_threads("auto")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", default="1,2,default,4", help="comma-separated: N, default (torch's), auto (the CLI's)")
    ap.add_argument("--busy", default="0,1", help="extra busy processes to start, per measurement (comma-separated)")
    ap.add_argument("--tokens", type=int, default=64, help="tokens of the replayed text")
    ap.add_argument("--repeats", type=int, default=3, help="rounds of timed replays (after one short warm-up each)")
    ap.add_argument("--max-s", type=float, default=240.0, help="no new round after this many seconds per busy level")
    ap.add_argument("--max-run-s", type=float, default=20.0,
                    help="cut a replay short after this many seconds (its steps so far count)")
    ap.add_argument("--name", default="cpu_threads")
    ap.add_argument("--out", type=Path, default=None, help="JSON path (default: bench/results/<name>.json)")
    ap.add_argument("--overwrite", action="store_true",
                    help="replace the output file when it exists (default: keep it, write <name>-2.json, ...)")
    args = ap.parse_args()

    import torch

    from bench_host import engine_info, machine_info
    from common import write_json
    from pasta_engine import Engine

    default_threads = torch.get_num_threads()
    from pasta_engine.entrypoints.args import busy_cores

    start = {"load_average": list(os.getloadavg()), "busy_cores": busy_cores(), "auto_threads": auto_threads(),
             "top_processes": busy_processes()}
    engine = Engine.from_pretrained(None, device="cpu", dtype=torch.float32, adapter=None)
    text, warm_text = clip_text(engine, args.tokens - 1), clip_text(engine, 8)  # + EOS: --tokens steps
    rows = []
    for busy in (int(b) for b in args.busy.split(",")):
        procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(busy)]
        try:
            time.sleep(1.0 if busy else 0.0)
            settings = {name: default_threads if name == "default" else auto_threads() if name == "auto" else int(name)
                        for name in args.threads.split(",")}
            for name, row in measure(engine, settings, text, warm_text, args.repeats, args.max_s,
                                     args.max_run_s).items():
                row = {"busy_processes_added": busy, "threads": name, **row}
                print(f"busy +{busy}, threads {name} ({row['torch_threads']}): {row['step_ms_median']:.1f} ms/step "
                      f"median (p10 {row['step_ms_p10']:.1f}, p90 {row['step_ms_p90']:.1f}), {row['runs']} runs",
                      flush=True)
                rows.append(row)
        finally:
            for p in procs:
                p.kill()
                p.wait()
    write_json(args.name, {
        **engine_info(), "machine": machine_info(), "device": "cpu", "command": " ".join([sys.executable, *sys.argv]),
        "cpu_count": os.cpu_count(), "cpu_affinity": sorted(os.sched_getaffinity(0)),
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"), "torch_default_threads": default_threads,
        "torch_version": torch.__version__, "at_start": start, "load_average_end": list(os.getloadavg()),
        "model": "embedded SmolLM2-135M-Instruct (base weights), float32, torch attention backend",
        "scenario": f"sequential replay of a fixed {args.tokens - 1}-token text (+ EOS), batch 1",
        "statistic": "wall ms of each Engine.step after the prefill step, over all timed runs",
        "contention": "measured on a shared machine: the load average and top processes at the start say what else "
                      "ran; busy_processes_added counts the extra busy loops this script started on top of that",
        "results": rows,
    }, overwrite=args.overwrite, out=args.out)


if __name__ == "__main__":
    main()
