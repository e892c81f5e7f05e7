"""The Hugging Face Qwen3-Next layout (Qwen3NextForCausalLM) of the hybrid models
(models/hybrid.py), dense or MoE: tensor names, value changes and config.json.

What: the four functions graphtrain.checkpoint.hf calls on a layout module (see models/gpt_hf.py):
hf_config, config_mismatches, to_hf_state, from_hf_state. Names are Llama's (gpt_hf) for the
embedding, head, norms, attention projections and dense FFNs; a GDN mixer's
`linear_attention.X` is Qwen3-Next's `linear_attn.X`, attention's q_norm/k_norm keep theirs.
Three value changes, each exact or inverted on import:
  norms      Qwen3-Next's RMSNorm multiplies by (1 + w) (zero-centred), ours by w: every block
             norm, the final norm and q_norm/k_norm are written as w - 1 (import adds 1,
             in fp32 at least: the round trip is exact for w in [0.5, 2]). The GDN output
             norm (RMSNormGated) is plain w in both.
  conv1d     our channels are grouped by key head (q, k, v of each; models/gated_deltanet.py),
             Qwen3-Next's are all q, all k, all v: reordered.
  the rest   renamed only: in_proj_qkvz / in_proj_ba grouped by key head, and wq's per-head
             [query, gate] rows, are Qwen3-Next's layouts; A_log, dt_bias as they are.
What it needs (else ValueError naming the option): model.gated_attention=true (Qwen3-Next's
attention: output gate, q/k norms; the hybrid presets set it), no MTP layers (model.mtp_depth=0:
Qwen3-Next's MTP layer computes another function, check_exportable says how), and for an MoE hybrid
Qwen3-Next's routing. Its sparse block (Qwen3NextSparseMoeBlock) is Qwen2-MoE's: softmax over
all experts, top-k, optionally normalised, one shared expert gated by sigmoid(shared_expert_gate
x); so the MoE layers are mapped by models/moe_hf.py's Qwen2-MoE mapping (our shared experts
concatenated, the gate written as zeros and the shared down_proj doubled: exact), and an MoE
routing that mapping refuses (sigmoid, groups, expert bias, route scale) is refused here.
"""

from __future__ import annotations

import re
from typing import Any

import torch

from models import gpt_hf, moe_hf
from models.hybrid import ATTENTION, GDN, HybridConfig

MODEL_TYPE = "qwen3_next"
_LAYER_TYPES = {GDN: "linear_attention", ATTENTION: "full_attention"}
# Norms Qwen3-Next stores zero-centred (w - 1), by our name's ending.
_CENTRED = re.compile(
    r"^(norm|layers\.\d+\.(attention_norm|ffn_norm|attention\.q_norm|attention\.k_norm))\.weight$"
)
_CONV = re.compile(r"^layers\.\d+\.linear_attention\.conv1d\.weight$")
_GDN_NAMES = ("in_proj_qkvz.weight", "in_proj_ba.weight", "conv1d.weight", "dt_bias", "A_log")
_GDN_NAMES += ("norm.weight", "out_proj.weight")
# Llama's names (gpt_hf), a GDN mixer's `linear_attention.X` as `linear_attn.X`, and
# attention's q/k norms.
_NAMES = gpt_hf.NameMap(
    gpt_hf.LLAMA_NAMES.top,
    gpt_hf.LLAMA_NAMES.layer
    | {f"linear_attention.{n}": f"linear_attn.{n}" for n in _GDN_NAMES}
    | {f"attention.{n}.weight": f"self_attn.{n}.weight" for n in ("q_norm", "k_norm")},
    "hybrid",
)
# The config.json keys of the hybrid part -> the model option each comes from (None: a constant
# of the layout), and Qwen3NextConfig's defaults where a config.json leaves one out.
_HYBRID_KEYS = {
    "layer_types": "layer_pattern",
    "partial_rotary_factor": "partial_rotary_factor",
    "linear_num_key_heads": "linear_num_key_heads",
    "linear_num_value_heads": "linear_num_value_heads",
    "linear_key_head_dim": "linear_key_head_dim",
    "linear_value_head_dim": "linear_value_head_dim",
    "linear_conv_kernel_dim": "linear_conv_kernel",
    "num_experts": None,
}
_HF_DEFAULTS = {"num_experts": 512, "partial_rotary_factor": 0.25, "linear_conv_kernel_dim": 4}


def check_exportable(cfg: HybridConfig) -> None:
    """ValueError naming the option unless Qwen3NextForCausalLM computes `cfg`'s model."""
    if _is_moe(cfg) and _moe_kind(cfg) != moe_hf.QWEN2_MOE:
        raise ValueError(
            "Hugging Face export of an MoE hybrid needs Qwen3-Next's routing, softmax over all "
            "experts: model.score_func='softmax', model.expert_bias=false, no group limit "
            "(model.topk_groups=model.num_groups) and model.route_scale=1.0; got "
            f"model.score_func={cfg.score_func!r}, model.expert_bias={cfg.expert_bias}, "
            f"model.num_groups={cfg.num_groups}, model.topk_groups={cfg.topk_groups}, "
            f"model.route_scale={cfg.route_scale}"
        )
    if cfg.mtp_depth:
        # transformers' Qwen3NextForCausalLM ignores mtp.* on load; vLLM's Qwen3NextMTP is
        # the reference for what the layer computes (docs/design/gated_delta_rule.md).
        raise ValueError(
            f"Hugging Face export of a hybrid with MTP layers (model.mtp_depth={cfg.mtp_depth}) "
            "is refused: Qwen3-Next's MTP layer computes another function than ours. It reads "
            "the trunk's hidden state after the final norm (ours: before it), has a final norm "
            "of its own (mtp.norm; ours shares the trunk's) and feeds its normed output to the "
            "next depth; its weights sit under mtp.* in the main files. Train with "
            "model.mtp_depth=0 to export"
        )
    if ATTENTION in cfg.layer_pattern and not cfg.gated_attention:
        raise ValueError(
            f"Hugging Face export of a hybrid needs model.gated_attention=true (Qwen3-Next's "
            f"attention: output gate and q/k norms), got model.gated_attention=false with "
            f"attention blocks in model.layer_pattern={cfg.layer_pattern!r}"
        )


def _is_moe(cfg: HybridConfig) -> bool:
    return hasattr(cfg, "num_experts")


def _moe_kind(cfg: Any) -> str:
    """moe_hf's architecture for cfg's routing, or why none (its ValueError's text)."""
    try:
        return moe_hf.hf_model_type(cfg)
    except ValueError as e:
        return str(e)


def _moe_keys(cfg: HybridConfig) -> dict[str, Any]:
    """The MoE keys of Qwen3-Next's config.json: Qwen2-MoE's (the same sparse block), without
    the attention keys Qwen2-MoE has and Qwen3-Next does not."""
    dense = gpt_hf.hf_config(cfg, dtype="float32", eos_token_id=None)
    moe = moe_hf.hf_config(cfg, dtype="float32", eos_token_id=None)
    drop = {"architectures", "model_type", "qkv_bias", "use_sliding_window"}
    return {k: v for k, v in moe.items() if k not in dense and k not in drop}


def conv_widths(cfg: HybridConfig) -> tuple[int, int, int]:
    """The q, k and v channels of one key head in conv1d: Dk, Dk and r * Dv."""
    r = cfg.linear_num_value_heads // cfg.linear_num_key_heads
    return cfg.linear_key_head_dim, cfg.linear_key_head_dim, r * cfg.linear_value_head_dim


def conv_to_hf(weight: torch.Tensor, num_key_heads: int, widths: tuple[int, ...]) -> torch.Tensor:
    """conv1d's (C, 1, K) weight, channels grouped by key head (each: `widths` = q, k, v
    channels, conv_widths) -> all q, all k, all v (Qwen3-Next's order)."""
    parts = weight.unflatten(0, (num_key_heads, -1)).split(list(widths), dim=1)
    return torch.cat([p.flatten(0, 1) for p in parts])


def conv_from_hf(weight: torch.Tensor, num_key_heads: int, widths: tuple[int, ...]) -> torch.Tensor:
    """The inverse of conv_to_hf."""
    parts = weight.split([num_key_heads * w for w in widths])
    return torch.cat([p.unflatten(0, (num_key_heads, -1)) for p in parts], dim=1).flatten(0, 1)


def to_hf_state(state: dict[str, torch.Tensor], cfg: HybridConfig) -> dict[str, torch.Tensor]:
    """Our state dict -> Qwen3-Next's tensors (module docstring)."""
    check_exportable(cfg)
    out, moe = {}, {}
    for name, t in state.items():
        if moe_hf.MOE_LAYER.match(name):
            moe[name] = t
            continue
        if _CENTRED.match(name):
            t = t - 1
        elif _CONV.match(name):
            t = conv_to_hf(t, cfg.linear_num_key_heads, conv_widths(cfg))
        out[_NAMES.to_hf(name)] = t
    return out | (moe_hf.to_hf_state(moe, cfg) if moe else {})


def from_hf_state(tensors: dict[str, torch.Tensor], cfg: HybridConfig) -> dict[str, torch.Tensor]:
    """Qwen3-Next's tensors -> our state dict; KeyError for a tensor we have no slot for,
    ValueError for one our model cannot hold (moe_hf: a non-zero shared expert gate)."""
    check_exportable(cfg)
    moe_layers = range(cfg.first_k_dense, cfg.num_layers) if _is_moe(cfg) else range(0)
    out, moe = {}, {}
    for hf_name, t in tensors.items():
        m = moe_hf.HF_MLP.match(hf_name)
        if m and int(m.group(1)) in moe_layers:
            moe[hf_name] = t
            continue
        name = _NAMES.from_hf(hf_name)
        if _CENTRED.match(name):
            t = t.to(torch.promote_types(t.dtype, torch.float32)) + 1  # 1 + w: not in bf16
        elif _CONV.match(name):
            t = conv_from_hf(t, cfg.linear_num_key_heads, conv_widths(cfg))
        out[name] = t
    return out | (moe_hf.from_hf_state(moe, cfg) if _is_moe(cfg) else {})


def hf_config(cfg: HybridConfig, *, dtype: str, eos_token_id: int | None) -> dict[str, Any]:
    """config.json of Qwen3NextForCausalLM for `cfg`; ValueError where it computes another
    model (check_exportable)."""
    check_exportable(cfg)
    llama = gpt_hf.hf_config(cfg, dtype=dtype, eos_token_id=eos_token_id)
    drop = ("architectures", "model_type", "mlp_bias", "rope_theta", "rope_parameters")
    return {k: v for k, v in llama.items() if k not in drop} | {
        "architectures": ["Qwen3NextForCausalLM"],
        "model_type": MODEL_TYPE,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": cfg.rope_theta,
            "partial_rotary_factor": cfg.partial_rotary_factor,
        },
        "layer_types": [_LAYER_TYPES[cfg.mixer(i)] for i in range(cfg.num_layers)],
        "linear_num_key_heads": cfg.linear_num_key_heads,
        "linear_num_value_heads": cfg.linear_num_value_heads,
        "linear_key_head_dim": cfg.linear_key_head_dim,
        "linear_value_head_dim": cfg.linear_value_head_dim,
        "linear_conv_kernel_dim": cfg.linear_conv_kernel,
        # Dense: every layer a Qwen3NextMLP of intermediate_size.
        **(_moe_keys(cfg) if _is_moe(cfg) else {"num_experts": 0}),
    }


def config_mismatches(cfg: HybridConfig, hf: dict[str, Any]) -> list[str]:
    """'model.dim=32 but dim=64' for each option a Qwen3-Next config.json sets otherwise than
    `cfg` (the Llama keys as gpt_hf compares them, then the hybrid keys)."""
    ours = hf_config(cfg, dtype="float32", eos_token_id=None)
    ours["partial_rotary_factor"] = cfg.partial_rotary_factor
    theirs = {k: hf.get(k, _HF_DEFAULTS.get(k)) for k in _HYBRID_KEYS}
    theirs["partial_rotary_factor"] = (hf.get("rope_parameters") or {}).get(
        "partial_rotary_factor", _HF_DEFAULTS["partial_rotary_factor"]
    )
    differ = gpt_hf.config_mismatches(cfg, hf, MODEL_TYPE)
    for key, option in _HYBRID_KEYS.items():
        if ours[key] == theirs[key]:
            continue
        ours_text = f"model.{option}={getattr(cfg, option)!r}" if option else f"{key}={ours[key]}"
        differ.append(f"{ours_text} but {key}={theirs[key]}")
    for key, want in (_moe_keys(cfg) if _is_moe(cfg) else {}).items():
        if key != "num_experts" and hf.get(key) != want:
            differ.append(f"{key}={hf.get(key)} but the model's export has {key}={want}")
    return differ
