"""Tensor parallelism with sequence parallel: a model's plan of style NAMES (models/*_plan.py)
turned into torch.distributed.tensor.parallel styles and applied with parallelize_module.

Activations between blocks are sharded on the sequence dim (Shard(1)): the residual stream
costs 1/tp of the memory and the norms run on 1/tp of the tokens. Inside attention and the MLP
they are gathered (all-gather on T), the weights are split column-wise then row-wise, and the
row-wise output is reduce-scattered back onto T.

The residual stream stays a DTensor (use_local_output=False on the embedding and the row-wise
outputs), unlike torchtitan's plain local tensors. Why: with plain tensors the first block's
input is `to_local()`'s output, a view of the DTensor's inner tensor, and on torch 2.13 a
compiled block fed that view sends a plain-tensor gradient into the embedding's Redistribute
backward ("'Tensor' object has no attribute '_local_tensor'"). DTensor block inputs and outputs
are handled by AOT autograd as subclass inputs, with no such view; eager cost: the residual adds
go through DTensor dispatch (a local add, no communication).

The output head ("colwise_head") splits the vocab and gathers the logits to a full (B, T, V)
tensor, so that the model's plain F.cross_entropy works unchanged in eager runs. Compiled, the
fuse_linear_cross_entropy pass recognises that head + gather + cross_entropy chain and replaces
it with graphtrain.linear_cross_entropy_vocab_parallel on the local vocab shard: the full
logits are never gathered (see graphtrain/passes/linear_cross_entropy.py).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from fnmatch import fnmatchcase

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    PrepareModuleInputOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)
from torch.distributed.tensor.parallel.style import ParallelStyle

_SEQ = Shard(1)  # (B, T, ...): the sequence dim of activations


def _gather_sequence(module: nn.Module) -> ParallelStyle:
    # All-gather the first input (the activation) on T; every other input (rope, attn_mask) is
    # full-sequence already and passes untouched (None layout). PrepareModuleInput wants one
    # layout per positional input, so count them from forward's signature.
    num_inputs = sum(
        p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
        for p in inspect.signature(module.forward).parameters.values()
    )
    rest = (None,) * (num_inputs - 1)
    return PrepareModuleInput(
        input_layouts=(_SEQ, *rest), desired_input_layouts=(Replicate(), *rest)
    )


def _split_keep_mask(module: nn.Module) -> ParallelStyle:
    # An MTP layer (models.mtp.MTPLayer): its `keep` input, a (B, T) mask full on every rank, is
    # cut to this rank's T slice (a local chunk, no communication) so that it multiplies the
    # Shard(1) embedding; the other inputs pass untouched.
    names = [
        p.name
        for p in inspect.signature(module.forward).parameters.values()
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
    ]
    return PrepareModuleInput(
        input_layouts=tuple(Replicate() if n == "keep" else None for n in names),
        desired_input_layouts=tuple(_SEQ if n == "keep" else None for n in names),
    )


class _EmbeddingRowwise(RowwiseParallel):
    """RowwiseParallel whose output's reduce-scatter is waited on at once (torch's leaves it
    async), so that the first block gets the input every later block gets from the compiled
    block before it, and Dynamo compiles the block once for all (before, twice with tp: the
    first block's guards failed for the second, on the input's local tensor type, an
    AsyncCollectiveTensor, and then on its placement: the same Shard(1) object as the
    block's own input layouts, which Dynamo guarded as an alias; hence the factory's fresh
    Shard(1)). The first block's norm reads the output next anyway."""

    @staticmethod
    def _prepare_output_fn(
        output_layouts: tuple, use_local_output: bool, mod: nn.Module, outputs: DTensor,
        device_mesh: DeviceMesh,
    ) -> torch.Tensor:  # fmt: skip
        if outputs.placements != output_layouts:
            outputs = outputs.redistribute(placements=output_layouts, async_op=False)
        return outputs.to_local() if use_local_output else outputs


# Style name -> factory (given the module, for styles that depend on its signature).
STYLES: dict[str, Callable[[nn.Module], ParallelStyle]] = {
    # Vocab-split table; partial sums reduce-scattered onto T, kept a DTensor (module docstring);
    # a Shard(1) of its own (_EmbeddingRowwise).
    "embedding_rowwise": lambda m: _EmbeddingRowwise(
        input_layouts=Replicate(), output_layouts=Shard(1), use_local_output=False
    ),
    # Norm on the local T slice, output a DTensor Shard(1) for the next gather_sequence/head.
    "sequence_parallel": lambda m: SequenceParallel(sequence_dim=1),
    "gather_sequence": _gather_sequence,
    "split_keep_mask": _split_keep_mask,
    # Replicated input -> output split on the last dim (heads / ffn), returned local: the
    # attention reshapes it with -1 heads and SDPA/FlexAttention run on plain tensors.
    "colwise": lambda m: ColwiseParallel(),
    # Input split on the last dim -> partial sums reduce-scattered onto T, kept a DTensor.
    "rowwise": lambda m: RowwiseParallel(output_layouts=_SEQ, use_local_output=False),
    # Sequence-sharded input gathered, vocab-split matmul, logits gathered to full (Replicate).
    # use_local_output: a plain tensor reaches F.cross_entropy.
    "colwise_head": lambda m: ColwiseParallel(
        input_layouts=_SEQ, output_layouts=Replicate(), use_local_output=True
    ),
    # A module that works on this rank's own tokens (an MoE layer, expert TP size 1): it gets
    # the local T slice as a plain tensor and its output is the local slice of a Shard(1)
    # DTensor. Its parameters stay plain tensors, replicated over tp; each rank's gradient is
    # a partial sum over its tokens, summed over tp by reduce_partial_grads.
    "sequence_local": lambda m: PrepareModuleInputOutput(
        input_layouts=(_SEQ,),
        desired_input_layouts=(_SEQ,),
        use_local_input=True,
        output_layouts=(_SEQ,),
        desired_output_layouts=(_SEQ,),
        use_local_output=False,
    ),
    # A module split over tp inside (an MoE layer, expert TP size = tp): the T slices gathered
    # into a plain full-sequence tensor, and its plain output taken as partial sums over tp,
    # reduce-scattered onto T (one collective each way, as for the dense MLP).
    "gather_sequence_partial_out": lambda m: PrepareModuleInputOutput(
        input_layouts=(_SEQ,),
        desired_input_layouts=(Replicate(),),
        use_local_input=True,
        output_layouts=(Partial(),),
        desired_output_layouts=(_SEQ,),
        use_local_output=False,
    ),
    # Replicated parameters fed identical inputs whose gradients come out partial over tp (an
    # MoE router weighting partial expert outputs): the module is left as it is and its
    # parameters are summed over tp by reduce_partial_grads.
    "replicate": lambda m: _Unchanged(),
    # Split on the last dim -> local partial sums, left for the enclosing module to reduce.
    "rowwise_partial": lambda m: RowwiseParallel(output_layouts=Partial(), use_local_output=True),
    # Stacked experts (models.moe.GroupedExperts) split on their hidden dim: w1/w3 (E, F, D)
    # on F, w2 (E, D, F) on F; each rank's grouped GEMMs give partial sums over tp.
    "experts_hidden": lambda m: _SplitExperts(),
    # Per-head parameters the module reads itself, not through a linear (Gated DeltaNet's
    # conv1d weight, A_log, dt_bias; models/hybrid_plan.py): its own parameters split on dim 0
    # with the heads; the module computes with their local blocks (to_local()).
    "split_rows": lambda m: _SplitRows(),
    # gather_sequence, and the module's own parameters split as split_rows.
    "gather_sequence_split_rows": lambda m: _SplitRows(_gather_sequence(m)),
}

# Styles whose parameters get a partial gradient on each tp rank (reduce_partial_grads).
_PARTIAL_GRAD_STYLES = ("sequence_local", "replicate")


class _Unchanged(ParallelStyle):
    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        return module


class _SplitExperts(ParallelStyle):
    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        from models.moe import EXPERT_HIDDEN_DIM

        for name, dim in EXPERT_HIDDEN_DIM.items():
            full = getattr(module, name)
            # Each rank cuts its own block (on the meta device: no data, no communication).
            # The module's own forward runs on the shards' local blocks, giving this rank's
            # partial sum (models.moe.GroupedExperts).
            shard = distribute_tensor(full.detach(), device_mesh, [Shard(dim)], src_data_rank=None)
            setattr(module, name, nn.Parameter(shard, full.requires_grad))
        return module


class _SplitRows(ParallelStyle):
    def __init__(self, then: ParallelStyle | None = None) -> None:
        self.then = then

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        for name, full in list(module.named_parameters(recurse=False)):
            # Each rank cuts its own block, as _SplitExperts does.
            shard = distribute_tensor(full.detach(), device_mesh, [Shard(0)], src_data_rank=None)
            setattr(module, name, nn.Parameter(shard, full.requires_grad))
        return module if self.then is None else self.then._apply(module, device_mesh)


def _match(name: str, pattern: str) -> bool:
    # "*" stands for exactly one path component, as in parallelize_module.
    parts, pats = name.split("."), pattern.split(".")
    return len(parts) == len(pats) and all(
        fnmatchcase(a, p) for a, p in zip(parts, pats, strict=True)
    )


def _shared_params(model: nn.Module) -> list[list[tuple[nn.Module, str]]]:
    """Groups of (module, name) that hold the same Parameter object (tied weights)."""
    owners: dict[int, list[tuple[nn.Module, str]]] = {}
    for module in model.modules():
        for name, param in module._parameters.items():
            if param is not None:
                owners.setdefault(id(param), []).append((module, name))
    return [group for group in owners.values() if len(group) > 1]


def _retie(groups: list[list[tuple[nn.Module, str]]]) -> None:
    # parallelize_module registers a new Parameter(DTensor) on every module it shards, so a
    # tied weight comes out as two different parameters (two copies, two gradients).
    # Put the first one back everywhere, after checking both sides agree on the layout.
    for group in groups:
        first_module, first_name = group[0]
        keep = getattr(first_module, first_name)
        for module, name in group[1:]:
            other = getattr(module, name)
            if other is keep:
                continue
            keep_layout = keep.placements if isinstance(keep, DTensor) else None
            other_layout = other.placements if isinstance(other, DTensor) else None
            if keep_layout != other_layout:
                raise ValueError(
                    f"tied parameter {first_name!r} of {type(first_module).__name__} and "
                    f"{name!r} of {type(module).__name__} got different tensor-parallel "
                    f"layouts ({keep_layout} vs {other_layout}); give both the same split"
                )
            setattr(module, name, keep)


def apply_tp(model: nn.Module, tp_mesh: DeviceMesh, plan: dict[str, str]) -> None:
    """Apply `plan` (module-path pattern -> style name, see STYLES) to `model` in place.

    Works on a meta-device model (parameters become meta DTensors). Raises ValueError for an
    unknown style name or a pattern that matches no module, before touching the model.
    """
    module_names = [name for name, _ in model.named_modules() if name]
    resolved: list[tuple[str, str]] = []
    for pattern, style in plan.items():
        if style not in STYLES:
            raise ValueError(
                f"tensor-parallel plan: unknown style {style!r} for {pattern!r}; "
                f"known: {sorted(STYLES)}"
            )
        matches = [name for name in module_names if _match(name, pattern)]
        if not matches:
            raise ValueError(
                f"tensor-parallel plan: pattern {pattern!r} matches no module of "
                f"{type(model).__name__}"
            )
        resolved.extend((name, style) for name in matches)

    tied = _shared_params(model)
    for name, style in resolved:
        module = model.get_submodule(name)
        parallelize_module(model, tp_mesh, {name: STYLES[style](module)})
    _retie(tied)


def partial_grad_params(model: nn.Module, plan: dict[str, str]) -> list[nn.Parameter]:
    """Parameters of the modules `plan` gives a "sequence_local" or "replicate" style: their
    gradients are partial over tp and need reduce_partial_grads."""
    names = [name for name, _ in model.named_modules() if name]
    params: dict[int, nn.Parameter] = {}
    for pattern, style in plan.items():
        if style not in _PARTIAL_GRAD_STYLES:
            continue
        for name in names:
            if _match(name, pattern):
                for p in model.get_submodule(name).parameters():
                    params.setdefault(id(p), p)
    return list(params.values())


@torch.no_grad()
def reduce_partial_grads(params: list[nn.Parameter], tp_mesh: DeviceMesh) -> None:
    """Sum the gradients of `params` over the tp ranks (their local shards, whatever other
    sharding they carry: FSDP's over dp, expert parallel's over ep). Once per step."""
    group = tp_mesh.get_group()
    for p in params:
        if p.grad is not None:
            grad = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
            dist.all_reduce(grad, group=group)
