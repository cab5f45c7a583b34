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


def on_meta(inputs, index):
    inputs[index] = inputs[index].to("meta")
    return inputs


def selection(inputs=None):
    inputs = inputs or good()
    return flashmsa.ops.select(inputs[3], inputs[4], 2)


def raw_backward(replaced):
    """flashmsa.ops.backward on a good forward's tensors, those named in ``replaced`` swapped."""
    inputs = good()
    block_idx = selection(inputs)
    out, lse, proxy_lse, _ = flashmsa.ops.forward(*inputs, block_idx, 2)
    arguments = dict(dout=out, kl_grad=torch.ones(()), q=inputs[0], k=inputs[1], v=inputs[2],
                     q_proxy=inputs[3], k_proxy=inputs[4], block_idx=block_idx, out=out, lse=lse,
                     proxy_lse=proxy_lse)
    arguments.update({name: swap(arguments[name]) for name, swap in replaced.items()})
    return flashmsa.ops.backward(*arguments.values(), 2)


def recall(block_idx=None, heads=HEADS, seqlen=256):
    """flashmsa.block_recall of the good problem (or one of other heads or length), K = 2 blocks;
    ``block_idx`` edits the selection (a function of it) or replaces it."""
    q, k, _, q_proxy, k_proxy = make_inputs(heads, seqlen, dtype=torch.bfloat16)
    if callable(block_idx):
        block_idx = block_idx(flashmsa.select_blocks(q_proxy, k_proxy, 256))
    return flashmsa.block_recall(q, k, q_proxy, k_proxy, 256, block_idx=block_idx)


def edit(row, value):
    """A function setting block_idx[0, 1, row] = value (a list of K entries) in a copy."""
    def apply(block_idx):
        block_idx = block_idx.clone()
        block_idx[0, 1, row] = torch.tensor(value, dtype=block_idx.dtype)
        return block_idx
    return apply


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
                         ValueError, "k: dtype must match q (torch.bfloat16), got torch.float16"),
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
                                              ValueError, "q_proxy.size(2) (num_proxy_heads): must be divisible by "
                                              "num_proxy_kv_heads (Hp % Hpk == 0), got Hp=2, Hpk=3"),
    "head_dim_not_multiple_of_8": (lambda: call(make_inputs(HEADS, 256, head_dim=4, proxy_head_dim=16, dtype=torch.bfloat16)),
                                   ValueError, "q.size(3) (head_dim): must be a multiple of 8"),
    "proxy_head_dim_not_multiple_of_8": (lambda: call(make_inputs(HEADS, 256, proxy_head_dim=12, dtype=torch.float32)),
                                         ValueError, "q_proxy.size(3) (proxy_head_dim): must be a multiple of 8"),
    # The ops take the scales as double and the kernels as fp32: nothing may change in between.
    "softmax_scale_below_fp32": (lambda: call(good(), softmax_scale=1e-50), ValueError,
                                 "softmax_scale: must be 0 (the default) or within float32's normal range"),
    "proxy_scale_above_fp32": (lambda: flashmsa.select_blocks(*good()[3:], 256, proxy_scale=1e39), ValueError,
                               "proxy_scale: must be 0 (the default) or within float32's normal range"),
    "raw_select_top_k_negative": (lambda: flashmsa.ops.select(*good()[3:], -1), ValueError,
                                  "top_k (blocks): must be in [1, 64], got -1"),
    "raw_forward_top_k_negative": (lambda: flashmsa.ops.forward(*good(), selection(), -1), ValueError,
                                   "top_k (blocks): must be in [1, 64], got -1"),
    "proxy_group_across_kv_groups": (lambda: call(make_inputs((4, 4, 2, 1), 256, dtype=torch.bfloat16)),
                                     ValueError, "Hp % Hkv"),
    "empty_sequence": (lambda: call(make_inputs(HEADS, 0, dtype=torch.bfloat16)), ValueError, "seqlen"),
    "kl_sink_without_grad": (lambda: call(good(), kl_sink=torch.zeros(())), ValueError, "kl_sink"),
    "kl_sink_not_a_leaf": (lambda: call(good(), kl_sink=flashmsa.new_kl_sink() * 1.0), ValueError,
                           "kl_sink: must be a 0-d torch.float32 leaf tensor"),
    "kl_sink_with_return_kl_false": (lambda: call(good(), return_kl=False, kl_sink=flashmsa.new_kl_sink()),
                                     ValueError, "kl_sink: must be None with return_kl=False"),
    "head_major_without_transpose": (lambda: call([t.transpose(1, 2).contiguous() for t in good()]),
                                     ValueError, "pass a [batch, heads, seqlen, dim] one as .transpose(1, 2)"),
    "module_positions_batched": (lambda: flashmsa.MSAAttention(64, 4, 2, 2, head_dim=16, top_k=128)(
                                     torch.randn(2, 256, 64), positions=torch.zeros(2, 256, dtype=torch.long)),
                                 ValueError, "positions: must be [S] = [256]"),
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
    "softmax_scale_string": (lambda: call(good(), softmax_scale="0.5"), TypeError, "softmax_scale"),
    "proxy_scale_string": (lambda: flashmsa.select_blocks(*good()[3:], 256, proxy_scale="0.5"),
                           TypeError, "proxy_scale"),
    # A meta tensor among CPU ones dispatches to the fake implementations (python/flashmsa/_ops.py).
    "k_on_meta": (lambda: call(on_meta(good(), 1)), ValueError, "k: must be on the device of q (cpu), got meta"),
    "k_proxy_on_meta": (lambda: call(on_meta(good(), 4)), ValueError, "k_proxy: must be on the device of q"),
    "kl_sink_on_meta": (lambda: call(good(), kl_sink=flashmsa.new_kl_sink("meta")), ValueError, "kl_sink"),
    "raw_select_k_proxy_on_meta": (lambda: flashmsa.ops.select(good()[3], good()[4].to("meta"), 2),
                                   ValueError, "k_proxy: must be on the device of q_proxy"),
    "raw_forward_block_idx_on_meta": (lambda: flashmsa.ops.forward(*good(), selection().to("meta"), 2),
                                      ValueError, "block_idx: must be on the device of q"),
    "raw_forward_kl_sink_on_meta": (lambda: flashmsa.ops.forward(*good(), selection(), 2, "sparse", 0.0, 0.0,
                                                                 False, flashmsa.new_kl_sink("meta")),
                                    ValueError, "kl_sink: must be on the device of q"),
    "raw_backward_lse_on_meta": (lambda: raw_backward({"lse": lambda t: t.to("meta")}),
                                 ValueError, "lse: must be on the device of q"),
    "raw_backward_dout_on_meta": (lambda: raw_backward({"dout": lambda t: t.to("meta")}),
                                  ValueError, "dout: must be on the device of q"),
    "raw_backward_q_on_meta": (lambda: raw_backward({"q": lambda t: t.to("meta")}),
                               ValueError, "dout: must be on the device of q (meta), got cpu"),
    "recall_block_idx_float": (lambda: recall(lambda b: b.float()), ValueError, "block_idx: dtype"),
    "recall_block_idx_past_last_block": (lambda: recall(edit(200, [1, 2])), ValueError,
                                         "block_idx: entries must be -1 or a block in [0, 2)"),
    "recall_block_idx_below_minus_one": (lambda: recall(edit(200, [1, -5])), ValueError,
                                         "block_idx: entries must be -1 or a block in [0, 2)"),
    "recall_block_idx_empty_slot_first": (lambda: recall(edit(200, [-1, 1])), ValueError,
                                          "block_idx: -1 (no block) may only fill the slots after"),
    "recall_block_idx_repeated_block": (lambda: recall(edit(200, [1, 1])), ValueError,
                                        "block_idx: a row must not hold a block twice"),
    "recall_block_idx_on_meta": (lambda: recall(lambda b: b.to("meta")), ValueError,
                                 "block_idx: must be on the device of q"),
    "recall_block_idx_not_tensor": (lambda: recall([[0]]), TypeError, "block_idx"),
    "recall_no_kv_heads": (lambda: recall(torch.zeros(1, 2, 256, 2, dtype=torch.int32), heads=(4, 0, 2, 1)),
                           ValueError, "k.size(2) (num_kv_heads): must be >= 1"),
    "recall_no_proxy_heads": (lambda: recall(torch.zeros(1, 0, 256, 2, dtype=torch.int32), heads=(4, 2, 0, 1)),
                              ValueError, "q_proxy.size(2) (num_proxy_heads): must be >= 1"),
    "recall_proxy_heads_not_divisible": (lambda: recall(heads=(4, 2, 2, 3)), ValueError, "Hp % Hpk"),
    "recall_empty_sequence": (lambda: recall(torch.zeros(1, 2, 0, 2, dtype=torch.int32), seqlen=0),
                              ValueError, "q.size(1) (seqlen): must be >= 1"),
    "recall_proxy_scale_negative": (lambda: flashmsa.block_recall(*good()[:2], *good()[3:], 256, proxy_scale=-1.0,
                                                                  block_idx=selection()),
                                    ValueError, "proxy_scale"),
    "module_top_k": (lambda: flashmsa.MSAAttention(64, 4, 2, 2, head_dim=16, top_k=100), ValueError, "top_k"),
    "module_mode": (lambda: flashmsa.MSAAttention(64, 4, 2, 2, head_dim=16, top_k=128, mode="x"), ValueError, "mode"),
    "module_softmax_scale_negative": (lambda: flashmsa.MSAAttention(64, 4, 2, 2, head_dim=16, top_k=128, softmax_scale=-1),
                                      ValueError, "softmax_scale"),
    "module_proxy_scale_nan": (lambda: flashmsa.MSAAttention(64, 4, 2, 2, head_dim=16, top_k=128, proxy_scale=float("nan")),
                               ValueError, "proxy_scale"),
    "module_softmax_scale_string": (lambda: flashmsa.MSAAttention(64, 4, 2, 2, head_dim=16, softmax_scale="0.5"),
                                    TypeError, "softmax_scale"),
    "module_heads_not_divisible": (lambda: flashmsa.MSAAttention(64, 6, 4, 2, head_dim=16, top_k=128),
                                   ValueError, "num_heads: must be divisible by num_kv_heads"),
    "module_proxy_group_across_kv_groups": (lambda: flashmsa.MSAAttention(64, 4, 4, 2, head_dim=16, top_k=128),
                                            ValueError, "num_proxy_heads: must be divisible by num_kv_heads"),
    "module_no_proxy_heads": (lambda: flashmsa.MSAAttention(64, 4, 2, 0, head_dim=16, top_k=128),
                              ValueError, "num_proxy_heads: must be >= 1"),
    "module_proxy_head_dim_zero": (lambda: flashmsa.MSAAttention(64, 4, 2, 2, head_dim=16, proxy_head_dim=0),
                                   ValueError, "proxy_head_dim: must be >= 1"),
    "module_head_dim_not_multiple_of_8": (lambda: flashmsa.MSAAttention(64, 4, 2, 2, head_dim=12, top_k=128),
                                          ValueError, "head_dim: must be a multiple of 8 with backend='flashmsa'"),
    "module_odd_head_dim_with_rotary": (lambda: flashmsa.MSAAttention(64, 4, 2, 2, head_dim=15, top_k=128,
                                                                      backend="eager"),
                                        ValueError, "head_dim: must be even"),
    "module_recall_rows_negative": (lambda: flashmsa.MSAAttention(64, 4, 2, 2, head_dim=16, recall_rows=-1),
                                    ValueError, "recall_rows"),
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


def test_failed_call_keeps_last_kl():
    """SPEC.md §6, nothing is written on error: a call that raises leaves last_kl() as it was."""
    inputs = make_inputs(HEADS, 256, requires_grad=True)
    out, kl = call(inputs)
    (out.sum() + kl).backward()
    before = flashmsa.last_kl()
    assert before is not None and before.item() > 0
    value = before.clone()
    with pytest.raises(ValueError, match="q: dtype"):
        call(replace(0, torch.zeros(1, 256, 4, 16, dtype=torch.int32)))
    with pytest.raises(ValueError, match="k: must be on the device of q"):
        call(on_meta(good(), 1))
    assert flashmsa.last_kl() is before
    assert torch.equal(flashmsa.last_kl(), value)


def test_meta_tensors_alone_are_traced():
    """The fake implementations' device check leaves an all-meta call alone: shapes come back."""
    inputs = [t.to("meta") for t in good()]
    block_idx = flashmsa.ops.select(inputs[3], inputs[4], 2)
    assert block_idx.device.type == "meta" and block_idx.shape == (1, 2, 256, 2)
    out, lse, proxy_lse, kl = flashmsa.ops.forward(*inputs, block_idx, 2, "sparse", 0.0, 0.0, False,
                                                   flashmsa.new_kl_sink("meta"))
    assert all(t.device.type == "meta" for t in (out, lse, proxy_lse, kl))
    grads = flashmsa.ops.backward(out, kl, *inputs, block_idx, out, lse, proxy_lse, 2)
    assert [g.shape for g in grads[:5]] == [t.shape for t in inputs]


def test_recall_takes_int64_selection():
    q, k, _, q_proxy, k_proxy = good()
    block_idx = flashmsa.select_blocks(q_proxy, k_proxy, 256)
    assert (block_idx[:, :, :128, 1] == -1).all(), "rows of block 0 see one block: -1 in slot 1"
    expected = flashmsa.block_recall(q, k, q_proxy, k_proxy, 256, block_idx=block_idx)
    result = flashmsa.block_recall(q, k, q_proxy, k_proxy, 256, block_idx=block_idx.long())
    for name in expected:
        assert torch.equal(result[name], expected[name]), name


def test_cuda_and_cpu_mixed():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device to mix devices")
    inputs = good()
    inputs[1] = inputs[1].cuda()
    with pytest.raises(ValueError, match="k: must be on the device of q"):
        call(inputs)
