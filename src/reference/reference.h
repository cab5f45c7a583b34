// The executable specification: a readable CPU implementation of every op of SPEC.md §1-§5.
//
// Every GPU test compares its kernel against `Precision::kFP64` and applies FA3's rule
//   |kernel - fp64| <= 2 * |same computation in the input dtype - fp64| + atol,
// where "the same computation in the input dtype" is this code run with Precision::kBF16/kFP16:
// matmul accumulation in fp32 and each operand that a kernel stores in 16 bits (inputs, P before
// P·V, dS before dS·K, outputs) rounded to that dtype. Precision::kFP32 rounds every intermediate
// to fp32.
//
// Storage is always double; lower precisions only round values as they are produced. All tensors
// are contiguous: activations [b, s, heads, dim], block_idx [b, hp, s, k], lse [b, h, s],
// proxy_lse [b, hp, s].
//
// Row subsets: GPU tests at 32K-128K check sampled rows. `QueryRows` selects (b, i) query rows for
// select / forward / KL / dq / dq_proxy; `KeyBlocks` selects (b, block) key blocks for dk, dv,
// dk_proxy. Entries of outputs outside the subset are left NaN so a test can never read them by
// accident. An empty subset means "all".
#pragma once

#include <cstdint>
#include <vector>

#include "flashmsa/params.h"

namespace flashmsa::reference {

enum class Precision { kFP64, kFP32, kBF16, kFP16 };

// Round x to the given precision (kFP64: identity; kFP32: float; kBF16/kFP16: round to nearest
// even, with fp16 subnormals and overflow to ±inf).
double round_to(double x, Precision precision);
Precision precision_of(DType dtype);

// Round a value held in a kernel's accumulator: fp32 for every precision except kFP64 (identity).
double accumulate_round(double x, Precision precision);

// ⟨a, b⟩ over n entries as a kernel computes it: operands rounded to `precision` (their storage
// format), products and sum in fp32; exact double arithmetic in kFP64.
double dot(const double* a, const double* b, int n, Precision precision);

// y += alpha · x with the same rounding as dot(): alpha and x rounded to `precision`, y an fp32
// accumulator (kFP64: plain double).
void axpy(double alpha, const double* x, double* y, int n, Precision precision);

struct Inputs {
  ProblemShape shape;
  double softmax_scale = 0.0;   // σ; 0 means D^-1/2
  double proxy_scale = 0.0;     // σp; 0 means Di^-1/2
  std::vector<double> q;        // [b, s, h, d]
  std::vector<double> k;        // [b, s, hkv, d]
  std::vector<double> v;        // [b, s, hkv, d]
  std::vector<double> q_proxy;  // [b, s, hp, di]
  std::vector<double> k_proxy;  // [b, s, hpk, di]
};

// Fills q, k, v, q_proxy, k_proxy with N(0, 1) values rounded to `dtype` (deterministic in seed).
Inputs random_inputs(const ProblemShape& shape, uint64_t seed, DType dtype);

// Throws std::invalid_argument naming the rule when the shape's head divisibility (SPEC.md), the
// sizes, the scales or the tensor lengths of `in` are wrong. Every op below calls it.
void validate(const Inputs& in);

// σ and σp with the defaults applied (D^-1/2, Di^-1/2).
double softmax_scale(const Inputs& in);
double proxy_scale(const Inputs& in);

// Element offset of [b, s, head, 0] in a contiguous [batch, seq, heads, dim] tensor.
inline int64_t offset_bshd(const ProblemShape& shape, int64_t b, int64_t s, int head, int num_heads,
                           int dim) {
  return ((b * shape.seqlen + s) * num_heads + head) * static_cast<int64_t>(dim);
}

// z_hij = σ⟨q_hi, k_gj⟩ (g = h/G) and s_pij = σp⟨q_proxy_pi, k_proxy_{p/R, j}⟩ in `precision`.
double score(const Inputs& in, int64_t batch, int head, int64_t row, int64_t key,
             Precision precision);
double proxy_score(const Inputs& in, int64_t batch, int proxy_head, int64_t row, int64_t key,
                   Precision precision);

struct QueryRow {
  int64_t batch;
  int64_t row;
};
using QueryRows = std::vector<QueryRow>;  // empty: all rows

struct KeyBlock {
  int64_t batch;
  int64_t block;
};
using KeyBlocks = std::vector<KeyBlock>;  // empty: all blocks

// The rows / key blocks an op evaluates: the subset itself (each entry checked to lie inside the
// shape, else std::invalid_argument) or, when it is empty, every (b, i) / (b, block) in order.
QueryRows resolve_rows(const ProblemShape& shape, const QueryRows& rows);
KeyBlocks resolve_blocks(const ProblemShape& shape, const KeyBlocks& blocks);

// §1. block_idx [b, hp, s, k]; rows outside `rows` are set to INT32_MIN.
std::vector<int32_t> select(const Inputs& in, Precision precision, const QueryRows& rows = {});

// The block scores m_ic of §1 for one (b, p, i): a vector of length c(i)+1, local block = +inf.
std::vector<double> block_scores(const Inputs& in, int64_t batch, int proxy_head, int64_t row,
                                 Precision precision);

// T_pi of SPEC.md §2 in ascending key order (§5 in warmup mode: all j <= i). Entries -1 of
// block_idx are empty slots and a block listed twice counts once; any other entry outside
// [0, NB) throws std::invalid_argument.
std::vector<int64_t> selected_tokens(const Inputs& in, const std::vector<int32_t>& block_idx,
                                     Mode mode, int64_t batch, int proxy_head, int64_t row);

struct ForwardOutputs {
  std::vector<double> out;        // [b, s, h, d]
  std::vector<double> lse;        // [b, h, s]
  std::vector<double> proxy_lse;  // [b, hp, s]
  std::vector<double> kl_rows;    // [b, hp, s]: Σ_{j∈T} t (log t - log π) for that (b, p, i)
  double kl = 0.0;                // L_KL = mean of kl_rows over all (b, p, i); NaN for a subset
};

// §2-§3 (mode kSparse) or §5 (mode kWarmup; block_idx ignored and may be empty).
ForwardOutputs forward(const Inputs& in, const std::vector<int32_t>& block_idx, Mode mode,
                       Precision precision, const QueryRows& rows = {});

struct Gradients {
  std::vector<double> dq;        // [b, s, h, d]
  std::vector<double> dk;        // [b, s, hkv, d]
  std::vector<double> dv;        // [b, s, hkv, d]
  std::vector<double> dq_proxy;  // [b, s, hp, di]
  std::vector<double> dk_proxy;  // [b, s, hpk, di]
};

// §3-§4. `dout` [b, s, h, d] is the upstream gradient of out, `kl_grad` the upstream gradient ḡ of
// the KL value. dq / dq_proxy are computed for `rows`, dk / dv / dk_proxy for `blocks`. A key
// block's gradients sum over every later query row that selected it, so they read block_idx of all
// rows from the block on (a block_idx that select() filled for a row subset only is rejected
// there); dq / dq_proxy read only their own rows.
// `saved`: the forward tensors a backward kernel is handed (out, lse, proxy_lse of every row). When
// given, Δ, P and π are computed from them, rounded to their storage formats (out to the input
// dtype, the LSEs to fp32), instead of from this precision's own forward. A test that hands the
// kernel saved tensors passes the same ones here, so that the rounded reference and the kernel take
// Δ from the same 16-bit O: Δ's error (σ·δΔ·Σ_j P k_j in dq) is then common to both instead of
// two independent draws (NOTES in attention.cpp). kFP64 with saved = the kFP64 forward is the
// same as without.
Gradients backward(const Inputs& in, const std::vector<int32_t>& block_idx,
                   const std::vector<double>& dout, double kl_grad, Mode mode, Precision precision,
                   const QueryRows& rows = {}, const KeyBlocks& blocks = {},
                   const ForwardOutputs* saved = nullptr);

// Recall of a selection against the main attention (monitoring; python/flashmsa/monitor.py is the
// same definition in torch). Per (b, p, i): the teacher t_pij of §3 over every visible token (the
// warmup teacher of §5), a block's mass Σ_{j in block} t_pij, and T_p(i) the min(K, c(i)+1)
// blocks of largest mass (ties to the smaller block). block = |selected ∩ T_p(i)| / |T_p(i)|,
// score = the mass of the selected blocks; both averaged over `rows` (empty: all) × proxy heads.
struct Recall {
  double block = 0.0;
  double score = 0.0;
};
Recall recall(const Inputs& in, const std::vector<int32_t>& block_idx, const QueryRows& rows = {});

// A scalar function of all differentiable inputs, for finite-difference tests:
//   loss = Σ out·dout + kl_grad · L_KL   (the selection held fixed at `block_idx`).
// Its gradient with respect to q, k, v, q_proxy, k_proxy is exactly backward(...) in kFP64 except
// that the KL's teacher is detached: the finite difference of L_KL w.r.t. q, k, v is not part of
// the gradient (SPEC.md §3), so tests perturb q, k, v with kl_grad = 0.
double loss(const Inputs& in, const std::vector<int32_t>& block_idx,
            const std::vector<double>& dout, double kl_grad, Mode mode);

}  // namespace flashmsa::reference
