"""bf16 working copies of fp32 master weights: one cast per optimizer step instead of one per use.

What
    working_weight_params(model): the parameters that get a working copy: the floating
        parameters of two or more dimensions (the matmul weights autocast casts on each use),
        except the token embedding and the output head and anything tied to them.
    WorkingWeights(model, masters, dtype): for each parameter of `masters` a Parameter of
        `dtype` holding the master's value rounded to nearest. The fp32 master stays the
        model's Parameter everywhere outside the forward and backward (optimizer, clipping,
        norms, replica checks, checkpoints and export see only masters).
        installed() -> context manager: the modules hold the working copies (forward, backward
            and activation-checkpoint recomputes run inside it).
        refresh(): the masters copied into the working copies (after each optimizer step);
        refresh_in(optimizer) hands that to an optimizer that writes the copies itself.
        Gradients: a post-accumulate-grad hook on each copy adds its micro-batch gradient into
        the master's fp32 .grad and drops it; collect_grads() moves those a zero-bubble
        pipeline's weight half set itself (no hook ran). No masters: nothing held or installed.

Numerics
    Bitwise the same as autocast on the fp32 masters (the same round-to-nearest cast, the same
    GEMM operands, the same bf16 gradients added in the same order), except a weight used twice
    in one micro-batch (none in models/: summed in bf16 before the hook). The FP8 linears'
    weights get no copy (graphtrain.precision.graph_cast): their op casts the master.
    Why, which parameters and layouts, and the predicted costs: docs/design/working_weights.md.
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

    def collect_grads(self) -> None:
        """Gradients set on the copies directly, moved into the masters as the hook moves the
        accumulated ones (a copy whose hook ran has none)."""
        for master, copy in zip(self._masters, self._copies, strict=True):
            if copy.grad is not None:
                _into_master(master, copy)

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
