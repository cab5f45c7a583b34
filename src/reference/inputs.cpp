// Inputs of the reference: deterministic random tensors, validation against SPEC.md's rules, the
// layout helpers and the two score functions (z and s) that every op is built on.
//
// Comes before select.cpp (§1) and attention.cpp (§2-§5); precision.cpp supplies the arithmetic.
#include <cmath>
#include <random>
#include <stdexcept>
#include <string>

#include "reference/reference.h"

namespace flashmsa::reference {
namespace {

// N(0, 1) by Box-Muller on std::mt19937_64, so the values are the same with every standard
// library (std::normal_distribution's algorithm is implementation-defined).
class Gaussian {
 public:
  explicit Gaussian(uint64_t seed) : engine_(seed) {}

  double next() {
    if (has_spare_) {
      has_spare_ = false;
      return spare_;
    }
    const double radius = std::sqrt(-2.0 * std::log(uniform()));
    const double angle = 2.0 * M_PI * uniform();
    spare_ = radius * std::sin(angle);
    has_spare_ = true;
    return radius * std::cos(angle);
  }

 private:
  // Uniform in (0, 1]: 53 random bits, shifted away from 0 so log() stays finite.
  double uniform() { return static_cast<double>((engine_() >> 11) + 1) * 0x1p-53; }

  std::mt19937_64 engine_;
  bool has_spare_ = false;
  double spare_ = 0.0;
};

void require(bool ok, const std::string& message) {
  if (!ok) throw std::invalid_argument("flashmsa::reference: " + message);
}

void require_size(const std::vector<double>& tensor, const char* name, int64_t expected) {
  require(static_cast<int64_t>(tensor.size()) == expected,
          std::string(name) + " has " + std::to_string(tensor.size()) + " elements, expected " +
              std::to_string(expected));
}

int64_t tensor_size(const ProblemShape& shape, int heads, int dim) {
  return shape.batch * shape.seqlen * heads * static_cast<int64_t>(dim);
}

}  // namespace

Inputs random_inputs(const ProblemShape& shape, uint64_t seed, DType dtype) {
  Inputs in;
  in.shape = shape;
  Gaussian gaussian(seed);
  const Precision precision = precision_of(dtype);
  auto fill = [&](std::vector<double>& tensor, int heads, int dim) {
    tensor.resize(tensor_size(shape, heads, dim));
    for (double& x : tensor) x = round_to(gaussian.next(), precision);
  };
  fill(in.q, shape.num_heads, shape.head_dim);
  fill(in.k, shape.num_kv_heads, shape.head_dim);
  fill(in.v, shape.num_kv_heads, shape.head_dim);
  fill(in.q_proxy, shape.num_proxy_heads, shape.proxy_head_dim);
  fill(in.k_proxy, shape.num_proxy_kv_heads, shape.proxy_head_dim);
  return in;
}

void validate(const Inputs& in) {
  const ProblemShape& s = in.shape;
  require(s.batch > 0 && s.seqlen > 0, "batch and seqlen must be positive");
  require(
      s.num_heads > 0 && s.num_kv_heads > 0 && s.num_proxy_heads > 0 && s.num_proxy_kv_heads > 0,
      "all head counts must be positive");
  require(s.head_dim > 0 && s.proxy_head_dim > 0, "head_dim and proxy_head_dim must be positive");
  require(s.num_heads % s.num_kv_heads == 0, "num_heads must be a multiple of num_kv_heads");
  require(s.num_heads % s.num_proxy_heads == 0, "num_heads must be a multiple of num_proxy_heads");
  require(s.num_proxy_heads % s.num_proxy_kv_heads == 0,
          "num_proxy_heads must be a multiple of num_proxy_kv_heads");
  require(
      s.num_proxy_heads % s.num_kv_heads == 0,
      "num_proxy_heads must be a multiple of num_kv_heads (a proxy group lies in one KV group)");
  require(std::isfinite(in.softmax_scale) && in.softmax_scale >= 0.0,
          "softmax_scale must be finite and >= 0 (0: default)");
  require(std::isfinite(in.proxy_scale) && in.proxy_scale >= 0.0,
          "proxy_scale must be finite and >= 0 (0: default)");
  require_size(in.q, "q", tensor_size(s, s.num_heads, s.head_dim));
  require_size(in.k, "k", tensor_size(s, s.num_kv_heads, s.head_dim));
  require_size(in.v, "v", tensor_size(s, s.num_kv_heads, s.head_dim));
  require_size(in.q_proxy, "q_proxy", tensor_size(s, s.num_proxy_heads, s.proxy_head_dim));
  require_size(in.k_proxy, "k_proxy", tensor_size(s, s.num_proxy_kv_heads, s.proxy_head_dim));
}

double softmax_scale(const Inputs& in) {
  return in.softmax_scale > 0.0 ? in.softmax_scale : 1.0 / std::sqrt(in.shape.head_dim);
}

double proxy_scale(const Inputs& in) {
  return in.proxy_scale > 0.0 ? in.proxy_scale : 1.0 / std::sqrt(in.shape.proxy_head_dim);
}

// Kernels receive σ and σp as fp32 parameters, hence the accumulate_round of the scale.
double score(const Inputs& in, int64_t batch, int head, int64_t row, int64_t key,
             Precision precision) {
  const ProblemShape& s = in.shape;
  const int kv_head = head / s.gqa_ratio();
  const double* q = &in.q[offset_bshd(s, batch, row, head, s.num_heads, s.head_dim)];
  const double* k = &in.k[offset_bshd(s, batch, key, kv_head, s.num_kv_heads, s.head_dim)];
  const double scale = accumulate_round(softmax_scale(in), precision);
  return accumulate_round(scale * dot(q, k, s.head_dim, precision), precision);
}

double proxy_score(const Inputs& in, int64_t batch, int proxy_head, int64_t row, int64_t key,
                   Precision precision) {
  const ProblemShape& s = in.shape;
  const int proxy_kv_head = proxy_head / s.proxy_ratio();
  const double* q =
      &in.q_proxy[offset_bshd(s, batch, row, proxy_head, s.num_proxy_heads, s.proxy_head_dim)];
  const double* k = &in.k_proxy[offset_bshd(s, batch, key, proxy_kv_head, s.num_proxy_kv_heads,
                                            s.proxy_head_dim)];
  const double scale = accumulate_round(proxy_scale(in), precision);
  return accumulate_round(scale * dot(q, k, s.proxy_head_dim, precision), precision);
}

QueryRows resolve_rows(const ProblemShape& shape, const QueryRows& rows) {
  for (const QueryRow& r : rows) {
    require(r.batch >= 0 && r.batch < shape.batch && r.row >= 0 && r.row < shape.seqlen,
            "query row (" + std::to_string(r.batch) + ", " + std::to_string(r.row) +
                ") lies outside the shape");
  }
  if (!rows.empty()) return rows;
  QueryRows all;
  all.reserve(shape.batch * shape.seqlen);
  for (int64_t b = 0; b < shape.batch; ++b) {
    for (int64_t i = 0; i < shape.seqlen; ++i) all.push_back({b, i});
  }
  return all;
}

KeyBlocks resolve_blocks(const ProblemShape& shape, const KeyBlocks& blocks) {
  for (const KeyBlock& kb : blocks) {
    require(
        kb.batch >= 0 && kb.batch < shape.batch && kb.block >= 0 && kb.block < shape.num_blocks(),
        "key block (" + std::to_string(kb.batch) + ", " + std::to_string(kb.block) +
            ") lies outside the shape");
  }
  if (!blocks.empty()) return blocks;
  KeyBlocks all;
  all.reserve(shape.batch * shape.num_blocks());
  for (int64_t b = 0; b < shape.batch; ++b) {
    for (int64_t c = 0; c < shape.num_blocks(); ++c) all.push_back({b, c});
  }
  return all;
}

}  // namespace flashmsa::reference
