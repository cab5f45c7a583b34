"""flashmsa.MSAAttention and flashmsa.flash_msa_func on the CPU reference."""

import torch

import flashmsa
from flashmsa import eager

from conftest import make_inputs


def small_module(**kwargs):
    torch.manual_seed(0)
    options = dict(head_dim=16, top_k=128, dtype=torch.float64)
    options.update(kwargs)
    return flashmsa.MSAAttention(64, 4, 2, 2, 1, **options)


def test_flash_msa_func_matches_msa_attention_on_transposed_views():
    inputs = make_inputs((8, 2, 4, 1), 300, head_major=True, requires_grad=True)
    q, k, v, q_proxy, k_proxy = (t.transpose(1, 2) for t in inputs)  # the seed's [B, heads, S, D]
    out, kl = flashmsa.flash_msa_func(q_proxy, k_proxy, q, k, v, 256, 0.3)
    assert out.shape == (1, 300, 8 * 16) and kl.item() == 0.0
    (out.sum() + kl).backward()
    assert flashmsa.last_kl().item() > 0, "the true KL value, after the backward"
    expected, _ = flashmsa.msa_attention(*inputs, 256, softmax_scale=0.3, proxy_scale=0.3)
    assert torch.equal(out, expected.flatten(2))


def test_module_matches_eager_backend():
    model = small_module()
    reference = small_module(backend="eager")
    hidden = torch.randn(2, 300, 64, dtype=torch.float64)
    out, kl = model(hidden)
    expected_out, expected_kl = reference(hidden)
    torch.testing.assert_close(out, expected_out)
    (out.sum() + kl).backward()
    (expected_out.sum() + expected_kl).backward()
    torch.testing.assert_close(model.kl_value, reference.kl_value)
    for actual, wanted in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(actual.grad, wanted.grad)


def test_proxy_input_detached_by_default():
    hidden = torch.randn(1, 256, 64, dtype=torch.float64, requires_grad=True)
    model = small_module()
    _, kl = model(hidden)
    kl.backward()
    assert hidden.grad is None or hidden.grad.abs().max() == 0
    assert model.q_proxy_proj.weight.grad.abs().max() > 0

    hidden.grad = None
    attached = small_module(detach_proxy_input=False)
    _, kl = attached(hidden)
    kl.backward()
    assert hidden.grad.abs().max() > 0


def test_warmup_then_sparse():
    model = small_module(mode="warmup")
    hidden = torch.randn(1, 384, 64, dtype=torch.float64)
    dense, _ = model(hidden)
    model.set_mode("sparse")
    sparse, _ = model(hidden)
    assert not torch.allclose(dense, sparse), "with K = 1 of 3 blocks the outputs differ"


def test_rotary_applied_to_main_and_proxy():
    x = torch.randn(1, 10, 2, 8, dtype=torch.float64)
    positions = torch.arange(10)
    rotated = flashmsa.apply_rotary(x, positions)
    torch.testing.assert_close(rotated[:, 0], x[:, 0])  # position 0 is the identity
    torch.testing.assert_close(rotated.norm(dim=-1), x.norm(dim=-1))
    plain = small_module(rotary_base=None)
    rotary = small_module()
    hidden = torch.randn(1, 256, 64, dtype=torch.float64)
    assert not torch.allclose(plain(hidden)[0], rotary(hidden)[0])


def test_kl_value_accumulates_until_reset():
    model = small_module()
    hidden = torch.randn(1, 256, 64, dtype=torch.float64)
    for _ in range(2):
        model(hidden)[1].backward()
    twice = model.kl_value.clone()
    model.reset_kl()
    assert model.kl_value is None
    model(hidden)[1].backward()
    torch.testing.assert_close(twice, 2 * model.kl_value)


def test_select_blocks_for_recall():
    _, _, _, q_proxy, k_proxy = make_inputs((4, 2, 2, 1), 512)
    block_idx = flashmsa.select_blocks(q_proxy, k_proxy, 256)
    exact = eager.select_blocks(q_proxy, k_proxy, 2)
    recall = (block_idx[..., :, None] == exact[..., None, :]).any(-1).float().mean()
    assert recall == 1.0
