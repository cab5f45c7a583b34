// Tensor Memory Accelerator wrappers, as thin inline PTX: tensor loads (cp.async.bulk.tensor) and
// bulk reduce-adds from shared to global memory (cp.reduce.async.bulk).
//
// Layer 1 of the device utilities. The tensor maps are built on the host by tma_desc.h and passed
// to kernels as __grid_constant__ parameters; a load completes on an mbarrier (barrier.h) that was
// told the byte count with mbarrier_arrive_expect_tx. A bulk reduce-add completes in the issuing
// thread's bulk groups: the writers of its source run fence_proxy_async_shared() before it is
// issued, and the source may be overwritten once bulk_wait_group_read() returns.
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

// global[i] += shared[i] for `bytes` / 4 floats (bytes a multiple of 16, both addresses 16-byte
// aligned), done by the TMA unit: no load-store-unit instructions per element.
__device__ __forceinline__ void bulk_reduce_add_f32(float* destination, const void* source, uint32_t bytes) {
  asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;" ::"l"(destination),
               "r"(smem_address(source)), "r"(bytes)
               : "memory");
}

// An L2 cache policy (createpolicy, fraction 1) for the accesses it is passed to: the eviction
// priority of the lines they bring in or touch.
__device__ __forceinline__ uint64_t l2_policy_evict_first() {
  uint64_t policy;
  asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(policy));
  return policy;
}
__device__ __forceinline__ uint64_t l2_policy_evict_last() {
  uint64_t policy;
  asm volatile("createpolicy.fractional.L2::evict_last.b64 %0, 1.0;" : "=l"(policy));
  return policy;
}

// global[i] += shared[i] for `bytes` / 2 fp16 values (same alignment rules), rounded to fp16 at
// every add, subnormals kept; the lines touched get the L2 `policy`.
__device__ __forceinline__ void bulk_reduce_add_f16(void* destination, const void* source, uint32_t bytes,
                                                    uint64_t policy) {
  asm volatile(
      "cp.reduce.async.bulk.global.shared::cta.bulk_group.L2::cache_hint.add.noftz.f16 [%0], [%1], %2, %3;" ::"l"(
          destination),
      "r"(smem_address(source)), "r"(bytes), "l"(policy)
      : "memory");
}

__device__ __forceinline__ void bulk_commit_group() { asm volatile("cp.async.bulk.commit_group;" ::: "memory"); }

// Waits until at most N of this thread's bulk groups still read their shared-memory sources.
template <int N>
__device__ __forceinline__ void bulk_wait_group_read() {
  asm volatile("cp.async.bulk.wait_group.read %0;" ::"n"(N) : "memory");
}

// Waits until at most N of this thread's bulk groups are incomplete (their global writes done).
template <int N>
__device__ __forceinline__ void bulk_wait_group() {
  asm volatile("cp.async.bulk.wait_group %0;" ::"n"(N) : "memory");
}

}  // namespace flashmsa::kernels::ptx
