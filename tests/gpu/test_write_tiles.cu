// The schedule's last pass (write_tiles in src/kernels/schedule/kernel.cuh) on a key table with more
// than 2^27 keys, i.e. more than 2^32 threads at one warp per key: every list's tiles must be
// written, the highest keys' too. Shapes that reach this exist within one H200's memory (e.g.
// B = 3, S = 704K, Hp = 16, K = 37: 1.4·10^8 keys), so the pass is checked on its own here with
// synthetic list bounds instead of a whole schedule of that size.
#include <algorithm>
#include <vector>

#include "gpu/gpu_test.h"

// Defined in src/kernels/schedule/kernel.cuh and compiled into the library (its schedule.cu); the
// header's other kernels are not inline, so it is declared here rather than included twice.
namespace flashmsa::kernels::schedule {
__global__ void write_tiles(const uint32_t* __restrict__ entry_offsets,
                            const uint32_t* __restrict__ tile_offsets, uint32_t num_keys,
                            int tokens_per_tile, uint4* __restrict__ tiles,
                            int32_t* __restrict__ header, int32_t values_buffer);
}  // namespace flashmsa::kernels::schedule

namespace flashmsa {
namespace {

namespace sched = kernels::schedule;

TEST(ScheduleWriteTiles, EveryKeyPastTwoToThe27) {
  FLASHMSA_REQUIRE_HOPPER();
  constexpr uint32_t kKeys = (uint32_t(1) << 27) + 1000;
  constexpr int kTokensPerTile = 8;
  constexpr int kThreads = 256;
  // List k holds k % 17 entries: 0, 1 or 2 tiles, the last one partial.
  auto length = [](uint32_t key) { return key % 17; };
  std::vector<uint32_t> entry_offsets(size_t(kKeys) + 1);
  std::vector<uint32_t> tile_offsets(size_t(kKeys) + 1);
  entry_offsets[0] = 5;  // need not start at 0
  tile_offsets[0] = 0;
  for (uint32_t k = 0; k < kKeys; ++k) {
    entry_offsets[k + 1] = entry_offsets[k] + length(k);
    tile_offsets[k + 1] = tile_offsets[k] + (length(k) + kTokensPerTile - 1) / kTokensPerTile;
  }
  const uint32_t total_tiles = tile_offsets[kKeys];

  testing::DeviceBuffer<uint32_t> device_entry_offsets(entry_offsets.size());
  testing::DeviceBuffer<uint32_t> device_tile_offsets(tile_offsets.size());
  testing::DeviceBuffer<uint4> device_tiles(total_tiles);
  testing::DeviceBuffer<int32_t> device_header(1);
  device_entry_offsets.upload(entry_offsets);
  device_tile_offsets.upload(tile_offsets);
  device_tiles.poison();
  device_header.poison();
  const int64_t threads = int64_t(kKeys) * 32;
  ASSERT_GT(threads, int64_t(1) << 32);
  sched::write_tiles<<<unsigned((threads + kThreads - 1) / kThreads), kThreads>>>(
      device_entry_offsets.get(), device_tile_offsets.get(), kKeys, kTokensPerTile,
      device_tiles.get(), device_header.get(), 1);
  ASSERT_EQ(cudaGetLastError(), cudaSuccess);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  EXPECT_EQ(device_header.download()[0], 1);

  const std::vector<uint4> tiles = device_tiles.download();
  uint32_t wrong = 0;
  uint32_t first_wrong_key = kKeys;
  for (uint32_t k = 0; k < kKeys; ++k) {
    for (uint32_t t = tile_offsets[k]; t < tile_offsets[k + 1]; ++t) {
      const uint32_t begin = (t - tile_offsets[k]) * kTokensPerTile;
      const uint32_t rows = std::min<uint32_t>(kTokensPerTile, length(k) - begin);
      const uint4 tile = tiles[t];
      if (tile.x != k || tile.y != entry_offsets[k] + begin || tile.z != rows || tile.w != 0) {
        if (wrong++ == 0) first_wrong_key = k;
      }
    }
  }
  EXPECT_EQ(wrong, 0u) << "tiles not written as listed; the first at key " << first_wrong_key
                       << " of " << kKeys;
}

}  // namespace
}  // namespace flashmsa
