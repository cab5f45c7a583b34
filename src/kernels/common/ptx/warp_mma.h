// Warp-level tensor-core MMA (mma.sync m16n8k16), ldmatrix and cp.async, as thin inline-PTX
// wrappers for 16-bit inputs with fp32 accumulation.
//
// Layer 1 of the device utilities (ptx/ -> kernels). Fragment layouts are PTX's: for m16n8k16 the
// A fragment holds rows lane/4 and lane/4 + 8, columns 2·(lane%4) + {0, 1} and + 8; B holds
// columns (n) lane/4 and rows (k) 2·(lane%4) + {0, 1} and + 8; the accumulator holds rows lane/4
// (c0, c1) and lane/4 + 8 (c2, c3) at columns 2·(lane%4) + {0, 1}.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "kernels/common/ptx/barrier.h"

namespace flashmsa::kernels::ptx {

// 16-byte global -> shared copy; `valid` false fills the 16 bytes with zeros (src is not read).
__device__ __forceinline__ void cp_async_16(void* shared, const void* global, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(smem_address(shared)),
               "l"(global), "r"(valid ? 16 : 0)
               : "memory");
}

// cp_async_16 with an L2 cache policy (tma.h l2_policy_*) for the line it reads.
__device__ __forceinline__ void cp_async_16(void* shared, const void* global, bool valid, uint64_t policy) {
  asm volatile("cp.async.cg.shared.global.L2::cache_hint [%0], [%1], 16, %2, %3;" ::"r"(smem_address(shared)),
               "l"(global), "r"(valid ? 16 : 0), "l"(policy)
               : "memory");
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }

// Waits until at most `kPending` committed groups of this thread are still in flight.
template <int kPending>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;" ::"n"(kPending) : "memory");
}

__device__ __forceinline__ void ldmatrix_x4(uint32_t (&frag)[4], const void* shared) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
               : "=r"(frag[0]), "=r"(frag[1]), "=r"(frag[2]), "=r"(frag[3])
               : "r"(smem_address(shared)));
}

// Stores four 8x8 16-bit matrices: lanes 8i … 8i + 7 give the row addresses of matrix i, and
// register i of each lane holds (row lane/4, columns 2·(lane%4) + {0, 1}) of matrix i, the
// accumulator fragment's layout.
__device__ __forceinline__ void stmatrix_x4(uint32_t shared, const uint32_t (&frag)[4]) {
  asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};" ::"r"(shared),
               "r"(frag[0]), "r"(frag[1]), "r"(frag[2]), "r"(frag[3])
               : "memory");
}

// The same four matrices stored transposed: lane 8i + j addresses row j of the transpose of matrix
// i, which receives column j of the fragment (so a key-by-row accumulator lands row-by-key).
__device__ __forceinline__ void stmatrix_x4_trans(uint32_t shared, const uint32_t (&frag)[4]) {
  asm volatile("stmatrix.sync.aligned.m8n8.x4.trans.shared.b16 [%0], {%1, %2, %3, %4};" ::"r"(shared),
               "r"(frag[0]), "r"(frag[1]), "r"(frag[2]), "r"(frag[3])
               : "memory");
}

__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&frag)[4], const void* shared) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];"
               : "=r"(frag[0]), "=r"(frag[1]), "=r"(frag[2]), "=r"(frag[3])
               : "r"(smem_address(shared)));
}

// d += a · b for one m16n8k16 tile; Element selects bf16 or fp16 inputs.
template <typename Element>
__device__ __forceinline__ void mma_16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0,
                                          uint32_t b1);

template <>
__device__ __forceinline__ void mma_16816<__nv_bfloat16>(float (&d)[4], const uint32_t (&a)[4],
                                                         uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
      "{%8, %9}, {%0, %1, %2, %3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

template <>
__device__ __forceinline__ void mma_16816<__half>(float (&d)[4], const uint32_t (&a)[4], uint32_t b0,
                                                  uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
      "{%8, %9}, {%0, %1, %2, %3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Two fp32 values -> one register of two 16-bit values (low half = first), round to nearest even.
template <typename Element>
__device__ __forceinline__ uint32_t pack2(float low, float high);

template <>
__device__ __forceinline__ uint32_t pack2<__nv_bfloat16>(float low, float high) {
  __nv_bfloat162 pair = __floats2bfloat162_rn(low, high);
  return *reinterpret_cast<uint32_t*>(&pair);
}

template <>
__device__ __forceinline__ uint32_t pack2<__half>(float low, float high) {
  __half2 pair = __floats2half2_rn(low, high);
  return *reinterpret_cast<uint32_t*>(&pair);
}

}  // namespace flashmsa::kernels::ptx
