"""A readable eager PyTorch implementation of MSA (SPEC.md §1-§5), for tests and for reading.

Dense [B, heads, S, S] score matrices with masks: quadratic memory, small problems only. It is the
model the op implementations are compared against (tests/python) and the "eager" backend of
flashmsa.MSAAttention. Layout as msa_attention: [B, S, heads, D]. Computation in fp32 at least
(fp64 for fp64 inputs); outputs in the input dtype.
"""

from typing import Optional, Tuple

import torch

BLOCK_SIZE = 128


def _work_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def _heads_first(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[B, S, heads, D] -> [B, heads, S, D] in the working dtype."""
    return x.transpose(1, 2).to(dtype)


def proxy_scores(q_proxy: torch.Tensor, k_proxy: torch.Tensor, proxy_scale: Optional[float] = None
                 ) -> torch.Tensor:
    """s[b, p, i, j] = sigma_p <q_proxy[b, i, p], k_proxy[b, j, p // R]>, causal (j > i is -inf)."""
    dtype = _work_dtype(q_proxy.dtype)
    proxy_heads, proxy_dim = q_proxy.shape[2], q_proxy.shape[3]
    ratio = proxy_heads // k_proxy.shape[2]
    scale = proxy_scale if proxy_scale else proxy_dim ** -0.5
    qp = _heads_first(q_proxy, dtype)
    kp = _heads_first(k_proxy, dtype).repeat_interleave(ratio, dim=1)
    scores = scale * (qp @ kp.transpose(-1, -2))
    seqlen = q_proxy.shape[1]
    causal = torch.ones(seqlen, seqlen, dtype=torch.bool, device=q_proxy.device).tril()
    return scores.masked_fill(~causal, float("-inf"))


def select_blocks(q_proxy: torch.Tensor, k_proxy: torch.Tensor, top_k_blocks: int,
                  proxy_scale: Optional[float] = None) -> torch.Tensor:
    """SPEC.md §1: block_idx [B, Hp, S, K] int32, descending block score, ties to the smaller
    block, the local block forced first, -1 where fewer than K blocks are visible."""
    scores = proxy_scores(q_proxy, k_proxy, proxy_scale)  # [B, Hp, S, S]
    batch, proxy_heads, seqlen, _ = scores.shape
    num_blocks = (seqlen + BLOCK_SIZE - 1) // BLOCK_SIZE
    padded = torch.full((batch, proxy_heads, seqlen, num_blocks * BLOCK_SIZE), float("-inf"),
                        dtype=scores.dtype, device=scores.device)
    padded[..., :seqlen] = scores
    block_scores = padded.view(batch, proxy_heads, seqlen, num_blocks, BLOCK_SIZE).amax(dim=-1)
    local_block = torch.arange(seqlen, device=scores.device) // BLOCK_SIZE  # c(i)
    is_local = local_block[:, None] == torch.arange(num_blocks, device=scores.device)[None, :]
    block_scores = block_scores.masked_fill(is_local, float("inf"))
    # A stable descending sort keeps the smaller block first among equal scores.
    order_scores, order = torch.sort(block_scores, dim=-1, descending=True, stable=True)
    keep = min(top_k_blocks, num_blocks)
    block_idx = order[..., :keep].masked_fill(order_scores[..., :keep] == float("-inf"), -1)
    if keep < top_k_blocks:
        empty = block_idx.new_full((batch, proxy_heads, seqlen, top_k_blocks - keep), -1)
        block_idx = torch.cat([block_idx, empty], dim=-1)
    return block_idx.to(torch.int32)


def token_mask(block_idx: Optional[torch.Tensor], seqlen: int, device: torch.device,
               proxy_heads: int = 1, batch: int = 1) -> torch.Tensor:
    """T of SPEC.md §2 as a [B, Hp, S, S] bool mask: the causal tokens of the selected blocks, or
    (block_idx None: warmup, §5) every causal token."""
    causal = torch.ones(seqlen, seqlen, dtype=torch.bool, device=device).tril()
    if block_idx is None:
        return causal.expand(batch, proxy_heads, seqlen, seqlen)
    batch, proxy_heads, _, _ = block_idx.shape
    num_blocks = (seqlen + BLOCK_SIZE - 1) // BLOCK_SIZE
    chosen = torch.zeros(batch, proxy_heads, seqlen, num_blocks + 1, dtype=torch.bool, device=device)
    slots = torch.where(block_idx >= 0, block_idx.long(), num_blocks)  # -1 -> a spare column
    chosen.scatter_(-1, slots, True)
    key_block = torch.arange(seqlen, device=device) // BLOCK_SIZE
    return chosen[..., key_block] & causal


def msa_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_proxy: torch.Tensor,
                  k_proxy: torch.Tensor, top_k: int, *, softmax_scale: Optional[float] = None,
                  proxy_scale: Optional[float] = None, mode: str = "sparse",
                  block_idx: Optional[torch.Tensor] = None
                  ) -> Tuple[torch.Tensor, torch.Tensor]:
    """SPEC.md §1-§5 in plain torch: ``(out [B, S, H, D], kl)`` with kl the true L_KL value.

    ``top_k`` in tokens (a multiple of 128) as flashmsa.msa_attention; ``block_idx`` overrides the
    selection. Gradients: out -> q, k, v; kl -> q_proxy, k_proxy (the teacher is detached).
    """
    dtype = _work_dtype(q.dtype)
    batch, seqlen, heads, head_dim = q.shape
    kv_heads, proxy_heads = k.shape[2], q_proxy.shape[2]
    gqa, per_proxy = heads // kv_heads, heads // proxy_heads
    scale = softmax_scale if softmax_scale else head_dim ** -0.5

    if mode == "sparse" and block_idx is None:
        block_idx = select_blocks(q_proxy.detach(), k_proxy.detach(), top_k // BLOCK_SIZE, proxy_scale)
    mask = token_mask(block_idx if mode == "sparse" else None, seqlen, q.device, proxy_heads, batch)

    # §2 main branch: every main head h uses the tokens of its proxy head h // M.
    qh = _heads_first(q, dtype)
    kh = _heads_first(k, dtype).repeat_interleave(gqa, dim=1)
    vh = _heads_first(v, dtype).repeat_interleave(gqa, dim=1)
    head_mask = mask.repeat_interleave(per_proxy, dim=1)
    logits = (scale * (qh @ kh.transpose(-1, -2))).masked_fill(~head_mask, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    out = (probs @ vh).transpose(1, 2).to(q.dtype)

    # §3 KL: teacher = mean of the M heads' probabilities (detached), student = proxy softmax on T.
    teacher = probs.detach().view(batch, proxy_heads, per_proxy, seqlen, seqlen).mean(dim=2)
    student_logits = proxy_scores(q_proxy, k_proxy, proxy_scale).masked_fill(~mask, float("-inf"))
    log_student = torch.log_softmax(student_logits, dim=-1).masked_fill(~mask, 0.0)
    kl_rows = (torch.xlogy(teacher, teacher) - teacher * log_student).sum(dim=-1)
    return out, kl_rows.mean().to(torch.float32)
