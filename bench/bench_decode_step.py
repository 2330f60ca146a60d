"""Full-model decode step at widths 1-16, with and without CUDA graphs, vs the roofline (GPU).

For each model shape (random weights at SmolLM2-135M's and Llama-3-8B's published configs,
built once by :func:`pasta_engine.tools.presets.build_checkpoint` and loaded through the normal
loader) and each width W, the engine replays a synthetic annotated response whose main thread
forks W-1 chunks right away, so W threads decode together for most steps. Every step is
profiled (:class:`pasta_engine.worker.model_runner.StepProfile`); we report, over the steps that sampled
exactly W rows, the median step time, host time (everything but waiting for the GPU) and the
roofline ``(weight bytes + distinct KV bytes read) / measured copy bandwidth``.

Usage: ``python bench/bench_decode_step.py [--models smollm2-135m,llama-3-8b] [--widths 1,2,4,8,16]``
-> bench/results/decode_step_<gpu>.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import copy_bandwidth, device_info, write_json  # noqa: E402

from pasta_engine import Engine, Limits  # noqa: E402
from pasta_engine.worker.model_runner import kv_bytes_per_token  # noqa: E402
from pasta_engine.lang.tags import promise_tag  # noqa: E402
from pasta_engine.tools.presets import build_checkpoint  # noqa: E402


def synthetic_trace(width: int, chunk: int) -> str:
    """Main text that forks ``width - 1`` chunks at once, each ``chunk`` words long, and then
    writes ``chunk`` words itself."""
    body = " ".join(["word"] * chunk)
    forks = "".join(f"{i}. " + promise_tag(f"part {i}", chunk) + "<async>" + body + "</async>\n" for i in range(width - 1))
    return "Intro.\n" + forks + body + "\n<sync/>Done."


def measure(engine: Engine, width: int, prompt_len: int, chunk: int, bw: float) -> dict:
    c = engine.model.config
    prompt = [[(17 * i) % (c.vocab_size - 3) + 3 for i in range(prompt_len)]]
    trace = synthetic_trace(width, chunk)
    engine.replay(prompt, [trace])  # warm-up: compiles kernels, captures graphs
    engine.profile = []
    [res] = engine.replay(prompt, [trace])
    steps = [p for p in engine.profile if p.sampled == width and p.sequences == width]
    engine.profile = None
    if not steps:
        return {"width": width, "error": "no step ran at this width"}
    per_tok = kv_bytes_per_token(c.num_layers, c.num_kv_heads, c.head_dim, engine.model.dtype)
    kv_tokens = statistics.median(p.kv_tokens for p in steps)
    floor_s = (engine.model.weight_bytes + kv_tokens * per_tok) / bw
    total = statistics.median(p.total_s for p in steps)
    return {
        "width": width, "steps": len(steps), "graphed_steps": sum(p.graphed for p in steps),
        "step_ms": 1e3 * total, "host_ms": 1e3 * statistics.median(p.host_s for p in steps),
        "gpu_wait_ms": 1e3 * statistics.median(p.gpu_wait_s for p in steps),
        "kv_tokens_read": kv_tokens, "weight_bytes": engine.model.weight_bytes,
        "roofline_ms": 1e3 * floor_s, "x_roofline": total / floor_s,
        "decode_steps": res.stats.decode_steps, "critical_path": res.stats.critical_path,
    }


def widths_list(text: str) -> list[int]:
    """argparse type of ``--widths``: comma-separated integers >= 1, at least one (checked while
    the flags are parsed, before the bandwidth, checkpoint and engine work)."""
    parts = [p.strip() for p in text.split(",")]
    try:
        widths = [int(p) for p in parts]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers >= 1, got {text!r}") from None
    if not widths or any(w < 1 for w in widths):
        raise argparse.ArgumentTypeError(f"expected comma-separated integers >= 1, got {text!r}")
    return widths


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="smollm2-135m,llama-3-8b")
    ap.add_argument("--widths", type=widths_list, default="1,2,4,8,16",
                    help="comma-separated thread counts, each >= 1 (default 1,2,4,8,16)")
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--chunk", type=int, default=96, help="words per chunk (and of the main thread)")
    ap.add_argument("--overwrite", action="store_true", help="replace an existing result (default: a new -2 file)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_decode_step needs a CUDA GPU")
    info = device_info()
    bw = copy_bandwidth()
    rows = []
    for name in args.models.split(","):
        path = build_checkpoint(name, dtype=torch.bfloat16)
        for graphs in (False, True):
            engine = Engine.from_pretrained(path, device="cuda", dtype=torch.bfloat16, attention_backend="triton",
                                            cuda_graphs=graphs, limits=Limits(max_threads=None, max_forks=64),
                                            kv_cache_bytes=8 * 2**30)
            for w in args.widths:
                r = {"model": name, "cuda_graphs": graphs, **measure(engine, w, args.prompt_len, args.chunk, bw)}
                rows.append(r)
                print(r, flush=True)
            del engine
            torch.cuda.empty_cache()
    tag = info["device"].replace(" ", "_").replace("/", "_")
    write_json(f"decode_step_{tag}", {"device": info, "copy_bandwidth_bytes_per_s": bw, "dtype": "bfloat16",
                                      "prompt_len": args.prompt_len, "chunk_words": args.chunk, "rows": rows},
               overwrite=args.overwrite)


if __name__ == "__main__":
    main()
