// Benchmark of the select stage (SPEC.md §1): the fused index-branch kernel on random Gaussian
// proxies, per named config and sequence length (B = 1). Counted FLOPs are the causal score matmul,
// 2 · Di · Hp · S² / 2; the note gives the speed-up over eager PyTorch selection (SPEC.md anchors).
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdio>
#include <map>
#include <string>
#include <vector>

#include "bench.h"
#include "common/cases.h"
#include "flashmsa/api.h"

namespace flashmsa::bench {
namespace {

// N(0, 1) bf16 values from a counter-based hash (Box-Muller), so inputs are never zeros.
__global__ void fill_gaussian(__nv_bfloat16* data, int64_t count, uint64_t seed) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < count;
       i += int64_t(gridDim.x) * blockDim.x) {
    uint64_t x = uint64_t(i) * 0x9E3779B97F4A7C15ull + seed * 0xD1B54A32D192ED03ull;
    x ^= x >> 31;
    x *= 0xBF58476D1CE4E5B9ull;
    x ^= x >> 29;
    const float u1 = (float(uint32_t(x >> 40)) + 1.f) * (1.f / 16777217.f);
    const float u2 = float(uint32_t(x) & 0xFFFFFF) * (1.f / 16777216.f);
    data[i] = __float2bfloat16(sqrtf(-2.f * logf(u1)) * cospif(2.f * u2));
  }
}

// Eager PyTorch selection on the H200, paper config (SPEC.md): milliseconds by sequence length.
const std::map<int64_t, double> kEagerMs = {{8192, 2.2}, {32768, 34.0}, {131072, 528.0}};

void bench_one(const cases::HeadConfig& config, const std::string& label, int top_k, int64_t seqlen,
               const Options& options, std::vector<Row>& rows) {
  ProblemShape shape = cases::make_shape(config, 1, seqlen);
  shape.top_k = top_k;
  testing::DeviceBuffer<__nv_bfloat16> q_proxy(shape.seqlen * shape.num_proxy_heads * shape.proxy_head_dim);
  testing::DeviceBuffer<__nv_bfloat16> k_proxy(shape.seqlen * shape.num_proxy_kv_heads * shape.proxy_head_dim);
  testing::DeviceBuffer<int32_t> block_idx(shape.num_proxy_heads * shape.seqlen * shape.top_k);
  fill_gaussian<<<1024, 256>>>(q_proxy.get(), int64_t(q_proxy.size()), 1);
  fill_gaussian<<<1024, 256>>>(k_proxy.get(), int64_t(k_proxy.size()), 2);
  FLASHMSA_CUDA_CHECK(cudaGetLastError());

  SelectParams params;
  params.shape = shape;
  params.dtype = DType::kBF16;
  params.q_proxy = cases::bshd(q_proxy.get(), shape, shape.num_proxy_heads, shape.proxy_head_dim);
  params.k_proxy = cases::bshd(k_proxy.get(), shape, shape.num_proxy_kv_heads, shape.proxy_head_dim);
  params.block_idx = block_idx.get();
  cudaStream_t stream = nullptr;
  const Status status = select(params, stream);
  if (!status.ok()) {
    std::fprintf(stderr, "select %s S=%lld: %s\n", label.c_str(), static_cast<long long>(seqlen),
                 status.message.c_str());
    return;
  }
  const double ms = time_median_ms([&](cudaStream_t s) { select(params, s); }, stream, options.warmup,
                                   options.repeats);
  const double flops = 2.0 * shape.proxy_head_dim * shape.num_proxy_heads * double(seqlen) * seqlen / 2;
  Row row = timed_row("select", label, "", seqlen, ms, flops, "");
  const auto eager = kEagerMs.find(seqlen);
  if (label == "paper" && eager != kEagerMs.end()) {
    char note[96];
    std::snprintf(note, sizeof(note), "%.1fx faster than eager PyTorch (%.1f ms)", eager->second / ms,
                  eager->second);
    row.note = note;
  }
  rows.push_back(row);
}

}  // namespace

FLASHMSA_BENCH(select, bench_select) {
  for (const std::string& name : options.configs) {
    const cases::HeadConfig* config = cases::find_config(name);
    if (config == nullptr) continue;
    // The named config's K, and K = 64 (the largest top-K bucket) under "<name>_k64".
    std::vector<int> top_ks = {config->top_k};
    if (config->top_k != kMaxTopK) top_ks.push_back(kMaxTopK);
    for (int top_k : top_ks) {
      const std::string label = top_k == config->top_k ? name : name + "_k64";
      for (int64_t seqlen : options.seqlens) bench_one(*config, label, top_k, seqlen, options, rows);
    }
  }
}

}  // namespace flashmsa::bench
