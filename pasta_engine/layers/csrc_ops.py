"""The optional CUDA C++ extension (``csrc/``, built by ``CMakeLists.txt``) and its references.

Two ops, registered by ``pasta_engine/_C.so`` as ``torch.ops.pasta_engine.*``:

* :func:`rope_kv_write`: RoPE on q and k plus the paged KV-cache write of k and v, one launch
  (what :meth:`pasta_engine.layers.attention.AttentionBackend.rope_and_write` does with five torch ops);
* :func:`lse_merge`: the log-sum-exp merge of split-KV attention partials (FlashDecoding;
  FlashInfer's ``merge_states``).

``pip install -e .`` never builds the extension; :func:`available` says whether it was built
(``cmake -S . -B build && cmake --build build -j`` on a machine with a CUDA build of torch and
nvcc) and loads it once. Callers use the extension when it is available and fall back to the
pure-torch references (:func:`rope_kv_write_reference`, :func:`lse_merge_reference`) otherwise;
the wrappers raise a RuntimeError naming the build command when it is missing.

The library is looked up at ``$PASTA_ENGINE_CSRC_LIB`` if that is set, else as ``_C*.so`` in the
``pasta_engine`` package directory (where CMake writes it).
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

import torch

from .attention import write_kv
from .rotary import apply_rope

__all__ = [
    "BUILD_COMMAND",
    "available",
    "unavailable_reason",
    "library_path",
    "rope_kv_write",
    "rope_kv_write_reference",
    "lse_merge",
    "lse_merge_reference",
]

BUILD_COMMAND = "cmake -S . -B build -DPython3_EXECUTABLE=$(which python) && cmake --build build -j"
_ENV_VAR = "PASTA_ENGINE_CSRC_LIB"
_KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)

# Whether available() ran, its answer, why not, and the library it loaded.
_STATE: dict = {"tried": False, "ok": False, "reason": "", "path": None}


def library_path() -> Path | None:
    """Where the built extension is: ``$PASTA_ENGINE_CSRC_LIB``, else the first ``_C*.so``
    in the package directory; None when neither exists."""
    env = os.environ.get(_ENV_VAR)
    if env:
        p = Path(env)
        return p if p.is_file() else None
    found = sorted(Path(__file__).resolve().parents[1].glob("_C*.so"))
    return found[0] if found else None


def available() -> bool:
    """Whether the CUDA extension is built and loaded (loads it on the first call, once).

    False on a CPU-only build of torch (``torch.version.cuda is None``: the extension links
    CUDA torch), when no library is found (see :func:`library_path`), or when loading it fails;
    :func:`unavailable_reason` says which. Never raises."""
    if _STATE["tried"]:
        return _STATE["ok"]
    _STATE["tried"] = True
    if torch.version.cuda is None:
        _STATE["reason"] = f"torch {torch.__version__} is a CPU-only build (the extension needs CUDA torch)"
        return False
    path = library_path()
    if path is None:
        where = os.environ.get(_ENV_VAR) or str(Path(__file__).resolve().parents[1] / "_C.so")
        _STATE["reason"] = f"extension not built ({where} not found)"
        return False
    try:
        torch.ops.load_library(str(path))
        ok = hasattr(torch.ops.pasta_engine, "rope_kv_write") and hasattr(torch.ops.pasta_engine, "lse_merge")
    except (OSError, RuntimeError) as e:  # undefined symbol, ABI or CUDA runtime mismatch
        cause = f" ({e.__cause__})" if e.__cause__ is not None else ""
        _STATE["reason"] = f"loading {path} failed: {e}{cause}"
        return False
    if not ok:
        _STATE["reason"] = f"{path} loaded but does not register torch.ops.pasta_engine.rope_kv_write/lse_merge"
        return False
    _STATE.update(ok=True, path=path, reason="")
    return True


def unavailable_reason() -> str:
    """Why :func:`available` is False ("" when it is True or was not called yet)."""
    return _STATE["reason"]


def _require_extension(op: str) -> None:
    if not available():
        raise RuntimeError(
            f"pasta_engine.layers.csrc_ops.{op}: the CUDA extension is not available: {unavailable_reason()}. "
            f"Build it on a machine with nvcc and a CUDA build of torch, from the repository root: "
            f"{BUILD_COMMAND}  (or use {op}_reference)"
        )


def _fail(op: str, msg: str) -> None:
    raise ValueError(f"{op}: {msg}")


def _check_rope_inputs(q, k, v, cos, sin, k_cache, v_cache, slot_mapping) -> None:
    op = "rope_kv_write"
    if q.dim() != 3 or k.dim() != 3 or v.dim() != 3:
        _fail(op, f"q, k, v must be [T, H, D], got shapes {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    t, _, d = q.shape
    if d % 2 or d == 0:
        _fail(op, f"head_dim must be even and positive, got q shape {tuple(q.shape)}")
    if k.shape[0] != t or k.shape[2] != d or v.shape != k.shape:
        _fail(op, f"k and v must be [T, Hkv, D] with T={t}, D={d}, got {tuple(k.shape)} and {tuple(v.shape)}")
    hkv = k.shape[1]
    for name, x in (("cos", cos), ("sin", sin)):
        if tuple(x.shape) != (t, d):
            _fail(op, f"{name} must be [T, D] = [{t}, {d}], got {tuple(x.shape)}")
    for name, c in (("k_cache", k_cache), ("v_cache", v_cache)):
        if c.dim() not in (3, 4) or tuple(c.shape[-2:]) != (hkv, d):
            _fail(op, f"{name} must be [num_slots, Hkv, D] or [num_pages, page_size, Hkv, D] with Hkv={hkv}, "
                      f"D={d}, got {tuple(c.shape)}")
    if k_cache.shape != v_cache.shape:
        _fail(op, f"k_cache and v_cache shapes differ: {tuple(k_cache.shape)} vs {tuple(v_cache.shape)}")
    if slot_mapping.dim() != 1 or slot_mapping.shape[0] != t or slot_mapping.dtype != torch.int64:
        _fail(op, f"slot_mapping must be int64 [T] = [{t}], got {slot_mapping.dtype} {tuple(slot_mapping.shape)}")
    if q.dtype not in _KERNEL_DTYPES:
        _fail(op, f"q must be float32, float16 or bfloat16, got {q.dtype}")
    for name, x in (("k", k), ("v", v), ("cos", cos), ("sin", sin), ("k_cache", k_cache), ("v_cache", v_cache)):
        if x.dtype != q.dtype:
            _fail(op, f"{name} must have q's dtype {q.dtype}, got {x.dtype}")


def _check_devices(op: str, tensors: dict[str, torch.Tensor]) -> None:
    devices = {name: x.device for name, x in tensors.items()}
    first = next(iter(devices.values()))
    if first.type != "cuda" or any(dev != first for dev in devices.values()):
        _fail(op, f"all tensors must be on one CUDA device, got {', '.join(f'{n}: {d}' for n, d in devices.items())}")


def rope_kv_write(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> torch.Tensor:
    """Rotate q and k by RoPE, write rotated k and raw v into the paged cache; one CUDA launch.

    Args:
        q: ``[T, Hq, D]``; k, v: ``[T, Hkv, D]`` (float32, float16 or bfloat16; each token's
            ``[H, D]`` contiguous, any stride along T, e.g. slices of a fused qkv output).
        cos, sin: ``[T, D]``, q's dtype (HF Llama "rotate half" tables at each token's position).
        k_cache, v_cache: ``[num_slots, Hkv, D]`` or ``[num_pages, page_size, Hkv, D]`` (one
            layer of :class:`the model runner's KV cache`), q's dtype; written in place.
        slot_mapping: int64 ``[T]``, slot ``page * page_size + offset`` of each token; a token
            with a slot < 0 or >= num_slots writes no K/V (CUDA-graph padding).

    Returns:
        rotated q, ``[T, Hq, D]`` contiguous. Formula (Su et al. 2021, RoFormer 3.4.2, HF
        convention): ``x * cos + cat(-x[D/2:], x[:D/2]) * sin``, in fp32, rounded once.

    Equal to :func:`rope_kv_write_reference` up to that single rounding. No host sync and no
    allocation besides the result, so it can be captured in a CUDA graph.

    Raises:
        ValueError: a shape, dtype or device mismatch (named).
        RuntimeError: the extension is not built or cannot be loaded (names the build command).
    """
    _check_rope_inputs(q, k, v, cos, sin, k_cache, v_cache, slot_mapping)
    _require_extension("rope_kv_write")
    _check_devices("rope_kv_write", dict(q=q, k=k, v=v, cos=cos, sin=sin, k_cache=k_cache, v_cache=v_cache,
                                         slot_mapping=slot_mapping))
    return torch.ops.pasta_engine.rope_kv_write(q, k, v, cos, sin, k_cache, v_cache, slot_mapping)


def rope_kv_write_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> torch.Tensor:
    """Pure-torch :func:`rope_kv_write` (same arguments, shapes and result; any device).

    The operations of :meth:`pasta_engine.layers.attention.AttentionBackend.rope_and_write`
    (:func:`pasta_engine.layers.rotary.apply_rope` in the input dtype, then ``index_copy_`` into the
    cache), plus the kernel's rule that tokens whose slot is outside ``[0, num_slots)`` write no
    K/V (filtering them syncs with the host; the reference is not meant for CUDA graphs)."""
    k_rot = apply_rope(k, cos, sin)
    slots = slot_mapping
    keep = (slots >= 0) & (slots < k_cache.numel() // (k.shape[1] * k.shape[2]))
    if not bool(keep.all()):
        slots, k_rot, v = slots[keep], k_rot[keep], v[keep]
    write_kv(k_rot, v, k_cache, v_cache, slots)
    return apply_rope(q, cos, sin)


def _renamed_kwarg(old: str, new: str):
    """Let a public function still take ``old=``, the keyword its argument ``new`` had before a
    rename (``lse_merge``'s ``row_slots`` became ``row_parts``: "slot" names only KV-cache slots)."""

    def wrap(fn):
        @functools.wraps(fn)
        def inner(*args, **kwargs):
            if old in kwargs:
                if new in kwargs:
                    raise TypeError(f"{fn.__name__}() got both {old}= and its new name {new}=")
                kwargs[new] = kwargs.pop(old)
            return fn(*args, **kwargs)

        return inner

    return wrap


def _check_merge_inputs(part_o, part_lse, row_indptr, row_parts, out, out_lse) -> None:
    op = "lse_merge"
    if out.dim() != 3:
        _fail(op, f"out must be [R, H, D], got {tuple(out.shape)}")
    r, h, d = out.shape
    if part_o.dim() != 3 or tuple(part_o.shape[1:]) != (h, d):
        _fail(op, f"part_o must be [S, H, D] with H={h}, D={d} (from out), got {tuple(part_o.shape)}")
    s = part_o.shape[0]
    if tuple(part_lse.shape) != (s, h):
        _fail(op, f"part_lse must be [S, H] = [{s}, {h}], got {tuple(part_lse.shape)}")
    if tuple(row_indptr.shape) != (r + 1,):
        _fail(op, f"row_indptr must be [R + 1] = [{r + 1}] (R from out), got {tuple(row_indptr.shape)}")
    if row_parts.dim() != 1:
        _fail(op, f"row_parts must be 1-D [nnz], got {tuple(row_parts.shape)}")
    if part_o.dtype != torch.float32 or part_lse.dtype != torch.float32:
        _fail(op, f"part_o and part_lse must be float32, got {part_o.dtype} and {part_lse.dtype}")
    if row_indptr.dtype != torch.int32 or row_parts.dtype != torch.int32:
        _fail(op, f"row_indptr and row_parts must be int32, got {row_indptr.dtype} and {row_parts.dtype}")
    if out.dtype not in _KERNEL_DTYPES:
        _fail(op, f"out must be float32, float16 or bfloat16, got {out.dtype}")
    if out_lse is not None and (tuple(out_lse.shape) != (r, h) or out_lse.dtype != torch.float32):
        _fail(op, f"out_lse must be float32 [R, H] = [{r}, {h}], got {out_lse.dtype} {tuple(out_lse.shape)}")


@_renamed_kwarg("row_slots", "row_parts")
def lse_merge(
    part_o: torch.Tensor,
    part_lse: torch.Tensor,
    row_indptr: torch.Tensor,
    row_parts: torch.Tensor,
    out: torch.Tensor,
    out_lse: torch.Tensor | None = None,
) -> torch.Tensor:
    """Merge split-KV attention partials by the log-sum-exp rule; one CUDA launch.

    Args:
        part_o: float32 ``[S, H, D]``, partial attention outputs (each softmax-normalized over
            its own keys).
        part_lse: float32 ``[S, H]``, natural-log log-sum-exp of each partial's scores
            (``-inf`` for an empty partial, whose ``part_o`` is then never read: may be NaN).
        row_indptr: int32 ``[R + 1]``; row ``r`` merges partials
            ``row_parts[row_indptr[r]:row_indptr[r + 1]]``.
        row_parts: int32 ``[nnz]``, partial indices into S (outside ``[0, S)``: ignored); the
            keyword ``row_slots=`` (its old name) is still accepted.
        out: ``[R, H, D]`` float32/float16/bfloat16, written in place.
        out_lse: optional float32 ``[R, H]``, written in place with the merged LSE.

    With ``M = max_i lse_i``: ``out = sum_i exp(lse_i - M) o_i / sum_i exp(lse_i - M)`` and
    ``out_lse = M + log(sum_i exp(lse_i - M))`` (FlashDecoding, Dao et al. 2023; FlashInfer
    ``merge_states``, which uses base-2 LSE). A row with no partials, or only ``-inf`` ones,
    gets 0 and ``-inf``. Returns ``out``. CUDA-graph capturable (no sync, no allocation).

    Raises:
        ValueError: a shape, dtype or device mismatch (named).
        RuntimeError: the extension is not built or cannot be loaded (names the build command).
    """
    _check_merge_inputs(part_o, part_lse, row_indptr, row_parts, out, out_lse)
    _require_extension("lse_merge")
    tensors = dict(part_o=part_o, part_lse=part_lse, row_indptr=row_indptr, row_parts=row_parts, out=out)
    if out_lse is not None:
        tensors["out_lse"] = out_lse
    _check_devices("lse_merge", tensors)
    torch.ops.pasta_engine.lse_merge(part_o, part_lse, row_indptr, row_parts, out, out_lse)
    return out


@_renamed_kwarg("row_slots", "row_parts")
def lse_merge_reference(
    part_o: torch.Tensor,
    part_lse: torch.Tensor,
    row_indptr: torch.Tensor,
    row_parts: torch.Tensor,
    out: torch.Tensor,
    out_lse: torch.Tensor | None = None,
) -> torch.Tensor:
    """Pure-torch :func:`lse_merge` (same arguments and in-place results; any device, syncs
    with the host). Math in float32; returns ``out``. Raises ValueError on bad shapes/dtypes."""
    _check_merge_inputs(part_o, part_lse, row_indptr, row_parts, out, out_lse)
    r, h, d = out.shape
    s = part_o.shape[0]
    dev = part_o.device
    counts = (row_indptr[1:] - row_indptr[:-1]).long()
    row_of = torch.repeat_interleave(torch.arange(r, device=dev), counts)  # [nnz]
    parts = row_parts.long()
    valid = (parts >= 0) & (parts < s)
    parts = torch.where(valid, parts, torch.zeros_like(parts))
    lse = part_lse.float()[parts] if s else torch.full((parts.shape[0], h), float("-inf"), device=dev)
    lse = torch.where(valid[:, None], lse, torch.full_like(lse, float("-inf")))  # [nnz, H]
    m = torch.full((r, h), float("-inf"), device=dev)
    m = m.scatter_reduce(0, row_of[:, None].expand(-1, h), lse, reduce="amax", include_self=True)
    m_row = m[row_of]  # [nnz, H]
    w = torch.where(lse > float("-inf"), torch.exp(lse - m_row), torch.zeros_like(lse))
    o = part_o.float()[parts] if s else torch.zeros(parts.shape[0], h, d, device=dev)
    contrib = torch.where(w[..., None] > 0, w[..., None] * o, torch.zeros_like(o))  # skip NaN of empty parts
    num = torch.zeros(r, h, d, device=dev).index_add_(0, row_of, contrib)
    den = torch.zeros(r, h, device=dev).index_add_(0, row_of, w)
    has = den > 0
    out.copy_(torch.where(has[..., None], num / torch.where(has, den, 1.0)[..., None], 0.0))
    if out_lse is not None:
        out_lse.copy_(torch.where(has, m + torch.log(torch.where(has, den, 1.0)), float("-inf")))
    return out
