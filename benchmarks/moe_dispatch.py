"""Benchmark: the MoE token dispatch (permute) and weighted combine (unpermute), fwd and fwd+bwd.

What
    moe-1b's shape by default: T = 16384 tokens (4 x 4096), k = 6 slots per token, D = 1024;
    x fp32 (the normalised residual under autocast), slots bf16, weights fp32, one random
    expert per slot (64 experts), as models/moe.py writes it:
        xs  = x[order // k].to(bf16)                                    the permute
        out = (empty_like(ys).index_copy_(0, order, ys).view(T, k, D).float()
               * weights.unsqueeze(-1)).sum(1)                          the combine
    with `ys` an independent input (the experts' GEMMs sit between the two in a model, so
    nothing fuses across them), run as (and tabled in this order, each row as it is measured)
        torch.compile   the plain code under torch.compile (Inductor, default options)
        eager           the plain code
        graphtrain      the plain code through graphtrain's backend: fuse_moe_dispatch puts
                        graphtrain.moe_permute / moe_unpermute in (checked from the pass dump)
    reporting the median wall time (triton.testing.do_bench) and the GPU kernel time (the
    profiler's sum over kernels per call) of the forward and of forward + backward (d x, d ys,
    d weights for fixed random output gradients), each row's agreement with eager, and the
    memory floor: the bytes the forward must move (read x, write xs, read ys, write out) and
    the backward (read d xs, write d x, read d out and ys, write d ys) at 3.0 TB/s.

Run
    python benchmarks/moe_dispatch.py [--tokens 16384 --top-k 6 --dim 1024] [--no-record]
    python benchmarks/moe_dispatch.py --cpu-smoke     # no GPU: tiny shape, the pass fires and
                                                      # the three rows agree
The table is printed and appended to benchmarks/RESULTS.md unless --no-record.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import torch
import triton
import triton.testing
from harness import CUT, parse_args, record, rows_until_cap, why_not  # benchmarks/ on sys.path
from moe_router import HBM_BYTES_PER_S, kernel_ms

from graphtrain.compile import backend as graphtrain_backend

IMPLS = ("torch.compile", "eager", "graphtrain")  # torch.compile first: the others vs it


def plain_dispatch(x, ys, weights, experts):
    T, k = experts.shape
    order = torch.argsort(experts.flatten(), stable=True)
    xs = x[order // k].to(ys.dtype)
    y = torch.empty_like(ys).index_copy_(0, order, ys)
    out = (y.view(T, k, -1).float() * weights.unsqueeze(-1)).sum(1)
    return xs, out


def build(impl: str, dump_dir: str | None = None):
    if impl == "eager":
        return plain_dispatch
    if impl == "torch.compile":
        return torch.compile(plain_dispatch, fullgraph=True)
    if impl == "graphtrain":
        return torch.compile(
            plain_dispatch, backend=graphtrain_backend(dump_dir=dump_dir), fullgraph=True
        )
    raise ValueError(f"unknown impl {impl!r}; known: {', '.join(IMPLS)}")


def inputs(T: int, k: int, D: int, device: str, slot_dtype: torch.dtype):
    g = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(T, D, device=device, generator=g, requires_grad=True)
    ys = torch.randn(T * k, D, device=device, generator=g).to(slot_dtype).requires_grad_()
    weights = torch.rand(T, k, device=device, generator=g, requires_grad=True)
    experts = torch.randint(0, 64, (T, k), device=device, generator=g)
    grad_xs = torch.randn(T * k, D, device=device, generator=g).to(slot_dtype)
    grad_out = torch.randn(T, D, device=device, generator=g)
    return x, ys, weights, experts, grad_xs, grad_out


def run_all(fn, x, ys, weights, experts, grad_xs, grad_out):
    xs, out = fn(x, ys, weights, experts)
    grads = torch.autograd.grad([xs, out], [x, ys, weights], [grad_xs, grad_out])
    return (xs.detach(), out.detach(), *grads)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def _pass_fired(dump: str) -> bool:
    for summary in Path(dump).glob("*/summary.json"):
        for step in json.loads(summary.read_text()):
            counts = step.get("op_counts", {})
            if step["label"] == "fuse_moe_dispatch" and counts.get(
                "graphtrain.moe_permute.default"
            ):
                return counts.get("graphtrain.moe_unpermute.default", 0) == 1
    return False


def cpu_smoke() -> None:
    args = inputs(37, 3, 24, "cpu", torch.float32)
    want = run_all(plain_dispatch, *args)
    with tempfile.TemporaryDirectory() as dump:
        fn = torch.compile(
            plain_dispatch,
            backend=graphtrain_backend(inner="aot_eager", dump_dir=dump),
            fullgraph=True,
        )
        got = run_all(fn, *args)
        assert _pass_fired(dump), "the pass did not insert both ops"
    errs = [_rel(g, w) for g, w in zip(got, want, strict=True)]
    assert max(errs) < 1e-6, errs
    print("cpu smoke: eager and graphtrain (both ops inserted) agree")


def measure(fn, data, want) -> tuple[float, float, tuple[float, float], float]:
    """fn's (forward ms, forward+backward ms, their kernel ms, max relative error vs want);
    the first call compiles."""
    x, ys, weights, experts, *_ = data
    err = max(_rel(g, w) for g, w in zip(run_all(fn, *data), want, strict=True))

    def forward():
        with torch.no_grad():
            return fn(x, ys, weights, experts)

    def step():
        return run_all(fn, *data)

    fwd, both = (triton.testing.do_bench(f, return_mode="median") for f in (forward, step))
    return fwd, both, (kernel_ms(forward, x), kernel_ms(step, x)), err


def fill_rows(data, dump: str, lines: list[str]) -> None:
    """Append a row to `lines` as each impl is measured, torch.compile's first: the kernel
    times of the others are put against it. A row that fails says why."""
    want = run_all(plain_dispatch, *data)
    base = None
    for impl in IMPLS:
        torch._dynamo.reset()
        try:
            fwd, both, kernels, err = measure(build(impl, dump), data, want)
        except Exception as e:  # the others are still measured
            lines.append(f"| {impl} | {why_not(e)} | | | | |")
        else:
            base = kernels if impl == "torch.compile" else base
            vs = (
                [f" ({b / k:.2f}x)" for b, k in zip(base, kernels, strict=True)]
                if base
                else ["", ""]
            )
            lines.append(
                f"| {impl} | {fwd:.3f} | {kernels[0]:.3f}{vs[0]} | {both:.3f} | "
                f"{kernels[1]:.3f}{vs[1]} | {err:.1e} |"
            )
        print(lines[-1], flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--top-k", type=int, default=6)
    parser.add_argument("--dim", type=int, default=1024)
    args = parse_args(parser, cpu_smoke)
    if args is None:
        return
    T, k, D = args.tokens, args.top_k, args.dim
    fwd_bytes = T * D * 4 + T * k * D * 2 + T * k * D * 2 + T * D * 4
    bwd_bytes = T * k * D * 2 + T * D * 4 + T * D * 4 + 2 * T * k * D * 2
    lines = [
        f"memory floor: forward {fwd_bytes / 2**20:.0f} MiB -> "
        f"{fwd_bytes / HBM_BYTES_PER_S * 1e3:.3f} ms; forward+backward "
        f"{(fwd_bytes + bwd_bytes) / 2**20:.0f} MiB -> "
        f"{(fwd_bytes + bwd_bytes) / HBM_BYTES_PER_S * 1e3:.3f} ms (at 3.0 TB/s)",
        "",
        "| impl | fwd ms | fwd kernels ms (vs compile) | fwd+bwd ms | "
        "fwd+bwd kernels ms (vs compile) | max rel err vs eager |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    data = inputs(T, k, D, "cuda", torch.bfloat16)
    with tempfile.TemporaryDirectory() as dump:
        rows_until_cap(lines, lambda: fill_rows(data, dump, lines), f"| (the rest) | {CUT} |")
        lines += ["", f"- fuse_moe_dispatch inserted both ops: {_pass_fired(dump)}"]
    table = "\n".join(lines)
    if args.no_record:
        print(table)
    else:
        record(f"moe_dispatch: permute + combine, T={T}, k={k}, D={D}, x fp32, slots bf16", table)


if __name__ == "__main__":
    main()
