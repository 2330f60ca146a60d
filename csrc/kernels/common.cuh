// Host-side declarations shared by the pasta-engine CUDA kernels and their torch binding.
//
// Everything in csrc/kernels/ is free of torch headers, so nvcc compiles it on any machine
// (CI has nvcc but no GPU and a CPU-only torch). Only csrc/torch_ops.cpp includes torch.
// This header must stay includable from a plain host C++ compiler: no device code here.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace pasta {

// Element type of the activation / KV tensors a kernel reads and writes. Math is always fp32.
enum class DType : int32_t { kFloat32 = 0, kFloat16 = 1, kBFloat16 = 2 };

}  // namespace pasta
