"""Tensor-parallel plan for models/moe.py: the dense plan (models/gpt_plan.py) for attention,
dense FFN layers, embedding and head, and one of two layouts of the MoE layers.

Expert tensor parallel size 1 ("sequence_local"): an MoE layer is not split over tp. With
sequence parallel each tp rank already holds its own T slice of the tokens, so it routes them
and runs them through the (replicated) router, experts and shared experts itself: no
communication in the layer. The layer's parameters get a partial gradient per tp rank, summed
over tp once per step (graphtrain.parallel.GradientFinisher). The aux and seq_aux losses then
see a slice of each sequence.

Expert tensor parallel size tp: the layer gathers the sequence (every tp rank routes the same
tokens with the replicated router), each expert's and the shared experts' hidden dim is split
over tp (w1/w3 on their rows, w2 on its columns), and the partial outputs are reduce-scattered
back onto T, as the dense MLP does. Only the router's gradient is partial over tp (it weights
partial expert outputs). With expert parallelism too (ep > 1) the experts' weights are split
over ("ep", "tp") by graphtrain.parallel.expert_parallel, so the plan leaves them out.
"""

from __future__ import annotations

from models.gpt_plan import GPT_TP_PLAN
from models.moe import MoEConfig


def moe_tp_plan(cfg: MoEConfig, etp: int = 1, ep: int = 1) -> dict[str, str]:
    """The plan for expert TP size `etp`: 1 (above) or tp (below), and expert-parallel size
    `ep`."""
    plan = {
        pattern: style
        for pattern, style in GPT_TP_PLAN.items()
        # Dense FFN entries only where dense layers exist (a pattern must match a module).
        if cfg.first_k_dense or not pattern.startswith("layers.*.feed_forward")
    }
    if etp == 1:
        plan["layers.*.moe"] = "sequence_local"
        return plan
    plan["layers.*.moe"] = "gather_sequence_partial_out"
    plan["layers.*.moe.router"] = "replicate"
    if ep == 1:
        plan["layers.*.moe.experts"] = "experts_hidden"
    if cfg.num_shared_experts:
        plan["layers.*.moe.shared_experts.w1"] = "colwise"
        plan["layers.*.moe.shared_experts.w3"] = "colwise"
        plan["layers.*.moe.shared_experts.w2"] = "rowwise_partial"
    return plan
