"""Plain-PyTorch models and their presets. Nothing here imports distributed, compile or kernel code."""

from models.gpt import GPT, PRESETS, GPTConfig, build_gpt
from models.gpt_plan import GPT_TP_PLAN, mtp_tp_plan
from models.hybrid import HYBRID_PRESETS, HybridConfig, HybridMoEConfig, build_hybrid
from models.hybrid_plan import hybrid_tp_plan
from models.moe import MOE_PRESETS, MoEConfig, MoEGPT, active_params, build_moe
from models.moe_plan import moe_tp_plan

MODEL_PRESETS: dict[str, GPTConfig] = {**PRESETS, **MOE_PRESETS, **HYBRID_PRESETS}


def build_model(cfg: GPTConfig) -> GPT:
    """The model for a config (called under torch.device("meta"), then to_empty + init_weights):
    MoEGPT for an MoEConfig, the dense GPT otherwise; a HybridConfig (models/hybrid.py) gives the
    hybrid of either kind."""
    if isinstance(cfg, HybridConfig):
        return build_hybrid(cfg)
    if isinstance(cfg, MoEConfig):
        return build_moe(cfg)
    return build_gpt(cfg)


def tp_plan(cfg: GPTConfig, etp: int = 1, ep: int = 1) -> dict[str, str]:
    """The tensor-parallel plan (module pattern -> style name) of the model for `cfg`; `etp`,
    `ep`: expert tensor-parallel (1 or tp) and expert-parallel sizes of an MoE model."""
    moe = isinstance(cfg, MoEConfig)
    plan = moe_tp_plan(cfg, etp, ep) if moe else dict(GPT_TP_PLAN)
    if isinstance(cfg, HybridConfig):
        return hybrid_tp_plan(cfg, plan, moe=moe)
    if cfg.mtp_depth:
        # The MTP block is of the kind of the trunk's last layer.
        plan |= mtp_tp_plan(plan, moe_block=moe)
    return plan


__all__ = [
    "GPT",
    "MODEL_PRESETS",
    "GPTConfig",
    "HybridConfig",
    "HybridMoEConfig",
    "MoEConfig",
    "MoEGPT",
    "active_params",
    "build_model",
    "tp_plan",
]
