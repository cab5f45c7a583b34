// The sparse forward's combine: merges the ≤ K partial outputs of every (query row, head) of one
// query chunk by their LSEs into O (input dtype, strided) and LSE [b, h, s], and the proxy partial
// LSEs into proxy_lse [b, hp, s].
//
// Comes before: forward/kernel.cuh (the partials of the chunk). Last stage of the forward.
//
// One warp per (row, proxy head), taking the proxy head's heads one after another: the selection
// (shared by those heads) and the proxy LSE are read once. Per head the two half-warps take
// alternate slots and lane l owns dims 8·(l % 16) … + 7, so each load instruction reads two partial
// rows as 16-byte pieces and a warp has up to 16 rows (4 KB) in flight; the halves' sums meet
// through one shuffle. The partials of a (row, proxy head) are one M·K·D region
// ([chunk_rows, Hp, K, M, D], config.h), read head after head, a head's slots M·D apart. The first
// sixteen slots are requested before the head's LSE loads. Slots whose block_idx entry is −1 were
// never written and are skipped.
#pragma once

#include <cstdint>

#include "kernels/forward/kernel.cuh"

namespace flashmsa::kernels::forward {

template <typename Element>
struct CombineArgs {
  const Element* partial_out;      // [chunk_rows, Hp, K, M, D] (config.h partial_index)
  const float* partial_lse;        // [chunk_rows, Hp, K, M]
  const float* partial_proxy_lse;  // [chunk_rows, Hp, K]
  const int32_t* block_idx;        // [b, hp, s, k]
  Strided<Element> out;            // [b, s, h, d]
  float* lse;                      // [b, h, s]
  float* proxy_lse;                // [b, hp, s]
  int64_t chunk_first_row;
  int64_t chunk_rows;              // rows of this chunk (the last may be short)
  int64_t seqlen;
  int num_heads, num_proxy_heads, heads_per_proxy, top_k;
};

struct alignas(8) Half4 {
  uint32_t low, high;
};

template <typename Element>
__device__ __forceinline__ void unpack4(const Half4& packed, float (&values)[4]) {
  using Pair = typename std::conditional<std::is_same<Element, __half>::value, __half2, __nv_bfloat162>::type;
  const Pair low = *reinterpret_cast<const Pair*>(&packed.low);
  const Pair high = *reinterpret_cast<const Pair*>(&packed.high);
  if constexpr (std::is_same<Element, __half>::value) {
    const float2 a = __half22float2(low);
    const float2 c = __half22float2(high);
    values[0] = a.x, values[1] = a.y, values[2] = c.x, values[3] = c.y;
  } else {
    const float2 a = __bfloat1622float2(low);
    const float2 c = __bfloat1622float2(high);
    values[0] = a.x, values[1] = a.y, values[2] = c.x, values[3] = c.y;
  }
}

// Log-sum-exp over the lanes' values (−inf lanes contribute nothing); returns (max, Σ e^(x − max)).
__device__ __forceinline__ float2 warp_logsumexp_parts(float x0, float x1) {
  float top = fmaxf(x0, x1);
  for (int offset = 16; offset > 0; offset /= 2) top = fmaxf(top, __shfl_xor_sync(0xffffffffu, top, offset));
  const float base = top == kNegInf ? 0.f : top;
  float sum = exp2_approx((x0 - base) * kLog2e) + exp2_approx((x1 - base) * kLog2e);
  for (int offset = 16; offset > 0; offset /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, offset);
  return make_float2(top, sum);
}

// The log-sum-exp from warp_logsumexp_parts' (max, sum): −inf when no lane held a value.
__device__ __forceinline__ float logsumexp_of(float2 parts) {
  return parts.y > 0.f ? parts.x + logf(parts.y) : kNegInf;
}

template <typename Element>
__global__ void __launch_bounds__(256, 3) sparse_forward_combine(const CombineArgs<Element> args) {
  // One warp per (row, proxy head): the row's selection, its validity masks and the proxy LSE are
  // read once, then the warp merges the partials of the proxy head's heads one after another.
  const int64_t warp_index = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
  const int lane = threadIdx.x % 32;
  if (warp_index >= args.chunk_rows * args.num_proxy_heads) return;
  const int proxy_head = int(warp_index % args.num_proxy_heads);
  const int64_t local_row = warp_index / args.num_proxy_heads;
  const int64_t flat_row = args.chunk_first_row + local_row;
  const int64_t b = flat_row / args.seqlen;
  const int64_t i = flat_row % args.seqlen;
  const int K = args.top_k;
  const int M = args.heads_per_proxy;
  const int half = lane / 16;
  const int slot_stride = M * (kHeadDim / 8);  // 16-byte pieces between a head's slots

  // ---- the selection: which slots hold a partial ---------------------------------------------
  const int32_t* selection = args.block_idx + ((b * args.num_proxy_heads + proxy_head) * args.seqlen + i) * K;
  const bool valid0 = (lane < K ? selection[lane] : -1) >= 0;
  const bool valid1 = (lane + 32 < K ? selection[lane + 32] : -1) >= 0;
  const uint32_t valid_mask0 = __ballot_sync(0xffffffffu, valid0);
  const uint32_t valid_mask1 = __ballot_sync(0xffffffffu, valid1);

  // ---- proxy LSE ------------------------------------------------------------------------------
  {
    const float* proxy_row = args.partial_proxy_lse + (local_row * args.num_proxy_heads + proxy_head) * K;
    const float2 proxy = warp_logsumexp_parts(valid0 ? proxy_row[lane] : kNegInf,
                                              valid1 ? proxy_row[lane + 32] : kNegInf);
    if (lane == 0) {
      args.proxy_lse[(b * args.num_proxy_heads + proxy_head) * args.seqlen + i] = logsumexp_of(proxy);
    }
  }

  for (int m = 0; m < M; ++m) {
    const int head = proxy_head * M + m;
    // The masks re-enter the loop opaque: otherwise the compiler hoists every slot's keep mask out
    // of it and spills them.
    uint32_t mask0 = valid_mask0;
    uint32_t mask1 = valid_mask1;
    asm volatile("" : "+r"(mask0), "+r"(mask1));
    // (row, proxy head, slot 0, m): slot s is s · M entries further.
    const int64_t head_first = partial_index(local_row, proxy_head, 0, m, args.num_proxy_heads, K, M);
    const uint4* partial = reinterpret_cast<const uint4*>(args.partial_out + head_first * kHeadDim) +
                           half * slot_stride + lane % 16;
    // Slots first + 2u + half, u < 8, one 16-byte piece each. Unconditional: a slot past K reads
    // slot 0 (always present; `partial` already points `half` slots in) and is discarded by the
    // sum, so the eight loads carry no predicate. Sixteen slots present (K = 16 has only those) are
    // read at fixed offsets from one address.
    auto load_slots = [&](int first, uint4 (&loaded)[8]) {
      if (first + 16 <= K) {
#pragma unroll
        for (int u = 0; u < 8; ++u) loaded[u] = __ldg(partial + (first + 2 * u) * slot_stride);
      } else {
#pragma unroll
        for (int u = 0; u < 8; ++u) {
          const int slot = first + 2 * u + half < K ? first + 2 * u : -half;
          loaded[u] = __ldg(partial + slot * slot_stride);
        }
      }
    };
    // The first sixteen slots are requested before the LSE loads, so their latency overlaps them
    // (a shuffle is a point the compiler does not move loads across).
    uint4 loaded[8];
    load_slots(0, loaded);

    // ---- weights of the partials ----------------------------------------------------------------
    const float* lse_row = args.partial_lse + head_first;
    const float stored0 = lane < K ? lse_row[lane * M] : kNegInf;
    const float stored1 = lane + 32 < K ? lse_row[(lane + 32) * M] : kNegInf;
    const float lse0 = valid0 ? stored0 : kNegInf;
    const float lse1 = valid1 ? stored1 : kNegInf;
    const float2 parts = warp_logsumexp_parts(lse0, lse1);
    const float base = parts.x == kNegInf ? 0.f : parts.x;
    const float inverse = parts.y > 0.f ? rcp_approx(parts.y) : 0.f;
    const float weight0 = exp2_approx((lse0 - base) * kLog2e) * inverse;
    const float weight1 = exp2_approx((lse1 - base) * kLog2e) * inverse;

    // ---- weighted sum of the partial outputs ------------------------------------------------------
    float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
    // Slots that were never written hold stale bytes (possibly NaN patterns): their 16-bit pairs
    // are masked to zero before the multiply-add (their weight is zero), never multiplied as they are.
#pragma unroll
    for (int first = 0; first < kMaxTopK; first += 16) {
      if (first >= K) break;
      if (first > 0) load_slots(first, loaded);
#pragma unroll
      for (int u = 0; u < 8; ++u) {
        const int slot = first + 2 * u + half;
        const float weight = __shfl_sync(0xffffffffu, slot < 32 ? weight0 : weight1, slot & 31);
        const bool valid = slot < K && (((slot < 32 ? mask0 : mask1) >> (slot & 31)) & 1u) != 0;
        const uint32_t keep = valid ? 0xffffffffu : 0u;
        float values[8];
        unpack4<Element>(Half4{loaded[u].x & keep, loaded[u].y & keep}, *reinterpret_cast<float(*)[4]>(values));
        unpack4<Element>(Half4{loaded[u].z & keep, loaded[u].w & keep}, *reinterpret_cast<float(*)[4]>(values + 4));
#pragma unroll
        for (int d = 0; d < 8; ++d) acc[d] = fmaf(weight, values[d], acc[d]);
      }
    }
#pragma unroll
    for (int d = 0; d < 8; ++d) acc[d] += __shfl_xor_sync(0xffffffffu, acc[d], 16);
    // Both halves hold the sums: half h writes dims 8·(l % 16) + 4h … + 3.
    Half4 packed;
    packed.low = ptx::pack2<Element>(half ? acc[4] : acc[0], half ? acc[5] : acc[1]);
    packed.high = ptx::pack2<Element>(half ? acc[6] : acc[2], half ? acc[7] : acc[3]);
    *reinterpret_cast<Half4*>(args.out.row(b, i, head) + (lane % 16) * 8 + half * 4) = packed;
    if (lane == 0) {
      args.lse[(b * args.num_heads + head) * args.seqlen + i] = logsumexp_of(parts);
    }
  }
}

}  // namespace flashmsa::kernels::forward
