"""Tensor-parallel plan for models/moe.py: the dense plan (models/gpt_plan.py) for attention,
dense FFN layers, embedding and head, and "sequence_local" for every MoE layer.

Expert tensor parallel size 1: an MoE layer is not split over tp. With sequence parallel each tp
rank already holds its own T slice of the tokens, so it routes them and runs them through the
(replicated) router, experts and shared experts itself: no communication in the layer (expert
parallelism, over the ep axis, is separate). The layer's parameters get a partial gradient per
tp rank, summed over tp by the trainer (graphtrain.parallel.reduce_partial_grads).
"""

from __future__ import annotations

from models.gpt_plan import GPT_TP_PLAN
from models.moe import MoEConfig


def moe_tp_plan(cfg: MoEConfig) -> dict[str, str]:
    plan = {
        pattern: style
        for pattern, style in GPT_TP_PLAN.items()
        # Dense FFN entries only where dense layers exist (a pattern must match a module).
        if cfg.first_k_dense or not pattern.startswith("layers.*.feed_forward")
    }
    plan["layers.*.moe"] = "sequence_local"
    return plan
