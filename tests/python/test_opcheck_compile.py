"""torch.library.opcheck on every op (schema, fake tensors, autograd registration, AOT dispatch)
and torch.compile(fullgraph=True) of a forward + backward, on the CPU and, when present, the GPU."""

import pytest
import torch

import flashmsa

from conftest import HOPPER, kernels_or_skip, leaves, make_inputs

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not HOPPER, reason="needs an H100/H200"))]


def problem(device, requires_grad=False, seqlen=300):
    """A small problem: head dim 16 on the CPU reference, 128 (the kernels' size) on the GPU."""
    if device == "cpu":
        return make_inputs((4, 2, 2, 1), seqlen, dtype=torch.float32, requires_grad=requires_grad)
    return make_inputs((8, 2, 2, 1), 1024, head_dim=128, dtype=torch.bfloat16, device=device,
                       requires_grad=requires_grad)


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck_select(device):
    _, _, _, q_proxy, k_proxy = problem(device)
    with kernels_or_skip():
        torch.library.opcheck(flashmsa.ops.select.default, (q_proxy, k_proxy, 2, 0.0))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mode", ["sparse", "warmup"])
@pytest.mark.parametrize("with_sink", [True, False])
def test_opcheck_forward(device, mode, with_sink):
    inputs = problem(device, requires_grad=True)
    block_idx = flashmsa.ops.select(inputs[3].detach(), inputs[4].detach(), 2, 0.0)
    sink = flashmsa.new_kl_sink(device) if with_sink else None
    with kernels_or_skip():
        torch.library.opcheck(flashmsa.ops.forward.default,
                              (*inputs, block_idx if mode == "sparse" else None, 2, mode, 0.0, 0.0,
                               False, sink))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mode", ["sparse", "warmup"])
def test_opcheck_backward(device, mode):
    inputs = problem(device)
    block_idx = flashmsa.ops.select(inputs[3], inputs[4], 2, 0.0) if mode == "sparse" else None
    with kernels_or_skip():
        out, lse, proxy_lse, _ = flashmsa.ops.forward(*inputs, block_idx, 2, mode)
        kl_grad = torch.ones((), device=device)
        torch.library.opcheck(flashmsa.ops.backward.default,
                              (torch.randn_like(out), kl_grad, *inputs, block_idx, out, lse,
                               proxy_lse, 2, mode))


@pytest.mark.parametrize("device", DEVICES)
def test_compile_fullgraph_forward_backward(device):
    inputs = problem(device, requires_grad=True)
    sink = flashmsa.new_kl_sink(device)

    def step(q, k, v, q_proxy, k_proxy):
        out, kl = flashmsa.msa_attention(q, k, v, q_proxy, k_proxy, 256, kl_sink=sink)
        return out.float().square().mean() + 0.5 * kl

    with kernels_or_skip():
        step(*inputs).backward()
    expected_grads = [t.grad.clone() for t in inputs]
    expected_kl = sink.grad.clone()

    compiled_inputs = leaves(inputs)
    sink.grad = None
    compiled = torch.compile(step, fullgraph=True)
    compiled(*compiled_inputs).backward()
    torch.testing.assert_close(sink.grad, expected_kl)
    for actual, expected in zip(compiled_inputs, expected_grads):
        torch.testing.assert_close(actual.grad, expected)


@pytest.mark.parametrize("device", DEVICES)
def test_compile_module(device):
    head_dim = 16 if device == "cpu" else 128
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    model = flashmsa.MSAAttention(4 * head_dim, 4, 2, 2, 1, head_dim=head_dim, top_k=128,
                                  device=device, dtype=dtype)
    hidden = torch.randn(1, 300, 4 * head_dim, device=device, dtype=dtype)
    with kernels_or_skip():
        out, kl = model(hidden)
        (out.float().sum() + kl).backward()
    expected_kl = model.kl_value.clone()
    model.reset_kl()
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    out_compiled, kl = compiled(hidden)
    (out_compiled.float().sum() + kl).backward()
    torch.testing.assert_close(out_compiled, out)
    torch.testing.assert_close(model.kl_value, expected_kl)


def test_compiled_call_without_sink_resets_last_kl():
    """last_kl() never shows an older eager value after a compiled call that made no sink."""
    inputs = make_inputs((4, 2, 2, 1), 256, requires_grad=True)
    out, kl = flashmsa.msa_attention(*inputs, 256)
    (out.sum() + kl).backward()
    assert flashmsa.last_kl() is not None

    def step(*tensors):
        out, kl = flashmsa.msa_attention(*tensors, 256)
        return out.sum() + kl

    torch.compile(step, fullgraph=True, backend="aot_eager")(*leaves(inputs)).backward()
    assert flashmsa.last_kl() is None
