"""Recall of the index branch against the main attention: how well the proxies pick the blocks
the main heads attend to. Meant for monitoring the warmup (SPEC.md §5: the selection does not gate
attention there, but it is what sparse mode will use) and sparse training alike.

For a query row i of proxy head p the TEACHER is the mean over the M = H/Hp main heads of p of the
dense causal softmax P_hi (as in the KL of SPEC.md §3, but over every visible token), and a block's
teacher mass is the teacher's sum over the block. With S_p(i) the blocks the index branch selects
(flashmsa.select_blocks) and T_p(i) the min(K, visible blocks) blocks of largest teacher mass (ties
to the smaller block):

    block recall  = |S_p(i) ∩ T_p(i)| / |T_p(i)|
    score recall  = Σ_{c ∈ S_p(i)} teacher mass of c      (the share of the teacher kept)

both averaged over the batch, the proxy heads and a set of query rows (evenly spaced over the
sequence, the last row included). Everything stays on the inputs' device: no host
synchronisation until the caller reads a value, except the check of a block_idx the caller passes.
"""

from typing import Dict, Optional

import torch

from ._ops import _check_device
from .functional import (BLOCK_SIZE, _check_heads, _check_sizes, _check_tensor, _scale, select_blocks,
                         top_k_blocks)

# Rows of [rows, M, S] fp32 scores computed at a time, so that a 1M-token sequence needs
# ≈ 512 MB of scratch, not rows × H × S × 4 bytes.
_SCRATCH_ELEMENTS = 1 << 27

# The arguments the head counts come from, named as the ops name them (bindings/torch/tensor_args.cpp).
_HEAD_ARGUMENTS = ("q.size(2) (num_heads)", "k.size(2) (num_kv_heads)",
                   "q_proxy.size(2) (num_proxy_heads)", "k_proxy.size(2) (num_proxy_kv_heads)")


def _sample_rows(seqlen: int, rows: int, device: torch.device) -> torch.Tensor:
    """min(rows, seqlen) rows evenly spaced from 0 to seqlen - 1 (rounded half up). Their spacing is
    at least 1, so they are distinct and ascending without a unique() (which would synchronise)."""
    count = min(rows, seqlen)
    if count == 1:
        return torch.full((1,), seqlen - 1, dtype=torch.long, device=device)
    steps = torch.arange(count, dtype=torch.long, device=device)
    return (2 * steps * (seqlen - 1) + (count - 1)) // (2 * (count - 1))


def _check_block_idx_rows(block_idx: torch.Tensor, row_ids: torch.Tensor, num_blocks: int,
                          caller: str) -> None:
    """The rows of block_idx that are measured hold what select_blocks writes: blocks in [0, NB),
    -1 only in the slots after the row's blocks, no block twice. Reading the verdict synchronises
    the host once."""
    chosen = block_idx[:, :, row_ids]                                       # [B, Hp, R, K]
    empty = chosen == -1
    out_of_range = (chosen < -1) | (chosen >= num_blocks)
    block_after_empty = ~empty & (empty.cumsum(dim=-1) > 0)
    ordered = chosen.sort(dim=-1).values
    repeated = (ordered[..., 1:] == ordered[..., :-1]) & (ordered[..., 1:] >= 0)
    verdicts = torch.stack((out_of_range.any(), block_after_empty.any(), repeated.any())).tolist()
    if not any(verdicts):
        return

    def first(mask):  # the first offending entry of a [B, Hp, R, K] mask, and its row's name
        b, p, r, slot = mask.nonzero()[0].tolist()
        return (b, p, r), slot, f"block_idx[{b}, {p}, {row_ids[r].item()}"

    if verdicts[0]:
        row, slot, name = first(out_of_range)
        raise ValueError(f"{caller}: block_idx: entries must be -1 or a block in [0, {num_blocks}) "
                         f"(NB = ceil(S/{BLOCK_SIZE})), got {name}, {slot}] = {chosen[row][slot].item()}")
    if verdicts[1]:
        row, _, name = first(block_after_empty)
        raise ValueError(f"{caller}: block_idx: -1 (no block) may only fill the slots after a row's "
                         f"blocks, got {name}] = {chosen[row].tolist()}")
    row, position, name = first(repeated)
    raise ValueError(f"{caller}: block_idx: a row must not hold a block twice, got block "
                     f"{ordered[row][position + 1].item()} twice in {name}] = {chosen[row].tolist()}")


def block_recall(q: torch.Tensor, k: torch.Tensor, q_proxy: torch.Tensor, k_proxy: torch.Tensor,
                 top_k: int, *, softmax_scale: Optional[float] = None,
                 proxy_scale: Optional[float] = None, rows: int = 256,
                 block_idx: Optional[torch.Tensor] = None) -> Dict[str, torch.Tensor]:
    """Block recall and score recall of the index branch (see the module text), as 0-d fp32 tensors.

    Args:
        q: [B, S, H, D]; k: [B, S, Hkv, D]; q_proxy: [B, S, Hp, Di]; k_proxy: [B, S, Hpk, Di], as
            for msa_attention (v is not needed).
        top_k: tokens kept per query and proxy head, a multiple of 128 (K = top_k/128 blocks).
        softmax_scale, proxy_scale: sigma and sigma_p, defaults D^-1/2 and Di^-1/2.
        rows: query rows per sequence to measure, evenly spaced (the cost is rows × H × S × D
            multiply-adds for the teacher plus one select_blocks call).
        block_idx: the selection to measure, [B, Hp, S, K] int32 (or int64) on q's device, when
            the caller already has it; by default select_blocks(q_proxy, k_proxy, top_k). Its
            measured rows must hold what select_blocks writes: blocks in [0, ceil(S/128)), -1 only
            in the slots after the row's blocks, no block twice; checking that reads a verdict back
            to the host, so passing block_idx synchronises the host once (on CUDA).

    Returns:
        {"block_recall": ..., "score_recall": ...}, each a 0-d fp32 tensor on q's device.
    """
    caller = "block_recall"
    for tensor, name in ((q, "q"), (k, "k"), (q_proxy, "q_proxy"), (k_proxy, "k_proxy")):
        _check_tensor(tensor, name, caller)
        if tensor.dim() != 4:
            raise ValueError(f"{caller}: {name}: must be 4-D [batch, seqlen, heads, dim], got shape "
                             f"{list(tensor.shape)}")
    blocks = top_k_blocks(top_k, caller=caller)
    sigma = _scale(softmax_scale, "softmax_scale", caller)
    _scale(proxy_scale, "proxy_scale", caller)
    if isinstance(rows, bool) or not isinstance(rows, int) or rows < 1:
        raise ValueError(f"{caller}: rows: must be a positive int, got {rows!r}")
    batch, seqlen, heads, dim = q.shape
    kv_heads, proxy_heads = k.shape[2], q_proxy.shape[2]
    _check_sizes({"q.size(0) (batch)": batch, "q.size(1) (seqlen)": seqlen, "q.size(3) (head_dim)": dim},
                 caller)
    if k.shape[0] != batch or k.shape[1] != seqlen or k.shape[3] != dim:
        raise ValueError(f"{caller}: k: must be [{batch}, {seqlen}, Hkv, {dim}] to match q, got "
                         f"{list(k.shape)}")
    if q_proxy.shape[0] != batch or q_proxy.shape[1] != seqlen:
        raise ValueError(f"{caller}: q_proxy: must be [{batch}, {seqlen}, Hp, Di] to match q, got "
                         f"{list(q_proxy.shape)}")
    _check_heads(heads, kv_heads, proxy_heads, k_proxy.shape[2], caller, _HEAD_ARGUMENTS)
    _check_device(caller, "q", q, k=k, q_proxy=q_proxy, k_proxy=k_proxy)
    given = block_idx is not None
    if not given:
        block_idx = select_blocks(q_proxy, k_proxy, top_k, proxy_scale=proxy_scale)
    else:
        _check_tensor(block_idx, "block_idx", caller)
        if block_idx.shape != (batch, proxy_heads, seqlen, blocks):
            raise ValueError(f"{caller}: block_idx: must be [{batch}, {proxy_heads}, {seqlen}, {blocks}] "
                             f"(select_blocks' output for this top_k), got {list(block_idx.shape)}")
        if block_idx.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"{caller}: block_idx: dtype must be torch.int32 (select_blocks' output) or "
                             f"torch.int64, got {block_idx.dtype}")
        _check_device(caller, "q", q, block_idx=block_idx)

    device = q.device
    sigma = sigma if sigma > 0.0 else dim ** -0.5
    per_proxy = heads // proxy_heads
    group = heads // kv_heads
    num_blocks = (seqlen + BLOCK_SIZE - 1) // BLOCK_SIZE
    sampled = _sample_rows(seqlen, rows, device)
    if given:
        _check_block_idx_rows(block_idx, sampled, num_blocks, caller)
    keys = torch.arange(seqlen, device=device)
    block_of_key = keys // BLOCK_SIZE
    block_ids = torch.arange(num_blocks, device=device)
    chunk = max(1, _SCRATCH_ELEMENTS // max(1, per_proxy * seqlen))

    block_hits = torch.zeros((), dtype=torch.float64, device=device)
    kept_mass = torch.zeros((), dtype=torch.float64, device=device)
    measured = 0
    for b in range(batch):
        for p in range(proxy_heads):
            first_head = p * per_proxy
            kv_head = first_head // group  # p's M heads share one KV head (Hp % Hkv == 0)
            keys_p = k[b, :, kv_head].float()                              # [S, D]
            for start in range(0, sampled.numel(), chunk):
                row_ids = sampled[start:start + chunk]                      # [R]
                queries = q[b, row_ids, first_head:first_head + per_proxy].float()  # [R, M, D]
                scores = sigma * torch.einsum("rmd,sd->rms", queries, keys_p)
                visible = keys[None, :] <= row_ids[:, None]                 # [R, S]
                scores = scores.masked_fill(~visible[:, None, :], float("-inf"))
                teacher = torch.softmax(scores, dim=-1).mean(dim=1)         # [R, S]
                mass = torch.zeros(row_ids.numel(), num_blocks, dtype=torch.float32, device=device)
                mass.index_add_(1, block_of_key, teacher)                   # [R, NB]
                visible_blocks = row_ids // BLOCK_SIZE + 1                  # [R]
                wanted = torch.clamp(visible_blocks, max=blocks)            # |T_p(i)|
                # Teacher's top blocks: mass descending, ties to the smaller block; invisible
                # blocks last (mass -1).
                ranked_mass = mass.masked_fill(block_ids[None, :] >= visible_blocks[:, None], -1.0)
                order = torch.argsort(ranked_mass, dim=1, descending=True, stable=True)
                rank = torch.empty_like(order)
                rank.scatter_(1, order, block_ids.expand_as(order).contiguous())
                in_teacher = rank < wanted[:, None]                         # [R, NB]
                chosen = block_idx[b, p, row_ids].long()                    # [R, K], -1 unused
                valid = chosen >= 0
                safe = chosen.clamp(min=0)
                hits = (torch.gather(in_teacher, 1, safe) & valid).sum(dim=1)
                block_hits += (hits.double() / wanted.double()).sum()
                kept_mass += (torch.gather(mass, 1, safe) * valid).sum().double()
                measured += row_ids.numel()
    return {"block_recall": (block_hits / measured).float(),
            "score_recall": (kept_mass / measured).float()}
