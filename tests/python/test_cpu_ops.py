"""The CPU implementations of the ops (the fp64 reference through the binding) against the eager
PyTorch model (flashmsa.eager) and against each other. No GPU needed."""

import pytest
import torch

import flashmsa
from flashmsa import eager

from conftest import SMALL_CONFIGS, leaves, make_inputs, relative_error

SEQLENS = [100, 256, 300]  # one block partial, two full blocks, a partial last block


def gradients(loss_fn, tensors):
    for tensor in tensors:
        tensor.grad = None
    loss_fn().backward()
    return [tensor.grad.clone() for tensor in tensors]


@pytest.mark.parametrize("config", SMALL_CONFIGS)
@pytest.mark.parametrize("seqlen", SEQLENS)
@pytest.mark.parametrize("top_k", [128, 256, 512])
def test_select_matches_eager(config, seqlen, top_k):
    _, _, _, q_proxy, k_proxy = make_inputs(SMALL_CONFIGS[config], seqlen, batch=2)
    block_idx = flashmsa.select_blocks(q_proxy, k_proxy, top_k)
    assert block_idx.dtype == torch.int32
    assert block_idx.shape == (2, q_proxy.shape[2], seqlen, top_k // 128)
    assert torch.equal(block_idx, eager.select_blocks(q_proxy, k_proxy, top_k // 128))


def test_select_properties():
    _, _, _, q_proxy, k_proxy = make_inputs(SMALL_CONFIGS["gqa"], 700)
    block_idx = flashmsa.select_blocks(q_proxy, k_proxy, 384).long()
    rows = torch.arange(700)
    local = rows // 128
    assert torch.equal(block_idx[..., 0], local.expand_as(block_idx[..., 0])), "local block first"
    visible = torch.minimum(local + 1, torch.tensor(3))
    assert torch.equal((block_idx >= 0).sum(-1), visible.expand_as(block_idx[..., 0]))
    assert ((block_idx <= local[:, None]) | (block_idx == -1)).all(), "no future block"


@pytest.mark.parametrize("config", SMALL_CONFIGS)
@pytest.mark.parametrize("seqlen", SEQLENS)
@pytest.mark.parametrize("mode", ["sparse", "warmup"])
def test_forward_backward_match_eager(config, seqlen, mode):
    inputs = make_inputs(SMALL_CONFIGS[config], seqlen, requires_grad=True)
    dout = torch.randn(inputs[0].shape, dtype=torch.float64)
    kl_weight = 0.7

    out, kl = flashmsa.msa_attention(*inputs, 256, mode=mode)
    assert kl.item() == 0.0, "the forward's kl is the 0-valued placeholder"
    expected_out, expected_kl = eager.msa_attention(*inputs, 256, mode=mode)
    torch.testing.assert_close(out, expected_out, rtol=1e-10, atol=1e-10)

    grads = gradients(lambda: (flashmsa.msa_attention(*inputs, 256, mode=mode)[0] * dout).sum()
                      + kl_weight * flashmsa.msa_attention(*inputs, 256, mode=mode)[1], inputs)
    torch.testing.assert_close(flashmsa.last_kl(), expected_kl.double().float(), rtol=1e-6, atol=1e-7)
    expected = gradients(lambda: (expected_out * dout).sum() + kl_weight * expected_kl, inputs)
    for name, actual, wanted in zip(("dq", "dk", "dv", "dq_proxy", "dk_proxy"), grads, expected):
        torch.testing.assert_close(actual, wanted, rtol=1e-9, atol=1e-12, msg=name)


def test_many_heads_per_proxy_head():
    """H/Hp = 256 is valid (SPEC.md) though no GPU schedule holds it: the CPU ops run it (sizing the
    GPU workspaces for it once divided by zero and killed the process)."""
    inputs = make_inputs((256, 1, 1, 1), 200, requires_grad=True)
    out, _ = flashmsa.msa_attention(*inputs, 256)
    expected, _ = eager.msa_attention(*inputs, 256)
    torch.testing.assert_close(out, expected, rtol=1e-10, atol=1e-10)


def test_kl_gradient_reaches_only_proxies():
    inputs = make_inputs(SMALL_CONFIGS["gqa"], 256, requires_grad=True)
    _, kl = flashmsa.msa_attention(*inputs, 128)
    kl.backward()
    q, k, v, q_proxy, k_proxy = inputs
    for tensor in (q, k, v):
        assert tensor.grad.abs().max() == 0
    assert q_proxy.grad.abs().max() > 0 and k_proxy.grad.abs().max() > 0


def test_kl_gradient_scales_with_upstream_gradient():
    inputs = make_inputs(SMALL_CONFIGS["gqa"], 256, requires_grad=True)
    once = gradients(lambda: flashmsa.msa_attention(*inputs, 128)[1], inputs)[3]
    thrice = gradients(lambda: 3.0 * flashmsa.msa_attention(*inputs, 128)[1], inputs)[3]
    torch.testing.assert_close(thrice, 3.0 * once)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_dtypes(dtype):
    inputs = make_inputs(SMALL_CONFIGS["gqa"], 256, dtype=dtype, requires_grad=True)
    out, kl = flashmsa.msa_attention(*inputs, 256)
    assert out.dtype == dtype and kl.dtype == torch.float32
    (out.float().square().sum() + kl).backward()
    assert all(t.grad.dtype == dtype for t in inputs)
    wide = [t.detach().double() for t in inputs]
    expected, _ = eager.msa_attention(*wide, 256)
    assert relative_error(out, expected) < (1e-6 if dtype == torch.float32 else 1e-2)


def test_head_major_views_match_token_major():
    token_major = make_inputs(SMALL_CONFIGS["specialized"], 300, seed=3)
    head_major = make_inputs(SMALL_CONFIGS["specialized"], 300, seed=3, head_major=True)
    assert not head_major[0].is_contiguous()
    for a, b in zip(token_major, head_major):
        assert torch.equal(a, b)
    out_a, _ = flashmsa.msa_attention(*token_major, 256)
    out_b, _ = flashmsa.msa_attention(*head_major, 256)
    assert torch.equal(out_a, out_b)


def test_packed_qkv_views():
    batch, seqlen, heads, kv_heads, dim = 1, 256, 4, 2, 16
    qkv = torch.randn(batch, seqlen, heads + 2 * kv_heads, dim, dtype=torch.float64, requires_grad=True)
    q, k, v = qkv.split([heads, kv_heads, kv_heads], dim=2)
    _, _, _, q_proxy, k_proxy = make_inputs((heads, kv_heads, 2, 1), seqlen)
    out, _ = flashmsa.msa_attention(q, k, v, q_proxy, k_proxy, 128)
    expected, _ = eager.msa_attention(q, k, v, q_proxy, k_proxy, 128)
    torch.testing.assert_close(out, expected)
    out.sum().backward()
    assert qkv.grad.shape == qkv.shape


def test_sparse_with_all_blocks_equals_warmup():
    inputs = make_inputs(SMALL_CONFIGS["gqa"], 300)
    sparse, _ = flashmsa.msa_attention(*inputs, 384)  # K = 3 = all blocks
    dense, _ = flashmsa.msa_attention(*inputs, 384, mode="warmup")
    torch.testing.assert_close(sparse, dense)


def test_scales():
    inputs = make_inputs(SMALL_CONFIGS["gqa"], 256)
    out, _ = flashmsa.msa_attention(*inputs, 128, softmax_scale=0.5, proxy_scale=0.3)
    expected, _ = eager.msa_attention(*inputs, 128, softmax_scale=0.5, proxy_scale=0.3)
    torch.testing.assert_close(out, expected)
    default, _ = flashmsa.msa_attention(*inputs, 128, softmax_scale=16 ** -0.5)
    torch.testing.assert_close(default, flashmsa.msa_attention(*inputs, 128)[0])


def test_raw_ops_against_each_other():
    """select -> forward -> backward by hand equals msa_attention's autograd."""
    inputs = make_inputs(SMALL_CONFIGS["specialized"], 256, requires_grad=True)
    dout = torch.randn(inputs[0].shape, dtype=torch.float64)
    block_idx = flashmsa.ops.select(inputs[3].detach(), inputs[4].detach(), 1, 0.0)
    detached = [t.detach() for t in inputs]
    out, lse, proxy_lse, kl = flashmsa.ops.forward(*detached, block_idx, 1)
    assert lse.shape == (1, 8, 256) and proxy_lse.shape == (1, 4, 256) and kl.shape == ()
    *grads, kl_value = flashmsa.ops.backward(dout, torch.tensor(1.0), *detached, block_idx, out, lse,
                                             proxy_lse, 1)
    sink = flashmsa.new_kl_sink()
    auto_out, auto_kl = flashmsa.msa_attention(*inputs, 128, kl_sink=sink)
    ((auto_out * dout).sum() + auto_kl).backward()
    assert torch.equal(out, auto_out)
    torch.testing.assert_close(sink.grad, kl_value)
    for actual, tensor in zip(grads, inputs):
        torch.testing.assert_close(actual, tensor.grad)


def test_kl_sink_accumulates():
    inputs = make_inputs(SMALL_CONFIGS["gqa"], 256, requires_grad=True)
    sink = flashmsa.new_kl_sink()
    for _ in range(2):
        _, kl = flashmsa.msa_attention(*inputs, 128, kl_sink=sink)
        kl.backward()
    _, expected = eager.msa_attention(*inputs, 128)
    torch.testing.assert_close(sink.grad, 2 * expected.float(), rtol=1e-6, atol=1e-7)


def test_return_kl_false():
    inputs = make_inputs(SMALL_CONFIGS["gqa"], 256, requires_grad=True)
    out = flashmsa.msa_attention(*inputs, 128, return_kl=False)
    out.sum().backward()
    assert inputs[3].grad.abs().max() == 0


def test_evaluation_records_nothing():
    """No input requires grad and no sink: out does not require grad (as with SDPA), and last_kl()
    keeps the value of the last call that recorded autograd."""
    trained = make_inputs(SMALL_CONFIGS["gqa"], 256, requires_grad=True)
    out, kl = flashmsa.msa_attention(*trained, 256)
    (out.sum() + kl).backward()
    before = flashmsa.last_kl()
    assert before is not None
    out, kl = flashmsa.msa_attention(*make_inputs(SMALL_CONFIGS["gqa"], 256, seed=1), 256)
    assert not out.requires_grad and not kl.requires_grad
    assert flashmsa.last_kl() is before


def test_top_k_may_be_a_numpy_integer():
    numpy = pytest.importorskip("numpy")
    inputs = make_inputs(SMALL_CONFIGS["gqa"], 256)
    expected, _ = flashmsa.msa_attention(*inputs, 256)
    out, _ = flashmsa.msa_attention(*inputs, numpy.int64(256))
    assert torch.equal(out, expected)


def test_second_order_gradient_raises():
    """The backward op has no derivative: asking for one raises instead of returning zeros."""
    inputs = make_inputs(SMALL_CONFIGS["gqa"], 256, requires_grad=True)
    out, _ = flashmsa.msa_attention(*inputs, 256)
    (dq,) = torch.autograd.grad(out.sum(), inputs[0], create_graph=True)
    with pytest.raises(RuntimeError, match="flashmsa::backward"):
        dq.sum().backward()


def test_leaves_are_untouched():
    inputs = make_inputs(SMALL_CONFIGS["gqa"], 256)
    copies = [t.clone() for t in inputs]
    flashmsa.msa_attention(*leaves(inputs), 256)
    for before, after in zip(copies, inputs):
        assert torch.equal(before, after)
