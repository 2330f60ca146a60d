// Torch binding of the pasta-engine CUDA kernels: TORCH_LIBRARY(pasta_engine) with
//   torch.ops.pasta_engine.rope_kv_write(q, k, v, cos, sin, k_cache, v_cache, slot_mapping) -> q_out
//   torch.ops.pasta_engine.lse_merge(part_o, part_lse, row_indptr, row_parts, out, out_lse) -> ()
// Built by CMakeLists.txt into pasta_engine/_C.so (loaded by pasta_engine/csrc_ops.py through
// torch.ops.load_library). Every op checks shapes, dtypes, strides and devices with a
// TORCH_CHECK naming the bad argument, then launches on the current CUDA stream with no host
// synchronization and no allocation except rope_kv_write's returned q_out, so both ops can be
// captured in a CUDA graph. Semantics: csrc/kernels/rope_kv_write.cuh, csrc/kernels/lse_merge.cuh.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <optional>

#include "kernels/lse_merge.cuh"
#include "kernels/rope_kv_write.cuh"

namespace {

using pasta::DType;

void check_device(const at::Tensor& t, const at::Tensor& ref, const char* op, const char* name, const char* ref_name) {
  TORCH_CHECK(t.is_cuda(), op, ": ", name, " must be a CUDA tensor, got device ", t.device());
  TORCH_CHECK(t.device() == ref.device(), op, ": ", name, " is on ", t.device(), " but ", ref_name, " is on ",
              ref.device());
}

// torch.<dtype> spelling, as Python users know them.
const char* dtype_name(at::ScalarType st) {
  switch (st) {
    case at::kFloat: return "torch.float32";
    case at::kHalf: return "torch.float16";
    case at::kBFloat16: return "torch.bfloat16";
    case at::kInt: return "torch.int32";
    case at::kLong: return "torch.int64";
    default: return c10::toString(st);
  }
}

void check_dtype(const at::Tensor& t, at::ScalarType want, const char* op, const char* name, const char* why) {
  TORCH_CHECK(t.scalar_type() == want, op, ": ", name, " must be ", dtype_name(want), " (", why, "), got ",
              dtype_name(t.scalar_type()));
}

DType kernel_dtype(const at::Tensor& t, const char* op, const char* name) {
  const auto st = t.scalar_type();
  TORCH_CHECK(st == at::kFloat || st == at::kHalf || st == at::kBFloat16, op, ": ", name,
              " must be torch.float32, torch.float16 or torch.bfloat16, got ", dtype_name(st));
  return st == at::kFloat ? DType::kFloat32 : (st == at::kHalf ? DType::kFloat16 : DType::kBFloat16);
}

// [T, H, D] with every token's [H, D] contiguous (strides [row, D, 1]); any row stride.
void check_token_major(const at::Tensor& t, int64_t T, int64_t D, const char* op, const char* name,
                       const char* shape) {
  TORCH_CHECK(t.dim() == 3, op, ": ", name, " must be 3-D ", shape, ", got shape ", t.sizes());
  TORCH_CHECK(t.size(0) == T && t.size(2) == D, op, ": ", name, " must be ", shape, " with T=", T, ", D=", D,
              ", got shape ", t.sizes());
  TORCH_CHECK(t.size(1) <= 1 || t.stride(1) == D, op, ": ", name,
              " must be contiguous within a token (strides [row, D, 1]), got strides ", t.strides());
  TORCH_CHECK(t.stride(2) == 1 || D == 1, op, ": ", name, " must have a contiguous last dim, got strides ",
              t.strides());
}

struct CacheView {
  int64_t num_slots;
  int64_t slot_stride;
};

// k_cache / v_cache: [num_slots, Hkv, D] or [num_pages, page_size, Hkv, D] (flattened to slots).
CacheView cache_view(const at::Tensor& c, int64_t hkv, int64_t d, const char* name) {
  const char* op = "rope_kv_write";
  TORCH_CHECK(c.dim() == 3 || c.dim() == 4, op, ": ", name,
              " must be [num_slots, Hkv, D] or [num_pages, page_size, Hkv, D], got shape ", c.sizes());
  TORCH_CHECK(c.size(-2) == hkv && c.size(-1) == d, op, ": ", name, " must end in [Hkv, D] = [", hkv, ", ", d,
              "] like k, got shape ", c.sizes());
  TORCH_CHECK(c.stride(-1) == 1 && (hkv <= 1 || c.stride(-2) == d), op, ": ", name,
              " must be contiguous within a slot (strides [..., D, 1]), got strides ", c.strides());
  if (c.dim() == 3) return {c.size(0), c.stride(0)};
  const int64_t pages = c.size(0), page_size = c.size(1);
  if (page_size == 1) return {pages, c.stride(0)};
  TORCH_CHECK(pages <= 1 || c.stride(0) == page_size * c.stride(1), op, ": ", name,
              " pages must be evenly spaced slots (stride(0) == page_size * stride(1)), got shape ", c.sizes(),
              " strides ", c.strides());
  return {pages * page_size, c.stride(1)};
}

void check_launch(cudaError_t err, const char* op) {
  TORCH_CHECK(err == cudaSuccess, op, ": kernel launch failed: ", cudaGetErrorString(err));
}

at::Tensor rope_kv_write(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& cos,
                         const at::Tensor& sin, const at::Tensor& k_cache, const at::Tensor& v_cache,
                         const at::Tensor& slot_mapping) {
  const char* op = "rope_kv_write";
  check_device(q, q, op, "q", "q");
  TORCH_CHECK(q.dim() == 3, op, ": q must be 3-D [T, Hq, D], got shape ", q.sizes());
  TORCH_CHECK(k.dim() == 3, op, ": k must be 3-D [T, Hkv, D], got shape ", k.sizes());
  const int64_t T = q.size(0), hq = q.size(1), D = q.size(2), hkv = k.size(1);
  TORCH_CHECK(D > 0 && D % 2 == 0, op, ": head_dim D must be even and positive, got q shape ", q.sizes());
  const DType dtype = kernel_dtype(q, op, "q");
  check_token_major(q, T, D, op, "q", "[T, Hq, D]");
  check_token_major(k, T, D, op, "k", "[T, Hkv, D]");
  check_token_major(v, T, D, op, "v", "[T, Hkv, D]");
  TORCH_CHECK(v.size(1) == hkv, op, ": v must have the shape of k ", k.sizes(), ", got ", v.sizes());
  for (const auto& [t, name] : {std::pair<const at::Tensor&, const char*>{cos, "cos"}, {sin, "sin"}}) {
    TORCH_CHECK(t.dim() == 2 && t.size(0) == T && t.size(1) == D, op, ": ", name, " must be [T, D] = [", T, ", ", D,
                "], got shape ", t.sizes());
    TORCH_CHECK(t.stride(1) == 1, op, ": ", name, " must have a contiguous last dim, got strides ", t.strides());
  }
  const CacheView kc = cache_view(k_cache, hkv, D, "k_cache");
  const CacheView vc = cache_view(v_cache, hkv, D, "v_cache");
  TORCH_CHECK(kc.num_slots == vc.num_slots, op, ": k_cache and v_cache must have the same slots, got shapes ",
              k_cache.sizes(), " and ", v_cache.sizes());
  TORCH_CHECK(slot_mapping.dim() == 1 && slot_mapping.size(0) == T, op, ": slot_mapping must be [T] = [", T,
              "], got shape ", slot_mapping.sizes());
  check_dtype(slot_mapping, at::kLong, op, "slot_mapping", "cache slot per token");
  TORCH_CHECK(slot_mapping.stride(0) == 1 || T <= 1, op, ": slot_mapping must be contiguous");
  const at::ScalarType st = q.scalar_type();
  const std::pair<const at::Tensor*, const char*> same[] = {
      {&k, "k"}, {&v, "v"}, {&cos, "cos"}, {&sin, "sin"}, {&k_cache, "k_cache"}, {&v_cache, "v_cache"}};
  for (const auto& [t, name] : same) {
    check_dtype(*t, st, op, name, "the dtype of q");
    check_device(*t, q, op, name, "q");
  }
  check_device(slot_mapping, q, op, "slot_mapping", "q");

  const c10::cuda::CUDAGuard guard(q.device());
  at::Tensor q_out = at::empty({T, hq, D}, q.options().memory_format(at::MemoryFormat::Contiguous));
  pasta::RopeKVWriteParams p{};
  p.q = q.const_data_ptr();
  p.q_row_stride = q.stride(0);
  p.k = k.const_data_ptr();
  p.k_row_stride = k.stride(0);
  p.v = v.const_data_ptr();
  p.v_row_stride = v.stride(0);
  p.cos = cos.const_data_ptr();
  p.cos_row_stride = cos.stride(0);
  p.sin = sin.const_data_ptr();
  p.sin_row_stride = sin.stride(0);
  p.q_out = q_out.data_ptr();
  p.k_cache = k_cache.data_ptr();
  p.k_cache_slot_stride = kc.slot_stride;
  p.v_cache = v_cache.data_ptr();
  p.v_cache_slot_stride = vc.slot_stride;
  p.num_slots = kc.num_slots;
  p.slot_mapping = slot_mapping.const_data_ptr<int64_t>();
  p.num_tokens = T;
  p.num_q_heads = static_cast<int32_t>(hq);
  p.num_kv_heads = static_cast<int32_t>(hkv);
  p.head_dim = static_cast<int32_t>(D);
  check_launch(pasta::launch_rope_kv_write(p, dtype, c10::cuda::getCurrentCUDAStream(q.get_device()).stream()), op);
  return q_out;
}

void lse_merge(const at::Tensor& part_o, const at::Tensor& part_lse, const at::Tensor& row_indptr,
               const at::Tensor& row_parts, const at::Tensor& out, const std::optional<at::Tensor>& out_lse) {
  const char* op = "lse_merge";
  check_device(out, out, op, "out", "out");
  TORCH_CHECK(out.dim() == 3, op, ": out must be 3-D [R, H, D], got shape ", out.sizes());
  const int64_t R = out.size(0), H = out.size(1), D = out.size(2);
  TORCH_CHECK(H > 0 && D > 0 && D <= 1024, op, ": out must have 1 <= H and 1 <= D <= 1024, got shape ", out.sizes());
  const DType dtype = kernel_dtype(out, op, "out");
  TORCH_CHECK(out.stride(2) == 1 || D == 1, op, ": out must have a contiguous last dim, got strides ",
              out.strides());
  TORCH_CHECK(part_o.dim() == 3 && part_o.size(1) == H && part_o.size(2) == D, op,
              ": part_o must be [S, H, D] with H=", H, ", D=", D, " (from out), got shape ", part_o.sizes());
  TORCH_CHECK(part_o.stride(2) == 1 || D == 1, op, ": part_o must have a contiguous last dim, got strides ",
              part_o.strides());
  const int64_t S = part_o.size(0);
  TORCH_CHECK(part_lse.dim() == 2 && part_lse.size(0) == S && part_lse.size(1) == H, op,
              ": part_lse must be [S, H] = [", S, ", ", H, "], got shape ", part_lse.sizes());
  TORCH_CHECK(row_indptr.dim() == 1 && row_indptr.size(0) == R + 1, op, ": row_indptr must be [R + 1] = [", R + 1,
              "] (R from out), got shape ", row_indptr.sizes());
  TORCH_CHECK(row_parts.dim() == 1, op, ": row_parts must be 1-D [nnz], got shape ", row_parts.sizes());
  check_dtype(part_o, at::kFloat, op, "part_o", "fp32 partial outputs");
  check_dtype(part_lse, at::kFloat, op, "part_lse", "fp32 natural-log LSE");
  check_dtype(row_indptr, at::kInt, op, "row_indptr", "int32 CSR offsets");
  check_dtype(row_parts, at::kInt, op, "row_parts", "int32 part indices");
  TORCH_CHECK(row_indptr.is_contiguous() && row_parts.is_contiguous(), op,
              ": row_indptr and row_parts must be contiguous");
  const std::pair<const at::Tensor*, const char*> tensors[] = {
      {&part_o, "part_o"}, {&part_lse, "part_lse"}, {&row_indptr, "row_indptr"}, {&row_parts, "row_parts"}};
  for (const auto& [t, name] : tensors) check_device(*t, out, op, name, "out");
  if (out_lse.has_value()) {
    const at::Tensor& ol = *out_lse;
    TORCH_CHECK(ol.dim() == 2 && ol.size(0) == R && ol.size(1) == H, op, ": out_lse must be [R, H] = [", R, ", ",
                H, "], got shape ", ol.sizes());
    check_dtype(ol, at::kFloat, op, "out_lse", "fp32 natural-log LSE");
    check_device(ol, out, op, "out_lse", "out");
  }

  const c10::cuda::CUDAGuard guard(out.device());
  pasta::LseMergeParams p{};
  p.part_o = part_o.const_data_ptr<float>();
  p.part_o_stride_s = part_o.stride(0);
  p.part_o_stride_h = part_o.stride(1);
  p.part_lse = part_lse.const_data_ptr<float>();
  p.part_lse_stride_s = part_lse.stride(0);
  p.part_lse_stride_h = part_lse.stride(1);
  p.num_parts = S;
  p.row_indptr = row_indptr.const_data_ptr<int32_t>();
  p.row_parts = row_parts.const_data_ptr<int32_t>();
  p.out = out.data_ptr();
  p.out_stride_r = out.stride(0);
  p.out_stride_h = out.stride(1);
  if (out_lse.has_value()) {
    p.out_lse = out_lse->data_ptr<float>();
    p.out_lse_stride_r = out_lse->stride(0);
    p.out_lse_stride_h = out_lse->stride(1);
  }
  p.num_rows = R;
  p.num_heads = static_cast<int32_t>(H);
  p.head_dim = static_cast<int32_t>(D);
  check_launch(pasta::launch_lse_merge(p, dtype, c10::cuda::getCurrentCUDAStream(out.get_device()).stream()), op);
}

}  // namespace

TORCH_LIBRARY(pasta_engine, m) {
  m.def(
      "rope_kv_write(Tensor q, Tensor k, Tensor v, Tensor cos, Tensor sin, Tensor(a!) k_cache, "
      "Tensor(b!) v_cache, Tensor slot_mapping) -> Tensor");
  m.def(
      "lse_merge(Tensor part_o, Tensor part_lse, Tensor row_indptr, Tensor row_parts, Tensor(a!) out, "
      "Tensor? out_lse) -> ()");
}

TORCH_LIBRARY_IMPL(pasta_engine, CUDA, m) {
  m.impl("rope_kv_write", &rope_kv_write);
  m.impl("lse_merge", &lse_merge);
}
