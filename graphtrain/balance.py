"""MoE routing state across a training step: count reduction, expert-bias updates, metrics.

What
    RouterBalance(model, count_group=..., token_slices=..., bias_update_rate=...) drives the
    routers of an MoE model (models.moe.Router, found through model.routers(); a dense model has
    none and every method is a no-op):
        install   each router's reduce_counts = an all-reduce (sum) over count_group, a
                  functional collective, so it traces into the compiled block; the routers then
                  see token counts summed over every rank that sees different tokens: the
                  data-parallel ranks (expert-parallel ranks included: they are carved out of
                  dp_shard) and, under tensor parallelism with expert TP size 1, the tp ranks
                  too (each routes its own sequence slice; the aux losses are then per slice);
                  token_slices = tp either way: the routers' gradients are summed over tp;
        before_micro_batch(weight)  the micro-batch's loss weight becomes its aux-loss scale
                  (the aux losses are averaged over the micro-batches like the loss);
        after_micro_batch()  step_counts += the counts of this micro-batch (for global_aux and
                  the bias update), and the aux-loss values are summed for logging;
        after_step()  per-layer load and bias statistics of the step, then update_bias: the
                  expert bias moves by rate * sign(mean_load - load_e) and step_counts reset;
        metrics()  the latest statistics as numbers (a host sync: call it at log steps only).

Why here and not in the model: the model file imports no distributed code, and the step
boundaries (micro-batches, optimizer steps) are the trainer's.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import nn


def _sum_over(t: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    return funcol.all_reduce(t, "sum", group)


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
        self.routers = model.routers() if hasattr(model, "routers") else []
        self.rate = bias_update_rate
        self.token_slices = token_slices
        for _, router in self.routers:
            router.reduce_counts = (
                functools.partial(_sum_over, group=count_group) if count_group is not None else None
            )
        self._aux: dict[str, torch.Tensor] = {}
        self._stats: dict[str, torch.Tensor] = {}

    def before_micro_batch(self, weight: float) -> None:
        if self.routers:
            # The routers' gradients are summed over the token_slices tp ranks: each rank's
            # aux losses (of its slice, or the same whole-sequence ones) count 1/tp.
            self.model.set_aux_loss_scale(weight / self.token_slices)

    def after_micro_batch(self, weight: float) -> None:
        for _, router in self.routers:
            router.accumulate_counts()
            for name, value in router.last_aux.items():
                self._aux[name] = self._aux.get(name, 0.0) + value * weight

    @torch.no_grad()
    def after_step(self) -> None:
        if not self.routers:
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
        self._stats, self._aux = stats, {}

    def metrics(self) -> dict[str, float]:
        """The last step's statistics (host sync)."""
        if not self._stats:
            return {}
        names = list(self._stats)
        values = torch.stack([self._stats[n].float() for n in names]).tolist()
        return dict(zip(names, values, strict=True))
