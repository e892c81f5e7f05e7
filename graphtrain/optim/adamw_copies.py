"""AdamW whose step also writes the bf16 working copies of the fp32 masters (graphtrain::adamw_step).

What
    AdamWCopies(groups, lr=, betas=, eps=, weight_decay=, state_dtype=): torch.optim.AdamW's
    update (amsgrad and maximize refused), with fp32 or bf16 moments (bf16: the maths of
    graphtrain.optim.adamw_bf16). attach_working_copies(masters, copies) (called by
    WorkingWeights.refresh_in) makes each step write every attached master's new value, rounded,
    into its copy, in the same pass; the foreach refresh after the step is then not needed.
    scale_grads_in_step(grads, coef) (graphtrain.optim.clip's `scale=`, which TrainStep passes)
    makes the next step read every gradient times coef, clipping's coefficient, instead of
    clipping multiplying them in a pass of its own (the gradients are left unscaled).
    Each step is one graphtrain::adamw_step launch per (param group, step count, with or without
    copies): four or so for the trainer's decay / no-decay and plain / DTensor groups.
    optim.implementation = "graphtrain", and "auto"'s choice for fp32 parameters on CUDA since
    benchmarks/adamw_step.py measured it on an H200: 9.1 ms against torch's clip + fused step
    + refresh's 13.7 for moe-1b (benchmarks/RESULTS.md).

State dict
    torch.optim.AdamW's: per parameter "step" (a float32 tensor), "exp_avg", "exp_avg_sq"; the
    param groups carry AdamW's keys (fused True: a torch AdamW resuming from it runs fused).
    Checkpoints resume across the switch both ways; loading keeps "step" on the host (reading it
    costs no device sync) and the moments in state_dtype.
    The bytes per weight against torch's step, predictions and what is not done:
    docs/design/working_weights.md.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from graphtrain.custom_ops.adamw_step import adamw_step, adamw_step_ref
from graphtrain.optim.adamw_base import AdamWBase, local_shard

# torch.optim.AdamW's group keys, so that its load_state_dict reads ours unchanged.
_ADAMW_GROUP_KEYS = {
    "amsgrad": False,
    "maximize": False,
    "foreach": None,
    "capturable": False,
    "differentiable": False,
    "fused": True,
    "decoupled_weight_decay": True,
}


def _forget_grad_scale(optimizer: AdamWCopies, args: Any, kwargs: Any) -> None:
    optimizer._grad_scale = None


class AdamWCopies(AdamWBase):
    def __init__(
        self, params: Iterable[Any], *, state_dtype: torch.dtype = torch.float32, **hyper: Any
    ) -> None:
        """AdamWBase's hyperparameters (lr, betas, eps, weight_decay); fp32 or bf16 moments."""
        if state_dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(
                f"AdamWCopies: state_dtype must be float32 or bfloat16, got {state_dtype}"
            )
        super().__init__(params, state_dtype=state_dtype, **hyper, **_ADAMW_GROUP_KEYS)
        for group in self.param_groups:
            for p in group["params"]:
                if p.dtype != torch.float32:
                    raise ValueError(
                        f"AdamWCopies needs fp32 parameters (master weights), got {p.dtype}; use "
                        "optim.implementation = 'fused' or 'foreach' for other dtypes"
                    )
        self._copies: dict[int, torch.Tensor] = {}
        self._grad_scale: torch.Tensor | None = None  # for the next step only
        self.register_step_post_hook(_forget_grad_scale)

    def attach_working_copies(
        self, masters: list[torch.Tensor], copies: list[torch.Tensor]
    ) -> None:
        """From now on each step writes masters[i]'s new value, rounded, into copies[i]."""
        mine = {id(p) for group in self.param_groups for p in group["params"]}
        for master, copy in zip(masters, copies, strict=True):
            if id(master) not in mine:
                raise ValueError(
                    "attach_working_copies: a master is not among the optimizer's params"
                )
            self._copies[id(master)] = local_shard(copy)

    def scale_grads_in_step(self, grads: list[torch.Tensor], coef: torch.Tensor) -> None:
        """The next step() multiplies every gradient it reads by `coef` (a one-element tensor;
        `grads`, the clipped ones, are what it will read: the gradients of its params)."""
        self._grad_scale = coef.reshape(()).to(torch.float32)

    def _loaded(self, s: dict[str, Any]) -> None:
        if "step" in s:  # a fused torch AdamW keeps it on the device: one sync, here only
            s["step"] = s["step"].to("cpu", torch.float32)
        super()._loaded(s)

    def _step_group(self, group: dict[str, Any]) -> None:
        for flag in ("amsgrad", "maximize"):
            if group.get(flag):
                raise ValueError(
                    f"AdamWCopies does not implement {flag}=True; use torch.optim.AdamW"
                )
        lr = group["lr"]
        if isinstance(lr, torch.Tensor):
            if lr.device.type != "cpu":
                raise ValueError(
                    f"AdamWCopies takes lr as a float or a CPU tensor, got a tensor on {lr.device}"
                )
            lr = lr.item()  # a CPU tensor: no device sync
        # One launch per (step count, with copies or not, contiguous or not).
        buckets: dict[tuple[float, bool, bool], list[list[torch.Tensor]]] = {}
        for p in group["params"]:
            if p.grad is None:
                continue
            if p.grad.is_sparse:
                raise ValueError("AdamWCopies does not support sparse gradients")
            state = self._advance(p)
            tensors = [local_shard(t) for t in (p, p.grad, state["exp_avg"], state["exp_avg_sq"])]
            copy = self._copies.get(id(p))
            contiguous = all(t.is_contiguous() for t in tensors)
            key = (state["step"].item(), copy is not None, contiguous)
            lists = buckets.setdefault(key, [[], [], [], [], []])
            for i, t in enumerate([*tensors, *([copy] if copy is not None else [])]):
                lists[i].append(t)
        beta1, beta2 = group["betas"]
        for (step, _, contiguous), lists in buckets.items():
            # A strided shard (none in today's layouts) takes torch's foreach ops.
            kernel = adamw_step if contiguous else adamw_step_ref
            scale = self._grad_scale
            if scale is not None:
                scale = scale.to(lists[0][0].device)
            kernel(
                *lists,
                scale,
                lr=lr,
                beta1=beta1,
                beta2=beta2,
                eps=group["eps"],
                weight_decay=group["weight_decay"],
                step=step,
            )
