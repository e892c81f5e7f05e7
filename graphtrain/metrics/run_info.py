"""What a run ran on: versions, device, host, world size, git commit, command line.

What: `collect_run_info` gathers it into a dict; `write_run_info` writes it (plus the caller's
extra entries, e.g. the resolved config) to run_dir/run_info.json.

Why: a loss curve or a benchmark number is only comparable with the software and hardware that
produced it; recording it at start-up costs nothing. The caller decides which rank writes (rank 0).
"""

from __future__ import annotations

import json
import os
import platform
import socket
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path
from typing import Any

import torch

_PACKAGES = ("triton", "tensordict", "safetensors", "tokenizers")


def _package_version(name: str) -> str | None:
    """Installed version of a distribution, None if it is not installed."""
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def _git(args: list[str], cwd: Path) -> str | None:
    """Output of a git command in `cwd`, None if git or the repository is not there."""
    try:
        result = subprocess.run(
            ["git", *args], cwd=cwd, capture_output=True, text=True, timeout=10, check=False
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return result.stdout.strip() if result.returncode == 0 else None


def git_info() -> dict[str, Any]:
    """Commit of the graphtrain source tree and whether tracked files differ from it.

    Only if this file is tracked by the repository around it: an installed copy inside some other
    repository (a venv under a project) must not report that project's commit. Untracked files do
    not count as dirty. {"commit": "unknown", "dirty": None} when git cannot tell.
    """
    here = Path(__file__).resolve()
    source_dir = here.parent
    if _git(["ls-files", "--error-unmatch", here.name], source_dir) is None:
        return {"commit": "unknown", "dirty": None}
    commit = _git(["rev-parse", "HEAD"], source_dir)
    status = _git(["status", "--porcelain", "--untracked-files=no"], source_dir)
    return {
        "commit": commit or "unknown",
        "dirty": None if status is None else bool(status),
    }


def _device_info() -> dict[str, Any]:
    """CUDA version and the device name and count (or "cpu")."""
    info: dict[str, Any] = {"cuda": torch.version.cuda, "hip": torch.version.hip}
    if torch.cuda.is_available():
        info["device_name"] = torch.cuda.get_device_name()
        info["device_count"] = torch.cuda.device_count()
    else:
        info["device_name"] = "cpu"
        info["device_count"] = 0
    return info


def collect_run_info() -> dict[str, Any]:
    """Versions, device, host, world size, git commit and command line of this process."""
    info: dict[str, Any] = {
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "python": platform.python_version(),
        "torch": torch.__version__,
    }
    for name in _PACKAGES:
        info[name] = _package_version(name)
    info.update(_device_info())
    info["hostname"] = socket.gethostname()
    info["world_size"] = int(os.environ.get("WORLD_SIZE", "1"))
    info["git"] = git_info()
    info["command"] = [sys.executable, *sys.argv]
    return info


def write_run_info(run_dir: Path, extra: dict[str, Any]) -> Path:
    """Write collect_run_info() updated with `extra` to run_dir/run_info.json; returns the path.

    Written to a temporary file and renamed, so a crash never leaves half a file. Values that are
    not JSON types (paths, dtypes) are written with str().
    """
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    info = collect_run_info()
    info.update(extra)
    path = run_dir / "run_info.json"
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(info, indent=2, default=str) + "\n", encoding="utf-8")
    os.replace(tmp, path)
    return path
