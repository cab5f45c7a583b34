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
synchronisation until the caller reads a value.
"""

from typing import Dict, Optional

import torch

from .functional import BLOCK_SIZE, _check_tensor, _scale, select_blocks, top_k_blocks

# Rows of [rows, M, S] fp32 scores computed at a time, so that a 1M-token sequence needs
# ≈ 512 MB of scratch, not rows × H × S × 4 bytes.
_SCRATCH_ELEMENTS = 1 << 27


def _sample_rows(seqlen: int, rows: int, device: torch.device) -> torch.Tensor:
    count = min(rows, seqlen)
    return torch.linspace(0, seqlen - 1, count, device=device).round().long().unique()


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
        block_idx: the selection to measure, [B, Hp, S, K] int32, when the caller already has it;
            by default select_blocks(q_proxy, k_proxy, top_k).

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
    if isinstance(rows, bool) or not isinstance(rows, int) or rows < 1:
        raise ValueError(f"{caller}: rows: must be a positive int, got {rows!r}")
    batch, seqlen, heads, dim = q.shape
    kv_heads, proxy_heads = k.shape[2], q_proxy.shape[2]
    if k.shape[0] != batch or k.shape[1] != seqlen or k.shape[3] != dim:
        raise ValueError(f"{caller}: k: must be [{batch}, {seqlen}, Hkv, {dim}] to match q, got "
                         f"{list(k.shape)}")
    if q_proxy.shape[0] != batch or q_proxy.shape[1] != seqlen:
        raise ValueError(f"{caller}: q_proxy: must be [{batch}, {seqlen}, Hp, Di] to match q, got "
                         f"{list(q_proxy.shape)}")
    if heads % kv_heads != 0 or heads % proxy_heads != 0 or proxy_heads % kv_heads != 0:
        raise ValueError(f"{caller}: heads: need H % Hkv == 0, H % Hp == 0 and Hp % Hkv == 0, got "
                         f"H={heads}, Hkv={kv_heads}, Hp={proxy_heads}")
    if block_idx is None:
        block_idx = select_blocks(q_proxy, k_proxy, top_k, proxy_scale=proxy_scale)
    elif not (isinstance(block_idx, torch.Tensor) and block_idx.shape == (batch, proxy_heads, seqlen, blocks)):
        described = list(block_idx.shape) if isinstance(block_idx, torch.Tensor) else type(block_idx).__name__
        raise ValueError(f"{caller}: block_idx: must be [{batch}, {proxy_heads}, {seqlen}, {blocks}] "
                         f"(select_blocks' output for this top_k), got {described}")

    device = q.device
    sigma = sigma if sigma > 0.0 else dim ** -0.5
    per_proxy = heads // proxy_heads
    group = heads // kv_heads
    num_blocks = (seqlen + BLOCK_SIZE - 1) // BLOCK_SIZE
    sampled = _sample_rows(seqlen, rows, device)
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
