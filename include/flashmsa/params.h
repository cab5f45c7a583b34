// Plain parameter structs of every flashmsa op, free of any framework type.
//
// The GoogleTest suites, the `flashmsa` CLI, the benchmarks and the PyTorch binding all fill these
// same structs and hand them to the entry points in api.h. Names and formulas follow SPEC.md; the
// maths and the layouts are written out in docs/design.md.
//
// Tensor convention: every 4-D activation is addressed as [batch, seq, heads, dim] through a
// TensorRef (pointer + three 64-bit element strides; the last dim is contiguous). The FlashAttention
// layout [B, S, H, D] and the [B, H, S, D] layout are both expressed by choosing the strides, so no
// caller ever copies. Outputs written by flashmsa with a fixed layout (block_idx, lse, proxy_lse)
// are contiguous in the order their shape comment gives.
#pragma once

#include <cmath>
#include <cstdint>

#include <cuda_runtime_api.h>

namespace flashmsa {

constexpr int kBlockSize = 128;  // Bk: tokens per KV block (SPEC.md)
constexpr int kMaxTopK = 64;     // K ≤ 64 blocks per (query, proxy head)

// The softmax scale in effect: `scale` (σ or σp of the structs below), or dim^-1/2 where it is 0.
inline double effective_scale(float scale, int64_t dim) {
  return scale != 0.f ? double(scale) : 1.0 / std::sqrt(double(dim));
}

enum class DType : int { kBF16 = 0, kFP16 = 1 };

enum class Mode : int {
  kSparse = 0,  // main branch over the selected blocks (SPEC.md §2)
  kWarmup = 1,  // main branch dense causal, KL over all visible tokens (SPEC.md §5)
};

// A strided view of a [batch, seq, heads, dim] tensor; strides are in elements, dim is contiguous.
struct TensorRef {
  void* ptr = nullptr;
  int64_t batch_stride = 0;
  int64_t seq_stride = 0;
  int64_t head_stride = 0;
};

// Sizes shared by every op. Head maps (SPEC.md): main head h -> kv head h / (H/Hkv) and proxy head
// h / (H/Hp); proxy head p -> proxy key head p / (Hp/Hpk).
struct ProblemShape {
  int64_t batch = 0;             // B
  int64_t seqlen = 0;            // S (need not be a multiple of 128)
  int num_heads = 0;             // H
  int num_kv_heads = 0;          // Hkv
  int num_proxy_heads = 0;       // Hp
  int num_proxy_kv_heads = 0;    // Hpk
  int head_dim = 128;            // D
  int proxy_head_dim = 128;      // Di
  int top_k = 0;                 // K, blocks kept per (query, proxy head)

  int64_t num_blocks() const { return (seqlen + kBlockSize - 1) / kBlockSize; }
  int gqa_ratio() const { return num_heads / num_kv_heads; }                    // G
  int heads_per_proxy() const { return num_heads / num_proxy_heads; }           // M
  int proxy_ratio() const { return num_proxy_heads / num_proxy_kv_heads; }      // R
};

// ---------------------------------------------------------------------------------------------
// §1 Index branch: block scores, forced local block, top-K.
// ---------------------------------------------------------------------------------------------
struct SelectParams {
  ProblemShape shape;
  DType dtype = DType::kBF16;
  float proxy_scale = 0.f;  // σp; 0 means Di^-1/2

  TensorRef q_proxy;   // [b, s, hp, di]
  TensorRef k_proxy;   // [b, s, hpk, di]
  int32_t* block_idx = nullptr;  // [b, hp, s, k] contiguous; descending score, -1 in empty slots
};

// ---------------------------------------------------------------------------------------------
// Schedule: the reverse index (per KV block, the query rows that chose it) built on the device.
// The layout inside the workspace is private to the kernels (docs/design.md "Schedule").
// ---------------------------------------------------------------------------------------------
struct ScheduleParams {
  ProblemShape shape;
  const int32_t* block_idx = nullptr;  // [b, hp, s, k] from select
  void* workspace = nullptr;           // schedule_workspace_size() bytes, device memory
};

// ---------------------------------------------------------------------------------------------
// §2-§3 Main-branch forward (sparse or warmup) with the proxy LSE and the KL value.
// ---------------------------------------------------------------------------------------------
struct ForwardParams {
  ProblemShape shape;
  DType dtype = DType::kBF16;
  Mode mode = Mode::kSparse;
  float softmax_scale = 0.f;  // σ; 0 means D^-1/2
  float proxy_scale = 0.f;    // σp; 0 means Di^-1/2
  // Warmup mode only: false leaves the dense main branch to another kernel (e.g. cuDNN's fused
  // attention). The forward then writes proxy_lse alone (v, out and lse are not touched and may be
  // null); the backward reads lse, the caller's natural-log [b, h, s] LSE of dense causal
  // attention, and writes only the KL value and dq_proxy, dk_proxy (dout, dq, dk, dv, out and v are
  // not touched and may be null). Non-deterministic (fp32 atomics); H/Hp ∈ {2, 4, 8, 16}.
  bool main_branch = true;

  TensorRef q;        // [b, s, h, d]
  TensorRef k;        // [b, s, hkv, d]
  TensorRef v;        // [b, s, hkv, d]
  TensorRef q_proxy;  // [b, s, hp, di]
  TensorRef k_proxy;  // [b, s, hpk, di]
  // [b, hp, s, k]; ignored in warmup mode. Each row names a block at most once (select() writes
  // distinct blocks; -1 marks an empty slot): the wgmma kernels count a repeated block twice.
  // The GPU path does not read the values on the host (that would be a synchronisation), so an
  // entry outside [-1, NB) gives undefined results there; the CPU reference rejects it.
  const int32_t* block_idx = nullptr;
  const void* schedule = nullptr;      // ScheduleParams::workspace after schedule(); sparse mode

  TensorRef out;                 // [b, s, h, d], input dtype
  float* lse = nullptr;          // [b, h, s] fp32, natural log
  float* proxy_lse = nullptr;    // [b, hp, s] fp32: log Σ_{j∈T} exp(s_pij)
  float* kl = nullptr;           // [1] fp32 device scalar: L_KL of SPEC.md §3; may be null
  void* workspace = nullptr;     // forward_workspace_size() bytes, device memory
};

// ---------------------------------------------------------------------------------------------
// §3-§4 Backward: main gradients and the KL gradient to the proxy heads.
// ---------------------------------------------------------------------------------------------
struct BackwardParams {
  ForwardParams fwd;         // the forward's inputs and saved outputs (out, lse, proxy_lse)
  TensorRef dout;            // [b, s, h, d]
  const float* kl_grad = nullptr;  // [1] fp32 device scalar ḡ = ∂loss/∂L_KL; null means 0
  bool deterministic = false;

  TensorRef dq;        // [b, s, h, d]
  TensorRef dk;        // [b, s, hkv, d]
  TensorRef dv;        // [b, s, hkv, d]
  TensorRef dq_proxy;  // [b, s, hp, di]
  TensorRef dk_proxy;  // [b, s, hpk, di]
  void* workspace = nullptr;  // backward_workspace_size() bytes, device memory
};

}  // namespace flashmsa
