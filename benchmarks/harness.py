"""What every benchmark shares: record() stamps a results table and appends it to RESULTS.md.

record(title, body) prints "## title (date, device, torch/triton versions, commit)" with the
table under it and appends it to benchmarks/RESULTS.md; git_commit() is the commit it stamps
($GRAPHTRAIN_COMMIT where the copy's git HEAD is stale); sqnr(got, want) the signal-to-noise
ratio in dB by which rows are checked against a reference; kernel_table(step) where a row's
time goes, kernel by kernel; parse_args(parser, cpu_smoke) the options every benchmark has
(--no-record, --cpu-smoke); rows_until_cap(rows, fill, cut_row) keeps the rows measured when
a GPU stage's time cap stops a benchmark part-way; why_not(error) is the cell of a row that
failed. The benchmarks run as scripts, so they import this module as `harness` (benchmarks/ is
first on their sys.path).
"""

from __future__ import annotations

import argparse
import datetime
import os
import subprocess
import traceback
from collections.abc import Callable
from pathlib import Path

import torch
import triton

RESULTS = Path(__file__).with_name("RESULTS.md")


def record(title: str, body: str, note: str = "") -> None:
    """Print and append to RESULTS.md a section "## title (date, device, torch/triton versions,
    commit[note])" with `body` under it: every benchmark's results are stamped alike."""
    stamp = (
        f"{datetime.datetime.now():%Y-%m-%d %H:%M}, {torch.cuda.get_device_name()}, "
        f"torch {torch.__version__}, triton {triton.__version__}, commit {git_commit()}{note}"
    )
    text = f"## {title} ({stamp})\n\n{body}\n"
    print()
    print(text)
    if not RESULTS.exists():
        RESULTS.write_text(
            "# Benchmark results\n\n"
            "Appended by benchmarks/*.py, one section per run: date, device, torch/triton "
            "versions and git commit in the title. Compare rows only within a section.\n\n"
        )
    with RESULTS.open("a") as f:
        f.write("\n" + text)
    print(f"appended to {RESULTS}")


CUT = "not run: stopped by SIGINT (the stage's time cap)"  # a row's note, cut by the cap


def why_not(error: BaseException, what: str = "not run") -> str:
    """A failed row's cell: "what: " and the root cause's type and first line (Dynamo and
    Triton wrap the real error; their messages run to many lines), "|" kept out of the table;
    the whole traceback printed for the log, since a GPU run is rare."""
    traceback.print_exception(error)
    while error.__cause__ is not None:
        error = error.__cause__
    first = (str(error).strip().splitlines() or [""])[0]
    return f"{what}: {type(error).__name__}: {first}".replace("|", "/")[:300]


def rows_until_cap(rows: list, fill: Callable[[], object], cut_row: object) -> list:
    """Run fill(), which appends a table's rows to `rows` as they are measured. Stopped by SIGINT
    (benchmarks/gpu_session.sh's cap on an item) after at least one row of its own, the rows
    measured stay and `cut_row` (saying CUT) ends them, for the caller to record; with none,
    the interrupt goes on."""
    before = len(rows)
    try:
        fill()
    except KeyboardInterrupt:
        if len(rows) == before:
            raise
        rows.append(cut_row)
    return rows


def git_commit() -> str:
    """The commit a result is stamped with: $GRAPHTRAIN_COMMIT when set (a copy of the
    repository whose git HEAD is stale, e.g. one synced onto a GPU machine, is told its commit
    by hand), else git's short HEAD, "+dirty" with uncommitted changes."""
    if os.environ.get("GRAPHTRAIN_COMMIT"):
        return os.environ["GRAPHTRAIN_COMMIT"]
    root = Path(__file__).resolve().parent.parent
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            cwd=root,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        head = "no-commit"
    try:
        dirty = subprocess.run(
            ["git", "status", "--porcelain"], cwd=root, capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        dirty = ""
    return head + ("+dirty" if dirty else "")


def sqnr(got: torch.Tensor, want: torch.Tensor) -> float:
    """10 log10(sum want^2 / sum (got - want)^2), in float64."""
    want = want.double()
    noise = (got.double() - want).pow(2).sum().clamp_min(1e-300)
    return (10 * torch.log10(want.pow(2).sum() / noise)).item()


def kernel_table(step: Callable[[], object], *, iters: int = 3, top: int = 12) -> list[str]:
    """Markdown rows "| kernel | calls | ms per call |" of the `top` kernels by time of `iters`
    calls of `step` (after one unprofiled call) under torch.profiler, then the total: device
    time on CUDA, the operators' own CPU time on CPU. Time per call of `step`."""
    cuda = torch.cuda.is_available()
    activities = [torch.profiler.ProfilerActivity.CPU]
    if cuda:
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    step()
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(iters):
            step()
        if cuda:
            torch.cuda.synchronize()
    if cuda:  # the device kernels, not the operators that launched them
        events = [e for e in prof.key_averages() if e.device_type.name == "CUDA"]
        us = {e.key: (e.self_device_time_total, e.count) for e in events}
    else:
        us = {e.key: (e.self_cpu_time_total, e.count) for e in prof.key_averages()}
    rows = sorted(us.items(), key=lambda kv: -kv[1][0])
    lines = ["| kernel | calls | ms per call |", "|---|---:|---:|"]
    for name, (total, count) in rows[:top]:
        name = name.replace("|", "/")[:100]
        lines.append(f"| {name} | {count // iters} | {total / 1e3 / iters:.3f} |")
    total = sum(t for t, _ in us.values()) / 1e3 / iters
    lines.append(f"| all {len(us)} kernels | | {total:.3f} |")
    return lines


def parse_args(
    parser: argparse.ArgumentParser, cpu_smoke: Callable[[], None]
) -> argparse.Namespace | None:
    """A benchmark's options with --no-record and --cpu-smoke added. --cpu-smoke runs cpu_smoke()
    (no GPU: tiny shapes, the rows checked against each other) and gives None, for the caller
    to return; otherwise the benchmark needs a CUDA GPU, and says so."""
    parser.add_argument("--no-record", action="store_true", help="print only: RESULTS.md untouched")
    parser.add_argument(
        "--cpu-smoke", action="store_true", help="no GPU: tiny shapes, rows checked"
    )
    args = parser.parse_args()
    if args.cpu_smoke:
        cpu_smoke()
        return None
    if not torch.cuda.is_available():
        raise SystemExit(f"benchmarks/{parser.prog} needs a CUDA GPU (or --cpu-smoke)")
    return args
