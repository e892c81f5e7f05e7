"""Reading a checkpoint's pickled files without running code from them.

A checkpoint may come from elsewhere (a shared folder, a download), and unpickling runs whatever a
pickle names. Two files of a graphtrain checkpoint are pickles:

- trainer-rank<r>.pt (torch.save): read with `torch.load(weights_only=True)`, whose unpickler
  builds only tensors and plain containers. The trainer state holds exactly that: ints, floats,
  strings, bools, None, lists, dicts, the RNG states (uint8 tensors) and the file manifest, so no
  global is allow-listed; anything else is refused.
- DCP's .metadata: torch (2.11 through 2.13 at least, `FileSystemReader.read_metadata` in
  torch/distributed/checkpoint/filesystem.py) reads it with a plain `pickle.load`, so a planted
  .metadata runs code in `dcp.load` and in every reader of the metadata. `read_dcp_metadata`
  unpickles it with an allow-list of the classes DCP's metadata is made of (its dataclasses and
  enums, torch.Size, dtypes, layouts, paths); the trainer and export read the metadata through it
  to check shapes before DCP touches the folder, so a hostile .metadata is refused first.

Both raise UnsafeCheckpointError (a ValueError) naming the file and the global it refused.
"""

from __future__ import annotations

import enum
import pathlib
import pickle
import re
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint.metadata as dcp_metadata
from torch.distributed.checkpoint.metadata import Metadata

# Exact globals a DCP .metadata names besides the classes of torch.distributed.checkpoint.metadata
# (seen on torch 2.13: filesystem._StorageInfo for the shard offsets, serialization._get_layout,
# which maps a layout's name to the layout, and the path class of the shard's relative_path).
_METADATA_GLOBALS = {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch.serialization", "_get_layout"),
    ("torch", "Size"),
    ("collections", "OrderedDict"),
    ("pathlib", "Path"),
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
    ("pathlib", "WindowsPath"),
    ("pathlib", "PureWindowsPath"),
}


class UnsafeCheckpointError(ValueError):
    """A checkpoint file names Python code or objects the loader does not build."""


def _refusal(path: Path, name: str) -> UnsafeCheckpointError:
    return UnsafeCheckpointError(
        f"checkpoint file {path} refers to {name}, which is not part of a checkpoint's state: "
        "refusing to load it (a pickle naming other globals can run code on load); use a "
        "checkpoint written by graphtrain, from a source you trust"
    )


class _MetadataUnpickler(pickle.Unpickler):
    def __init__(self, file: Any, path: Path) -> None:
        super().__init__(file)
        self._path = path

    def _enum_member(self, cls: Any, name: Any) -> Any:
        """getattr(EnumClass, "MEMBER"): how some Python builds (3.11.2 among them) pickle an
        enum member. Only a member of an enum the allow-list returned; never another attribute
        (a plain getattr would reach functions' globals and from there any code)."""
        if isinstance(cls, type) and issubclass(cls, enum.Enum) and name in cls.__members__:
            return cls.__members__[name]
        raise _refusal(self._path, f"getattr({getattr(cls, '__name__', cls)!r}, {name!r})")

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == ("builtins", "getattr"):
            return self._enum_member
        if module == dcp_metadata.__name__:
            obj = getattr(dcp_metadata, name, None)
            # DCP's own dataclasses and enums: constructing them runs no user code.
            if isinstance(obj, type) and (
                issubclass(obj, enum.Enum) or hasattr(obj, "__dataclass_fields__")
            ):
                return obj
        elif module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        elif (module, name) in _METADATA_GLOBALS:
            if module == "pathlib":
                return getattr(pathlib, name)
            return super().find_class(module, name)
        raise _refusal(self._path, f"{module}.{name}")


def read_dcp_metadata(checkpoint: Path) -> Metadata:
    """The DCP Metadata of checkpoint folder `checkpoint`, unpickled with the allow-list.

    UnsafeCheckpointError for a global outside it; ValueError when the file is damaged.
    """
    path = Path(checkpoint) / ".metadata"
    try:
        with open(path, "rb") as f:
            metadata = _MetadataUnpickler(f, path).load()
    except UnsafeCheckpointError:
        raise
    except Exception as e:  # a damaged pickle raises anything
        raise ValueError(
            f"checkpoint {checkpoint} is corrupted: its .metadata cannot be read ({brief(e)})"
        ) from e
    if not isinstance(metadata, Metadata):
        raise ValueError(
            f"checkpoint {checkpoint} is corrupted: its .metadata holds a "
            f"{type(metadata).__name__}, not DCP metadata"
        )
    return metadata


_GLOBAL = re.compile(r"GLOBAL ([\w.]+)")
_DETAIL = re.compile(r"WeightsUnpickler error:\s*([^\n]+)")


def load_trainer_file(path: Path) -> dict[str, Any]:
    """A trainer-rank<r>.pt, read with weights_only=True (tensors and plain containers only)."""
    try:
        state = torch.load(path, weights_only=True, map_location="cpu")
    except Exception as e:  # a truncated pickle raises EOFError, RuntimeError, UnpicklingError...
        named = _GLOBAL.search(str(e))
        if isinstance(e, pickle.UnpicklingError) and named:
            raise _refusal(path, named.group(1)) from None
        if isinstance(e, pickle.UnpicklingError) and "weights_only" in str(e):
            # The safe unpickler met something other than tensors and plain containers (an
            # old-format pickle, an opcode it does not run): never torch's advice to retry
            # with weights_only=False, which would run whatever the file names.
            detail = _DETAIL.search(str(e))
            raise UnsafeCheckpointError(
                f"checkpoint file {path} is a pickle the safe loader refuses "
                f"({detail.group(1).strip() if detail else 'not tensors and plain containers'}): "
                "loading it any other way could run code from it; use a checkpoint written by "
                "graphtrain, from a source you trust"
            ) from None
        raise ValueError(f"checkpoint file {path} is truncated or corrupted ({brief(e)})") from e
    if not isinstance(state, dict):
        raise ValueError(
            f"checkpoint file {path} holds a {type(state).__name__}, not the trainer state"
        )
    return state


def brief(error: BaseException, limit: int = 300) -> str:
    """An exception as one short line for an error message: its first line, no traceback (DCP's
    CheckpointException, whose text is every failed rank's traceback, as each rank's error)."""
    failures = getattr(error, "failures", None)
    if isinstance(failures, dict) and failures:
        parts = []
        for rank, pair in failures.items():
            exc = pair[0] if isinstance(pair, tuple) else pair
            parts.append(f"rank {rank}: {type(exc).__name__}: {brief(exc, limit)}")
        line = "; ".join(parts)
    else:
        text = str(error).strip().splitlines()
        line = text[0] if text else type(error).__name__
    return line if len(line) <= limit else line[: limit - 3] + "..."
