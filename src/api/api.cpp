// The public entry points of include/flashmsa/api.h: validate (validate.cpp), check the device,
// then hand over to the stage launchers of src/kernels/launch.h. Nothing here touches tensor data.
#include "flashmsa/api.h"

#include <cuda_runtime_api.h>

#include <array>
#include <atomic>
#include <sstream>

#include "kernels/common/device_cache.h"
#include "kernels/launch.h"

namespace flashmsa {

namespace {

Status check_device() {
  if (!hopper_available()) {
    return {StatusCode::kNoDevice,
            "device: flashmsa kernels need an NVIDIA Hopper GPU (H100/H200, sm_90); none found"};
  }
  return Status::Ok();
}

}  // namespace

bool hopper_available() {
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess) {
    cudaGetLastError();  // clear the sticky "no device" error
    return false;
  }
  // NOTES: every op call checks the device, so the answer is kept per device (it cannot change
  // while the process runs): 0 not asked yet, 1 sm_90, 2 anything else.
  static std::array<std::atomic<int>, kernels::kMaxCachedDevices> answers{};
  const bool cacheable = device >= 0 && device < kernels::kMaxCachedDevices;
  if (cacheable) {
    if (const int answer = answers[device].load(std::memory_order_relaxed); answer != 0) {
      return answer == 1;
    }
  }
  int major = 0;
  int minor = 0;
  if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess ||
      cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device) != cudaSuccess) {
    cudaGetLastError();
    return false;
  }
  const bool hopper = major == 9 && minor == 0;
  if (cacheable) answers[device].store(hopper ? 1 : 2, std::memory_order_relaxed);
  return hopper;
}

std::string supported_combinations() {
  std::ostringstream table;
  table << "dtype      head_dim  proxy_head_dim\n"
        << "bf16       128       128\n"
        << "fp16       128       128\n";
  return table.str();
}

// A launcher's CUDA error is reported in its Status; the runtime's last-error slot is cleared so
// that the caller's next cudaGetLastError (or the next flashmsa call's launch check) does not see
// it again. Sticky errors (a faulted context) cannot be cleared and stay visible to everyone.
namespace {
Status reported(Status status) {
  if (status.code == StatusCode::kCudaError) (void)cudaGetLastError();
  return status;
}
}  // namespace

Status select(const SelectParams& params, cudaStream_t stream) {
  if (Status status = validate(params); !status.ok()) return status;
  if (Status status = check_device(); !status.ok()) return status;
  return reported(kernels::launch_select(params, stream));
}

Status schedule(const ScheduleParams& params, cudaStream_t stream) {
  if (Status status = validate(params); !status.ok()) return status;
  if (Status status = check_device(); !status.ok()) return status;
  return reported(kernels::launch_schedule(params, stream));
}

Status forward(const ForwardParams& params, cudaStream_t stream) {
  if (Status status = validate(params); !status.ok()) return status;
  if (Status status = check_device(); !status.ok()) return status;
  if (params.mode == Mode::kWarmup) return reported(kernels::launch_warmup_forward(params, stream));
  return reported(kernels::launch_forward(params, stream));
}

Status backward(const BackwardParams& params, cudaStream_t stream) {
  if (Status status = validate(params); !status.ok()) return status;
  if (Status status = check_device(); !status.ok()) return status;
  if (params.fwd.mode == Mode::kWarmup) return reported(kernels::launch_warmup_backward(params, stream));
  return reported(kernels::launch_backward(params, stream));
}

}  // namespace flashmsa
