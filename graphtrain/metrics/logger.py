"""Rank-0 metrics logging: JSON lines, TensorBoard, a console line and a progress bar.

What: `MetricsLogger.log(step, metrics)` appends {"step", "time", "elapsed_s", **metrics} as one
JSON object per line to run_dir/metrics.jsonl, writes each metric as a TensorBoard scalar under
run_dir/tb, and prints a one-line summary to stdout. When stderr is a terminal a progress bar is
drawn there (`progress(step)` may be called every step; it is host-only and cheap).

Why: JSONL is the record a script can read without TensorBoard; TensorBoard is what people look at.
Only rank 0 writes, so a multi-rank run has one log; other ranks' calls return at once.

One row per step, also across restarts: a fresh run (resume_step None) starts both records
afresh (a reused run directory's old metrics.jsonl is replaced, its TensorBoard events purged);
a run resumed from the checkpoint of step S keeps the rows up to S and supersedes the later ones
(metrics.jsonl rewritten without them, atomically: a new file renamed over the old one;
TensorBoard's purge_step = S + 1), since the steps after S are trained again.

Values must be python numbers: the trainer converts tensors with .item() at log steps only
(a device sync), never here. Non-finite values are written to JSONL as the strings "nan", "inf",
"-inf", because NaN and Infinity are not valid JSON.

Metric names the console line knows (all optional; every metric goes to JSONL and TensorBoard):
loss, val_loss, lr, grad_norm, tokens_per_s, mfu (a fraction, printed in percent),
memory/peak_allocated_gib (CUDA) or memory/max_rss_gib (CPU), see
`graphtrain.metrics.hardware.memory_stats`.
"""

from __future__ import annotations

import json
import logging
import math
import os
import sys
import time
import warnings
from pathlib import Path
from typing import Any

from graphtrain.metrics.progress import ProgressBar

_warned_no_tensorboard = False


def _warn_no_tensorboard(error: Exception) -> None:
    """Warn once per process that TensorBoard logging is off."""
    global _warned_no_tensorboard
    if not _warned_no_tensorboard:
        _warned_no_tensorboard = True
        warnings.warn(
            f"TensorBoard logging disabled: {error} (pip install tensorboard to enable it); "
            "metrics.jsonl is still written",
            stacklevel=3,
        )


def _json_value(value: float) -> float | str:
    """A JSON-safe number: non-finite floats become "nan" / "inf" / "-inf"."""
    value = float(value)
    if not math.isfinite(value):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
    return value


# (metric key, label, format) of the console line, in order.
_SUMMARY = (
    ("loss", "loss", "{:.4f}".format),
    ("val_loss", "val_loss", "{:.4f}".format),
    ("lr", "lr", "{:.2e}".format),
    ("grad_norm", "grad_norm", "{:.3f}".format),
    ("tokens_per_s", "tok/s", "{:,.0f}".format),
    ("mfu", "mfu", lambda v: f"{v * 100:.1f}%"),
)


def format_summary(step: int, metrics: dict[str, float], total_steps: int | None = None) -> str:
    """The concise console line, e.g. "step 10/100 | loss 3.2100 | lr 3.00e-04 | ..."."""
    parts = [f"step {step}/{total_steps}" if total_steps else f"step {step}"]
    parts += [f"{label} {fmt(metrics[key])}" for key, label, fmt in _SUMMARY if key in metrics]
    for key, label in (("memory/peak_allocated_gib", "mem"), ("memory/max_rss_gib", "rss")):
        if key in metrics:
            parts.append(f"{label} {metrics[key]:.2f} GiB")
            break
    return " | ".join(parts)


def _rows_up_to(path: Path, step: int) -> list[str]:
    """The lines of metrics.jsonl `path` whose step is <= `step` (none when it does not exist);
    a line that does not parse (a write cut off by a kill) is dropped."""
    if not path.is_file():
        return []
    kept = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            row_step = json.loads(line)["step"]
        except (ValueError, KeyError, TypeError):
            continue
        if row_step <= step:
            kept.append(line + "\n")
    return kept


def recorded(path: Path, key: str) -> dict[int, float]:
    """step -> value of metric `key` in metrics.jsonl `path` (a resumed run's summary covers the
    steps before the resume too); rows that do not parse or lack it are skipped."""
    found = {}
    if Path(path).is_file():
        for line in Path(path).read_text(encoding="utf-8").splitlines():
            try:
                row = json.loads(line)
                found[int(row["step"])] = float(row[key])
            except (ValueError, KeyError, TypeError):
                continue
    return found


class _ClearBar(logging.Filter):
    """Erases the progress bar before a log record is written to the terminal."""

    def __init__(self, bar: ProgressBar) -> None:
        super().__init__()
        self.bar = bar

    def filter(self, record: logging.LogRecord) -> bool:
        self.bar.clear()
        return True


class MetricsLogger:
    """Writes metrics on rank 0; a no-op on every other rank."""

    def __init__(
        self,
        run_dir: Path,
        *,
        rank: int,
        tensorboard: bool = True,
        total_steps: int | None = None,
        resume_step: int | None = None,
    ) -> None:
        self.run_dir = Path(run_dir)
        self.rank = rank
        self.total_steps = total_steps
        self.enabled = rank == 0
        self._start = time.time()
        self._jsonl = None
        self._writer: Any = None
        self._bar: ProgressBar | None = None
        if not self.enabled:
            return
        self.run_dir.mkdir(parents=True, exist_ok=True)
        path = self.run_dir / "metrics.jsonl"
        kept = _rows_up_to(path, resume_step) if resume_step is not None else []
        # The kept rows go to a new file that replaces the old one in one rename: a kill while
        # they are written leaves the old history whole (opening it with "w" emptied it first).
        tmp = path.with_name(f"{path.name}.tmp")
        with open(tmp, "w", encoding="utf-8") as f:
            f.writelines(kept)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        self._jsonl = open(path, "a", encoding="utf-8")
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self._writer = SummaryWriter(
                    log_dir=str(self.run_dir / "tb"),
                    flush_secs=30,
                    # Events at steps >= purge_step in the older files are dropped by readers.
                    purge_step=0 if resume_step is None else resume_step + 1,
                )
            except ImportError as error:
                _warn_no_tensorboard(error)
        if sys.stderr.isatty():
            self._bar = ProgressBar(sys.stderr, total=total_steps)
            # Log records go to the same terminal: the bar is erased before each one is written
            # (it is redrawn at the next step), so that no line runs into it.
            self._clear_bar = _ClearBar(self._bar)
            for handler in logging.getLogger().handlers:
                handler.addFilter(self._clear_bar)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        """Record `metrics` for optimizer step `step` (python numbers only)."""
        if not self.enabled:
            return
        for key, value in metrics.items():
            if not isinstance(value, (int, float)):
                raise TypeError(
                    f"metric {key!r} is a {type(value).__name__}, expected a python float; "
                    "convert tensors with .item() at log steps"
                )
        now = time.time()
        record: dict[str, Any] = {"step": step, "time": now, "elapsed_s": now - self._start}
        # ints (token counts) stay ints; floats become JSON-safe floats.
        record.update({k: v if isinstance(v, int) else _json_value(v) for k, v in metrics.items()})
        assert self._jsonl is not None
        self._jsonl.write(json.dumps(record, allow_nan=False) + "\n")
        self._jsonl.flush()
        if self._writer is not None:
            for key, value in metrics.items():
                self._writer.add_scalar(key, float(value), global_step=step)
        line = format_summary(step, metrics, self.total_steps)
        if self._bar is not None:
            self._bar.clear()
        if line != format_summary(step, {}, self.total_steps):  # none the console line shows
            print(line, flush=True)
        if self._bar is not None:
            self._bar.update(step, force=True)

    def progress(self, step: int) -> None:
        """Advance the progress bar to `step` (no-op without a terminal or off rank 0)."""
        if self._bar is not None:
            self._bar.update(step)

    def close(self) -> None:
        """Flush and close the files and end the progress bar; safe to call twice."""
        if self._bar is not None:
            for handler in logging.getLogger().handlers:
                handler.removeFilter(self._clear_bar)
            self._bar.close()
            self._bar = None
        if self._writer is not None:
            self._writer.close()
            self._writer = None
        if self._jsonl is not None:
            self._jsonl.close()
            self._jsonl = None

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
