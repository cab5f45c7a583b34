// flashmsa_traffic: the forward tile kernel's DRAM traffic without its arithmetic, to tell how
// fast that access mix can go on this GPU (design.md "Next", item 10).
//
//   flashmsa_traffic [--tiles N] [--ctas-per-sm N] [--out FILE]
//
// A tile of the paper config (M = 16 heads per proxy head, 8 tokens of a 128-key block) reads each
// token's 16 query rows (4 KB, contiguous, at a random token of a 16K-row chunk: 268 MB, far past
// L2) and writes 16 partial rows of 256 bytes per token, 4 KB apart (partials [rows, H = 64,
// K = 16, D = 128] in a 4.3 GB buffer). One warp moves one token. Modes: the reads alone, the
// writes alone, both (the tile kernel's mix), the writes alone and both with a token's M heads of
// one slot adjacent ([rows, H / M, K, M, D]: one 4 KB piece per token), the combine's reads of
// every partial in either layout, and a sequential read and copy of the same bytes as the ceiling
// of plain streaming. Prints TB/s counting the bytes each mode moves; --out also writes them as
// JSON ({"gpu", "ctas_per_sm", "tiles", "modes": [{"mode", "ms", "gb", "tbps"}]}), the
// "traffic" entry of the results file (scripts/gpu_check.sh).
#include <cuda_runtime_api.h>

#include <cstdint>
#include <cstdio>
#include <fstream>
#include <optional>
#include <string>
#include <type_traits>
#include <vector>

#include "bench.h"
#include "common/flags.h"
#include "flashmsa/api.h"

namespace {

using flashmsa::testing::DeviceBuffer;

constexpr int kRows = 16384;     // query rows of one chunk
constexpr int kHeads = 64;       // H
constexpr int kGroupHeads = 16;  // M: heads gathered per token
constexpr int kGroups = kHeads / kGroupHeads;
constexpr int kSlots = 16;         // K
constexpr int kRowBytes = 256;     // D = 128 in 16 bits
constexpr int kTokensPerTile = 8;  // 128 rows / M
constexpr int kThreads = kTokensPerTile * 32;
constexpr size_t kQBytes = size_t(kRows) * kHeads * kRowBytes;
constexpr size_t kOutBytes = kQBytes * kSlots;
constexpr int kChunksPerToken = kGroupHeads * kRowBytes / 16 / 32;  // 16-byte chunks per lane: 8

enum Mode { kRead = 1, kWrite = 2, kBoth = 3 };

__device__ __forceinline__ uint32_t mix(uint32_t x) {
  x ^= x >> 16;
  x *= 0x7feb352dU;
  x ^= x >> 15;
  x *= 0x846ca68bU;
  x ^= x >> 16;
  return x;
}

// Tiles are walked by a persistent grid; tile i's token w is a hash of (i, w). kHeadsAdjacent
// writes the partials as [rows, H / M, K, M, D] (a token's M heads of one slot adjacent: one 4 KB
// piece per token) instead of [rows, H, K, D] (16 rows of 256 bytes, 4 KB apart).
template <int kMode, bool kHeadsAdjacent = false>
__global__ void __launch_bounds__(kThreads)
    scattered_tiles(const uint4* q, uint4* out, int64_t tiles, uint4* sink) {
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  uint4 acc = make_uint4(0, 0, 0, 0);
  for (int64_t tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
    const uint32_t hash = mix(uint32_t(tile) * kTokensPerTile + warp);
    const uint32_t token = hash % kRows;
    const uint32_t group = uint32_t(tile) % kGroups;
    const uint32_t slot = (hash >> 20) % kSlots;
    const size_t row = size_t(token) * kHeads + group * kGroupHeads;  // first head's row
    uint4 data[kChunksPerToken];
#pragma unroll
    for (int c = 0; c < kChunksPerToken; ++c) {
      const int index = c * 32 + lane;  // head index / 16, 16-byte chunk index % 16
      if constexpr (kMode & kRead) {
        data[c] = __ldcg(q + row * (kRowBytes / 16) + index);
      } else {
        data[c] = make_uint4(token, index, slot, 1);
      }
    }
#pragma unroll
    for (int c = 0; c < kChunksPerToken; ++c) {
      const int index = c * 32 + lane;
      const size_t head_row = row + index / 16;
      if constexpr (kMode & kWrite) {
        const size_t out_row = kHeadsAdjacent ? (size_t(token) * kGroups + group) * kSlots * kGroupHeads +
                                                    size_t(slot) * kGroupHeads + index / 16
                                              : head_row * kSlots + slot;
        out[out_row * (kRowBytes / 16) + index % 16] = data[c];
      } else {
        acc.x ^= data[c].x;
        acc.y ^= data[c].y;
        acc.z ^= data[c].z;
        acc.w ^= data[c].w;
      }
    }
  }
  if (acc.x == 0x12345678u) sink[threadIdx.x] = acc;  // keeps the reads of the read-only mode
}

// The combine's reads: one warp per (row, group) region of M · K partial rows (64 KB, contiguous in
// both layouts), head after head, each head's K slots as 16-byte pieces by the two half-warps. As
// [rows, H, K, D] a head's slots are one 4 KB piece; as [rows, H / M, K, M, D] they are 256 bytes
// each, 4 KB apart.
template <bool kHeadsAdjacent>
__global__ void __launch_bounds__(256) combine_reads(const uint4* partial, int64_t regions, uint4* sink) {
  const int lane = threadIdx.x % 32;
  const int half = lane / 16;
  uint4 acc = make_uint4(0, 0, 0, 0);
  for (int64_t region = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) / 32; region < regions;
       region += int64_t(gridDim.x) * blockDim.x / 32) {
    const uint4* base = partial + region * kGroupHeads * kSlots * (kRowBytes / 16) + lane % 16;
    for (int m = 0; m < kGroupHeads; ++m) {
      uint4 loaded[kSlots / 2];
#pragma unroll
      for (int u = 0; u < kSlots / 2; ++u) {
        const int slot = 2 * u + half;
        const int row = kHeadsAdjacent ? slot * kGroupHeads + m : m * kSlots + slot;
        loaded[u] = __ldcg(base + row * (kRowBytes / 16));
      }
#pragma unroll
      for (int u = 0; u < kSlots / 2; ++u) {
        acc.x ^= loaded[u].x;
        acc.y ^= loaded[u].y;
      }
    }
  }
  if (acc.x == 0x12345678u) sink[threadIdx.x % kThreads] = acc;
}

__global__ void sequential_copy(const uint4* in, uint4* out, int64_t count, uint4* sink,
                                bool copy) {
  uint4 acc = make_uint4(0, 0, 0, 0);
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < count;
       i += int64_t(gridDim.x) * blockDim.x) {
    const uint4 value = __ldcg(in + i);
    if (copy) {
      out[i] = value;
    } else {
      acc.x ^= value.x;
      acc.y ^= value.y;
    }
  }
  if (acc.x == 0x12345678u) sink[threadIdx.x] = acc;
}

}  // namespace

int main(int argc, char** argv) {
  int64_t tiles = 1 << 20;  // ≈ 34 GB each way, about the 128K paper forward's 1.05M tiles
  int ctas_per_sm = 8;
  std::string out_path;
  for (int i = 1; i < argc; i += 2) {
    const std::string flag = argv[i];
    if (flag != "--tiles" && flag != "--ctas-per-sm" && flag != "--out") {
      std::fprintf(stderr, "flashmsa_traffic: unknown flag %s\n", flag.c_str());
      return 2;
    }
    const std::string value = i + 1 < argc ? argv[i + 1] : "";
    if (flag == "--out") {
      if (value.empty()) {
        std::fprintf(stderr, "flashmsa_traffic: --out needs a file name\n");
        return 2;
      }
      out_path = value;
      continue;
    }
    std::string error;
    const bool is_tiles = flag == "--tiles";
    const std::optional<int64_t> parsed =
        flashmsa::testing::parse_integer(flag, value, 1, is_tiles ? int64_t(1) << 40 : 32, error);
    if (!parsed) {
      std::fprintf(stderr, "flashmsa_traffic: %s\n", error.c_str());
      return 2;
    }
    if (is_tiles) {
      tiles = *parsed;
    } else {
      ctas_per_sm = int(*parsed);
    }
  }
  if (!flashmsa::hopper_available()) {
    std::fprintf(stderr, "flashmsa_traffic: no Hopper GPU (H100/H200) here; nothing to time\n");
    return 1;
  }
  int device = 0;
  FLASHMSA_CUDA_CHECK(cudaGetDevice(&device));
  cudaDeviceProp prop{};
  FLASHMSA_CUDA_CHECK(cudaGetDeviceProperties(&prop, device));
  DeviceBuffer<uint4> q(kQBytes / 16);
  DeviceBuffer<uint4> out(kOutBytes / 16);
  DeviceBuffer<uint4> sink(kThreads);
  FLASHMSA_CUDA_CHECK(cudaMemset(q.get(), 1, kQBytes));
  FLASHMSA_CUDA_CHECK(cudaMemset(out.get(), 0, kOutBytes));
  const int grid = prop.multiProcessorCount * ctas_per_sm;
  const double tile_bytes = double(kTokensPerTile) * kGroupHeads * kRowBytes;
  std::printf("%s, %d SMs, grid %d x %d threads, %lld tiles\n", prop.name, prop.multiProcessorCount,
              grid, kThreads, static_cast<long long>(tiles));
  std::printf("%-34s %10s %10s %8s\n", "mode", "ms", "GB", "TB/s");
  // Median of 10 runs, each after an L2 flush (bench.h).
  struct Measured {
    std::string mode;
    double ms, gb, tbps;
  };
  std::vector<Measured> measured;
  auto report = [&](const char* name, const std::function<void(cudaStream_t)>& work, double bytes) {
    const double ms = flashmsa::bench::time_median_ms(work, nullptr, 2, 10);
    measured.push_back({name, ms, bytes / 1e9, bytes / (ms * 1e-3) / 1e12});
    std::printf("%-34s %10.3f %10.2f %8.3f\n", name, ms, bytes / 1e9, measured.back().tbps);
  };
  const double one_way = tile_bytes * double(tiles);
  // The scattered tiles in one mode (kRead, kWrite or kBoth) and partial layout, as a benchmark's
  // work.
  auto scattered = [&](auto mode, auto heads_adjacent) {
    return [&, mode, heads_adjacent](cudaStream_t stream) {
      scattered_tiles<decltype(mode)::value, decltype(heads_adjacent)::value>
          <<<grid, kThreads, 0, stream>>>(q.get(), out.get(), tiles, sink.get());
    };
  };
  using Read = std::integral_constant<int, kRead>;
  using Write = std::integral_constant<int, kWrite>;
  using Both = std::integral_constant<int, kBoth>;
  report("scattered 4 KB reads", scattered(Read(), std::false_type()), one_way);
  report("scattered 256 B writes", scattered(Write(), std::false_type()), one_way);
  report("both (the tile kernel's mix)", scattered(Both(), std::false_type()), 2 * one_way);
  // The same with a token's M heads of one slot adjacent in the partials.
  report("4 KB writes, heads adjacent", scattered(Write(), std::true_type()), one_way);
  report("both, heads adjacent", scattered(Both(), std::true_type()), 2 * one_way);
  const int64_t regions = int64_t(kRows) * kGroups;
  report(
      "combine reads, [rows, H, K, D]",
      [&](cudaStream_t stream) {
        combine_reads<false><<<grid, 256, 0, stream>>>(out.get(), regions, sink.get());
      },
      double(kOutBytes));
  report(
      "combine reads, heads adjacent",
      [&](cudaStream_t stream) {
        combine_reads<true><<<grid, 256, 0, stream>>>(out.get(), regions, sink.get());
      },
      double(kOutBytes));
  const int64_t count = int64_t(kOutBytes / 16);
  report(
      "sequential read",
      [&](cudaStream_t stream) {
        sequential_copy<<<grid, 256, 0, stream>>>(out.get(), nullptr, count, sink.get(), false);
      },
      double(kOutBytes));
  const int64_t half = count / 2;
  report(
      "sequential copy",
      [&](cudaStream_t stream) {
        sequential_copy<<<grid, 256, 0, stream>>>(out.get(), out.get() + half, half, sink.get(),
                                                  true);
      },
      double(kOutBytes));
  if (!out_path.empty()) {
    using flashmsa::bench::json_string;
    std::ofstream out_file(out_path);
    out_file << "{\"gpu\": " << json_string(prop.name) << ", \"ctas_per_sm\": " << ctas_per_sm
             << ", \"tiles\": " << tiles << ", \"modes\": [\n";
    for (size_t i = 0; i < measured.size(); ++i) {
      const Measured& m = measured[i];
      out_file << "  {\"mode\": " << json_string(m.mode) << ", \"ms\": " << m.ms << ", \"gb\": " << m.gb
               << ", \"tbps\": " << m.tbps << "}" << (i + 1 < measured.size() ? "," : "") << "\n";
    }
    out_file << "]}\n";
    if (!out_file) {
      std::fprintf(stderr, "flashmsa_traffic: could not write %s\n", out_path.c_str());
      return 1;
    }
  }
  return 0;
}
