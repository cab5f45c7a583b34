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


# ---- fake implementations: shapes and dtypes only, the same as the CPU/CUDA ones produce -------


@torch.library.register_fake("flashmsa::select")
def _select_fake(q_proxy, k_proxy, top_k, proxy_scale=0.0):
    batch, seqlen, proxy_heads, _ = q_proxy.shape
    return q_proxy.new_empty((batch, proxy_heads, seqlen, top_k), dtype=torch.int32)


@torch.library.register_fake("flashmsa::forward")
def _forward_fake(q, k, v, q_proxy, k_proxy, block_idx, top_k, attention_mode="sparse", softmax_scale=0.0,
                  proxy_scale=0.0, deterministic=False, kl_sink=None):
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
    gradients = tuple(torch.empty_like(t) for t in (q, k, v, q_proxy, k_proxy))
    return gradients + (q.new_empty((), dtype=torch.float32),)
