"""Host microseconds per decode step at 1, 4, 16 and 64 live threads (CPU, pytest-benchmark).

The model costs almost nothing (a 1-layer, hidden-32 random Llama built by
:func:`pasta_engine.tools.presets.build_checkpoint`), so a step's time is the engine's own work:
the scheduler, the interpreter (detokenizer, tag parser, KV operations), the attention plan and
the sampler, plus a forward that is a few small matmuls. Each width W replays forced traces whose
threads all run: a request's main thread writes W-1 promises one after the other, each chunk is
long enough to still be decoding when the main thread has written its last promise and a tail of
``tail`` tokens, so every thread samples in each of the last ``tail`` steps. Widths above 16 use
several such requests of 16 threads (``Limits.max_threads`` is 16 per request by default, and a
server with a few concurrent PASTA requests is the case that matters): 64 = 4 x 16.

Reported per width: the median over the steps where all W threads sampled (``steps``) of the
step's wall time (``step_us``, everything :meth:`Engine.step` does) and its split:
``schedule_us`` (admission, the interpreters' thread steps, KV page checks), ``interp_us``
(tokens handed back: detokenizer, tag parser, forks/joins, KV operations, the step's outputs),
``plan_us`` (the batch's token/position/slot lists and the attention plan), ``forward_us`` (the
model), ``sample_us`` (choosing every token and the one copy back) and ``other_us`` (the rest).
The split comes from :class:`~pasta_engine.worker.model_runner.StepProfile` when it has the
fields, else from timers wrapped around the same functions (older engines). Keeping the profile
costs time of its own (at 16 threads about 20 us: the distinct-KV-token count, the entries, the
extra clock reads), so the layered engine replays each trace a second time with the profile off
and reports the same steps' median wall time as ``step_unprofiled_us``: the step a user's
engine runs.

Run as a benchmark: ``pytest bench/bench_host.py --benchmark-json /tmp/host.json`` (the per-step
medians are in each benchmark's ``extra_info``), or as a script that writes
``bench/results/<name>.json`` (a new ``<name>-2.json``, ... when it exists, unless ``--overwrite``)
with the machine, the command and the load average:
``python bench/bench_host.py [--threads 1,4,16,64] [--repeats 3] [--name host_step_cpu]``.
The same script measures an older checkout: ``--worktree /tmp/before`` imports ``pasta_engine``
from that folder (e.g. one made by ``git worktree add /tmp/before <commit>``; it records which
engine it ran), so two engines are compared side by side on the same machine with the same
script. ``--logprobs`` replays with ``return_logprobs=True``, so every step also runs the
sampler's general path (the sampling batch packed from the rows, the logprobs, the copy back)
rather than the CPU replay shortcut that returns the forced tokens as they are.
Timings taken while other jobs load the CPU are meaningless: the load average is recorded, and
``--max-load`` makes the script wait (up to ``--wait-s``) for a quiet machine first.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

MODEL_OVERRIDES = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                       num_key_value_heads=1, head_dim=16)
THREADS_PER_REQUEST = 16
WIDTHS = (1, 4, 16, 64)
SPLIT = ("schedule", "interp", "plan", "forward", "sample")


# --------------------------------------------------------------------------- the scenario



def _final_only(engine) -> dict:
    """``output_kind="final"`` where the engine has it (what ``generate`` runs: no per-step
    rendering, which a step-API user reading every step's text pays on top; older engines
    rendered lazily)."""
    import inspect

    return {"output_kind": "final"} if "output_kind" in inspect.signature(engine.add_request).parameters else {}

def build_model(out_dir: str | Path) -> Path:
    """The near-zero-cost model: tiny-llama with 1 layer, hidden 32, 2 heads of 16, 1 KV head."""
    from pasta_engine.tools.presets import build_checkpoint

    return build_checkpoint("tiny-llama", out_dir, overrides=MODEL_OVERRIDES)


def _ntok(tokenizer, text: str) -> int:
    return len(tokenizer.encode(text, add_special_tokens=False))


def trace(tokenizer, width: int, tail: int) -> str:
    """An annotated response with ``width`` threads that all sample in its last ``tail`` main
    steps: ``width - 1`` promises back to back, chunk ``k`` long enough to outlast the promises
    after it and the main thread's tail (token counts measured with ``tokenizer``; tags are
    tokenized apart from text, as replay does)."""
    word = " word"
    per_word = _ntok(tokenizer, word * 8) / 8
    intro = "Intro.\n"
    promises = [f'<promise topic="p{k:02d}" tokens="10"/>' for k in range(1, width)]
    ends, at = [], _ntok(tokenizer, intro)
    for p in promises:
        at += _ntok(tokenizer, p)
        ends.append(at)
    tail_words = math.ceil(tail / per_word)
    main_end = at + _ntok(tokenizer, word * tail_words)
    parts = [intro]
    for p, e in zip(promises, ends):
        need = main_end - e + 8  # tokens the chunk must still sample when the tail ends
        parts.append(p + "<async>" + word * math.ceil(need / per_word) + "</async>")
    parts.append(word * tail_words + "<sync/> Done.")
    return "".join(parts)


def _engine_kind() -> str:
    try:
        import pasta_engine.engine.llm_engine  # noqa: F401
    except ImportError:
        return "flat"  # before the layered core (one Scheduler.step does everything)
    return "layered"


def _timer(store: dict, key: str, fn):
    def wrapped(*a, **k):
        t = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            store[key] = store.get(key, 0.0) + time.perf_counter() - t

    return wrapped


def load_engine(model_dir: Path):
    """An engine over the benchmark model (torch backend, CPU, float32, 64 MiB of KV)."""
    import torch

    from pasta_engine import Engine

    return Engine.from_pretrained(str(model_dir), device="cpu", dtype=torch.float32, kv_cache_bytes=64 * 2**20)


def _replay_params(logprobs: bool) -> dict:
    """``add_request``'s params: None (the replay default) or logprobs on."""
    if not logprobs:
        return {}
    from pasta_engine import SamplingParams

    return {"params": SamplingParams(max_new_tokens=1, return_logprobs=True)}


def run_width(engine, width: int, tail: int = 64, logprobs: bool = False) -> list[dict]:
    """Replay the scenario at ``width`` live threads; one record per step where every thread
    sampled: wall seconds of the whole step and its split (see the module docstring)."""
    tok = engine.tokenizer
    n_req = max(1, width // THREADS_PER_REQUEST)
    per_req = width // n_req
    resp = trace(tok, per_req, tail)
    prompt = tok.encode("Give me some tips.", add_special_tokens=False)
    records: list[dict] = []
    cur: dict = {}
    if _engine_kind() == "layered":
        from pasta_engine import Limits

        sched = engine.scheduler
        runner = engine.model_runner
        # the runner's own module (engine/ before issue 32's folders, worker/ after), so an older checkout works too
        runner_module = sys.modules[type(runner).__module__]
        native = "plan_s" in getattr(getattr(runner_module, "StepProfile", None), "__dataclass_fields__", {})
        patched = []
        if not native:
            for obj, name, key in ((sched, "schedule", "schedule"), (sched, "postprocess", "interp"),
                                   (runner.backend, "plan", "plan"), (runner, "_sample", "sample"),
                                   (runner.model, "forward", "forward")):
                setattr(obj, name, _timer(cur, key, getattr(obj, name)))
                patched.append((obj, name))
        engine.profile = []
        for _ in range(n_req):
            engine.add_request(prompt, annotated_response=resp, limits=Limits(max_threads=per_req),
                               **_replay_params(logprobs), **_final_only(engine))
        chosen: list[int] = []  # indices (in this replay's steps) of the recorded steps
        try:
            k = -1
            while engine.has_unfinished_requests():
                k += 1
                cur.clear()
                n_prof = len(engine.profile)
                t = time.perf_counter()
                engine.step()
                total = time.perf_counter() - t
                if len(engine.profile) == n_prof:
                    continue
                p = engine.profile[-1]
                if p.sampled != width or p.sequences != width:
                    continue
                rec = {"step": total}
                if native:
                    rec.update({k2: getattr(p, f"{k2}_s") for k2 in SPLIT})
                else:
                    rec.update({k2: cur.get(k2, 0.0) for k2 in SPLIT})
                records.append(rec)
                chosen.append(k)
        finally:
            engine.profile = None
            for obj, name in patched:
                delattr(obj, name)
        # the same replay again with the profile off (as a user runs it): replay is
        # deterministic, so step k is the same step; its wall time is "step_unprofiled"
        for _ in range(n_req):
            engine.add_request(prompt, annotated_response=resp, limits=Limits(max_threads=per_req),
                               **_replay_params(logprobs), **_final_only(engine))
        walls: list[float] = []
        while engine.has_unfinished_requests():
            t = time.perf_counter()
            engine.step()
            walls.append(time.perf_counter() - t)
        for rec, k in zip(records, chosen):
            rec["step_unprofiled"] = walls[k]
    else:
        from pasta_engine import SamplingParams
        from pasta_engine.interpreter import Limits
        from pasta_engine.scheduler import Scheduler

        engine.limits = Limits(max_threads=per_req)
        orig_step = Scheduler.step
        orig_plan = engine.backend.plan
        orig_fwd = engine.model.forward
        engine.backend.plan = _timer(cur, "plan", orig_plan)
        engine.model.forward = _timer(cur, "forward", orig_fwd)

        def step(self):
            cur.clear()
            n_prof = len(self.profile)
            t = time.perf_counter()
            out = orig_step(self)
            total = time.perf_counter() - t
            if len(self.profile) > n_prof:
                p = self.profile[-1]
                if p.sampled == width and getattr(p, "sequences", getattr(p, "rows", None)) == width:
                    records.append({"step": total, "plan": cur.get("plan", 0.0), "forward": cur.get("forward", 0.0)})
            return out

        Scheduler.step = step
        engine.profile = []
        try:
            engine.replay([prompt] * n_req, [resp] * n_req, params=SamplingParams(max_new_tokens=1))
        finally:
            Scheduler.step = orig_step
            engine.profile = None
            del engine.backend.plan
            del engine.model.forward
    return records


def summarize(records: list[dict]) -> dict:
    """Medians in microseconds over the records (``other_us``: step minus the split's medians)."""
    if not records:
        return {"steps": 0}
    out = {"steps": len(records), "step_us": 1e6 * statistics.median(r["step"] for r in records)}
    if "step_unprofiled" in records[0]:
        out["step_unprofiled_us"] = 1e6 * statistics.median(r["step_unprofiled"] for r in records)
    parts = 0.0
    for k in SPLIT:
        if k in records[0]:
            out[f"{k}_us"] = 1e6 * statistics.median(r[k] for r in records)
            parts += out[f"{k}_us"]
    if parts:
        out["other_us"] = out["step_us"] - parts
    return out


def engine_info() -> dict:
    """Which pasta_engine ran: its folder, git commit, and whether the checkout was dirty."""
    import pasta_engine

    root = Path(pasta_engine.__file__).resolve().parents[1]
    info = {"engine_path": str(root), "engine_kind": _engine_kind()}
    try:
        info["engine_commit"] = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"],
                                               capture_output=True, text=True, timeout=20).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=20).stdout.strip()
        info["engine_dirty_files"] = dirty.splitlines()
    except (OSError, subprocess.TimeoutExpired):
        pass
    return info


def machine_info() -> str:
    """The CPU model and the platform."""
    import platform

    model = platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), model)
    except OSError:
        pass
    return f"{model}; {platform.platform()}"


def torch_threads() -> int:
    import torch

    return torch.get_num_threads()


# --------------------------------------------------------------------------- pytest-benchmark


@pytest.fixture(scope="module")
def host_engine(tmp_path_factory):
    return load_engine(build_model(tmp_path_factory.mktemp("host-bench-model")))


@pytest.mark.parametrize("width", WIDTHS)
def test_host_step(benchmark, host_engine, width):
    run_width(host_engine, width)  # warm-up
    records: list[dict] = []
    benchmark.pedantic(lambda: records.extend(run_width(host_engine, width)), rounds=3, iterations=1)
    benchmark.extra_info.update(width=width, load_average_1m=os.getloadavg()[0], **summarize(records))


# --------------------------------------------------------------------------- script


def wait_for_quiet(max_load: float, wait_s: float, every_s: float = 300.0) -> float:
    """Wait until the 1-minute load average is below ``max_load`` (or ``wait_s`` has passed);
    returns the load average seen last."""
    deadline = time.time() + wait_s
    load = os.getloadavg()[0]
    while load >= max_load and time.time() < deadline:
        print(f"load average {load:.2f} >= {max_load}: waiting", flush=True)
        time.sleep(min(every_s, max(1.0, deadline - time.time())))
        load = os.getloadavg()[0]
    return load


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", default=",".join(map(str, WIDTHS)))
    ap.add_argument("--repeats", type=int, default=3, help="replays per width (after one warm-up)")
    ap.add_argument("--tail", type=int, default=64, help="steps per replay where every thread samples")
    ap.add_argument("--name", default="host_step_cpu")
    ap.add_argument("--out", type=Path, default=None, help="JSON path (default: bench/results/<name>.json)")
    ap.add_argument("--overwrite", action="store_true",
                    help="replace the output file when it exists (default: keep it, write <name>-2.json, ...)")
    ap.add_argument("--model-dir", default="/tmp/pasta-bench-host-model")
    ap.add_argument("--max-load", type=float, default=None, help="wait for a 1-minute load average below this")
    ap.add_argument("--wait-s", type=float, default=3600.0)
    ap.add_argument("--worktree", type=Path, default=None,
                    help="import pasta_engine from this checkout (default: the one on the path)")
    ap.add_argument("--logprobs", action="store_true", help="replay with return_logprobs=True (the sampler runs)")
    args = ap.parse_args()
    if args.worktree is not None:
        sys.path.insert(0, str(args.worktree.resolve()))
    from common import device_info, write_json

    engine = load_engine(build_model(args.model_dir))
    load_before = wait_for_quiet(args.max_load, args.wait_s) if args.max_load else os.getloadavg()[0]
    rows = []
    for w in (int(x) for x in args.threads.split(",")):
        run_width(engine, w, args.tail, args.logprobs)  # warm-up
        recs: list[dict] = []
        for _ in range(args.repeats):
            recs += run_width(engine, w, args.tail, args.logprobs)
        row = {"threads": w, **summarize(recs)}
        print(row, flush=True)
        rows.append(row)
    write_json(args.name, {
        **device_info(), **engine_info(), "machine": machine_info(), "command": " ".join([sys.executable, *sys.argv]),
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"), "torch_threads": torch_threads(),
        "cpu_affinity": sorted(os.sched_getaffinity(0)), "cpu_count": os.cpu_count(),
        "load_average_1m_start": load_before, "load_average_end": list(os.getloadavg()),
        "model": {"preset": "tiny-llama", **MODEL_OVERRIDES}, "attention_backend": "torch",
        "threads_per_request": THREADS_PER_REQUEST, "tail": args.tail, "repeats": args.repeats,
        "return_logprobs": args.logprobs,
        "statistic": "median over the steps where every live thread sampled", "results": rows,
    }, overwrite=args.overwrite, out=args.out)


if __name__ == "__main__":
    main()
