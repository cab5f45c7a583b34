// The benchmark harness: CUDA-event timing with an L2 flush before every repetition, result rows in
// the schema of SPEC.md "Results file", and a registry so each stage adds its benchmark in its own
// file (bench/bench_<stage>.cu) without touching main.cpp.
#pragma once

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <string>
#include <vector>

#include "common/device_buffers.h"

namespace flashmsa::bench {

struct Row {
  std::string system = "flashmsa";
  std::string stage;    // select | schedule | forward | backward | fwd_bwd | step | warmup_fwd_bwd
  std::string config;   // paper | specialized | seed | <other>
  std::string pattern;  // random | hot | tile_shared | dense | "" (null)
  int64_t seqlen = 0;
  int64_t batch = 1;
  double ms = 0.0;
  double tflops = 0.0;  // counted FLOPs / time; 0 when not meaningful
  double peak_mem_gb = 0.0;
  std::string note;
};

struct Options {
  std::vector<std::string> configs = {"paper"};
  std::vector<int64_t> seqlens = {8192, 32768, 131072};
  std::vector<std::string> patterns = {"random", "hot", "tile_shared"};
  int warmup = 3;
  int repeats = 10;
};

// Times `work` (enqueued on `stream`) `repeats` times after `warmup` runs; the 60 MB L2 is flushed
// before each timed run, outside the timed region. Returns the median in milliseconds.
// NOTES: a run slower than 100 ms (the 512K/1M rows, and some 128K step rows) gets one warm-up
// and 3 repeats: its spread is far below 1%, and the device time of a whole benchmark stays within
// minutes. FLASHMSA_BENCH_TRACE=1 prints every timed run to stderr.
inline double time_median_ms(const std::function<void(cudaStream_t)>& work, cudaStream_t stream,
                             int warmup, int repeats) {
  static testing::DeviceBuffer<char> flush(size_t(256) << 20);
  cudaEvent_t start, stop;
  FLASHMSA_CUDA_CHECK(cudaEventCreate(&start));
  FLASHMSA_CUDA_CHECK(cudaEventCreate(&stop));
  auto timed_run = [&](int index) {
    FLASHMSA_CUDA_CHECK(cudaMemsetAsync(flush.get(), index & 0xFF, flush.bytes(), stream));
    FLASHMSA_CUDA_CHECK(cudaEventRecord(start, stream));
    work(stream);
    FLASHMSA_CUDA_CHECK(cudaEventRecord(stop, stream));
    FLASHMSA_CUDA_CHECK(cudaEventSynchronize(stop));
    float ms = 0.f;
    FLASHMSA_CUDA_CHECK(cudaEventElapsedTime(&ms, start, stop));
    return double(ms);
  };
  const double first_ms = timed_run(0);
  if (first_ms > 100.0) {
    warmup = 0;
    repeats = std::min(repeats, 3);
  }
  for (int i = 1; i < warmup; ++i) work(stream);
  std::vector<double> times;
  for (int i = 0; i < repeats; ++i) times.push_back(timed_run(i + 1));
  if (std::getenv("FLASHMSA_BENCH_TRACE") != nullptr) {  // every timed run, in order, on stderr
    std::fprintf(stderr, "timed runs: first %.3f ms, %d untimed, then", first_ms, std::max(warmup - 1, 0));
    for (double ms : times) std::fprintf(stderr, " %.3f", ms);
    std::fprintf(stderr, "\n");
  }
  FLASHMSA_CUDA_CHECK(cudaGetLastError());
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  std::sort(times.begin(), times.end());
  return times[times.size() / 2];
}

// `text` as a JSON string literal (quotes and backslashes escaped), for the rows files.
inline std::string json_string(const std::string& text) {
  std::string quoted = "\"";
  for (char ch : text) {
    if (ch == '"' || ch == '\\') quoted += '\\';
    quoted += ch;
  }
  return quoted + "\"";
}

// Peak device memory in use since the last reset_peak_memory() (cudaMemGetInfo-based).
double device_memory_used_gb();

// A measured flashmsa row: TFLOP/s on `flops` counted FLOPs (0: not meaningful), the device
// memory in use now.
inline Row timed_row(const std::string& stage, const std::string& config, const std::string& pattern,
                     int64_t seqlen, double ms, double flops, const std::string& note) {
  Row row;
  row.stage = stage;
  row.config = config;
  row.pattern = pattern;
  row.seqlen = seqlen;
  row.ms = ms;
  row.tflops = flops > 0.0 ? flops / (ms * 1e-3) / 1e12 : 0.0;
  row.peak_mem_gb = device_memory_used_gb();
  row.note = note;
  return row;
}

using BenchFunction = std::function<void(const Options&, std::vector<Row>&)>;

struct Registration {
  std::string stage;
  BenchFunction function;
  bool opt_in;  // runs only when named in --stages (a stage too slow for every default run)
};

std::vector<Registration>& registry();

struct Registrar {
  Registrar(const std::string& stage, BenchFunction function, bool opt_in = false) {
    registry().push_back({stage, std::move(function), opt_in});
  }
};

}  // namespace flashmsa::bench

// Registers a benchmark of one stage: FLASHMSA_BENCH(select, bench_select) { ... }
#define FLASHMSA_BENCH(stage, name)                                                         \
  static void name(const ::flashmsa::bench::Options& options,                               \
                   std::vector<::flashmsa::bench::Row>& rows);                              \
  static ::flashmsa::bench::Registrar name##_registrar(#stage, name);                       \
  static void name(const ::flashmsa::bench::Options& options, std::vector<::flashmsa::bench::Row>& rows)

// The same for a stage that runs only when --stages names it.
#define FLASHMSA_BENCH_OPT_IN(stage, name)                                                  \
  static void name(const ::flashmsa::bench::Options& options,                               \
                   std::vector<::flashmsa::bench::Row>& rows);                              \
  static ::flashmsa::bench::Registrar name##_registrar(#stage, name, /*opt_in=*/true);      \
  static void name(const ::flashmsa::bench::Options& options, std::vector<::flashmsa::bench::Row>& rows)
