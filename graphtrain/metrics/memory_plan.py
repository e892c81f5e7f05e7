"""Memory plan: the predicted per-rank device memory of a job, before anything is allocated.

What
    plan_memory(cfg, world_size) builds the model on the meta device (no memory) and adds up,
    for one rank of the configured layout: the parameters (the master copy, sharded over
    dp_shard by FSDP2 and over tp / etp / ep as the layout splits them), the gradients (the
    same shards), AdamW's two moments (optim.state_dtype), the bf16 working copies where the
    layout has them, FSDP's gathered parameters (the largest block's, twice: running and
    prefetched), the activations per micro-batch (per block, what autograd keeps per token of
    the rank's sequence slice; with activation_checkpoint=full only each block's input plus
    one block's recompute) and the loss's buffers (the fused op's own figure,
    linear_cross_entropy.fast_mode_extra_bytes, or the unfused logits where compile.lce_mode
    auto may leave the loss to Inductor).

Contract
    An estimate, not a measurement: allocator fragmentation, NCCL buffers, the CUDA context
    (~0.5-1 GiB) and compiler workspaces come on top, so check_fits keeps 10% of the device as
    headroom. The trainer logs it at start and the measured peak beside it after the first
    log step. What each term counts, element by element: docs/design/memory_plan.md.
"""

from __future__ import annotations

import dataclasses
import fnmatch
from typing import Any

import torch

from graphtrain.config import JobConfig
from graphtrain.custom_ops.linear_cross_entropy import fast_mode_extra_bytes, unfused_extra_bytes
from graphtrain.optim import working_weight_params
from graphtrain.parallel import ParallelDims, check_layout
from models import MoEConfig, build_model, tp_plan

_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
# Plan styles that split a module's parameters over tp (the others keep them whole).
_TP_SPLIT = {
    "colwise",
    "rowwise",
    "rowwise_partial",
    "embedding_rowwise",
    "colwise_head",
    "experts_hidden",
}
HEADROOM = 0.9  # of the device memory a plan may use


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
    items: dict[str, int]  # name -> bytes per rank

    @property
    def total(self) -> int:
        return sum(self.items.values())

    def format(self) -> str:
        """One line: each item and the total, in GiB."""
        parts = [f"{name} {size / 2**30:.2f}" for name, size in self.items.items()]
        return (
            "predicted memory per rank (GiB): "
            + ", ".join(parts)
            + f"; total {self.total / 2**30:.2f}"
        )


def _tp_divisor(name: str, plan: dict[str, str], dims: ParallelDims) -> int:
    module = name.rsplit(".", 1)[0]
    for pattern, style in plan.items():
        pattern_re = pattern.replace("*", "[!.]*")
        if fnmatch.fnmatchcase(module, pattern_re) and style in _TP_SPLIT:
            return dims.etp if ".experts" in name else dims.tp
    return 1


def plan_memory(cfg: JobConfig, world_size: int) -> MemoryPlan:
    """The predicted per-rank memory of job `cfg` on `world_size` ranks (no device touched)."""
    t, m = cfg.training, cfg.model
    dims = check_layout(cfg, world_size)
    with torch.device("meta"):
        model = build_model(m)
    plan = tp_plan(m, dims.etp, dims.ep)
    master = _DTYPE_BYTES[t.master_dtype]
    compute = 2 if t.dtype == "auto" else _DTYPE_BYTES[t.dtype]  # auto: bf16 on GPUs
    state = min(_DTYPE_BYTES[cfg.optim.state_dtype], master)
    local, per_block = 0.0, {}
    for name, param in model.named_parameters():
        share = param.numel() / _tp_divisor(name, plan, dims)
        # Routed experts under ep: split over ep, replicated over the other dp ranks.
        local += share / (dims.ep if dims.ep > 1 and ".experts." in name else dims.dp_shard)
        if name.startswith("layers."):
            block = name.split(".")[1]
            per_block[block] = per_block.get(block, 0.0) + share
    items = {
        "parameters": int(local * master),
        "gradients": int(local * master),
        "optimizer states": int(2 * local * state),
    }
    if t.working_weights and master == 4 and compute == 2:
        matmul = {id(p) for p in working_weight_params(model)}
        copies = sum(
            p.numel()
            / _tp_divisor(name, plan, dims)
            * compute
            / (dims.ep if ".experts." in name else 1)
            for name, p in model.named_parameters()
            # The trainer's choice (graphtrain.precision.Precision.working_masters).
            if (dims.dp_size == 1 and id(p) in matmul)
            or (dims.dp_size > 1 and dims.ep > 1 and ".experts." in name)
        )
        if copies:
            items["working copies"] = int(copies)
    if dims.dp_shard > 1:
        items["gathered parameters"] = int(2 * max(per_block.values(), default=0) * compute)
    tokens = t.micro_batch_size * t.seq_len
    kv_dim = m.num_kv_heads * m.head_dim
    ffn = m.ffn_dim
    if isinstance(m, MoEConfig):  # the routed experts' and shared experts' hidden per token
        ffn = max(ffn, (m.top_k + m.num_shared_experts) * m.moe_ffn_dim)
    per_token = 7 * m.dim + 2 * kv_dim + 4 * ffn
    per_block = [per_token] * m.num_layers
    if getattr(m, "layer_pattern", None):  # a hybrid: its GDN blocks keep other tensors
        gdn = per_token - 2 * m.dim - 2 * kv_dim + gated_deltanet_activations_per_token(m)
        per_block = [gdn if m.mixer(i) == "G" else per_token for i in range(m.num_layers)]
    block_acts = tokens / dims.tp * max(per_block) * compute
    if t.activation_checkpoint == "full":
        acts = m.num_layers * tokens / dims.tp * m.dim * compute + block_acts
    else:
        acts = tokens / dims.tp * sum(per_block) * compute
    items["activations per micro-batch"] = int(acts)
    # An fp32 weight: the op's extra over low-memory mode is its [token chunk, V] logits alone.
    compute_dtype = torch.bfloat16 if compute == 2 else torch.float32
    vocab = m.vocab_size // dims.tp
    chunk = fast_mode_extra_bytes(tokens, m.dim, vocab, compute_dtype, torch.float32, True)
    loss = vocab * m.dim * 4 + tokens * m.dim * 4 + chunk
    if cfg.compile.lce_mode == "auto" and dims.tp == 1:
        loss = max(loss, unfused_extra_bytes(tokens, vocab, compute_dtype))
    items["loss buffers"] = int(loss)
    return MemoryPlan(items)


def gated_deltanet_activations_per_token(cfg: Any) -> int:
    """Elements per token a Gated DeltaNet mixer keeps for the backward, in compute-dtype units
    (module docstring): projections, convolution in and out, normalised q and k (and their
    copies per value head), v, g and beta (fp32: twice), rule output and gated norm output."""
    Hv, Dk, Dv = cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim
    key_dim, value_dim = cfg.linear_num_key_heads * Dk, Hv * Dv
    projections = 2 * key_dim + 2 * value_dim + 2 * Hv
    conv = 2 * (2 * key_dim + value_dim)
    qk = 2 * key_dim + (2 * Hv * Dk if Hv != cfg.linear_num_key_heads else 0)
    return projections + conv + qk + value_dim + 2 * 2 * Hv + 2 * value_dim


def check_fits(plan: MemoryPlan, device_bytes: int, *, device: str = "the device") -> None:
    """ValueError naming the biggest item when the plan exceeds HEADROOM of the device
    (`device`: what device_bytes is, for the message)."""
    if plan.total <= HEADROOM * device_bytes:
        return
    name, size = max(plan.items.items(), key=lambda kv: kv[1])
    raise ValueError(
        f"the layout needs about {plan.total / 2**30:.1f} GiB per rank but {device} has "
        f"{device_bytes / 2**30:.1f} GiB ({HEADROOM:.0%} usable); the biggest item is {name} "
        f"({size / 2**30:.1f} GiB): shard more (parallel.dp_shard, parallel.tp), use "
        "training.activation_checkpoint=full or a smaller training.micro_batch_size"
    )
