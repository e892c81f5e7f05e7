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
back what was there before.
"""

from __future__ import annotations

import os
import signal
import threading
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
