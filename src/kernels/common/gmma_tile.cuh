// A one-warpgroup tile product on Hopper tensor cores expressed with CuTe:
//   acc(64, N) += A(64, K) · B(N, K)ᵀ, A and B K-major in 128-byte-swizzled shared memory,
// Element = cutlass::bfloat16_t or cutlass::half_t.
//
// It is the CuTe form of the S = Q·Kᵀ step of the attention kernels (a 64-row warpgroup slab of
// gathered queries against a 128-key block), kept as a small building block: the select kernel
// issues the same wgmma through the raw wrappers of common/ptx/wgmma.h. tests/gpu/test_gmma_tile.cu
// checks it against the CPU, so the CuTe/CUTLASS toolchain is exercised by every build.
#pragma once

#include <cute/arch/mma_sm90_gmma.hpp>
#include <cute/atom/mma_atom.hpp>
#include <cute/atom/mma_traits_sm90_gmma.hpp>
#include <cute/tensor.hpp>

namespace flashmsa::kernels {

template <typename Element, int kTileN, int kTileK>
struct GmmaTile {
  static constexpr int kTileM = 64;  // one warpgroup
  using SmemLayoutA = decltype(cute::tile_to_shape(
      cute::GMMA::Layout_K_SW128_Atom<Element>{},
      cute::Shape<cute::Int<kTileM>, cute::Int<kTileK>>{}));  // (64, K)
  using SmemLayoutB = decltype(cute::tile_to_shape(
      cute::GMMA::Layout_K_SW128_Atom<Element>{},
      cute::Shape<cute::Int<kTileN>, cute::Int<kTileK>>{}));  // (N, K)
  using TiledMma = decltype(cute::make_tiled_mma(
      cute::GMMA::ss_op_selector<Element, Element, float,
                                 cute::Shape<cute::Int<kTileM>, cute::Int<kTileN>, cute::Int<kTileK>>,
                                 cute::GMMA::Major::K, cute::GMMA::Major::K>()));

  // Runs on the 128 threads of one warpgroup; `acc` comes from make_accumulator().
  // Shared memory must be written and fenced (fence.proxy.async) before the call.
  template <typename TensorA, typename TensorB, typename Accumulator>
  static __device__ void multiply(TensorA const& smem_a,  // (64, K)
                                  TensorB const& smem_b,  // (N, K)
                                  Accumulator& acc, int thread_in_group) {
    TiledMma tiled_mma;
    auto thread_mma = tiled_mma.get_thread_slice(thread_in_group);
    auto fragment_a = thread_mma.make_fragment_A(thread_mma.partition_A(smem_a));  // (MMA, 1, K/16)
    auto fragment_b = thread_mma.make_fragment_B(thread_mma.partition_B(smem_b));  // (MMA, 1, K/16)
    cute::warpgroup_fence_operand(acc);
    cute::warpgroup_arrive();
    tiled_mma.accumulate_ = cute::GMMA::ScaleOut::One;
    CUTE_UNROLL
    for (int k_block = 0; k_block < cute::size<2>(fragment_a); ++k_block) {
      cute::gemm(tiled_mma, fragment_a(cute::_, cute::_, k_block),
                 fragment_b(cute::_, cute::_, k_block), acc);
    }
    cute::warpgroup_commit_batch();
    cute::warpgroup_wait<0>();
    cute::warpgroup_fence_operand(acc);
  }

  // A zeroed fp32 accumulator laid out for this thread's share of the (64, N) tile.
  static __device__ auto make_accumulator() {
    auto acc = cute::partition_fragment_C(TiledMma{},
                                          cute::Shape<cute::Int<kTileM>, cute::Int<kTileN>>{});
    cute::clear(acc);
    return acc;
  }

  // This thread's view of a (64, N) tensor in the accumulator's layout (for the epilogue).
  template <typename TensorC>
  static __device__ auto partition_output(TensorC const& tensor_c, int thread_in_group) {
    return TiledMma{}.get_thread_slice(thread_in_group).partition_C(tensor_c);
  }
};

}  // namespace flashmsa::kernels
