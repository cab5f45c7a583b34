"""Shared helpers of the PyTorch tests (tests/python).

Which flashmsa is tested: the installed package (scripts/setup_torch.sh), or, when
FLASHMSA_TORCH_LIBRARY names a built libflashmsa_torch.so, the sources in python/ with that library
(how scripts/gpu_check.sh runs them on the GPU machine).

GPU tests are marked `hopper` and skip with a message without an H100/H200. A CUDA op that has no
kernel in this build raises NotImplementedError; `kernels_or_skip` turns that into a skip that says
which op, so GPU tests stay green while kernels land stage by stage.
"""

import contextlib
import os
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
if os.environ.get("FLASHMSA_TORCH_LIBRARY"):
    sys.path.insert(0, str(ROOT / "python"))

import flashmsa  # noqa: E402

HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
hopper = pytest.mark.skipif(not HOPPER, reason="needs an NVIDIA Hopper GPU (H100/H200); none found")

# SPEC.md's named head configurations scaled down to 16 query heads (H, Hkv, Hp, Hpk), keeping the
# ratios that matter: paper G = M = 16 (Hp = Hkv, Hpk = 1), specialized Hp > Hkv, seed exactly.
HEAD_CONFIGS = {
    "paper": (16, 1, 1, 1),
    "specialized": (16, 1, 4, 1),
    "seed": (16, 2, 4, 1),
}
# Small configurations for the CPU reference (fast at head dim 16).
SMALL_CONFIGS = {
    "mha_like": (2, 2, 2, 2),
    "gqa": (4, 2, 2, 1),
    "specialized": (8, 2, 4, 1),
    "one_proxy": (4, 1, 1, 1),
}


@contextlib.contextmanager
def kernels_or_skip():
    """Run CUDA ops; a NotImplementedError (no kernel in this build) skips the test, also when a
    checker such as torch.library.opcheck re-raises it as the cause of its own error."""
    try:
        yield
    except Exception as error:
        cause = error
        while cause is not None and not isinstance(cause, NotImplementedError):
            cause = cause.__cause__
        if cause is None:
            raise
        pytest.skip(f"kernel not built: {cause}".splitlines()[0])


def make_inputs(heads, seqlen=256, *, batch=1, head_dim=16, proxy_head_dim=None,
                dtype=torch.float64, device="cpu", requires_grad=False, seed=0, head_major=False):
    """q, k, v, q_proxy, k_proxy as [B, S, heads, dim] leaves (head_major: the same values stored
    [B, heads, S, dim] and seen through .transpose(1, 2), the seed's layout without a copy)."""
    num_heads, num_kv_heads, num_proxy_heads, num_proxy_kv_heads = heads
    proxy_head_dim = proxy_head_dim or head_dim
    generator = torch.Generator().manual_seed(seed)
    tensors = []
    for count, dim in ((num_heads, head_dim), (num_kv_heads, head_dim), (num_kv_heads, head_dim),
                       (num_proxy_heads, proxy_head_dim), (num_proxy_kv_heads, proxy_head_dim)):
        tensor = torch.randn((batch, seqlen, count, dim), generator=generator).to(dtype).to(device)
        if head_major:  # the same values stored [B, heads, S, dim]
            tensor = tensor.transpose(1, 2).contiguous().transpose(1, 2)
        tensors.append(tensor.requires_grad_(requires_grad))
    return tensors


def leaves(tensors):
    """Fresh leaf copies (same layout) that require grad."""
    return [t.detach().clone().requires_grad_(True) for t in tensors]


def relative_error(actual, expected):
    actual, expected = actual.double(), expected.double()
    return ((actual - expected).norm() / expected.norm().clamp_min(1e-30)).item()
