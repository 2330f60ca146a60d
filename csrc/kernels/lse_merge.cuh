// Log-sum-exp merge of split-KV attention partials (host API; the kernel is in lse_merge.cu).
//
// Split-KV decoding (FlashDecoding: Dao, Haziza, Massa, Sizov, "Flash-Decoding for long-context
// inference", 2023) computes attention of one query row over S disjoint pieces of its keys; piece
// i gives o_i = softmax(q K_i^T) V_i and lse_i = log sum_j exp(q k_j) (natural log). The exact
// attention over all pieces is
//   M   = max_i lse_i
//   out = sum_i exp(lse_i - M) o_i / sum_i exp(lse_i - M)
//   lse = M + log sum_i exp(lse_i - M)
// This is FlashInfer's "merge_states" (include/flashinfer/attention/cascade.cuh,
// VariableLengthMergeStates), with natural-log LSE (FlashInfer uses base 2) and an indirection
// through row_parts (partial indices) so that the partials of a row need not be contiguous.
//
// A part with lse == -inf (an empty piece) has weight 0 and its o is never read, so it may hold
// anything (even NaN). A row with no parts, or only -inf parts, gets out = 0 and lse = -inf.
// Partial indices outside [0, num_parts) are ignored.
#pragma once

#include <cstdint>

#include "common.cuh"

namespace pasta {

struct LseMergeParams {
  const float* part_o;   // [S, H, D] fp32; D contiguous
  int64_t part_o_stride_s;
  int64_t part_o_stride_h;
  const float* part_lse;  // [S, H] fp32, natural log
  int64_t part_lse_stride_s;
  int64_t part_lse_stride_h;
  int64_t num_parts;            // S
  const int32_t* row_indptr;    // [R + 1]: the parts of row r are row_parts[row_indptr[r] : row_indptr[r+1]]
  const int32_t* row_parts;     // [nnz]
  void* out;                    // [R, H, D] element type `dtype`; D contiguous
  int64_t out_stride_r;
  int64_t out_stride_h;
  float* out_lse;               // [R, H] fp32, or nullptr
  int64_t out_lse_stride_r;
  int64_t out_lse_stride_h;
  int64_t num_rows;             // R
  int32_t num_heads;            // H
  int32_t head_dim;             // D
};

// Enqueues the kernel on `stream` (no host synchronization, no allocation: CUDA-graph
// capturable). Returns cudaErrorInvalidValue for an unsupported dtype, head_dim <= 0 or
// > 1024, or num_heads <= 0, otherwise the launch status. R == 0 launches nothing.
cudaError_t launch_lse_merge(const LseMergeParams& params, DType dtype, cudaStream_t stream);

}  // namespace pasta
