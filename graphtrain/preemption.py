"""Preemption: SIGTERM (what cluster schedulers send before killing a job) and SIGINT (Ctrl-C)
end the run at a step boundary with a checkpoint, instead of a traceback and lost work.

The first signal only sets a flag; the step in progress finishes. At the end of every step the
ranks agree whether any of them got a signal (a signal may reach one rank first, or only one):
one all-reduce (MAX) of a single int on a host (gloo) group, so it costs no device sync even
under NCCL. When they agree, every rank saves a checkpoint of that step (unless
checkpoint.save_on_signal is off, or the run keeps no state on disk: checkpoint.interval = 0
and checkpoint.final = false; it then stops cleanly without one), rank 0 logs one line
naming it, and the trainer raises Preempted; the CLI exits with EXIT_PREEMPTED. A second signal
to a rank stops that rank at once (the default action of the signal).

Handlers are installed in the main thread only (Python delivers signals there); `restore()` puts
back what was there before. A SIGTERM during start-up (before the loop's handler is installed,
or during the first validation) stops at once with StartupStopped: one line, exit
EXIT_PREEMPTED, nothing trained and nothing saved.

Several ranks (launch.sh): `run_torchrun` runs torchrun in this process with a grace period
after a signal that fits the save (estimated from the checkpoint size, SHUTDOWN_TIMEOUT
overrides it), and each rank reports how it stopped in a status folder: ranks that saved on a
signal exit 0 (torchrun then reports no failure) and `run_torchrun` returns EXIT_PREEMPTED.
A rank that loses its peers (one died) raises PeerLostError, one line naming the checkpoint to
continue from, instead of gloo's traceback.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.distributed as dist

# sysexits.h EX_TEMPFAIL: "temporary failure, retry later", what a requeued job is.
EXIT_PREEMPTED = 75
_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class Preempted(Exception):
    """The run stopped after `step` on a signal; `checkpoint` is what it saved (None: nothing)."""

    def __init__(self, step: int, checkpoint: Path | None) -> None:
        saved = (
            f"saved checkpoint {checkpoint} (continue with --checkpoint.resume=latest)"
            if checkpoint is not None
            else "no checkpoint saved (checkpoints are off)"
        )
        super().__init__(f"stopped by a signal after step {step}; {saved}")
        self.step = step
        self.checkpoint = checkpoint


# Set by run_torchrun for its ranks: the folder where each rank writes how it stopped.
STATUS_DIR = "GRAPHTRAIN_STATUS_DIR"


class StartupStopped(BaseException):
    """A SIGTERM arrived while the run was starting: it stopped before training anything.

    A BaseException, as KeyboardInterrupt: raised from the signal handler wherever the start-up
    is, it must not be taken for an error of that code (logging swallows an Exception raised
    while it writes a record)."""

    def __init__(self, signum: int) -> None:
        super().__init__(
            f"{signal.Signals(signum).name} during start-up, before the first step: stopped; "
            "nothing was trained, so nothing was saved (checkpoints already in the run "
            "directory are untouched)"
        )


class PeerLostError(ConnectionError):
    """A collective failed because another rank stopped or died."""


_LOST_CONNECTION = ("Connection reset", "Connection closed", "Broken pipe", "Read error")


def looks_like_lost_peer(error: BaseException) -> bool:
    """Whether `error` is a collective failing because a peer went away (gloo's "Connection
    reset by peer" / "Connection closed by peer", a broken pipe, a timeout, NCCL's abort). Not
    a check of gloo's that failed on this rank with its connections up ("enforce fail", e.g.
    torch 2.11's pipelining sending to its own rank: "Pair is not connected"): that error is
    this rank's own, and it is raised as it is."""
    text = str(error)
    if "enforce fail" in text and not any(hint in text for hint in _LOST_CONNECTION):
        return False
    if isinstance(error, dist.DistError):
        return True
    return isinstance(error, RuntimeError) and any(
        hint in text for hint in (*_LOST_CONNECTION, "gloo", "NCCL")
    )


def report_status(state: str) -> None:
    """Tell run_torchrun how this rank stopped ("preempted", "startup"); a no-op outside it."""
    folder = os.environ.get(STATUS_DIR)
    if folder:
        rank = os.environ.get("RANK", "0")
        with contextlib.suppress(OSError):
            Path(folder, f"rank{rank}").write_text(state + "\n")


@contextlib.contextmanager
def stop_during_startup() -> Iterator[None]:
    """SIGTERM while a run starts raises StartupStopped at once (there is nothing to save; the
    default action would kill the process without a word)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(signum: int, frame: object) -> None:
        raise StartupStopped(signum)

    previous = signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


class PreemptionHandler:
    """The signal flag of one training run, and the cross-rank agreement on it."""

    def __init__(self) -> None:
        self.signum = 0
        self._previous: dict[int, object] = {}
        self._group = None
        if dist.is_initialized() and dist.get_world_size() > 1:
            # The default group may be NCCL: the agreement runs on the host.
            gloo = dist.get_backend() == "gloo"
            self._group = dist.group.WORLD if gloo else dist.new_group(backend="gloo")

    def install(self) -> PreemptionHandler:
        if threading.current_thread() is threading.main_thread():
            for sig in _SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def restore(self) -> None:
        """Put back the handlers that were there before `install` (idempotent)."""
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous.clear()

    def _handle(self, signum: int, frame: object) -> None:
        if self.signum:  # the second signal: stop now, as without a handler
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        self.signum = signum
        # os.write, not logging: a handler may run while the logging lock is held.
        os.write(
            2,
            f"{signal.Signals(signum).name}: finishing this step, then saving and stopping "
            "(send it again to stop at once)\n".encode(),
        )

    def should_stop(self) -> bool:
        """Whether any rank got a signal. Every rank calls it at the end of every step (a
        collective of one int on the host)."""
        flag = torch.tensor([1 if self.signum else 0], dtype=torch.int32)
        if self._group is not None:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self._group)
        return bool(flag.item())


# A save writes each rank's shards and optimizer states; assumed written at this rate per node
# (a slow network file system), after a minute for the step in progress to finish.
_SAVE_BYTES_PER_S = 100e6
_MIN_GRACE_S = 120


def save_grace_seconds(train_args: list[str], world_size: int, ranks_per_node: int) -> int:
    """Seconds torchrun should wait after forwarding a signal before it kills the ranks: the
    step in progress plus writing this node's share of the checkpoint."""
    from graphtrain.config import load_config
    from graphtrain.metrics.memory_plan import plan_memory

    items = plan_memory(load_config(train_args), world_size).items
    per_node = (items["parameters"] + items["optimizer states"]) * ranks_per_node
    return max(_MIN_GRACE_S, int(60 + per_node / _SAVE_BYTES_PER_S))


def _torchrun_takes_shutdown_timeout() -> bool:
    """torchrun has --shutdown-timeout (torch 2.13 does; 2.11 kills the ranks 30 s after a
    signal, always)."""
    from torch.distributed.run import get_args_parser

    return any("--shutdown-timeout" in a.option_strings for a in get_args_parser()._actions)


def run_torchrun(args: list[str]) -> int:
    """torchrun `args` (as `python -m torch.distributed.run` takes them) in this process; the exit
    code: EXIT_PREEMPTED when the ranks stopped on a signal (after saving, or during start-up),
    else 0, or 1 with one line per failed rank (no traceback: each rank printed its error)."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args
    from torch.distributed.run import run as torchrun

    settable = _torchrun_takes_shutdown_timeout()
    if not settable and "--shutdown-timeout" in args:
        print(
            f"graphtrain: error: SHUTDOWN_TIMEOUT needs a torchrun with --shutdown-timeout; "
            f"torch {torch.__version__}'s has none (it gives the ranks 30 s after a signal)",
            file=sys.stderr,
        )
        return 2
    ns = parse_args(args)
    if getattr(ns, "shutdown_timeout", None) is None and (
        "TORCH_ELASTIC_SHUTDOWN_TIMEOUT" not in os.environ
    ):
        nproc = int(ns.nproc_per_node)
        nodes = int(str(ns.nnodes).split(":")[-1])
        script_args = list(ns.training_script_args)
        train_args = script_args[1:] if script_args[:1] == ["train"] else script_args
        grace = save_grace_seconds(train_args, nproc * nodes, nproc)
        if settable:
            ns.shutdown_timeout = grace
            print(
                f"launch: after a signal the ranks get {grace} s to finish the step and save "
                "(estimated from the checkpoint size; SHUTDOWN_TIMEOUT=seconds sets it)",
                file=sys.stderr,
            )
        else:  # torch 2.11's torchrun: a fixed 30 s
            print(
                f"launch: after a signal torch {torch.__version__}'s torchrun gives the ranks "
                f"30 s to finish the step and save, where this checkpoint's estimate is {grace} s "
                "(a newer torch's torchrun takes --shutdown-timeout)",
                file=sys.stderr,
            )
    with tempfile.TemporaryDirectory(prefix="graphtrain-status-") as folder:
        os.environ[STATUS_DIR] = folder  # the ranks inherit it
        code = 0
        try:
            torchrun(ns)
        except SignalException as e:  # the signal reached torchrun: it stopped the ranks
            code = 128 + int(e.sigval)
        except ChildFailedError as e:
            code = 1
            failed = e.failures
        states = {p.read_text().strip() for p in Path(folder).iterdir()}
    if states & {"preempted", "startup"}:
        return EXIT_PREEMPTED
    if code == 1:
        for rank, failure in sorted(failed.items()):
            how = (
                f"signal {failure.signal_name()}"
                if failure.exitcode < 0
                else f"exit code {failure.exitcode}"
            )
            print(f"launch: rank {rank} stopped with {how}", file=sys.stderr)
    return code
