"""Sharded checkpoints with torch.distributed.checkpoint (DCP), resumable exactly.

Layout: <run_dir>/checkpoints/step-0000100/ holds the DCP shards of the model and optimizer
(every rank writes its own shards) and trainer-rank<r>.pt with the step, consumed tokens, the
data loader position and the RNG states of that rank.

Never loading a half-written checkpoint: a save is written under step-N.tmp and renamed to
step-N only after every rank finished (the rename is atomic, so the final name is the completion
marker); `latest` resolves to the newest name without the .tmp suffix, and a stale .tmp from a
killed save is removed by the next save. Old checkpoints are deleted only after a newer one is
complete, keeping the last `keep_last`.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

_NAME = re.compile(r"^step-(\d{7})$")


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def complete_checkpoints(run_dir: Path) -> list[Path]:
    """Complete checkpoints of a run, oldest first."""
    root = Path(run_dir) / "checkpoints"
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if p.is_dir() and _NAME.match(p.name))


def save(
    run_dir: Path,
    *,
    step: int,
    consumed_tokens: int,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    data: Any,
    keep_last: int,
) -> Path:
    root = Path(run_dir) / "checkpoints"
    final = root / f"step-{step:07d}"
    tmp = root / f"{final.name}.tmp"
    if _rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)  # left by a save that was killed
        tmp.mkdir(parents=True)
    _barrier()
    model_sd, optim_sd = get_state_dict(model, optimizer)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(tmp))
    extra = {
        "step": step,
        "consumed_tokens": consumed_tokens,
        "data": data.state_dict(),
        "rng_cpu": torch.get_rng_state(),
        "rng_cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None,
    }
    torch.save(extra, tmp / f"trainer-rank{_rank()}.pt")
    _barrier()
    if _rank() == 0:
        if final.exists():  # the same step saved again (a resumed run): replace it
            shutil.rmtree(final)
        tmp.rename(final)
        for old in complete_checkpoints(run_dir)[:-keep_last]:
            shutil.rmtree(old)
    _barrier()
    return final


def resolve(run_dir: Path, which: str) -> Path:
    """`latest` or a checkpoint name -> its folder; a clear error when there is none."""
    found = complete_checkpoints(run_dir)
    if which == "latest":
        if not found:
            raise ValueError(
                f"checkpoint.resume='latest' but {run_dir}/checkpoints has no complete checkpoint"
            )
        return found[-1]
    path = Path(run_dir) / "checkpoints" / which
    if path not in found:
        names = ", ".join(p.name for p in found) or "none"
        raise ValueError(
            f"checkpoint.resume={which!r} is not a complete checkpoint of {run_dir}; found: {names}"
        )
    return path


def load(
    run_dir: Path,
    which: str,
    *,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    data: Any,
) -> tuple[int, int]:
    """Restore model, optimizer, data position and RNG; returns (step, consumed_tokens)."""
    path = resolve(run_dir, which)
    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=str(path))
    set_state_dict(
        model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"]
    )
    extra_path = path / f"trainer-rank{_rank()}.pt"
    if not extra_path.exists():  # resumed on more ranks than saved: rank 0's position is global
        extra_path = path / "trainer-rank0.pt"
    extra = torch.load(extra_path, weights_only=False)
    data.load_state_dict(extra["data"])
    torch.set_rng_state(extra["rng_cpu"])
    if extra["rng_cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(extra["rng_cuda"])
    return extra["step"], extra["consumed_tokens"]
