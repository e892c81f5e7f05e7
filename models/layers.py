"""Pieces every model file shares: RMSNorm, the truncated-normal init, a rank's block of a
split weight. Imports no distributed, compile or kernel code."""

from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in fp32 whatever the activation dtype: bf16 squares lose too much.
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return xf.type_as(x) * self.weight

    def init_weights(self) -> None:
        nn.init.ones_(self.weight)


def init_trunc_normal(std: float, *weights: torch.Tensor) -> None:
    """Each weight in place, in order: normal(0, std) truncated at 3 std."""
    for w in weights:
        nn.init.trunc_normal_(w, std=std, a=-3 * std, b=3 * std)


def is_sharded(t: torch.Tensor) -> bool:
    """Whether t is a parameter that tensor or expert parallelism split (a DTensor). Duck-typed,
    so models/ imports no distributed code. The type is asked, not t: Dynamo (torch 2.13)
    answers hasattr on a tensor from torch.Tensor's methods, without its subclass's."""
    return hasattr(type(t), "to_local")


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """This rank's block of a sharded parameter (to_local() keeps autograd), t itself otherwise."""
    return t.to_local() if is_sharded(t) else t
