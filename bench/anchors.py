"""Anchors timed in the same run as flashmsa: dense causal attention through torch SDPA (cuDNN and
FlashAttention backends), the eager PyTorch MSA model (python/flashmsa/eager.py) and FlexAttention
on the tile-shared selection pattern (its best case) and on the exact per-query pattern. Writes
{"rows": [...], "skipped": [...]}: rows in the schema of SPEC.md "Results file", and the anchors
left out with the reason. Paper config: H=64, Hkv=4, Hp=4, D=128, K=16, bf16, B=1.

  python3 bench/anchors.py --out rows.json [--seqlens 4096,8192,32768,131072] [--flex 1]

Progress goes to stdout, one line per anchor. Budgets: FlexAttention is compiled once for all S
(dynamic shapes) and its rows stop being started once --flex-budget-s (default 60 s, compile
included) is spent; the eager model runs only up to --max-eager (8K: it holds [H, S, S] fp32
matrices).
"""
import argparse
import importlib.util
import json
import math
import os
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

HEADS, KV_HEADS, PROXY_HEADS, HEAD_DIM, TOP_K, BLOCK = 64, 4, 4, 128, 16, 128
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FLEX_OPTIONS = dict(BLOCK_M=128, BLOCK_N=64, num_stages=2, num_warps=8,  # SPEC.md: these compile
                    BLOCK_M1=64, BLOCK_N1=128, BLOCK_M2=128, BLOCK_N2=64)


def progress(text):
    print("anchors: " + text, flush=True)


def load_eager():
    """python/flashmsa/eager.py by path: plain torch, so the anchors need no built flashmsa."""
    spec = importlib.util.spec_from_file_location(
        "flashmsa_eager", os.path.join(ROOT, "python", "flashmsa", "eager.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


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


def tile_shared_blocks(num_blocks, generator):
    """tile_shared: every query block keeps its local block plus TOP_K-1 random earlier blocks.
    Returns the earlier (fully visible) blocks of each query block as a [num_blocks, TOP_K-1]
    index table padded with 0 and their counts."""
    earlier = torch.zeros(num_blocks, TOP_K - 1, dtype=torch.int32)
    counts = torch.zeros(num_blocks, dtype=torch.int32)
    for c in range(1, num_blocks):
        chosen = torch.randperm(c, generator=generator)[: TOP_K - 1]
        earlier[c, : len(chosen)] = chosen.sort().values.to(torch.int32)
        counts[c] = len(chosen)
    return earlier, counts


def flex_tile_shared_mask(seqlen):
    """The BlockMask built from block lists (no [S, S] mask is ever materialised): the local block
    is partial (causal inside), the earlier chosen blocks are full."""
    from torch.nn.attention.flex_attention import BlockMask

    num_blocks = math.ceil(seqlen / BLOCK)
    earlier, counts = tile_shared_blocks(num_blocks, torch.Generator().manual_seed(0))
    local = torch.arange(num_blocks, dtype=torch.int32)
    chosen = torch.zeros(num_blocks, num_blocks, dtype=torch.bool)
    chosen[local.long(), local.long()] = True
    for c in range(1, num_blocks):
        chosen[c, earlier[c, : counts[c]].long()] = True
    chosen = chosen.cuda()

    # Exact on every block (the kernels evaluate it on partial blocks only; eager flex, everywhere).
    def tile_shared(b, h, q_idx, kv_idx):
        return chosen[q_idx // BLOCK, kv_idx // BLOCK] & (kv_idx <= q_idx)

    def shaped(tensor):  # [num_blocks, ...] -> [1, 1, num_blocks, ...] on the GPU
        return tensor.cuda()[None, None].contiguous()

    padded_local = torch.zeros(num_blocks, num_blocks, dtype=torch.int32)
    padded_local[:, 0] = local
    padded_full = torch.zeros(num_blocks, num_blocks, dtype=torch.int32)
    width = min(TOP_K - 1, num_blocks)  # counts[c] <= c < num_blocks
    padded_full[:, :width] = earlier[:, :width]
    visible_tokens = (int(counts.sum()) * BLOCK * BLOCK + num_blocks * BLOCK * (BLOCK + 1) // 2)
    return BlockMask.from_kv_blocks(shaped(torch.ones(num_blocks, dtype=torch.int32)),
                                    shaped(padded_local), shaped(counts), shaped(padded_full),
                                    BLOCK_SIZE=BLOCK, mask_mod=tile_shared, seq_lengths=(seqlen, seqlen)), \
        visible_tokens


def flex_per_query_mask(seqlen):
    """The exact MSA pattern: every query row attends to its own selected blocks (a random
    selection, per proxy head, shared by the 16 heads of its group). Query blocks list every KV
    block one of their rows selected, as partial blocks; mask_mod applies the row's selection."""
    from torch.nn.attention.flex_attention import BlockMask

    if seqlen % BLOCK:
        raise ValueError("the per-query anchor needs S to be a multiple of %d" % BLOCK)
    num_blocks = seqlen // BLOCK
    generator = torch.Generator(device="cuda").manual_seed(0)
    rows = torch.arange(seqlen, device="cuda")
    local = rows // BLOCK
    # Per (proxy head, row): the local block plus TOP_K-1 distinct random earlier blocks.
    scores = torch.rand(PROXY_HEADS, seqlen, num_blocks, device="cuda", generator=generator)
    scores = scores.masked_fill(torch.arange(num_blocks, device="cuda")[None, None] > local[None, :, None], -1.0)
    scores[:, rows, local] = 2.0
    top = scores.topk(min(TOP_K, num_blocks), dim=-1)
    selected = torch.zeros(PROXY_HEADS, seqlen, num_blocks, dtype=torch.bool, device="cuda")
    selected.scatter_(-1, top.indices, top.values >= 0)
    per_tile = selected.view(PROXY_HEADS, num_blocks, BLOCK, num_blocks).any(dim=2)  # S % 128 == 0
    counts = per_tile.sum(-1).to(torch.int32)
    order = torch.argsort((~per_tile).to(torch.int8), dim=-1, stable=True).to(torch.int32)
    group = HEADS // PROXY_HEADS

    def per_query(b, h, q_idx, kv_idx):
        return selected[h // group, q_idx, kv_idx // BLOCK] & (kv_idx <= q_idx)

    mask = BlockMask.from_kv_blocks(counts.repeat_interleave(group, 0)[None].contiguous(),
                                    order.repeat_interleave(group, 0)[None].contiguous(),
                                    BLOCK_SIZE=BLOCK, mask_mod=per_query,
                                    seq_lengths=(seqlen, seqlen))
    visible_tokens = int(selected.sum()) * BLOCK  # ≈ (the causal cut of the local block ignored)
    return mask, visible_tokens // PROXY_HEADS


def flex_rows(seqlen, compiled, pattern):
    """forward and fwd_bwd of FlexAttention at one S, pattern "tile_shared" or "per_query"."""
    make_mask = flex_tile_shared_mask if pattern == "tile_shared" else flex_per_query_mask
    block_mask, visible_tokens = make_mask(seqlen)
    q = torch.randn(1, HEADS, seqlen, HEAD_DIM, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(1, KV_HEADS, seqlen, HEAD_DIM, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(1, KV_HEADS, seqlen, HEAD_DIM, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dout = torch.randn(1, HEADS, seqlen, HEAD_DIM, device="cuda", dtype=torch.bfloat16)

    def forward():
        return compiled(q, k, v, block_mask=block_mask, enable_gqa=True, kernel_options=FLEX_OPTIONS)

    def fwd_bwd():
        forward().backward(dout)

    flops_fwd = 4.0 * HEAD_DIM * HEADS * visible_tokens
    system = "flex_tile_shared" if pattern == "tile_shared" else "flex_per_query"
    repeats = 3 if seqlen >= 131072 else 5
    torch.cuda.reset_peak_memory_stats()
    with torch.no_grad():
        forward_row = row(system, "forward", pattern, seqlen, median_ms(forward, repeats=repeats), flops_fwd)
    return [forward_row,
            row(system, "fwd_bwd", pattern, seqlen, median_ms(fwd_bwd, repeats=repeats), 3.5 * flops_fwd)]


def paper_leaves(seqlen, generator):
    """q, k, v, q_proxy, k_proxy of the paper config: bf16 [1, S, heads, D] N(0, 1) leaves that
    require grad, drawn from `generator` in that order."""
    def leaf(heads):
        return torch.randn(1, seqlen, heads, HEAD_DIM, device="cuda", dtype=torch.bfloat16,
                           generator=generator).requires_grad_(True)

    return leaf(HEADS), leaf(KV_HEADS), leaf(KV_HEADS), leaf(PROXY_HEADS), leaf(1)


def eager_rows(seqlen, eager):
    """The eager PyTorch MSA model (flashmsa.eager, dense [H, S, S] fp32 scores with masks) on the
    paper config: forward and fwd_bwd on a given selection (pattern random, like flashmsa's rows),
    and the step with its own selection. TFLOP/s are left out: it computes dense scores."""
    generator = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, q_proxy, k_proxy = paper_leaves(seqlen, generator)
    dout = torch.randn(1, seqlen, HEADS, HEAD_DIM, device="cuda", dtype=torch.float32, generator=generator)
    top_k = TOP_K * BLOCK
    block_idx = eager.select_blocks(q_proxy.detach(), k_proxy.detach(), TOP_K)

    def forward():
        return eager.msa_attention(q, k, v, q_proxy, k_proxy, top_k, block_idx=block_idx)

    def backward_of(out, kl):
        torch.autograd.backward([out, kl], [dout.to(out.dtype), torch.ones_like(kl)])

    def fwd_bwd():
        backward_of(*forward())

    def step():
        backward_of(*eager.msa_attention(q, k, v, q_proxy, k_proxy, top_k))

    rows = []
    torch.cuda.reset_peak_memory_stats()
    with torch.no_grad():
        rows.append(row("eager_torch", "forward", "random", seqlen, median_ms(forward, repeats=3), None))
    rows.append(row("eager_torch", "fwd_bwd", "random", seqlen, median_ms(fwd_bwd, repeats=3), None))
    rows.append(row("eager_torch", "step", "random", seqlen, median_ms(step, repeats=3), None))
    return rows


def row(system, stage, pattern, seqlen, ms, flops):
    result = {"system": system, "stage": stage, "config": "paper", "pattern": pattern, "S": seqlen,
              "B": 1, "ms": round(ms, 4), "tflops": round(flops / ms / 1e9, 1) if flops else None,
              "peak_mem_gb": round(torch.cuda.max_memory_allocated() / 1e9, 2), "note": ""}
    progress("%-17s %-8s %-11s S=%-7d %10.3f ms%s" % (
        system, stage, pattern, seqlen, ms, " %7.1f TFLOP/s" % result["tflops"] if flops else ""))
    return result


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--seqlens", default="4096,8192,32768,131072")
    parser.add_argument("--max-dense", type=int, default=131072)
    parser.add_argument("--eager", type=int, default=1, help="0 leaves the eager model out")
    parser.add_argument("--max-eager", type=int, default=8192)
    parser.add_argument("--flex", type=int, default=1, help="0 leaves FlexAttention out")
    parser.add_argument("--flex-seqlens", default="8192,32768,131072")
    parser.add_argument("--flex-per-query-seqlens", default="8192")
    parser.add_argument("--flex-budget-s", type=float, default=60.0)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    seqlens = sorted(int(s) for s in args.seqlens.split(","))
    rows, skipped = [], []

    def attempt(system, seqlen, make_rows):
        try:
            rows.extend(make_rows())
        except Exception as error:  # a backend refusing a shape is recorded, not fatal
            reason = str(error).splitlines()[0][:300] if str(error) else type(error).__name__
            progress("%s at S=%d failed: %s" % (system, seqlen, reason))
            skipped.append({"system": system, "S": seqlen, "reason": "failed: " + reason})
        finally:
            torch.cuda.empty_cache()

    for seqlen in seqlens:
        if seqlen > args.max_dense:
            continue
        for backend, system in ((SDPBackend.CUDNN_ATTENTION, "cudnn_dense"),
                                (SDPBackend.FLASH_ATTENTION, "fa2_dense")):
            attempt(system, seqlen, lambda: dense_rows(seqlen, backend, system))
    if args.eager:
        eager = load_eager()
        for seqlen in seqlens:
            if seqlen <= args.max_eager:
                attempt("eager_torch", seqlen, lambda: eager_rows(seqlen, eager))
    if args.flex:
        from torch.nn.attention.flex_attention import flex_attention

        # NOTES: one compiled function with dynamic shapes, so the kernels compile once for all S
        # (per pattern: the mask_mod is part of the graph), not once per S.
        compiled = {"function": torch.compile(flex_attention, dynamic=True), "dynamic": True}

        def flex_or_fallback(seqlen, pattern):
            try:
                return flex_rows(seqlen, compiled["function"], pattern)
            except Exception as error:
                if not compiled["dynamic"]:
                    raise
                reason = str(error).splitlines()[0][:200] if str(error) else type(error).__name__
                progress("dynamic-shape FlexAttention failed (%s); compiling once per S instead" % reason)
                compiled.update(function=torch.compile(flex_attention, dynamic=False), dynamic=False)
                return flex_rows(seqlen, compiled["function"], pattern)

        started = time.perf_counter()
        plan = [(seqlen, "tile_shared") for seqlen in map(int, args.flex_seqlens.split(","))]
        plan += [(seqlen, "per_query") for seqlen in map(int, args.flex_per_query_seqlens.split(",")) if seqlen]
        for seqlen, pattern in plan:
            system = "flex_" + pattern
            spent = time.perf_counter() - started
            if spent > args.flex_budget_s:
                reason = "FlexAttention budget of %.0f s spent (%.0f s so far, compile included)" % (
                    args.flex_budget_s, spent)
                progress("%s at S=%d skipped: %s" % (system, seqlen, reason))
                skipped.append({"system": system, "S": seqlen, "reason": reason})
                continue
            progress("%s at S=%d (%.0f s of FlexAttention so far)" % (system, seqlen, spent))
            attempt(system, seqlen, lambda: flex_or_fallback(seqlen, pattern))
    with open(args.out, "w") as f:
        json.dump({"rows": rows, "skipped": skipped}, f, indent=1)


if __name__ == "__main__":
    main()
