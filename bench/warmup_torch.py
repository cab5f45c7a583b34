"""Warmup mode through the PyTorch op, next to cuDNN dense attention timed in the same process with
the same harness (bench/anchors.py's median_ms). Paper config, B = 1, bf16.

flashmsa.msa_attention(mode="warmup") runs the dense main branch on cuDNN and adds the proxy LSE
and the KL-only backward (docs/design.md "Warmup"); its fwd_bwd row includes the KL's gradient and
value. The cuDNN baseline is the anchors' dense call (K and V repeated to all heads, the issue's
113 / 1826 ms at 32K / 128K); cuDNN's native GQA (enable_gqa=True, K and V at their 4 heads) is
timed next to it, since the op's cuDNN route takes K and V that way.

  FLASHMSA_TORCH_LIBRARY=build-torch/libflashmsa_torch.so \
      python3 bench/warmup_torch.py --seqlens 8192,32768,131072 --out rows.json
"""
import argparse
import json
import os
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

BENCH = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, BENCH)
from anchors import HEADS, HEAD_DIM, KV_HEADS, median_ms, paper_leaves, progress, row  # noqa: E402

try:
    import flashmsa  # noqa: E402
except ImportError:  # not installed: the package sources of this checkout
    sys.path.insert(0, os.path.join(os.path.dirname(BENCH), "python"))
    import flashmsa  # noqa: E402


def warmup_rows(seqlen):
    generator = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, q_proxy, k_proxy = paper_leaves(seqlen, generator)
    dout = torch.randn(1, seqlen, HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16, generator=generator)
    sink = flashmsa.new_kl_sink("cuda")

    def ours():
        out, kl = flashmsa.msa_attention(q, k, v, q_proxy, k_proxy, 128, mode="warmup", kl_sink=sink)
        torch.autograd.backward([out, kl], [dout, torch.ones_like(kl)])

    group = HEADS // KV_HEADS
    qh = q.detach().transpose(1, 2).contiguous().requires_grad_(True)
    kh = k.detach().transpose(1, 2).contiguous().requires_grad_(True)
    vh = v.detach().transpose(1, 2).contiguous().requires_grad_(True)
    douth = dout.transpose(1, 2).contiguous()

    def cudnn():
        kx = kh.repeat_interleave(group, dim=1)
        vx = vh.repeat_interleave(group, dim=1)
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            F.scaled_dot_product_attention(qh, kx, vx, is_causal=True).backward(douth)

    def cudnn_gqa():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, enable_gqa=True).backward(douth)

    repeats = 3 if seqlen >= 131072 else 5
    flops = 3.5 * 4.0 * HEAD_DIM * HEADS * seqlen * seqlen / 2
    torch.cuda.reset_peak_memory_stats()
    dense_ms = median_ms(cudnn, repeats=repeats)
    try:
        gqa_note = "; cuDNN native GQA %.2f ms" % median_ms(cudnn_gqa, repeats=repeats)
    except RuntimeError as error:  # an older torch refuses enable_gqa on cuDNN
        gqa_note = "; cuDNN native GQA refused: %s" % str(error).splitlines()[0][:120]
    torch.cuda.reset_peak_memory_stats()
    ours_ms = median_ms(ours, repeats=repeats)
    result = row("flashmsa", "warmup_fwd_bwd", "cudnn_main", seqlen, ours_ms, flops)
    result["note"] = ("torch op, main branch on cuDNN + proxy LSE + KL-only backward; cuDNN dense fwd+bwd "
                      "in the same process %.2f ms (%.3fx)%s" % (dense_ms, ours_ms / dense_ms, gqa_note))
    progress("warmup / cuDNN dense fwd+bwd at S=%d: %.3f / %.3f ms = %.3fx%s" % (
        seqlen, ours_ms, dense_ms, ours_ms / dense_ms, gqa_note))
    return [result]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--seqlens", default="8192,32768,131072")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    rows, skipped = [], []
    for seqlen in map(int, args.seqlens.split(",")):
        try:
            rows.extend(warmup_rows(seqlen))
        except Exception as error:  # recorded, not fatal: the other lengths still run
            reason = str(error).splitlines()[0][:300] if str(error) else type(error).__name__
            progress("warmup torch op at S=%d failed: %s" % (seqlen, reason))
            skipped.append({"system": "flashmsa", "S": seqlen, "reason": "warmup torch op failed: " + reason})
        finally:
            torch.cuda.empty_cache()
    with open(args.out, "w") as f:
        json.dump({"rows": rows, "skipped": skipped}, f, indent=1)


if __name__ == "__main__":
    main()
