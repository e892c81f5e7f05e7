"""`graphtrain train ARGS` on argv[1] CPU ranks (gloo) for each argument list of the JSON list
argv[2], one job after the other (conftest.rank_jobs).

This process imports the trainer once and forks every rank of every job from it: the imports
and the first compile's warm-up are paid once per launch, not once per rank (a torchrun launch
of 4 ranks running nothing cost 35 CPU-seconds on 2 cores, 32 of them the ranks' imports).
Each rank is a fresh process, as in a launch of its own (torch's distributed caches are keyed by
mesh shape, so a second job in the same process can meet the groups of the first: seen as "Could
not resolve the process group"), with the environment torchrun gives a rank (RANK, WORLD_SIZE,
LOCAL_RANK, LOCAL_WORLD_SIZE) and a FileStore of the job's own, so that no job meets another's
keys (groups started again on the same keys hung: seen with gloo). The first rank that fails
ends its job: the other ranks are killed (their collectives would wait for it forever) and the
launch exits with that rank's code. torchrun itself is tested through launch.sh.

The warm-up: a process's first compile imports ~600 modules and fills their caches (Dynamo's
backends, AOTAutograd, the partitioner and its networkx; ~1.3 s of a moe-debug job's 4.4 on 2
cores), which every rank would do again after its fork. With a tensor that requires grad where
torch is a CPU build; a CUDA (or ROCm) build's autograd, once it has run in a process (tracing a
joint graph runs it), refuses to run in a fork of it ("Unable to handle autograd's threading in
combination with fork-based multiprocessing"): there, an inference graph (~0.4 s of it)."""

import faulthandler
import json
import os
import signal
import sys
import tempfile
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
from parallel_dist import scalar_cpu_kernels

import graphtrain.trainer  # noqa: F401  imported once, before the forks
from graphtrain.cli import main
from graphtrain.preemption import EXIT_PREEMPTED


def _rank(store: Path, rank: int, world_size: int, args: list[str]) -> int:
    os.environ.update(
        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
    )  # fmt: skip
    # The trainer finds the group started and uses it (and destroys it at its end).
    dist.init_process_group(
        "gloo", store=dist.FileStore(str(store), world_size), rank=rank, world_size=world_size
    )
    code = main(["train", *args])
    # A job that ended as asked (done, or stopped by a signal) has ended every group it used,
    # their threads with them (graphtrain.parallel.destroy_distributed): a group left to the
    # interpreter's exit is where a finished rank was seen to abort.
    if code in (0, EXIT_PREEMPTED):
        left = [name for name in _thread_names() if "gloo" in name]
        if left:
            print(f"rank {rank}: the job left gloo's threads running: {left}", file=sys.stderr)
            return 1
    return code


def _thread_names() -> list[str]:
    return [(task / "comm").read_text().strip() for task in Path("/proc/self/task").iterdir()]


def _fork(store: Path, rank: int, world_size: int, args: list[str]) -> int:
    pid = os.fork()
    if pid == 0:
        try:
            code = _rank(store, rank, world_size, args)
        except BaseException:
            traceback.print_exc()
            code = 1
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return pid


def _job(index: int, world_size: int, args: list[str], folder: Path) -> int:
    """Every rank of one job; 0, or the exit code of the first rank that failed."""
    store = folder / f"store{index}"
    ranks = {_fork(store, rank, world_size, args): rank for rank in range(world_size)}
    failed = 0
    while ranks:
        pid, status = os.wait()
        rank, code = ranks.pop(pid), os.waitstatus_to_exitcode(status)
        if code and not failed:
            how = f"killed by signal {-code}" if code < 0 else f"exited with code {code}"
            print(f"job {index}: rank {rank} {how}", file=sys.stderr, flush=True)
            failed = code if code > 0 else 1
            for other in ranks:
                os.kill(other, signal.SIGKILL)
    return failed


def _warm_up() -> None:
    x = torch.ones(2, requires_grad=not torch.backends.cuda.is_built())
    torch.compile(lambda t: t.sin().sum(), backend="aot_eager")(x)
    torch._dynamo.reset()  # each job starts from Dynamo's fresh state


if __name__ == "__main__":
    faulthandler.enable(all_threads=True)  # a rank killed by a signal prints its stacks
    scalar_cpu_kernels()
    _warm_up()
    world_size, jobs = int(sys.argv[1]), json.loads(sys.argv[2])
    with tempfile.TemporaryDirectory(prefix="graphtrain-jobs-") as folder:
        for index, args in enumerate(jobs):
            code = _job(index, world_size, args, Path(folder))
            if code:
                sys.exit(code)
