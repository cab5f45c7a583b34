// Public C++ entry points of flashmsa.
//
// Every call validates its params on the host first (src/api/validate.cpp) and returns a Status;
// on any error nothing is written and no kernel is launched. Every call takes a cudaStream_t, never
// synchronises the host, and is CUDA-graph capturable. Callers allocate the workspaces, sized by the
// *_workspace_size() queries, which depend on shapes only.
//
// Pipeline (one training step, sparse mode):  select -> schedule -> forward -> backward.
#pragma once

#include <cstddef>
#include <string>

#include "flashmsa/params.h"

namespace flashmsa {

enum class StatusCode : int {
  kOk = 0,
  kInvalidArgument = 1,  // a violated SPEC.md §6 rule; the message names the argument
  kUnsupported = 2,      // valid per SPEC.md but not built (see supported_combinations())
  kNoDevice = 3,         // no CUDA device, or the device is not Hopper (sm_90)
  kCudaError = 4,        // a CUDA runtime call failed
};

struct Status {
  StatusCode code = StatusCode::kOk;
  std::string message;  // "<argument>: <rule>" for kInvalidArgument

  bool ok() const { return code == StatusCode::kOk; }
  static Status Ok() { return {}; }
};

// Host-only checks of every rule in SPEC.md §6 that can be decided without touching the device
// (shapes, strides, head divisibility, K range, null and misaligned pointers). The entry points below
// call these first; they are public so tests and bindings can check without a GPU.
Status validate(const SelectParams& params);
Status validate(const ScheduleParams& params);
Status validate(const ForwardParams& params);
Status validate(const BackwardParams& params);

// Workspace sizes in bytes, from shapes alone (no count is ever read back from the device); 0 for a
// shape the op refuses (an invalid one, head dims no kernel is built for, or in sparse mode one the
// schedule's 32-bit indices cannot hold: validate() says which).
size_t schedule_workspace_size(const ProblemShape& shape);
size_t forward_workspace_size(const ProblemShape& shape, Mode mode);
// The backward's size depends on the input dtype (bf16 inputs sum dQ in fp16: ≈ 2·B·S·H·D bytes
// less); the default, fp16's, is the larger and serves both.
size_t backward_workspace_size(const ProblemShape& shape, Mode mode, bool deterministic,
                               DType dtype = DType::kFP16);

// The ops. Each returns kNoDevice on a machine without a Hopper GPU.
Status select(const SelectParams& params, cudaStream_t stream);
Status schedule(const ScheduleParams& params, cudaStream_t stream);
Status forward(const ForwardParams& params, cudaStream_t stream);
Status backward(const BackwardParams& params, cudaStream_t stream);

// A human-readable table of the (dtype, head_dim, proxy_head_dim) combinations the kernels are built
// for; an unsupported combination is refused with kUnsupported and this table in the message.
std::string supported_combinations();

// True when a CUDA device of compute capability 9.0 is present.
bool hopper_available();

}  // namespace flashmsa
