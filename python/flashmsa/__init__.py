"""flashmsa: MiniMax Sparse Attention training kernels for Hopper, as PyTorch ops.

    out, kl = flashmsa.msa_attention(q, k, v, q_proxy, k_proxy, top_k=2048)
    loss = task_loss(out) + lam * kl        # kl's gradient trains the proxy heads
    loss.backward()
    flashmsa.last_kl()                      # the KL value of that call, computed by the backward

CUDA tensors (H100/H200) run the kernels; CPU tensors run the fp64 reference (slow, for tests).
The raw ops are torch.ops.flashmsa.{select, forward, backward}; see docs in README.md "PyTorch".
"""

from ._ops import include_dir, library_path, ops
from .functional import (BLOCK_SIZE, flash_msa_func, last_kl, msa_attention, new_kl_sink,
                         select_blocks, top_k_blocks)
from .modules import MSAAttention, apply_rotary
from .monitor import block_recall

__all__ = [
    "BLOCK_SIZE",
    "MSAAttention",
    "apply_rotary",
    "block_recall",
    "flash_msa_func",
    "include_dir",
    "last_kl",
    "library_path",
    "msa_attention",
    "new_kl_sink",
    "ops",
    "select_blocks",
    "top_k_blocks",
]
__version__ = "0.1.0"
