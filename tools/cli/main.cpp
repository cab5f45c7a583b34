// The `flashmsa` command: runs one MSA training step (select -> schedule -> forward -> backward) for
// a named head configuration of SPEC.md on random inputs and prints the time of every stage.
//
// On a machine without a Hopper GPU it runs the fp64 CPU reference (src/reference) on a small
// problem instead, and says so: the kernels need an H100/H200.
//
//   flashmsa [--config paper|specialized|seed] [--seqlen S] [--batch B] [--top-k K]
//            [--mode sparse|warmup] [--dtype bf16|fp16] [--cpu]
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <new>
#include <optional>
#include <string>
#include <vector>

#include "common/cases.h"
#include "common/device_buffers.h"
#include "common/flags.h"
#include "flashmsa/api.h"
#include "reference/reference.h"

namespace {

using namespace flashmsa;

struct CliOptions {
  std::string config = "paper";
  int64_t seqlen = -1;  // -1: 32768 on the GPU, 512 on the CPU
  int64_t batch = 1;
  int top_k = -1;       // -1: the config's K on the GPU, 2 on the CPU
  Mode mode = Mode::kSparse;
  DType dtype = DType::kBF16;
  bool force_cpu = false;
};

constexpr const char* kUsage =
    "usage: flashmsa [--config paper|specialized|seed] [--seqlen S] [--batch B]\n"
    "                [--top-k K] [--mode sparse|warmup] [--dtype bf16|fp16] [--cpu]\n";

[[noreturn]] void usage_error(const std::string& message) {
  std::fprintf(stderr, "flashmsa: %s\n%s", message.c_str(), kUsage);
  std::exit(2);
}

// `value` as a whole decimal integer in [low, high], or a usage error naming the flag.
int64_t parse_integer(const std::string& flag, const std::string& value, int64_t low, int64_t high) {
  std::string error;
  const std::optional<int64_t> parsed = testing::parse_integer(flag, value, low, high, error);
  if (!parsed) usage_error(error);
  return *parsed;
}

CliOptions parse(int argc, char** argv) {
  CliOptions options;
  for (int i = 1; i < argc; ++i) {
    const std::string flag = argv[i];
    if (flag == "--cpu") {
      options.force_cpu = true;
      continue;
    }
    if (flag == "--help" || flag == "-h") {
      std::fputs(kUsage, stdout);
      std::exit(0);
    }
    // Taken only by a known flag, so an unknown one is named as such also when it comes last.
    const auto take_value = [&]() -> std::string {
      if (i + 1 >= argc) usage_error(flag + " needs a value");
      return argv[++i];
    };
    if (flag == "--config") {
      const std::string value = take_value();
      if (cases::find_config(value) == nullptr) usage_error("unknown --config " + value);
      options.config = value;
    } else if (flag == "--seqlen") {
      options.seqlen = parse_integer(flag, take_value(), 1, int64_t(1) << 30);
    } else if (flag == "--batch") {
      options.batch = parse_integer(flag, take_value(), 1, 1 << 16);
    } else if (flag == "--top-k") {
      options.top_k = int(parse_integer(flag, take_value(), 1, kMaxTopK));
    } else if (flag == "--mode") {
      const std::string value = take_value();
      if (value == "sparse") {
        options.mode = Mode::kSparse;
      } else if (value == "warmup") {
        options.mode = Mode::kWarmup;
      } else {
        usage_error("--mode must be sparse or warmup");
      }
    } else if (flag == "--dtype") {
      const std::string value = take_value();
      if (value == "bf16") {
        options.dtype = DType::kBF16;
      } else if (value == "fp16") {
        options.dtype = DType::kFP16;
      } else {
        usage_error("--dtype must be bf16 or fp16");
      }
    } else {
      usage_error("unknown flag " + flag);
    }
  }
  return options;
}

const char* mode_name(Mode mode) { return mode == Mode::kSparse ? "sparse" : "warmup"; }

void print_shape(const ProblemShape& shape, Mode mode, const char* where) {
  std::printf("flashmsa: %s, B=%lld S=%lld H=%d Hkv=%d Hp=%d Hpk=%d D=%d K=%d, mode %s\n", where,
              static_cast<long long>(shape.batch), static_cast<long long>(shape.seqlen),
              shape.num_heads, shape.num_kv_heads, shape.num_proxy_heads, shape.num_proxy_kv_heads,
              shape.head_dim, shape.top_k, mode_name(mode));
}

double seconds_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

// ---------------------------------------------------------------------------------------------
// CPU: the fp64 reference on a small problem.
// ---------------------------------------------------------------------------------------------
// The reference's cost grows as S² (select, recall and dense warmup rows): 2048 tokens of the paper
// config take ≈ 40 s on one core, so larger requests are refused rather than left running for hours.
constexpr int64_t kMaxCpuTokens = 4096;

int run_cpu(const CliOptions& options, const cases::HeadConfig& config) {
  ProblemShape shape = cases::make_shape(config, options.batch, options.seqlen > 0 ? options.seqlen : 512);
  shape.top_k = options.top_k > 0 ? options.top_k : 2;
  if (shape.batch * shape.seqlen > kMaxCpuTokens) {
    usage_error("--seqlen, --batch: the CPU reference (" +
                std::string(options.force_cpu ? "--cpu" : "no Hopper GPU here") + ") runs at most " +
                std::to_string(kMaxCpuTokens) + " tokens (B*S), got B*S = " +
                std::to_string(shape.batch * shape.seqlen));
  }
  print_shape(shape, options.mode, "CPU fp64 reference");
  std::fflush(stdout);  // the header shows before the reference's seconds of work, also in a pipe

  const reference::Inputs inputs = reference::random_inputs(shape, /*seed=*/1, options.dtype);
  const reference::Precision fp64 = reference::Precision::kFP64;

  auto start = std::chrono::steady_clock::now();
  const std::vector<int32_t> block_idx = reference::select(inputs, fp64);
  const double select_s = seconds_since(start);

  start = std::chrono::steady_clock::now();
  const reference::ForwardOutputs fwd = reference::forward(inputs, block_idx, options.mode, fp64);
  const double forward_s = seconds_since(start);

  std::vector<double> dout(fwd.out.size());
  for (size_t i = 0; i < dout.size(); ++i) dout[i] = std::sin(0.37 * double(i));
  start = std::chrono::steady_clock::now();
  const reference::Gradients grads =
      reference::backward(inputs, block_idx, dout, /*kl_grad=*/1.0, options.mode, fp64);
  const double backward_s = seconds_since(start);

  // The selection against the main attention's own top-K (computed in warmup mode too: there it
  // gates nothing, but it is what sparse mode will use).
  start = std::chrono::steady_clock::now();
  const reference::Recall recall = reference::recall(inputs, block_idx);
  const double recall_s = seconds_since(start);

  auto rms = [](const std::vector<double>& values) {
    double sum = 0.0;
    for (double value : values) sum += value * value;
    return std::sqrt(sum / double(values.size()));
  };
  std::printf("  stage      time (CPU)   result\n");
  std::printf("  select     %8.3f s   block_idx[0,0,S-1,:K] local block first = %d\n", select_s,
              block_idx[(shape.seqlen - 1) * shape.top_k]);
  std::printf("  recall     %8.3f s   block %.3f, score %.3f (the selection vs the teacher's top-K)\n",
              recall_s, recall.block, recall.score);
  std::printf("  forward    %8.3f s   rms(out) = %.4f, KL = %.6f\n", forward_s, rms(fwd.out), fwd.kl);
  std::printf("  backward   %8.3f s   rms(dq) = %.4e, rms(dk) = %.4e, rms(dv) = %.4e,\n"
              "                          rms(dq_proxy) = %.4e, rms(dk_proxy) = %.4e\n",
              backward_s, rms(grads.dq), rms(grads.dk), rms(grads.dv), rms(grads.dq_proxy),
              rms(grads.dk_proxy));
  std::printf("flashmsa: no Hopper GPU here; ran the CPU reference on a small problem. The CUDA\n"
              "          kernels need an NVIDIA H100/H200 (sm_90).\n");
  return 0;
}

// ---------------------------------------------------------------------------------------------
// GPU: the kernels, timed with CUDA events.
// ---------------------------------------------------------------------------------------------
int run_gpu(const CliOptions& options, const cases::HeadConfig& config) {
  using testing::DeviceBuffer;
  ProblemShape shape = cases::make_shape(config, options.batch, options.seqlen > 0 ? options.seqlen : 32768);
  if (options.top_k > 0) shape.top_k = options.top_k;
  print_shape(shape, options.mode, "H100/H200 kernels");

  const int64_t tokens = shape.batch * shape.seqlen;

  // Random inputs generated on the host once (N(0,1), rounded to the dtype).
  auto random_half = [&](int64_t count, uint64_t seed) {
    std::vector<double> values(count);
    uint64_t state = seed * 0x9E3779B97F4A7C15ull + 1;
    for (int64_t i = 0; i < count; ++i) {
      // Irwin-Hall approximation of N(0,1) from 4 uniforms: cheap and never zero-filled.
      double sum = 0.0;
      for (int u = 0; u < 4; ++u) {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        sum += double(state >> 11) * (1.0 / 9007199254740992.0);
      }
      values[i] = (sum - 2.0) * std::sqrt(3.0);
    }
    return testing::upload_half(values, options.dtype);
  };
  DeviceBuffer<uint16_t> q = random_half(tokens * shape.num_heads * shape.head_dim, 1);
  DeviceBuffer<uint16_t> k = random_half(tokens * shape.num_kv_heads * shape.head_dim, 2);
  DeviceBuffer<uint16_t> v = random_half(tokens * shape.num_kv_heads * shape.head_dim, 3);
  DeviceBuffer<uint16_t> q_proxy = random_half(tokens * shape.num_proxy_heads * shape.proxy_head_dim, 4);
  DeviceBuffer<uint16_t> k_proxy =
      random_half(tokens * shape.num_proxy_kv_heads * shape.proxy_head_dim, 5);
  DeviceBuffer<uint16_t> out(tokens * shape.num_heads * shape.head_dim);
  DeviceBuffer<uint16_t> dout = random_half(tokens * shape.num_heads * shape.head_dim, 6);
  DeviceBuffer<uint16_t> dq(q.size()), dk(k.size()), dv(v.size());
  DeviceBuffer<uint16_t> dq_proxy(q_proxy.size()), dk_proxy(k_proxy.size());
  DeviceBuffer<int32_t> block_idx(tokens * shape.num_proxy_heads * shape.top_k);
  DeviceBuffer<float> lse(tokens * shape.num_heads);
  DeviceBuffer<float> proxy_lse(tokens * shape.num_proxy_heads);
  DeviceBuffer<float> kl(1), kl_grad(1);
  const float one = 1.f;
  FLASHMSA_CUDA_CHECK(cudaMemcpy(kl_grad.get(), &one, sizeof(one), cudaMemcpyHostToDevice));
  DeviceBuffer<char> schedule_ws(schedule_workspace_size(shape));
  DeviceBuffer<char> forward_ws(forward_workspace_size(shape, options.mode));
  DeviceBuffer<char> backward_ws(backward_workspace_size(shape, options.mode, false, options.dtype));

  auto ref = [&](DeviceBuffer<uint16_t>& buffer, int heads, int dim) {
    return cases::bshd(buffer.get(), shape, heads, dim);
  };
  SelectParams select_params{shape, options.dtype, 0.f, ref(q_proxy, shape.num_proxy_heads, shape.proxy_head_dim),
                             ref(k_proxy, shape.num_proxy_kv_heads, shape.proxy_head_dim), block_idx.get()};
  ScheduleParams schedule_params{shape, block_idx.get(), schedule_ws.get()};
  ForwardParams forward_params;
  forward_params.shape = shape;
  forward_params.dtype = options.dtype;
  forward_params.mode = options.mode;
  forward_params.q = ref(q, shape.num_heads, shape.head_dim);
  forward_params.k = ref(k, shape.num_kv_heads, shape.head_dim);
  forward_params.v = ref(v, shape.num_kv_heads, shape.head_dim);
  forward_params.q_proxy = select_params.q_proxy;
  forward_params.k_proxy = select_params.k_proxy;
  forward_params.block_idx = block_idx.get();
  forward_params.schedule = schedule_ws.get();
  forward_params.out = ref(out, shape.num_heads, shape.head_dim);
  forward_params.lse = lse.get();
  forward_params.proxy_lse = proxy_lse.get();
  forward_params.kl = kl.get();
  forward_params.workspace = forward_ws.get();
  BackwardParams backward_params;
  backward_params.fwd = forward_params;
  backward_params.dout = ref(dout, shape.num_heads, shape.head_dim);
  backward_params.kl_grad = kl_grad.get();
  backward_params.dq = ref(dq, shape.num_heads, shape.head_dim);
  backward_params.dk = ref(dk, shape.num_kv_heads, shape.head_dim);
  backward_params.dv = ref(dv, shape.num_kv_heads, shape.head_dim);
  backward_params.dq_proxy = ref(dq_proxy, shape.num_proxy_heads, shape.proxy_head_dim);
  backward_params.dk_proxy = ref(dk_proxy, shape.num_proxy_kv_heads, shape.proxy_head_dim);
  backward_params.workspace = backward_ws.get();

  struct Stage {
    const char* name;
    std::function<Status(cudaStream_t)> call;
  };
  const std::vector<Stage> stages = {
      {"select", [&](cudaStream_t s) { return select(select_params, s); }},
      {"schedule", [&](cudaStream_t s) { return schedule(schedule_params, s); }},
      {"forward", [&](cudaStream_t s) { return forward(forward_params, s); }},
      {"backward", [&](cudaStream_t s) { return backward(backward_params, s); }},
  };
  cudaStream_t stream;
  FLASHMSA_CUDA_CHECK(cudaStreamCreate(&stream));
  cudaEvent_t start, stop;
  FLASHMSA_CUDA_CHECK(cudaEventCreate(&start));
  FLASHMSA_CUDA_CHECK(cudaEventCreate(&stop));
  std::printf("  stage      time (GPU)   status\n");
  int failures = 0;
  for (const Stage& stage : stages) {
    if ((options.mode == Mode::kWarmup) &&
        (std::string(stage.name) == "select" || std::string(stage.name) == "schedule")) {
      continue;
    }
    Status status = stage.call(stream);  // warm-up run (module load, first-touch)
    FLASHMSA_CUDA_CHECK(cudaStreamSynchronize(stream));
    if (!status.ok()) {
      std::printf("  %-9s  %10s   %s\n", stage.name, "-", status.message.c_str());
      if (status.code != StatusCode::kUnsupported) ++failures;
      continue;
    }
    FLASHMSA_CUDA_CHECK(cudaEventRecord(start, stream));
    status = stage.call(stream);
    FLASHMSA_CUDA_CHECK(cudaEventRecord(stop, stream));
    FLASHMSA_CUDA_CHECK(cudaEventSynchronize(stop));
    float ms = 0.f;
    FLASHMSA_CUDA_CHECK(cudaEventElapsedTime(&ms, start, stop));
    std::printf("  %-9s  %7.3f ms   ok\n", stage.name, ms);
  }
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  cudaStreamDestroy(stream);
  return failures == 0 ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  const CliOptions options = parse(argc, argv);
  const cases::HeadConfig& config = *cases::find_config(options.config);
  try {
    if (options.force_cpu || !hopper_available()) return run_cpu(options, config);
    return run_gpu(options, config);
  } catch (const std::bad_alloc&) {
    std::fprintf(stderr, "flashmsa: out of host memory for this problem (smaller --seqlen or --batch)\n");
    return 1;
  }
}
