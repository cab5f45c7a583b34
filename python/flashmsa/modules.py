"""flashmsa.MSAAttention: an attention layer with MSA's index branch, ready for training.

Projections: q/k/v/o of the main GQA attention and the two proxy (index) projections. By default
the proxy projections read DETACHED hidden states (the paper's stopgrad(X): the KL trains the
proxies only and never reaches the backbone); ``detach_proxy_input=False`` lets it flow.
"""

from typing import Optional, Tuple

import torch
from torch import nn

from . import eager
from .functional import (MODES, _check_heads, _check_sizes, _scale, msa_attention, new_kl_sink,
                         top_k_blocks)
from .monitor import block_recall


def apply_rotary(x: torch.Tensor, positions: torch.Tensor, base: float = 10000.0) -> torch.Tensor:
    """Rotary embedding on interleaved pairs (x[..., 2i], x[..., 2i+1]), as Flash-MSA's test model.

    x: [B, S, heads, dim] with an even dim; positions: [S] token positions.
    """
    dim = x.shape[-1]
    inv_freq = base ** (-torch.arange(0, dim, 2, device=x.device, dtype=torch.float32) / dim)
    angles = positions.to(torch.float32)[:, None] * inv_freq[None, :]  # [S, dim/2]
    cos = angles.cos()[None, :, None, :]
    sin = angles.sin()[None, :, None, :]
    pairs = x.float().unflatten(-1, (dim // 2, 2))
    even, odd = pairs[..., 0], pairs[..., 1]
    rotated = torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1)
    return rotated.flatten(-2).to(x.dtype)


class _ReportToSink(torch.autograd.Function):
    """Identity on the eager KL that, like the op, hands its value to the sink in the backward."""

    @staticmethod
    def forward(ctx, kl, sink):
        ctx.save_for_backward(kl.detach())
        return kl.clone()

    @staticmethod
    def backward(ctx, grad):
        (value,) = ctx.saved_tensors
        return grad, value


class MSAAttention(nn.Module):
    """Causal GQA attention with MiniMax Sparse Attention's index branch.

    forward(hidden_states [B, S, hidden_size], positions=None) -> (out [B, S, hidden_size], kl).
    ``kl`` is the loss term: add ``lam * kl`` to the loss. With backend="flashmsa" its value is 0
    (msa_attention's term, whose gradient trains the proxies); with backend="eager" it is the KL
    value itself; the gradients are the same. After backward the true KL value is in
    ``self.kl_value`` (fp32 0-d tensor on the layer's device), with either backend. It accumulates
    over the backward passes since ``reset_kl()`` (e.g. over micro-batches), like a gradient that
    ``optimizer.zero_grad()`` does not touch: call ``reset_kl()`` once per step.

    Args:
        hidden_size: model width.
        num_heads, num_kv_heads: H and Hkv of the main attention.
        num_proxy_heads, num_proxy_kv_heads: Hp and Hpk of the index branch (paper: Hp = Hkv,
            Hpk = 1).
        head_dim, proxy_head_dim: D and Di (the kernels take 128; the CPU reference any multiple
            of 8; backend='eager' any dim, even with rotary_base set).
        top_k: tokens kept per query and proxy head, a multiple of 128.
        mode: "warmup" (dense attention, KL over all causal tokens) or "sparse"; switch with
            ``set_mode``.
        detach_proxy_input: proxies read hidden_states.detach() (default True).
        rotary_base: base of the rotary embedding applied to q, k, q_proxy and k_proxy; None: none.
            It turns interleaved pairs (x[2i], x[2i+1]) as Flash-MSA's model does (GPT-J style),
            not the halves (x[i], x[i + dim/2]) of Llama / GPT-NeoX checkpoints.
        backend: "flashmsa" (the ops) or "eager" (flashmsa.eager, for comparisons).
        recall_rows: when > 0, every forward also measures the index branch against the main
            attention on that many query rows (flashmsa.block_recall: block and score recall, in
            warmup as in sparse mode) and keeps the result in ``self.last_recall``, a dict of 0-d
            fp32 tensors (no host synchronisation). It costs one select plus rows × H × S × D
            multiply-adds per call; set it on the steps you log. Default 0: off.
    """

    def __init__(self, hidden_size: int, num_heads: int, num_kv_heads: int, num_proxy_heads: int,
                 num_proxy_kv_heads: int = 1, *, head_dim: int = 128,
                 proxy_head_dim: Optional[int] = None, top_k: int = 2048, mode: str = "sparse",
                 detach_proxy_input: bool = True, rotary_base: Optional[float] = 10000.0,
                 softmax_scale: Optional[float] = None, proxy_scale: Optional[float] = None,
                 deterministic: bool = False, bias: bool = False, backend: str = "flashmsa",
                 recall_rows: int = 0, device=None, dtype=None):
        super().__init__()
        # NOTES: what msa_attention would reject at the first forward is rejected here, through the
        # same checks (functional.py).
        caller = "MSAAttention"
        top_k_blocks(top_k, caller=caller)
        _check_heads(num_heads, num_kv_heads, num_proxy_heads, num_proxy_kv_heads, caller)
        proxy_head_dim = head_dim if proxy_head_dim is None else proxy_head_dim
        _check_sizes({"head_dim": head_dim, "proxy_head_dim": proxy_head_dim}, caller)
        if backend not in ("flashmsa", "eager"):
            raise ValueError(f"{caller}: backend: must be 'flashmsa' or 'eager', got {backend!r}")
        for name, dim in (("head_dim", head_dim), ("proxy_head_dim", proxy_head_dim)):
            if backend == "flashmsa" and dim % 8 != 0:
                raise ValueError(f"{caller}: {name}: must be a multiple of 8 with backend='flashmsa' "
                                 f"(row strides are multiples of 8 elements), got {dim}")
            if rotary_base is not None and dim % 2 != 0:
                raise ValueError(f"{caller}: {name}: must be even with rotary_base set (the "
                                 f"rotary embedding turns pairs), got {dim}")
        _scale(softmax_scale, "softmax_scale", caller)
        _scale(proxy_scale, "proxy_scale", caller)
        if isinstance(recall_rows, bool) or not isinstance(recall_rows, int) or recall_rows < 0:
            raise ValueError(f"{caller}: recall_rows: must be an int >= 0, got {recall_rows!r}")
        factory = {"device": device, "dtype": dtype}
        self.num_heads, self.num_kv_heads = num_heads, num_kv_heads
        self.num_proxy_heads, self.num_proxy_kv_heads = num_proxy_heads, num_proxy_kv_heads
        self.head_dim, self.proxy_head_dim = head_dim, proxy_head_dim
        self.top_k = top_k
        self.detach_proxy_input = detach_proxy_input
        self.rotary_base = rotary_base
        self.softmax_scale, self.proxy_scale = softmax_scale, proxy_scale
        self.deterministic = deterministic
        self.backend = backend
        self.recall_rows = recall_rows
        self.last_recall = None  # block_recall's result of the last forward, when recall_rows > 0
        self.q_proj = nn.Linear(hidden_size, num_heads * head_dim, bias=bias, **factory)
        self.k_proj = nn.Linear(hidden_size, num_kv_heads * head_dim, bias=bias, **factory)
        self.v_proj = nn.Linear(hidden_size, num_kv_heads * head_dim, bias=bias, **factory)
        self.o_proj = nn.Linear(num_heads * head_dim, hidden_size, bias=bias, **factory)
        self.q_proxy_proj = nn.Linear(hidden_size, num_proxy_heads * proxy_head_dim, bias=bias, **factory)
        self.k_proxy_proj = nn.Linear(hidden_size, num_proxy_kv_heads * proxy_head_dim, bias=bias,
                                      **factory)
        self.mode = "sparse"
        self.set_mode(mode)
        self._kl_sink = new_kl_sink(self.q_proj.weight.device)

    def set_mode(self, mode: str) -> None:
        """"warmup" -> "sparse" when the proxies have learnt enough (paper: after the warmup)."""
        if mode not in MODES:
            raise ValueError(f"MSAAttention: mode: must be 'sparse' or 'warmup', got {mode!r}")
        self.mode = mode

    @property
    def kl_value(self) -> Optional[torch.Tensor]:
        """The KL value summed over the backward passes since reset_kl(); None before any."""
        return self._kl_sink.grad

    def reset_kl(self) -> None:
        self._kl_sink.grad = None

    def _apply(self, fn, recurse=True):
        # NOTES: the sink is a plain fp32 leaf, not a buffer (a buffer would be cast by
        # module.to(dtype) and stop being a leaf); it follows the weights' device here.
        module = super()._apply(fn, recurse)
        if self._kl_sink.device != self.q_proj.weight.device:
            self._kl_sink = new_kl_sink(self.q_proj.weight.device)
        return module

    def _heads(self, x: torch.Tensor, heads: int, dim: int) -> torch.Tensor:
        return x.unflatten(-1, (heads, dim))  # [B, S, heads*dim] -> [B, S, heads, dim]

    def forward(self, hidden_states: torch.Tensor, positions: Optional[torch.Tensor] = None
                ) -> Tuple[torch.Tensor, torch.Tensor]:
        batch, seqlen, _ = hidden_states.shape
        proxy_input = hidden_states.detach() if self.detach_proxy_input else hidden_states
        q = self._heads(self.q_proj(hidden_states), self.num_heads, self.head_dim)
        k = self._heads(self.k_proj(hidden_states), self.num_kv_heads, self.head_dim)
        v = self._heads(self.v_proj(hidden_states), self.num_kv_heads, self.head_dim)
        q_proxy = self._heads(self.q_proxy_proj(proxy_input), self.num_proxy_heads, self.proxy_head_dim)
        k_proxy = self._heads(self.k_proxy_proj(proxy_input), self.num_proxy_kv_heads,
                              self.proxy_head_dim)
        if self.rotary_base is not None:
            if positions is None:
                positions = torch.arange(seqlen, device=hidden_states.device)
            elif positions.shape != (seqlen,):
                raise ValueError(f"MSAAttention: positions: must be [S] = [{seqlen}] (one position per "
                                 f"token, shared by the batch), got {list(positions.shape)}")
            q, k, q_proxy, k_proxy = (apply_rotary(x, positions, self.rotary_base)
                                      for x in (q, k, q_proxy, k_proxy))
        scales = {"softmax_scale": self.softmax_scale, "proxy_scale": self.proxy_scale}
        if self.recall_rows > 0:
            with torch.no_grad():
                self.last_recall = block_recall(q, k, q_proxy, k_proxy, self.top_k, rows=self.recall_rows,
                                                **scales)
        if self.backend == "eager":
            out, kl = eager.msa_attention(q, k, v, q_proxy, k_proxy, self.top_k, mode=self.mode, **scales)
            kl = _ReportToSink.apply(kl, self._kl_sink)
        else:
            out, kl = msa_attention(q, k, v, q_proxy, k_proxy, self.top_k, mode=self.mode,
                                    deterministic=self.deterministic, kl_sink=self._kl_sink, **scales)
        return self.o_proj(out.reshape(batch, seqlen, -1)), kl
