"""`graphtrain train ARGS` for each argument list of the JSON list argv[1], one job after the
other on the ranks of one torchrun launch (conftest.torchrun_jobs): the launch and the imports
are most of a small job's cost, and they are paid once.

Each rank imports the trainer once, then forks one process per job: every job starts from a
fresh process state as in a launch of its own (torch's distributed caches are keyed by mesh
shape, so a second job in the same process can meet the groups of the first: seen as "Could not
resolve the process group"). Each job's process group lives on its own key space of
torchrun's store (groups started again on the same keys hung: seen with gloo). The first job
that fails ends the launch with its exit code. Before the forks, one tiny compile: a process's
first compile imports ~600 modules and fills their caches (Dynamo's backends, AOTAutograd, the
partitioner and its networkx; ~1.3 s of a moe-debug job's 4.4 on 2 cores), which every job
would do again after its fork. With a tensor that requires grad where torch is a CPU build; a
CUDA (or ROCm) build's autograd, once it has run in a process (tracing a joint graph runs it),
refuses to run in a fork of it ("Unable to handle autograd's threading in combination with
fork-based multiprocessing"): there, an inference graph (~0.4 s of it)."""

import faulthandler
import json
import os
import sys
import traceback

import torch
import torch.distributed as dist

import graphtrain.trainer  # noqa: F401  imported once, before the forks
from graphtrain.cli import main


def _job(index: int, args: list[str]) -> int:
    store, rank, world_size = next(dist.rendezvous("env://"))
    store = dist.PrefixStore(f"job{index}/", store)
    # The trainer finds the group started and uses it (and destroys it at its end).
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size)
    return main(["train", *args])


def _warm_up() -> None:
    x = torch.ones(2, requires_grad=not torch.backends.cuda.is_built())
    torch.compile(lambda t: t.sin().sum(), backend="aot_eager")(x)
    torch._dynamo.reset()  # each job starts from Dynamo's fresh state


if __name__ == "__main__":
    faulthandler.enable(all_threads=True)  # a job killed by a signal prints its stacks
    _warm_up()
    for index, args in enumerate(json.loads(sys.argv[1])):
        pid = os.fork()
        if pid == 0:
            try:
                code = _job(index, args)
            except BaseException:
                traceback.print_exc()
                code = 1
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
        code = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
        if code:
            sys.exit(code)
