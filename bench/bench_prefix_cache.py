"""Prefix caching, measured: prompt tokens prefilled vs read from the cache, and what that does to
time to first token, for AlpacaEval instructions in pasta mode (every prompt starts with the
same chat template and PASTA-LANG system prompt).

    python bench/bench_prefix_cache.py                          # embedded SmolLM2, 16 prompts
    python bench/bench_prefix_cache.py --prompts ../shared/data/alpaca_eval/gpt4_1106_preview_outputs.json --limit 16

Two arrival patterns, each run with ``enable_prefix_caching`` off and on (a fresh engine each):
``burst`` adds every request at once (with ``--max-running`` 8, the first 8 are admitted in one
step and none of them can reuse another's prefix: a page is cached only after the forward that
wrote it); ``one_by_one`` adds each request when the previous one has finished (an interactive
user). Reported per run: prompt tokens, tokens read from the cache, prompt tokens computed,
wall seconds, time to first token (first step that returns a token for the request, from when
it was added) p50/max, and whether every response equals the caching-off one. Written to a new
``bench/results/prefix_cache_<device>[-N].json`` (an existing file is never replaced).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

def run(engine, prompts, params, pattern: str) -> dict:
    """Add the prompts (``burst``: all at once; ``one_by_one``: each after the previous ended),
    step until done; returns the numbers and the responses' token ids."""
    before = engine.stats()
    added: dict[str, float] = {}
    first: dict[str, float] = {}
    tokens: dict[str, list[int]] = {}
    order = []
    t0 = time.perf_counter()
    queue = list(prompts)
    while queue or engine.has_unfinished_requests():
        if queue and (pattern == "burst" or not engine.has_unfinished_requests()):
            batch = queue if pattern == "burst" else queue[:1]
            for p in batch:
                rid = engine.add_request(p, params, mode="pasta")
                added[rid] = time.perf_counter()
                order.append(rid)
            queue = [] if pattern == "burst" else queue[1:]
        for out in engine.step():
            now = time.perf_counter()
            if out.new_token_ids and out.request_id not in first:
                first[out.request_id] = now - added[out.request_id]
            if out.finished:
                tokens[out.request_id] = out.result.token_ids
    wall = time.perf_counter() - t0
    after = engine.stats()
    query = after["prefix_cache_query_tokens"] - before["prefix_cache_query_tokens"]
    hit = after["prefix_cache_hit_tokens"] - before["prefix_cache_hit_tokens"]
    ttft = [first[r] for r in order]
    return {
        "prompt_tokens": query,
        "cached_tokens": hit,
        "computed_prompt_tokens": query - hit,
        "saved_fraction": round(hit / query, 4) if query else 0.0,
        "wall_s": round(wall, 3),
        "ttft_s": {"p50": round(statistics.median(ttft), 3), "max": round(max(ttft), 3)},
        "kv_pages_cached": after["kv_pages_cached"],
        "evictions": after["prefix_cache_evictions"] - before["prefix_cache_evictions"],
        "pages_leaked": after["kv_pages_total"] - after["kv_pages_free"],
        "_tokens": [tokens[r] for r in order],
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=Path, default=None,
                    help="AlpacaEval model_outputs.json (its 'instruction' fields); default: 8 built-in instructions")
    ap.add_argument("--limit", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--max-running", type=int, default=8)
    ap.add_argument("--preset", default=None, help="a random-weight preset instead of the embedded SmolLM2")
    ap.add_argument("--adapter", choices=("auto", "none"), default="auto",
                    help="auto: the embedded model's shipped adapter, which was trained with a one-line system "
                    "prompt; none: the base weights, taught PASTA-LANG by the default system prompt with examples "
                    "(~530 tokens)")
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()

    from pasta_engine import Engine, SamplingParams

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from bench_server_load import PROMPTS as FALLBACK  # the load test's short prompts
    from common import RESULTS, device_info, new_path

    if args.prompts is not None:
        rows = json.loads(args.prompts.read_text())
        prompts = [r["instruction"] for r in rows][: args.limit]
    else:
        prompts = (FALLBACK * (args.limit // len(FALLBACK) + 1))[: args.limit]
    model = None
    if args.preset:
        from pasta_engine.tools.presets import build_checkpoint

        model = build_checkpoint(args.preset)
    params = SamplingParams(max_new_tokens=args.max_new_tokens)
    load = [round(x, 2) for x in os.getloadavg()]
    runs = {}
    for pattern in ("burst", "one_by_one"):
        for caching in (False, True):
            engine = Engine.from_pretrained(model, device="cpu", max_running_requests=args.max_running,
                                            page_size=args.page_size, enable_prefix_caching=caching,
                                            adapter="auto" if args.adapter == "auto" else None)
            engine.model_runner.warm_up()
            key = f"{pattern}_{'on' if caching else 'off'}"
            runs[key] = run(engine, prompts, params, pattern)
            r = runs[key]
            print(f"{key:16s} prompt tokens {r['prompt_tokens']:6d}  from cache {r['cached_tokens']:6d}  computed "
                  f"{r['computed_prompt_tokens']:6d}  wall {r['wall_s']:7.2f} s  TTFT p50 {r['ttft_s']['p50']:6.2f} s "
                  f"max {r['ttft_s']['max']:6.2f} s  leaked {r['pages_leaked']}", flush=True)
        same = runs[f"{pattern}_on"]["_tokens"] == runs[f"{pattern}_off"]["_tokens"]
        runs[f"{pattern}_on"]["same_tokens_as_off"] = same
        print(f"{pattern}: responses identical with caching on and off: {same}")
    for r in runs.values():
        r.pop("_tokens")
    info = device_info()
    out = new_path(args.out or RESULTS / f"prefix_cache_{info.get('device', 'cpu').replace(' ', '_')}.json")
    payload = {"command": " ".join([Path(sys.executable).name] + sys.argv), "time": time.strftime("%Y-%m-%d %H:%M:%S"),
               "model": args.preset or "SmolLM2-135M-Instruct (embedded)", "adapter": args.adapter,
               "prompts": len(prompts),
               "mode": "pasta", "max_new_tokens": args.max_new_tokens, "max_running_requests": args.max_running,
               "page_size": args.page_size, "cpu_count": os.cpu_count(), "load_average_before": load,
               "load_average_after": [round(x, 2) for x in os.getloadavg()], **info, "runs": runs}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(payload, indent=1))
    print(f"wrote {out} (load average before {load})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
