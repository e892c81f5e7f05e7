"""Run a function on N ranks (CPU with gloo; or one GPU each with nccl) in fresh processes and
collect what each returns.

The ranks are forked from multiprocessing's fork server, which imports torch once per test
process (~2 s a rank on 2 cores otherwise) and nothing else. Each rank takes the caller's
environment of the moment (the server's own is the one it started with), then unpickles the
function, importing its module as a spawned process would: what reads the environment at import
(TRITON_INTERPRET, for Triton's decorators) sees the caller's. The server never initialises
CUDA, so nccl ranks may.

A rank that hangs (a collective waiting forever) fails the test after `timeout` seconds instead of
blocking CI: the children are killed and TimeoutError is raised.
"""

from __future__ import annotations

import faulthandler
import os
import pickle
import tempfile
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def scalar_cpu_kernels() -> None:
    """Inductor's C++ kernels without SIMD in this process (cpp.simdlen 1): the tests compile
    with Inductor on CPU for its graphs (partitions, inlined regions, fusions), not for its CPU
    vectorisation, which graphtrain never ships (its CUDA code is Triton). The vectorised
    codegen's tiling analysis was a third of such a compile: 46 s -> 35 s for the Gated DeltaNet
    block's forward and backward. Called by every test process (conftest), train_jobs.py's
    ranks, and the run_ranks functions that compile with Inductor (test_compiled_collectives);
    not by _entry: importing Inductor's config imports Dynamo, ~1 s in a rank that never
    compiles."""
    import torch._inductor.config as inductor_config

    inductor_config.cpp.simdlen = 1


def _entry(
    rank: int,
    world_size: int,
    out_dir: str,
    backend: str,
    env: dict[str, str],
    call: bytes,
) -> None:
    os.environ.clear()
    os.environ.update(env)
    fn, args = pickle.loads(call)
    # A rank that dies of a signal (SIGSEGV, SIGABRT from a corrupted heap) prints every
    # thread's Python stack to the test's stderr, not only its exit code.
    faulthandler.enable(all_threads=True)
    # One intra-op thread per rank: 4 ranks on 2 cores otherwise oversubscribe badly.
    torch.set_num_threads(1)
    if backend == "nccl":
        torch.cuda.set_device(rank)
    # A file rendezvous in this run's own temp dir: no race for a free TCP port with whatever
    # else runs on the machine (a port picked and released can be taken before rank 0 binds it).
    dist.init_process_group(
        backend,
        init_method=f"file://{Path(out_dir) / 'rendezvous'}",
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=120),
    )
    try:
        result = fn(rank, world_size, *args)
        torch.save(result, Path(out_dir) / f"rank{rank}.pt")
        dist.barrier()  # every rank done with its collectives before gloo tears down
    finally:
        dist.destroy_process_group()


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = 240.0,
    backend: str = "gloo",
) -> list[Any]:
    """fn(rank, world_size, *args) on every rank; returns the results in rank order.

    fn and args must be picklable (a module-level function). An exception on any rank is
    re-raised here (torch.multiprocessing.ProcessRaisedException, with the rank's traceback);
    a rank killed by a signal prints every thread's stack (faulthandler) and fails it too.
    """
    with tempfile.TemporaryDirectory() as out_dir:
        mp.set_forkserver_preload(["torch"])  # before the server's first start: once
        context = mp.start_processes(
            _entry,
            args=(world_size, out_dir, backend, dict(os.environ), pickle.dumps((fn, args))),
            nprocs=world_size,
            join=False,
            start_method="forkserver",
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
