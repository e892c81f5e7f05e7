"""bf16 working copies of fp32 master weights: one cast per optimizer step instead of one per use.

What
    working_weight_params(model): the parameters that get a working copy (see "Which").
    WorkingWeights(model, masters, dtype): for each parameter of `masters` (fp32: those of
        working_weight_params(model), the expert-parallel weights under FSDP, or none to turn
        the copies off; graphtrain.run chooses) a Parameter of `dtype` holding the master's
        value rounded to nearest (the working copy). The fp32 master stays the model's Parameter
        everywhere outside the forward and backward: the optimizer, clipping, norms, replica
        checks, checkpoints and export see only masters.
        installed() -> context manager: the modules hold the working copies; the forward, the
            backward and activation-checkpoint recomputes of a step run inside it.
        refresh(): the masters copied into the working copies (after each optimizer step).
        refresh_in(optimizer): hands the refresh to an optimizer whose step writes the copies
            itself (graphtrain.optim.adamw_copies, optim.implementation = "graphtrain");
            refresh() then does nothing.
        Gradients: a post-accumulate-grad hook on each working copy adds its micro-batch
        gradient (bf16, as the GEMM wrote it) into the master's fp32 .grad the moment autograd
        has it, and drops it: the first micro-batch's is widened, the later ones are added with
        type promotion (one kernel that reads bf16 and accumulates in fp32, no fp32 temporary).
    With no masters it holds nothing and installs nothing.

Why
    Under autocast with fp32 parameters, every matmul casts its fp32 weight to bf16 on every use,
    in every micro-batch (and again in an activation-checkpoint recompute), and the backward casts
    each bf16 weight gradient back to fp32 before autograd adds it to .grad. Megatron's
    mixed-precision optimizer keeps bf16 model weights refreshed from fp32 main weights after
    each step instead; this is the same design with the roles of the tensors inverted (the model
    keeps the masters as its Parameters, the copies are swapped in), so the optimizer, the
    checkpoint's names and the export need no change.

Which parameters
    The matmul weights autocast casts on each use: every floating parameter of two or more
    dimensions, except the token embedding (a lookup, which autocast does not cast: the residual
    stream starts in fp32) and the output head (the fused linear + cross-entropy op's fast mode
    accumulates the head's gradient in fp32 straight into its fp32 .grad: that exactness is
    kept, at the price of autocast's cast of the head, V x dim, per micro-batch), nor anything
    tied to them. Norm weights (1-D, applied in fp32), the MoE expert biases (fp32 buffers) keep
    their fp32 as today. The router gate is a linear autocast casts to bf16 today: it gets a copy
    and computes as before (its logits are cast up to fp32 after the GEMM).

Numerics
    Bitwise the same as autocast on the fp32 masters: the copy is the same round-to-nearest cast
    autocast makes, the GEMMs see the same operands, and the fp32 .grad receives the same bf16
    gradients added in the same order (tests: the train step, the trainer's loss curve, resume
    and export, tensor parallel, expert parallel under FSDP). Two exceptions. A weight used twice
    in one micro-batch (none in models/) has its two gradient contributions summed by autograd in
    bf16 before the hook, where autocast summed them in fp32. With training.fp8, the FP8 casts
    of graphtrain::fp8_linear read the bf16 copy instead of the fp32 master (as Megatron and
    TransformerEngine cast from bf16 model weights): the amax and the E4M3 values come from
    the weight rounded to bf16 first, a relative change below 2^-9 against E4M3's 2^-4 spacing;
    moe-debug on CPU, 6 steps: losses within 6e-5 relative of autocast's.

Layouts
    One process, and tensor parallel without data parallelism: the matmul weights above (DTensor
    copies with the masters' placements; GradientFinisher then reduces the masters' gradients as
    before). FSDP2 (dp > 1) casts its units' parameters itself: MixedPrecisionPolicy casts each
    local shard (1/dp of its bytes) once per all-gather, inside the copy into the all-gather
    buffer that it makes anyway, and reduces the gradients in reduce_dtype, so there is no
    per-use cast to remove and no copies of them. The exception is expert parallel (ep > 1):
    FSDP2 leaves the expert weights alone and the experts cast them to the activations' dtype on
    every use, so they get copies (in moe-1b the routed experts are 906M of the 979M matmul
    weights).

Cost, predicted (unmeasured). P = 979M matmul weights of moe-1b (1,046M parameters less the
    embedding and head, 33.5M each), m micro-batches a step, bytes per parameter per step:
        autocast today:   cast fp32->bf16 in forward (4 read + 2 write) and the gradient back
                          (2 + 4) in every micro-batch; autograd's .grad += (4 + 4 + 4) from the
                          second: 12m + 12(m - 1); plus 6m with activation checkpointing.
        working copies:   refresh once (4 + 2), widen the first gradient (2 + 4), then
                          .grad += bf16 (2 + 4 + 4): 12 + 10(m - 1).
    moe-1b's default recipe (m = 1, no checkpointing): 12 against 12 bytes, the same 11.7 GB
    (the 4.2 ms measured): no byte saved, only kernels (one foreach copy a step instead of one
    cast kernel per weight and micro-batch); the cast per micro-batch is gone, and what remains
    is the refresh and the widening. With m = 4: 84 against 42 bytes, 82 against 41 GB, 27 ms
    against 14 ms a step at 3.0 TB/s; with checkpointing on, 6 bytes per micro-batch more
    saved. Under expert parallel the same arithmetic holds for the expert weights. At m = 1
    the 12 bytes shrink only with two kernel changes. The refresh fused into the optimizer
    kernel (the bf16 write next to the fp32 one: 2 bytes instead of 6) is built: refresh_in,
    graphtrain.optim.adamw_copies, with optim.implementation = "graphtrain" (opt-in until
    measured); 8 bytes, 7.8 GB, 2.6 ms against 3.9 ms a step on moe-1b at 3.0 TB/s (predicted,
    unmeasured). A weight-gradient GEMM that
    writes fp32 into .grad (Megatron's gradient-accumulation fusion: 2 bytes more written
    instead of the widening's 6) would leave 4 bytes, 3.9 GB, 1.3 ms.
    Memory: a bf16 copy of the P weights (2 bytes each) lives through the run; autocast's bf16
    weights saved for the backward (2 bytes each, during every forward and backward) are gone.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch
from torch import nn

from graphtrain.optim.adamw_bf16 import local_shard

if TYPE_CHECKING:
    from graphtrain.optim.adamw_copies import AdamWCopies


def working_weight_params(model: nn.Module) -> list[nn.Parameter]:
    """The parameters that get a working copy (see the module docstring), each once."""
    kept: set[int] = set()
    for module in model.modules():
        if isinstance(module, nn.Embedding):
            kept.update(id(p) for p in module.parameters())
    head = getattr(model, "output", None)
    if isinstance(head, nn.Module):
        kept.update(id(p) for p in head.parameters())
    chosen: dict[int, nn.Parameter] = {}
    for param in model.parameters():
        if (
            param.requires_grad
            and param.is_floating_point()
            and param.ndim >= 2
            and id(param) not in kept
        ):
            chosen[id(param)] = param
    return list(chosen.values())


def _into_master(master: nn.Parameter, working: nn.Parameter) -> None:
    """Post-accumulate-grad hook: the working copy's gradient moves into the master's fp32 .grad."""
    grad = working.grad
    working.grad = None
    if master.grad is None:
        master.grad = grad.to(master.dtype)
    else:
        master.grad.add_(grad)  # bf16 promoted: accumulated in fp32, no widened temporary


class WorkingWeights:
    """Working copies of `masters` in `dtype`, swapped into `model` by installed() (see the
    module docstring)."""

    def __init__(self, model: nn.Module, masters: list[nn.Parameter], dtype: torch.dtype) -> None:
        for master in masters:
            if master.dtype != torch.float32:
                raise ValueError(f"working copies need fp32 master weights, got {master.dtype}")
        self._masters = masters
        self._refreshed_by_optimizer = False
        self._copies = [nn.Parameter(m.detach().to(dtype), requires_grad=True) for m in masters]
        for master, copy in zip(masters, self._copies, strict=True):
            copy.register_post_accumulate_grad_hook(functools.partial(_into_master, master))
        # Every (module, name) slot that holds a master (a parameter may sit in several).
        index = {id(m): i for i, m in enumerate(masters)}
        self._slots = [
            (module, name, index[id(p)])
            for module in model.modules()
            for name, p in module._parameters.items()
            if p is not None and id(p) in index
        ]

    @property
    def copies(self) -> list[nn.Parameter]:
        """The working copies, in the order of `masters`."""
        return self._copies

    @property
    def masters(self) -> list[nn.Parameter]:
        """The fp32 master weights that have a copy (the model's own Parameters)."""
        return self._masters

    @contextlib.contextmanager
    def installed(self) -> Iterator[None]:
        """The model computes with the working copies inside; the masters are back after.
        Swapping the slots is what FSDP2 does with its sharded and unsharded parameters: the
        compiled regions see the same Parameter objects every step (no recompile; CUDA-graphed
        regions keep their addresses, refresh writes in place)."""
        for module, name, i in self._slots:
            module._parameters[name] = self._copies[i]
        try:
            yield
        finally:
            for module, name, i in self._slots:
                module._parameters[name] = self._masters[i]

    @torch.no_grad()
    def refresh(self) -> None:
        """The masters' current values, rounded, into the working copies (in place). DTensors
        copy their local shards (same placements; the foreach op has no DTensor rule)."""
        if self._copies and not self._refreshed_by_optimizer:
            torch._foreach_copy_(_locals(self._copies), _locals(self._masters))

    def refresh_in(self, optimizer: AdamWCopies) -> None:
        """From now on `optimizer.step()` writes the copies in its pass over the masters (a
        master it skips, having no gradient, is unchanged: its copy stays right); refresh()
        does nothing."""
        optimizer.attach_working_copies(self._masters, self._copies)
        self._refreshed_by_optimizer = True


def _locals(tensors: list[nn.Parameter]) -> list[torch.Tensor]:
    return [local_shard(t) for t in tensors]
