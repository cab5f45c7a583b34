// Warmup mode's dense main branch on cuDNN (warmup_cudnn.cpp), for cuda_ops.cpp.
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>

#include "flashmsa/params.h"

namespace flashmsa::torch_binding {

// Whether the CUDA ops run warmup mode's main branch on cuDNN (warmup_cudnn.cpp says when).
bool warmup_main_on_cudnn(const ProblemShape& shape, bool deterministic);

struct CudnnForward {
  at::Tensor out;  // [b, s, h, d] contiguous, input dtype
  at::Tensor lse;  // [b, h, s] fp32, natural log
};
// Dense causal attention of q [b, s, h, d] over k, v [b, s, hkv, d] (any strides, last dim
// contiguous). Both calls return nullopt, with a warning once, where cuDNN refuses the problem
// (e.g. an older cuDNN); the caller then runs flashmsa's own dense kernels.
std::optional<CudnnForward> cudnn_dense_forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                 const ProblemShape& shape, double softmax_scale);

struct CudnnGradients {
  at::Tensor dq, dk, dv;  // sizes and strides of q, k, v (for dense inputs)
};
std::optional<CudnnGradients> cudnn_dense_backward(const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k,
                                    const at::Tensor& v, const at::Tensor& out, const at::Tensor& lse,
                                    const ProblemShape& shape, double softmax_scale);

}  // namespace flashmsa::torch_binding
