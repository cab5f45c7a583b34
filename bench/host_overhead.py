"""Host time per call of the flashmsa torch ops on a GPU, and where it goes.

  FLASHMSA_TORCH_LIBRARY=build-torch/libflashmsa_torch.so python3 bench/host_overhead.py

Prints, for the seed configuration at a small S (the GPU finishes each call long before the host
issues the next, so the loop measures host time only): the median host µs per call of
torch.ops.flashmsa.select, .forward and flashmsa.msa_attention (scripts/gpu_check.sh runs this
and keeps the output in raw/host_overhead.log), then the CUDA runtime calls one
forward call makes, from the torch profiler (count and host µs per call), and the cost of the
torch-side pieces (an empty tensor, a zero fill, a no-op kernel launch) for scale.
"""
import argparse
import os
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if os.environ.get("FLASHMSA_TORCH_LIBRARY"):
    sys.path.insert(0, os.path.join(ROOT, "python"))

import flashmsa  # noqa: E402

SEED_HEADS = (16, 2, 4, 1)  # H, Hkv, Hp, Hpk


def host_us(call, repeats=7, calls=300):
    """Median over `repeats` of the host µs per call, the GPU left to run asynchronously."""
    for _ in range(20):
        call()
    torch.cuda.synchronize()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            call()
        samples.append((time.perf_counter() - start) / calls * 1e6)
        torch.cuda.synchronize()
    return sorted(samples)[repeats // 2]


def runtime_calls(call, calls=50):
    """CUDA runtime/driver calls made by `call`, as (name, count per call, host µs per call)."""
    from torch.profiler import ProfilerActivity, profile

    call()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            call()
        torch.cuda.synchronize()
    found = []
    for event in prof.key_averages():
        if event.key.startswith(("cuda", "cu")) and event.key != "cudaDeviceSynchronize":
            found.append((event.key, event.count / calls, event.cpu_time_total / calls))
    return sorted(found, key=lambda item: -item[2])


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--seqlen", type=int, default=256)
    parser.add_argument("--blocks", type=int, default=2)
    args = parser.parse_args()
    heads = dict(zip(("q", "k", "v", "q_proxy", "k_proxy"),
                     (SEED_HEADS[0], SEED_HEADS[1], SEED_HEADS[1], SEED_HEADS[2], SEED_HEADS[3])))
    q, k, v, q_proxy, k_proxy = (
        torch.randn(1, args.seqlen, count, 128, device="cuda", dtype=torch.bfloat16)
        for count in heads.values())
    ops = flashmsa.ops
    block_idx = ops.select(q_proxy, k_proxy, args.blocks, 0.0)

    def forward():
        return ops.forward(q, k, v, q_proxy, k_proxy, block_idx, args.blocks)

    print("library: %s, torch %s, %s" % (flashmsa.library_path(), torch.__version__,
                                         torch.cuda.get_device_name()))
    print("host us per call (seed config, S=%d, K=%d):" % (args.seqlen, args.blocks))
    print("  select        %6.1f" % host_us(lambda: ops.select(q_proxy, k_proxy, args.blocks, 0.0)))
    print("  forward       %6.1f" % host_us(forward))
    # A training call: leaves that require grad, so autograd records the op and a KL sink is made.
    leaves = [t.detach().requires_grad_() for t in (q, k, v, q_proxy, k_proxy)]
    print("  msa_attention %6.1f  (select + forward + autograd)" % host_us(
        lambda: flashmsa.msa_attention(*leaves, 128 * args.blocks)))
    scalar = torch.empty((), device="cuda")
    print("for scale: torch.empty %.1f, torch.zeros(()) %.1f, scalar.add_(1) %.1f" % (
        host_us(lambda: torch.empty(1024, device="cuda")),
        host_us(lambda: torch.zeros((), device="cuda")), host_us(lambda: scalar.add_(1))))
    print("CUDA calls per forward call (count, host us):")
    try:
        for name, count, micros in runtime_calls(forward):
            print("  %-48s %5.1f %7.1f" % (name, count, micros))
    except Exception as error:  # no CUPTI on this machine
        print("  profiler unavailable: %s" % error)


if __name__ == "__main__":
    main()
