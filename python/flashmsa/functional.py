"""The functional API: msa_attention, flash_msa_func (the seed's signature), select_blocks, last_kl.

Every function here is a thin layer over the ops of ``_ops.py``: it converts ``top_k`` from tokens
to blocks, picks defaults, runs the selection, then the autograd-enabled ``flashmsa::forward``.
"""

import numbers
from typing import Dict, Optional, Tuple, Union

import torch

from ._ops import ops

BLOCK_SIZE = 128  # tokens per KV block (SPEC.md Bk)
MAX_TOP_K_BLOCKS = 64  # K <= 64 blocks
MODES = ("sparse", "warmup")
HEAD_NAMES = ("num_heads", "num_kv_heads", "num_proxy_heads", "num_proxy_kv_heads")


class _LastKL:
    """The KL sink of the most recent eager msa_attention call that made its own."""

    sink: Optional[torch.Tensor] = None


_last = _LastKL()


def new_kl_sink(device: Union[str, torch.device, None] = None) -> torch.Tensor:
    """A fresh KL sink: an fp32 0-d leaf tensor with requires_grad=True.

    Pass it as ``msa_attention(..., kl_sink=sink)``: the backward of that call adds the true KL
    value (SPEC.md §3) to ``sink.grad``, like a gradient: calls sharing a sink (layers,
    micro-batches) sum their values until ``sink.grad = None``. Its own value is never read, so it
    is left uninitialised (a zero fill would be one more kernel launch per eager call).
    """
    return torch.empty((), dtype=torch.float32, device=device, requires_grad=True)


def last_kl() -> Optional[torch.Tensor]:
    """The true KL value (SPEC.md §3) of the most recent eager ``msa_attention`` /
    ``flash_msa_func`` call made without a ``kl_sink`` while autograd records it (grad enabled and
    an input requiring grad), as an fp32 0-d tensor on its device. A call that raises leaves it as
    it was.

    The backward computes it, so it is None until ``loss.backward()`` has run for that call.
    Reading it with ``.item()`` synchronises the host: log it every n steps. A call traced by
    torch.compile without a ``kl_sink`` resets it to None rather than leave an older eager value;
    pass a ``kl_sink`` there (MSAAttention does).
    """
    return None if _last.sink is None else _last.sink.grad


def top_k_blocks(top_k: int, *, name: str = "top_k", caller: str = "msa_attention") -> int:
    """``top_k`` in tokens (a multiple of 128, as in Flash-MSA) -> K blocks, with the rule checked."""
    if isinstance(top_k, bool) or not isinstance(top_k, numbers.Integral):
        raise TypeError(f"{caller}: {name}: must be an int number of tokens, got {type(top_k).__name__}")
    top_k = int(top_k)  # e.g. a numpy integer
    if top_k % BLOCK_SIZE != 0 or not BLOCK_SIZE <= top_k <= BLOCK_SIZE * MAX_TOP_K_BLOCKS:
        raise ValueError(
            f"{caller}: {name}: must be a multiple of {BLOCK_SIZE} tokens in "
            f"[{BLOCK_SIZE}, {BLOCK_SIZE * MAX_TOP_K_BLOCKS}] (K = {name}/{BLOCK_SIZE} blocks of "
            f"{BLOCK_SIZE} tokens), got {top_k}"
        )
    return top_k // BLOCK_SIZE


def _scale(value: Optional[float], name: str, caller: str) -> float:
    """None -> 0.0, which the ops read as the default dim^-1/2."""
    if value is None:
        return 0.0
    if not isinstance(value, (numbers.Real, torch.SymFloat, torch.SymInt)):
        raise TypeError(f"{caller}: {name}: must be a float or None, got {type(value).__name__}")
    value = float(value)
    if not (value > 0.0 and value != float("inf")):
        raise ValueError(f"{caller}: {name}: must be a finite positive float or None, got {value}")
    return value


def _check_sizes(sizes: Dict[str, int], caller: str) -> None:
    """Each named size (a head count, a dim, batch, seqlen) is an int >= 1, as the ops require."""
    for name, value in sizes.items():
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{caller}: {name}: must be an int, got {type(value).__name__}")
        if value < 1:
            raise ValueError(f"{caller}: {name}: must be >= 1, got {value}")


def _check_heads(heads: int, kv_heads: int, proxy_heads: int, proxy_kv_heads: int, caller: str,
                 names: Tuple[str, str, str, str] = HEAD_NAMES) -> None:
    """The head-count rules of the ops (src/api/validate.cpp, check_shape), worded as they word
    them, for the callers that need them before any op runs (block_recall, MSAAttention). ``names``
    are the arguments the four counts come from, e.g. "q.size(2) (num_heads)"."""
    _check_sizes(dict(zip(names, (heads, kv_heads, proxy_heads, proxy_kv_heads))), caller)
    if heads % kv_heads != 0:
        raise ValueError(f"{caller}: {names[0]}: must be divisible by num_kv_heads (H % Hkv == 0), "
                         f"got H={heads}, Hkv={kv_heads}")
    if heads % proxy_heads != 0:
        raise ValueError(f"{caller}: {names[0]}: must be divisible by num_proxy_heads (H % Hp == 0), "
                         f"got H={heads}, Hp={proxy_heads}")
    if proxy_heads % proxy_kv_heads != 0:
        raise ValueError(f"{caller}: {names[2]}: must be divisible by num_proxy_kv_heads "
                         f"(Hp % Hpk == 0), got Hp={proxy_heads}, Hpk={proxy_kv_heads}")
    if proxy_heads % kv_heads != 0:
        raise ValueError(f"{caller}: {names[2]}: must be divisible by num_kv_heads (Hp % Hkv == 0: "
                         f"each proxy group lies inside one KV group), got Hp={proxy_heads}, "
                         f"Hkv={kv_heads}")


def _check_kl_sink(sink, q: torch.Tensor, caller: str) -> None:
    # A leaf: the value arrives as its .grad, which autograd keeps only on leaves.
    if not (isinstance(sink, torch.Tensor) and sink.dim() == 0 and sink.dtype == torch.float32
            and sink.requires_grad and sink.is_leaf and sink.device == q.device):
        described = (f"{sink.dtype} of shape {list(sink.shape)} on {sink.device}, requires_grad="
                     f"{sink.requires_grad}, is_leaf={sink.is_leaf}"
                     if isinstance(sink, torch.Tensor) else type(sink).__name__)
        raise ValueError(f"{caller}: kl_sink: must be a 0-d torch.float32 leaf tensor with "
                         f"requires_grad=True on {q.device} (flashmsa.new_kl_sink()), got {described}")


def _check_tensor(tensor, name: str, caller: str) -> None:
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{caller}: {name}: must be a torch.Tensor, got {type(tensor).__name__}")


def select_blocks(q_proxy: torch.Tensor, k_proxy: torch.Tensor, top_k: int, *,
                  proxy_scale: Optional[float] = None) -> torch.Tensor:
    """The index branch alone (SPEC.md §1), for analysis such as recall.

    Args:
        q_proxy: [B, S, Hp, Di]; k_proxy: [B, S, Hpk, Di] (any strides, contiguous last dim).
        top_k: tokens kept per query and proxy head, a multiple of 128 (K = top_k/128 blocks).
        proxy_scale: sigma_p, default Di^-1/2.

    Returns:
        block_idx [B, Hp, S, K] int32: per row the selected 128-token blocks by descending block
        score (ties to the smaller block), the query's own block first, -1 in slots beyond the
        c(i)+1 visible blocks. Not differentiable.
    """
    caller = "select_blocks"
    _check_tensor(q_proxy, "q_proxy", caller)
    _check_tensor(k_proxy, "k_proxy", caller)
    blocks = top_k_blocks(top_k, caller=caller)
    return ops.select(q_proxy.detach(), k_proxy.detach(), blocks, _scale(proxy_scale, "proxy_scale", caller))


def msa_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_proxy: torch.Tensor,
    k_proxy: torch.Tensor,
    top_k: int,
    *,
    softmax_scale: Optional[float] = None,
    proxy_scale: Optional[float] = None,
    mode: str = "sparse",
    deterministic: bool = False,
    return_kl: bool = True,
    kl_sink: Optional[torch.Tensor] = None,
) -> Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]:
    """MiniMax Sparse Attention (SPEC.md §1-§5) with its KL alignment loss.

    Args:
        q: [B, S, H, D]; k, v: [B, S, Hkv, D]; q_proxy: [B, S, Hp, Di]; k_proxy: [B, S, Hpk, Di].
            bf16 or fp16 on CUDA (the CPU reference also takes fp32 and fp64), any strides with a
            contiguous last dim (a [B, H, S, D] tensor passed as ``.transpose(1, 2)`` is not
            copied). Heads: H % Hkv == 0, H % Hp == 0, Hp % Hpk == 0, Hp % Hkv == 0.
        top_k: tokens kept per query and proxy head, in TOKENS like Flash-MSA: a multiple of 128,
            at most 8192; the kernels keep K = top_k/128 blocks of 128 tokens, the query's own
            block always among them. In warmup mode it is only checked.
        softmax_scale: sigma of the main scores, default D^-1/2.
        proxy_scale: sigma_p of the proxy scores, default Di^-1/2.
        mode: "sparse" (attention over the selected blocks) or "warmup" (dense causal attention,
            the KL taken over all visible tokens; no selection is computed).
        deterministic: ask the backward for a run-to-run bitwise identical result.
        return_kl: when False, return ``out`` only (the KL then sends no gradient and computes
            no value; a ``kl_sink`` is refused).
        kl_sink: where the true KL value goes (see ``new_kl_sink()``): an fp32 0-d leaf tensor with
            requires_grad=True on the inputs' device; the backward of this call adds the value to
            ``kl_sink.grad``. When None (eager mode, autograd recording), a fresh sink is made:
            ``last_kl()``. Without a sink and with no input requiring grad (evaluation), ``out``
            does not require grad either, as with SDPA.

    Returns:
        ``(out, kl)``: out [B, S, H, D] contiguous in the input dtype; kl a 0-d fp32 tensor whose
        gradient trains the proxies (dq_proxy, dk_proxy; none reaches q, k, v), so
        ``loss = task_loss + lam * kl`` works with no host synchronisation. Its VALUE is 0: the
        forward cannot know the final softmax statistics, so the KL value is accumulated by the
        backward and lands in ``kl_sink.grad`` (or ``last_kl()``) once ``backward()`` has run.
        For the same reason ``torch.autograd.gradcheck`` applies to ``out`` only; the KL
        gradients are checked against ``flashmsa.eager.msa_attention`` (tests/python).

    The CUDA kernels take head_dim = proxy_head_dim = 128 (others raise NotImplementedError);
    the CPU reference takes any multiple of 8.
    """
    caller = "msa_attention"
    for tensor, name in ((q, "q"), (k, "k"), (v, "v"), (q_proxy, "q_proxy"), (k_proxy, "k_proxy")):
        _check_tensor(tensor, name, caller)
    if mode not in MODES:
        raise ValueError(f"{caller}: mode: must be 'sparse' or 'warmup', got {mode!r}")
    blocks = top_k_blocks(top_k, caller=caller)
    sigma = _scale(softmax_scale, "softmax_scale", caller)
    sigma_p = _scale(proxy_scale, "proxy_scale", caller)
    own_sink = None
    if not return_kl:
        if kl_sink is not None:
            raise ValueError(f"{caller}: kl_sink: must be None with return_kl=False (no KL value is "
                             f"computed then)")
    elif kl_sink is not None:
        _check_kl_sink(kl_sink, q, caller)
    elif torch.compiler.is_compiling():
        _last.sink = None  # replayed on every compiled call: last_kl() never shows a stale value
    elif torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v, q_proxy, k_proxy)):
        kl_sink = own_sink = new_kl_sink(q.device)
    block_idx = None
    if mode == "sparse":
        block_idx = ops.select(q_proxy.detach(), k_proxy.detach(), blocks, sigma_p)
    out, _, _, kl = ops.forward(q, k, v, q_proxy, k_proxy, block_idx, blocks, mode, sigma, sigma_p,
                                bool(deterministic), kl_sink)
    if own_sink is not None:  # only now that the ops took the input: a failed call keeps last_kl()
        _last.sink = own_sink
    return (out, kl) if return_kl else out


def flash_msa_func(q_proxy: torch.Tensor, k_proxy: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                   v: torch.Tensor, top_k: int, scale: float) -> Tuple[torch.Tensor, torch.Tensor]:
    """Flash-MSA's ``flash_msa_func``, same signature, layouts and semantics (sparse mode).

    Args:
        q_proxy [B, Hp, S, D], k_proxy [B, Hpk, S, D], q [B, H, S, D], k and v [B, Hkv, S, D]
            (head-major, as Flash-MSA; read through transposed views, never copied).
        top_k: tokens, a multiple of 128 (K = top_k/128 blocks).
        scale: sigma for BOTH the main and the proxy scores, as in Flash-MSA.

    Returns:
        ``(out [B, S, H*D], kl_loss)``: token-major output; kl_loss a 0-d fp32 tensor of value 0
        whose gradient trains the proxies. Unlike Flash-MSA the true KL value is computed: after
        ``backward()`` it is in ``flashmsa.last_kl()``.
    """
    caller = "flash_msa_func"
    for tensor, name in ((q_proxy, "q_proxy"), (k_proxy, "k_proxy"), (q, "q"), (k, "k"), (v, "v")):
        _check_tensor(tensor, name, caller)
        if tensor.dim() != 4:
            raise ValueError(f"{caller}: {name}: must be 4-D [batch, heads, seqlen, dim], got shape "
                             f"{list(tensor.shape)}")
    top_k_blocks(top_k, caller=caller)
    out, kl = msa_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                            q_proxy.transpose(1, 2), k_proxy.transpose(1, 2), top_k,
                            softmax_scale=scale, proxy_scale=scale)
    batch, seqlen, heads, dim = out.shape
    return out.view(batch, seqlen, heads * dim), kl
