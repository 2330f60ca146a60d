"""Tree decode attention at PASTA shapes vs the physical limit and peers (GPU only).

One request: a shared prefix of P tokens, then T threads (the main thread and T-1 forked
children) with S private tokens each; one query per thread. For each shape we time (median of
``triton.testing.do_bench``, L2 flushed) our tree kernel, our plain per-thread kernel, torch
SDPA per thread over a dense copy of each thread's context, and FlashInfer's
``MultiLevelCascadeAttentionWrapper`` (prefix level + per-thread level) when it imports.

Bytes actually read by the tree kernel: the prefix once plus every private suffix (K and V,
valid tokens only) plus q and the output; GB/s = bytes / time, reported as a fraction of the
measured device-to-device copy bandwidth (bench.common.copy_bandwidth).

Usage: ``python bench/bench_tree_attention.py [--quick]`` -> bench/results/tree_attention_<gpu>.json
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import bench_us, copy_bandwidth, device_info, write_json  # noqa: E402

from pasta_engine.engine.block_manager import BlockManager, KVView  # noqa: E402
from pasta_engine.triton_kernels.tree_attention import build_plan, tree_decode_attention  # noqa: E402

SHAPES = {"llama3-8b": (32, 8, 128), "smollm2-135m": (9, 3, 64)}
PAGE = 16


def make_forest(threads: int, prefix: int, suffix: int, hkv: int, d: int):
    """Pages of a prefix shared by ``threads`` threads that each own a suffix, and one layer's
    K and V caches ``[pages, PAGE, hkv, d]`` bf16 filled with noise."""
    pages = (prefix + threads * (suffix + PAGE)) // PAGE + 4
    bm = BlockManager(pages, PAGE)
    main = KVView()
    bm.append(main, prefix)
    views = [main] + [bm.fork(main) for _ in range(threads - 1)]
    for v in views:
        bm.append(v, suffix)
    k = torch.randn(pages, PAGE, hkv, d, dtype=torch.bfloat16, device="cuda")
    v = torch.randn(pages, PAGE, hkv, d, dtype=torch.bfloat16, device="cuda")
    return (k, v), views


def flashinfer_cascade(q, k, v, views, prefix_pages, hq, hkv, d):
    """A callable running FlashInfer's two-level cascade on the same paged cache, or the reason
    it cannot run."""
    try:
        import flashinfer
    except Exception as e:  # not installed, or its import fails (JIT, CUDA mismatch)
        return None, f"import flashinfer failed: {type(e).__name__}: {e}"
    try:
        n = len(views)
        dev = q.device
        i32 = dict(dtype=torch.int32, device=dev)
        ws = torch.empty(256 * 2**20, dtype=torch.uint8, device=dev)
        wrapper = flashinfer.MultiLevelCascadeAttentionWrapper(2, ws, "NHD")
        own = [vw.pages[prefix_pages:] for vw in views]
        wrapper.plan(
            [torch.tensor([0, n], **i32), torch.arange(n + 1, **i32)],
            [torch.tensor([0, prefix_pages], **i32),
             torch.tensor([0] + [sum(len(o) for o in own[: i + 1]) for i in range(n)], **i32)],
            [torch.tensor(views[0].pages[:prefix_pages], **i32), torch.tensor([p for o in own for p in o], **i32)],
            [torch.tensor([PAGE], **i32), torch.tensor([vw.lens[-1] for vw in views], **i32)],
            hq, hkv, d, PAGE,
        )
        return (lambda: wrapper.run(q, (k, v))), None
    except Exception as e:
        return None, f"flashinfer cascade failed: {type(e).__name__}: {str(e)[:300]}"


def run_case(name, threads, prefix, suffix, bw):
    hq, hkv, d = SHAPES[name]
    (k, v), views = make_forest(threads, prefix, suffix, hkv, d)
    q = torch.randn(threads, hq, d, dtype=torch.bfloat16, device="cuda")
    scale = d**-0.5
    pv = [[(s.id, s.pages, s.lens) for s in vw.segments] for vw in views]
    tree = build_plan(pv, group=hq // hkv, num_kv_heads=hkv, device="cuda", mode="tree")
    plain = build_plan(pv, group=hq // hkv, num_kv_heads=hkv, device="cuda", mode="plain")
    out_tree = tree_decode_attention(q, k, v, tree, scale)
    out_plain = tree_decode_attention(q, k, v, plain, scale)
    torch.testing.assert_close(out_tree.float(), out_plain.float(), rtol=2e-2, atol=2e-2)

    dense = []
    flat = k.view(-1, hkv, d)
    for vw in views:
        slots = torch.tensor([p * PAGE + o for p, n in zip(vw.pages, vw.lens) for o in range(n)], device="cuda")
        dense.append((flat[slots].transpose(0, 1)[None].contiguous(), v.reshape(-1, hkv, d)[slots].transpose(0, 1)[None].contiguous()))

    def sdpa():
        for i, (kd, vd) in enumerate(dense):
            torch.nn.functional.scaled_dot_product_attention(q[i : i + 1, :, None], kd, vd, scale=scale, enable_gqa=True)

    res = {"shape": name, "hq": hq, "hkv": hkv, "head_dim": d, "threads": threads, "prefix": prefix, "suffix": suffix,
           "tree_us": bench_us(lambda: tree_decode_attention(q, k, v, tree, scale)),
           "plain_us": bench_us(lambda: tree_decode_attention(q, k, v, plain, scale)),
           "sdpa_per_thread_us": bench_us(sdpa),
           "tree_separate_merge_us": bench_us(lambda: tree_decode_attention(q, k, v, tree, scale, merge="separate")),
           "tree_work_items": tree.n_work, "plain_work_items": plain.n_work}
    prefix_pages = prefix // PAGE
    fi, why = flashinfer_cascade(q, k, v, views, prefix_pages, hq, hkv, d)
    if fi is not None:
        torch.testing.assert_close(fi().float(), out_tree.float(), rtol=2e-2, atol=2e-2)
        res["flashinfer_cascade_us"] = bench_us(fi)
    else:
        res["flashinfer_cascade"] = why
    tok_bytes = 2 * hkv * d * 2  # K and V, bf16
    io = 2 * threads * hq * d * 2
    res["tree_bytes"] = (prefix + threads * suffix) * tok_bytes + io
    res["plain_bytes"] = threads * (prefix + suffix) * tok_bytes + io
    res["tree_gbps"] = res["tree_bytes"] / res["tree_us"] / 1e3
    res["tree_pct_of_copy_bw"] = 100 * res["tree_bytes"] / (res["tree_us"] / 1e6) / bw
    res["speedup_vs_plain"] = res["plain_us"] / res["tree_us"]
    res["speedup_vs_sdpa"] = res["sdpa_per_thread_us"] / res["tree_us"]
    if "flashinfer_cascade_us" in res:
        res["speedup_vs_flashinfer"] = res["flashinfer_cascade_us"] / res["tree_us"]
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="a few shapes only")
    ap.add_argument("--overwrite", action="store_true", help="replace an existing result (default: a new -2 file)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_tree_attention needs a CUDA GPU")
    info = device_info()
    bw = copy_bandwidth()
    print(f"{info['device']}: measured copy bandwidth {bw / 1e12:.2f} TB/s")
    rows = []
    threads_list = [1, 2, 4, 8, 16] if not args.quick else [1, 16]
    prefixes = [256, 1024, 4096, 16384] if not args.quick else [4096, 16384]
    suffixes = [32, 512] if not args.quick else [128]
    for name in SHAPES:
        for t in threads_list:
            for p in prefixes:
                for s in suffixes:
                    r = run_case(name, t, p, s, bw)
                    rows.append(r)
                    print(f"{name} T={t} P={p} S={s}: tree {r['tree_us']:.1f} us ({r['tree_pct_of_copy_bw']:.0f}% of copy bw), "
                          f"plain {r['plain_us']:.1f}, sdpa {r['sdpa_per_thread_us']:.1f}, "
                          f"flashinfer {r.get('flashinfer_cascade_us', r.get('flashinfer_cascade'))}", flush=True)
    tag = info["device"].replace(" ", "_").replace("/", "_")
    write_json(f"tree_attention_{tag}", {"device": info, "copy_bandwidth_bytes_per_s": bw, "dtype": "bfloat16",
                                         "page_size": PAGE, "rows": rows},
               overwrite=args.overwrite)


if __name__ == "__main__":
    main()
