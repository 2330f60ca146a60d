// Device helpers for the pasta-engine kernels: fp16/bf16/fp32 <-> fp32 conversion and
// vectorized (up to 16-byte) loads and stores. Included only by .cu files.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "common.cuh"

namespace pasta {

template <typename T>
__device__ __forceinline__ float to_float(T x);
template <>
__device__ __forceinline__ float to_float<float>(float x) { return x; }
template <>
__device__ __forceinline__ float to_float<__half>(__half x) { return __half2float(x); }
template <>
__device__ __forceinline__ float to_float<__nv_bfloat16>(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T>
__device__ __forceinline__ T from_float(float x);
template <>
__device__ __forceinline__ float from_float<float>(float x) { return x; }
template <>
__device__ __forceinline__ __half from_float<__half>(float x) { return __float2half_rn(x); }
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }

// N elements of T moved as one aligned access (N * sizeof(T) <= 16 bytes: one LDG/STG.128).
template <typename T, int N>
struct alignas(sizeof(T) * N) Vec {
  T val[N];
};

// Loads N consecutive elements at `ptr` (aligned to N * sizeof(T)) as fp32.
template <typename T, int N>
__device__ __forceinline__ void load_vec(const T* __restrict__ ptr, float (&out)[N]) {
  const Vec<T, N> v = *reinterpret_cast<const Vec<T, N>*>(ptr);
#pragma unroll
  for (int i = 0; i < N; ++i) out[i] = to_float<T>(v.val[i]);
}

// Stores N fp32 values, rounded to T (round to nearest even), at `ptr` (aligned to N * sizeof(T)).
template <typename T, int N>
__device__ __forceinline__ void store_vec(T* __restrict__ ptr, const float (&in)[N]) {
  Vec<T, N> v;
#pragma unroll
  for (int i = 0; i < N; ++i) v.val[i] = from_float<T>(in[i]);
  *reinterpret_cast<Vec<T, N>*>(ptr) = v;
}

// Host: whether `ptr` is aligned to `bytes` (a null pointer counts as aligned: absent operand).
inline bool is_aligned(const void* ptr, int64_t bytes) {
  return reinterpret_cast<uintptr_t>(ptr) % static_cast<uintptr_t>(bytes) == 0;
}

}  // namespace pasta
