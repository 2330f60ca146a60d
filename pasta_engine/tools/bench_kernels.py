"""``pasta-engine bench kernels``: the tree decode attention kernel at shapes the user sets,
checked against a reference and timed against its peers and the physical limit.

One request: a shared prefix of ``prefix`` tokens, then ``threads`` threads (the main thread and
its forked children) with ``suffix`` private tokens each, one query per thread, in a paged KV
cache (:class:`~pasta_engine.core.block_manager.BlockManager`). Measured:

- ``tree``: :func:`~pasta_engine.triton_kernels.tree_attention.tree_decode_attention` with the
  tree plan (the shared prefix read once for all threads);
- ``plain``: the same kernel with every row alone (the prefix read once per thread);
- ``sdpa_per_thread``: torch's ``scaled_dot_product_attention`` per thread over a dense copy of
  its context (the reference the outputs are checked against);
- ``flashinfer_cascade``: FlashInfer's ``MultiLevelCascadeAttentionWrapper`` (prefix level +
  per-thread level, from the views' true page lengths: :func:`cascade_levels`), the best peer
  for a shared prefix, when it imports (GPU).

Per kernel: median, p10 and p90 (interpolated within the measured times), min and max
microseconds over ``repeats`` timed calls after ``warmup``
calls (on a GPU ``triton.testing.do_bench``'s CUDA events with the L2 cache flushed, which reads
``warmup`` and ``repeats`` as milliseconds; the record's ``repeats_unit`` says which, and each
kernel's ``calls`` how many were timed); the bytes the
tree kernel must read (prefix once + every suffix, K and V, plus queries and outputs) and its
bandwidth as a fraction of the measured device-to-device copy bandwidth (the physical limit).

On a CPU the kernels run under Triton's interpreter (``TRITON_INTERPRET=1``, set when the
package is imported without a GPU): the run checks the kernels against the reference at small
shapes and its times are the interpreter's, not a performance figure (the record says so).
Bfloat16 is refused there (``tl.dot`` in bf16 is wrong under the interpreter); use float16 or
float32.
"""

from __future__ import annotations

import itertools
import statistics
import time
from dataclasses import asdict, dataclass
from typing import Any, Callable, Sequence

import torch

from ..errors import ParameterError

__all__ = ["KernelShape", "bench_tree_attention", "cascade_levels", "copy_bandwidth"]

_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


@dataclass(frozen=True)
class KernelShape:
    """One benchmark case: ``threads`` rows (one query each) over a shared ``prefix`` and a
    private ``suffix`` per thread (tokens); ``heads`` query heads, ``kv_heads`` KV heads (the
    GQA group is their ratio), ``head_dim``; ``page_size`` tokens per KV page; ``dtype`` one of
    float16, bfloat16, float32.

    Raises ParameterError naming the field for a value < 1 (``prefix`` and ``suffix`` may be 0,
    not both), heads not a multiple of kv_heads, or an unknown dtype."""

    threads: int = 8
    prefix: int = 4096
    suffix: int = 128
    heads: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    page_size: int = 16
    dtype: str = "bfloat16"

    def __post_init__(self) -> None:
        for name in ("threads", "heads", "kv_heads", "head_dim", "page_size"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ParameterError(name, v, "an integer >= 1")
        for name in ("prefix", "suffix"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ParameterError(name, v, "an integer >= 0 (tokens)")
        if self.prefix + self.suffix < 1:
            raise ParameterError("prefix", self.prefix, message="prefix and suffix are both 0: every thread needs a key")
        if self.heads % self.kv_heads:
            raise ParameterError("heads", self.heads, f"a multiple of kv_heads={self.kv_heads} (GQA)")
        if self.dtype not in _DTYPES:
            raise ParameterError("dtype", self.dtype, f"one of {sorted(_DTYPES)}")


def _forest(shape: KernelShape, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, list[Any], int]:
    from ..core.block_manager import BlockManager, KVView

    page = shape.page_size
    pages = (shape.prefix + shape.threads * (shape.suffix + page)) // page + 4
    bm = BlockManager(pages, page)
    main = KVView()
    if shape.prefix:
        bm.append(main, shape.prefix)
    views = [main] + [bm.fork(main) for _ in range(shape.threads - 1)]
    for v in views:
        if shape.suffix:
            bm.append(v, shape.suffix)
    g = torch.Generator(device="cpu").manual_seed(0)
    dt = _DTYPES[shape.dtype]
    k = torch.randn(pages, page, shape.kv_heads, shape.head_dim, generator=g).to(device, dt)
    v = torch.randn(pages, page, shape.kv_heads, shape.head_dim, generator=g).to(device, dt)
    return k, v, views, pages


def _times_us(fn: Callable[[], Any], device: torch.device, warmup: int, repeats: int) -> list[float]:
    if device.type == "cuda":
        from triton.testing import do_bench

        ms = do_bench(fn, warmup=max(1, warmup), rep=max(1, repeats), return_mode="all")
        return [1e3 * t for t in ms]
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        out.append(1e6 * (time.perf_counter() - t0))
    return out


def _summary(times: list[float]) -> dict[str, float]:
    """Median, p10, p90, min and max of ``times`` (microseconds, at least one) and their count.
    The deciles interpolate between the measured times (``method="inclusive"``), so they lie
    within [min, max] however few calls were timed."""
    q = statistics.quantiles(times, n=10, method="inclusive") if len(times) >= 2 else [times[0]] * 9
    return {"median_us": statistics.median(times), "p10_us": q[0], "p90_us": q[-1], "min_us": min(times),
            "max_us": max(times), "calls": len(times)}


def copy_bandwidth(device: torch.device | str = "cuda", n_bytes: int = 2 << 30, reps: int = 20) -> float:
    """Measured device-to-device copy bandwidth in bytes/s, counting bytes read plus written
    (``n_bytes`` in all, copied ``reps`` times after 3 warm-up copies, timed with CUDA events):
    the physical limit every GPU benchmark reports against (docs/DESIGN.md section 5). Needs a
    CUDA ``device``: raises what torch raises without one."""
    a = torch.empty(n_bytes // 2, dtype=torch.uint8, device=device)
    b = torch.empty_like(a)
    for _ in range(3):
        b.copy_(a)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        b.copy_(a)
    end.record()
    torch.cuda.synchronize()
    return 2 * a.numel() * reps / (start.elapsed_time(end) / 1e3)


def bench_tree_attention(shape: KernelShape, *, device: str = "auto", warmup: int = 3, repeats: int = 20,
                         peers: bool = True) -> dict[str, Any]:
    """Check and time the tree decode attention kernel on ``shape`` (see the module docstring).

    Args:
        shape: the case.
        device: ``auto`` (cuda when available, else cpu), ``cuda`` or ``cpu``.
        warmup, repeats: calls before timing and timed calls per kernel (on a GPU, do_bench's
            warm-up and repetition times in ms instead).
        peers: also time SDPA per thread and FlashInfer's cascade (FlashInfer on a GPU only).

    Returns a JSON-ready record: the shape, the device, ``interpreter`` (True on a CPU: times are
    not performance), per kernel the time summary (``median_us``, ``p10_us``, ``p90_us``, ...)
    and its largest absolute difference from the reference, the tree kernel's bytes, bandwidth
    and fraction of the copy bandwidth (GPU), and the speedups of the tree kernel over each peer.

    Raises ParameterError naming ``device`` when cuda is asked for and there is none, and
    ``dtype`` for bfloat16 on a CPU; ValueError when a kernel's output differs from the reference
    by more than the dtype's tolerance (the figures of a wrong kernel mean nothing)."""
    from ..triton_kernels.tree_attention import build_plan, tree_decode_attention

    if device not in ("auto", "cuda", "cpu"):
        raise ParameterError("device", device, "auto, cuda or cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise ParameterError("device", device, message="--device cuda: no CUDA GPU is visible")
    dev = torch.device("cuda" if device == "auto" and torch.cuda.is_available() else device if device != "auto"
                       else "cpu")
    if dev.type == "cpu" and shape.dtype == "bfloat16":
        raise ParameterError("dtype", shape.dtype, message="--dtype bfloat16 on the CPU: Triton's interpreter computes "
                             "bf16 tl.dot wrongly; use float16 or float32")
    k, v, views, _ = _forest(shape, dev)
    hq, hkv, d = shape.heads, shape.kv_heads, shape.head_dim
    dt = _DTYPES[shape.dtype]
    q = torch.randn(shape.threads, hq, d, generator=torch.Generator().manual_seed(1)).to(dev, dt)
    scale = d**-0.5
    pv = [[(s.id, s.pages, s.lens) for s in vw.segments] for vw in views]
    plans = {m: build_plan(pv, group=hq // hkv, num_kv_heads=hkv, device=dev, mode=m) for m in ("tree", "plain")}
    flat_k, flat_v = k.view(-1, hkv, d), v.view(-1, hkv, d)
    dense = []
    for vw in views:
        slots = torch.tensor([p * shape.page_size + o for p, n in zip(vw.pages, vw.lens) for o in range(n)], device=dev)
        dense.append((flat_k[slots].transpose(0, 1)[None].contiguous(), flat_v[slots].transpose(0, 1)[None].contiguous()))

    def sdpa() -> torch.Tensor:
        return torch.cat([torch.nn.functional.scaled_dot_product_attention(
            q[i : i + 1, :, None], kd, vd, scale=scale, enable_gqa=True)[:, :, 0] for i, (kd, vd) in enumerate(dense)])

    want = torch.cat([torch.nn.functional.scaled_dot_product_attention(
        q[i : i + 1, :, None].float(), kd.float(), vd.float(), scale=scale, enable_gqa=True)[:, :, 0]
        for i, (kd, vd) in enumerate(dense)])
    tol = {torch.float32: 1e-3, torch.float16: 2e-2, torch.bfloat16: 3e-2}[dt]
    kernels: dict[str, Callable[[], torch.Tensor]] = {
        m: (lambda p=plan: tree_decode_attention(q, k, v, p, scale)) for m, plan in plans.items()}
    if peers:
        kernels["sdpa_per_thread"] = sdpa
        if dev.type == "cuda":
            fi, why = _flashinfer_cascade(q, k, v, views, shape)
            if fi is not None:
                kernels["flashinfer_cascade"] = fi
    rec: dict[str, Any] = {"shape": asdict(shape), "device": torch.cuda.get_device_name(dev) if dev.type == "cuda"
                           else "cpu", "interpreter": dev.type == "cpu", "warmup": warmup, "repeats": repeats,
                           "repeats_unit": "ms" if dev.type == "cuda" else "calls",
                           "tolerance_abs": tol, "kernels": {}}
    if peers and dev.type == "cuda" and "flashinfer_cascade" not in kernels:
        rec["flashinfer_cascade"] = why
    for name, fn in kernels.items():
        err = float((fn().float() - want).abs().max())
        if not err <= tol:
            raise ValueError(f"{name} differs from the reference by {err:.3g} (tolerance {tol}) at {asdict(shape)}")
        rec["kernels"][name] = {**_summary(_times_us(fn, dev, warmup, repeats)), "max_abs_error": err}
    tok_bytes = 2 * hkv * d * q.element_size()
    io = 2 * shape.threads * hq * d * q.element_size()
    rec["tree_bytes"] = (shape.prefix + shape.threads * shape.suffix) * tok_bytes + io
    rec["plain_bytes"] = shape.threads * (shape.prefix + shape.suffix) * tok_bytes + io
    tree_us = rec["kernels"]["tree"]["median_us"]
    if dev.type == "cuda":
        for name, r in rec["kernels"].items():
            if name != "tree":
                rec[f"tree_speedup_vs_{name}"] = r["median_us"] / tree_us
        bw = copy_bandwidth(dev)
        rec["copy_bandwidth_bytes_per_s"] = bw
        rec["tree_bytes_per_s"] = rec["tree_bytes"] / (tree_us / 1e6)
        rec["tree_fraction_of_copy_bandwidth"] = rec["tree_bytes_per_s"] / bw
        rec["physical_limit_us"] = 1e6 * rec["tree_bytes"] / bw
    else:
        rec["physical_limit_us"] = None
        rec["note"] = ("Triton interpreter on the CPU: the outputs are checked against the reference; the times are the "
                       "interpreter's, not a performance figure")
    return rec


def cascade_levels(views: Sequence[Any], shape: KernelShape) -> list[dict[str, list[int]]]:
    """The paged layout of a FlashInfer cascade over :func:`_forest`'s ``views``, from their
    true page lengths: level 0 the prefix's ``ceil(prefix / page_size)`` pages, which every
    thread shares and reads once (one request; its last page's length as the views hold it:
    ``prefix % page_size`` tokens when threads fork off a prefix that ends inside a page), then
    level 1 each thread's own pages after them (one request per thread). Each level is a dict of FlashInfer's plan arrays as lists:
    ``qo_indptr``, ``kv_indptr``, ``kv_indices``, ``kv_last_page_len``; in every request every
    page is full but its last (FlashInfer's paged layout). A level no thread has tokens in (no
    prefix, or no suffix) is left out, so there are one or two.

    Raises ValueError when the views do not share the prefix's pages, or the prefix's or a
    thread's own pages are not all full but the last (layouts this benchmark does not build)."""
    page, n = shape.page_size, len(views)
    shared = -(-shape.prefix // page)
    if any(vw.pages[:shared] != views[0].pages[:shared] for vw in views):
        raise ValueError("the threads do not share the prefix's pages")
    levels = []
    if shared:
        lens = views[0].lens[:shared]
        if any(x != page for x in lens[:-1]):
            raise ValueError("the prefix's pages are not all full but the last")
        levels.append({"qo_indptr": [0, n], "kv_indptr": [0, shared], "kv_indices": list(views[0].pages[:shared]),
                       "kv_last_page_len": [lens[-1]]})
    own = [(list(vw.pages[shared:]), list(vw.lens[shared:])) for vw in views]
    if any(pages for pages, _ in own):
        if any(not pages or any(x != page for x in lens[:-1]) for pages, lens in own):
            raise ValueError("a thread's own pages are not all full but the last")
        levels.append({"qo_indptr": list(range(n + 1)),
                       "kv_indptr": [0, *itertools.accumulate(len(pages) for pages, _ in own)],
                       "kv_indices": [p for pages, _ in own for p in pages],
                       "kv_last_page_len": [lens[-1] for _, lens in own]})
    return levels


def _flashinfer_cascade(q, k, v, views, shape: KernelShape):
    """A callable running FlashInfer's cascade (:func:`cascade_levels`: the shared prefix, then
    each thread's own pages) on the same paged cache, or (None, why)."""
    try:
        import flashinfer
    except Exception as e:  # noqa: BLE001  (not installed, or its import fails: JIT, CUDA mismatch)
        return None, f"import flashinfer failed: {type(e).__name__}: {e}"
    try:
        dev, page = q.device, shape.page_size
        i32 = dict(dtype=torch.int32, device=dev)
        levels = cascade_levels(views, shape)
        ws = torch.empty(256 * 2**20, dtype=torch.uint8, device=dev)
        wrapper = flashinfer.MultiLevelCascadeAttentionWrapper(len(levels), ws, "NHD")
        wrapper.plan(
            *([torch.tensor(lv[key], **i32) for lv in levels]
              for key in ("qo_indptr", "kv_indptr", "kv_indices", "kv_last_page_len")),
            shape.heads, shape.kv_heads, shape.head_dim, page,
        )
        return (lambda: wrapper.run(q, (k, v))), None
    except Exception as e:  # noqa: BLE001  (a shape it does not take is a reason, not a crash)
        return None, f"flashinfer cascade failed: {type(e).__name__}: {str(e)[:300]}"
