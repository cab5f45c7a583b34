// Shared-memory barriers (mbarrier) and named CTA barriers, as thin inline-PTX wrappers.
//
// Layer 1 of the device utilities (ptx/ -> tma.h, wgmma.h -> kernels). An mbarrier counts arrivals
// and, for bulk copies, transaction bytes; waiting on a phase parity is how a consumer learns that
// a TMA load landed and how a producer learns that a stage was released.
#pragma once

#include <cstdint>

namespace flashmsa::kernels::ptx {

__device__ __forceinline__ uint32_t smem_address(const void* pointer) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(pointer));
}

// The first 1024-byte aligned byte of dynamic shared memory (128-byte swizzled tiles and their
// descriptors need 1024-byte atoms). Pointer arithmetic on the __shared__ array itself, not an
// integer round trip, so the compiler keeps the shared address space (LDS/STS, not generic).
__device__ __forceinline__ unsigned char* align_shared_1024(unsigned char* raw) {
  return raw + ((1024 - (smem_address(raw) & 1023)) & 1023);
}

__device__ __forceinline__ void mbarrier_init(uint64_t* barrier, uint32_t arrivals) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_address(barrier)), "r"(arrivals));
}

// Makes barrier initialisation visible to the async proxy (TMA) before the first use.
__device__ __forceinline__ void fence_barrier_init() {
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}

// Orders this thread's earlier shared-memory writes (st.shared, completed cp.async) before later
// reads of the async proxy (wgmma operands, TMA).
__device__ __forceinline__ void fence_proxy_async_shared() {
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}

__device__ __forceinline__ void mbarrier_arrive(uint64_t* barrier) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(smem_address(barrier)) : "memory");
}

// Arrives once and announces `bytes` of TMA transactions that complete this phase.
__device__ __forceinline__ void mbarrier_arrive_expect_tx(uint64_t* barrier, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_address(barrier)),
               "r"(bytes)
               : "memory");
}

// Blocks until the phase with the given parity has completed.
__device__ __forceinline__ void mbarrier_wait(uint64_t* barrier, uint32_t parity) {
  asm volatile(
      "{\n"
      ".reg .pred done;\n"
      "WAIT_%=:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra WAIT_%=;\n"
      "}\n" ::"r"(smem_address(barrier)),
      "r"(parity)
      : "memory");
}

// Named barriers (bar.sync / bar.arrive) between warp groups; id 0 is __syncthreads.
__device__ __forceinline__ void named_barrier_sync(uint32_t id, uint32_t threads) {
  asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(threads) : "memory");
}

__device__ __forceinline__ void named_barrier_arrive(uint32_t id, uint32_t threads) {
  asm volatile("bar.arrive %0, %1;" ::"r"(id), "r"(threads) : "memory");
}

// The warp group of this thread (threadIdx.x / 128), broadcast from lane 0 so the compiler knows it
// is warp-uniform: what derives from it (shared-memory tile addresses, wgmma descriptors) then
// lives in uniform registers instead of being moved there before every wgmma.
__device__ __forceinline__ int warpgroup_index() { return __shfl_sync(0xffffffffu, int(threadIdx.x / 128), 0); }

// The warp of this thread (threadIdx.x / 32), broadcast the same way.
__device__ __forceinline__ int warp_index() { return __shfl_sync(0xffffffffu, int(threadIdx.x / 32), 0); }

// Register reallocation between warp groups (sm_90a); needs a register cap at kernel entry.
template <uint32_t kRegisters>
__device__ __forceinline__ void warpgroup_registers_increase() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(kRegisters));
}

template <uint32_t kRegisters>
__device__ __forceinline__ void warpgroup_registers_decrease() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(kRegisters));
}

}  // namespace flashmsa::kernels::ptx
