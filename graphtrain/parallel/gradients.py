"""Finishing a step's gradients: the reductions no FSDP hook does, as one call.

What
    GradientFinisher(model, mesh, dims, plan), made by parallelize_model, called once per
    optimizer step after the last micro-batch's backward (and before clipping):
        expert-parallel weights   summed over the ranks holding the same experts, divided by
                                  the number of data-parallel ranks (reduce_expert_grads);
        tp-partial parameters     MoE layers under tp with expert TP size 1, or their routers
                                  with expert TP = tp: summed over tp (reduce_partial_grads).
    Without expert parallelism and without tp the call does nothing.

Why one object: the trainer then knows nothing of which parameters are expert-parallel or
partial over tp, nor of the groups involved; a later layout adds its reduction here.
The parameter lists are looked up at the first call, once the model has its final parameters
(after to_empty and init), and kept for the run.
"""

from __future__ import annotations

import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from graphtrain.parallel.expert_parallel import expert_params, reduce_expert_grads
from graphtrain.parallel.mesh import ParallelDims, expert_dp_mesh
from graphtrain.parallel.tensor_parallel import partial_grad_params, reduce_partial_grads


class GradientFinisher:
    def __init__(
        self, model: nn.Module, mesh: DeviceMesh | None, dims: ParallelDims, plan: dict[str, str]
    ) -> None:
        self._model, self._mesh, self._dims, self._plan = model, mesh, dims, plan
        # Ranks holding the same experts (none besides this one when ep covers every dp rank).
        self._expert_group: dist.ProcessGroup | None = (
            expert_dp_mesh(mesh).get_group() if 1 < dims.ep < dims.dp_size else None
        )
        self._params: tuple[list[nn.Parameter], list[nn.Parameter]] | None = None

    def __call__(self) -> None:
        """Reduce this step's expert-parallel and tp-partial gradients (in place)."""
        if self._params is None:
            experts = expert_params(self._model) if self._dims.ep > 1 else []
            partial = partial_grad_params(self._model, self._plan) if self._dims.tp > 1 else []
            self._params = experts, partial
        experts, partial = self._params
        if experts:
            reduce_expert_grads(experts, self._expert_group, self._dims.dp_size)
        if partial:
            reduce_partial_grads(partial, self._mesh["tp"])
