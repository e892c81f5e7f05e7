"""Print a short run's every logged loss as float.hex, to compare two commits bit for bit.

    python benchmarks/bitwise_curve.py [--preset tiny] [--steps 5] [any --section.key=value ...]

Trains with `graphtrain train` in a temporary run directory, logging every step, then prints one
line per metrics.jsonl value whose key names a loss: `step key hex`. Run it at each commit with
the same arguments (same seed and data) and diff the outputs; a refactor must change nothing.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path


def hex_losses(metrics: Path) -> list[str]:
    """`step key float.hex(value)` for every loss value in the metrics.jsonl file `metrics`."""
    lines = []
    for row in map(json.loads, metrics.read_text().splitlines()):
        for key, value in sorted(row.items()):
            if "loss" in key and isinstance(value, float):
                lines.append(f"{row.get('step')} {key} {value.hex()}")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--steps", type=int, default=5)
    args, extra = parser.parse_known_args()
    with tempfile.TemporaryDirectory() as tmp:
        command = [
            sys.executable,
            "-m",
            "graphtrain",
            "train",
            f"--preset={args.preset}",
            f"--training.steps={args.steps}",
            "--metrics.log_interval=1",
            "--metrics.val_interval=0",
            f"--training.run_dir={tmp}/run",
            *extra,
        ]
        subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
        print("\n".join(hex_losses(Path(tmp) / "run" / "metrics.jsonl")))


if __name__ == "__main__":
    main()
