"""Checks that a checkpoint is whole and fits the model, before anything is loaded from it.

Whole: every rank records the size of each file it wrote (its DCP shards, and rank 0 the DCP
metadata) in its trainer-rank<r>.pt; on load a missing or shorter/longer file is reported as
truncated, with the file and both sizes. A file that cannot be unpickled is reported as corrupted.
Not checked: a bit flip inside a shard that keeps its size (DCP stores no checksums; hashing
every byte of a large checkpoint at each save would cost more than it is worth here).

Fits: the global shapes recorded in the DCP metadata are compared with the model's before DCP
reads any tensor, so a checkpoint of another model shape names the keys and shapes that differ.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

# What a failed DCP read or write raises: any error, or DCP's CheckpointException, which wraps
# the failures of every rank and is a BaseException, not an Exception.
DCP_ERRORS = (Exception, CheckpointException)


def written_files(path: Path, rank: int) -> dict[str, int]:
    """Name -> size of the files DCP wrote for `rank` in checkpoint folder `path`."""
    names = [p for p in path.glob(f"__{rank}_*.distcp")]
    if rank == 0:
        names.append(path / ".metadata")
    return {p.name: p.stat().st_size for p in names}


def check_files(path: Path, manifests: list[dict[str, int]]) -> None:
    """ValueError naming the first file that is missing or has another size than recorded."""
    for manifest in manifests:
        for name, size in manifest.items():
            f = path / name
            actual = f.stat().st_size if f.exists() else None
            if actual != size:
                found = "missing" if actual is None else f"{actual} bytes"
                raise ValueError(
                    f"checkpoint {path} is truncated or damaged: {name} was written with {size} "
                    f"bytes but is {found}; resume from another checkpoint (--checkpoint.resume=NAME)"
                )


def read_shapes(path: Path) -> dict[str, tuple[int, ...] | None]:
    """Key -> global shape of every entry in the DCP checkpoint at `path` (None: not a tensor)."""
    try:
        metadata = FileSystemReader(str(path)).read_metadata()
    except Exception as e:  # unpickling a damaged file raises anything
        raise ValueError(
            f"checkpoint {path} is corrupted: its .metadata cannot be read ({e})"
        ) from e
    return {
        key: tuple(meta.size) if isinstance(meta, TensorStorageMetadata) else None
        for key, meta in metadata.state_dict_metadata.items()
    }


def check_shapes(
    expected: Mapping[str, torch.Size | tuple[int, ...]],
    found: Mapping[str, tuple[int, ...]],
    *,
    source: str,
) -> None:
    """ValueError listing keys missing from `found`, unexpected in it, and differing shapes."""
    missing = sorted(set(expected) - set(found))
    unexpected = sorted(set(found) - set(expected))
    differ = [
        f"{k}: model {tuple(expected[k])}, {source} {tuple(found[k])}"
        for k in sorted(set(expected) & set(found))
        if tuple(expected[k]) != tuple(found[k])
    ]
    if not (missing or unexpected or differ):
        return
    parts = []
    if differ:
        parts.append("shapes differ: " + "; ".join(differ))
    if missing:
        parts.append(f"missing in {source}: " + ", ".join(missing))
    if unexpected:
        parts.append("not in the model: " + ", ".join(unexpected))
    raise ValueError(
        f"{source} does not fit the model ({'. '.join(parts)}); check the model config "
        "(preset and model.* keys) against the run that wrote it"
    )
