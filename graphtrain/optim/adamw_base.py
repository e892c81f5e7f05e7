"""What graphtrain's two AdamW optimizers share (AdamWBF16, AdamWCopies).

Contract
    torch.optim.AdamW's state layout: per parameter "step" (a float32 CPU scalar, so reading
    it costs no device sync), "exp_avg" and "exp_avg_sq" in `state_dtype`, created at the
    parameter's first step. load_state_dict casts the loaded moments back to state_dtype
    (torch.optim.Optimizer casts them to the parameter dtype). The constructor takes AdamW's
    hyperparameters (lr, betas, eps, weight_decay) and state_dtype. A subclass implements
    _step_group(group) for one param group; step() runs the closure, then every group.
    local_shard: a DTensor's local shard (a view), else the tensor itself.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch.distributed.tensor import DTensor

MOMENTS = ("exp_avg", "exp_avg_sq")


def local_shard(t: torch.Tensor) -> torch.Tensor:
    """The local shard of a DTensor (a view: updating it updates the DTensor), else the tensor."""
    return t.to_local() if isinstance(t, DTensor) else t


class AdamWBase(torch.optim.Optimizer):
    def __init__(
        self,
        params: Iterable[Any],
        *,
        lr: float,
        betas: tuple[float, float],
        eps: float,
        weight_decay: float,
        state_dtype: torch.dtype,
        **group_keys: Any,
    ) -> None:
        """AdamW's hyperparameters, then any further keys every param group carries."""
        defaults = {"lr": lr, "betas": tuple(betas), "eps": eps, "weight_decay": weight_decay}
        super().__init__(params, {**defaults, **group_keys})
        self.state_dtype = state_dtype

    def state_bytes(self) -> int:
        """Bytes of the moment states this rank holds (0 before the first step)."""
        return sum(
            local_shard(s[k]).numel() * local_shard(s[k]).element_size()
            for s in self.state.values()
            for k in MOMENTS
            if k in s
        )

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        for s in self.state.values():
            self._loaded(s)

    def _loaded(self, s: dict[str, Any]) -> None:
        for k in MOMENTS:
            if k in s:
                s[k] = s[k].to(self.state_dtype)

    def _advance(self, p: torch.Tensor) -> dict[str, Any]:
        """p's state, created at its first step, with its step count advanced."""
        state = self.state[p]
        if not state:
            # A float32 CPU scalar, as torch's non-fused AdamW keeps it.
            state["step"] = torch.tensor(0.0)
            state["exp_avg"] = torch.zeros_like(p, dtype=self.state_dtype)
            state["exp_avg_sq"] = torch.zeros_like(p, dtype=self.state_dtype)
        state["step"] += 1
        return state

    def _step_group(self, group: dict[str, Any]) -> None:
        raise NotImplementedError

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            self._step_group(group)
        return loss
