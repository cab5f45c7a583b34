// Draws shared by the seeded random configurations of the forward, backward and warmup GPU tests
// (test_forward.cpp, test_backward.cpp, test_warmup.cpp): head maps that meet SPEC.md's rules,
// sequence lengths weighted toward the block edges where masking and partial blocks go wrong, and
// the measured host costs of the reference that size each case's checked subset.
#pragma once

#include <cstdint>
#include <iterator>
#include <random>
#include <string>
#include <vector>

namespace flashmsa::random_draws {

// Host cost of the reference, measured on one x86 core (Release build): reference::random_inputs
// and a random dO per value; per unit B·Σ_i |T_i|·(2H + Hp)·D over the rows i evaluated, the fp64
// forward of the saved tensors, the input-dtype forward of the KL value, and the fp64 plus the
// input-dtype backward.
constexpr double kInputNsPerValue = 35.0;
constexpr double kForwardNsPerUnit = 0.6;
constexpr double kRoundedForwardNsPerUnit = 5.5;
constexpr double kBackwardNsPerUnit = 25.0;

struct HeadMap {
  int num_heads, num_kv_heads, num_proxy_heads, num_proxy_kv_heads;
};

// Every (H, Hkv, Hp, Hpk) with H = num_heads that meets SPEC.md's divisibility rules.
inline std::vector<HeadMap> head_maps(int num_heads) {
  std::vector<HeadMap> maps;
  for (int kv_heads = 1; kv_heads <= num_heads; ++kv_heads) {
    for (int proxy_heads = 1; proxy_heads <= num_heads; ++proxy_heads) {
      for (int proxy_kv_heads = 1; proxy_kv_heads <= proxy_heads; ++proxy_kv_heads) {
        if (num_heads % kv_heads == 0 && num_heads % proxy_heads == 0 &&
            proxy_heads % kv_heads == 0 && proxy_heads % proxy_kv_heads == 0) {
          maps.push_back({num_heads, kv_heads, proxy_heads, proxy_kv_heads});
        }
      }
    }
  }
  return maps;
}

// A head map with H ∈ [1, 16] drawn uniformly, then one of its valid maps, set on a test case.
template <typename Case>
void draw_heads(std::mt19937_64& rng, Case& c) {
  const std::vector<HeadMap> maps = head_maps(1 + int(rng() % 16));
  const HeadMap heads = maps[rng() % maps.size()];
  c.num_heads = heads.num_heads;
  c.num_kv_heads = heads.num_kv_heads;
  c.num_proxy_heads = heads.num_proxy_heads;
  c.num_proxy_kv_heads = heads.num_proxy_kv_heads;
}

// The start of a random case's name: "r<index>_b<B>_s<S>_h<H>_hkv<Hkv>_hp<Hp>_hpk<Hpk>".
template <typename Case>
std::string case_prefix(size_t index, const Case& c) {
  return "r" + std::to_string(1000 + index).substr(1) + "_b" + std::to_string(c.batch) + "_s" +
         std::to_string(c.seqlen) + "_h" + std::to_string(c.num_heads) + "_hkv" + std::to_string(c.num_kv_heads) +
         "_hp" + std::to_string(c.num_proxy_heads) + "_hpk" + std::to_string(c.num_proxy_kv_heads);
}

// S in [1, 1100]; one draw in four is a block edge (1, 127-129, 255-257, 1023-1025, ...).
inline int64_t draw_seqlen(std::mt19937_64& rng) {
  constexpr int64_t kEdges[] = {1, 2, 127, 128, 129, 255, 256, 257, 640, 1023, 1024, 1025, 1100};
  if (rng() % 4 == 0) return kEdges[rng() % std::size(kEdges)];
  return 1 + int64_t(rng() % 1100);
}

}  // namespace flashmsa::random_draws
