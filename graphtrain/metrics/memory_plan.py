"""Memory plan: the predicted per-rank device memory of a job, before anything is allocated.

What
    plan_memory(cfg, world_size) builds the model on the meta device (no memory) and adds up,
    for one rank of the configured layout: the parameters (the master copy, sharded over
    dp_shard by FSDP2 and over tp / etp / ep as the layout splits them), the gradients (the
    same shards; under pp x FSDP the whole, summed unsharded until the step's reduce),
    AdamW's two moments (optim.state_dtype), the bf16 working copies where the layout has
    them, FSDP's gathered parameters (the largest block's, twice: running and prefetched;
    under pp by default, every block of the rank), the activations per micro-batch (per
    block, what autograd keeps per token of the rank's sequence slice; with
    activation_checkpoint=full only each block's input plus one block's recompute; with
    activation_memory_budget b, the inputs plus b of the rest plus 1 - b of one block's) and
    the loss's buffers (the fused op's own figure,
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
from graphtrain.parallel.fsdp import reshards_after_forward
from graphtrain.passes.registry import trainer_runs
from graphtrain.precision import graph_cast
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
    notes: tuple[str, ...] = ()  # lines format() adds (a pipeline's ranks and bubble)

    @property
    def total(self) -> int:
        return sum(self.items.values())

    def format(self) -> str:
        """One line: each item and the total, in GiB; then the notes, a line each."""
        parts = [f"{name} {size / 2**30:.2f}" for name, size in self.items.items()]
        return (
            "predicted memory per rank (GiB): "
            + ", ".join(parts)
            + f"; total {self.total / 2**30:.2f}"
            + "".join(f"\n{note}" for note in self.notes)
        )


def _tp_divisor(name: str, plan: dict[str, str], dims: ParallelDims) -> int:
    module = name.rsplit(".", 1)[0]
    for pattern, style in plan.items():
        pattern_re = pattern.replace("*", "[!.]*")
        if fnmatch.fnmatchcase(module, pattern_re) and style in _TP_SPLIT:
            return dims.etp if ".experts" in name else dims.tp
    return 1


def plan_memory(cfg: JobConfig, world_size: int) -> MemoryPlan:
    """The predicted per-rank memory of job `cfg` on `world_size` ranks (no device touched).
    Under pipeline parallelism: the pp rank that needs the most, each rank's total and the
    schedule's bubble in its notes."""
    dims = check_layout(cfg, world_size)
    if not dims.pp_enabled:
        with torch.device("meta"):
            model = build_model(cfg.model)
        return MemoryPlan(_rank_items(cfg, dims, model, tokens=cfg.training.micro_batch_size))
    from graphtrain.parallel.pipeline import (
        bubble_fraction,
        check_pipeline,
        cut_model,
        in_flight_micro_batches,
        pipeline_microbatches,
    )

    specs = check_pipeline(cfg, dims)
    num_microbatches, rows = pipeline_microbatches(cfg, dims)
    schedule = cfg.parallel.pp_schedule
    ranks = []
    for rank in range(dims.pp):
        with torch.device("meta"):
            model = build_model(cfg.model)
            cut_model(model, specs, rank, dims.pp, schedule, lambda: None)
        in_flight = in_flight_micro_batches(schedule, dims.pp, rank, num_microbatches)
        ranks.append(MemoryPlan(_rank_items(cfg, dims, model, tokens=rows, in_flight=in_flight)))
    worst = max(ranks, key=lambda plan: plan.total)
    totals = ", ".join(f"rank {r} {plan.total / 2**30:.2f}" for r, plan in enumerate(ranks))
    bubble = bubble_fraction(schedule, dims.pp, num_microbatches, len(specs) // dims.pp)
    return MemoryPlan(
        worst.items,
        notes=(
            f"pipeline: {schedule}, pp={dims.pp}, {len(specs)} stages, {num_microbatches} "
            f"micro-batches of {rows} rows; memory per pp rank (GiB): {totals} (the largest "
            f"above); predicted bubble {bubble:.1%} of the step (forward = input backward = "
            "weight backward time per layer)",
        ),
    )


def _rank_items(
    cfg: JobConfig, dims: ParallelDims, model: torch.nn.Module, *, tokens: int, in_flight=1.0
) -> dict[str, int]:
    """The memory items of one rank holding `model` (the whole model, or a pipeline rank's
    cut); tokens: rows per micro-batch; in_flight: micro-batches whose activations it keeps."""
    t, m = cfg.training, cfg.model
    plan = tp_plan(m, dims.etp, dims.ep)
    master = _DTYPE_BYTES[t.master_dtype]
    compute = 2 if t.dtype == "auto" else _DTYPE_BYTES[t.dtype]  # auto: bf16 on GPUs
    state = min(_DTYPE_BYTES[cfg.optim.state_dtype], master)
    local, per_block, fsdp_whole = 0.0, {}, 0.0
    for name, param in model.named_parameters():
        share = param.numel() / _tp_divisor(name, plan, dims)
        # Routed experts under ep: split over ep, replicated over the other dp ranks.
        expert = dims.ep > 1 and ".experts." in name
        local += share / (dims.ep if expert else dims.dp_shard)
        fsdp_whole += 0.0 if expert else share
        if name.startswith("layers."):
            block = name.split(".")[1]
            per_block[block] = per_block.get(block, 0.0) + share
    gradients = local * master
    if dims.pp > 1 and dims.dp_size > 1:
        # torch's pipeline stages sum each micro-batch's gradients unsharded (FSDP2's no-sync)
        # and reduce-scatter them once after the step (a shared embedding likewise: the
        # pipeline runner's reduced_once): until then the whole gradient of the rank's FSDP
        # parameters, in the reduce dtype.
        sharded = (fsdp_whole / dims.dp_shard) * master
        gradients += fsdp_whole * _DTYPE_BYTES[t.reduce_dtype] - sharded
    items = {
        "parameters": int(local * master),
        "gradients": int(gradients),
        "optimizer states": int(2 * local * state),
    }
    if t.working_weights and master == 4 and compute == 2:
        matmul = {id(p) for p in working_weight_params(model)}
        cast = {id(p) for p in graph_cast(model, cfg)}
        copies = sum(
            p.numel()
            / _tp_divisor(name, plan, dims)
            * compute
            / (dims.ep if ".experts." in name else 1)
            for name, p in model.named_parameters()
            # The trainer's choice (graphtrain.precision.Precision.working_masters).
            if id(p) not in cast
            and (
                (dims.dp_size == 1 and id(p) in matmul)
                or (dims.dp_size > 1 and dims.ep > 1 and ".experts." in name)
            )
        )
        if copies:
            items["working copies"] = int(copies)
    if dims.dp_shard > 1:
        # Kept after forward (by default under pp: graphtrain.parallel.fsdp's
        # reshards_after_forward), every block of the rank is gathered at once; else the
        # running block's and the prefetched one's.
        blocks = per_block.values()
        kept = not reshards_after_forward(cfg.parallel.fsdp_reshard_after_forward, dims.pp)
        gathered = sum(blocks) if kept else 2 * max(blocks, default=0)
        items["gathered parameters"] = int(gathered * compute)
    tokens *= t.seq_len
    layers = [int(i) for i in model.layers]  # a pipeline rank's layers only
    if layers:
        name = (
            "activations per micro-batch"
            if in_flight == 1
            else f"activations of {in_flight:g} micro-batches"
        )
        items[name] = int(in_flight * _activations(cfg, dims, layers, tokens, compute))
    if hasattr(model, "output"):  # the head (a pipeline rank without it has none)
        # An fp32 weight: the op's extra over low-memory mode is its [token chunk, V] logits.
        compute_dtype = torch.bfloat16 if compute == 2 else torch.float32
        vocab = m.vocab_size // dims.tp
        chunk = fast_mode_extra_bytes(tokens, m.dim, vocab, compute_dtype, torch.float32, True)
        loss = vocab * m.dim * 4 + tokens * m.dim * 4 + chunk
        if cfg.compile.lce_mode == "auto" and dims.tp == 1:  # auto may leave it to Inductor
            loss = max(loss, unfused_extra_bytes(tokens, vocab, compute_dtype))
        items["loss buffers"] = int(loss)
    return items


def _activations(
    cfg: JobConfig, dims: ParallelDims, layers: list[int], tokens: int, compute: int
) -> float:
    """Bytes autograd keeps for one micro-batch of `tokens` through blocks `layers`."""
    t, m = cfg.training, cfg.model
    kv_dim = m.num_kv_heads * m.head_dim
    ffn = m.ffn_dim
    if isinstance(m, MoEConfig):  # the routed experts' and shared experts' hidden per token
        ffn = max(ffn, (m.top_k + m.num_shared_experts) * m.moe_ffn_dim)
    per_token = 7 * m.dim + 2 * kv_dim + 4 * ffn
    per_block = [per_token] * len(layers)
    if getattr(m, "layer_pattern", None):  # a hybrid: its GDN blocks keep other tensors
        gdn = per_token - 2 * m.dim - 2 * kv_dim + gated_deltanet_activations_per_token(m)
        if _compiles_the_chunked_form(cfg.compile):
            gdn += gated_deltanet_chunked_activations_per_token(m)
        # Qwen3-Next's GatedAttention keeps besides: q and k before their norms, the gate, and
        # the gated product (wo's input; the attention output is the gate's gradient's).
        attention = per_token + (3 * m.dim + kv_dim if m.gated_attention else 0)
        per_block = [gdn if m.mixer(i) == "G" else attention for i in layers]
    block_acts = tokens / dims.tp * max(per_block) * compute
    inputs = len(layers) * tokens / dims.tp * m.dim * compute  # what full keeps
    if t.activation_checkpoint == "full":
        return inputs + block_acts
    kept = tokens / dims.tp * sum(per_block) * compute
    # The budget keeps its fraction of what the blocks save beyond their inputs; a block's
    # backward holds what it recomputes while it runs.
    budget = t.activation_memory_budget
    return inputs + budget * (kept - inputs) + (1 - budget) * block_acts


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


def _compiles_the_chunked_form(compile_cfg: Any) -> bool:
    """Whether Inductor compiles the Gated DeltaNet mixer's chunked form (compile.gdr_form
    "inline", or the gated_delta_rule pass off) rather than the pass's op (the default)."""
    if not compile_cfg.enable:  # eager: the plan counts compiled regions (docs/design)
        return False
    return compile_cfg.gdr_form == "inline" or not trainer_runs("gated_delta_rule", compile_cfg)


def gated_deltanet_chunked_activations_per_token(cfg: Any) -> int:
    """Elements per token (compute-dtype units) the chunked form keeps, compiled by Inductor,
    beyond the op's, per value head in fp32 (two units): its chunk terms, five of each head dim
    and five of the chunk (the system, its inverse, the decayed products), and the state entering
    each chunk spread over its positions; less the op's own inputs (q and k in fp32, v). Counted
    from Inductor's partition of hybrid-1b's GDN block at 8192 tokens: +769 MiB with the inline
    form (some of those tensors may be views of others), +798 MiB with the pass off (its loop
    unrolled by Dynamo); this formula gives 768."""
    Hv, Dk, Dv = cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim
    C = cfg.linear_chunk_size
    terms = 5 * (Dk + Dv) + Dk * Dv // C + 5 * C
    return Hv * (2 * terms - (2 * 2 * Dk + Dv))


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
        "training.activation_checkpoint=full (or training.activation_memory_budget below 1) or "
        "a smaller training.micro_batch_size"
    )
