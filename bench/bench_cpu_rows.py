"""A decode step's wall time against its row count (one row per live thread) on a CPU, with
``F.linear`` for every projection and with :func:`pasta_engine.layers.linear.linear`'s
per-shape choice, for the embedded SmolLM2-135M (float32, torch backend).

PASTA saves decode steps only if a step with R threads costs about what a step with one does:
on a CPU that holds while the step is bound by reading the weights. The floor is the weights'
bytes over the measured memory bandwidth (a single-thread copy of 256 MiB, bytes read plus
written). Each row count R replays a forced trace in which R threads sample in the last
``--tail`` steps (``bench_host.trace``); the median over those steps is reported.

    OMP_NUM_THREADS=1 taskset -c 1 python bench/bench_cpu_rows.py [--rows 1,2,3,4,5,6,8] [--name cpu_rows]

writes ``bench/results/<name>.json`` (a new ``<name>-2.json``, ... when it exists, unless
``--overwrite``) with the machine, the command, the load average and the
GEMM choices made.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def copy_bandwidth_cpu(n_bytes: int = 256 << 20, reps: int = 5) -> float:
    """Bytes per second read plus written by the fastest of ``reps`` copies of ``n_bytes``."""
    import torch

    a = torch.ones(n_bytes // 4, dtype=torch.float32)
    b = torch.empty_like(a)
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        b.copy_(a)
        best = min(best, time.perf_counter() - t)
    return 2 * n_bytes / best


def step_ms(engine, rows: int, tail: int) -> tuple[float, int]:
    """Median milliseconds of the steps where all ``rows`` threads sampled, and their count."""
    from bench_host import trace

    from pasta_engine import Limits

    tok = engine.tokenizer
    prompt = tok.encode("Give me some tips.", add_special_tokens=False)
    engine.add_request(prompt, annotated_response=trace(tok, rows, tail), limits=Limits(max_threads=rows))
    engine.profile = []
    walls = []
    try:
        while engine.has_unfinished_requests():
            t = time.perf_counter()
            engine.step()
            wall = time.perf_counter() - t
            p = engine.profile[-1] if engine.profile else None
            if p is not None and p.sampled == rows and p.sequences == rows:
                walls.append(wall)
    finally:
        engine.profile = None
    return 1e3 * statistics.median(walls), len(walls)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", default="1,2,3,4,5,6,8")
    ap.add_argument("--tail", type=int, default=12, help="steps per replay where every thread samples")
    ap.add_argument("--name", default="cpu_rows")
    ap.add_argument("--out", type=Path, default=None, help="JSON path (default: bench/results/<name>.json)")
    ap.add_argument("--overwrite", action="store_true",
                    help="replace the output file when it exists (default: keep it, write <name>-2.json, ...)")
    args = ap.parse_args()

    import torch

    import pasta_engine.layers.linear as lin
    from bench_host import engine_info, machine_info
    from common import device_info, write_json
    from pasta_engine import Engine

    load_start = os.getloadavg()[0]
    engine = Engine.from_pretrained(None, device="cpu", dtype=torch.float32, adapter=None)
    model = engine.model_runner.model
    bandwidth = copy_bandwidth_cpu()
    floor_ms = 1e3 * model.weight_bytes / bandwidth
    rows_list = [int(x) for x in args.rows.split(",")]
    results = {r: {"rows": r} for r in rows_list}
    choices = {}
    for mode, fn in (("f_linear", torch.nn.functional.linear), ("chosen", lin.linear)):
        lin._choices.clear()
        model._linear = fn  # what LlamaModel calls for every projection
        if mode == "chosen":
            engine.model_runner.warm_up()
            choices = lin.gemm_choices()
        for r in rows_list:
            step_ms(engine, r, 4)  # warm-up
            ms, n = step_ms(engine, r, args.tail)
            results[r][f"{mode}_step_ms"] = ms
            results[r][f"{mode}_steps"] = n
            print(mode, r, f"{ms:.1f} ms", flush=True)
    for r in rows_list:
        res = results[r]
        res["f_linear_vs_1_row"] = res["f_linear_step_ms"] / results[rows_list[0]]["f_linear_step_ms"]
        res["chosen_vs_1_row"] = res["chosen_step_ms"] / results[rows_list[0]]["chosen_step_ms"]
        res["chosen_floor_fraction"] = floor_ms / res["chosen_step_ms"]
    write_json(args.name, {
        **device_info(), **engine_info(), "machine": machine_info(), "command": " ".join([sys.executable, *sys.argv]),
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"), "torch_threads": torch.get_num_threads(),
        "cpu_affinity": sorted(os.sched_getaffinity(0)), "load_average_1m_start": load_start,
        "load_average_end": list(os.getloadavg()), "model": "embedded SmolLM2-135M-Instruct (base weights), float32",
        "attention_backend": engine.model_runner.backend.name, "weight_bytes": model.weight_bytes,
        "copy_bandwidth_bytes_per_s": bandwidth, "floor_ms": floor_ms,
        "floor": "weight bytes / single-thread copy bandwidth (read + written): the step if only weights were read",
        "statistic": "median wall ms of Engine.step over the steps where all rows sampled", "tail": args.tail,
        "gemm_choices": choices, "results": [results[r] for r in rows_list],
    }, overwrite=args.overwrite, out=args.out)


if __name__ == "__main__":
    main()
