"""Anchors timed in the same run as flashmsa: dense causal attention through torch SDPA (cuDNN and
FlashAttention backends) and FlexAttention on the tile-shared selection pattern (its best case).
Writes rows in the schema of SPEC.md "Results file". Paper config: H=64, Hkv=4, D=128, bf16, B=1."""
import argparse
import json
import math

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

HEADS, KV_HEADS, HEAD_DIM, TOP_K, BLOCK = 64, 4, 128, 16, 128


def median_ms(fn, warmup=1, repeats=5):
    flush = torch.empty(256 << 20, dtype=torch.int8, device="cuda")
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        flush.zero_()
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        stop.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(stop))
    times.sort()
    return times[len(times) // 2]


def dense_rows(seqlen, backend, system):
    q = torch.randn(1, HEADS, seqlen, HEAD_DIM, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(1, KV_HEADS, seqlen, HEAD_DIM, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(1, KV_HEADS, seqlen, HEAD_DIM, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    group = HEADS // KV_HEADS
    dout = torch.randn(1, HEADS, seqlen, HEAD_DIM, device="cuda", dtype=torch.bfloat16)

    def forward():
        # K/V broadcast to all heads (an expand, not a copy, until the kernel reads them).
        kx = k.repeat_interleave(group, dim=1)
        vx = v.repeat_interleave(group, dim=1)
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q, kx, vx, is_causal=True)

    def fwd_bwd():
        out = forward()
        out.backward(dout)

    flops_fwd = 4.0 * HEAD_DIM * HEADS * seqlen * seqlen / 2
    repeats = 3 if seqlen >= 131072 else 5
    rows = []
    torch.cuda.reset_peak_memory_stats()
    with torch.no_grad():
        ms = median_ms(forward, repeats=repeats)
    rows.append(row(system, "forward", "dense", seqlen, ms, flops_fwd))
    ms = median_ms(fwd_bwd, repeats=repeats)
    rows.append(row(system, "fwd_bwd", "dense", seqlen, ms, 3.5 * flops_fwd))
    return rows


def flex_rows(seqlen):
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    num_blocks = math.ceil(seqlen / BLOCK)
    generator = torch.Generator(device="cpu").manual_seed(0)
    # tile_shared: every query block keeps its local block plus TOP_K-1 random earlier blocks.
    chosen = torch.zeros(num_blocks, num_blocks, dtype=torch.bool)
    for c in range(num_blocks):
        chosen[c, c] = True
        if c > 0:
            earlier = torch.randperm(c, generator=generator)[: TOP_K - 1]
            chosen[c, earlier] = True
    chosen = chosen.cuda()

    def mask_mod(b, h, q_idx, kv_idx):
        return chosen[q_idx // BLOCK, kv_idx // BLOCK] & (kv_idx <= q_idx)

    block_mask = create_block_mask(mask_mod, 1, None, seqlen, seqlen, BLOCK_SIZE=BLOCK)
    options = dict(BLOCK_M=128, BLOCK_N=64, num_stages=2, num_warps=8,
                   BLOCK_M1=64, BLOCK_N1=128, BLOCK_M2=128, BLOCK_N2=64)
    compiled = torch.compile(flex_attention, dynamic=False)
    q = torch.randn(1, HEADS, seqlen, HEAD_DIM, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(1, KV_HEADS, seqlen, HEAD_DIM, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(1, KV_HEADS, seqlen, HEAD_DIM, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dout = torch.randn(1, HEADS, seqlen, HEAD_DIM, device="cuda", dtype=torch.bfloat16)

    def forward():
        return compiled(q, k, v, block_mask=block_mask, enable_gqa=True, kernel_options=options)

    def fwd_bwd():
        forward().backward(dout)

    visible = sum(min(TOP_K, c + 1) for c in range(num_blocks)) * BLOCK * BLOCK  # approx, tiles
    flops_fwd = 4.0 * HEAD_DIM * HEADS * visible
    rows = []
    with torch.no_grad():
        rows.append(row("flex_tile_shared", "forward", "tile_shared", seqlen, median_ms(forward), flops_fwd))
    rows.append(row("flex_tile_shared", "fwd_bwd", "tile_shared", seqlen, median_ms(fwd_bwd), 3.5 * flops_fwd))
    return rows


def row(system, stage, pattern, seqlen, ms, flops):
    return {"system": system, "stage": stage, "config": "paper", "pattern": pattern, "S": seqlen,
            "B": 1, "ms": round(ms, 4), "tflops": round(flops / ms / 1e9, 1),
            "peak_mem_gb": round(torch.cuda.max_memory_allocated() / 1e9, 2), "note": ""}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--seqlens", default="8192,32768,131072")
    parser.add_argument("--max-dense", type=int, default=131072)
    parser.add_argument("--flex", type=int, default=1)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    rows = []
    for seqlen in [int(s) for s in args.seqlens.split(",")]:
        if seqlen > args.max_dense:
            continue
        for backend, system in ((SDPBackend.CUDNN_ATTENTION, "cudnn_dense"),
                                (SDPBackend.FLASH_ATTENTION, "fa2_dense")):
            try:
                rows.extend(dense_rows(seqlen, backend, system))
            except Exception as error:  # a backend refusing a shape is reported, not fatal
                print("anchors: %s at S=%d failed: %s" % (system, seqlen, error))
        if args.flex:
            try:
                rows.extend(flex_rows(seqlen))
            except Exception as error:
                print("anchors: flex_tile_shared at S=%d failed: %s" % (seqlen, error))
        for r in rows[-6:]:
            print("%-17s %-8s S=%-7d %9.3f ms %7.1f TFLOP/s" % (r["system"], r["stage"], r["S"], r["ms"], r["tflops"]))
    with open(args.out, "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
