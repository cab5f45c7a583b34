"""flashmsa.block_recall (python/flashmsa/monitor.py) on the CPU reference: checked against a
row-by-row count written from its definition, on the eager model's selection."""

import pytest
import torch

import flashmsa
from flashmsa import eager

from conftest import SMALL_CONFIGS, make_inputs

BLOCK = flashmsa.BLOCK_SIZE


def recall_by_rows(q, k, q_proxy, k_proxy, blocks, rows, scale):
    """Per (b, p, i): teacher = mean over p's heads of the causal softmax, block masses, the teacher's
    top blocks sorted by (-mass, block), the eager selection; plain loops in fp64."""
    batch, seqlen, heads, _ = q.shape
    kv_heads, proxy_heads = k.shape[2], q_proxy.shape[2]
    per_proxy, group = heads // proxy_heads, heads // kv_heads
    selection = eager.select_blocks(q_proxy, k_proxy, blocks)
    hits, kept, count = 0.0, 0.0, 0
    for b in range(batch):
        for p in range(proxy_heads):
            for i in rows:
                teacher = torch.zeros(i + 1, dtype=torch.float64)
                for h in range(p * per_proxy, (p + 1) * per_proxy):
                    scores = scale * (k[b, : i + 1, h // group].double() @ q[b, i, h].double())
                    teacher += torch.softmax(scores, dim=0) / per_proxy
                visible = i // BLOCK + 1
                mass = [teacher[c * BLOCK: (c + 1) * BLOCK].sum().item() for c in range(visible)]
                wanted = min(blocks, visible)
                best = sorted(range(visible), key=lambda c: (-mass[c], c))[:wanted]
                chosen = [c for c in selection[b, p, i].tolist() if c >= 0]
                hits += len(set(chosen) & set(best)) / wanted
                kept += sum(mass[c] for c in chosen)
                count += 1
    return hits / count, kept / count


@pytest.mark.parametrize("config", ["gqa", "specialized"])
def test_matches_a_row_by_row_count(config):
    q, k, _, q_proxy, k_proxy = make_inputs(SMALL_CONFIGS[config], 640, batch=2, seed=3)
    rows = 9
    result = flashmsa.block_recall(q, k, q_proxy, k_proxy, 256, rows=rows)
    sampled = torch.linspace(0, 639, rows).round().long().unique().tolist()
    block_recall, score_recall = recall_by_rows(q, k, q_proxy, k_proxy, 2, sampled, 16 ** -0.5)
    assert result["block_recall"].dtype == torch.float32 and result["block_recall"].dim() == 0
    assert result["block_recall"].item() == pytest.approx(block_recall, abs=1e-6)
    assert result["score_recall"].item() == pytest.approx(score_recall, abs=1e-5)
    # Random proxies on 5 blocks keeping 2: neither trivially 1 nor 0.
    assert 0.0 < result["block_recall"].item() < 1.0
    assert 0.0 < result["score_recall"].item() < 1.0


def test_everything_kept_is_full_recall():
    q, k, _, q_proxy, k_proxy = make_inputs(SMALL_CONFIGS["gqa"], 384, seed=1)
    result = flashmsa.block_recall(q, k, q_proxy, k_proxy, 3 * BLOCK, rows=384)
    assert result["block_recall"].item() == pytest.approx(1.0, abs=1e-6)
    assert result["score_recall"].item() == pytest.approx(1.0, abs=1e-5)


def test_given_selection_is_measured():
    q, k, _, q_proxy, k_proxy = make_inputs(SMALL_CONFIGS["gqa"], 512, seed=2)
    own = flashmsa.select_blocks(q_proxy, k_proxy, BLOCK)   # K = 1: the query's own block only
    result = flashmsa.block_recall(q, k, q_proxy, k_proxy, BLOCK, rows=512, block_idx=own)
    sampled = list(range(512))
    expected = recall_by_rows(q, k, q_proxy, k_proxy, 1, sampled, 16 ** -0.5)
    assert result["block_recall"].item() == pytest.approx(expected[0], abs=1e-6)
    assert result["score_recall"].item() == pytest.approx(expected[1], abs=1e-5)


def test_bad_arguments_are_named():
    q, k, _, q_proxy, k_proxy = make_inputs(SMALL_CONFIGS["gqa"], 256)
    with pytest.raises(ValueError, match="rows"):
        flashmsa.block_recall(q, k, q_proxy, k_proxy, BLOCK, rows=0)
    with pytest.raises(ValueError, match="top_k"):
        flashmsa.block_recall(q, k, q_proxy, k_proxy, 100)
    with pytest.raises(ValueError, match="block_idx"):
        flashmsa.block_recall(q, k, q_proxy, k_proxy, BLOCK, block_idx=torch.zeros(1, 2, 256, 2, dtype=torch.int32))
    with pytest.raises(ValueError, match="k:"):
        flashmsa.block_recall(q, k[:, :128], q_proxy, k_proxy, BLOCK)
    with pytest.raises(TypeError, match="q_proxy"):
        flashmsa.block_recall(q, k, None, k_proxy, BLOCK)


def test_module_reports_recall_per_call_when_asked():
    torch.manual_seed(0)
    model = flashmsa.MSAAttention(64, 4, 2, 2, 1, head_dim=16, top_k=BLOCK, mode="warmup",
                                  dtype=torch.float64)
    hidden = torch.randn(1, 300, 64, dtype=torch.float64)
    model(hidden)
    assert model.last_recall is None, "off unless asked"
    model.recall_rows = 32
    out, kl = model(hidden)
    recall = model.last_recall
    assert set(recall) == {"block_recall", "score_recall"}
    assert 0.0 < recall["block_recall"].item() <= 1.0 and 0.0 < recall["score_recall"].item() <= 1.0
    assert not recall["block_recall"].requires_grad
    (out.sum() + kl).backward()  # the measurement leaves the autograd graph alone
