"""Bad input raises ValueError/TypeError/RuntimeError naming the argument; never a crash. CPU
tensors go through the same validation as CUDA ones (src/api/validate.cpp behind the binding)."""

import pytest
import torch

import flashmsa

from conftest import make_inputs

HEADS = (4, 2, 2, 1)


def good():
    return make_inputs(HEADS, 256, dtype=torch.bfloat16)


def replace(index, tensor):
    inputs = good()
    inputs[index] = tensor
    return inputs


def call(inputs, top_k=256, **kwargs):
    return flashmsa.msa_attention(*inputs, top_k, **kwargs)


CASES = {
    # name: (callable, exception, text the message must contain)
    "top_k_not_multiple_of_128": (lambda: call(good(), 100), ValueError, "top_k"),
    "top_k_zero": (lambda: call(good(), 0), ValueError, "top_k"),
    "top_k_negative": (lambda: call(good(), -128), ValueError, "top_k"),
    "top_k_too_large": (lambda: call(good(), 128 * 65), ValueError, "top_k"),
    "top_k_float": (lambda: call(good(), 256.0), TypeError, "top_k"),
    "mode_unknown": (lambda: call(good(), mode="dense"), ValueError, "mode"),
    "softmax_scale_negative": (lambda: call(good(), softmax_scale=-1.0), ValueError, "softmax_scale"),
    "proxy_scale_nan": (lambda: call(good(), proxy_scale=float("nan")), ValueError, "proxy_scale"),
    "q_not_tensor": (lambda: call(replace(0, [1.0])), TypeError, "q"),
    "q_3d": (lambda: call(replace(0, torch.zeros(1, 256, 64, dtype=torch.bfloat16))), ValueError, "q"),
    "q_int_dtype": (lambda: call(replace(0, torch.zeros(1, 256, 4, 16, dtype=torch.int32))),
                    ValueError, "q: dtype"),
    "k_dtype_mismatch": (lambda: call(replace(1, torch.zeros(1, 256, 2, 16, dtype=torch.float16))),
                         ValueError, "k: dtype"),
    "v_shape_mismatch": (lambda: call(replace(2, torch.zeros(1, 256, 1, 16, dtype=torch.bfloat16))),
                         ValueError, "v: shape"),
    "k_seqlen_mismatch": (lambda: call(replace(1, torch.zeros(1, 200, 2, 16, dtype=torch.bfloat16))),
                          ValueError, "k: [batch, seqlen]"),
    "k_head_dim_mismatch": (lambda: call(replace(1, torch.zeros(1, 256, 2, 32, dtype=torch.bfloat16))),
                            ValueError, "k: head dim"),
    "k_proxy_dim_mismatch": (lambda: call(replace(4, torch.zeros(1, 256, 1, 32, dtype=torch.bfloat16))),
                             ValueError, "k_proxy: head dim"),
    "last_dim_strided": (lambda: call(replace(0, torch.zeros(1, 256, 4, 32, dtype=torch.bfloat16)[..., ::2])),
                         ValueError, "q: the last dim must be contiguous"),
    "seq_stride_misaligned": (lambda: call(replace(0, torch.zeros(1, 256, 4, 17, dtype=torch.bfloat16)[..., :16])),
                              ValueError, "q.stride("),
    "heads_not_divisible_by_kv": (lambda: call(make_inputs((6, 4, 2, 1), 256, dtype=torch.bfloat16)),
                                  ValueError, "q.size(2) (num_heads)"),
    "heads_not_divisible_by_proxy": (lambda: call(make_inputs((4, 2, 3, 1), 256, dtype=torch.bfloat16)),
                                     ValueError, "num_heads"),
    "proxy_heads_not_divisible_by_proxy_kv": (lambda: call(make_inputs((4, 2, 2, 3), 256, dtype=torch.bfloat16)),
                                              ValueError, "q_proxy.size(2) (num_proxy_heads)"),
    "proxy_group_across_kv_groups": (lambda: call(make_inputs((4, 4, 2, 1), 256, dtype=torch.bfloat16)),
                                     ValueError, "Hp % Hkv"),
    "empty_sequence": (lambda: call(make_inputs(HEADS, 0, dtype=torch.bfloat16)), ValueError, "seqlen"),
    "kl_sink_without_grad": (lambda: call(good(), kl_sink=torch.zeros(())), ValueError, "kl_sink"),
    "kl_sink_wrong_dtype": (lambda: call(good(), kl_sink=torch.zeros((), dtype=torch.float64, requires_grad=True)),
                            ValueError, "kl_sink"),
    "select_top_k_tokens": (lambda: flashmsa.select_blocks(*good()[3:], 64), ValueError, "top_k"),
    "flash_msa_func_3d": (lambda: flashmsa.flash_msa_func(*good()[3:], torch.zeros(4, 256, 16), *good()[1:3], 256, 0.25),
                          ValueError, "q"),
    "raw_forward_block_idx_missing": (lambda: flashmsa.ops.forward(*good(), None, 2),
                                      ValueError, "block_idx"),
    "raw_forward_block_idx_dtype": (lambda: flashmsa.ops.forward(*good(), torch.zeros(1, 2, 256, 2), 2),
                                    ValueError, "block_idx: dtype"),
    "raw_forward_block_idx_shape": (lambda: flashmsa.ops.forward(*good(), torch.zeros(1, 2, 256, 3, dtype=torch.int32), 2),
                                    ValueError, "block_idx: shape"),
    "raw_forward_block_idx_out_of_range": (lambda: flashmsa.ops.forward(*good(), torch.full((1, 2, 256, 2), 7, dtype=torch.int32), 2),
                                           ValueError, "block_idx"),
    "raw_forward_top_k_blocks": (lambda: flashmsa.ops.forward(*good(), None, 0, "warmup"),
                                 ValueError, "top_k (blocks)"),
    "raw_forward_mode": (lambda: flashmsa.ops.forward(*good(), None, 2, "dense"), ValueError, "mode"),
    "raw_select_k_proxy_batch": (lambda: flashmsa.ops.select(good()[3], torch.zeros(2, 256, 1, 16, dtype=torch.bfloat16), 2),
                                 ValueError, "k_proxy"),
    "module_top_k": (lambda: flashmsa.MSAAttention(64, 4, 2, 2, head_dim=16, top_k=100), ValueError, "top_k"),
    "module_mode": (lambda: flashmsa.MSAAttention(64, 4, 2, 2, head_dim=16, top_k=128, mode="x"), ValueError, "mode"),
}


@pytest.mark.parametrize("name", CASES)
def test_bad_input(name):
    action, exception, text = CASES[name]
    with pytest.raises(exception) as error:
        action()
    assert text in str(error.value), str(error.value)


def test_raw_backward_bad_saved_outputs():
    inputs = good()
    block_idx = flashmsa.ops.select(inputs[3], inputs[4], 2)
    out, lse, proxy_lse, _ = flashmsa.ops.forward(*inputs, block_idx, 2)
    with pytest.raises(ValueError, match="lse: shape"):
        flashmsa.ops.backward(out, None, *inputs, block_idx, out, lse[:, :2], proxy_lse, 2)
    with pytest.raises(ValueError, match="dout: shape"):
        flashmsa.ops.backward(out[:, :10], None, *inputs, block_idx, out, lse, proxy_lse, 2)
    with pytest.raises(ValueError, match="kl_grad"):
        flashmsa.ops.backward(out, torch.ones(2), *inputs, block_idx, out, lse, proxy_lse, 2)


def test_cuda_and_cpu_mixed():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device to mix devices")
    inputs = good()
    inputs[1] = inputs[1].cuda()
    with pytest.raises(ValueError, match="k: must be on the device of q"):
        call(inputs)
