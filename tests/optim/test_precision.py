"""cast_parameters_ and FP32GradAccumulator: bf16 parameters, gradients summed in fp32."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from graphtrain.optim import FP32GradAccumulator, cast_parameters_


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 16)
        self.norm = nn.LayerNorm(16)
        self.out = nn.Linear(16, 10, bias=False)
        self.out.weight = self.emb.weight  # tied
        self.register_buffer("table", torch.ones(3))


def test_cast_keeps_ties_and_buffers():
    model = Tiny()
    cast_parameters_(model, torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    assert model.out.weight is model.emb.weight
    assert model.table.dtype == torch.float32


def _micro_grads(n: int) -> list[torch.Tensor]:
    # One large micro-batch gradient, then many small ones: in bf16 (8 bits of mantissa) each
    # small addition to ~1.0 rounds away; in fp32 they add up to ~6% of the total.
    g = torch.Generator().manual_seed(0)
    first = torch.ones(16, dtype=torch.bfloat16)
    rest = [(torch.rand(16, generator=g) * 2e-3).to(torch.bfloat16) for _ in range(n - 1)]
    return [first, *rest]


def _accumulate(patterns: list[str], grads: list[torch.Tensor]) -> torch.Tensor:
    model = Tiny()
    cast_parameters_(model, torch.bfloat16)
    acc = FP32GradAccumulator(model, patterns)
    for g in grads:
        # What autograd does: add into an existing .grad in the parameter's dtype.
        w = model.norm.weight
        w.grad = g.clone() if w.grad is None else w.grad + g
        acc.after_backward()
    acc.finalize()
    return model.norm.weight.grad


def test_fp32_accumulation_rounds_once():
    grads = _micro_grads(64)
    exact = torch.stack([g.double() for g in grads]).sum(0)
    fp32 = _accumulate(["norm.*"], grads)
    assert fp32.dtype == torch.bfloat16
    # One rounding of the exact sum (the fp32 sum is off by far less than bf16 spacing).
    assert torch.equal(fp32, exact.to(torch.bfloat16))
    # Without the pattern the small contributions vanish in bf16 accumulation.
    plain = _accumulate([], grads)
    assert torch.equal(plain, torch.ones_like(plain)), plain
    assert (exact > 1.05).all()


def test_unmatched_pattern_is_refused():
    with pytest.raises(ValueError, match=r"'router\.\*' matches no parameter"):
        FP32GradAccumulator(Tiny(), ["router.*"])


def test_fp32_parameters_need_no_accumulator():
    assert FP32GradAccumulator(Tiny(), ["norm.*"]).params == []
