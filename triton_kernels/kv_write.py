"""Fused RoPE + paged KV-cache write: one launch per layer for every new token of a step.

:func:`rope_and_write` does what :meth:`pasta_engine.layers.attention.AttentionBackend.rope_and_write`
does with torch ops (rotate q and k by RoPE, store rotated k and raw v in their cache slots,
return rotated q), in a single kernel that reads q/k/v straight out of the fused qkv projection
(strided views, no copies).

RoPE is the "rotate half" convention of HF Llama (Su et al. 2021, RoFormer, section 3.4.2):
``x * cos + cat(-x[D/2:], x[:D/2]) * sin`` with ``cos``/``sin`` ``[T, D]`` given by the model.
The kernel loads the two halves of each head separately, so for ``h = D/2``

    out[:h] = x[:h] * cos[:h] - x[h:] * sin[:h]
    out[h:] = x[h:] * cos[h:] + x[:h] * sin[h:]

computed in float32 and cast once at the store (vLLM's and FlashInfer's fused RoPE kernels do
the same; with float32 inputs the result equals the torch default bit for bit unless the GPU
compiler contracts a multiply-add into an FMA, a last-bit difference).

Grid: ``(T, Hkv)``; program ``(t, g)`` handles token ``t``'s KV head ``g`` and the ``Hq / Hkv``
query heads that read it (GQA). Nothing in the launch depends on slot values, so the launch can
be captured in a CUDA graph; a negative slot means "padding row: rotate q, write nothing".
"""

from __future__ import annotations

from . import FLOAT_DTYPES, register_compile_spec  # the package sets TRITON_INTERPRET on CPU before triton.jit runs

import torch
import triton
import triton.language as tl

__all__ = ["rope_and_write"]



@triton.jit
def _rope_kv_write_kernel(
    q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, q_out_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
    stride_cos_t, stride_sin_t,
    stride_kc_p, stride_kc_s, stride_kc_h, stride_vc_p, stride_vc_s, stride_vc_h,
    stride_ot, stride_oh,
    page_size,
    GROUP: tl.constexpr,  # query heads per KV head
    GROUP_PAD: tl.constexpr,  # next power of two of GROUP
    HALF: tl.constexpr,  # head_dim // 2
    BLOCK_HALF: tl.constexpr,  # next power of two of HALF
):
    t = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1)
    offs = tl.arange(0, BLOCK_HALF)
    dm = offs < HALF

    cos1 = tl.load(cos_ptr + t * stride_cos_t + offs, mask=dm, other=0.0).to(tl.float32)
    cos2 = tl.load(cos_ptr + t * stride_cos_t + HALF + offs, mask=dm, other=0.0).to(tl.float32)
    sin1 = tl.load(sin_ptr + t * stride_sin_t + offs, mask=dm, other=0.0).to(tl.float32)
    sin2 = tl.load(sin_ptr + t * stride_sin_t + HALF + offs, mask=dm, other=0.0).to(tl.float32)

    # query heads g*GROUP .. g*GROUP+GROUP-1, rotated, to the contiguous output
    hs = tl.arange(0, GROUP_PAD)
    hm = hs < GROUP
    heads = g * GROUP + hs
    qm = hm[:, None] & dm[None, :]
    q_row = q_ptr + t * stride_qt + heads[:, None] * stride_qh + offs[None, :]
    q1 = tl.load(q_row, mask=qm, other=0.0).to(tl.float32)
    q2 = tl.load(q_row + HALF, mask=qm, other=0.0).to(tl.float32)
    o1 = q1 * cos1[None, :] - q2 * sin1[None, :]
    o2 = q2 * cos2[None, :] + q1 * sin2[None, :]
    o_row = q_out_ptr + t * stride_ot + heads[:, None] * stride_oh + offs[None, :]
    tl.store(o_row, o1.to(q_out_ptr.dtype.element_ty), mask=qm)
    tl.store(o_row + HALF, o2.to(q_out_ptr.dtype.element_ty), mask=qm)

    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot >= 0:
        page = slot // page_size
        off = slot % page_size
        k_row = k_ptr + t * stride_kt + g * stride_kh + offs
        k1 = tl.load(k_row, mask=dm, other=0.0).to(tl.float32)
        k2 = tl.load(k_row + HALF, mask=dm, other=0.0).to(tl.float32)
        r1 = k1 * cos1 - k2 * sin1
        r2 = k2 * cos2 + k1 * sin2
        kc = k_cache_ptr + page * stride_kc_p + off * stride_kc_s + g * stride_kc_h + offs
        tl.store(kc, r1.to(k_cache_ptr.dtype.element_ty), mask=dm)
        tl.store(kc + HALF, r2.to(k_cache_ptr.dtype.element_ty), mask=dm)

        v_row = v_ptr + t * stride_vt + g * stride_vh + offs
        v1 = tl.load(v_row, mask=dm, other=0.0)
        v2 = tl.load(v_row + HALF, mask=dm, other=0.0)
        vc = v_cache_ptr + page * stride_vc_p + off * stride_vc_s + g * stride_vc_h + offs
        tl.store(vc, v1.to(v_cache_ptr.dtype.element_ty), mask=dm)
        tl.store(vc + HALF, v2.to(v_cache_ptr.dtype.element_ty), mask=dm)


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise ValueError(f"rope_and_write: {msg}")


def rope_and_write(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Rotate q and k by RoPE, write rotated k and raw v into the paged cache, return rotated q.

    Args:
        q: ``[T, Hq, D]`` float16/bfloat16/float32; any strides with a unit last stride (e.g. a
            view into a fused qkv projection output).
        k, v: ``[T, Hkv, D]``, same dtype as q, unit last stride; ``Hq % Hkv == 0``, D even.
        cos, sin: ``[T, D]`` same dtype as q (the model's RoPE table at each token's logical
            position), unit last stride.
        k_cache, v_cache: ``[num_pages, page_size, Hkv, D]`` (one layer, "NHD"), float16,
            bfloat16 or float32 (both the same), unit last stride. A token's slot is
            ``page * page_size + offset``.
        slot_mapping: ``[T]`` int64 (or int32) slot of every token; a negative slot writes
            nothing (padding row). Values are not range-checked (that would sync with the host).
        out: optional ``[T, Hq, D]`` tensor of q's dtype with a unit last stride for the rotated q.

    Returns:
        Rotated q ``[T, Hq, D]`` in q's dtype (``out`` if given, else a new contiguous tensor).
        Arithmetic is float32, cast once at the store; equals
        :meth:`pasta_engine.layers.attention.AttentionBackend.rope_and_write` exactly (up to GPU FMA
        contraction) in float32 and within one rounding in float16/bfloat16.

    Raises:
        ValueError: a shape, dtype, stride or device mismatch, named in the message.
    """
    for name, x, nd in (("q", q, 3), ("k", k, 3), ("v", v, 3), ("cos", cos, 2), ("sin", sin, 2),
                        ("k_cache", k_cache, 4), ("v_cache", v_cache, 4), ("slot_mapping", slot_mapping, 1)):
        _check(isinstance(x, torch.Tensor), f"{name} must be a torch.Tensor, got {type(x).__name__}")
        _check(x.dim() == nd, f"{name} must have {nd} dims, got shape {tuple(x.shape)}")
        _check(x.device == q.device, f"{name} is on {x.device} but q is on {q.device}")
    t, hq, d = q.shape
    hkv = k.shape[1]
    _check(q.dtype in FLOAT_DTYPES, f"q dtype must be float16, bfloat16 or float32, got {q.dtype}")
    for name, x in (("k", k), ("v", v), ("cos", cos), ("sin", sin)):
        _check(x.dtype == q.dtype, f"{name} dtype {x.dtype} != q dtype {q.dtype}")
    _check(tuple(k.shape) == (t, hkv, d), f"k shape {tuple(k.shape)} must be [T={t}, Hkv, D={d}]")
    _check(tuple(v.shape) == tuple(k.shape), f"v shape {tuple(v.shape)} != k shape {tuple(k.shape)}")
    _check(hkv >= 1 and hq % hkv == 0, f"Hq={hq} must be a positive multiple of Hkv={hkv}")
    _check(d % 2 == 0 and d > 0, f"head_dim D={d} must be even")
    for name, x in (("cos", cos), ("sin", sin)):
        _check(tuple(x.shape) == (t, d), f"{name} shape {tuple(x.shape)} must be [T={t}, D={d}]")
    _check(k_cache.dtype in FLOAT_DTYPES, f"k_cache dtype must be float16, bfloat16 or float32, got {k_cache.dtype}")
    _check(v_cache.dtype == k_cache.dtype, f"v_cache dtype {v_cache.dtype} != k_cache dtype {k_cache.dtype}")
    _check(tuple(v_cache.shape) == tuple(k_cache.shape),
           f"v_cache shape {tuple(v_cache.shape)} != k_cache shape {tuple(k_cache.shape)}")
    _check(tuple(k_cache.shape[2:]) == (hkv, d),
           f"cache shape {tuple(k_cache.shape)} must be [num_pages, page_size, Hkv={hkv}, D={d}]")
    _check(slot_mapping.dtype in (torch.int64, torch.int32), f"slot_mapping dtype must be int64/int32, got {slot_mapping.dtype}")
    _check(slot_mapping.shape[0] == t, f"slot_mapping has {slot_mapping.shape[0]} entries for T={t} tokens")
    if out is None:
        out = torch.empty((t, hq, d), dtype=q.dtype, device=q.device)
    else:
        _check(isinstance(out, torch.Tensor) and tuple(out.shape) == (t, hq, d) and out.dtype == q.dtype
               and out.device == q.device, f"out must be a [{t}, {hq}, {d}] {q.dtype} tensor on {q.device}")
    for name, x in (("q", q), ("k", k), ("v", v), ("cos", cos), ("sin", sin), ("k_cache", k_cache),
                    ("v_cache", v_cache), ("out", out)):
        _check(x.stride(-1) == 1, f"{name} must have a unit stride in its last dim, got strides {x.stride()}")
    if t == 0:
        return out
    group = hq // hkv
    half = d // 2
    _rope_kv_write_kernel[(t, hkv)](
        q, k, v, cos, sin, k_cache, v_cache, slot_mapping, out,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        cos.stride(0), sin.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        out.stride(0), out.stride(1),
        k_cache.shape[1],
        GROUP=group, GROUP_PAD=triton.next_power_of_2(group), HALF=half, BLOCK_HALF=triton.next_power_of_2(half),
        num_warps=1 if group * d <= 512 else 2,
    )
    return out


def _register() -> None:
    ptr = "*bf16"
    sig = {
        "q_ptr": ptr, "k_ptr": ptr, "v_ptr": ptr, "cos_ptr": ptr, "sin_ptr": ptr,
        "k_cache_ptr": ptr, "v_cache_ptr": ptr, "slot_ptr": "*i64", "q_out_ptr": ptr,
        **{n: "i32" for n in ("stride_qt", "stride_qh", "stride_kt", "stride_kh", "stride_vt", "stride_vh",
                              "stride_cos_t", "stride_sin_t", "stride_kc_p", "stride_kc_s", "stride_kc_h",
                              "stride_vc_p", "stride_vc_s", "stride_vc_h", "stride_ot", "stride_oh", "page_size")},
        "GROUP": "constexpr", "GROUP_PAD": "constexpr", "HALF": "constexpr", "BLOCK_HALF": "constexpr",
    }
    # Llama-3-8B and Qwen3-8B (32 q heads, 8 KV heads, D=128), SmolLM2-135M (9 q heads, 3 KV heads,
    # D=64), Gemma-7B (16 heads, 16 KV heads, D=256), Gemma-2-9B (16 q heads, 8 KV heads, D=256),
    # Phi-3-mini (32 heads, 32 KV heads, D=96)
    for d, group in ((128, 4), (64, 3), (256, 1), (256, 2), (96, 1)):
        register_compile_spec(
            f"rope_kv_write bf16 D={d} group={group}", _rope_kv_write_kernel, sig,
            {"GROUP": group, "GROUP_PAD": triton.next_power_of_2(group), "HALF": d // 2,
             "BLOCK_HALF": triton.next_power_of_2(d // 2)},
        )


_register()
