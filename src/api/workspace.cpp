// Workspace sizes of every op, from shapes alone: callers allocate, and no count is ever read back
// from the device. Each size is the upper bound documented in docs/design.md for its stage.
#include "flashmsa/api.h"

#include "api/check.h"
#include "kernels/backward/config.h"

#include "kernels/forward/config.h"
#include "kernels/schedule/config.h"
#include "kernels/warmup/config.h"

namespace flashmsa {

// Sort keys and entries (double-buffered, 16 B per block_idx entry), the per-list tables, the tile
// list and CUB's temporary storage: kernels/schedule/config.h.
size_t schedule_workspace_size(const ProblemShape& shape) {
  if (!detail::workspace_defined(shape, Mode::kSparse)) return 0;
  return kernels::schedule::make_schedule_layout(shape).total;
}

// Sparse mode: the partials of one query chunk, ≤ 5 GB (kernels/forward/config.h). Warmup mode
// accumulates O in registers and needs nothing (kernels/warmup/config.h).
size_t forward_workspace_size(const ProblemShape& shape, Mode mode) {
  if (mode == Mode::kWarmup || !detail::workspace_defined(shape, mode)) return 0;
  return kernels::forward::make_forward_layout(shape).total;
}

// Sparse mode: the backward's reverse index, Δ and accumulators (src/kernels/backward/config.h),
// the dQ accumulator in fp16 where bf16 inputs take the scaled fp16 sums. Warmup mode: Δ, the
// per-proxy-head dk_proxy sums and the per-row KL terms (src/kernels/warmup/config.h), the same in
// deterministic mode (always deterministic).
size_t backward_workspace_size(const ProblemShape& shape, Mode mode, bool deterministic, DType dtype) {
  if (!detail::workspace_defined(shape, mode)) return 0;
  if (mode == Mode::kWarmup) return kernels::warmup::workspace_layout(shape).total;
  return kernels::backward::workspace_layout(shape, deterministic,
                                             kernels::backward::dq_half_sums(shape, dtype, deterministic))
      .total;
}

}  // namespace flashmsa
