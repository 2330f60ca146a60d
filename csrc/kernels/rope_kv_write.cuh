// Fused RoPE + paged KV-cache write (host API; the kernel is in rope_kv_write.cu).
//
// For every token t of T:
//   q_out[t, h]                 = rope(q[t, h], cos[t], sin[t])       for h < Hq
//   k_cache[slot_mapping[t], h] = rope(k[t, h], cos[t], sin[t])       for h < Hkv
//   v_cache[slot_mapping[t], h] = v[t, h]                             for h < Hkv
// with the "rotate half" RoPE of HF Llama (Su et al. 2021, RoFormer, section 3.4.2):
//   rope(x, c, s) = x * c + cat(-x[D/2:], x[:D/2]) * s
// i.e. out[i] = x[i] c[i] - x[i+D/2] s[i] and out[i+D/2] = x[i+D/2] c[i+D/2] + x[i] s[i+D/2]
// for i < D/2, computed in fp32 and rounded once to the storage type.
//
// A token whose slot is negative (padding of a CUDA-graph bucket) or >= num_slots writes no
// K/V (its q is still rotated). Same job as vLLM's rotary_embedding + reshape_and_cache_flash
// (csrc/pos_encoding_kernels.cu, csrc/cache_kernels.cu), fused into one launch.
#pragma once

#include <cstdint>

#include "common.cuh"

namespace pasta {

struct RopeKVWriteParams {
  // Inputs, element type `dtype`. Within a token every tensor is contiguous ([H, D] with head
  // stride D); along T any row stride (in elements) is allowed, so q/k/v may be column slices
  // of a fused qkv projection output.
  const void* q;    // [T, Hq, D]
  int64_t q_row_stride;
  const void* k;    // [T, Hkv, D]
  int64_t k_row_stride;
  const void* v;    // [T, Hkv, D]
  int64_t v_row_stride;
  const void* cos;  // [T, D]
  int64_t cos_row_stride;
  const void* sin;  // [T, D]
  int64_t sin_row_stride;
  // Outputs.
  void* q_out;      // [T, Hq, D], contiguous
  void* k_cache;    // [num_slots, Hkv, D], slot stride k_cache_slot_stride (elements)
  int64_t k_cache_slot_stride;
  void* v_cache;    // [num_slots, Hkv, D], slot stride v_cache_slot_stride (elements)
  int64_t v_cache_slot_stride;
  int64_t num_slots;
  const int64_t* slot_mapping;  // [T] slot = page * page_size + offset
  int64_t num_tokens;           // T
  int32_t num_q_heads;          // Hq
  int32_t num_kv_heads;         // Hkv
  int32_t head_dim;             // D, even
};

// Enqueues the kernel on `stream` (no host synchronization, no allocation: CUDA-graph
// capturable). Returns cudaErrorInvalidValue for an unsupported dtype or an odd / non-positive
// head_dim, otherwise the launch status (cudaGetLastError). T == 0 launches nothing.
cudaError_t launch_rope_kv_write(const RopeKVWriteParams& params, DType dtype, cudaStream_t stream);

}  // namespace pasta
