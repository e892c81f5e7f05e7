"""Parameter storage dtype, and fp32 gradient accumulation for chosen parameters.

What
    cast_parameters_(model, dtype): store every floating parameter of a (meta-device) model in
        `dtype`, keeping tied parameters tied; buffers keep their dtype (RoPE tables, MoE expert
        biases stay fp32).
    FP32GradAccumulator(model, patterns): for the parameters whose dotted name matches one of
        the fnmatch `patterns` and that are not fp32, sums the gradient of every micro-batch
        into an fp32 buffer (after_backward, once per micro-batch) instead of letting autograd
        add bf16 gradients into a bf16 .grad; finalize() puts the sum back as .grad, rounded
        once, before clipping and the optimizer step.

Why
    With training.master_dtype = "bfloat16" (no fp32 master copy: half the parameter and
    gradient memory) autograd accumulates the micro-batch gradients in bf16: each addition
    rounds to 8 bits of mantissa, so a step of 16 micro-batches carries up to 16 roundings, and
    small per-micro-batch contributions (router and norm gradients are the usual victims) can
    vanish entirely. Accumulating those few parameters in fp32 costs 4 bytes per element of
    them only, and leaves one rounding per step. With fp32 parameters the gradients already
    accumulate in fp32 and the accumulator holds nothing.

Works with DTensor (FSDP2 / TP) parameters: .grad is a DTensor and the buffer is one, sharded
alike. No host synchronisation.
"""

from __future__ import annotations

from fnmatch import fnmatch

import torch
from torch import nn


def cast_parameters_(model: nn.Module, dtype: torch.dtype) -> None:
    """Replace every floating parameter by one of `dtype` (in place; ties preserved)."""
    new: dict[int, nn.Parameter] = {}
    for module in model.modules():
        for name, param in list(module.named_parameters(recurse=False)):
            if not param.is_floating_point() or param.dtype == dtype:
                continue
            key = id(param)
            if key not in new:
                new[key] = nn.Parameter(param.detach().to(dtype), param.requires_grad)
            setattr(module, name, new[key])


class FP32GradAccumulator:
    def __init__(self, model: nn.Module, patterns: list[str]) -> None:
        names: dict[int, list[str]] = {}
        params: dict[int, nn.Parameter] = {}
        for name, param in model.named_parameters(remove_duplicate=False):
            names.setdefault(id(param), []).append(name)
            params.setdefault(id(param), param)
        for pattern in patterns:
            if not any(fnmatch(n, pattern) for ns in names.values() for n in ns):
                raise ValueError(
                    f"optim.fp32_grad_accum pattern {pattern!r} matches no parameter name "
                    f"(names look like {next(iter(names.values()))[0]!r})"
                )
        self.params = [
            p
            for key, p in params.items()
            if p.requires_grad
            and p.dtype != torch.float32
            and any(fnmatch(n, pat) for n in names[key] for pat in patterns)
        ]
        self._sums: dict[int, torch.Tensor] = {}

    def after_backward(self) -> None:
        """Move this micro-batch's gradients of the chosen parameters into the fp32 sums."""
        for p in self.params:
            if p.grad is None:
                continue
            total = self._sums.get(id(p))
            if total is None:
                self._sums[id(p)] = p.grad.float()
            else:
                total.add_(p.grad)  # bf16 promoted into the fp32 sum
            p.grad = None

    def finalize(self) -> None:
        """Put the step's sums back as .grad (one rounding to the parameter dtype)."""
        for p in self.params:
            total = self._sums.pop(id(p), None)
            if total is not None:
                p.grad = total.to(p.dtype)
