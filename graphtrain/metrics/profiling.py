"""Profiling a few training steps: a torch profiler trace and a CUDA memory snapshot.

What: `metrics.profile_steps = "10-12"` runs optimizer steps 10 to 12 (the logged numbering,
1-based) under torch.profiler (CPU and, where present, CUDA activities) and writes a Chrome /
Perfetto trace per rank to run_dir/profile/; `metrics.memory_snapshot = true` also records the
CUDA caching allocator's history over those steps and writes it as run_dir/memory/rank<r>.pickle
(open with https://pytorch.org/memory_viz), as torchtitan users expect.

Why in a range: a trace of every step is too large to open, and the first steps are compile
and warm-up. The profiler's own overhead stays inside the range.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path

import torch

logger = logging.getLogger("graphtrain")


def parse_step_range(text: str, key: str = "metrics.profile_steps") -> tuple[int, int] | None:
    """ "10-12" -> (10, 12), "7" -> (7, 7), "" -> None; anything else a ValueError naming `key`."""
    if not text:
        return None
    match = re.fullmatch(r"\s*(\d+)\s*(?:-\s*(\d+)\s*)?", text)
    first, last = (int(match.group(1)), int(match.group(2) or match.group(1))) if match else (0, 0)
    if not match or not 1 <= first <= last:
        raise ValueError(
            f'{key}={text!r} is not a step range such as "10-12" (first >= 1, first <= last)'
        )
    return first, last


class StepProfiler:
    """Profiles the steps of one range; `before_step(n)` / `after_step(n)` around step n."""

    def __init__(
        self, run_dir: Path, *, steps: str, memory_snapshot: bool, device: torch.device, rank: int
    ) -> None:
        self.range = parse_step_range(steps)
        if memory_snapshot and device.type != "cuda":
            raise ValueError(
                f"metrics.memory_snapshot=true records the CUDA caching allocator, but training "
                f"runs on {device.type}; set metrics.memory_snapshot=false (the profiler trace of "
                "metrics.profile_steps works on CPU)"
            )
        if memory_snapshot and self.range is None:
            raise ValueError(
                "metrics.memory_snapshot=true records the steps of metrics.profile_steps; set "
                'it too, e.g. metrics.profile_steps="3-4"'
            )
        self.run_dir, self.rank, self.device = Path(run_dir), rank, device
        self.memory_snapshot = memory_snapshot
        self._profiler: torch.profiler.profile | None = None

    def before_step(self, step: int) -> None:
        if self.range is None or step != self.range[0]:
            return
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        if self.memory_snapshot:
            torch.cuda.memory._record_memory_history(max_entries=100_000)
        self._profiler = torch.profiler.profile(activities=activities, record_shapes=True)
        self._profiler.__enter__()

    def after_step(self, step: int) -> None:
        if self._profiler is not None and self.range is not None and step == self.range[1]:
            self.close()

    def close(self) -> None:
        """Stop and write what was recorded (a run that ends inside the range writes it too)."""
        if self._profiler is None:
            return
        profiler, self._profiler = self._profiler, None
        profiler.__exit__(None, None, None)
        first, last = self.range
        trace = self.run_dir / "profile" / f"rank{self.rank}-steps-{first}-{last}.json"
        trace.parent.mkdir(parents=True, exist_ok=True)
        profiler.export_chrome_trace(str(trace))
        logger.info("profiler trace of steps %d-%d: %s", first, last, trace)
        if self.memory_snapshot:
            snapshot = self.run_dir / "memory" / f"rank{self.rank}.pickle"
            snapshot.parent.mkdir(parents=True, exist_ok=True)
            torch.cuda.memory._dump_snapshot(str(snapshot))
            torch.cuda.memory._record_memory_history(enabled=None)
            logger.info("CUDA memory snapshot: %s", snapshot)
