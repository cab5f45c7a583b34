// The selection patterns of SPEC.md "Benchmark configurations", made on the host, shared by the
// GPU tests and the benchmarks of the main branch (forward, backward):
//   random       per query: the local block plus K−1 distinct uniformly random earlier blocks (what
//                the index branch gives for random Gaussian proxies: nearly uncorrelated queries)
//   hot          every query: block 0, its local block and its K−2 most recent blocks
//   tile_shared  all queries of a 128-token block share the local block plus K−1 random earlier ones
// Every row lists the local block first and −1 in the trailing empty slots, like select's output.
#pragma once

#include <algorithm>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "flashmsa/params.h"

namespace flashmsa::patterns {

enum class Pattern { kRandom, kHot, kTileShared };

inline const char* pattern_name(Pattern pattern) {
  switch (pattern) {
    case Pattern::kRandom:
      return "random";
    case Pattern::kHot:
      return "hot";
    case Pattern::kTileShared:
      return "tile_shared";
  }
  return "?";
}

// False for an unknown name.
inline bool parse_pattern(const std::string& name, Pattern* pattern) {
  for (Pattern candidate : {Pattern::kRandom, Pattern::kHot, Pattern::kTileShared}) {
    if (name == pattern_name(candidate)) {
      *pattern = candidate;
      return true;
    }
  }
  return false;
}

namespace detail {

// Writes the local block then up to K−1 distinct random blocks of [0, local) into `slots`.
inline void random_blocks(int32_t local, int top_k, std::mt19937_64& rng, std::vector<int32_t>& pool,
                          int32_t* slots) {
  slots[0] = local;
  const int picks = std::min<int>(top_k - 1, local);
  if (picks == local) {  // every earlier block fits
    for (int s = 0; s < picks; ++s) slots[1 + s] = local - 1 - s;
    return;
  }
  // Few picks out of many blocks: rejection sampling against the picks so far.
  if (int64_t(picks) * 4 < local) {
    for (int s = 0; s < picks; ++s) {
      int32_t c;
      do {
        c = int32_t(rng() % uint64_t(local));
      } while (std::find(slots + 1, slots + 1 + s, c) != slots + 1 + s);
      slots[1 + s] = c;
    }
    return;
  }
  pool.resize(local);
  for (int32_t c = 0; c < local; ++c) pool[c] = c;
  for (int s = 0; s < picks; ++s) {
    const size_t pick = s + rng() % (pool.size() - s);
    std::swap(pool[s], pool[pick]);
    slots[1 + s] = pool[s];
  }
}

}  // namespace detail

// block_idx [b, hp, s, k] for `pattern`, deterministic in seed.
inline std::vector<int32_t> make_selection(const ProblemShape& shape, Pattern pattern, uint64_t seed) {
  const int K = shape.top_k;
  const int64_t rows = shape.batch * shape.num_proxy_heads * shape.seqlen;
  std::vector<int32_t> block_idx(size_t(rows) * K, -1);
  std::mt19937_64 rng(seed);
  std::vector<int32_t> pool;
  std::vector<int32_t> shared(K);
  for (int64_t row = 0; row < rows; ++row) {
    const int64_t i = row % shape.seqlen;
    const int32_t local = int32_t(i / kBlockSize);
    int32_t* slots = block_idx.data() + row * K;
    switch (pattern) {
      case Pattern::kRandom:
        detail::random_blocks(local, K, rng, pool, slots);
        break;
      case Pattern::kHot: {
        int used = 0;
        slots[used++] = local;
        if (local > 0 && used < K) slots[used++] = 0;
        for (int32_t c = local - 1; c > 0 && used < K; --c) slots[used++] = c;
        break;
      }
      case Pattern::kTileShared:
        if (i % kBlockSize == 0) {
          std::fill(shared.begin(), shared.end(), -1);
          detail::random_blocks(local, K, rng, pool, shared.data());
        }
        std::copy(shared.begin(), shared.end(), slots);
        break;
    }
  }
  return block_idx;
}

}  // namespace flashmsa::patterns
