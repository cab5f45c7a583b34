// launch_schedule (src/kernels/launch.h). The schedule is dtype-independent, so there is one
// instantiation: this file.
#include "kernels/schedule/kernel.cuh"

namespace flashmsa::kernels {

Status launch_schedule(const ScheduleParams& params, cudaStream_t stream) {
  return schedule::run_schedule(params, stream);
}

}  // namespace flashmsa::kernels
