"""Helpers the custom ops share: the Triton interpreter switch, compute dtypes, process groups.

What
    interpreting()            True under TRITON_INTERPRET=1 (kernels run on CPU tensors)
    compute_dtype(dtype)      the dtype an op's reductions run in: fp32, or fp64 for fp64 inputs
    group_rank_size(name)     (rank, size) of a process group named as functional collectives
                              name it; (0, 1) for None
    group_size(name)          its size; 1 for None
    all_reduce(x, op, name)   functional all-reduce, waited on
    schema_arguments(cls, names, ...)  an op schema's arguments written from the fields of its
                              options dataclass (one list of options per op)

Contract
    Host-side and static: the group lookups read the registered process group, never the
    device, so they run at trace time as well. all_reduce uses functional collectives: async on
    the stream (no host sync, CUDA-graph capturable), and the same code runs on gloo in the CPU
    tests. Nothing here imports a pass, the config or the trainer.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence

import torch
from torch import Tensor


def interpreting() -> bool:
    """Whether Triton kernels run in the interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """At least fp32, as F.cross_entropy(logits.float()) computes; fp64 stays fp64 (tests)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def group_rank_size(group_name: str | None) -> tuple[int, int]:
    """(rank, size) of the process group `group_name`; (0, 1) without one."""
    if group_name is None:
        return 0, 1
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _resolve_process_group

    group = _resolve_process_group(group_name)
    return dist.get_rank(group), dist.get_world_size(group)


def group_size(group_name: str | None) -> int:
    """Ranks in the process group `group_name`; 1 without one."""
    if group_name is None:
        return 1
    from torch.distributed.distributed_c10d import _resolve_process_group

    return _resolve_process_group(group_name).size()


def all_reduce(x: Tensor, op: str, group_name: str) -> Tensor:
    """`x` reduced with `op` ("sum", "max", ...) over the group, as a functional collective."""
    out = torch.ops._c10d_functional.all_reduce(x, op, group_name)
    return torch.ops._c10d_functional.wait_tensor(out)


# Python annotations of the options dataclasses' fields -> torch.library schema types.
_SCHEMA_TYPES = {"int": "int", "float": "float", "str": "str", "bool": "bool", "str | None": "str?"}


def schema_arguments(
    options: type, names: Sequence[str], *, first_default: str | None, int_type: str = "int"
) -> str:
    """The schema's arguments for these fields of the dataclass `options`, in order: "int
    top_k, str score_func=\"softmax\", ...". Defaults are written from the field
    `first_default` on (None: none). int_type: "SymInt" where torch.library would infer it."""
    fields = {f.name: f for f in dataclasses.fields(options)}
    out, defaulted = [], False
    for name in names:
        f = fields[name]
        defaulted = defaulted or name == first_default
        kind = _SCHEMA_TYPES[f.type]
        kind = int_type if kind == "int" else kind
        default = ""
        if defaulted:
            default = f'="{f.default}"' if isinstance(f.default, str) else f"={f.default!r}"
        out.append(f"{kind} {name}{default}")
    return ", ".join(out)
