"""Checks that a checkpoint is whole and fits the model, before anything is loaded from it.

Whole: every rank records the size and the SHA-256 of each file it wrote (its DCP shards, and
rank 0 the DCP metadata) in its trainer-rank<r>.pt; on load a missing or shorter/longer file is
reported as truncated, with the file and both sizes, and a file whose bytes changed (a flipped
bit, an overwritten block) by its digest. Hashing costs one read of each file from the page cache
at save (DCP stores no checksums of its own); with an async save it runs on the background thread
that waits for DCP, and on load the files are split over the ranks, each hashing its share.
Checkpoints written before digests were recorded (sizes only) are checked by size.

Every byte: rank 0 also writes checksums.json, the sizes and digests of every file of the
checkpoint, the trainer-rank<r>.pt files included (they hold the RNG states and the data position,
and torch's zip reader checks no CRC), closed by the SHA-256 of its own text, so a flipped bit in
any file, checksums.json too, is refused naming the file. A trainer file records that it was
written with checksums.json: deleting that file is refused too.

Finite: nonfinite_names lists the tensors holding a NaN or an Inf; a save of such weights is
refused (it would push the last finite checkpoint out by retention), and so is an export, an
evaluation or a generation from them.

Fits: the global shapes recorded in the DCP metadata are compared with the model's before DCP
reads any tensor, so a checkpoint of another model shape names the keys and shapes that differ.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from graphtrain.checkpoint.safe_load import read_dcp_metadata

# What a failed DCP read or write raises: any error, or DCP's CheckpointException, which wraps
# the failures of every rank and is a BaseException, not an Exception.
DCP_ERRORS = (Exception, CheckpointException)


def file_digest(path: Path) -> str:
    """SHA-256 of a file, hex (read in blocks: hashlib releases the GIL on each)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 23):
            h.update(block)
    return h.hexdigest()


CHECKSUMS = "checksums.json"


def _text_digest(body: bytes) -> str:
    return hashlib.sha256(body).hexdigest()


def file_entry(path: Path) -> dict[str, dict[str, Any]]:
    """{name: {"size", "sha256"}} of one file."""
    return {path.name: {"size": path.stat().st_size, "sha256": file_digest(path)}}


def write_checksums(folder: Path, files: Mapping[str, Mapping[str, Any]]) -> None:
    """checksums.json in `folder`: every file's size and SHA-256, then the digest of that text
    (so the file checks itself); fsynced."""
    body = (json.dumps({"files": dict(sorted(files.items()))}, indent=1) + "\n").encode()
    path = folder / CHECKSUMS
    with open(path, "wb") as f:
        f.write(body + f"sha256 {_text_digest(body)}\n".encode())
        f.flush()
        os.fsync(f.fileno())


def read_checksums(folder: Path) -> dict[str, dict[str, Any]] | None:
    """The files listed by `folder`'s checksums.json (None: a checkpoint written without one);
    ValueError naming the file when its text is not what was written."""
    path = folder / CHECKSUMS
    if not path.exists():
        return None
    raw = path.read_bytes()
    body, _, last = raw.rstrip(b"\n").rpartition(b"\n")
    body += b"\n"
    if last != f"sha256 {_text_digest(body)}".encode():
        raise ValueError(f"{CHECKSUMS} is corrupted: its text differs from the one saved")
    try:
        files = json.loads(body)["files"]
        ok = all(
            isinstance(e, dict) and isinstance(e["size"], int) and isinstance(e["sha256"], str)
            for e in files.values()
        )
    except (ValueError, KeyError, TypeError, AttributeError):
        ok = False
    if not ok:  # a consistent digest over text graphtrain did not write
        raise ValueError(f"{CHECKSUMS} does not list files and their digests")
    return files


def written_files(path: Path, rank: int) -> dict[str, dict[str, Any]]:
    """Name -> {"size", "sha256"} of the files DCP wrote for `rank` in checkpoint folder `path`."""
    names = [p for p in path.glob(f"__{rank}_*.distcp")]
    if rank == 0:
        names.append(path / ".metadata")
    return {p.name: {"size": p.stat().st_size, "sha256": file_digest(p)} for p in names}


def damaged_files(
    path: Path, manifests: list[dict[str, Any]], *, rank: int = 0, world_size: int = 1
) -> list[str]:
    """What is wrong with the files of checkpoint `path` against the manifests its ranks saved:
    one line per missing file, file of another size, and file whose SHA-256 differs. Sizes are
    checked for every file; digests only for this rank's share (every world_size-th file), so
    the ranks together read each file once. An empty list: intact (as far as this rank looked)."""
    # Old manifests map a name to its size only.
    files = sorted(
        (name, entry if isinstance(entry, dict) else {"size": entry})
        for manifest in manifests
        for name, entry in manifest.items()
    )
    problems = []
    for i, (name, entry) in enumerate(files):
        f = path / name
        actual = f.stat().st_size if f.exists() else None
        if actual != entry["size"]:
            found = "missing" if actual is None else f"{actual} bytes"
            problems.append(f"{name} was written with {entry['size']} bytes but is {found}")
        elif "sha256" in entry and i % world_size == rank and file_digest(f) != entry["sha256"]:
            problems.append(f"{name} is corrupted: its SHA-256 differs from the one saved with it")
    return problems


def nonfinite_names(tensors: Mapping[str, torch.Tensor]) -> list[str]:
    """The names of the floating-point tensors (this rank's shards of DTensors) that hold a NaN
    or an Inf, in order; one host sync for all of them."""
    named = [
        (name, t.to_local() if hasattr(t, "to_local") else t)
        for name, t in tensors.items()
        if t.is_floating_point()
    ]
    if not named:
        return []
    flags = torch.stack([~torch.isfinite(t).all() for _, t in named]).tolist()
    return [name for (name, _), bad in zip(named, flags, strict=True) if bad]


def few(names: list[str], *, total: int, limit: int = 3) -> str:
    """'a, b, c and 12 more (15 of 40 tensors)': a few names and the count, for one line."""
    shown = ", ".join(names[:limit])
    more = f" and {len(names) - limit} more" if len(names) > limit else ""
    return f"{shown}{more} ({len(names)} of {total} tensors)"


def read_shapes(path: Path) -> dict[str, tuple[int, ...] | None]:
    """Key -> global shape of every entry in the DCP checkpoint at `path` (None: not a tensor)."""
    metadata = read_dcp_metadata(path)
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
    # A few of each and the counts: a checkpoint of another model size differs in every tensor.
    parts = []
    if differ:
        more = f" and {len(differ) - 3} more" if len(differ) > 3 else ""
        parts.append(f"shapes differ in {len(differ)} tensors: " + "; ".join(differ[:3]) + more)
    if missing:
        parts.append(f"{len(missing)} missing in {source}: " + ", ".join(missing[:3]))
        parts[-1] += f" and {len(missing) - 3} more" if len(missing) > 3 else ""
    if unexpected:
        parts.append(f"{len(unexpected)} not in the model: " + ", ".join(unexpected[:3]))
        parts[-1] += f" and {len(unexpected) - 3} more" if len(unexpected) > 3 else ""
    raise ValueError(
        f"{source} does not fit the model ({'. '.join(parts)}); check the model config "
        "(preset and model.* keys) against the run that wrote it"
    )
