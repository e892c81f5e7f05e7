"""AdamW with its moment states stored in bf16: half the optimizer memory, fp32 math.

What: the same update as torch.optim.AdamW (decoupled weight decay, bias correction, eps added
after the square root), with `exp_avg` and `exp_avg_sq` kept in `state_dtype` (bf16). Each step
upcasts one parameter's moments to fp32, updates them and the parameter in fp32, and stores the
moments back rounded to nearest (even) - no stochastic rounding. Parameters themselves keep their
dtype (the fp32 master weights of graphtrain).

Why per parameter: upcasting every state at once would bring back the fp32 footprint at the peak;
one parameter at a time adds only the largest parameter's fp32 moments. It is slower than the fused
kernel (a handful of elementwise ops per parameter), the price of the memory.

Checkpoints: the moments are bf16 tensors (DTensors under FSDP/TP, sharded like their
parameters), so DCP saves and loads them as bf16. `load_state_dict` casts them back to
`state_dtype`, because torch.optim.Optimizer casts loaded states to the parameter dtype.

Numerics: bf16 keeps 8 bits of mantissa, so each stored moment carries a relative rounding error of
at most 2**-9; the update m / (sqrt(v) + eps) is then within about 0.3% of the fp32 one per step
(tests compare the first steps with torch.optim.AdamW).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch

from graphtrain.optim.adamw_base import AdamWBase, local_shard


class AdamWBF16(AdamWBase):
    def __init__(
        self, params: Iterable[Any], *, state_dtype: torch.dtype = torch.bfloat16, **hyper: Any
    ) -> None:
        """AdamWBase's hyperparameters (lr, betas, eps, weight_decay); bf16 moments by default."""
        super().__init__(params, state_dtype=state_dtype, **hyper)

    def _step_group(self, group: dict[str, Any]) -> None:
        beta1, beta2 = group["betas"]
        lr, eps, wd = group["lr"], group["eps"], group["weight_decay"]
        for p in group["params"]:
            if p.grad is None:
                continue
            state = self._advance(p)
            step = state["step"].item()  # a CPU tensor: no device sync
            param, grad = local_shard(p), local_shard(p.grad).float()
            exp_avg, exp_avg_sq = (
                local_shard(state["exp_avg"]),
                local_shard(state["exp_avg_sq"]),
            )
            m, v = exp_avg.float(), exp_avg_sq.float()
            m.lerp_(grad, 1 - beta1)
            v.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
            exp_avg.copy_(m)  # round to nearest on store
            exp_avg_sq.copy_(v)
            bias1, bias2 = 1 - beta1**step, 1 - beta2**step
            denom = (v.sqrt() / math.sqrt(bias2)).add_(eps)
            # Not in place: with fp32 states, m is the stored exp_avg itself.
            update = torch.div(m, denom).mul_(lr / bias1)
            if param.dtype == torch.float32:
                param.mul_(1 - lr * wd).sub_(update)
            else:
                param.copy_(param.float().mul_(1 - lr * wd).sub_(update))
