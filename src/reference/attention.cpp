// SPEC.md §2-§5: the main branch (sparse or warmup attention), the KL alignment loss and the
// backward of both, for any subset of query rows and key blocks.
//
// Comes after select.cpp (block_idx) and inputs.cpp (scores). Everything is organised around one
// "group row": a query row i of batch b seen through proxy head p, i.e. the token set T_pi, the M
// main heads p·M … p·M+M−1 that share it, and the proxy softmax over it. The forward and the
// dq / dq_proxy side of the backward walk group rows; the dk / dv / dk_proxy side walks the query
// rows that selected a key block, using each row's LSE, Δ and proxy LSE (cached, computed once).
#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <stdexcept>
#include <string>
#include <unordered_map>

#include "reference/reference.h"

namespace flashmsa::reference {
namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();
constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

void require(bool ok, const std::string& message) {
  if (!ok) throw std::invalid_argument("flashmsa::reference: " + message);
}

int64_t block_idx_size(const ProblemShape& s) {
  return s.batch * s.num_proxy_heads * s.seqlen * s.top_k;
}

// Sparse mode needs a block_idx of the right size. Its entries are checked row by row where they
// are read (row_slots), so a block_idx that select() filled only for a subset of rows serves a
// forward or dq pass over that subset.
void check_block_idx(const ProblemShape& s, const std::vector<int32_t>& block_idx, Mode mode) {
  if (mode == Mode::kWarmup) return;
  require(s.top_k >= 1 && s.top_k <= kMaxTopK,
          "top_k = " + std::to_string(s.top_k) + " must lie in [1, 64]");
  require(static_cast<int64_t>(block_idx.size()) == block_idx_size(s),
          "block_idx has " + std::to_string(block_idx.size()) +
              " entries, expected B*Hp*S*K = " + std::to_string(block_idx_size(s)));
}

// The K slots of (b, p, i), each checked to be -1 or a block index.
const int32_t* row_slots(const ProblemShape& s, const std::vector<int32_t>& block_idx, int64_t b,
                         int p, int64_t i) {
  const int32_t* slots = &block_idx[((b * s.num_proxy_heads + p) * s.seqlen + i) * s.top_k];
  for (int slot = 0; slot < s.top_k; ++slot) {
    if (slots[slot] < -1 || slots[slot] >= s.num_blocks()) {  // hot path: message only on failure
      require(false, "block_idx[" + std::to_string(b) + ", " + std::to_string(p) + ", " +
                         std::to_string(i) + ", " + std::to_string(slot) + "] = " +
                         std::to_string(slots[slot]) + " is neither -1 nor a block in [0, NB)");
    }
  }
  return slots;
}

void check_dout(const ProblemShape& s, const std::vector<double>& dout) {
  require(static_cast<int64_t>(dout.size()) == s.batch * s.seqlen * s.num_heads * s.head_dim,
          "dout must have the size of out, [b, s, h, d]");
}

// Everything one op needs to evaluate §2-§4, with short accessors for the tensors.
struct Problem {
  const Inputs& in;
  const std::vector<int32_t>& block_idx;
  Mode mode;
  Precision precision;
  const ForwardOutputs* saved = nullptr;  // backward only: the saved out / lse / proxy_lse

  const ProblemShape& s() const { return in.shape; }
  int heads_per_proxy() const { return in.shape.heads_per_proxy(); }  // M

  double acc(double x) const { return accumulate_round(x, precision); }  // fp32 accumulator
  double store(double x) const { return round_to(x, precision); }        // 16-bit operand

  const double* q(int64_t b, int64_t i, int h) const {
    return &in.q[offset_bshd(s(), b, i, h, s().num_heads, s().head_dim)];
  }
  const double* k(int64_t b, int64_t j, int g) const {
    return &in.k[offset_bshd(s(), b, j, g, s().num_kv_heads, s().head_dim)];
  }
  const double* v(int64_t b, int64_t j, int g) const {
    return &in.v[offset_bshd(s(), b, j, g, s().num_kv_heads, s().head_dim)];
  }
  const double* q_proxy(int64_t b, int64_t i, int p) const {
    return &in.q_proxy[offset_bshd(s(), b, i, p, s().num_proxy_heads, s().proxy_head_dim)];
  }
  const double* k_proxy(int64_t b, int64_t j, int pk) const {
    return &in.k_proxy[offset_bshd(s(), b, j, pk, s().num_proxy_kv_heads, s().proxy_head_dim)];
  }

  // log Σ exp(x) with the maximum subtracted first, as the kernels do; -inf for an empty set.
  double log_sum_exp(const std::vector<double>& x) const {
    double max = -kInf;
    for (double xi : x) max = std::max(max, xi);
    if (max == -kInf) return -kInf;
    double sum = 0.0;
    for (double xi : x) sum = acc(sum + acc(std::exp(acc(xi - max))));
    return acc(max + std::log(sum));
  }

  // exp(logit - lse): P_hij from z and LSE, or π_pij from s and the proxy LSE. A row whose every
  // score is -inf has LSE -inf and no mass: P = 0 (O = 0, as in the kernels), never exp(NaN).
  double softmax_prob(double logit, double lse) const {
    if (lse == -kInf) return 0.0;
    return acc(std::exp(acc(logit - lse)));
  }

  // Is block c in T_pi? Only asked for rows i in or after block c.
  bool block_selected(int64_t b, int p, int64_t i, int64_t c) const {
    if (mode == Mode::kWarmup) return true;
    const int32_t* slots = row_slots(s(), block_idx, b, p, i);
    for (int slot = 0; slot < s().top_k; ++slot) {
      if (slots[slot] == c) return true;
    }
    return false;
  }
};

// One query row (b, i) through proxy head p: what §2-§3 define for it.
struct GroupRow {
  std::vector<int64_t> tokens;  // T_pi, ascending
  std::vector<double> probs;    // [M, |T|]: P_hij for h = p·M + m
  std::vector<double> lse;      // [M]: LSE_hi
  std::vector<double> out;      // [M, D]: O_hi rounded to the output dtype
  std::vector<double> student;  // [|T|]: π_pij
  std::vector<double> teacher;  // [|T|]: t_pij = (1/M) Σ_h P_hij
  double proxy_lse = 0.0;       // log Σ_{j∈T} exp s_pij
  double kl = 0.0;              // Σ_{j∈T} t (log t - log π)
};

GroupRow evaluate(const Problem& pb, int64_t b, int p, int64_t i) {
  const ProblemShape& s = pb.s();
  const int M = pb.heads_per_proxy();
  const int D = s.head_dim;
  GroupRow row;
  row.tokens = selected_tokens(pb.in, pb.block_idx, pb.mode, b, p, i);
  const size_t n = row.tokens.size();
  row.probs.assign(M * n, 0.0);
  row.lse.assign(M, -kInf);
  row.out.assign(static_cast<size_t>(M) * D, 0.0);
  row.teacher.assign(n, 0.0);
  row.student.assign(n, 0.0);

  // §2 for each main head of the group: z, LSE, P, O = Σ P v (P rounded to 16 bits before P·V).
  std::vector<double> logits(n);
  for (int m = 0; m < M; ++m) {
    const int h = p * M + m;
    const int g = h / s.gqa_ratio();
    for (size_t t = 0; t < n; ++t) logits[t] = score(pb.in, b, h, i, row.tokens[t], pb.precision);
    // NOTES: a backward kernel reads the saved LSE (fp32) and O (16 bits); with pb.saved the
    // rounded reference does the same, so its Δ = ⟨O, dO⟩ carries the same storage rounding of O.
    row.lse[m] = pb.saved ? pb.acc(pb.saved->lse[(b * s.num_heads + h) * s.seqlen + i])
                          : pb.log_sum_exp(logits);
    double* o = &row.out[static_cast<size_t>(m) * D];
    for (size_t t = 0; t < n; ++t) {
      const double P = pb.softmax_prob(logits[t], row.lse[m]);
      row.probs[m * n + t] = P;
      row.teacher[t] = pb.acc(row.teacher[t] + P);
      if (!pb.saved) axpy(P, pb.v(b, row.tokens[t], g), o, D, pb.precision);
    }
    const double* saved_o =
        pb.saved ? &pb.saved->out[offset_bshd(s, b, i, h, s.num_heads, D)] : o;
    for (int d = 0; d < D; ++d) o[d] = pb.store(pb.acc(saved_o[d]));  // as the upload: via fp32
  }

  // §3: student π = softmax of the proxy scores over T, teacher t = mean of the group's P.
  for (size_t t = 0; t < n; ++t) {
    logits[t] = proxy_score(pb.in, b, p, i, row.tokens[t], pb.precision);
  }
  row.proxy_lse = pb.saved
                      ? pb.acc(pb.saved->proxy_lse[(b * s.num_proxy_heads + p) * s.seqlen + i])
                      : pb.log_sum_exp(logits);
  for (size_t t = 0; t < n; ++t) {
    const double log_student = pb.acc(logits[t] - row.proxy_lse);
    row.student[t] = pb.acc(std::exp(log_student));
    row.teacher[t] = pb.acc(row.teacher[t] / M);
    if (row.teacher[t] > 0.0) {  // t log t -> 0 as t -> 0
      const double term = pb.acc(row.teacher[t] * pb.acc(std::log(row.teacher[t]) - log_student));
      row.kl = pb.acc(row.kl + term);
    }
  }
  return row;
}

// What the key-block side of the backward needs from a (b, p, i) row.
struct RowStats {
  std::vector<double> lse;    // [M]
  std::vector<double> delta;  // [M]: Δ_hi = ⟨O_hi, dO_hi⟩
  double proxy_lse = 0.0;
};

// The backward of §3-§4 for one op call: outputs, the upstream gradients and the row cache.
class Backward {
 public:
  Backward(const Problem& pb, const std::vector<double>& dout, double kl_grad, Gradients& grads)
      : pb_(pb), s_(pb.s()), dout_(dout), grads_(grads) {
    // ∂L/∂s_pij = ḡ (π - t) / (B·Hp·S); σp joins it so dq_proxy = kl_factor · Σ_j (π - t)
    // k_proxy_j. NOTES: the emulated precisions round (π - t) to 16 bits as the matmul operand and
    // apply the tiny factor ḡσp/(B·Hp·S) to the fp32 sum afterwards, as a kernel must: rounding the
    // scaled gradient itself would flush it to zero in fp16 at long sequence lengths.
    const double rows = static_cast<double>(s_.batch) * s_.num_proxy_heads * s_.seqlen;
    kl_factor_ = pb.acc(kl_grad * proxy_scale(pb.in) / rows);
    scale_ = pb.acc(softmax_scale(pb.in));
  }

  // dq_hi for the M heads of group p and dq_proxy_pi.
  void query_row(int64_t b, int p, int64_t i) {
    const int M = pb_.heads_per_proxy();
    const int D = s_.head_dim;
    const int Di = s_.proxy_head_dim;
    const GroupRow row = evaluate(pb_, b, p, i);
    const size_t n = row.tokens.size();
    RowStats stats{row.lse, std::vector<double>(M), row.proxy_lse};

    std::vector<double> dq(D);
    for (int m = 0; m < M; ++m) {
      const int h = p * M + m;
      const int g = h / s_.gqa_ratio();
      const double* dO = dout(b, i, h);
      stats.delta[m] = dot(&row.out[static_cast<size_t>(m) * D], dO, D, pb_.precision);
      std::fill(dq.begin(), dq.end(), 0.0);
      for (size_t t = 0; t < n; ++t) {
        const int64_t j = row.tokens[t];
        const double dS = grad_logit(row.probs[m * n + t], dO, b, j, g, stats.delta[m]);
        axpy(dS, pb_.k(b, j, g), dq.data(), D, pb_.precision);
      }
      write(grads_.dq, offset_bshd(s_, b, i, h, s_.num_heads, D), dq, scale_);
    }

    std::vector<double> dq_proxy(Di, 0.0);
    const int pk = p / s_.proxy_ratio();
    for (size_t t = 0; t < n; ++t) {
      const double diff = pb_.acc(row.student[t] - row.teacher[t]);  // π - t
      axpy(diff, pb_.k_proxy(b, row.tokens[t], pk), dq_proxy.data(), Di, pb_.precision);
    }
    write(grads_.dq_proxy, offset_bshd(s_, b, i, p, s_.num_proxy_heads, Di), dq_proxy, kl_factor_);
    cache_.emplace(row_key(b, p, i), std::move(stats));
  }

  // dk_gj, dv_gj and dk_proxy_j for the keys j of block c: sums over every (h, i) with j ∈ T.
  void key_block(int64_t b, int64_t c) {
    const int M = pb_.heads_per_proxy();
    const int D = s_.head_dim;
    const int Di = s_.proxy_head_dim;
    const int64_t first = c * kBlockSize;
    const int64_t end = std::min<int64_t>(first + kBlockSize, s_.seqlen);
    const int64_t len = end - first;
    std::vector<double> dk(s_.num_kv_heads * len * D, 0.0);  // [hkv, len, d] accumulators
    std::vector<double> dv(s_.num_kv_heads * len * D, 0.0);
    std::vector<double> dk_proxy(s_.num_proxy_kv_heads * len * Di, 0.0);  // [hpk, len, di]

    for (int64_t i = first; i < s_.seqlen; ++i) {
      for (int p = 0; p < s_.num_proxy_heads; ++p) {
        if (!pb_.block_selected(b, p, i, c)) continue;
        const RowStats& stats = row_stats(b, p, i);
        const int pk = p / s_.proxy_ratio();
        for (int64_t j = first; j < std::min(end, i + 1); ++j) {
          const int64_t jj = j - first;
          double teacher = 0.0;
          for (int m = 0; m < M; ++m) {
            const int h = p * M + m;
            const int g = h / s_.gqa_ratio();
            const double P =
                pb_.softmax_prob(score(pb_.in, b, h, i, j, pb_.precision), stats.lse[m]);
            const double* dO = dout(b, i, h);
            const double dS = grad_logit(P, dO, b, j, g, stats.delta[m]);
            axpy(dS, pb_.q(b, i, h), &dk[(g * len + jj) * D], D, pb_.precision);
            axpy(P, dO, &dv[(g * len + jj) * D], D, pb_.precision);
            teacher = pb_.acc(teacher + P);
          }
          teacher = pb_.acc(teacher / M);
          const double student =
              pb_.softmax_prob(proxy_score(pb_.in, b, p, i, j, pb_.precision), stats.proxy_lse);
          axpy(pb_.acc(student - teacher), pb_.q_proxy(b, i, p), &dk_proxy[(pk * len + jj) * Di],
               Di, pb_.precision);
        }
      }
    }

    for (int64_t jj = 0; jj < len; ++jj) {
      for (int g = 0; g < s_.num_kv_heads; ++g) {
        const int64_t at = offset_bshd(s_, b, first + jj, g, s_.num_kv_heads, D);
        write(grads_.dk, at, &dk[(g * len + jj) * D], D, scale_);
        write(grads_.dv, at, &dv[(g * len + jj) * D], D, 1.0);
      }
      for (int pk = 0; pk < s_.num_proxy_kv_heads; ++pk) {
        const int64_t at = offset_bshd(s_, b, first + jj, pk, s_.num_proxy_kv_heads, Di);
        write(grads_.dk_proxy, at, &dk_proxy[(pk * len + jj) * Di], Di, kl_factor_);
      }
    }
  }

 private:
  const double* dout(int64_t b, int64_t i, int h) const {
    return &dout_[offset_bshd(s_, b, i, h, s_.num_heads, s_.head_dim)];
  }

  // dS_hij = P (dP - Δ) with dP = ⟨dO_hi, v_gj⟩ (§4), unscaled by σ.
  double grad_logit(double P, const double* dO, int64_t b, int64_t j, int g, double delta) const {
    const double dP = dot(dO, pb_.v(b, j, g), s_.head_dim, pb_.precision);
    return pb_.acc(P * pb_.acc(dP - delta));
  }

  // Final gradient = factor · accumulator, rounded to the output dtype.
  void write(std::vector<double>& grad, int64_t at, const double* accumulator, int n,
             double factor) const {
    for (int d = 0; d < n; ++d) grad[at + d] = pb_.store(pb_.acc(factor * accumulator[d]));
  }
  void write(std::vector<double>& grad, int64_t at, const std::vector<double>& accumulator,
             double factor) const {
    write(grad, at, accumulator.data(), static_cast<int>(accumulator.size()), factor);
  }

  int64_t row_key(int64_t b, int p, int64_t i) const {
    return (b * s_.num_proxy_heads + p) * s_.seqlen + i;
  }

  const RowStats& row_stats(int64_t b, int p, int64_t i) {
    auto found = cache_.find(row_key(b, p, i));
    if (found != cache_.end()) return found->second;
    const int M = pb_.heads_per_proxy();
    const GroupRow row = evaluate(pb_, b, p, i);
    RowStats stats{row.lse, std::vector<double>(M), row.proxy_lse};
    for (int m = 0; m < M; ++m) {
      stats.delta[m] = dot(&row.out[static_cast<size_t>(m) * s_.head_dim], dout(b, i, p * M + m),
                           s_.head_dim, pb_.precision);
    }
    return cache_.emplace(row_key(b, p, i), std::move(stats)).first->second;
  }

  const Problem& pb_;
  const ProblemShape& s_;
  const std::vector<double>& dout_;
  Gradients& grads_;
  double kl_factor_ = 0.0;
  double scale_ = 0.0;
  std::unordered_map<int64_t, RowStats> cache_;
};

}  // namespace

std::vector<int64_t> selected_tokens(const Inputs& in, const std::vector<int32_t>& block_idx,
                                     Mode mode, int64_t batch, int proxy_head, int64_t row) {
  std::vector<int64_t> tokens;
  if (mode == Mode::kWarmup) {
    tokens.resize(row + 1);
    std::iota(tokens.begin(), tokens.end(), int64_t{0});
    return tokens;
  }
  const ProblemShape& s = in.shape;
  require(static_cast<int64_t>(block_idx.size()) == block_idx_size(s),
          "block_idx must have B*Hp*S*K entries");
  const int32_t* slots = row_slots(s, block_idx, batch, proxy_head, row);
  std::vector<int64_t> blocks;
  for (int slot = 0; slot < s.top_k; ++slot) {
    const int32_t c = slots[slot];
    if (c >= 0 && c * int64_t{kBlockSize} <= row) blocks.push_back(c);
  }
  std::sort(blocks.begin(), blocks.end());
  blocks.erase(std::unique(blocks.begin(), blocks.end()), blocks.end());
  for (int64_t c : blocks) {
    const int64_t end = std::min<int64_t>((c + 1) * kBlockSize, row + 1);
    for (int64_t j = c * kBlockSize; j < end; ++j) tokens.push_back(j);
  }
  return tokens;
}

ForwardOutputs forward(const Inputs& in, const std::vector<int32_t>& block_idx, Mode mode,
                       Precision precision, const QueryRows& rows) {
  validate(in);
  const ProblemShape& s = in.shape;
  check_block_idx(s, block_idx, mode);
  const Problem pb{in, block_idx, mode, precision};
  const int M = s.heads_per_proxy();
  const int D = s.head_dim;

  ForwardOutputs f;
  f.out.assign(s.batch * s.seqlen * s.num_heads * D, kNaN);
  f.lse.assign(s.batch * s.num_heads * s.seqlen, kNaN);
  f.proxy_lse.assign(s.batch * s.num_proxy_heads * s.seqlen, kNaN);
  f.kl_rows.assign(s.batch * s.num_proxy_heads * s.seqlen, kNaN);

  for (const QueryRow& r : resolve_rows(s, rows)) {
    const int64_t b = r.batch;
    const int64_t i = r.row;
    for (int p = 0; p < s.num_proxy_heads; ++p) {
      const GroupRow row = evaluate(pb, b, p, i);
      for (int m = 0; m < M; ++m) {
        const int h = p * M + m;
        std::copy_n(&row.out[static_cast<size_t>(m) * D], D,
                    &f.out[offset_bshd(s, b, i, h, s.num_heads, D)]);
        f.lse[(b * s.num_heads + h) * s.seqlen + i] = row.lse[m];
      }
      f.proxy_lse[(b * s.num_proxy_heads + p) * s.seqlen + i] = row.proxy_lse;
      f.kl_rows[(b * s.num_proxy_heads + p) * s.seqlen + i] = row.kl;
    }
  }

  if (!rows.empty()) {
    f.kl = kNaN;  // the mean needs every row
  } else {
    double sum = 0.0;
    for (double kl_row : f.kl_rows) sum = pb.acc(sum + kl_row);
    f.kl = pb.acc(sum / static_cast<double>(f.kl_rows.size()));
  }
  return f;
}

Gradients backward(const Inputs& in, const std::vector<int32_t>& block_idx,
                   const std::vector<double>& dout, double kl_grad, Mode mode, Precision precision,
                   const QueryRows& rows, const KeyBlocks& blocks, const ForwardOutputs* saved) {
  validate(in);
  const ProblemShape& s = in.shape;
  check_block_idx(s, block_idx, mode);
  check_dout(s, dout);
  if (saved != nullptr) {
    require(saved->out.size() == in.q.size() &&
                static_cast<int64_t>(saved->lse.size()) == s.batch * s.num_heads * s.seqlen &&
                static_cast<int64_t>(saved->proxy_lse.size()) ==
                    s.batch * s.num_proxy_heads * s.seqlen,
            "saved forward tensors must hold out, lse and proxy_lse of every row");
  }
  const Problem pb{in, block_idx, mode, precision, saved};

  Gradients grads;
  grads.dq.assign(in.q.size(), kNaN);
  grads.dk.assign(in.k.size(), kNaN);
  grads.dv.assign(in.v.size(), kNaN);
  grads.dq_proxy.assign(in.q_proxy.size(), kNaN);
  grads.dk_proxy.assign(in.k_proxy.size(), kNaN);

  Backward backward_pass(pb, dout, kl_grad, grads);
  for (const QueryRow& r : resolve_rows(s, rows)) {
    for (int p = 0; p < s.num_proxy_heads; ++p) backward_pass.query_row(r.batch, p, r.row);
  }
  for (const KeyBlock& kb : resolve_blocks(s, blocks)) backward_pass.key_block(kb.batch, kb.block);
  return grads;
}

Recall recall(const Inputs& in, const std::vector<int32_t>& block_idx, const QueryRows& rows) {
  validate(in);
  const ProblemShape& s = in.shape;
  check_block_idx(s, block_idx, Mode::kSparse);
  const std::vector<int32_t> none;
  const Problem dense{in, none, Mode::kWarmup, Precision::kFP64};  // every j <= i: the full teacher
  Recall total;
  int64_t measured = 0;
  for (const QueryRow& r : resolve_rows(s, rows)) {
    const int64_t visible = r.row / kBlockSize + 1;
    const int64_t wanted = std::min<int64_t>(s.top_k, visible);
    for (int p = 0; p < s.num_proxy_heads; ++p) {
      const GroupRow row = evaluate(dense, r.batch, p, r.row);  // tokens 0 … i in order
      std::vector<double> mass(visible, 0.0);
      for (size_t t = 0; t < row.tokens.size(); ++t) mass[row.tokens[t] / kBlockSize] += row.teacher[t];
      std::vector<int64_t> order(visible);
      for (int64_t c = 0; c < visible; ++c) order[c] = c;
      std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return mass[a] > mass[b]; });
      std::vector<bool> in_teacher(visible, false);
      for (int64_t n = 0; n < wanted; ++n) in_teacher[order[n]] = true;
      const int32_t* slots = row_slots(s, block_idx, r.batch, p, r.row);
      int64_t hits = 0;
      double kept = 0.0;
      std::vector<bool> counted(visible, false);  // a block listed twice counts once, as in T_pi
      for (int slot = 0; slot < s.top_k; ++slot) {
        const int32_t c = slots[slot];
        if (c < 0 || c >= visible || counted[c]) continue;  // empty slot, later block, repeat
        counted[c] = true;
        hits += in_teacher[c] ? 1 : 0;
        kept += mass[c];
      }
      total.block += static_cast<double>(hits) / static_cast<double>(wanted);
      total.score += kept;
      ++measured;
    }
  }
  total.block /= static_cast<double>(measured);
  total.score /= static_cast<double>(measured);
  return total;
}

double loss(const Inputs& in, const std::vector<int32_t>& block_idx,
            const std::vector<double>& dout, double kl_grad, Mode mode) {
  check_dout(in.shape, dout);
  const ForwardOutputs f = forward(in, block_idx, mode, Precision::kFP64);
  double sum = 0.0;
  for (size_t e = 0; e < f.out.size(); ++e) sum += f.out[e] * dout[e];
  return sum + kl_grad * f.kl;
}

}  // namespace flashmsa::reference
