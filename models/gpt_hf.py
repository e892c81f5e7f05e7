"""The Hugging Face Llama layout of models/gpt.py: parameter names and config.json fields.

Export is a renaming: our RoPE is Hugging Face's rotate-half layout (x1 * cos - x2 * sin,
x2 * cos + x1 * sin over the two halves of each head), so q/k need no permutation; RMSNorm,
SwiGLU (gate_proj = w1, up_proj = w3, down_proj = w2) and grouped-query attention are Llama's.
A tied output head is written once, as the embedding, with tie_word_embeddings = true.

graphtrain.checkpoint.hf uses a layout module through four functions, which models/moe_hf.py
(the MoE layouts) has too: hf_config, config_mismatches, to_hf_state, from_hf_state.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import torch

from models.gpt import GPTConfig

# Our name (with {i} for the layer) -> the Hugging Face LlamaForCausalLM name.
_LAYER_NAMES = {
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}
_TOP_NAMES = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
# A name inside layer i, ours and theirs: groups (i, the rest).
LAYER = re.compile(r"^layers\.(\d+)\.(.+)$")
HF_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")


@dataclass(frozen=True)
class _Renaming:
    """One direction of a NameMap: whole names by `top`; the rest of a name inside layer i
    (`pattern` groups i and the rest) by `layer`, written `prefix`{i}.<renamed>."""

    top: dict[str, str]
    layer: dict[str, str]
    pattern: re.Pattern
    prefix: str

    def __call__(self, name: str) -> str | None:
        if name in self.top:
            return self.top[name]
        m = self.pattern.match(name)
        if m and m.group(2) in self.layer:
            return f"{self.prefix}{m.group(1)}.{self.layer[m.group(2)]}"
        return None


class NameMap:
    """Our parameter names <-> Hugging Face names: `top` renames whole names, `layer` the rest of
    a name inside layer i (layers.{i}.<ours> <-> model.layers.{i}.<theirs>). `model` names our
    model in the KeyError for a tensor it has no slot for."""

    def __init__(self, top: dict[str, str], layer: dict[str, str], model: str) -> None:
        self.top, self.layer = top, layer
        self._to_hf = _Renaming(top, layer, LAYER, "model.layers.")
        self._from_hf = _Renaming(_inverse(top), _inverse(layer), HF_LAYER, "layers.")
        self.model = model

    def to_hf(self, name: str) -> str:
        """Our parameter name -> the Hugging Face name; KeyError for an unknown name."""
        found = self._to_hf(name)
        if found is None:
            raise KeyError(f"no Hugging Face name for parameter {name!r}")
        return found

    def from_hf(self, name: str) -> str:
        """The Hugging Face name -> ours; KeyError for a name our model has no slot for."""
        found = self._from_hf(name)
        if found is None:
            raise KeyError(
                f"the {self.model} model has no parameter for the Hugging Face tensor {name!r}"
            )
        return found


def _inverse(names: dict[str, str]) -> dict[str, str]:
    return {v: k for k, v in names.items()}


LLAMA_NAMES = NameMap(_TOP_NAMES, _LAYER_NAMES, "GPT")
to_hf_name, from_hf_name = LLAMA_NAMES.to_hf, LLAMA_NAMES.from_hf


def hf_config(cfg: GPTConfig, *, dtype: str, eos_token_id: int | None) -> dict[str, Any]:
    """config.json of LlamaForCausalLM for `cfg` (dtype: "bfloat16" or "float32")."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.dim,
        "intermediate_size": cfg.ffn_dim,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": cfg.max_seq_len,
        "rms_norm_eps": cfg.norm_eps,
        # transformers >= 5 reads rope_parameters, earlier versions rope_theta.
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
        "rope_theta": cfg.rope_theta,
        "tie_word_embeddings": cfg.tie_embeddings,
        "attention_bias": False,
        "mlp_bias": False,
        "initializer_range": cfg.init_std,
        "bos_token_id": None,
        "eos_token_id": eos_token_id,
        "pad_token_id": None,
        "dtype": dtype,
        "torch_dtype": dtype,
    }


def to_hf_state(state: dict[str, torch.Tensor], cfg: GPTConfig) -> dict[str, torch.Tensor]:
    """Our state dict -> the Hugging Face Llama tensors (the same tensors, renamed)."""
    return {to_hf_name(k): v for k, v in state.items()}


def from_hf_state(tensors: dict[str, torch.Tensor], cfg: GPTConfig) -> dict[str, torch.Tensor]:
    """Hugging Face Llama tensors -> our state dict; KeyError for a tensor we have no slot for."""
    return {from_hf_name(k): v for k, v in tensors.items()}


def config_mismatches(cfg: GPTConfig, hf: dict[str, Any], model_type: str = "llama") -> list[str]:
    """'model.dim=32 but dim=64' for each GPTConfig field a config.json of `model_type` sets
    otherwise than `cfg`."""
    return [
        f"model.{k}={getattr(cfg, k)} but {k}={v}"
        for k, v in gpt_config_from_hf(hf, model_type).items()
        if getattr(cfg, k) != v
    ]


def gpt_config_from_hf(hf: dict[str, Any], model_type: str = "llama") -> dict[str, Any]:
    """The GPTConfig fields a Hugging Face config.json of `model_type` describes (the attention,
    norms and dense FFN keys, which Llama and the MoE layouts of models/moe_hf.py share)."""
    if hf.get("model_type") != model_type:
        raise ValueError(
            f"config.json has model_type={hf.get('model_type')!r}; the model maps onto "
            f"{model_type!r}"
        )
    rope = hf.get("rope_parameters") or {}
    return {
        "vocab_size": hf["vocab_size"],
        "dim": hf["hidden_size"],
        "num_layers": hf["num_hidden_layers"],
        "num_heads": hf["num_attention_heads"],
        "num_kv_heads": hf.get("num_key_value_heads") or hf["num_attention_heads"],
        "ffn_dim": hf["intermediate_size"],
        "rope_theta": float(rope.get("rope_theta", hf.get("rope_theta", 10000.0))),
        "norm_eps": hf["rms_norm_eps"],
        "tie_embeddings": bool(hf.get("tie_word_embeddings", False)),
    }
