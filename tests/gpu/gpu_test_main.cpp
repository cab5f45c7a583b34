// Entry point of the GPU test executable: says which GPU the tests run on, or that they all skip.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <cstdio>

#include "flashmsa/api.h"

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  if (flashmsa::hopper_available()) {
    int device = 0;
    cudaDeviceProp prop{};
    if (cudaGetDevice(&device) == cudaSuccess && cudaGetDeviceProperties(&prop, device) == cudaSuccess) {
      std::printf("flashmsa GPU tests on %s (%d SMs)\n", prop.name, prop.multiProcessorCount);
    }
  } else {
    std::printf("flashmsa GPU tests: no Hopper GPU (H100/H200) here; every GPU test skips\n");
  }
  return RUN_ALL_TESTS();
}
