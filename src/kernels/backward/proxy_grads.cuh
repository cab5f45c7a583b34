// The proxy heads' gradients of the sparse backward (SPEC.md §3), from the g = π − t rows the wgmma
// tile kernel (pipelined_kernel.cuh) stores: per list (chunk, b, g, c, p) and entry e (a token's
// selection of block c) one row g[e][128 keys] in the input dtype, exactly as the products below
// consume it.
//
//   dq_proxy[token] += g[e] · k̃[block]          (64 entries × 128 keys × 128 dims per item)
//   dk_proxy[block] += Σ_e g[e]ᵀ · q̃[token(e)]  (128 keys × 64 entries × 128 dims per item)
//
// Comes after: the tile kernel of the same query chunk. Comes before: kernel.cuh's finish
// kernels. Layout of g: config.h (proxy_grad_*); design: docs/design.md "Backward".
//
// Work. A CTA takes a contiguous range of the chunk's schedule tiles and walks it as items of up
// to 64 consecutive entries of one list. The items' g rows (16 KB, contiguous), q̃ rows (gathered)
// and k̃ block (reloaded when the buffer last held another list) are copied with cp.async into one
// of three buffers (128-byte swizzled tiles) while another is multiplied by the two warpgroups with
// wgmma: warpgroup c computes dims 64c … of the item's dq_proxy (m64n64, g K-major, k̃ MN-major) and
// keys 64c … of dk_proxy (m64n128, gᵀ and q̃ MN-major). dq_proxy is reduce-added per item; dk_proxy
// of the list's 128 keys stays in the accumulators while the list lasts and is reduce-added when the
// CTA's part of the list ends.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <string>

#include "flashmsa/api.h"
#include "kernels/backward/config.h"
#include "kernels/backward/mma.cuh"
#include "kernels/common/device_cache.h"
#include "kernels/common/ptx/barrier.h"
#include "kernels/common/ptx/wgmma.h"
#include "kernels/common/strided.h"
#include "kernels/forward/pipelined_kernel.cuh"

namespace flashmsa::kernels::backward {

template <typename Element>
struct ProxyGradArgs {
  Strided<const Element> q_proxy, k_proxy;
  const Element* g;  // [entry − entry_offsets[key_begin]][kKeys]
  const uint32_t* entries[2];
  const int32_t* header;
  const uint4* tiles;
  const uint32_t* tile_offsets;
  const uint32_t* entry_offsets;
  int64_t key_begin, key_end;  // the chunk's list keys
  uint32_t* tile_counter;      // the chunk's counter of tiles dealt on demand (zeroed before)
  float* dq_proxy_accum;       // [b, s, hp, di]
  float* dk_proxy_accum;       // [b, s, hp, di]
  int seqlen, num_blocks, batch;
  int num_heads, num_kv_heads, num_proxy_heads, proxy_heads_per_kv, proxy_ratio;
};

constexpr int kProxyGradThreads = 256;
constexpr int kProxyItemEntries = 64;
constexpr int kProxyTileCache = kProxyGradThreads;  // schedule tiles read per refill, one per thread
constexpr int kProxyRowsPerThread = kProxyItemEntries * 16 / kProxyGradThreads;  // 16-byte copies per row set
constexpr int kProxyGradBuffers = 3;  // an item multiplied while the next two items' copies fly
// The wgmma operand tiles are two 64-column halves of 128-byte rows with the 128-byte swizzle
// (forward::sw128_offset), 1024-byte aligned.
struct ProxyGradBuffer {
  alignas(1024) uint16_t g[kProxyItemEntries * kKeys];             // [key half][entry][64 keys]
  alignas(1024) uint16_t q_proxy[kProxyItemEntries * kHeadDim];    // [dim half][entry][64 dims]
  alignas(1024) uint16_t k_proxy[kKeys * kHeadDim];                // [dim half][key][64 dims]
  int32_t token[kProxyItemEntries];
};
struct ProxyGradShared {
  ProxyGradBuffer buffers[kProxyGradBuffers];
  uint4 tiles[kProxyTileCache];  // the CTA's schedule tiles [tile_cache_first, + kProxyTileCache)
  uint32_t grab[2];              // the last ranges taken from the counter (thread 0 -> all)
};
constexpr int kProxyGradSmemBytes = int(sizeof(ProxyGradShared)) + 1024;  // + alignment slack

struct ProxyItem {
  uint32_t key, begin, count;  // list key, first entry, entries (≤ 64)
};

// A warpgroup's m64n128 fp32 fragment of dk_proxy reduce-added to a proxy head's rows: the
// thread's rows are keys key_pos and key_pos + 8 (columns = dims 2·(lane % 4) + 8j, + 1); keys past
// the sequence are skipped.
template <typename Args>
__device__ __forceinline__ void reduce_add_dk_proxy_rows(const Args& args, const float (&acc)[64], int b,
                                                         int proxy_head, int key_pos) {
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    if (key_pos + 8 * h < args.seqlen) {
      float* row = args.dk_proxy_accum +
                   ((int64_t(b) * args.seqlen + key_pos + 8 * h) * args.num_proxy_heads + proxy_head) * kHeadDim +
                   2 * (threadIdx.x % 4);
#pragma unroll
      for (int j = 0; j < 16; ++j) reduce_add2(row + 8 * j, acc[4 * j + 2 * h], acc[4 * j + 2 * h + 1]);
    }
  }
}

template <typename Element>
__global__ void __launch_bounds__(kProxyGradThreads, 1) proxy_grads_kernel(const ProxyGradArgs<Element> args) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  ProxyGradShared& shared = *reinterpret_cast<ProxyGradShared*>(ptx::align_shared_1024(smem_raw));
  const int thread = threadIdx.x;
  const int warp = ptx::warp_index();
  const int lane = thread % 32;
  const uint32_t* entries = args.header[0] == 1 ? args.entries[1] : args.entries[0];
  const uint32_t entry_base = args.entry_offsets[args.key_begin];
  const uint32_t first_tile = args.tile_offsets[args.key_begin];
  const uint64_t total = args.tile_offsets[args.key_end] - first_tile;
  // Load balance as in the forward tile kernel (forward/config.h, kDealtShare): an equal share of
  // all but 1/kDealtShare of the tiles, then ranges of the rest from the chunk's counter.
  const forward::TileSplit split = forward::split_tiles(uint32_t(total), gridDim.x);
  const uint32_t fixed = split.fixed, dealt = split.dealt, grab = split.grab;
  uint32_t t = first_tile + uint32_t(uint64_t(fixed) * blockIdx.x / gridDim.x);
  uint32_t t_end = first_tile + uint32_t(uint64_t(fixed) * (blockIdx.x + 1) / gridDim.x);
  uint32_t t_used = 0;  // entries of tile t already taken
  int grabs = 0;
  bool exhausted = false;

  // Tiles come from a shared copy refilled 256 at a time (one load per thread), so walking them
  // costs no dependent global loads. Called by all threads alike.
  uint32_t cache_first = 0xffffffffu;
  auto tile_at = [&](uint32_t index) {
    if (cache_first == 0xffffffffu || index >= cache_first + kProxyTileCache) {
      __syncthreads();  // every thread is done reading the previous copy
      cache_first = index;
      if (index + thread < t_end) shared.tiles[thread] = args.tiles[index + thread];
      __syncthreads();
    }
    return shared.tiles[index - cache_first];
  };
  // The next range from the counter (all threads alike; two slots, so a fast thread 0 never
  // overwrites the one the others are still reading).
  auto next_range = [&]() {
    if (exhausted) return false;
    if (thread == 0) shared.grab[grabs & 1] = atomicAdd(args.tile_counter, grab);
    __syncthreads();
    const uint32_t taken = shared.grab[grabs & 1];
    ++grabs;
    if (taken >= dealt) {
      exhausted = true;
      return false;
    }
    t = first_tile + fixed + taken;
    t_end = t + min(grab, dealt - taken);
    t_used = 0;
    cache_first = 0xffffffffu;  // the copy may hold tiles past the previous range's end, never loaded
    return true;
  };
  // The next item: up to 64 entries of consecutive tiles of one list (a list's tiles hold
  // consecutive entries).
  auto next_item = [&](ProxyItem& item) {
    if (t >= t_end && !next_range()) return false;
    uint4 tile = tile_at(t);
    item.key = tile.x;
    item.begin = tile.y + t_used;
    item.count = 0;
    while (item.count < kProxyItemEntries) {
      const uint32_t take = min(uint32_t(kProxyItemEntries) - item.count, tile.z - t_used);
      item.count += take;
      t_used += take;
      if (t_used < tile.z) break;
      ++t;
      t_used = 0;
      if (t >= t_end) break;
      tile = tile_at(t);
      if (tile.x != item.key) break;
    }
    return true;
  };
  // The query positions of this thread's copy rows (thread / 16 + 16·i) of an item, loaded an item
  // ahead of the copies that need them.
  auto load_tokens = [&](const ProxyItem& item, int (&token)[kProxyRowsPerThread]) {
#pragma unroll
    for (int i = 0; i < kProxyRowsPerThread; ++i) {
      const int row = thread / 16 + 16 * i;
      token[i] = row < int(item.count) ? int(entries[item.begin + row] >> schedule::kSlotBits) : -1;
    }
  };

  uint32_t loaded_key[kProxyGradBuffers];  // the list whose k̃ block each buffer holds
#pragma unroll
  for (int index = 0; index < kProxyGradBuffers; ++index) loaded_key[index] = 0xffffffffu;
  auto issue = [&](const ProxyItem& item, int index, const int (&token)[kProxyRowsPerThread]) {
    ProxyGradBuffer& buffer = shared.buffers[index];
    const forward::ListKey key = forward::decode_list_key(item.key, args);
    const Element* g_rows = args.g + int64_t(item.begin - entry_base) * kKeys;
    const int chunk = thread % 16;
#pragma unroll
    for (int i = 0; i < kProxyRowsPerThread; ++i) {
      const int row = thread / 16 + 16 * i;
      const bool valid = token[i] >= 0;
      const Element* src = valid ? g_rows + row * kKeys + chunk * 8 : args.g;
      cp_async_16(buffer.g + forward::sw128_offset(kProxyItemEntries, row, chunk), src, valid);
      const Element* q_src = valid ? args.q_proxy.row(key.b, token[i], key.proxy_head) + chunk * 8 : args.q_proxy.ptr;
      cp_async_16(buffer.q_proxy + forward::sw128_offset(kProxyItemEntries, row, chunk), q_src, valid);
      if (chunk == 0) buffer.token[row] = token[i];
    }
    // (index is uniform; the unrolled compares keep loaded_key in registers)
    bool new_list = false;
#pragma unroll
    for (int other = 0; other < kProxyGradBuffers; ++other) {
      if (other == index && loaded_key[other] != item.key) {
        loaded_key[other] = item.key;
        new_list = true;
      }
    }
    if (new_list) {
      const int first_key = key.block * kBlockSize;
      const int proxy_key_head = key.proxy_head / args.proxy_ratio;
      for (int i = thread; i < kKeys * 16; i += kProxyGradThreads) {
        const int row = i / 16;
        const bool valid = first_key + row < args.seqlen;
        const Element* src = valid ? args.k_proxy.row(key.b, first_key + row, proxy_key_head) + chunk * 8 : args.k_proxy.ptr;
        cp_async_16(buffer.k_proxy + forward::sw128_offset(kKeys, row, chunk), src, valid);
      }
    }
    ptx::cp_async_commit();
  };

  // Warpgroup c (warps 4c … 4c + 3) owns keys 64c … 64c + 63 of dk_proxy and dims 64c … 64c + 63
  // of an item's dq_proxy. dk: the list's m64n128 fragment (rows = keys 64c + 16·(warp % 4) +
  // lane/4 (+8), columns = dims), accumulated over the CTA's items of the list.
  const int consumer = warp / 4;
  const int row0 = 16 * (warp % 4) + lane / 4;  // this thread's first fragment row
  float dk[64];  // written first by a list's first product (scale-d 0), never zeroed
  uint32_t dk_key = 0xffffffffu;
  auto flush_dk = [&]() {
    const forward::ListKey key = forward::decode_list_key(dk_key, args);
    reduce_add_dk_proxy_rows(args, dk, key.b, key.proxy_head, key.block * kBlockSize + 64 * consumer + row0);
  };

  // Software pipeline: while item i is multiplied, items i + 1 and i + 2 have their copies in flight
  // and item i + 3's query positions are being loaded.
  ProxyItem item;
  if (!next_item(item)) return;
  {
    int token[kProxyRowsPerThread];
    load_tokens(item, token);
    issue(item, 0, token);
  }
  ProxyItem second{};
  bool has_second = next_item(second);
  if (has_second) {
    int token[kProxyRowsPerThread];
    load_tokens(second, token);
    issue(second, 1, token);
  }
  ProxyItem next{};
  bool has_next = has_second && next_item(next);
  int next_token[kProxyRowsPerThread] = {};
  if (has_next) load_tokens(next, next_token);
  for (int index = 0;; index = index == kProxyGradBuffers - 1 ? 0 : index + 1) {
    // Item i + 2 takes the buffer of item i − 1, last read before the barrier that ended it.
    if (has_next) issue(next, index == 0 ? kProxyGradBuffers - 1 : index - 1, next_token);
    ProxyItem after{};
    const bool has_after = has_next && next_item(after);
    int after_token[kProxyRowsPerThread] = {};
    if (has_after) load_tokens(after, after_token);
    if (has_next) {
      ptx::cp_async_wait<2>();
    } else if (has_second) {
      ptx::cp_async_wait<1>();
    } else {
      ptx::cp_async_wait<0>();
    }
    ptx::fence_proxy_async_shared();  // the landed copies are wgmma operands
    __syncthreads();
    const ProxyGradBuffer& buffer = shared.buffers[index];
    const forward::ListKey key = forward::decode_list_key(item.key, args);

    // A new list starts its dk with the first product (scale-d 0) rather than zeroing the registers
    // after the flush, which would have the compiler copy the accumulators between register sets.
    const bool dk_fresh = item.key != dk_key;
    if (dk_fresh) {
      if (dk_key != 0xffffffffu) flush_dk();
      dk_key = item.key;
    }
    // ---- dq_proxy = g · k̃ (this warpgroup's 64 dims; g K-major, k̃ MN-major) and dk_proxy += gᵀ · q̃
    // (this warpgroup's 64 keys; both MN-major), one wgmma group ------------------------------------
    float dq[32];
    ptx::wgmma_fence();
#pragma unroll
    for (int k_step = 0; k_step < kKeys / 16; ++k_step) {
      const uint64_t desc_g =
          ptx::advance_desc(ptx::make_sw128_kmajor_desc(buffer.g + (k_step / 4) * kProxyItemEntries * 64), (k_step % 4) * 32);
      const uint64_t desc_kp =
          ptx::make_sw128_mnmajor_desc(buffer.k_proxy + consumer * kKeys * 64 + k_step * 16 * 64, kKeys * 128);
      ptx::WgmmaSS<Element, 64, 0, 1>::run(dq, desc_g, desc_kp, k_step > 0 ? 1u : 0u);
    }
#pragma unroll
    for (int k_step = 0; k_step < kProxyItemEntries / 16; ++k_step) {
      const uint64_t desc_gt = ptx::make_sw128_mnmajor_desc(
          buffer.g + consumer * kProxyItemEntries * 64 + k_step * 16 * 64, kProxyItemEntries * 128);
      const uint64_t desc_qp =
          ptx::make_sw128_mnmajor_desc(buffer.q_proxy + k_step * 16 * 64, kProxyItemEntries * 128);
      ptx::WgmmaSS<Element, 128, 1, 1>::run(dk, desc_gt, desc_qp, k_step > 0 || !dk_fresh ? 1u : 0u);
    }
    ptx::wgmma_commit_group();
    ptx::wgmma_wait_group<0>();
    ptx::fence_accumulators(dq);
    ptx::fence_accumulators(dk);
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int token = buffer.token[row0 + 8 * h];
      if (token >= 0) {
        float* row = args.dq_proxy_accum +
                     ((int64_t(key.b) * args.seqlen + token) * args.num_proxy_heads + key.proxy_head) * kHeadDim +
                     64 * consumer + 2 * (lane % 4);
#pragma unroll
        for (int j = 0; j < 8; ++j) reduce_add2(row + 8 * j, dq[4 * j + 2 * h], dq[4 * j + 2 * h + 1]);
      }
    }
    __syncthreads();  // this buffer's readers are done before an issue overwrites it
    if (!has_second) break;
    item = second;
    second = next;
    has_second = has_next;
    next = after;
    has_next = has_after;
#pragma unroll
    for (int i = 0; i < kProxyRowsPerThread; ++i) next_token[i] = after_token[i];
  }
  flush_dk();
}

template <typename Element>
Status launch_proxy_grads(const ProxyGradArgs<Element>& args, cudaStream_t stream) {
  int device = 0;
  int sm_count = 0;
  cudaError_t error = current_device_sms(&device, &sm_count);
  if (error == cudaSuccess) {
    error = set_max_dynamic_smem(reinterpret_cast<const void*>(proxy_grads_kernel<Element>), device,
                                 kProxyGradSmemBytes);
  }
  if (error == cudaSuccess) {
    proxy_grads_kernel<Element><<<unsigned(sm_count), kProxyGradThreads, kProxyGradSmemBytes, stream>>>(args);
    error = cudaGetLastError();
  }
  if (error == cudaSuccess) return Status::Ok();
  return {StatusCode::kCudaError, std::string("backward: proxy gradients: ") + cudaGetErrorString(error)};
}

}  // namespace flashmsa::kernels::backward
