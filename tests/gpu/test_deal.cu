// The dealing of tiles to a persistent grid (src/kernels/schedule/deal.cuh) against a direct
// search on the host: for random segments of lists (empty, one-tile and long lists, runs of empty
// keys), grids from 1 to kMaxDealGrid, whole and partial shares, bounds[x] must be the first
// tile i whose weight before it reaches ⌊W · share · x / grid⌋. The properties the tile kernels
// rely on follow and are checked too: bounds[0] is the segment's first tile, the bounds never
// decrease, and a whole share ends at the segment's last tile.
#include <random>
#include <vector>

#include "gpu/gpu_test.h"
#include "kernels/schedule/deal.cuh"

namespace flashmsa {
namespace {

namespace sched = kernels::schedule;

struct DealCase {
  int segments;
  int64_t segment_keys;
  int max_list_tiles;  // a non-empty list has 1 … max_list_tiles tiles
  double empty_share;  // probability that a list is empty
};

// Host rule: the first i in [begin, end] with W(i) ≥ target, W(i) the weight of the tiles before i.
uint32_t first_reaching(const std::vector<uint32_t>& offsets, int64_t first, int64_t keys,
                        const sched::DealWeights& w, uint64_t target) {
  uint64_t weight = 0;
  for (int64_t k = first; k < first + keys; ++k) {
    const uint32_t at = offsets[k];
    const uint32_t count = offsets[k + 1] - at;
    if (count == 0) continue;
    for (uint32_t j = 0; j < count; ++j) {
      // W(at + j): the list's start weight counts from its second tile on.
      const uint64_t before = weight + (j > 0 ? w.list + uint64_t(w.tile) * j : 0);
      if (before >= target) return at + j;
    }
    weight += w.list + uint64_t(w.tile) * count;
  }
  return offsets[first + keys];
}

void check_deal(const DealCase& c, int grid, const sched::DealWeights& w, uint64_t seed) {
  FLASHMSA_SEED_TRACE(seed);
  SCOPED_TRACE(::testing::Message() << "grid " << grid << ", weights " << w.tile << "/" << w.list
                                    << ", share " << w.share_num << "/" << w.share_den);
  std::mt19937_64 generator(seed);
  std::uniform_int_distribution<int> length(1, c.max_list_tiles);
  std::bernoulli_distribution empty(c.empty_share);
  const int64_t keys = c.segments * c.segment_keys;
  std::vector<uint32_t> offsets(keys + 1);
  offsets[0] =
      uint32_t(std::uniform_int_distribution<int>(0, 1000)(generator));  // need not start at 0
  for (int64_t k = 0; k < keys; ++k)
    offsets[k + 1] = offsets[k] + (empty(generator) ? 0u : uint32_t(length(generator)));

  testing::DeviceBuffer<uint32_t> device_offsets(offsets.size());
  device_offsets.upload(offsets);
  testing::DeviceBuffer<uint32_t> device_bounds(size_t(c.segments) * (sched::kMaxDealGrid + 1));
  device_bounds.poison();
  sched::deal_tile_bounds<sched::kDealThreads><<<unsigned(c.segments), sched::kDealThreads>>>(
      device_offsets.get(), c.segment_keys, grid, w, device_bounds.get());
  ASSERT_EQ(cudaGetLastError(), cudaSuccess);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  const std::vector<uint32_t> bounds = device_bounds.download();

  for (int segment = 0; segment < c.segments; ++segment) {
    const int64_t first = int64_t(segment) * c.segment_keys;
    const uint32_t begin = offsets[first];
    const uint32_t end = offsets[first + c.segment_keys];
    uint64_t lists = 0;
    for (int64_t k = first; k < first + c.segment_keys; ++k)
      lists += offsets[k + 1] > offsets[k] ? 1 : 0;
    const uint64_t total = uint64_t(w.tile) * (end - begin) + uint64_t(w.list) * lists;
    const uint32_t* row = bounds.data() + size_t(segment) * (sched::kMaxDealGrid + 1);
    for (int x = 0; x <= grid; ++x) {
      const uint64_t target = total * w.share_num * uint64_t(x) / (uint64_t(grid) * w.share_den);
      ASSERT_EQ(row[x], first_reaching(offsets, first, c.segment_keys, w, target))
          << "segment " << segment << ", bound " << x << " of " << grid;
    }
    EXPECT_EQ(row[0], begin) << "segment " << segment;
    for (int x = 0; x < grid; ++x)
      EXPECT_LE(row[x], row[x + 1]) << "segment " << segment << ", bound " << x;
    EXPECT_LE(row[grid], end) << "segment " << segment;
    if (w.share_num == w.share_den) EXPECT_EQ(row[grid], end) << "segment " << segment;
  }
}

TEST(DealTileBounds, MatchesHostSearch) {
  FLASHMSA_REQUIRE_HOPPER();
  const DealCase cases[] = {
      {5, 700, 9, 0.3},   // several scan rounds per segment, short lists
      {3, 64, 300, 0.5},  // few long lists: many bounds fall inside one list
      {4, 37, 1, 0.9},    // mostly empty keys, one-tile lists: fewer tiles than CTAs
      {2, 1, 5, 0.0},     // one list per segment
      {3, 200, 4, 1.0},   // empty segments
  };
  const int grids[] = {1, 7, 132, sched::kMaxDealGrid};
  const sched::DealWeights weights[] = {{4, 8, 1, 1}, {4, 8, 7, 8}, {1, 0, 1, 1}, {3, 17, 15, 16}};
  const uint64_t seed = testing::test_seed("deal_tile_bounds");
  uint64_t round = 0;
  for (const DealCase& c : cases) {
    for (int grid : grids) {
      for (const sched::DealWeights& w : weights) {
        check_deal(c, grid, w, seed + round++);
        if (HasFatalFailure()) return;
      }
    }
  }
}

}  // namespace
}  // namespace flashmsa
