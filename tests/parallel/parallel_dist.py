"""Run a function on N CPU ranks (gloo) in spawned processes and collect what each returns.

A rank that hangs (a collective waiting forever) fails the test after `timeout` seconds instead of
blocking CI: the children are killed and TimeoutError is raised.
"""

from __future__ import annotations

import os
import socket
import tempfile
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    # Port 0: the OS picks an unused port. Closed right away, so another process could take it
    # before rank 0 binds it; rare enough on a test machine.
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(
    rank: int, world_size: int, port: int, out_dir: str, fn: Callable[..., Any], args: tuple
) -> None:
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    # One intra-op thread per rank: 4 ranks on 2 cores otherwise oversubscribe badly.
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=120)
    )
    try:
        result = fn(rank, world_size, *args)
        torch.save(result, Path(out_dir) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def run_ranks(
    fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 240.0
) -> list[Any]:
    """fn(rank, world_size, *args) on every rank; returns the results in rank order.

    fn and args must be picklable (a module-level function). An exception on any rank is
    re-raised here (torch.multiprocessing.ProcessRaisedException, with the rank's traceback).
    """
    with tempfile.TemporaryDirectory() as out_dir:
        context = mp.start_processes(
            _entry,
            args=(world_size, free_port(), out_dir, fn, args),
            nprocs=world_size,
            join=False,
            start_method="spawn",
        )
        deadline = time.monotonic() + timeout
        while not context.join(timeout=1.0):
            if time.monotonic() > deadline:
                for process in context.processes:
                    if process.is_alive():
                        process.kill()
                raise TimeoutError(f"{world_size} ranks running {fn.__name__} hung > {timeout} s")
        return [
            torch.load(Path(out_dir) / f"rank{r}.pt", weights_only=False) for r in range(world_size)
        ]
