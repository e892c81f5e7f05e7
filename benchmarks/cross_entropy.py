"""Benchmark: linear + cross-entropy, forward + backward, bf16, on one CUDA GPU.

What
    For each shape (N tokens, H hidden, V vocab) it runs, side by side in one process:
        eager               F.cross_entropy(F.linear(h, W).float(), t)
        torch.compile       the same code under torch.compile (Inductor, default options)
        liger               Liger-Kernel's LigerFusedLinearCrossEntropyLoss (skipped with a note
                            when liger-kernel is not installed: pip install liger-kernel)
        graphtrain op       torch.ops.graphtrain.linear_cross_entropy called directly
        graphtrain pass     the plain code compiled with graphtrain's backend (Inductor), where
                            the fuse_linear_cross_entropy pass inserts the op
    and reports the median fwd+bwd time (triton.testing.do_bench) and the extra peak memory:
    max_memory_allocated during one fwd+bwd minus what was allocated before it (the inputs),
    so the gradients (W.grad is 0.98 GiB at V=128256, H=4096 in bf16) are included, as in the
    MISSION.md peer numbers. A "loss err" column checks each row against eager.

Why
    MISSION.md's target for this op: faster than torch.compile (37.4 ms on an H100 at
    8192 x 4096 x 128256) AND less extra memory than Liger (1.1 GiB), in the same run.

Run
    python benchmarks/cross_entropy.py                      # both default shapes, all rows
    python benchmarks/cross_entropy.py --shape 4096,2048,32000 --impl eager,graphtrain-op
The table is printed and appended to benchmarks/RESULTS.md (date, device, torch/triton
versions, git commit); --no-record skips that.
"""

from __future__ import annotations

import argparse
import datetime
import subprocess
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
import triton.testing

import graphtrain  # noqa: F401  (the "graphtrain" backend and the passes)
from graphtrain.compile import backend as graphtrain_backend
from graphtrain.custom_ops import linear_cross_entropy as _lce  # noqa: F401  (registers the op)

SHAPES = [(8192, 4096, 128256), (16384, 2048, 151936)]
IMPLS = ("eager", "torch.compile", "liger", "graphtrain-op", "graphtrain-pass")
RESULTS = Path(__file__).with_name("RESULTS.md")
GIB = 1 << 30

LossFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def plain(h: torch.Tensor, w: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(F.linear(h, w).float(), t)


def build(impl: str) -> tuple[LossFn | None, str]:
    """The loss function of one row, or None and why it is skipped."""
    if impl == "eager":
        return plain, ""
    if impl == "torch.compile":
        return torch.compile(plain, fullgraph=True), ""
    if impl == "liger":
        try:
            from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss
        except ImportError:
            return None, "liger-kernel not installed (pip install liger-kernel)"
        loss = LigerFusedLinearCrossEntropyLoss()
        return (lambda h, w, t: loss(w, h, t)), ""  # Liger takes (weight, input, target)
    if impl == "graphtrain-op":
        return (lambda h, w, t: torch.ops.graphtrain.linear_cross_entropy(h, w, t)), ""
    if impl == "graphtrain-pass":
        compiled = torch.compile(
            plain, backend=graphtrain_backend(inner="inductor"), fullgraph=True
        )
        return compiled, ""
    raise ValueError(f"unknown --impl {impl!r}; known: {', '.join(IMPLS)}")


def measure(
    fn: LossFn, h: torch.Tensor, w: torch.Tensor, t: torch.Tensor
) -> tuple[float, float, float]:
    """(median ms of fwd+bwd, extra peak GiB, loss)."""

    def step() -> torch.Tensor:
        loss = fn(h, w, t)
        loss.backward()
        return loss

    for _ in range(2):  # compile, autotune, warm the allocator
        h.grad = w.grad = None
        loss = step()
    torch.cuda.synchronize()
    h.grad = w.grad = None
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    loss = step()
    torch.cuda.synchronize()
    extra = (torch.cuda.max_memory_allocated() - base) / GIB
    value = float(loss)  # outside the timed region
    h.grad = w.grad = None
    ms = triton.testing.do_bench(
        step, warmup=50, rep=300, grad_to_none=[h, w], return_mode="median"
    )
    return ms, extra, value


def git_commit() -> str:
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--shape", action="append", help="N,H,V (repeatable); default: the two MISSION shapes"
    )
    parser.add_argument(
        "--impl", default=",".join(IMPLS), help=f"comma list from {', '.join(IMPLS)}"
    )
    parser.add_argument(
        "--no-record", action="store_true", help="do not append to benchmarks/RESULTS.md"
    )
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/cross_entropy.py needs a CUDA GPU")
    shapes = [tuple(int(x) for x in s.split(",")) for s in args.shape] if args.shape else SHAPES
    impls = [i.strip() for i in args.impl.split(",") if i.strip()]
    for impl in impls:
        if impl not in IMPLS:
            raise SystemExit(f"unknown --impl {impl!r}; known: {', '.join(IMPLS)}")

    header = "| N, H, V | impl | fwd+bwd ms (median) | extra peak GiB | loss err vs eager | note |"
    lines = [header, "|---|---|---:|---:|---:|---|"]
    verdicts = []
    for N, H, V in shapes:
        torch.manual_seed(0)
        h = (torch.randn(N, H, device="cuda") * 1.0).to(torch.bfloat16).requires_grad_(True)
        w = (torch.randn(V, H, device="cuda") * H**-0.5).to(torch.bfloat16).requires_grad_(True)
        t = torch.randint(0, V, (N,), device="cuda")
        t[::17] = -100  # some ignored tokens, as packed sequences have
        results: dict[str, tuple[float, float, float]] = {}
        for impl in impls:
            torch._dynamo.reset()
            fn, note = build(impl)
            if fn is not None:
                try:
                    results[impl] = measure(fn, h, w, t)
                except torch.cuda.OutOfMemoryError:
                    note = "out of memory"
                h.grad = w.grad = None
                torch.cuda.empty_cache()
            shape = f"{N}, {H}, {V}"
            if impl in results:
                ms, extra, loss = results[impl]
                err = abs(loss - results["eager"][2]) if "eager" in results else float("nan")
                lines.append(f"| {shape} | {impl} | {ms:.2f} | {extra:.2f} | {err:.1e} | {note} |")
            else:
                lines.append(f"| {shape} | {impl} | - | - | - | {note} |")
            print(lines[-1], flush=True)
        ours = results.get("graphtrain-op")
        if ours and "torch.compile" in results:
            faster = ours[0] < results["torch.compile"][0]
            verdicts.append(
                f"{N}x{H}x{V}: graphtrain-op {'faster' if faster else 'NOT faster'} than torch.compile"
            )
        if ours and "liger" in results:
            smaller = ours[1] < results["liger"][1]
            verdicts.append(
                f"{N}x{H}x{V}: graphtrain-op {'less' if smaller else 'NOT less'} extra memory than Liger"
            )
        del h, w, t

    device = torch.cuda.get_device_name()
    stamp = datetime.datetime.now().strftime("%Y-%m-%d %H:%M")
    title = (
        f"## cross_entropy: linear + cross-entropy fwd+bwd, bf16 ({stamp}, {device}, "
        f"torch {torch.__version__}, triton {triton.__version__}, commit {git_commit()})"
    )
    text = "\n".join([title, "", *lines, "", *(f"- {v}" for v in verdicts), ""])
    print()
    print(text)
    if not args.no_record:
        if not RESULTS.exists():
            RESULTS.write_text(
                "# Benchmark results\n\n"
                "Appended by benchmarks/*.py, one section per run: date, device, torch/triton "
                "versions and git commit in the title. Compare rows only within a section.\n\n"
            )
        with RESULTS.open("a") as f:
            f.write(text + "\n")
        print(f"appended to {RESULTS}")


if __name__ == "__main__":
    main()
