"""Named parallel axes: the layout (ParallelDims), the DeviceMesh built from it, and the checks
that a model can be split the way the layout asks.

The mesh always has the axes ("dp_replicate", "dp_shard", "tp"), size-1 axes included, so
code can slice `mesh["tp"]` without asking whether TP is on; with expert parallelism "dp_shard"
is the flattening of ("dp_shard_mod_ep", "ep"), see build_mesh. A flattened "dp" axis
(dp_replicate x dp_shard) is what data loading (which rank reads which rows) and loss averaging
use: get it with dp_mesh(mesh). (mesh["dp"] works on torch 2.13 but warns that slicing a
flattened axis from the root mesh is deprecated.)

Axis order is outer to inner: ranks that differ only in "tp" are neighbours (same node, fastest
links), then "dp_shard", then "dp_replicate" (the one that may cross slow links: HSDP only
all-reduces over it). With pipeline parallelism (pp > 1) a "pp" axis comes first, outermost: a
stage boundary sends one activation per micro-batch, the least traffic of any axis. It is only
there when pp > 1, so every other axis slices the same with or without it.
"""

from __future__ import annotations

import gc
import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

MESH_AXES = ("dp_replicate", "dp_shard", "tp")
EP_MESH_AXES = ("dp_replicate", "dp_shard_mod_ep", "ep", "tp")


@dataclass(frozen=True)
class ParallelDims:
    """Sizes of the parallel axes. dp_shard=-1 means "whatever is left" of world_size.

    Later axes (cp) go here as fields, into `_sizes` and MESH_AXES (cp next
    to dp_shard, ep carved out of dp_shard x cp), each with the same validation.
    """

    dp_replicate: int = 1
    dp_shard: int = -1
    tp: int = 1
    world_size: int = 1
    # Expert parallel: carved out of dp_shard (ranks that read different rows also hold
    # different experts), so it adds no ranks; dp_shard = dp_shard_mod_ep * ep.
    ep: int = 1
    # Expert tensor parallel: 1 (MoE layers not split by tp: each tp rank routes its own
    # sequence slice) or tp (experts split on their hidden dim over the tp axis; with ep > 1
    # each expert-parallel shard is split so).
    etp: int = 1
    # Pipeline stages (outermost axis): each pp rank holds some of the layers
    # (graphtrain.parallel.pipeline); the other axes repeat inside every stage.
    pp: int = 1

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise ValueError(f"world size must be >= 1, got {self.world_size}")
        for name in ("dp_replicate", "tp", "pp"):
            if getattr(self, name) < 1:
                raise ValueError(f"parallel.{name} must be >= 1, got {getattr(self, name)}")
        # pp named in the messages only when it is on: the others read as before it existed.
        pp = f"pp={self.pp} * " if self.pp > 1 else ""
        if self.dp_shard == -1:
            rest = self.pp * self.dp_replicate * self.tp
            if self.world_size % rest:
                raise ValueError(
                    f"parallel.dp_shard=-1 takes what is left of the world size, but world size "
                    f"{self.world_size} is not divisible by parallel.{pp}dp_replicate="
                    f"{self.dp_replicate} * tp={self.tp} = {rest}"
                )
            # Frozen dataclass: __post_init__ is the one place allowed to fill in a field.
            object.__setattr__(self, "dp_shard", self.world_size // rest)
        elif self.dp_shard < 1:
            raise ValueError(
                f"parallel.dp_shard must be >= 1 or -1 (the rest), got {self.dp_shard}"
            )
        if self.ep < 1 or self.dp_shard % self.ep:
            raise ValueError(
                f"parallel.ep={self.ep} must be >= 1 and divide parallel.dp_shard={self.dp_shard}: "
                "expert-parallel ranks are carved out of the FSDP (dp_shard) ranks"
            )
        if self.etp not in (1, self.tp):
            raise ValueError(
                f"parallel.etp={self.etp} must be 1 or parallel.tp={self.tp}: experts are split "
                "over the whole tp axis or not at all"
            )
        product = self.pp * self.dp_replicate * self.dp_shard * self.tp
        if product != self.world_size:
            raise ValueError(
                f"parallel.{pp}dp_replicate={self.dp_replicate} * dp_shard="
                f"{self.dp_shard} * tp={self.tp} = {product} != world size {self.world_size}"
            )

    @property
    def _sizes(self) -> tuple[int, ...]:
        return (self.dp_replicate, self.dp_shard, self.tp)

    @property
    def pp_enabled(self) -> bool:
        return self.pp > 1

    @property
    def dp_size(self) -> int:
        """Number of data-parallel ranks: each reads different rows of the global batch."""
        return self.dp_replicate * self.dp_shard

    @property
    def fsdp_enabled(self) -> bool:
        return self.dp_shard > 1

    @property
    def hsdp(self) -> bool:
        return self.dp_replicate > 1 and self.dp_shard > 1

    @property
    def tp_enabled(self) -> bool:
        return self.tp > 1


def init_distributed(device_choice: str) -> tuple[torch.device, int, int]:
    """This process's device, rank and world size; starts the process group (nccl on CUDA,
    gloo on CPU) when torchrun launched several ranks. device_choice: "auto", "cuda" or
    "cpu" (training.device); rank and world size come from torchrun's environment."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    if device_choice == "auto":
        device_choice = "cuda" if torch.cuda.is_available() else "cpu"
    if device_choice == "cuda":
        if not torch.cuda.is_available():
            raise ValueError("training.device='cuda' but no CUDA device is visible")
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    if world_size > 1 and not dist.is_initialized():
        dist.init_process_group(
            "nccl" if device.type == "cuda" else "gloo",
            device_id=device if device.type == "cuda" else None,
        )
    return device, rank, world_size


def destroy_distributed(*, release: bool = True) -> None:
    """End torch.distributed in this process: the default group and every other group, now
    rather than in the interpreter's exit (docs/design/parallel.md, "The end of a job").

    destroy_process_group forgets the groups, but each DeviceMesh keeps references of its own
    (`_pg_registry`, rebuilt by every copy of a mesh) and torch's DTensor caches keep the
    meshes: with `release`, those references go too (a collection and a pass over the
    process's objects: 0.3-0.5 s after a small job on 2 cores). The caller drops its own (the run,
    its model's FSDP states) first.
    """
    if not dist.is_initialized():
        return
    dist.destroy_process_group()
    if not release:
        return
    # What the job left in reference cycles goes, and the groups it held (without: one of the
    # three still alive after a 2-rank FSDP job).
    gc.collect()
    # `type(...) is`: isinstance on some of gc's objects (dead weak proxies) raises.
    for obj in gc.get_objects():
        if type(obj) is DeviceMesh:
            obj._pg_registry.clear()  # private; torch 2.11 to 2.15 have it


def build_mesh(dims: ParallelDims, device_type: str) -> DeviceMesh:
    """The mesh ("dp_replicate", "dp_shard", "tp"), preceded by "pp" when dims.pp > 1, with the flattened "dp" axis created (and its
    process group with it, collectively, now rather than at first use).

    With expert parallelism (dims.ep > 1) "dp_shard" is split into ("dp_shard_mod_ep", "ep"):
    the mesh is ("dp_replicate", "dp_shard_mod_ep", "ep", "tp") and "dp_shard" is their
    flattening, so fsdp_mesh and dp_mesh mean the same ranks either way.

    Needs torch.distributed initialised with dims.world_size ranks. `DeviceMesh._flatten` is
    private (added in torch 2.5, what torchtitan uses; checked on 2.13, no public replacement
    there); it is idempotent, which the accessors below rely on.
    """
    world = torch.distributed.get_world_size()
    if world != dims.world_size:
        raise ValueError(
            f"ParallelDims was built for world size {dims.world_size}, but torch.distributed "
            f"has {world} ranks"
        )
    # pp, when on, is the outermost axis: the others are sliced from it by name as without it.
    pp_sizes, pp_axes = ((dims.pp,), ("pp",)) if dims.pp_enabled else ((), ())
    if dims.ep > 1:
        sizes = (*pp_sizes, dims.dp_replicate, dims.dp_shard // dims.ep, dims.ep, dims.tp)
        mesh = init_device_mesh(device_type, sizes, mesh_dim_names=(*pp_axes, *EP_MESH_AXES))
        mesh["dp_shard_mod_ep", "ep"]._flatten("dp_shard")
        expert_dp_mesh(mesh)
    else:
        mesh = init_device_mesh(
            device_type, (*pp_sizes, *dims._sizes), mesh_dim_names=(*pp_axes, *MESH_AXES)
        )
    dp_mesh(mesh)
    return mesh


def _data_axes(mesh: DeviceMesh) -> tuple[str, ...]:
    names = mesh.mesh_dim_names or ()
    return (
        ("dp_replicate", "dp_shard_mod_ep", "ep") if "ep" in names else ("dp_replicate", "dp_shard")
    )


def dp_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The 1-D flattened "dp" axis (every rank that reads different rows) of a build_mesh mesh:
    data-loading rank = dp_mesh(mesh).get_local_rank(), loss average over its group."""
    # _flatten returns the cached mesh when it exists with the same layout.
    return mesh[_data_axes(mesh)]._flatten("dp")


def fsdp_mesh(mesh: DeviceMesh, dims: ParallelDims) -> DeviceMesh:
    """The mesh FSDP2 shards the (non-expert) parameters over: ("dp_replicate", "dp_shard") for
    HSDP or replication, else "dp_shard"."""
    if "ep" in (mesh.mesh_dim_names or ()):
        mesh["dp_shard_mod_ep", "ep"]._flatten("dp_shard")  # cached; makes "dp_shard" sliceable
    return mesh["dp_replicate", "dp_shard"] if dims.dp_replicate > 1 else mesh["dp_shard"]


def expert_dp_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """Ranks that hold the same experts and read different rows (dp_replicate x
    dp_shard_mod_ep, flattened): expert gradients are summed over it."""
    return mesh["dp_replicate", "dp_shard_mod_ep"]._flatten("dp_mod_ep")


def validate_model_for_tp(cfg: Any, tp: int, *, seq_len: int | None = None, etp: int = 1) -> None:
    """Raise ValueError unless every dimension the TP plan (models/gpt_plan.py) splits is
    divisible by tp: heads (wq/wk/wv/wo; a hybrid's Gated DeltaNet key heads, whose value
    heads are a multiple of them), ffn_dim (w1/w2/w3), vocab (embedding, output) and,
    when given, the sequence length (sequence parallel shards activations on it); with expert
    TP (etp > 1) the experts' hidden size too."""
    if tp < 1:
        raise ValueError(f"parallel.tp must be >= 1, got {tp}")
    checks = [
        ("model.num_heads", cfg.num_heads),
        ("model.num_kv_heads", cfg.num_kv_heads),
        ("model.ffn_dim", cfg.ffn_dim),
        ("model.vocab_size", cfg.vocab_size),
    ]
    if seq_len is not None:
        checks.append(("training.seq_len", seq_len))
    if "G" in getattr(cfg, "layer_pattern", ""):  # Gated DeltaNet mixers split by key head
        checks.append(("model.linear_num_key_heads", cfg.linear_num_key_heads))
    if etp > 1:  # MoE experts split on their hidden dim (models/moe_plan.py)
        if not hasattr(cfg, "moe_ffn_dim"):
            raise ValueError(f"parallel.etp={etp} splits routed experts: it needs an MoE model")
        checks.append(("model.moe_ffn_dim", cfg.moe_ffn_dim))
    for name, value in checks:
        if value % tp:
            raise ValueError(f"{name}={value} is not divisible by parallel.tp={tp}")


def check_layout(cfg: Any, world_size: int) -> ParallelDims:
    """The parallel axes of job config `cfg` (graphtrain.config.JobConfig) on `world_size`
    ranks, checked against the model (a ValueError naming the numbers otherwise): the trainer's
    first check, `graphtrain train --check` before any rank starts, and `graphtrain plan`."""
    parallel = cfg.parallel
    dims = ParallelDims(
        dp_replicate=parallel.dp_replicate,
        dp_shard=parallel.dp_shard,
        tp=parallel.tp,
        ep=parallel.ep,
        etp=parallel.etp,
        pp=parallel.pp,
        world_size=world_size,
    )
    validate_model_for_tp(cfg.model, dims.tp, seq_len=cfg.training.seq_len, etp=dims.etp)
    if dims.pp_enabled:  # the stages' layout, schedule and micro-batches, before any rank starts
        from graphtrain.parallel.pipeline import check_pipeline

        check_pipeline(cfg, dims)
    return dims


def unused_axis_settings(parallel: Any) -> list[str]:
    """A line for each group of pipeline or tp-overlap settings given while its axis is off (pp
    or tp 1), where nothing uses them: the trainer logs them at start, since the likely cause is
    a forgotten axis (not refused: a pipelined job's config run with pp=1 to compare is fine)."""
    defaults = type(parallel)()
    lines = []
    for axis, keys in (
        ("pp", ("pp_schedule", "pp_microbatches", "pp_layout")),
        ("tp", ("tp_overlap_chunks", "tp_overlap_variant")),
    ):
        changed = [k for k in keys if getattr(parallel, k) != getattr(defaults, k)]
        if getattr(parallel, axis) == 1 and changed:
            given = ", ".join(f"parallel.{k}={getattr(parallel, k)!r}" for k in changed)
            verb = "does" if len(changed) == 1 else "do"
            lines.append(f"{given} {verb} nothing with parallel.{axis}=1")
    return lines
