// Benchmark of the sparse backward (SPEC.md §3-§4, main gradients + KL gradient + KL value) on the
// selection patterns of tests/common/patterns.h. Counted FLOPs: 2.5 × 4·D·Σ_{h,i} |T_hi| (the
// forward's 4·D per selected (head, query, key), times the usual 2.5 for the backward).
//
// Inputs are device-generated uniform values of unit variance; the saved LSEs are set to 8 (the
// order of log Σ_{j∈T} e^z for |T| ≈ 2000 and z ~ N(0, 1)). The backward's time does not depend on
// the values, only on the selection.
#include <cuda_runtime_api.h>

#include <cstdio>
#include <vector>

#include "bench.h"
#include "common/cases.h"
#include "common/patterns.h"
#include "flashmsa/api.h"

namespace flashmsa::bench {
namespace {

__global__ void fill_uniform_kernel(uint16_t* data, int64_t count, uint64_t seed, bool bf16) {
  for (int64_t e = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; e < count; e += int64_t(gridDim.x) * blockDim.x) {
    uint64_t x = (uint64_t(e) + seed) * 0x9E3779B97F4A7C15ull;
    x ^= x >> 31;
    x *= 0xBF58476D1CE4E5B9ull;
    x ^= x >> 29;
    const float u = (float(x >> 40) / float(1 << 24) - 0.5f) * 3.4641f;  // variance 1
    uint16_t bits;
    if (bf16) {
      __nv_bfloat16 value = __float2bfloat16_rn(u);
      bits = *reinterpret_cast<uint16_t*>(&value);
    } else {
      __half value = __float2half_rn(u);
      bits = *reinterpret_cast<uint16_t*>(&value);
    }
    data[e] = bits;
  }
}

__global__ void fill_value_kernel(float* data, int64_t count, float value) {
  for (int64_t e = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; e < count; e += int64_t(gridDim.x) * blockDim.x) {
    data[e] = value;
  }
}

testing::DeviceBuffer<uint16_t> random_tensor(int64_t count, uint64_t seed) {
  testing::DeviceBuffer<uint16_t> buffer{size_t(count)};
  fill_uniform_kernel<<<1024, 256>>>(buffer.get(), count, seed, true);
  FLASHMSA_CUDA_CHECK(cudaGetLastError());
  return buffer;
}

testing::DeviceBuffer<float> constant_floats(int64_t count, float value) {
  testing::DeviceBuffer<float> buffer{size_t(count)};
  fill_value_kernel<<<1024, 256>>>(buffer.get(), count, value);
  FLASHMSA_CUDA_CHECK(cudaGetLastError());
  return buffer;
}

// Σ over (b, p, i) of |T_pi|, times M: the (head, query, key) triples of the main branch.
double selected_triples(const ProblemShape& shape, const std::vector<int32_t>& block_idx) {
  double total = 0.0;
  const int K = shape.top_k;
  for (int64_t row = 0; row < shape.batch * shape.num_proxy_heads * shape.seqlen; ++row) {
    const int64_t i = row % shape.seqlen;
    const int32_t* slots = block_idx.data() + row * K;
    for (int s = 0; s < K; ++s) {
      const int32_t c = slots[s];
      if (c < 0 || int64_t(c) * kBlockSize > i) continue;
      bool repeated = false;
      for (int t = 0; t < s; ++t) repeated = repeated || slots[t] == c;
      if (repeated) continue;
      total += double(std::min<int64_t>(kBlockSize, i - int64_t(c) * kBlockSize + 1));
    }
  }
  return total * shape.heads_per_proxy();
}

}  // namespace

FLASHMSA_BENCH(backward, bench_backward) {
  cudaStream_t stream;
  FLASHMSA_CUDA_CHECK(cudaStreamCreate(&stream));
  for (const std::string& config_name : options.configs) {
    const cases::HeadConfig* config = cases::find_config(config_name);
    if (config == nullptr) continue;
    for (int64_t seqlen : options.seqlens) {
      const ProblemShape shape = cases::make_shape(*config, 1, seqlen);
      const int64_t tokens = shape.batch * shape.seqlen;
      const int D = shape.head_dim;
      auto q = random_tensor(tokens * shape.num_heads * D, 1);
      auto k = random_tensor(tokens * shape.num_kv_heads * D, 2);
      auto v = random_tensor(tokens * shape.num_kv_heads * D, 3);
      auto q_proxy = random_tensor(tokens * shape.num_proxy_heads * D, 4);
      auto k_proxy = random_tensor(tokens * shape.num_proxy_kv_heads * D, 5);
      auto out = random_tensor(tokens * shape.num_heads * D, 6);
      auto dout = random_tensor(tokens * shape.num_heads * D, 7);
      auto lse = constant_floats(tokens * shape.num_heads, 8.f);
      auto proxy_lse = constant_floats(tokens * shape.num_proxy_heads, 8.f);
      auto kl_grad = constant_floats(1, 1.f);
      testing::DeviceBuffer<float> kl(1);
      testing::DeviceBuffer<uint16_t> dq(size_t(tokens * shape.num_heads * D));
      testing::DeviceBuffer<uint16_t> dk(size_t(tokens * shape.num_kv_heads * D));
      testing::DeviceBuffer<uint16_t> dv(size_t(tokens * shape.num_kv_heads * D));
      testing::DeviceBuffer<uint16_t> dq_proxy(size_t(tokens * shape.num_proxy_heads * D));
      testing::DeviceBuffer<uint16_t> dk_proxy(size_t(tokens * shape.num_proxy_kv_heads * D));
      testing::DeviceBuffer<char> schedule(std::max<size_t>(256, schedule_workspace_size(shape)));
      testing::DeviceBuffer<char> workspace(std::max<size_t>(256, backward_workspace_size(shape, Mode::kSparse, false)));
      testing::DeviceBuffer<int32_t> block_idx(size_t(tokens * shape.num_proxy_heads * shape.top_k));

      for (const std::string& pattern_name : options.patterns) {
        patterns::Pattern pattern;
        if (!patterns::parse_pattern(pattern_name, &pattern)) continue;
        const std::vector<int32_t> selection = patterns::make_selection(shape, pattern, 42);
        block_idx.upload(selection);

        BackwardParams params;
        params.fwd.shape = shape;
        params.fwd.dtype = DType::kBF16;
        params.fwd.q = cases::bshd(q.get(), shape, shape.num_heads, D);
        params.fwd.k = cases::bshd(k.get(), shape, shape.num_kv_heads, D);
        params.fwd.v = cases::bshd(v.get(), shape, shape.num_kv_heads, D);
        params.fwd.q_proxy = cases::bshd(q_proxy.get(), shape, shape.num_proxy_heads, D);
        params.fwd.k_proxy = cases::bshd(k_proxy.get(), shape, shape.num_proxy_kv_heads, D);
        params.fwd.block_idx = block_idx.get();
        params.fwd.schedule = schedule.get();
        params.fwd.out = cases::bshd(out.get(), shape, shape.num_heads, D);
        params.fwd.lse = lse.get();
        params.fwd.proxy_lse = proxy_lse.get();
        params.fwd.kl = kl.get();
        params.dout = cases::bshd(dout.get(), shape, shape.num_heads, D);
        params.kl_grad = kl_grad.get();
        params.dq = cases::bshd(dq.get(), shape, shape.num_heads, D);
        params.dk = cases::bshd(dk.get(), shape, shape.num_kv_heads, D);
        params.dv = cases::bshd(dv.get(), shape, shape.num_kv_heads, D);
        params.dq_proxy = cases::bshd(dq_proxy.get(), shape, shape.num_proxy_heads, D);
        params.dk_proxy = cases::bshd(dk_proxy.get(), shape, shape.num_proxy_kv_heads, D);
        params.workspace = workspace.get();

        const Status status = backward(params, stream);
        if (!status.ok()) {
          std::fprintf(stderr, "backward %s S=%lld %s: %s\n", config_name.c_str(), (long long)seqlen,
                       pattern_name.c_str(), status.message.c_str());
          continue;
        }
        const double ms = time_median_ms([&](cudaStream_t s) { backward(params, s); }, stream,
                                         options.warmup, options.repeats);
        const double flops = 2.5 * 4.0 * D * selected_triples(shape, selection);
        Row row;
        row.stage = "backward";
        row.config = config_name;
        row.pattern = pattern_name;
        row.seqlen = seqlen;
        row.ms = ms;
        row.tflops = flops / (ms * 1e-3) / 1e12;
        row.peak_mem_gb = device_memory_used_gb();
        row.note = "main + KL gradient + KL value; saved tensors synthetic";
        rows.push_back(row);
      }
    }
  }
  cudaStreamDestroy(stream);
}

}  // namespace flashmsa::bench
