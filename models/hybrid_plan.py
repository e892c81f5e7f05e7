"""Tensor-parallel plan for models/hybrid.py: the dense or MoE plan (models/gpt_plan.py,
models/moe_plan.py) for attention blocks, FFNs, embedding and head, plus the Gated DeltaNet
mixers split by head, as attention is.

Qwen3-Next's attention (model.gated_attention) adds q_norm and k_norm, "replicate" (one
weight shared by the heads; gradients summed over tp); its wq, query and gate rows per head,
splits by heads with the dense plan's colwise.

The Gated DeltaNet mixers' layouts are GDN_TP_PLAN, each entry explained beside it. The
recurrence runs per value head on plain local tensors: no communication inside the mixer.
Needs linear_num_key_heads divisible by tp (graphtrain.parallel.mesh.validate_model_for_tp).
"""

from __future__ import annotations

from models.gpt_plan import mtp_tp_plan
from models.hybrid import ATTENTION, GDN, HybridConfig

# Over the tp axis of a GDN mixer, h a DTensor Shard(1):
GDN_TP_PLAN: dict[str, str] = {
    # all-gather x on T -> Replicate; document_ids (B, T) pass untouched; A_log and dt_bias (one
    # per value head) split with the heads
    "layers.*.linear_attention": "gather_sequence_split_rows",
    # rows grouped by key head: each rank gets Hk/tp key heads' q, k and their value heads' v, z
    "layers.*.linear_attention.in_proj_qkvz": "colwise",
    "layers.*.linear_attention.in_proj_ba": "colwise",  # grouped by key head the same way
    # channels grouped by key head (models/gated_deltanet.py): the same heads
    "layers.*.linear_attention.conv1d": "split_rows",
    # one weight (value_head_dim) shared by all heads: each rank's gradient is the sum over its
    # heads, summed over tp by reduce_partial_grads
    "layers.*.linear_attention.norm": "replicate",
    # split on value heads (its input dim); the partial outputs reduce-scattered onto T
    "layers.*.linear_attention.out_proj": "rowwise",
}


# Qwen3-Next's attention (models.hybrid.GatedAttention, model.gated_attention): wq holds each
# head's query and gate rows together, so the dense plan's colwise split keeps them on one
# rank; the q/k norms' weights (head_dim) are shared by the heads, as the GDN norm's.
GATED_ATTENTION_TP_PLAN: dict[str, str] = {
    "layers.*.attention.q_norm": "replicate",
    "layers.*.attention.k_norm": "replicate",
}


def _is_attention_entry(pattern: str) -> bool:
    return pattern == "layers.*.attention" or pattern.startswith("layers.*.attention.")


def hybrid_tp_plan(cfg: HybridConfig, plan: dict[str, str], *, moe: bool) -> dict[str, str]:
    """The plan of hybrid `cfg`, given its non-hybrid model's `plan` (dense or MoE, `moe`):
    attention entries only where attention blocks exist, the GDN entries where GDN blocks do
    (a pattern must match a module), and the MTP layers' entries (their block is an attention
    block, models/hybrid.py)."""
    attention = dict(plan)
    if cfg.gated_attention:
        attention |= GATED_ATTENTION_TP_PLAN
    out = {
        p: s
        for p, s in attention.items()
        if ATTENTION in cfg.layer_pattern or not _is_attention_entry(p)
    }
    if GDN in cfg.layer_pattern:
        out |= GDN_TP_PLAN
    if cfg.mtp_depth:
        out |= mtp_tp_plan(attention, moe_block=moe)
    return out
