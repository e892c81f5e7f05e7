import math
import re

import pytest
import torch
import torch.nn.functional as F
from conftest import poisoned_model

from graphtrain.attention import document_causal_mask
from models.gpt import GPT, PRESETS, GPTConfig, apply_rope, rope_cache

SMALL = GPTConfig(
    vocab_size=97, dim=48, num_layers=2, num_heads=6, num_kv_heads=2, ffn_dim=72, max_seq_len=64
)


@pytest.mark.parametrize("tie", [False, True])
def test_every_parameter_and_buffer_is_initialized(tie):
    model = poisoned_model(GPTConfig(**{**SMALL.__dict__, "tie_embeddings": tie}))
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        assert torch.isfinite(t).all(), f"{name} not initialized"
    if tie:
        assert model.output.weight is model.tok_embeddings.weight


def test_init_is_seeded():
    a, b, c = (
        poisoned_model(SMALL, seed=1),
        poisoned_model(SMALL, seed=1),
        poisoned_model(SMALL, seed=2),
    )
    for (n, pa), pb, pc in zip(a.named_parameters(), b.parameters(), c.parameters(), strict=True):
        assert torch.equal(pa, pb), n
        if pa.ndim > 1:
            assert not torch.equal(pa, pc), n


def test_1b_preset_is_the_benchmark_shape():
    cfg = PRESETS["1b"]
    assert (
        cfg.dim,
        cfg.num_layers,
        cfg.num_heads,
        cfg.num_kv_heads,
        cfg.ffn_dim,
        cfg.vocab_size,
    ) == (
        2048,
        16,
        16,
        8,
        8192,
        128256,
    )
    with torch.device("meta"):
        n = sum(p.numel() for p in GPT(cfg).parameters())
    assert 1.5e9 < n < 1.55e9  # "dense 1.5B" of MISSION.md


def test_3b_preset_is_the_fp8_benchmark_shape():
    # MISSION.md's "dense ~3B (dim 4096)" for benchmarks/e2e.py --fp8, on one GPU.
    cfg = PRESETS["3b"]
    assert (cfg.dim, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.ffn_dim) == (
        4096,
        10,
        32,
        8,
        14336,
    )
    with torch.device("meta"):
        n = sum(p.numel() for p in GPT(cfg).parameters())
    assert n == 3_231_797_248  # the count in the preset's comment


def test_config_errors_name_values():
    with pytest.raises(
        ValueError, match=re.escape("model.dim=50 is not divisible by model.num_heads=4")
    ):
        GPTConfig(dim=50, num_heads=4)
    with pytest.raises(ValueError, match=re.escape("model.num_layers must be >= 1, got 0")):
        GPTConfig(num_layers=0)


def test_rope_depends_only_on_relative_position():
    torch.manual_seed(0)
    D = 16
    cache = rope_cache(D, 64, 10000.0)
    q, k = torch.randn(1, 1, 1, D), torch.randn(1, 1, 1, D)

    def score(m, n):
        qm = apply_rope(q, cache[torch.tensor([[m]])])
        kn = apply_rope(k, cache[torch.tensor([[n]])])
        return (qm * kn).sum()

    torch.testing.assert_close(score(10, 3), score(30, 23))
    torch.testing.assert_close(score(5, 5), (q * k).sum())  # equal positions: rotation cancels
    assert not torch.allclose(score(10, 3), score(10, 4))


def test_gqa_matches_repeated_kv_heads():
    """Grouped-query attention equals full attention with each kv head repeated."""
    model = poisoned_model(SMALL)
    full_cfg = GPTConfig(**{**SMALL.__dict__, "num_kv_heads": SMALL.num_heads})
    full = poisoned_model(full_cfg)
    full.load_state_dict(
        {
            k: (
                v.view(SMALL.num_kv_heads, -1, SMALL.dim)
                .repeat_interleave(3, 0)
                .reshape(-1, SMALL.dim)
                if k.endswith(("wk.weight", "wv.weight"))
                else v
            )
            for k, v in model.state_dict().items()
        }
    )
    x = torch.randint(0, SMALL.vocab_size, (2, 20))
    torch.testing.assert_close(model(x), full(x))


def test_packed_documents_equal_separate_documents():
    """A row holding two documents gives each the output it gets alone: no attention across the
    boundary, positions restart."""
    model = poisoned_model(SMALL)
    torch.manual_seed(1)
    a, b = torch.randint(0, SMALL.vocab_size, (1, 11)), torch.randint(0, SMALL.vocab_size, (1, 9))
    packed = torch.cat([a, b], dim=1)
    doc = torch.cat([torch.zeros(1, 11), torch.ones(1, 9)], dim=1).int()
    pos = torch.cat([torch.arange(11), torch.arange(9)]).unsqueeze(0)
    out = model(packed, position_ids=pos, attn_mask=document_causal_mask(doc))
    torch.testing.assert_close(out[:, :11], model(a))
    torch.testing.assert_close(out[:, 11:], model(b))


@torch.no_grad()  # FlexAttention has no CPU backward: forward only here
def test_flex_mask_matches_sdpa_mask_forward():
    from graphtrain.attention import document_block_mask

    model = poisoned_model(SMALL)
    torch.manual_seed(2)
    x = torch.randint(0, SMALL.vocab_size, (2, 32))
    doc = torch.tensor([[0] * 7 + [1] * 20 + [2] * 5, [0] * 32]).int()
    dense = model(x, attn_mask=document_causal_mask(doc))
    torch.testing.assert_close(
        model(x, attn_mask=document_block_mask(doc)), dense, atol=1e-5, rtol=1e-5
    )


def test_loss_is_mean_cross_entropy_over_labelled_tokens():
    model = poisoned_model(SMALL)
    x = torch.randint(0, SMALL.vocab_size, (2, 10))
    y = torch.randint(0, SMALL.vocab_size, (2, 10))
    y[0, :4] = -100
    logits = model(x)
    expected = F.cross_entropy(logits.flatten(0, 1), y.flatten(), ignore_index=-100)
    torch.testing.assert_close(model(x, y), expected)
    # An untrained model is near uniform over the vocabulary.
    assert abs(model(x, y).item() - math.log(SMALL.vocab_size)) < 1.0
