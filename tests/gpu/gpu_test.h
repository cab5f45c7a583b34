// Common pieces of the GPU test executable: every test starts with FLASHMSA_REQUIRE_HOPPER() so the
// suite skips with a message (and passes) on a machine without an H100/H200.
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <cstdlib>
#include <functional>
#include <random>
#include <string>

#include "common/cases.h"
#include "common/device_buffers.h"
#include "flashmsa/api.h"
#include "reference/reference.h"

#define FLASHMSA_REQUIRE_HOPPER()                                                           \
  do {                                                                                      \
    if (!::flashmsa::hopper_available()) {                                                  \
      GTEST_SKIP() << "no Hopper GPU (H100/H200) on this machine: GPU test skipped";        \
    }                                                                                       \
  } while (0)

namespace flashmsa::testing {

// The seed of a test's random inputs: fresh on every run (salted with the case name), or the value
// of FLASHMSA_TEST_SEED to replay a failure. FLASHMSA_SEED_TRACE puts it in every failure message.
inline uint64_t test_seed(const std::string& salt) {
  if (const char* fixed = std::getenv("FLASHMSA_TEST_SEED")) return std::strtoull(fixed, nullptr, 0);
  std::random_device device;
  const uint64_t fresh = (uint64_t(device()) << 32) | device();
  return std::hash<std::string>{}(salt) ^ fresh;
}

// Runs `work` once as a CUDA graph: synchronizes the device (a non-blocking stream does not wait
// for work still queued on the legacy stream, e.g. poisoning memsets), captures `work` on a
// non-blocking stream, replays the graph and waits for it. Returns the status `work` returned
// while captured; nothing is replayed unless it is ok.
inline Status run_as_graph(const std::function<Status(cudaStream_t)>& work) {
  FLASHMSA_CUDA_CHECK(cudaDeviceSynchronize());
  cudaStream_t stream;
  FLASHMSA_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  cudaGraph_t graph;
  FLASHMSA_CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
  const Status status = work(stream);
  FLASHMSA_CUDA_CHECK(cudaStreamEndCapture(stream, &graph));
  if (status.ok()) {
    cudaGraphExec_t exec;
    FLASHMSA_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
    FLASHMSA_CUDA_CHECK(cudaGraphLaunch(exec, stream));
    FLASHMSA_CUDA_CHECK(cudaStreamSynchronize(stream));
    cudaGraphExecDestroy(exec);
  }
  cudaGraphDestroy(graph);
  cudaStreamDestroy(stream);
  return status;
}

}  // namespace flashmsa::testing

#define FLASHMSA_SEED_TRACE(seed) \
  SCOPED_TRACE("seed " + std::to_string(seed) + " (FLASHMSA_TEST_SEED=" + std::to_string(seed) + " replays it)")
