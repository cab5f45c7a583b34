// Warpgroup matrix multiply-accumulate (wgmma, sm_90a): shared-memory descriptors, the fences and
// commit/wait of the async group, and the m64n128k16 instructions the kernels use.
//
// Layer 1 of the device utilities. Accumulator layout of an m64nN fp32 fragment (PTX ISA "wgmma
// 64N16 D"): thread t of the warpgroup (warp w = t/32, lane l) holds d[4j + {0,1}] at row
// 16w + l/4 and d[4j + {2,3}] at row 16w + l/4 + 8, columns 8j + 2(l%4) + {0,1}, j < N/8.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

#include "kernels/common/ptx/barrier.h"

namespace flashmsa::kernels::ptx {

// Descriptor of a K-major operand tile stored with the 128-byte swizzle, as TMA writes it with
// CU_TENSOR_MAP_SWIZZLE_128B: rows of 64 16-bit elements (128 bytes), 8-row atoms 1024 bytes apart.
// The tile must start 1024-byte aligned; a k-step of 16 elements inside the row adds 32 bytes to the
// start address (the hardware applies the swizzle to the absolute address).
__device__ __forceinline__ uint64_t make_sw128_kmajor_desc(const void* tile) {
  const uint64_t start = (smem_address(tile) & 0x3FFFF) >> 4;
  constexpr uint64_t kLeadingByteOffset = 16 >> 4;   // unused for swizzled K-major; 1 by convention
  constexpr uint64_t kStrideByteOffset = 1024 >> 4;  // 8 rows x 128 bytes
  constexpr uint64_t kSwizzle128B = 1;
  return start | (kLeadingByteOffset << 16) | (kStrideByteOffset << 32) | (kSwizzle128B << 62);
}

// Descriptor of an MN-major operand (the B of P·V: V stored [key][dim], dims contiguous) with the
// 128-byte swizzle: rows of 64 16-bit elements along MN, one row per k, 8-k atoms of 1024 bytes
// (stride byte offset) and the next 64 MN elements `mn_stride_bytes` further (leading byte
// offset). A k-step of 16 adds 2048 bytes to the start address.
__device__ __forceinline__ uint64_t make_sw128_mnmajor_desc(const void* tile, uint32_t mn_stride_bytes) {
  const uint64_t start = (smem_address(tile) & 0x3FFFF) >> 4;
  const uint64_t leading = mn_stride_bytes >> 4;
  constexpr uint64_t kStrideByteOffset = 1024 >> 4;
  constexpr uint64_t kSwizzle128B = 1;
  return start | (leading << 16) | (kStrideByteOffset << 32) | (kSwizzle128B << 62);
}

// Advances a descriptor by `bytes` (a multiple of 16) along its start address.
__device__ __forceinline__ uint64_t advance_desc(uint64_t desc, uint32_t bytes) {
  return desc + (bytes >> 4);
}

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }

__device__ __forceinline__ void wgmma_commit_group() {
  asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
}

template <int kPending>
__device__ __forceinline__ void wgmma_wait_group() {
  asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(kPending) : "memory");
}

// Four 8x8 b16 matrices from shared memory (ldmatrix .x4); lane l supplies the row address of
// matrix l/8, row l%8.
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&fragment)[4], uint32_t address) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
               : "=r"(fragment[0]), "=r"(fragment[1]), "=r"(fragment[2]), "=r"(fragment[3])
               : "r"(address));
}

// Keeps the compiler from moving accumulator reads or writes across an async wgmma boundary.
template <int kCount>
__device__ __forceinline__ void fence_accumulators(float (&d)[kCount]) {
#pragma unroll
  for (int i = 0; i < kCount; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

template <int kCount>
__device__ __forceinline__ void fence_fragment(uint32_t (&a)[kCount]) {
#pragma unroll
  for (int i = 0; i < kCount; ++i) asm volatile("" : "+r"(a[i])::"memory");
}

// The 64 fp32 accumulator registers of an m64n128 fragment, as inline-PTX placeholders %0 … %63
// and as the matching read-write operand list.
#define FLASHMSA_WGMMA_D_PLACEHOLDERS                                                           \
  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15,"                       \
  "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31,"              \
  "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47,"              \
  "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}"
#define FLASHMSA_WGMMA_D_OPERANDS(d)                                                                    \
  "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),          \
      "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), \
      "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]),          \
      "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]),          \
      "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]),          \
      "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]),          \
      "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]),          \
      "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]),          \
      "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])

// D[64x128] (+)= A[64x16] · B[128x16]ᵀ, fp32 accumulators, both operands K-major in shared memory;
// `type` is the PTX input type (bf16 or f16). scale_d = 0 overwrites D (first k-step), 1 accumulates.
#define FLASHMSA_WGMMA_SS(type, d, desc_a, desc_b, scale_d)                                       \
  asm volatile("{\n.reg .pred accumulate;\nsetp.ne.b32 accumulate, %66, 0;\n"                    \
               "wgmma.mma_async.sync.aligned.m64n128k16.f32." type "." type " "                  \
               FLASHMSA_WGMMA_D_PLACEHOLDERS ", %64, %65, accumulate, 1, 1, 0, 0;\n}\n"           \
               : FLASHMSA_WGMMA_D_OPERANDS(d)                                                    \
               : "l"(desc_a), "l"(desc_b), "r"(scale_d))

// The same with A from registers (the fragment ldmatrix_x4 loads: rows 16w + l/4 (+8), k 2(l%4)
// (+8)) and B in shared memory, K-major (transpose_b = 0) or MN-major (transpose_b = 1, see
// make_sw128_mnmajor_desc).
#define FLASHMSA_WGMMA_RS(type, d, a, desc_b, scale_d, transpose_b)                               \
  asm volatile("{\n.reg .pred accumulate;\nsetp.ne.b32 accumulate, %69, 0;\n"                    \
               "wgmma.mma_async.sync.aligned.m64n128k16.f32." type "." type " "                  \
               FLASHMSA_WGMMA_D_PLACEHOLDERS ", {%64, %65, %66, %67}, %68, accumulate, 1, 1, %70;\n}\n" \
               : FLASHMSA_WGMMA_D_OPERANDS(d)                                                    \
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(scale_d), "n"(transpose_b))

__device__ __forceinline__ void wgmma_m64n128k16_bf16(float (&d)[64], uint64_t desc_a, uint64_t desc_b,
                                                      uint32_t scale_d) {
  FLASHMSA_WGMMA_SS("bf16", d, desc_a, desc_b, scale_d);
}

__device__ __forceinline__ void wgmma_m64n128k16_f16(float (&d)[64], uint64_t desc_a, uint64_t desc_b,
                                                     uint32_t scale_d) {
  FLASHMSA_WGMMA_SS("f16", d, desc_a, desc_b, scale_d);
}

template <int kTransposeB = 0>
__device__ __forceinline__ void wgmma_m64n128k16_rs_bf16(float (&d)[64], const uint32_t (&a)[4],
                                                         uint64_t desc_b, uint32_t scale_d) {
  FLASHMSA_WGMMA_RS("bf16", d, a, desc_b, scale_d, kTransposeB);
}

template <int kTransposeB = 0>
__device__ __forceinline__ void wgmma_m64n128k16_rs_f16(float (&d)[64], const uint32_t (&a)[4],
                                                        uint64_t desc_b, uint32_t scale_d) {
  FLASHMSA_WGMMA_RS("f16", d, a, desc_b, scale_d, kTransposeB);
}

#undef FLASHMSA_WGMMA_SS
#undef FLASHMSA_WGMMA_RS
#undef FLASHMSA_WGMMA_D_OPERANDS
#undef FLASHMSA_WGMMA_D_PLACEHOLDERS

// The instruction for a 16-bit element type.
template <typename Element>
struct Wgmma64x128x16;

template <>
struct Wgmma64x128x16<__nv_bfloat16> {
  __device__ __forceinline__ static void run(float (&d)[64], uint64_t desc_a, uint64_t desc_b,
                                             uint32_t scale_d) {
    wgmma_m64n128k16_bf16(d, desc_a, desc_b, scale_d);
  }
  template <int kTransposeB = 0>
  __device__ __forceinline__ static void run(float (&d)[64], const uint32_t (&a)[4], uint64_t desc_b,
                                             uint32_t scale_d) {
    wgmma_m64n128k16_rs_bf16<kTransposeB>(d, a, desc_b, scale_d);
  }
};

template <>
struct Wgmma64x128x16<__half> {
  __device__ __forceinline__ static void run(float (&d)[64], uint64_t desc_a, uint64_t desc_b,
                                             uint32_t scale_d) {
    wgmma_m64n128k16_f16(d, desc_a, desc_b, scale_d);
  }
  template <int kTransposeB = 0>
  __device__ __forceinline__ static void run(float (&d)[64], const uint32_t (&a)[4], uint64_t desc_b,
                                             uint32_t scale_d) {
    wgmma_m64n128k16_rs_f16<kTransposeB>(d, a, desc_b, scale_d);
  }
};


// D[64xN] (+)= A[64x16]·B[Nx16]ᵀ for N < 128, both operands in shared memory; kTransposeA /
// kTransposeB = 1 read that operand MN-major (make_sw128_mnmajor_desc), 0 K-major. N/2 fp32
// accumulators per thread in the layout of the header comment.
template <typename Element, int N, int kTransposeA = 0, int kTransposeB = 0>
struct WgmmaSS;

#define FLASHMSA_WGMMA_SS_N(n, regs, placeholders, operand_list, ia, ib, is, ita, itb)                  \
  template <typename Element, int kTransposeA, int kTransposeB>                                          \
  struct WgmmaSS<Element, n, kTransposeA, kTransposeB> {                                                 \
    __device__ __forceinline__ static void run(float (&d)[regs], uint64_t desc_a, uint64_t desc_b,       \
                                               uint32_t scale_d) {                                       \
      if constexpr (std::is_same_v<Element, __half>) {                                                   \
        asm volatile("{\n.reg .pred accumulate;\nsetp.ne.b32 accumulate, " is ", 0;\n"                  \
                     "wgmma.mma_async.sync.aligned.m64n" #n "k16.f32.f16.f16 " placeholders ", " ia ", " ib \
                     ", accumulate, 1, 1, " ita ", " itb ";\n}\n"                                       \
                     : operand_list                                                                      \
                     : "l"(desc_a), "l"(desc_b), "r"(scale_d), "n"(kTransposeA), "n"(kTransposeB));      \
      } else {                                                                                           \
        asm volatile("{\n.reg .pred accumulate;\nsetp.ne.b32 accumulate, " is ", 0;\n"                  \
                     "wgmma.mma_async.sync.aligned.m64n" #n "k16.f32.bf16.bf16 " placeholders ", " ia ", " ib \
                     ", accumulate, 1, 1, " ita ", " itb ";\n}\n"                                       \
                     : operand_list                                                                      \
                     : "l"(desc_a), "l"(desc_b), "r"(scale_d), "n"(kTransposeA), "n"(kTransposeB));      \
      }                                                                                                  \
    }                                                                                                    \
  };

#define FLASHMSA_WGMMA_OPERANDS_8 \
    "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
FLASHMSA_WGMMA_SS_N(8, 4, "{%0, %1, %2, %3}", FLASHMSA_WGMMA_OPERANDS_8, "%4", "%5", "%6", "%7", "%8")
#undef FLASHMSA_WGMMA_OPERANDS_8

#define FLASHMSA_WGMMA_OPERANDS_16 \
    "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7])
FLASHMSA_WGMMA_SS_N(16, 8, "{%0, %1, %2, %3, %4, %5, %6, %7}", FLASHMSA_WGMMA_OPERANDS_16, "%8", "%9", "%10", "%11", "%12")
#undef FLASHMSA_WGMMA_OPERANDS_16

#define FLASHMSA_WGMMA_OPERANDS_32 \
    "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), \
    "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15])
FLASHMSA_WGMMA_SS_N(32, 16, "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}", FLASHMSA_WGMMA_OPERANDS_32, "%16", "%17", "%18", "%19", "%20")
#undef FLASHMSA_WGMMA_OPERANDS_32

#define FLASHMSA_WGMMA_OPERANDS_64 \
    "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), \
    "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), \
    "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), \
    "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
FLASHMSA_WGMMA_SS_N(64, 32,
                    "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15,"
                    "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}",
                    FLASHMSA_WGMMA_OPERANDS_64, "%32", "%33", "%34", "%35", "%36")
#undef FLASHMSA_WGMMA_OPERANDS_64

#define FLASHMSA_WGMMA_OPERANDS_128 \
    "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), \
    "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), \
    "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), \
    "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), \
    "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), \
    "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), \
    "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), \
    "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
FLASHMSA_WGMMA_SS_N(128, 64,
                    "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15,"
                    "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31,"
                    "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47,"
                    "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}",
                    FLASHMSA_WGMMA_OPERANDS_128, "%64", "%65", "%66", "%67", "%68")
#undef FLASHMSA_WGMMA_OPERANDS_128
#undef FLASHMSA_WGMMA_SS_N

}  // namespace flashmsa::kernels::ptx
