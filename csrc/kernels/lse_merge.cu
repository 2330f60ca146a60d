// Log-sum-exp merge of split-KV partials. Semantics and sources: lse_merge.cuh.
//
// Grid (R, ceil(H / heads_per_block)); block (D / VEC, heads_per_block): thread (x, y) owns
// VEC consecutive elements of head blockIdx.y * heads_per_block + y of row blockIdx.x. Two
// passes over the row's parts: the max of their lse (a few scalars, shared by the warp through
// L1), then the weighted sum of their o, each weight exp(lse_i - M) <= 1 so nothing overflows.
// FlashInfer's merge kernels keep an online (running max) state instead; with the parts' lse
// being a few bytes each, the two-pass form reads o exactly once as well and needs no rescaling.
#include <math.h>

#include <algorithm>

#include "lse_merge.cuh"
#include "vec_utils.cuh"

namespace pasta {
namespace {

constexpr int kThreadsPerBlock = 128;

template <typename T, int VEC>
__global__ void __launch_bounds__(1024) lse_merge_kernel(const LseMergeParams p) {
  const int64_t r = blockIdx.x;
  const int h = blockIdx.y * blockDim.y + threadIdx.y;
  if (h >= p.num_heads) return;
  const int e0 = threadIdx.x * VEC;
  const int begin = p.row_indptr[r];
  const int end = p.row_indptr[r + 1];
  const int32_t* __restrict__ parts = p.row_parts;
  const float* __restrict__ part_lse = p.part_lse;
  const float* __restrict__ part_o = p.part_o;

  float m = -INFINITY;
  for (int i = begin; i < end; ++i) {
    const int s = parts[i];
    if (s < 0 || s >= p.num_parts) continue;
    m = fmaxf(m, part_lse[s * p.part_lse_stride_s + h * p.part_lse_stride_h]);
  }

  float acc[VEC];
#pragma unroll
  for (int e = 0; e < VEC; ++e) acc[e] = 0.f;
  float denom = 0.f;
  if (m > -INFINITY) {
    for (int i = begin; i < end; ++i) {
      const int s = parts[i];
      if (s < 0 || s >= p.num_parts) continue;
      const float w = expf(part_lse[s * p.part_lse_stride_s + h * p.part_lse_stride_h] - m);
      if (!(w > 0.f)) continue;  // empty part (lse = -inf): its o is never read
      float o[VEC];
      load_vec<float, VEC>(part_o + s * p.part_o_stride_s + h * p.part_o_stride_h + e0, o);
      denom += w;
#pragma unroll
      for (int e = 0; e < VEC; ++e) acc[e] = fmaf(w, o[e], acc[e]);
    }
  }
  const float inv = denom > 0.f ? 1.f / denom : 0.f;
#pragma unroll
  for (int e = 0; e < VEC; ++e) acc[e] *= inv;
  T* out = static_cast<T*>(p.out) + r * p.out_stride_r + h * p.out_stride_h + e0;
  store_vec<T, VEC>(out, acc);
  if (p.out_lse != nullptr && threadIdx.x == 0) {
    p.out_lse[r * p.out_lse_stride_r + h * p.out_lse_stride_h] = denom > 0.f ? m + logf(denom) : -INFINITY;
  }
}

template <typename T, int VEC>
cudaError_t launch_vec(const LseMergeParams& p, cudaStream_t stream) {
  const int bdx = p.head_dim / VEC;
  const int bdy = std::max(1, std::min<int>(p.num_heads, kThreadsPerBlock / bdx));
  const dim3 grid(static_cast<unsigned int>(p.num_rows), static_cast<unsigned int>((p.num_heads + bdy - 1) / bdy));
  lse_merge_kernel<T, VEC><<<grid, dim3(bdx, bdy), 0, stream>>>(p);
  return cudaGetLastError();
}

// Widest VEC (at most 4: one 16-byte fp32 load of part_o) that the pointers and strides allow.
template <typename T>
int pick_vec(const LseMergeParams& p) {
  for (int vec = 4; vec > 1; vec /= 2) {
    const bool ok = p.head_dim % vec == 0 && is_aligned(p.part_o, vec * 4) &&
                    is_aligned(p.out, vec * static_cast<int64_t>(sizeof(T))) && p.part_o_stride_s % vec == 0 &&
                    p.part_o_stride_h % vec == 0 && p.out_stride_r % vec == 0 && p.out_stride_h % vec == 0;
    if (ok) return vec;
  }
  return 1;
}

template <typename T>
cudaError_t launch_typed(const LseMergeParams& p, cudaStream_t stream) {
  switch (pick_vec<T>(p)) {
    case 4:
      return launch_vec<T, 4>(p, stream);
    case 2:
      return launch_vec<T, 2>(p, stream);
    default:
      return launch_vec<T, 1>(p, stream);
  }
}

}  // namespace

cudaError_t launch_lse_merge(const LseMergeParams& params, DType dtype, cudaStream_t stream) {
  if (params.head_dim <= 0 || params.head_dim > 1024 || params.num_heads <= 0 || params.num_rows < 0 ||
      params.num_rows > 0x7fffffff) {
    return cudaErrorInvalidValue;
  }
  if (params.num_rows == 0) return cudaSuccess;
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
