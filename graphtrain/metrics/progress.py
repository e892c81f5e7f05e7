"""A small progress bar for an interactive terminal.

What: `ProgressBar` draws "[#####.....] 120/1000 12.0% 3.4 step/s ETA 0:04:18" on one line of a
stream (stderr), redrawing at most every `min_interval_s` seconds. The rate and the ETA leave out
the first step (it compiles).

Why our own: tqdm is not a dependency of graphtrain and the trainer needs only this. The metrics
logger prints its summary lines to stdout on the same terminal, so the bar can be cleared before a
line is printed and redrawn after it.
"""

from __future__ import annotations

import time
from typing import TextIO


def _format_duration(seconds: float) -> str:
    """H:MM:SS."""
    seconds = max(0, int(seconds))
    return f"{seconds // 3600}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}"


class ProgressBar:
    """One-line progress bar over optimizer steps, drawn with carriage returns."""

    def __init__(
        self,
        stream: TextIO,
        *,
        total: int | None,
        width: int = 30,
        min_interval_s: float = 0.2,
    ) -> None:
        self.stream = stream
        self.total = total
        self.width = width
        self.min_interval_s = min_interval_s
        self._start_time = time.monotonic()  # for "elapsed"
        self._start_step: int | None = None
        # The rate (and ETA) counts from the end of the first step after the bar started: that
        # step compiles the model, which would make a short run's ETA minutes long.
        self._rate_step: int | None = None
        self._rate_time = 0.0
        self._step = 0
        self._last_draw = 0.0
        self._drawn_len = 0

    def update(self, step: int, *, force: bool = False) -> None:
        """Record that `step` steps are done and redraw if enough time passed."""
        now = time.monotonic()
        if self._start_step is None:
            self._start_step = step
            self._start_time = now
        elif self._rate_step is None and step > self._start_step:
            self._rate_step, self._rate_time = step, now
        self._step = step
        if force or now - self._last_draw >= self.min_interval_s:
            self._last_draw = now
            self._draw(now)

    def _render(self, now: float) -> str:
        """The bar's text for the current state."""
        elapsed = now - self._start_time
        rate = 0.0
        if self._rate_step is not None and self._step > self._rate_step and now > self._rate_time:
            rate = (self._step - self._rate_step) / (now - self._rate_time)
        if self.total:
            frac = min(1.0, self._step / self.total)
            filled = int(frac * self.width)
            bar = "#" * filled + "." * (self.width - filled)
            text = f"[{bar}] {self._step}/{self.total} {frac * 100:5.1f}%"
            if rate > 0:
                text += (
                    f" {rate:.2f} step/s ETA {_format_duration((self.total - self._step) / rate)}"
                )
        else:
            text = f"{self._step} steps"
            if rate > 0:
                text += f" {rate:.2f} step/s"
        return text + f" elapsed {_format_duration(elapsed)}"

    def _draw(self, now: float) -> None:
        text = self._render(now)
        pad = max(0, self._drawn_len - len(text))
        self.stream.write("\r" + text + " " * pad)
        self.stream.flush()
        self._drawn_len = len(text)

    def clear(self) -> None:
        """Erase the bar so another line can be printed on the terminal."""
        if self._drawn_len:
            self.stream.write("\r" + " " * self._drawn_len + "\r")
            self.stream.flush()
            self._drawn_len = 0

    def close(self) -> None:
        """Draw the final state and end the line."""
        self._draw(time.monotonic())
        self.stream.write("\n")
        self.stream.flush()
        self._drawn_len = 0
