// The CuTe tile product of src/kernels/common/gmma_tile.cuh on random bf16/fp16 tiles against the
// CPU (Element is CUTLASS's bfloat16_t or half_t): proves the CuTe/CUTLASS headers build wgmma code that runs correctly on the GPU.
#include <random>

#include "gpu/gpu_test.h"
#include "kernels/common/gmma_tile.cuh"

namespace flashmsa {
namespace {

constexpr int kTileN = 128;
constexpr int kTileK = 128;

template <typename Element>
__global__ void gmma_tile_kernel(const Element* a,  // [64, K] row-major
                                 const Element* b,  // [N, K] row-major
                                 float* c) {        // [64, N] row-major
  using Tile = kernels::GmmaTile<Element, kTileN, kTileK>;
  __shared__ alignas(1024) Element smem_a[cute::cosize_v<typename Tile::SmemLayoutA>];
  __shared__ alignas(1024) Element smem_b[cute::cosize_v<typename Tile::SmemLayoutB>];
  auto tensor_a = cute::make_tensor(cute::make_smem_ptr(smem_a), typename Tile::SmemLayoutA{});
  auto tensor_b = cute::make_tensor(cute::make_smem_ptr(smem_b), typename Tile::SmemLayoutB{});
  for (int index = threadIdx.x; index < Tile::kTileM * kTileK; index += blockDim.x) {
    tensor_a(index / kTileK, index % kTileK) = a[index];
  }
  for (int index = threadIdx.x; index < kTileN * kTileK; index += blockDim.x) {
    tensor_b(index / kTileK, index % kTileK) = b[index];
  }
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");  // generic writes -> wgmma reads
  __syncthreads();

  auto acc = Tile::make_accumulator();
  Tile::multiply(tensor_a, tensor_b, acc, threadIdx.x);
  auto tensor_c = cute::make_tensor(
      cute::make_gmem_ptr(c), cute::make_layout(cute::make_shape(cute::Int<64>{}, cute::Int<kTileN>{}),
                                                cute::LayoutRight{}));  // (64, N)
  cute::copy(acc, Tile::partition_output(tensor_c, threadIdx.x));
}

template <typename Element>
void check_tile(DType dtype, uint64_t seed) {
  std::mt19937_64 generator(seed);
  std::normal_distribution<double> normal;
  std::vector<double> a(64 * kTileK), b(kTileN * kTileK);
  for (double& x : a) x = testing::from_half_bits(testing::to_half_bits(normal(generator), dtype), dtype);
  for (double& x : b) x = testing::from_half_bits(testing::to_half_bits(normal(generator), dtype), dtype);
  testing::DeviceBuffer<uint16_t> device_a = testing::upload_half(a, dtype);
  testing::DeviceBuffer<uint16_t> device_b = testing::upload_half(b, dtype);
  testing::DeviceBuffer<float> device_c(64 * kTileN);
  device_c.poison();
  gmma_tile_kernel<Element><<<1, 128>>>(reinterpret_cast<const Element*>(device_a.get()),
                                        reinterpret_cast<const Element*>(device_b.get()),
                                        device_c.get());
  ASSERT_EQ(cudaGetLastError(), cudaSuccess);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  const std::vector<double> c = testing::download_float(device_c);
  for (int m = 0; m < 64; ++m) {
    for (int n = 0; n < kTileN; ++n) {
      double expected = 0.0;
      double magnitude = 0.0;
      for (int k = 0; k < kTileK; ++k) {
        expected += a[m * kTileK + k] * b[n * kTileK + k];
        magnitude += std::fabs(a[m * kTileK + k] * b[n * kTileK + k]);
      }
      // Exact products of 16-bit inputs, fp32 accumulation over 128 terms.
      ASSERT_NEAR(c[m * kTileN + n], expected, 1e-5 * magnitude + 1e-6) << "at (" << m << ", " << n << ")";
    }
  }
}

TEST(GmmaTile, Bf16MatchesCpu) {
  FLASHMSA_REQUIRE_HOPPER();
  check_tile<cutlass::bfloat16_t>(DType::kBF16, 1);
}

TEST(GmmaTile, Fp16MatchesCpu) {
  FLASHMSA_REQUIRE_HOPPER();
  check_tile<cutlass::half_t>(DType::kFP16, 2);
}

}  // namespace
}  // namespace flashmsa
