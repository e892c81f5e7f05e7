"""training_flops against torch's FlopCounterMode on a tiny Llama-like model, and by hand.

The model is written here (RMSNorm, RoPE, GQA attention through SDPA, SwiGLU, tied or untied
head) because the real one lives elsewhere. SDPA runs on the math backend so FlopCounterMode sees
its two batched matmuls and their backward matmuls; it computes the full T x T score matrix even
with a causal mask, so the check uses num_attention_pairs = B * T * T. (The fused CPU/flash SDPA
kernels are either not counted on CPU or counted with the backward's recompute of the scores,
which "model FLOPs" leave out.)
"""

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from graphtrain.metrics import (
    dense_causal_pairs,
    document_causal_pairs,
    model_training_flops,
    training_flops,
)


class RMSNorm(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight


def rope(x, pos):  # x: (B, H, T, D), rotate-half RoPE: elementwise only
    d = x.shape[-1]
    inv_freq = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
    angles = pos[:, None].float() * inv_freq[None, :]  # (T, D/2)
    cos, sin = angles.cos().repeat(1, 2), angles.sin().repeat(1, 2)
    x1, x2 = x[..., : d // 2], x[..., d // 2 :]
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


class Block(nn.Module):
    def __init__(self, dim, num_heads, num_kv_heads, ffn_dim):
        super().__init__()
        self.num_heads, self.num_kv_heads = num_heads, num_kv_heads
        self.head_dim = dim // num_heads
        self.attention_norm, self.ffn_norm = RMSNorm(dim), RMSNorm(dim)
        self.wq = nn.Linear(dim, num_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(dim, num_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(dim, num_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(num_heads * self.head_dim, dim, bias=False)
        self.w1 = nn.Linear(dim, ffn_dim, bias=False)
        self.w3 = nn.Linear(dim, ffn_dim, bias=False)
        self.w2 = nn.Linear(ffn_dim, dim, bias=False)

    def forward(self, x):
        B, T, _ = x.shape
        h = self.attention_norm(x)
        q = self.wq(h).view(B, T, self.num_heads, self.head_dim).transpose(1, 2)  # (B, H, T, D)
        k = self.wk(h).view(B, T, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = self.wv(h).view(B, T, self.num_kv_heads, self.head_dim).transpose(1, 2)
        pos = torch.arange(T)
        q, k = rope(q, pos), rope(k, pos)
        rep = self.num_heads // self.num_kv_heads
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)  # GQA
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.wo(attn.transpose(1, 2).reshape(B, T, -1))
        h = self.ffn_norm(x)
        return x + self.w2(F.silu(self.w1(h)) * self.w3(h))


class TinyLlama(nn.Module):
    def __init__(self, *, dim, num_layers, num_heads, num_kv_heads, ffn_dim, vocab_size, tied):
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab_size, dim)
        self.layers = nn.ModuleList(
            Block(dim, num_heads, num_kv_heads, ffn_dim) for _ in range(num_layers)
        )
        self.norm = RMSNorm(dim)
        self.output = nn.Linear(dim, vocab_size, bias=False)
        if tied:
            self.output.weight = self.tok_embeddings.weight

    def forward(self, tokens):
        x = self.tok_embeddings(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.output(self.norm(x))


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize(
    "shape",
    [
        dict(dim=32, num_layers=2, num_heads=4, num_kv_heads=2, ffn_dim=48, vocab_size=50),
        dict(dim=24, num_layers=1, num_heads=3, num_kv_heads=3, ffn_dim=40, vocab_size=37),
    ],
)
def test_matches_flop_counter(shape, tied):
    torch.manual_seed(0)
    B, T = 2, 7
    model = TinyLlama(**shape, tied=tied)
    tokens = torch.randint(0, shape["vocab_size"], (B, T))
    targets = torch.randint(0, shape["vocab_size"], (B, T))
    counter = FlopCounterMode(display=False)
    with sdpa_kernel(SDPBackend.MATH), counter:
        logits = model(tokens)
        F.cross_entropy(logits.flatten(0, 1), targets.flatten()).backward()
    expected = training_flops(**shape, num_tokens=B * T, num_attention_pairs=B * T * T)
    assert counter.get_total_flops() == expected


def test_worked_example_from_docstring():
    pairs = dense_causal_pairs(1, 4096)
    assert pairs == 8_390_656
    flops = training_flops(
        dim=2048,
        num_layers=16,
        num_heads=16,
        num_kv_heads=8,
        ffn_dim=8192,
        vocab_size=128256,
        num_tokens=4096,
        num_attention_pairs=pairs,
    )
    assert flops == 34_493_687_660_544


def test_by_hand_one_layer():
    # dim 4, 2 heads (head_dim 2), 1 kv head (kv_dim 2), ffn 6, vocab 10, 3 tokens, 6 pairs:
    # layer = 2*4*4 (wq) + 2*2*4*2 (wk, wv) + 2*4*4 (wo) + 3*2*4*6 (ffn) = 32+32+32+144 = 240
    # head = 2*4*10 = 80; attention per pair = 4 * 2 * 2 = 16
    # forward = 3 * (240 + 80) + 6 * 16 = 1056; training = 3168
    got = training_flops(
        dim=4,
        num_layers=1,
        num_heads=2,
        num_kv_heads=1,
        ffn_dim=6,
        vocab_size=10,
        num_tokens=3,
        num_attention_pairs=6,
    )
    assert got == 3168


def test_pairs():
    assert dense_causal_pairs(3, 4) == 3 * 10
    assert dense_causal_pairs(0, 4) == 0
    # A packed row of documents 3 + 1 + 4 tokens: 6 + 1 + 10 pairs, fewer than 8*9/2 = 36.
    assert document_causal_pairs([3, 1, 4]) == 17
    assert document_causal_pairs([8]) == dense_causal_pairs(1, 8)


def test_errors():
    kw = dict(
        dim=30,
        num_layers=1,
        num_heads=4,
        num_kv_heads=2,
        ffn_dim=8,
        vocab_size=10,
        num_tokens=1,
        num_attention_pairs=1,
    )
    with pytest.raises(ValueError, match=r"dim \(30\).*num_heads \(4\)"):
        training_flops(**kw)
    with pytest.raises(ValueError, match=r"num_heads \(4\).*num_kv_heads \(3\)"):
        training_flops(**(kw | dict(dim=32, num_kv_heads=3)))
    with pytest.raises(ValueError, match="num_layers must be positive, got 0"):
        training_flops(**(kw | dict(dim=32, num_layers=0)))


def test_moe_flops_count_the_active_experts_only():
    """One MoE layer, counted by hand: attention + router + shared + top_k routed experts."""
    from models import MoEConfig

    cfg = MoEConfig(
        vocab_size=64, dim=16, num_layers=1, num_heads=2, num_kv_heads=1, ffn_dim=32,
        max_seq_len=8, num_experts=8, top_k=2, num_shared_experts=1, moe_ffn_dim=8,
        first_k_dense=0, num_groups=1, topk_groups=1,
    )  # fmt: skip
    hd = 8
    attention = 2 * 16 * 2 * hd * 2 + 2 * 2 * 16 * 1 * hd  # wq, wo; wk, wv
    experts = (2 + 1) * 3 * 2 * 16 * 8 + 2 * 16 * 8  # routed top-2 + shared, router gate
    head = 2 * 16 * 64
    pairs = 10
    expected = 3 * (5 * (attention + experts + head) + pairs * 4 * hd * 2)
    assert model_training_flops(cfg, num_tokens=5, num_attention_pairs=pairs) == expected


@pytest.mark.parametrize("depth", [0, 2])
def test_mtp_flops_match_flop_counter_on_the_model(depth):
    """The real dense model with D MTP depths (its blocks, projections and shared head run by
    the loss) against FlopCounterMode; plain causal attention counted as its full T x T."""
    from models import GPTConfig, build_model

    cfg = GPTConfig(
        vocab_size=50, dim=32, num_layers=2, num_heads=4, num_kv_heads=2, ffn_dim=48,
        max_seq_len=16, mtp_depth=depth,
    )  # fmt: skip
    torch.manual_seed(0)
    model = build_model(cfg)
    model.init_weights(seed=0)
    B, T = 2, 7
    tokens = torch.randint(0, cfg.vocab_size, (B, T))
    counter = FlopCounterMode(display=False)
    with sdpa_kernel(SDPBackend.MATH), counter:
        model(tokens, tokens).backward()
    expected = model_training_flops(cfg, num_tokens=B * T, num_attention_pairs=B * T * T)
    assert counter.get_total_flops() == expected


def test_mtp_flops_of_moe_add_one_block_projection_and_head_per_depth():
    """An MoE model's MTP depth costs one more MoE block (the last layer's kind), eh_proj and
    the head, by hand."""
    from dataclasses import replace

    from models import MoEConfig

    cfg = MoEConfig(
        vocab_size=64, dim=16, num_layers=1, num_heads=2, num_kv_heads=1, ffn_dim=32,
        max_seq_len=8, num_experts=8, top_k=2, num_shared_experts=1, moe_ffn_dim=8,
        first_k_dense=0, num_groups=1, topk_groups=1,
    )  # fmt: skip
    hd, tokens, pairs = 8, 5, 10
    attention = 2 * 16 * 2 * hd * 2 + 2 * 2 * 16 * 1 * hd  # wq, wo; wk, wv
    experts = (2 + 1) * 3 * 2 * 16 * 8 + 2 * 16 * 8  # routed top-2 + shared, router gate
    mtp = 2 * 2 * 16 * 16 + 2 * 16 * 64  # eh_proj, head
    base = model_training_flops(cfg, num_tokens=tokens, num_attention_pairs=pairs)
    got = model_training_flops(
        replace(cfg, mtp_depth=2), num_tokens=tokens, num_attention_pairs=pairs
    )
    assert got - base == 3 * 2 * (tokens * (attention + experts + mtp) + pairs * 4 * hd * 2)


def test_hybrid_flops_by_hand_with_gated_attention_and_mtp():
    """A "G*" hybrid with Qwen3-Next's gated attention and one MTP depth, counted by hand:
    the gate projection (wq's second half) is counted in the trunk's and the MTP's attention
    blocks; the q/k norms are elementwise work, not counted."""
    from models.hybrid import HybridConfig

    cfg = HybridConfig(
        vocab_size=16, dim=8, num_layers=2, num_heads=2, num_kv_heads=1, ffn_dim=12,
        max_seq_len=8, mtp_depth=1, layer_pattern="G*", gated_attention=True,
        partial_rotary_factor=0.5, linear_num_key_heads=1, linear_num_value_heads=2,
        linear_key_head_dim=4, linear_value_head_dim=4, linear_chunk_size=4,
    )  # fmt: skip
    # Per token, forward. head_dim 4, key_dim 4, value_dim 8.
    # GDN mixer: in_proj_qkvz 2*8*24 = 384, in_proj_ba 2*8*4 = 64, out_proj 2*8*8 = 128,
    #   rule 2 heads * (4 * (5*4 + 3*4 + 2) + 6*4*4) = 464: 1040
    # gated attention: wq 2*8*16 = 256 (query and gate), wk + wv 2*2*8*4 = 128, wo 2*8*8 = 128: 512
    # FFN 3*2*8*12 = 576; head 2*8*16 = 256; MTP eh_proj 2*2*8*8 = 256
    # trunk (1040 + 576) + (512 + 576) + head 256 + MTP (512 + 576 + 256 + 256) = 4560
    # attention per pair 4*4*2 = 32, in the trunk's attention block and the MTP block
    tokens, pairs = 5, 9
    forward = tokens * 4560 + pairs * 32 * 2
    assert forward == 23_376
    assert model_training_flops(cfg, num_tokens=tokens, num_attention_pairs=pairs) == 3 * forward
