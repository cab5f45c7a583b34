// GPU schedule (the reverse index of block_idx, docs/design.md "Schedule") against a host-side
// inversion: every list holds exactly the (query, slot) entries that chose its block, in ascending
// query order; every list is cut into ⌈n / tokens_per_tile⌉ tiles of ≤ tokens_per_tile entries in
// order; the tile ranges of the chunks partition the tile list. The schedule is also captured in a
// CUDA graph and replayed over a poisoned workspace, which must give the same result. Small cases
// take the one-CTA path, larger ones the device-wide passes.
#include <cuda_runtime.h>

#include <cstring>
#include <string>
#include <vector>

#include "gpu/forward_cases.h"
#include "kernels/schedule/config.h"

namespace flashmsa {
namespace {

namespace sched = kernels::schedule;

struct ScheduleCase {
  const char* name;
  int num_heads, num_kv_heads, num_proxy_heads;
  int64_t batch, seqlen;
  int top_k;
};

// Everything the forward reads, downloaded from the workspace.
struct ScheduleView {
  std::vector<uint32_t> entries, entry_offsets, tile_offsets;
  std::vector<uint4> tiles;
};

ScheduleView read_schedule(const testing::DeviceBuffer<char>& workspace, const sched::ScheduleLayout& layout) {
  std::vector<char> bytes = workspace.download();
  auto table = [&](size_t offset, int64_t count) {
    std::vector<uint32_t> values(count);
    std::memcpy(values.data(), bytes.data() + offset, count * 4);
    return values;
  };
  int32_t current = 0;
  std::memcpy(&current, bytes.data() + layout.header, 4);
  ScheduleView view;
  view.entries = table(layout.values[current == 1 ? 1 : 0], layout.entries);
  view.entry_offsets = table(layout.entry_offsets, layout.num_keys + 1);
  view.tile_offsets = table(layout.tile_offsets, layout.num_keys + 1);
  const int64_t tile_count = view.tile_offsets.back();
  view.tiles.resize(tile_count);
  if (tile_count > 0 && tile_count <= layout.max_tiles) {
    std::memcpy(view.tiles.data(), bytes.data() + layout.tiles, tile_count * 16);
  }
  return view;
}

void expect_schedule(const ProblemShape& shape, const std::vector<int32_t>& block_idx, const ScheduleView& view) {
  const sched::ScheduleLayout layout = sched::make_schedule_layout(shape);
  const int tokens = sched::tokens_per_tile(shape);
  const int64_t chunk_rows = sched::chunk_rows(shape);
  const int rg = shape.num_proxy_heads / shape.num_kv_heads;
  const int64_t nb = shape.num_blocks();
  // Host inversion in (b, p, i, slot) order: appending keeps every list query-ascending.
  std::vector<std::vector<uint32_t>> lists(layout.num_keys);
  int64_t valid = 0;
  for (int64_t b = 0; b < shape.batch; ++b) {
    for (int p = 0; p < shape.num_proxy_heads; ++p) {
      for (int64_t i = 0; i < shape.seqlen; ++i) {
        for (int slot = 0; slot < shape.top_k; ++slot) {
          const int32_t c = block_idx[((b * shape.num_proxy_heads + p) * shape.seqlen + i) * shape.top_k + slot];
          if (c < 0) continue;
          const int64_t chunk = (b * shape.seqlen + i) / chunk_rows;
          const int64_t key = (((chunk * shape.batch + b) * shape.num_kv_heads + p / rg) * nb + c) * rg + p % rg;
          lists[key].push_back(uint32_t(i) << sched::kSlotBits | uint32_t(slot));
          ++valid;
        }
      }
    }
  }
  ASSERT_EQ(view.entry_offsets[layout.num_keys], uint32_t(valid));
  ASSERT_LE(int64_t(view.tile_offsets[layout.num_keys]), layout.max_tiles);
  int64_t list_errors = 0;
  int64_t tile_errors = 0;
  for (int64_t key = 0; key < layout.num_keys; ++key) {
    const uint32_t first = view.entry_offsets[key];
    const uint32_t length = view.entry_offsets[key + 1] - first;
    if (length != lists[key].size() ||
        !std::equal(lists[key].begin(), lists[key].end(), view.entries.begin() + first)) {
      if (++list_errors < 5) ADD_FAILURE() << "list " << key << " differs (length " << length << " vs " << lists[key].size() << ")";
      continue;
    }
    const uint32_t first_tile = view.tile_offsets[key];
    const uint32_t tiles = view.tile_offsets[key + 1] - first_tile;
    if (tiles != (length + tokens - 1) / tokens) {
      if (++tile_errors < 5) ADD_FAILURE() << "list " << key << ": " << tiles << " tiles for " << length << " entries";
      continue;
    }
    for (uint32_t t = 0; t < tiles; ++t) {
      const uint4 tile = view.tiles[first_tile + t];
      const uint32_t expected_count = std::min<uint32_t>(tokens, length - t * tokens);
      if (tile.x != key || tile.y != first + t * tokens || tile.z != expected_count) {
        if (++tile_errors < 5) ADD_FAILURE() << "tile " << first_tile + t << " of list " << key << " is wrong";
      }
    }
  }
  EXPECT_EQ(list_errors, 0);
  EXPECT_EQ(tile_errors, 0);
}

class ScheduleTest : public ::testing::TestWithParam<ScheduleCase> {};

TEST_P(ScheduleTest, MatchesHostInversion) {
  FLASHMSA_REQUIRE_HOPPER();
  const ScheduleCase& c = GetParam();
  const ProblemShape shape = cases::problem_shape(c.batch, c.seqlen, c.num_heads, c.num_kv_heads,
                                                  c.num_proxy_heads, 1, c.top_k);
  const std::vector<int32_t> block_idx = forward_testing::random_selection(shape, 17 + c.seqlen);
  testing::DeviceBuffer<int32_t> device_idx(block_idx.size());
  device_idx.upload(block_idx);
  const sched::ScheduleLayout layout = sched::make_schedule_layout(shape);
  ASSERT_EQ(schedule_workspace_size(shape), layout.total);
  testing::DeviceBuffer<char> workspace(layout.total);
  workspace.poison();

  ScheduleParams params;
  params.shape = shape;
  params.block_idx = device_idx.get();
  params.workspace = workspace.get();
  const Status status = schedule(params, nullptr);
  ASSERT_TRUE(status.ok()) << status.message;
  FLASHMSA_CUDA_CHECK(cudaDeviceSynchronize());
  expect_schedule(shape, block_idx, read_schedule(workspace, layout));

  // The same schedule from a captured graph, over a poisoned workspace (run_as_graph waits for the
  // poisoning memset on the legacy stream before the capture stream runs).
  workspace.poison();
  const Status captured = testing::run_as_graph([&](cudaStream_t stream) { return schedule(params, stream); });
  ASSERT_TRUE(captured.ok()) << captured.message;
  expect_schedule(shape, block_idx, read_schedule(workspace, layout));
}

// Chunk boundaries: paper rows use 16K-row chunks (K = 16) and 4K-row chunks (K = 64), so the
// longer cases span several chunks, one of them straddling two batches.
INSTANTIATE_TEST_SUITE_P(
    Shapes, ScheduleTest,
    ::testing::Values(ScheduleCase{"paper_s1000_k16", 64, 4, 4, 1, 1000, 16},
                      ScheduleCase{"paper_b2_s20000_k16", 64, 4, 4, 2, 20000, 16},
                      ScheduleCase{"paper_s9001_k64", 64, 4, 4, 1, 9001, 64},
                      ScheduleCase{"paper_s131072_k16", 64, 4, 4, 1, 131072, 16},
                      ScheduleCase{"specialized_s5000_k16", 64, 4, 16, 1, 5000, 16},
                      ScheduleCase{"odd_h48_hkv4_hp12_s777_k2", 48, 4, 12, 1, 777, 2},
                      ScheduleCase{"m12_h48_hkv4_hp4_s300_k1", 48, 4, 4, 3, 300, 1},
                      // One-CTA path (kernels/schedule/kernel.cuh: ≤ 4096 entries) and its edge.
                      ScheduleCase{"seed_s256_k2", 16, 2, 4, 1, 256, 2},
                      ScheduleCase{"b2_h8_hkv2_hp2_s1000_k1", 8, 2, 2, 2, 1000, 1},
                      ScheduleCase{"seed_s1024_k1_4096_entries", 16, 2, 4, 1, 1024, 1},
                      ScheduleCase{"seed_s1025_k1_4100_entries", 16, 2, 4, 1, 1025, 1}),
    [](const ::testing::TestParamInfo<ScheduleCase>& info) { return std::string(info.param.name); });

}  // namespace
}  // namespace flashmsa
