"""Hybrid decoders: Gated DeltaNet blocks mixed with attention blocks by a layer pattern, with
dense (models/gpt.py) or MoE (models/moe.py) feed-forward networks. Qwen3-Next's layout.

What: `model.layer_pattern` names each block's token mixer with one letter, read as Megatron's
hybrid patterns read:
    G   Gated DeltaNet (models/gated_deltanet.py), a linear-attention recurrence
    *   attention (models.gpt.Attention: RoPE, grouped-query, packed documents by the mask;
        with model.gated_attention, which the presets set, Qwen3-Next's GatedAttention: an
        output gate, q/k norms, RoPE on model.partial_rotary_factor of each head)
The pattern is repeated to num_layers blocks (its length must divide num_layers): "GGG*" with
8 layers is G G G * G G G *, Qwen3-Next's three GDN layers to one attention layer. The
feed-forward network of a block is dense, or MoE after the first `first_k_dense` blocks in the
MoE variant, exactly as in the non-hybrid models. MTP depths (cfg.mtp_depth) are attention
blocks, as Qwen3-Next's MTP layer is.

Packed documents: a GDN block is called with the batch's document_ids (GPT.block_inputs), its
recurrence and convolution restart at every document; attention blocks keep using the mask.

Parameter names: Llama's for attention and FFN (layers.N.attention.wq, ..., q_norm, k_norm),
Qwen3-Next's inside a GDN mixer (layers.N.linear_attention.in_proj_qkvz, conv1d, A_log,
dt_bias, norm, out_proj); models/hybrid_hf.py maps them onto Qwen3NextForCausalLM.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from models.fields import option
from models.gated_deltanet import GatedDeltaNet
from models.gpt import (
    GPT,
    PRESETS,
    Attention,
    AttnMask,
    GPTConfig,
    TransformerBlock,
    apply_rope,
    attend,
    derive,
)
from models.layers import RMSNorm
from models.moe import DEBUG_ROUTING, MoEBlock, MoEConfig, MoEGPT

GDN, ATTENTION = "G", "*"
MIXERS = (GDN, ATTENTION)


@dataclass(frozen=True)
class HybridConfig(GPTConfig):
    layer_pattern: str = option(
        "GGG*", "token mixer per block, repeated: G Gated DeltaNet, * attention"
    )
    linear_num_key_heads: int = option(2, "GDN query/key heads")
    linear_num_value_heads: int = option(4, "GDN value heads (a multiple of the key heads)")
    linear_key_head_dim: int = option(64, "GDN query/key head width")
    linear_value_head_dim: int = option(64, "GDN value head width")
    linear_conv_kernel: int = option(4, "width of GDN's causal depthwise convolution")
    linear_chunk_size: int = option(64, "positions per chunk of the chunked recurrence")
    gated_attention: bool = option(
        False,
        "Qwen3-Next's attention (GatedAttention): an output gate and RMSNorm on q and k per head",
    )
    partial_rotary_factor: float = option(
        1.0, "the fraction of each head RoPE rotates (Qwen3-Next 0.25)"
    )

    @property
    def rope_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)  # transformers' rounding

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0 < self.partial_rotary_factor <= 1 or self.rope_dim < 2 or self.rope_dim % 2:
            raise ValueError(
                f"model.partial_rotary_factor={self.partial_rotary_factor} must be in (0, 1] "
                f"and rotate an even number >= 2 of head_dim={self.head_dim}'s dims "
                f"(it rotates {self.rope_dim})"
            )
        if self.partial_rotary_factor != 1 and not self.gated_attention:
            raise ValueError(
                f"model.partial_rotary_factor={self.partial_rotary_factor} needs "
                "model.gated_attention=true (the plain attention rotates whole heads)"
            )
        for name in (
            "linear_num_key_heads",
            "linear_num_value_heads",
            "linear_key_head_dim",
            "linear_value_head_dim",
            "linear_conv_kernel",
            "linear_chunk_size",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"model.{name} must be >= 1, got {getattr(self, name)}")
        if self.linear_num_value_heads % self.linear_num_key_heads:
            raise ValueError(
                f"model.linear_num_value_heads={self.linear_num_value_heads} is not a multiple "
                f"of model.linear_num_key_heads={self.linear_num_key_heads}"
            )
        bad = sorted(set(self.layer_pattern) - set(MIXERS))
        if not self.layer_pattern or bad:
            raise ValueError(
                f"model.layer_pattern={self.layer_pattern!r} must be a non-empty string of "
                f"{' and '.join(repr(m) for m in MIXERS)} (Gated DeltaNet, attention)"
                + (f"; unknown letters {bad}" if bad else "")
            )
        if self.num_layers % len(self.layer_pattern):
            raise ValueError(
                f"model.layer_pattern={self.layer_pattern!r} (length {len(self.layer_pattern)}) "
                f"does not repeat to model.num_layers={self.num_layers}: its length must "
                "divide num_layers"
            )

    def mixer(self, layer_id: int) -> str:
        """The token mixer letter of block layer_id."""
        return self.layer_pattern[layer_id % len(self.layer_pattern)]


@dataclass(frozen=True)
class HybridMoEConfig(MoEConfig, HybridConfig):
    """A hybrid with MoE feed-forward networks after the first first_k_dense blocks."""


# Qwen3-Next's layout, which the hybrid presets keep: three GDN blocks to one attention block,
# its attention (so they export to it, models/hybrid_hf.py).
_QWEN3_NEXT_LAYOUT = {
    "layer_pattern": "GGG*",
    "gated_attention": True,
    "partial_rotary_factor": 0.25,
}
# For fast tests: `debug` with 4 blocks, 3 GDN blocks and 1 attention block, GVA (4 value heads
# on 2 key heads).
_HYBRID_DEBUG = derive(
    PRESETS["debug"],
    HybridConfig,
    num_layers=4,
    **_QWEN3_NEXT_LAYOUT,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
)

HYBRID_PRESETS: dict[str, HybridConfig] = {
    "hybrid-debug": _HYBRID_DEBUG,
    # moe-debug's routing with the pattern: block 0 GDN + dense FFN, 1-2 GDN + MoE, 3 attention
    # + MoE.
    "hybrid-moe-debug": derive(_HYBRID_DEBUG, HybridMoEConfig, **DEBUG_ROUTING),
    # A ~1B hybrid for one GPU (999,297,920 parameters, tests/models/test_hybrid.py): 12 GDN
    # blocks with Qwen3-Next's head shapes halved in count (8 key heads, 16 value heads of 128)
    # and 4 Qwen3-Next attention blocks, SwiGLU 6144; vocabulary 32768 so the head does not
    # dominate.
    "hybrid-1b": HybridConfig(
        vocab_size=32768,
        dim=2048,
        num_layers=16,
        num_heads=16,
        num_kv_heads=4,
        ffn_dim=6144,
        max_seq_len=4096,
        rope_theta=500000.0,
        **_QWEN3_NEXT_LAYOUT,
        linear_num_key_heads=8,
        linear_num_value_heads=16,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
    ),
}


def apply_partial_rope(x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
    """RoPE on the first 2 * rope.shape[-2] dims of each head of x (B, T, H, D), the rest as it
    is (Qwen3-Next's partial rotary embedding; rope_cache built for that width)."""
    d = 2 * rope.shape[-2]
    if d == x.shape[-1]:
        return apply_rope(x, rope)
    return torch.cat([apply_rope(x[..., :d], rope), x[..., d:]], dim=-1)


class GatedAttention(Attention):
    """Qwen3-Next's attention (Qwen3NextAttention): q/k RMSNorm per head before the (partial)
    RoPE, grouped-query attention, and the output gated per element by sigmoid of a second
    projection. wq's rows are Qwen3-Next's q_proj: per head its query, then its gate (2 x
    head_dim), so tensor parallelism splits wq by heads as it splits Attention's."""

    query_parts = 2

    def __init__(self, cfg: HybridConfig) -> None:
        super().__init__(cfg)
        # One weight (head_dim) shared by the heads. Qwen3-Next stores it zero-centred (it
        # multiplies by 1 + w): the export subtracts one.
        self.q_norm = RMSNorm(cfg.head_dim, cfg.norm_eps)
        self.k_norm = RMSNorm(cfg.head_dim, cfg.norm_eps)

    def forward(self, x: torch.Tensor, rope: torch.Tensor, attn_mask: AttnMask) -> torch.Tensor:
        B, T, _ = x.shape
        hd = self.head_dim
        # -1 heads: under tensor parallelism each rank holds a slice of the heads.
        q, gate = self.wq(x).view(B, T, -1, 2 * hd).chunk(2, dim=-1)  # (B, T, H, D) each
        q = self.q_norm(q)
        k = self.k_norm(self.wk(x).view(B, T, -1, hd))  # (B, T, Hkv, D)
        v = self.wv(x).view(B, T, -1, hd)
        q, k = apply_partial_rope(q, rope), apply_partial_rope(k, rope)
        out = attend(q, k, v, attn_mask) * torch.sigmoid(gate.reshape(B, T, -1))
        return self.wo(out)

    def init_weights(self, std: float, out_std: float) -> None:
        super().init_weights(std, out_std)
        self.q_norm.init_weights()
        self.k_norm.init_weights()


def build_gated_deltanet(cfg: HybridConfig) -> GatedDeltaNet:
    return GatedDeltaNet(
        cfg.dim,
        cfg.linear_num_key_heads,
        cfg.linear_num_value_heads,
        cfg.linear_key_head_dim,
        cfg.linear_value_head_dim,
        cfg.linear_conv_kernel,
        cfg.norm_eps,
        cfg.linear_chunk_size,
    )


class GatedDeltaNetBlock(TransformerBlock):
    """A block whose token mixer is Gated DeltaNet (`linear_attention`) instead of attention,
    reading the documents (it takes rope and attn_mask too: the trunk's call signature); the
    norms and the feed-forward network as TransformerBlock's."""

    reads_documents = True

    def build_mixer(self, cfg: HybridConfig) -> None:
        self.linear_attention = build_gated_deltanet(cfg)

    @property
    def mixer(self) -> nn.Module:
        return self.linear_attention


class GatedDeltaNetMoEBlock(GatedDeltaNetBlock, MoEBlock):
    """Gated DeltaNet mixer, MoE feed-forward network (`moe`, found by MoEGPT.routers)."""


def build_hybrid_block(cfg: HybridConfig, mixer: str, moe: bool) -> TransformerBlock:
    """A block with token mixer `mixer` and an MoE (`moe`) or dense FFN."""
    if mixer == GDN:
        return (GatedDeltaNetMoEBlock if moe else GatedDeltaNetBlock)(cfg)
    block = (MoEBlock if moe else TransformerBlock)(cfg)
    if cfg.gated_attention:
        # Swapped in place of the block's Attention (same name and position, so the same
        # parameter order, and models/gpt.py stays as it is); it has no values yet.
        block.attention = GatedAttention(cfg)
    return block


class HybridGPT(GPT):
    """GPT whose blocks follow cfg.layer_pattern; same forward contract."""

    cfg: HybridConfig

    def build_block(self, layer_id: int) -> nn.Module:
        return build_hybrid_block(self.cfg, self.cfg.mixer(layer_id), self.is_moe_layer(layer_id))

    def build_mtp_block(self) -> nn.Module:
        # An attention block (Qwen3-Next's MTP layer), of the last layer's FFN kind.
        last = self.cfg.num_layers - 1
        return build_hybrid_block(self.cfg, ATTENTION, self.is_moe_layer(last))


class HybridMoEGPT(HybridGPT, MoEGPT):
    """HybridGPT with MoE feed-forward networks after the first cfg.first_k_dense blocks
    (MoEGPT.is_moe_layer)."""

    cfg: HybridMoEConfig


def build_hybrid(cfg: HybridConfig) -> HybridGPT:
    return HybridMoEGPT(cfg) if isinstance(cfg, MoEConfig) else HybridGPT(cfg)
