"""Tree decode attention at PASTA shapes vs the physical limit and peers (GPU): the grid the GPU
script runs, through ``pasta-engine bench kernels``' measurement
(:func:`pasta_engine.tools.bench_kernels.bench_tree_attention`: our tree kernel, the same kernel
per thread, torch SDPA per thread over dense copies, FlashInfer's cascade when it imports; all
checked against a float32 reference, then timed with do_bench, L2 flushed; median, p10, p90;
the tree kernel's bytes against the measured copy bandwidth).

For one shape of your own, use the command: ``pasta-engine bench kernels --threads 8 --prefix
4096 --suffix 128 --out f.json``.

Usage: ``python bench/bench_tree_attention.py [--quick]`` -> bench/results/tree_attention_<gpu>.json
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import device_info, write_json  # noqa: E402

from pasta_engine.tools.bench_kernels import KernelShape, bench_tree_attention  # noqa: E402

SHAPES = {"llama3-8b": (32, 8, 128), "smollm2-135m": (9, 3, 64)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="a few shapes only")
    ap.add_argument("--overwrite", action="store_true", help="replace an existing result (default: a new -2 file)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_tree_attention needs a CUDA GPU (on the CPU: pasta-engine bench kernels --device cpu "
                         "checks the kernels under the interpreter)")
    info = device_info()
    rows = []
    threads_list = [1, 2, 4, 8, 16] if not args.quick else [1, 16]
    prefixes = [256, 1024, 4096, 16384] if not args.quick else [4096, 16384]
    suffixes = [32, 512] if not args.quick else [128]
    for name, (hq, hkv, d) in SHAPES.items():
        for t in threads_list:
            for p in prefixes:
                for s in suffixes:
                    r = bench_tree_attention(KernelShape(t, p, s, hq, hkv, d), device="cuda")
                    r["model_shape"] = name
                    rows.append(r)
                    ks = r["kernels"]
                    print(f"{name} T={t} P={p} S={s}: tree {ks['tree']['median_us']:.1f} us "
                          f"({100 * r['tree_fraction_of_copy_bandwidth']:.0f}% of copy bw), "
                          + ", ".join(f"{n} {k['median_us']:.1f}" for n, k in ks.items() if n != "tree")
                          + (f"; flashinfer: {r['flashinfer_cascade']}" if "flashinfer_cascade" in r else ""),
                          flush=True)
    tag = info["device"].replace(" ", "_").replace("/", "_")
    write_json(f"tree_attention_{tag}", {"device": info, "dtype": "bfloat16", "page_size": 16, "rows": rows},
               overwrite=args.overwrite)


if __name__ == "__main__":
    main()
