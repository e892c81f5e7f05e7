"""MoE routing balance across a training step: count reduction, expert-bias updates, metrics.

What
    install_router_balance(model, optimizer, mesh, dims, bias_update_rate) drives the routers
    of an MoE model (models.moe.Router, through model.routers(); a dense model gets None). It
    returns a RouterBalance, a step hook of graphtrain.step.TrainStep:
        reduce_counts  each router's count reducer: a functional all-reduce (sum) over the
                  ranks that route different tokens (data-parallel and expert-parallel ranks
                  and, with expert TP size 1, the tp ranks), traced into the compiled block;
        micro_batch(weight)  around one micro-batch's forward and backward: before, the
                  micro-batch's loss weight / tp becomes the routers' aux-loss scale; after,
                  step_counts += its dispatch counts (for the bias update), with global_aux
                  step_plain_counts += its plain top-k counts, and the aux losses are summed
                  for logging;
        optimizer step pre-hook  once per step, before optimizer.step(): per-layer load and
                  bias statistics, then Router.update_bias (the bias moves by
                  rate * sign(mean_load - load_e)) and step_counts reset;
        statistics()  the last step's statistics as detached device tensors (no host sync),
                  among them each layer's count of tokens whose router logits were not finite
                  (the loop stops at the next log step naming the layer).
    The model file imports no distributed code: the reducer is injected from here. Why the
    counts are accumulated after the backward and reduced in the forward, and the aux-loss
    scale under tp: docs/design/moe_balance.md.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Collection, Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from graphtrain.parallel import ParallelDims, dp_mesh

# The statistic of each layer's tokens whose router logits were not finite (the loop stops on it).
NONFINITE = "nonfinite_router_tokens"


def _sum_over(t: torch.Tensor, group_name: str) -> torch.Tensor:
    # By the group's name: the group itself would be an input of the compiled graphs, which keep
    # it to the end of the process (docs/design/parallel.md, "The end of a job").
    return funcol.all_reduce(t, "sum", group_name)


class RouterBalance:
    def __init__(
        self,
        model: nn.Module,
        *,
        count_group: dist.ProcessGroup | None,
        token_slices: int,
        bias_update_rate: float,
    ) -> None:
        self.model = model
        self.routers = model.routers()
        self.rate = bias_update_rate
        self.token_slices = token_slices
        for _, router in self.routers:
            router.reduce_counts = (
                functools.partial(_sum_over, group_name=count_group.group_name)
                if count_group is not None
                else None
            )
        self._aux: dict[str, torch.Tensor] = {}
        # Per layer: tokens with NaN/inf router logits since the start (a running total, so
        # a step between two log steps is never missed; any count stops the run).
        self._nonfinite: dict[str, torch.Tensor] = {}
        self._stats: dict[str, torch.Tensor] = {}
        self._micro_batches = 0  # since the last optimizer step

    @contextlib.contextmanager
    def micro_batch(self, weight: float, layers: Collection[str] | None = None) -> Iterator[None]:
        """layers: only these layers' routers (a pipeline stage's, around its forward alone:
        graphtrain.parallel.pipeline); None: all of them."""
        routers = [(n, r) for n, r in self.routers if layers is None or n in layers]
        # The routers' gradients are summed over the token_slices tp ranks: each rank's aux
        # losses (of its slice, or the same whole-sequence ones) count 1/tp.
        if layers is None:
            self.model.set_aux_loss_scale(weight / self.token_slices)
        else:
            # A fresh scale per micro-batch: a pipeline runs this micro-batch's backward after
            # other micro-batches' forwards, and the backward reads the scale its forward saved.
            for _, router in routers:
                scale = torch.full(
                    (), weight / self.token_slices, device=router.aux_loss_scale.device
                )
                router.aux_loss_scale = scale
        yield
        self._micro_batches += 1
        for layer, router in routers:
            router.accumulate_counts()
            if router.last_nonfinite is not None:
                self._nonfinite[layer] = self._nonfinite.get(layer, 0) + router.last_nonfinite
            for name, value in router.last_aux.items():
                self._aux[name] = self._aux.get(name, 0.0) + value * weight

    @torch.no_grad()
    def before_optimizer_step(self, *_: Any) -> None:
        """Optimizer step pre-hook (torch.optim.Optimizer.register_step_pre_hook)."""
        if not self._micro_batches:
            # A step with no training forward (e.g. the optimizer-state initialisation of a
            # checkpoint load): there are no counts to act on.
            return
        stats = {}
        for name, router in self.routers:
            load = router.step_counts
            stats[f"moe/{name}/load_max_over_mean"] = load.max() / load.mean().clamp(min=1e-9)
            if router.expert_bias is not None:
                stats[f"moe/{name}/bias_absmax"] = router.expert_bias.abs().max()
            router.update_bias(self.rate)
        # Aux losses: summed over the layers, averaged over the step's micro-batches.
        stats.update({f"moe/{name}_loss": value for name, value in self._aux.items()})
        stats.update({f"moe/{n}/{NONFINITE}": count for n, count in self._nonfinite.items()})
        self._stats, self._aux, self._micro_batches = stats, {}, 0

    def statistics(self) -> dict[str, torch.Tensor]:
        """The last optimizer step's statistics (device tensors)."""
        return dict(self._stats)


def install_router_balance(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    mesh: DeviceMesh | None,
    dims: ParallelDims,
    *,
    bias_update_rate: float,
) -> RouterBalance | None:
    """A RouterBalance for `model`'s routers, its expert-bias update registered as `optimizer`'s
    step pre-hook; None for a model without routers."""
    if not getattr(model, "routers", lambda: [])():
        return None
    if dims.tp > 1 and dims.etp == 1:
        # Every rank routes different tokens: dp rows and, within a tp group, sequence slices
        # (with etp = tp every tp rank routes the whole sequence).
        count_group = dist.group.WORLD
        if dims.pp_enabled:  # those of this pipeline rank's stages: the other axes flattened
            axes = tuple(name for name in mesh.mesh_dim_names if name != "pp")
            count_group = mesh[axes]._flatten("pp_stage").get_group()
    else:
        count_group = dp_mesh(mesh).get_group() if dims.dp_size > 1 else None
    balance = RouterBalance(
        model, count_group=count_group, token_slices=dims.tp, bias_update_rate=bias_update_rate
    )
    optimizer.register_step_pre_hook(balance.before_optimizer_step)
    return balance
