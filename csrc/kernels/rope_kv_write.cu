// Fused RoPE + paged KV-cache write. Semantics: rope_kv_write.cuh.
//
// One thread block per token. Its work items are (a) the rotation of VEC consecutive pairs
// (x[i..i+VEC), x[i+D/2..i+D/2+VEC)) of one q or k head and (b) the copy of VEC consecutive
// elements of one v head; threads stride over the items. VEC is the widest vector (up to 16
// bytes) that every pointer and row stride allows, picked on the host. A padded token
// (slot < 0) skips its k rotation and v copy entirely.
#include <algorithm>

#include "rope_kv_write.cuh"
#include "vec_utils.cuh"

namespace pasta {
namespace {

constexpr int kMaxThreads = 512;

template <typename T, int VEC>
__global__ void __launch_bounds__(kMaxThreads) rope_kv_write_kernel(const RopeKVWriteParams p) {
  const int64_t t = blockIdx.x;
  const int d = p.head_dim;
  const int half = d / 2;
  const int pairs = half / VEC;     // rotation items per head
  const int chunks = d / VEC;       // copy items per v head
  const int hq = p.num_q_heads;
  const int hkv = p.num_kv_heads;
  const int64_t slot = p.slot_mapping[t];
  const bool write_kv = slot >= 0 && slot < p.num_slots;
  const int n_rot = (hq + (write_kv ? hkv : 0)) * pairs;
  const int n_items = n_rot + (write_kv ? hkv * chunks : 0);

  const T* __restrict__ q = static_cast<const T*>(p.q) + t * p.q_row_stride;
  const T* __restrict__ k = static_cast<const T*>(p.k) + t * p.k_row_stride;
  const T* __restrict__ v = static_cast<const T*>(p.v) + t * p.v_row_stride;
  const T* __restrict__ cos = static_cast<const T*>(p.cos) + t * p.cos_row_stride;
  const T* __restrict__ sin = static_cast<const T*>(p.sin) + t * p.sin_row_stride;
  T* __restrict__ q_out = static_cast<T*>(p.q_out) + t * hq * d;
  T* __restrict__ k_dst = static_cast<T*>(p.k_cache) + (write_kv ? slot * p.k_cache_slot_stride : 0);
  T* __restrict__ v_dst = static_cast<T*>(p.v_cache) + (write_kv ? slot * p.v_cache_slot_stride : 0);

  for (int item = threadIdx.x; item < n_items; item += blockDim.x) {
    if (item < n_rot) {
      const int h = item / pairs;
      const int i = (item - h * pairs) * VEC;
      const T* src;
      T* dst;
      if (h < hq) {
        src = q + h * d;
        dst = q_out + h * d;
      } else {
        src = k + (h - hq) * d;
        dst = k_dst + (h - hq) * d;
      }
      float x1[VEC], x2[VEC], c1[VEC], c2[VEC], s1[VEC], s2[VEC];
      load_vec<T, VEC>(src + i, x1);
      load_vec<T, VEC>(src + half + i, x2);
      load_vec<T, VEC>(cos + i, c1);
      load_vec<T, VEC>(cos + half + i, c2);
      load_vec<T, VEC>(sin + i, s1);
      load_vec<T, VEC>(sin + half + i, s2);
      float y1[VEC], y2[VEC];
#pragma unroll
      for (int e = 0; e < VEC; ++e) {
        y1[e] = x1[e] * c1[e] - x2[e] * s1[e];
        y2[e] = x2[e] * c2[e] + x1[e] * s2[e];
      }
      store_vec<T, VEC>(dst + i, y1);
      store_vec<T, VEC>(dst + half + i, y2);
    } else {
      const int c = item - n_rot;
      const int h = c / chunks;
      const int off = h * d + (c - h * chunks) * VEC;
      *reinterpret_cast<Vec<T, VEC>*>(v_dst + off) = *reinterpret_cast<const Vec<T, VEC>*>(v + off);
    }
  }
}

template <typename T, int VEC>
cudaError_t launch_vec(const RopeKVWriteParams& p, cudaStream_t stream) {
  const int per_head_rot = p.head_dim / 2 / VEC;
  const int items = (p.num_q_heads + p.num_kv_heads) * per_head_rot + p.num_kv_heads * (p.head_dim / VEC);
  const int threads = std::min(kMaxThreads, std::max(32, (items + 31) / 32 * 32));
  rope_kv_write_kernel<T, VEC><<<static_cast<unsigned int>(p.num_tokens), threads, 0, stream>>>(p);
  return cudaGetLastError();
}

// Widest VEC (elements, at most 16 bytes) such that every pointer is VEC-aligned and every
// offset the kernel adds (D/2, row strides, slot strides) is a multiple of VEC.
template <typename T>
int pick_vec(const RopeKVWriteParams& p) {
  for (int vec = 16 / static_cast<int>(sizeof(T)); vec > 1; vec /= 2) {
    const int64_t bytes = vec * static_cast<int64_t>(sizeof(T));
    const bool ptrs_ok = is_aligned(p.q, bytes) && is_aligned(p.k, bytes) && is_aligned(p.v, bytes) &&
                         is_aligned(p.cos, bytes) && is_aligned(p.sin, bytes) && is_aligned(p.q_out, bytes) &&
                         is_aligned(p.k_cache, bytes) && is_aligned(p.v_cache, bytes);
    const bool strides_ok = (p.head_dim / 2) % vec == 0 && p.q_row_stride % vec == 0 &&
                            p.k_row_stride % vec == 0 && p.v_row_stride % vec == 0 &&
                            p.cos_row_stride % vec == 0 && p.sin_row_stride % vec == 0 &&
                            p.k_cache_slot_stride % vec == 0 && p.v_cache_slot_stride % vec == 0;
    if (ptrs_ok && strides_ok) return vec;
  }
  return 1;
}

template <typename T>
cudaError_t launch_typed(const RopeKVWriteParams& p, cudaStream_t stream) {
  switch (pick_vec<T>(p)) {
    case 8:
      if constexpr (sizeof(T) <= 2) return launch_vec<T, 8>(p, stream);
      break;
    case 4:
      return launch_vec<T, 4>(p, stream);
    case 2:
      return launch_vec<T, 2>(p, stream);
    default:
      return launch_vec<T, 1>(p, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace

cudaError_t launch_rope_kv_write(const RopeKVWriteParams& params, DType dtype, cudaStream_t stream) {
  if (params.head_dim <= 0 || params.head_dim % 2 != 0 || params.num_q_heads < 0 || params.num_kv_heads < 0 ||
      params.num_tokens < 0 || params.num_tokens > 0x7fffffff) {
    return cudaErrorInvalidValue;
  }
  if (params.num_tokens == 0) return cudaSuccess;
  switch (dtype) {
    case DType::kFloat32:
      return launch_typed<float>(params, stream);
    case DType::kFloat16:
      return launch_typed<__half>(params, stream);
    case DType::kBFloat16:
      return launch_typed<__nv_bfloat16>(params, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace pasta
