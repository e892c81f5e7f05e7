"""The Hugging Face layouts of models/moe.py: Glm4MoeForCausalLM for sigmoid routing,
Qwen2MoeForCausalLM for softmax routing; tensor names, config.json, and what neither computes.

What: the same four functions as models/gpt_hf.py (hf_config, config_mismatches, to_hf_state,
from_hf_state), which graphtrain.checkpoint.hf calls for an MoEConfig. Attention, norms,
embeddings, head and the dense first layers keep gpt_hf's Llama names. An MoE layer i is
written as the published GLM-4.5 and Qwen MoE checkpoints are, one tensor per expert,
    model.layers.i.mlp.gate.weight                      router.gate.weight           [E, D]
    model.layers.i.mlp.gate.e_score_correction_bias     router.expert_bias (Glm4Moe) [E] fp32
    model.layers.i.mlp.experts.j.gate_proj.weight       experts.w1[j]                [F, D]
    model.layers.i.mlp.experts.j.up_proj.weight         experts.w3[j]                [F, D]
    model.layers.i.mlp.experts.j.down_proj.weight       experts.w2[j]                [D, F]
    model.layers.i.mlp.shared_experts.{gate,up,down}_proj.weight   (Glm4Moe; Qwen2Moe:
        mlp.shared_expert.* and mlp.shared_expert_gate.weight [1, D])   shared_experts.w1/w3/w2
Refused with a ValueError naming the option: softmax with model.expert_bias, with
group-limited routing or with model.route_scale != 1; sigmoid with one expert per group.
Not exported: the training-only options (aux loss coefficients, bias_update_rate,
force_balance).

Numerics: an fp32 export computes our logits up to summation order; exact ties between
experts may route differently (torch.topk there, the lower index here), and in bf16 so may
near-ties. e_score_correction_bias stays fp32 in every export. Why these two architectures,
how each is configured to compute ours, and Qwen2Moe's shared-expert gate:
docs/design/hf_export.md.
"""

from __future__ import annotations

import re
from typing import Any

import torch

from models import gpt_hf
from models.moe import MoEConfig

GLM4_MOE = "glm4_moe"
QWEN2_MOE = "qwen2_moe"
_ARCHITECTURES = {GLM4_MOE: "Glm4MoeForCausalLM", QWEN2_MOE: "Qwen2MoeForCausalLM"}
# Our expert weights -> the projection names of a Hugging Face SwiGLU.
_PROJ = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
_SHARED = {GLM4_MOE: "shared_experts", QWEN2_MOE: "shared_expert"}
MOE_LAYER = re.compile(r"^layers\.(\d+)\.moe\.(.+)$")
HF_MLP = re.compile(r"^model\.layers\.(\d+)\.mlp\.(.+)$")
# The config classes' defaults for keys a config.json may leave out (configuration_*.py).
_HF_DEFAULTS = {
    GLM4_MOE: {
        "partial_rotary_factor": 0.5,
        "attention_bias": False,
        "use_qk_norm": False,
        "hidden_act": "silu",
        "n_shared_experts": 1,
        "n_group": 1,
        "topk_group": 1,
        "first_k_dense_replace": 1,
        "norm_topk_prob": True,
        "routed_scaling_factor": 1.0,
    },
    QWEN2_MOE: {
        "qkv_bias": True,
        "use_sliding_window": False,
        "hidden_act": "silu",
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "norm_topk_prob": False,
    },
}


def hf_model_type(cfg: MoEConfig) -> str:
    """The transformers model_type that computes `cfg`'s model; ValueError naming the option
    when none does."""
    if cfg.score_func == "sigmoid":
        if cfg.num_experts // cfg.num_groups < 2:
            raise ValueError(
                f"model.num_experts={cfg.num_experts} in model.num_groups={cfg.num_groups} "
                "groups is one expert per group; Glm4MoeForCausalLM, the Hugging Face "
                "architecture for sigmoid routing, scores a group by its top 2 experts and "
                "needs at least 2 (model.num_groups=1 routes the same)"
            )
        return GLM4_MOE
    if cfg.expert_bias:
        name, plain = "expert_bias", "false"
    elif cfg.topk_groups < cfg.num_groups:  # all groups kept is plain top-k
        name, plain = "num_groups", "1"
    elif cfg.route_scale != 1:
        name, plain = "route_scale", "1.0"
    else:
        return QWEN2_MOE
    raise ValueError(
        f"model.{name}={getattr(cfg, name)} with model.score_func='softmax' has no Hugging Face "
        f"architecture: Qwen2MoeForCausalLM, the one for softmax routing, needs "
        f"model.{name}={plain}, and Glm4MoeForCausalLM routes with sigmoid only"
    )


def _moe_fields(cfg: MoEConfig, model_type: str) -> dict[str, tuple[Any, str | None]]:
    """config.json key -> (value, the model option it comes from, or None for a constant of the
    layout): the MoE part of hf_config and what config_mismatches compares."""
    common = {
        "num_experts_per_tok": (cfg.top_k, "top_k"),
        "moe_intermediate_size": (cfg.moe_ffn_dim, "moe_ffn_dim"),
        "hidden_act": ("silu", None),
    }
    if model_type == GLM4_MOE:
        return common | {
            "n_routed_experts": (cfg.num_experts, "num_experts"),
            "n_shared_experts": (cfg.num_shared_experts, "num_shared_experts"),
            "first_k_dense_replace": (cfg.first_k_dense, "first_k_dense"),
            "n_group": (cfg.num_groups, "num_groups"),
            "topk_group": (cfg.topk_groups, "topk_groups"),
            "norm_topk_prob": (cfg.normalize_weights, "normalize_weights"),
            "routed_scaling_factor": (cfg.route_scale, "route_scale"),
            "partial_rotary_factor": (1.0, None),
            "attention_bias": (False, None),
            "use_qk_norm": (False, None),
        }
    return common | {
        "num_experts": (cfg.num_experts, "num_experts"),
        "shared_expert_intermediate_size": (
            cfg.num_shared_experts * cfg.moe_ffn_dim,
            "num_shared_experts",
        ),
        "mlp_only_layers": (list(range(cfg.first_k_dense)), "first_k_dense"),
        # Softmax after top-k is the normalised softmax (see the module docstring).
        "norm_topk_prob": (
            cfg.normalize_weights or not cfg.pre_softmax,
            "normalize_weights" if cfg.pre_softmax else "pre_softmax",
        ),
        "qkv_bias": (False, None),
        "use_sliding_window": (False, None),
        "decoder_sparse_step": (1, None),
    }


def hf_config(cfg: MoEConfig, *, dtype: str, eos_token_id: int | None) -> dict[str, Any]:
    """config.json of the architecture hf_model_type(cfg) names (ValueError if none)."""
    model_type = hf_model_type(cfg)
    config = gpt_hf.hf_config(cfg, dtype=dtype, eos_token_id=eos_token_id)
    del config["mlp_bias"]
    if model_type == QWEN2_MOE:
        del config["attention_bias"]
    config |= {
        "architectures": [_ARCHITECTURES[model_type]],
        "model_type": model_type,
        **{k: v for k, (v, _) in _moe_fields(cfg, model_type).items()},
    }
    if model_type == GLM4_MOE:
        # transformers >= 5 reads the factor from rope_parameters, earlier versions top-level.
        config["rope_parameters"] = {**config["rope_parameters"], "partial_rotary_factor": 1.0}
        config["num_nextn_predict_layers"] = 0  # no multi-token-prediction layers
    return config


def _hf_value(hf: dict[str, Any], key: str, model_type: str) -> Any:
    """What transformers reads for `key` (absent or null: the config class's default)."""
    rope = hf.get("rope_parameters") or {}
    value = rope.get(key) if key == "partial_rotary_factor" and key in rope else hf.get(key)
    return _HF_DEFAULTS[model_type].get(key) if value is None else value


def config_mismatches(cfg: MoEConfig, hf: dict[str, Any]) -> list[str]:
    """'model.top_k=2 but num_experts_per_tok=4' for each key a config.json sets otherwise than
    the export of `cfg` would; ValueError if no architecture computes `cfg`, or another one."""
    model_type = hf_model_type(cfg)
    differ = gpt_hf.config_mismatches(cfg, hf, model_type)
    for key, (want, option) in _moe_fields(cfg, model_type).items():
        have = _hf_value(hf, key, model_type)
        if have != want and option:
            differ.append(f"model.{option}={getattr(cfg, option)} but {key}={have}")
        elif have != want:
            differ.append(f"{key}={have} but graphtrain's model needs {key}={want}")
    return differ


def _layer_to_hf(
    p: dict[str, torch.Tensor], cfg: MoEConfig, model_type: str
) -> dict[str, torch.Tensor]:
    """One MoE layer's tensors (names after `moe.`) -> theirs (names after `mlp.`)."""
    gate = p.pop("router.gate.weight")
    out = {"gate.weight": gate}
    for ours, theirs in _PROJ.items():
        stacked = p.pop(f"experts.{ours}")  # (E, F, D) or (E, D, F)
        out |= {f"experts.{j}.{theirs}.weight": w for j, w in enumerate(stacked.unbind(0))}
    shared = {ours: p.pop(f"shared_experts.{ours}.weight", None) for ours in _PROJ}
    if shared["w1"] is None:  # no shared experts: transformers builds them zero wide
        empty = gate.new_empty(0, cfg.dim)
        shared = {"w1": empty, "w3": empty, "w2": empty.T}
    if model_type == GLM4_MOE:
        bias = p.pop("router.expert_bias", None)
        out["gate.e_score_correction_bias"] = torch.zeros(cfg.num_experts) if bias is None else bias
    else:
        shared["w2"] = shared["w2"] * 2  # sigmoid(0) = 0.5 halves it back exactly
        out["shared_expert_gate.weight"] = gate.new_zeros(1, cfg.dim)
    out |= {f"{_SHARED[model_type]}.{_PROJ[k]}.weight": w for k, w in shared.items()}
    if p:
        raise KeyError(f"no Hugging Face name for the MoE parameter(s) {sorted(p)}")
    return out


def _layer_from_hf(
    h: dict[str, torch.Tensor], cfg: MoEConfig, model_type: str, where: str
) -> dict[str, torch.Tensor]:
    """Their tensors of one MoE layer (names after `mlp.`) -> ours (names after `moe.`)."""

    def take(name: str) -> torch.Tensor:
        if name not in h:
            raise ValueError(f"the tensor {where}.{name} is missing")
        return h.pop(name)

    out = {"router.gate.weight": take("gate.weight")}
    for ours, theirs in _PROJ.items():
        experts = [take(f"experts.{j}.{theirs}.weight") for j in range(cfg.num_experts)]
        out[f"experts.{ours}"] = torch.stack(experts)
    shared_names = {k: f"{_SHARED[model_type]}.{v}.weight" for k, v in _PROJ.items()}
    shared = {}
    if cfg.num_shared_experts:
        shared = {k: take(name) for k, name in shared_names.items()}
    else:  # the zero-wide shared experts of our export, if there
        for name in shared_names.values():
            h.pop(name, None)
    if model_type == GLM4_MOE:
        bias = take("gate.e_score_correction_bias")
        if cfg.expert_bias:
            out["router.expert_bias"] = bias
        elif bias.any():
            raise ValueError(
                f"{where}.gate.e_score_correction_bias is not zero but model.expert_bias=false: "
                "set model.expert_bias=true to import it"
            )
    else:
        if take("shared_expert_gate.weight").any():
            raise ValueError(
                f"{where}.shared_expert_gate.weight is not zero: graphtrain's shared experts "
                "are ungated, so only a zero gate (sigmoid = 0.5, as graphtrain exports) maps"
            )
        if shared:
            shared["w2"] = shared["w2"] / 2
    if h:
        raise KeyError(f"the MoE model has no parameter for {sorted(f'{where}.{k}' for k in h)}")
    return out | {f"shared_experts.{k}.weight": w for k, w in shared.items()}


def to_hf_state(state: dict[str, torch.Tensor], cfg: MoEConfig) -> dict[str, torch.Tensor]:
    """Our state dict -> the tensors of hf_model_type(cfg)'s checkpoint files."""
    model_type = hf_model_type(cfg)
    layers: dict[str, dict[str, torch.Tensor]] = {}
    out = {}
    for name, t in state.items():
        m = MOE_LAYER.match(name)
        if m:
            layers.setdefault(m.group(1), {})[m.group(2)] = t
        else:
            out[gpt_hf.to_hf_name(name)] = t
    for i, parts in layers.items():
        hf = _layer_to_hf(parts, cfg, model_type)
        out |= {f"model.layers.{i}.mlp.{k}": v for k, v in hf.items()}
    return out


def from_hf_state(tensors: dict[str, torch.Tensor], cfg: MoEConfig) -> dict[str, torch.Tensor]:
    """The tensors of a hf_model_type(cfg) checkpoint -> our state dict; ValueError for a
    missing tensor or a value graphtrain's model cannot hold, KeyError for an unknown name."""
    model_type = hf_model_type(cfg)
    moe_layers = {str(i) for i in range(cfg.first_k_dense, cfg.num_layers)}
    layers: dict[str, dict[str, torch.Tensor]] = {i: {} for i in moe_layers}
    out = {}
    for name, t in tensors.items():
        m = HF_MLP.match(name)
        if m and m.group(1) in moe_layers:
            layers[m.group(1)][m.group(2)] = t
        else:
            out[gpt_hf.from_hf_name(name)] = t
    for i, parts in layers.items():
        ours = _layer_from_hf(parts, cfg, model_type, f"model.layers.{i}.mlp")
        out |= {f"layers.{i}.moe.{k}": v for k, v in ours.items()}
    return out
