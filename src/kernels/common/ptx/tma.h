// Tensor Memory Accelerator (cp.async.bulk.tensor) loads, as thin inline-PTX wrappers.
//
// Layer 1 of the device utilities. The tensor maps are built on the host by tma_desc.h and passed
// to kernels as __grid_constant__ parameters; a load completes on an mbarrier (barrier.h) that was
// told the byte count with mbarrier_arrive_expect_tx.
#pragma once

#include <cuda.h>

#include <cstdint>

#include "kernels/common/ptx/barrier.h"

namespace flashmsa::kernels::ptx {

__device__ __forceinline__ void tma_prefetch_descriptor(const CUtensorMap* map) {
  asm volatile("prefetch.tensormap [%0];" ::"l"(reinterpret_cast<uint64_t>(map)) : "memory");
}

// Loads the box at coordinates (c0 innermost .. c3) of a rank-4 tensor map into shared memory.
__device__ __forceinline__ void tma_load_4d(void* destination, const CUtensorMap* map,
                                            uint64_t* barrier, int32_t c0, int32_t c1, int32_t c2,
                                            int32_t c3) {
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%3, %4, %5, %6}], [%2];" ::"r"(smem_address(destination)),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(smem_address(barrier)), "r"(c0), "r"(c1), "r"(c2),
      "r"(c3)
      : "memory");
}

}  // namespace flashmsa::kernels::ptx
