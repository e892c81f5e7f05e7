"""Rank divergence: replicas that must hold equal values are compared every N steps.

Which ranks must agree: for a DTensor parameter, the ranks whose mesh coordinates are equal on
every mesh axis where it is sharded (Shard) hold the same local tensor: the dp_replicate
replicas of every parameter, and the tp ranks of a parameter that tensor parallel replicates
(the norms), whatever FSDP does on dp_shard. The same for the optimizer state of the parameter
(AdamW's moments and step). A plain tensor on a multi-rank run is taken to be rank-local and is
not compared (expert-parallel experts, for instance).

The hash: the tensor's bits viewed as integers and summed into an int64 on the device (one read
of the local shard, no copy of it), so any change of one element's bits changes it; a swap of
two elements does not, which is not how replicas drift (a missing reduction, a nondeterministic
kernel, a bad GPU: values change). One all_gather_object of (key, hash) pairs compares them all;
the hashes reach the host once (a sync, at check steps only).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

_INT_OF_SIZE = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


class ReplicaDivergenceError(RuntimeError):
    """Ranks that must hold equal values hold different ones."""


def _bits_sum(t: torch.Tensor) -> torch.Tensor:
    t = t.detach().contiguous()
    if t.dtype.is_floating_point or t.dtype.is_complex:
        t = t.view(_INT_OF_SIZE[t.element_size()])
    return t.sum(dtype=torch.int64)


def _shard_key(t: torch.Tensor) -> tuple | None:
    """Which piece of the global tensor this rank holds; None: rank-local (not compared)."""
    if not isinstance(t, DTensor):
        return None
    coordinate = t.device_mesh.get_coordinate()
    sharded = tuple(
        (axis, coordinate[axis])
        for axis, placement in enumerate(t.placements)
        if not placement.is_replicate()
    )
    return (tuple(t.device_mesh.mesh_dim_names or ()), sharded, tuple(t.to_local().shape))


def _tensors(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer | None
) -> Iterator[tuple[str, torch.Tensor, tuple | None]]:
    """(name, local tensor, key) of every parameter and optimizer state tensor to compare."""
    for name, p in model.named_parameters():
        key = _shard_key(p)
        if key is None:
            continue
        yield name, p.to_local(), key
        state = optimizer.state.get(p, {}) if optimizer is not None else {}
        for state_name, value in sorted(state.items()):
            if isinstance(value, DTensor):
                value = value.to_local()
            if isinstance(value, torch.Tensor):
                yield f"{name} (optimizer {state_name})", value, key


def check_replicas(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None, *, step: int
) -> None:
    """Compare every parameter (and its optimizer state) across the ranks that must hold it
    equal; ReplicaDivergenceError on every rank, naming the tensors and ranks, if any differ.
    A collective: every rank calls it at the same step."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    names, hashes, keys = [], [], []
    for name, local, key in _tensors(model, optimizer):
        names.append(name)
        keys.append(key)
        hashes.append(_bits_sum(local).cpu())
    values = torch.stack(hashes).tolist() if hashes else []  # host sync: check steps only
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, list(zip(names, keys, values, strict=True)))
    by_piece: dict[tuple, dict[int, list[int]]] = defaultdict(lambda: defaultdict(list))
    for rank, entries in enumerate(gathered):
        for name, key, value in entries:
            by_piece[(name, key)][value].append(rank)
    differ = []
    for (name, _), groups in by_piece.items():
        if len(groups) > 1:
            ranks = " vs ".join(
                "ranks " + ",".join(map(str, group)) for group in sorted(groups.values())
            )
            differ.append(f"{name} ({ranks})")
    if differ:
        shown = "; ".join(differ[:5]) + (f"; and {len(differ) - 5} more" if len(differ) > 5 else "")
        raise ReplicaDivergenceError(
            f"replicas diverged at step {step}: {shown} hold different values where they must "
            "be equal (data-parallel replicas, or tensor-parallel ranks of a replicated "
            "parameter); stopping. Suspect the ranks in the smallest group: a faulty device, "
            "or a nondeterministic or unreduced update"
        )
