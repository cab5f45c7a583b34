"""Loads libflashmsa_torch.so and registers what the C++ library leaves to Python.

The .so (bindings/torch) defines the ops ``torch.ops.flashmsa.{select, forward, backward}`` with
their CPU (fp64 reference) and CUDA (kernels) implementations and the autograd formula of
``forward`` (bindings/torch/autograd.cpp: its backward calls ``flashmsa::backward`` and hands the KL
value that the backward returns to the optional ``kl_sink`` input as its gradient, so the value
reaches the caller through autograd itself, in eager mode, torch.compile and CUDA graphs alike).
This module adds, once, the fake (meta) implementations, so torch.compile traces the ops without
graph breaks.

The library is looked up in ``$FLASHMSA_TORCH_LIBRARY`` when set (e.g. a .so built on another
machine), else next to this file, where ``pip install .`` puts it.
"""

import os
from pathlib import Path

import torch

LIBRARY_NAME = "libflashmsa_torch.so"


def library_path() -> str:
    """Path of the libflashmsa_torch.so this package loads."""
    override = os.environ.get("FLASHMSA_TORCH_LIBRARY")
    if override:
        return override
    return str(Path(__file__).resolve().parent / LIBRARY_NAME)


def include_dir() -> str:
    """Directory holding flashmsa/torch.h (for LibTorch programs built against the package)."""
    return str(Path(__file__).resolve().parent / "include")


def _load() -> None:
    path = library_path()
    if not os.path.exists(path):
        raise ImportError(
            f"flashmsa: {path} not found; build it with scripts/setup_torch.sh (or `pip install .`), "
            "or point FLASHMSA_TORCH_LIBRARY at a built libflashmsa_torch.so"
        )
    torch.ops.load_library(path)


_load()
ops = torch.ops.flashmsa


def _check_device(caller: str, like_name: str, like: torch.Tensor, **tensors) -> None:
    """Every tensor given (None skipped) is on ``like``'s device, with the ValueError the C++ ops
    raise (bindings/torch/tensor_args.cpp): "flashmsa.forward: k: must be on the device of q (cpu),
    got meta"."""
    for name, tensor in tensors.items():
        if tensor is not None and tensor.device != like.device:
            raise ValueError(f"{caller}: {name}: must be on the device of {like_name} ({like.device}), "
                             f"got {tensor.device}")


# ---- fake implementations: shapes and dtypes only, the same as the CPU/CUDA ones produce -------
# NOTES: they also check the devices. A meta tensor among CPU or CUDA ones dispatches here, not to
# the real op that would reject the mix, so without the check the call would return uninitialised
# memory on q's device. Fake tensors carry their real device (torch.compile, FakeTensorMode), so
# the check holds there as well.


@torch.library.register_fake("flashmsa::select")
def _select_fake(q_proxy, k_proxy, top_k, proxy_scale=0.0):
    _check_device("flashmsa.select", "q_proxy", q_proxy, k_proxy=k_proxy)
    batch, seqlen, proxy_heads, _ = q_proxy.shape
    return q_proxy.new_empty((batch, proxy_heads, seqlen, top_k), dtype=torch.int32)


@torch.library.register_fake("flashmsa::forward")
def _forward_fake(q, k, v, q_proxy, k_proxy, block_idx, top_k, attention_mode="sparse", softmax_scale=0.0,
                  proxy_scale=0.0, deterministic=False, kl_sink=None):
    _check_device("flashmsa.forward", "q", q, k=k, v=v, q_proxy=q_proxy, k_proxy=k_proxy,
                  block_idx=block_idx, kl_sink=kl_sink)
    batch, seqlen, heads, _ = q.shape
    proxy_heads = q_proxy.shape[2]
    out = q.new_empty(q.shape)
    lse = q.new_empty((batch, heads, seqlen), dtype=torch.float32)
    proxy_lse = q.new_empty((batch, proxy_heads, seqlen), dtype=torch.float32)
    kl = q.new_empty((), dtype=torch.float32)
    return out, lse, proxy_lse, kl


@torch.library.register_fake("flashmsa::backward")
def _backward_fake(dout, kl_grad, q, k, v, q_proxy, k_proxy, block_idx, out, lse, proxy_lse, top_k,
                   attention_mode="sparse", softmax_scale=0.0, proxy_scale=0.0, deterministic=False):
    _check_device("flashmsa.backward", "q", q, dout=dout, kl_grad=kl_grad, k=k, v=v, q_proxy=q_proxy,
                  k_proxy=k_proxy, block_idx=block_idx, out=out, lse=lse, proxy_lse=proxy_lse)
    gradients = tuple(torch.empty_like(t) for t in (q, k, v, q_proxy, k_proxy))
    return gradients + (q.new_empty((), dtype=torch.float32),)
