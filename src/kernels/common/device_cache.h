// Per-device facts that cannot change while the process runs, read from the CUDA runtime once and
// then served from memory: device attributes (compute capability, SM count) and the dynamic
// shared-memory limit each kernel has been given. Host code only (src/api, the stage launchers).
//
// NOTES: the ops run once per layer and step, and at small S their host time is the step's time.
// cudaDeviceGetAttribute and cudaFuncSetAttribute each cost a driver call every time; only
// cudaGetDevice (a thread-local read in the runtime) stays in every call.
#pragma once

#include <cuda_runtime_api.h>

#include <array>
#include <atomic>
#include <map>
#include <mutex>
#include <utility>

namespace flashmsa::kernels {

inline constexpr int kMaxCachedDevices = 64;

// cudaDeviceGetAttribute for an attribute that is a positive constant of the device (SM count,
// compute capability major/minor, ...). Devices beyond kMaxCachedDevices are asked every time.
template <cudaDeviceAttr kAttribute>
cudaError_t cached_device_attribute(int device, int* value) {
  static std::array<std::atomic<int>, kMaxCachedDevices> slots{};  // 0: not read yet
  if (device < 0 || device >= kMaxCachedDevices) {
    return cudaDeviceGetAttribute(value, kAttribute, device);
  }
  const int cached = slots[device].load(std::memory_order_relaxed);
  if (cached > 0) {
    *value = cached;
    return cudaSuccess;
  }
  const cudaError_t error = cudaDeviceGetAttribute(value, kAttribute, device);
  if (error == cudaSuccess && *value > 0) slots[device].store(*value, std::memory_order_relaxed);
  return error;
}

// The current device and its SM count.
inline cudaError_t current_device_sms(int* device, int* num_sms) {
  const cudaError_t error = cudaGetDevice(device);
  if (error != cudaSuccess) return error;
  return cached_device_attribute<cudaDevAttrMultiProcessorCount>(*device, num_sms);
}

// Makes sure `kernel` may launch with `bytes` of dynamic shared memory on `device`: calls
// cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes) only when this
// (kernel, device) has not been allowed at least `bytes` before. The attribute is a maximum, so
// the limit only ever rises (to the largest size asked for), and it belongs to the kernel in the
// device's context, so it is remembered per device. Callers pass the exact size they launch with:
// static shared memory counts against the same limit.
inline cudaError_t set_max_dynamic_smem(const void* kernel, int device, int bytes) {
  static std::mutex mutex;
  static std::map<std::pair<const void*, int>, int> given;
  const std::lock_guard<std::mutex> lock(mutex);
  const auto key = std::make_pair(kernel, device);
  const auto found = given.find(key);
  if (found != given.end() && found->second >= bytes) return cudaSuccess;
  const cudaError_t error =
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
  if (error == cudaSuccess) given[key] = bytes;
  return error;
}

// The same on the current device.
inline cudaError_t set_max_dynamic_smem(const void* kernel, int bytes) {
  int device = 0;
  const cudaError_t error = cudaGetDevice(&device);
  if (error != cudaSuccess) return error;
  return set_max_dynamic_smem(kernel, device, bytes);
}

}  // namespace flashmsa::kernels
