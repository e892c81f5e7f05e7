"""FSDP2 (fully_shard): parameters sharded over the data-parallel ranks, gathered block by block.

One FSDP unit per transformer block and per MTP depth's layer (its all-gather overlaps the previous block's compute, its
reduce-scatter the next block's backward), then the root for what is left: tok_embeddings, norm,
output (a tied output head is the same Parameter as the table and stays one: fully_shard
deduplicates shared parameters within a unit).

A 1-D dp_mesh ("dp_shard") is plain FSDP; a 2-D one ("dp_replicate", "dp_shard") is HSDP:
sharded within dp_shard, replicated (gradients all-reduced) across dp_replicate. A size-1
"dp_shard" makes that pure replication (DDP semantics) with the same DTensor parameters, the same
state dict and the same composition with TP and compile; see graphtrain.parallel.parallelize_model.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard


def reshards_after_forward(policy: str, pp: int) -> bool:
    """parallel.fsdp_reshard_after_forward for a job with `pp` pipeline ranks. The default keeps
    a pipeline's blocks gathered from their first forward to the step's last backward:
    resharded after each forward, every micro-batch would gather each block twice (torchtitan's
    default under pp is the same, for that reason), and the zero-bubble schedules need them
    gathered (graphtrain.parallel.pipeline.layout refuses "always" there)."""
    return {"always": True, "never": False}.get(policy, pp == 1)


def apply_fsdp(
    model: nn.Module,
    dp_mesh: DeviceMesh,
    *,
    param_dtype: torch.dtype,
    reduce_dtype: torch.dtype,
    reshard_after_forward: bool = True,
    ignored_params: set[nn.Parameter] | None = None,
    roots: Sequence[nn.Module] | None = None,
) -> None:
    """fully_shard every block of model.layers and every MTP layer, then the model itself.

    param_dtype: dtype of the gathered parameters the compute sees (bf16 for speed; the sharded
    master copy keeps its own dtype, fp32). reduce_dtype: dtype of the gradient reduce-scatter
    (fp32 keeps the sum over many ranks accurate). reshard_after_forward=False keeps gathered
    parameters from forward to backward (ZeRO-2 like: more memory, one all-gather fewer).
    ignored_params: left alone (the expert-parallel weights, which
    graphtrain.parallel.expert_parallel shards and reduces itself). roots: the root units
    instead of the model (pipeline stages, graphtrain.parallel.pipeline: the modules the
    schedule calls, each holding its blocks and what else of the model it runs).
    """
    if dp_mesh.ndim not in (1, 2):
        raise ValueError(f"apply_fsdp wants a 1-D (FSDP) or 2-D (HSDP) mesh, got {dp_mesh.ndim}-D")
    mp_policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    # In forward order: the trunk's blocks, then the MTP depths' layers (one unit each).
    blocks = [*model.layers.values(), *getattr(model, "mtp_layers", {}).values()]
    for i, block in enumerate(blocks):
        # The last block's parameters are needed again at once by backward: resharding them
        # after forward would only buy an immediate second all-gather.
        reshard = reshard_after_forward and i < len(blocks) - 1
        fully_shard(
            block,
            mesh=dp_mesh,
            mp_policy=mp_policy,
            reshard_after_forward=reshard,
            ignored_params=ignored_params,
        )
    # The root unit (embedding, norm, head) is the first one backward needs: keep it gathered
    # (FSDP2's own default for the root, stated because an explicit value overrides it).
    for root in [model] if roots is None else roots:
        fully_shard(
            root,
            mesh=dp_mesh,
            mp_policy=mp_policy,
            reshard_after_forward=False,
            ignored_params=ignored_params,
        )
