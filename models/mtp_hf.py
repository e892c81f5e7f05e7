"""DeepSeek-V3's layout of the MTP layers (models/mtp.py): names of the extra safetensors file.

DeepSeek-V3 stores MTP depth k (1-based) as decoder layer num_layers + k - 1 after the trunk's:
    model.layers.{i}.eh_proj.weight             mtp_layers.{k-1}.eh_proj.weight   [D, 2D]
    model.layers.{i}.enorm.weight               mtp_layers.{k-1}.enorm.weight
    model.layers.{i}.hnorm.weight               mtp_layers.{k-1}.hnorm.weight
    model.layers.{i}.<block tensor>             mtp_layers.{k-1}.block.<ours>   (the layer's
                                                 Hugging Face names: Llama's, or the MoE
                                                 layout's of models/moe_hf.py)
    model.layers.{i}.shared_head.norm.weight    norm.weight           (shared: written for tools
    model.layers.{i}.shared_head.head.weight    output.weight          that expect them, never
    model.layers.{i}.embed_tokens.weight        tok_embeddings.weight  read back)
The main model's files stay what transformers loads; these go to MTP_FILE beside them.
eh_proj's input columns are [enorm(embedding); hnorm(hidden)], DeepSeek-V3's order.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable

import torch

from models.gpt import GPTConfig
from models.gpt_hf import HF_LAYER

MTP_FILE = "mtp.safetensors"
_OWN = ("eh_proj.weight", "enorm.weight", "hnorm.weight")
_SHARED = {
    "shared_head.norm.weight": "norm.weight",
    "shared_head.head.weight": "output.weight",
    "embed_tokens.weight": "tok_embeddings.weight",
}
_MTP = re.compile(r"^mtp_layers\.(\d+)\.(.+)$")

StateMap = Callable[[dict[str, torch.Tensor], GPTConfig], dict[str, torch.Tensor]]


def _one_layer(cfg: GPTConfig, i: int) -> GPTConfig:
    """A config whose layer i is the MTP block (and the only MoE layer, if any): a layout maps
    the MoE layers it finds by index, and the MoE one expects every MoE layer it knows of."""
    changes: dict = {"num_layers": i + 1, "mtp_depth": 0}
    first_k_dense = getattr(cfg, "first_k_dense", None)
    if first_k_dense is not None:  # an MoE config: the MTP block is MoE iff the last layer is
        changes["first_k_dense"] = i if cfg.num_layers > first_k_dense else i + 1
    return dataclasses.replace(cfg, **changes)


def _by_layer(names: dict[str, torch.Tensor], pattern: re.Pattern) -> dict[int, dict]:
    layers: dict[int, dict[str, torch.Tensor]] = {}
    for name, t in names.items():
        m = pattern.match(name)
        if m:
            layers.setdefault(int(m.group(1)), {})[m.group(2)] = t
    return layers


def mtp_to_hf_state(
    state: dict[str, torch.Tensor], cfg: GPTConfig, block_to_hf: StateMap
) -> dict[str, torch.Tensor]:
    """The MTP tensors of our full state dict -> DeepSeek-V3 names (block_to_hf: the layout's
    to_hf_state). The shared norm, head and embedding are included under each layer's name."""
    out: dict[str, torch.Tensor] = {}
    for k, parts in _by_layer(state, _MTP).items():
        i = cfg.num_layers + k
        block = {}
        for rest, t in parts.items():
            if rest in _OWN:
                out[f"model.layers.{i}.{rest}"] = t
            else:
                block[f"layers.{i}.{rest.removeprefix('block.')}"] = t
        out |= block_to_hf(block, _one_layer(cfg, i))
        for hf_name, ours in _SHARED.items():
            # A tied head is the embedding (export drops "output.weight").
            # Copies: safetensors refuses tensors that share memory.
            shared = state.get(ours, state["tok_embeddings.weight"])
            out[f"model.layers.{i}.{hf_name}"] = shared.clone()
    return out


def mtp_from_hf_state(
    tensors: dict[str, torch.Tensor], cfg: GPTConfig, block_from_hf: StateMap
) -> dict[str, torch.Tensor]:
    """DeepSeek-V3 MTP tensors -> our names (block_from_hf: the layout's from_hf_state).
    ValueError unless the file holds exactly cfg.mtp_depth layers after the trunk's."""
    layers = _by_layer(tensors, HF_LAYER)
    expected = list(range(cfg.num_layers, cfg.num_layers + cfg.mtp_depth))
    if sum(map(len, layers.values())) != len(tensors):
        stray = sorted(n for n in tensors if not HF_LAYER.match(n))
        raise ValueError(f"{MTP_FILE} holds tensors of no layer: {stray}")
    if sorted(layers) != expected:
        raise ValueError(
            f"{MTP_FILE} holds MTP layers {sorted(layers)} but model.num_layers="
            f"{cfg.num_layers} with model.mtp_depth={cfg.mtp_depth} needs layers {expected}; "
            f"set model.mtp_depth={len(layers)} or remove {MTP_FILE}"
        )
    out: dict[str, torch.Tensor] = {}
    for i, parts in layers.items():
        prefix = f"mtp_layers.{i - cfg.num_layers}"
        block = {}
        for rest, t in parts.items():
            if rest in _OWN:
                out[f"{prefix}.{rest}"] = t
            elif rest not in _SHARED:  # the shared ones are the main model's own tensors
                block[f"model.layers.{i}.{rest}"] = t
        for ours, t in block_from_hf(block, _one_layer(cfg, i)).items():
            out[f"{prefix}.block.{ours.removeprefix(f'layers.{i}.')}"] = t
    return out
