"""Flash-MSA's acceptance test, scaled down: the same small attention model trained for 10 SGD
steps with flashmsa and with the eager model (flashmsa.eager) from identical weights; every weight
must match within 1e-2 (atol and rtol). On an H100/H200 it runs the kernels in bf16 at head dim 128;
without one, the CPU reference in fp64 at head dim 16."""

import copy

import pytest
import torch

import flashmsa

from conftest import HEAD_CONFIGS, HOPPER, kernels_or_skip

STEPS = 10
LEARNING_RATE = 0.01


def rms_norm(x):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


def train(model, inputs, targets):
    optimizer = torch.optim.SGD(model.parameters(), lr=LEARNING_RATE)
    kl_values = []
    for step in range(STEPS):
        optimizer.zero_grad()
        model.reset_kl()
        out, kl = model(inputs[step])
        loss = torch.nn.functional.mse_loss(out.float(), targets[step].float()) + kl
        loss.backward()
        optimizer.step()
        kl_values.append(model.kl_value.item())
    return kl_values


@pytest.mark.parametrize("mode", ["sparse", "warmup"])
@pytest.mark.parametrize("config", HEAD_CONFIGS)
def test_ten_sgd_steps_match_eager(config, mode):
    heads, kv_heads, proxy_heads, proxy_kv_heads = HEAD_CONFIGS[config]
    if HOPPER:
        device, dtype, head_dim, seqlen, top_k = "cuda", torch.bfloat16, 128, 2048, 512
    else:
        device, dtype, head_dim, seqlen, top_k = "cpu", torch.float64, 16, 384, 256
    hidden = heads * head_dim
    torch.manual_seed(67)
    eager_model = flashmsa.MSAAttention(hidden, heads, kv_heads, proxy_heads, proxy_kv_heads,
                                        head_dim=head_dim, top_k=top_k, mode=mode,
                                        detach_proxy_input=False, backend="eager",
                                        device=device, dtype=dtype)
    model = copy.deepcopy(eager_model)
    model.backend = "flashmsa"
    generator = torch.Generator().manual_seed(1)
    inputs = [rms_norm(torch.randn(1, seqlen, hidden, generator=generator)).to(device, dtype)
              for _ in range(STEPS)]
    targets = [rms_norm(torch.randn(1, seqlen, hidden, generator=generator)).to(device, dtype)
               for _ in range(STEPS)]

    with kernels_or_skip():
        kl_values = train(model, inputs, targets)
    eager_kl_values = train(eager_model, inputs, targets)

    for (name, actual), expected in zip(model.named_parameters(), eager_model.parameters()):
        torch.testing.assert_close(actual, expected, atol=1e-2, rtol=1e-2, msg=name)
    torch.testing.assert_close(torch.tensor(kl_values), torch.tensor(eager_kl_values),
                               atol=1e-3, rtol=1e-2)
    assert kl_values[-1] > 0
