"""Microbenchmark of the CUDA C++ extension's ops (GPU only).

    python bench/bench_csrc_ops.py [--dtype bfloat16] [--splits 8] [--out bench/results/...json]

Times, at T in {1, 16, 64} new tokens and the head shapes of Llama-3-8B (32 q / 8 KV heads,
D=128) and SmolLM2-135M (9 / 3, D=64):

* ``rope_kv_write``: the extension (``pasta_engine.layers.csrc_ops.rope_kv_write``) against the torch
  default (``AttentionBackend.rope_and_write``: 2 RoPEs + 2 ``index_copy_``) and the Triton
  kernel (``pasta_engine.triton_kernels.kv_write.rope_and_write``, when importable);
* ``lse_merge`` of ``--splits`` partials per row (R = T rows, H = Hq heads): the extension
  against ``csrc_ops.lse_merge_reference`` (general CSR form, syncs with the host) and a dense
  torch softmax-weighted sum over the splits (what torch code does when every row has the same
  number of splits).

Each is timed by ``triton.testing.do_bench`` (median, L2 flushed before each run; "eager": what
a step pays when it launches the op itself, launch gaps included) and, where the op can be
captured, by ``triton.testing.do_bench_cudagraph`` ("graph": replayed from a CUDA graph, GPU
time only). Results (device, versions, shapes, median microseconds, bytes moved, achieved
GB/s against docs/DESIGN.md's measured copy bandwidth: H100 ~3.0 TB/s, H200 ~4.3 TB/s) go to
``bench/results/csrc_ops_<device>.json`` and a table to stdout. Every implementation is
checked against the reference before it is timed.

Needs the extension built: ``cmake -S . -B build -DPython3_EXECUTABLE=$(which python) &&
cmake --build build -j`` (see CMakeLists.txt).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
MODELS = {"llama-3-8b": (32, 8, 128), "smollm2-135m": (9, 3, 64)}
TOKENS = (1, 16, 64)
PAGE_SIZE = 16
NUM_PAGES = 4096


def _time_us(fn, graph: bool) -> float:
    """Median microseconds of ``fn()`` (triton.testing; CUDA events if triton is missing)."""
    try:
        import triton.testing as tt
    except ImportError:
        tt = None
    if tt is not None:
        if graph:
            return 1e3 * tt.do_bench_cudagraph(fn, rep=100, return_mode="median")
        return 1e3 * tt.do_bench(fn, warmup=25, rep=100, return_mode="median")
    for _ in range(10):
        fn()
    if graph:
        g = torch.cuda.CUDAGraph()
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            fn()
        torch.cuda.current_stream().wait_stream(s)
        with torch.cuda.graph(g):
            fn()
        fn = g.replay
    times = []
    for _ in range(200):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(1e3 * a.elapsed_time(b))
    return sorted(times)[len(times) // 2]


def _rope_inputs(t: int, hq: int, hkv: int, d: int, dtype: torch.dtype, seed: int = 0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    qkv = torch.randn(t, (hq + 2 * hkv) * d, device="cuda", dtype=dtype, generator=g)  # fused projection output
    q = qkv[:, : hq * d].unflatten(1, (hq, d))
    k = qkv[:, hq * d : (hq + hkv) * d].unflatten(1, (hkv, d))
    v = qkv[:, (hq + hkv) * d :].unflatten(1, (hkv, d))
    pos = torch.randint(0, 8192, (t,), device="cuda", generator=g).float()
    inv_freq = 1.0 / (500000.0 ** (torch.arange(0, d, 2, device="cuda").float() / d))
    emb = torch.cat([pos[:, None] * inv_freq] * 2, -1)
    cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
    kv = torch.zeros(2, NUM_PAGES, PAGE_SIZE, hkv, d, device="cuda", dtype=dtype)  # one layer, K and V
    slots = torch.randperm(NUM_PAGES * PAGE_SIZE, device="cuda", generator=g)[:t]
    return q, k, v, cos, sin, kv, slots


def _rope_bytes(t, hq, hkv, d, es) -> int:
    return (t * (hq + 2 * hkv) * d * es  # read q, k, v
            + 2 * t * d * es  # read cos, sin
            + t * hq * d * es + 2 * t * hkv * d * es  # write q_out, k and v slots
            + 8 * t)  # slot_mapping


def _merge_inputs(r: int, h: int, d: int, splits: int, dtype: torch.dtype, seed: int = 0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    s = r * splits
    part_o = torch.randn(s, h, d, device="cuda", generator=g)
    part_lse = 5 * torch.randn(s, h, device="cuda", generator=g)
    row_indptr = (torch.arange(r + 1, device="cuda") * splits).to(torch.int32)
    row_parts = torch.arange(s, device="cuda", dtype=torch.int32)
    out = torch.empty(r, h, d, device="cuda", dtype=dtype)
    out_lse = torch.empty(r, h, device="cuda")
    return part_o, part_lse, row_indptr, row_parts, out, out_lse


def _merge_bytes(r, h, d, splits, es) -> int:
    s = r * splits
    return s * h * d * 4 + s * h * 4 + r * h * d * es + r * h * 4 + (r + 1) * 4 + s * 4


def _merge_dense(part_o, part_lse, r, splits, out, out_lse):
    """torch, every row with `splits` consecutive partials: softmax over the splits' LSE."""
    lse = part_lse.view(r, splits, -1)
    w = torch.softmax(lse, dim=1)
    out.copy_((w[..., None] * part_o.view(r, splits, *part_o.shape[1:])).sum(1))
    out_lse.copy_(torch.logsumexp(lse, dim=1))


def _measure(label: dict, fn, bytes_moved: int, graph_ok: bool, rows: list, err: float) -> None:
    for mode in ("eager", "graph") if graph_ok else ("eager",):
        try:
            us = _time_us(fn, graph=mode == "graph")
        except Exception as e:  # e.g. an op that cannot be captured: record why, keep going
            rows.append({**label, "mode": mode, "error": f"{type(e).__name__}: {e}"[:300]})
            continue
        rows.append({**label, "mode": mode, "median_us": round(us, 3), "bytes": bytes_moved,
                     "gb_per_s": round(bytes_moved / (us * 1e-6) / 1e9, 2), "max_abs_err": err})


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--splits", type=int, default=8, help="partials per row for lse_merge")
    ap.add_argument("--out", type=Path, default=None,
                    help="JSON path (default bench/results/csrc_ops_<device>.json; an existing file is kept and the "
                    "result goes to a new -2, -3, ... file beside it unless --overwrite)")
    ap.add_argument("--overwrite", action="store_true", help="replace the output file when it exists")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_csrc_ops: needs a CUDA GPU (run it on the GPU machine)", file=sys.stderr)
        return 2
    from pasta_engine.layers import csrc_ops
    from pasta_engine.layers.reference_attention import TorchAttention

    if not csrc_ops.available():
        print(f"bench_csrc_ops: the extension is not available: {csrc_ops.unavailable_reason()}\n"
              f"build it first: {csrc_ops.BUILD_COMMAND}", file=sys.stderr)
        return 2
    try:
        from pasta_engine.triton_kernels.kv_write import rope_and_write as triton_rope_and_write
        triton_note = ""
    except Exception as e:  # written concurrently by another engineer; bench what exists
        triton_rope_and_write, triton_note = None, f"{type(e).__name__}: {e}"
    dtype = getattr(torch, args.dtype)
    es = torch.tensor([], dtype=dtype).element_size()
    torch_backend = TorchAttention()
    rows: list[dict] = []
    t0 = time.perf_counter()

    for model, (hq, hkv, d) in MODELS.items():
        for t in TOKENS:
            q, k, v, cos, sin, kv, slots = _rope_inputs(t, hq, hkv, d, dtype)
            kc, vc = kv[0], kv[1]
            kv_ref = kv.clone()
            q_ref = csrc_ops.rope_kv_write_reference(q, k, v, cos, sin, kv_ref[0], kv_ref[1], slots)
            impls = {
                "csrc": lambda: csrc_ops.rope_kv_write(q, k, v, cos, sin, kc, vc, slots),
                "torch": lambda: torch_backend.rope_and_write(q, k, v, cos, sin, kc, vc, slots),
            }
            if triton_rope_and_write is not None:
                impls["triton"] = lambda: triton_rope_and_write(q, k, v, cos, sin, kc, vc, slots)
            label = dict(op="rope_kv_write", model=model, T=t, Hq=hq, Hkv=hkv, D=d, dtype=args.dtype)
            for name, fn in impls.items():
                kv.zero_()
                q_out = fn()
                torch.cuda.synchronize()
                err = max(float((q_out.float() - q_ref.float()).abs().max()),
                          float((kv.float() - kv_ref.float()).abs().max()))
                if err > 0.1:
                    raise SystemExit(f"{name} rope_kv_write disagrees with the reference at {label}: {err}")
                _measure({**label, "impl": name}, fn, _rope_bytes(t, hq, hkv, d, es), True, rows, err)

            r = t
            part_o, part_lse, indptr, rslots, out, out_lse = _merge_inputs(r, hq, d, args.splits, dtype)
            ref, ref_lse = torch.empty(r, hq, d, device="cuda"), torch.empty(r, hq, device="cuda")
            csrc_ops.lse_merge_reference(part_o, part_lse, indptr, rslots, ref, ref_lse)
            impls = {
                "csrc": (lambda: csrc_ops.lse_merge(part_o, part_lse, indptr, rslots, out, out_lse), True),
                "torch_reference": (lambda: csrc_ops.lse_merge_reference(part_o, part_lse, indptr, rslots, out,
                                                                         out_lse), False),
                "torch_dense": (lambda: _merge_dense(part_o, part_lse, r, args.splits, out, out_lse), True),
            }
            label = dict(op="lse_merge", model=model, T=t, R=r, H=hq, D=d, splits=args.splits, dtype=args.dtype)
            for name, (fn, graph_ok) in impls.items():
                out.zero_()
                fn()
                torch.cuda.synchronize()
                err = max(float((out.float() - ref).abs().max()), float((out_lse - ref_lse).abs().max()))
                if err > 0.05:
                    raise SystemExit(f"{name} lse_merge disagrees with the reference at {label}: {err}")
                _measure({**label, "impl": name}, fn, _merge_bytes(r, hq, d, args.splits, es), graph_ok, rows, err)

    import triton

    name = torch.cuda.get_device_name()
    result = {
        "command": "python bench/bench_csrc_ops.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "device": name,
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "triton": triton.__version__,
        "extension": str(csrc_ops._STATE["path"]),
        "triton_rope_and_write": "ok" if triton_rope_and_write is not None else f"not importable: {triton_note}",
        "timing": "triton.testing.do_bench (eager, median, L2 flushed) / do_bench_cudagraph (graph, median)",
        "wall_s": round(time.perf_counter() - t0, 1),
        "results": rows,
    }
    slug = re.sub(r"[^a-z0-9]+", "_", name.lower()).strip("_")
    sys.path.insert(0, str(ROOT / "bench"))
    from common import new_path

    path = new_path(args.out or ROOT / "bench" / "results" / f"csrc_ops_{slug}.json", args.overwrite)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1) + "\n")

    print(f"{'op':14} {'model':13} {'T':>3} {'impl':16} {'mode':6} {'median_us':>10} {'GB/s':>8}")
    for row in rows:
        us = f"{row['median_us']:10.2f}" if "median_us" in row else f"{'-':>10}"
        gbs = f"{row['gb_per_s']:8.1f}" if "gb_per_s" in row else row.get("error", "")[:40]
        print(f"{row['op']:14} {row['model']:13} {row['T']:>3} {row['impl']:16} {row['mode']:6} {us} {gbs}")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
