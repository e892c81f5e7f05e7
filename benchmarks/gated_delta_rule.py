"""Benchmark: the gated delta rule of Gated DeltaNet, forward and forward + backward.

What
    Qwen3-Next's shapes by default: batch 1, sequence 4096 (--seq 32768 for the long one),
    32 value heads of 128 with q and k (16 key heads of 128) repeated to the value heads as
    models/gated_deltanet.py does, bf16 inputs, unit-norm keys, --documents equal documents
    per row (default 1); rows:
        torch.compile   the model's chunked reference (models.gated_deltanet.
                        chunk_gated_delta_rule, chunk 64) under torch.compile (Inductor)
        graphtrain triton  graphtrain::chunk_gated_delta_rule, kernels="triton" (ours)
        graphtrain fla  the same op, kernels="fla" (FLA's kernels inside our op: with
                        documents, the cu_seqlens it derives from our segments, a host sync)
        fla             flash-linear-attention's chunk_gated_delta_rule called directly
                        (documents as cu_seqlens over the rows laid end to end)
        torch.compile, our kernels in its slots   the chunked form under torch.compile with
                        our loop and inverse kernels in its slots (Inductor fuses the rest)
    where the fla-core package is installed (else the fla rows say so)
    reporting the median wall time (triton.testing.do_bench) of the forward and of forward +
    backward (all five input gradients for a fixed random output gradient), and each row's
    error against the reference in fp32 (the chunked form, eager; relative norm). Ours run
    first, the compiled reference last (its unrolled chunk loop compiles for minutes); a row
    that its software refuses here says why (its forward timed where only its backward
    fails); stopped by SIGINT (a stage's time cap), the rows measured are recorded.

Run
    python benchmarks/gated_delta_rule.py [--seq 4096 --batch 1 --documents 1] [--no-record]
    python benchmarks/gated_delta_rule.py --kernels     # instead of the table: where our op's
                                                        # forward + backward time goes, by kernel,
                                                        # its chunk systems' inverse 3 ways, and
                                                        # the slots row (printed, not recorded)
    python benchmarks/gated_delta_rule.py --cpu-smoke   # no GPU: tiny shape, the op agrees with
                                                        # the reference and the pass fires
The table is printed and appended to benchmarks/RESULTS.md unless --no-record.
"""

from __future__ import annotations

import argparse
import functools
import json
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
import triton.testing
from harness import (  # run as a script: benchmarks/ on sys.path
    CUT,
    kernel_table,
    parse_args,
    record,
    rows_until_cap,
    why_not,
)

import graphtrain.custom_ops.gated_delta_rule as gdr  # registers the op
from graphtrain.compile import backend as graphtrain_backend
from graphtrain.compile import region_config as graphtrain_region_config
from models.gated_deltanet import (
    GatedDeltaNet,
    chunk_gated_delta_rule,
    l2norm,
    segment_ids,
    unit_lower_inverse,
)

OP = torch.ops.graphtrain.chunk_gated_delta_rule
SLOTS = "torch.compile, our kernels in its slots"  # the row of the chunked form with our kernels


def inputs(B: int, T: int, H: int, D: int, device: str, dtype: torch.dtype):
    gen = torch.Generator(device=device).manual_seed(0)
    q = torch.randn(B, T, H, D, device=device, generator=gen)
    k = l2norm(torch.randn(B, T, H, D, device=device, generator=gen))
    v = torch.randn(B, T, H, D, device=device, generator=gen)
    g = -F.softplus(torch.randn(B, T, H, device=device, generator=gen)) * 0.1
    beta = torch.rand(B, T, H, device=device, generator=gen)
    grad_o = torch.randn(B, T, H, D, device=device, generator=gen).to(dtype)
    xs = [x.to(dtype).requires_grad_() for x in (q, k, v, g, beta)]
    return xs, grad_o


def documents(B: int, T: int, n: int, device: str) -> tuple[torch.Tensor | None, torch.Tensor]:
    """Our segments (None for one document per row) and FLA's cu_seqlens over the rows laid
    end to end, for n documents of (nearly) equal length per row."""
    bounds = torch.linspace(0, T, n + 1).long()
    ids = torch.repeat_interleave(torch.arange(n), bounds.diff()).expand(B, T)
    starts = (torch.arange(B)[:, None] * T + bounds[None, :-1]).flatten()
    cu = torch.cat([starts, torch.tensor([B * T])]).to(device)
    return (segment_ids(ids).to(device) if n > 1 else None), cu


def builds(D: int, seg: torch.Tensor | None, cu: torch.Tensor) -> dict:
    """The rows in the order they run: ours first, the compiled reference last (its chunk loop,
    unrolled, takes minutes to compile: a time cap cuts it, not the others)."""
    scale = D**-0.5
    fns = {}
    for kernels in ("triton", "fla"):
        fns[f"graphtrain {kernels}"] = lambda q, k, v, g, b, kernels=kernels: OP(
            q, k, v, g, b, seg, scale=scale, chunk_size=64, kernels=kernels
        )
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fla_rule
    except ImportError:
        del fns["graphtrain fla"]
        fla_rule = None

    def fla(q, k, v, g, b):
        if seg is None:
            return fla_rule(q, k, v, g, b, scale=scale)[0]
        rows = (x.reshape(1, -1, *x.shape[2:]) for x in (q, k, v, g, b))
        return fla_rule(*rows, scale=scale, cu_seqlens=cu)[0].reshape(v.shape)

    if fla_rule is not None:
        fns["fla"] = fla
    # The chunked form with our two kernels in its slots, the rest compiled by Inductor (its
    # chunk terms fused, the backward AOTAutograd's): what a pass emitting that form would give
    slots = gdr.triton_slots(torch.bfloat16)
    fns[SLOTS] = torch.compile(
        lambda q, k, v, g, b: chunk_gated_delta_rule(q, k, v, g, b, seg, 64, scale, **slots)
    )
    fns["torch.compile"] = torch.compile(
        lambda q, k, v, g, b: chunk_gated_delta_rule(q, k, v, g, b, seg, 64, scale)
    )
    return fns


def measure_row(name, fn, xs, grad_o, want, bench) -> str:
    """One table row: fn's forward and forward + backward times (bench(callable) -> ms) and its
    error against `want`. The forward is timed as training runs it, with grad (a compiled row's
    one graph: under no_grad Dynamo would compile an inference graph too, minutes for the
    unrolled reference). Our own op must run; a peer that fails is a row that says why, its
    forward timed where only its backward fails (FLA's direct call on Hopper with triton >=
    3.4.0 and < 3.7.1 refuses in its backward alone)."""
    ours = name == "graphtrain triton"
    try:
        out = fn(*xs)
        fwd, err = bench(lambda: fn(*xs)), f"{_rel(out, want):.1e}"
    except Exception as e:
        if ours:
            raise
        return f"| {name} | {why_not(e, 'skipped')} | | |"

    def step():
        return torch.autograd.grad(fn(*xs), xs, grad_o)

    try:
        both = f"{bench(step):.3f}"
    except Exception as e:
        if ours:
            raise
        both = why_not(e, "backward not run")
    return f"| {name} | {fwd:.3f} | {both} | {err} |"


def ours_step(xs, grad_o, seg, D) -> tuple:
    """Our op's forward and backward, kernels="triton": --kernels profiles it."""
    o = OP(*xs, seg, scale=D**-0.5, chunk_size=64, kernels="triton")
    return torch.autograd.grad(o, xs, grad_o)


def inverse_rows(n: int, D: int, device: str, bench) -> list[str]:
    """The op's chunk systems inverted three ways, n systems of 64 in fp32 (forward only):
    the two solves the chunked form ran before 2026-11-30 (for u_v and u_s, D right-hand sides
    each), the model's solve against the identity (plain compile's and the pass-off row's),
    graphtrain::unit_lower_inverse (our CUDA path's)."""
    gen = torch.Generator(device=device).manual_seed(1)
    k = l2norm(torch.randn(n, 64, D, device=device, generator=gen))
    beta = torch.rand(n, 64, 1, device=device, generator=gen)
    lower = ((k * beta) @ k.mT).tril(-1)
    system = lower + torch.eye(64, device=device)
    rhs = torch.randn(n, 64, D, device=device, generator=gen)
    fns = {
        f"two solves of {D} right-hand sides": lambda: [
            torch.linalg.solve_triangular(system, rhs, upper=False) for _ in range(2)
        ],
        "solve against the identity (models.gated_deltanet)": lambda: unit_lower_inverse(lower),
        "graphtrain::unit_lower_inverse": lambda: torch.ops.graphtrain.unit_lower_inverse(lower),
    }
    rows = [f"| {n} chunk systems of 64, inverted | ms |", "|---|---:|"]
    return rows + [f"| {name} | {bench(fn):.3f} |" for name, fn in fns.items()]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


class _ForwardOnly(torch.autograd.Function):
    """For the CPU smoke: a peer whose forward runs and whose backward refuses, as FLA's does
    on Hopper with triton 3.6."""

    @staticmethod
    def forward(ctx, q, k, v, g, b):
        return chunk_gated_delta_rule(q, k, v, g, b, None, 64, q.shape[-1] ** -0.5)

    @staticmethod
    def backward(ctx, grad_o):
        raise RuntimeError("gated chunk_bwd_dqkwg refuses this GPU and triton (see its #640)")


def cpu_smoke() -> None:
    (q, k, v, g, beta), _ = inputs(2, 70, 2, 8, "cpu", torch.float32)
    ref = chunk_gated_delta_rule(q, k, v, g, beta, None, 64, 8**-0.5)
    out = OP(q, k, v, g, beta, None, scale=8**-0.5, chunk_size=64)
    assert torch.equal(out, ref)
    seg, cu = documents(2, 70, 3, "cpu")  # the fla row's cu_seqlens are the op's for seg
    assert torch.equal(cu, gdr._fla_documents(seg, q)[1])
    layer = GatedDeltaNet(32, 2, 4, 8, 8, 4, 1e-6)
    layer.init_weights(0.02, 0.01)
    x = torch.randn(2, 40, 32)
    with tempfile.TemporaryDirectory() as dump:
        torch._dynamo.reset()
        fn = torch.compile(
            layer,
            backend=graphtrain_backend(
                inner="aot_eager",
                dump_dir=dump,
                passes=["+gated_delta_rule"],
                pass_options={"gdr_kernels": "triton"},
            ),
        )
        with graphtrain_region_config():  # as the trainer traces a region
            torch.testing.assert_close(fn(x), layer(x))
        (summary,) = Path(dump).glob("*/summary.json")
        steps = {s["label"]: s for s in json.loads(summary.read_text())}
        fired = steps["gated_delta_rule"]["op_diff"].get(
            "graphtrain.chunk_gated_delta_rule.default"
        )
    assert fired == 1, steps["gated_delta_rule"]
    assert "kernels='triton'); on cpu: reference" in steps["gated_delta_rule"]["notes"][0]
    (q, k, v, g, beta), grad_o = inputs(1, 70, 2, 8, "cpu", torch.float32)
    fns = builds(8, None, documents(1, 70, 1, "cpu")[1])
    order = list(fns)
    assert order[0] == "graphtrain triton" and order[-1] == "torch.compile", order
    assert order[-2] == SLOTS, order  # before the compiled reference, which a cap cuts
    xs = [q, k, v, g, beta]
    want = chunk_gated_delta_rule(*xs, None, 64, 8**-0.5)

    def untimed(fn):
        fn()
        return 0.0

    def refusing(*xs):  # a peer whose software refuses this device: here, an unknown kernel set
        return OP(*xs, None, scale=8**-0.5, chunk_size=64, kernels="none")

    ours = measure_row("graphtrain triton", fns["graphtrain triton"], xs, grad_o, want, untimed)
    assert ours.endswith("| 0.000 | 0.000 | 0.0e+00 |"), ours
    refused = measure_row("refusing peer", refusing, xs, grad_o, want, untimed)
    assert "skipped: ValueError" in refused, refused
    forward_only = measure_row("forward-only peer", _ForwardOnly.apply, xs, grad_o, want, untimed)
    assert forward_only.startswith("| forward-only peer | 0.000 | backward not run: "), forward_only
    assert forward_only.endswith(" 0.0e+00 |") and "RuntimeError: gated" in forward_only
    table = kernel_table(functools.partial(ours_step, xs, grad_o, None, 8), top=25)
    assert table[-1].startswith("| all ") and len(table) > 6, table  # --kernels' table
    assert len(inverse_rows(4, 8, "cpu", untimed)) == 5  # and its inverse rows
    print("cpu smoke: the op equals the reference, the pass inserts it, refused rows say why")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--documents", type=int, default=1, help="equal documents per row")
    parser.add_argument(
        "--kernels",
        action="store_true",
        help="instead of the table: our op's forward + backward kernels under torch.profiler "
        "(printed): where its time goes",
    )
    args = parse_args(parser, cpu_smoke)
    if args is None:
        return
    B, T, H, D = args.batch, args.seq, args.heads, args.head_dim
    xs, grad_o = inputs(B, T, H, D, "cuda", torch.bfloat16)
    seg, cu = documents(B, T, args.documents, "cuda")
    fns = builds(D, seg, cu)
    with torch.no_grad():  # the model's chunked form in fp32, eager: no compile to wait for
        want = chunk_gated_delta_rule(*(x.float() for x in xs), seg, 64, D**-0.5)
    lines = [
        "| impl | fwd ms | fwd+bwd ms | rel err of o vs fp32 reference |",
        "|---|---:|---:|---:|",
    ]
    bench = functools.partial(triton.testing.do_bench, return_mode="median")
    if args.kernels:
        print(f"our op, forward + backward, B={B}, T={T}, {H} heads of {D}, bf16:")
        print("\n".join(kernel_table(functools.partial(ours_step, xs, grad_o, seg, D), top=25)))
        print("\n".join(inverse_rows(B * H * triton.cdiv(T, 64), D, "cuda", bench)))
        # the next lever's row here too, early in the hybrid stage (RESULTS, Gated DeltaNet)
        lines.append(measure_row(SLOTS, fns[SLOTS], xs, grad_o, want, bench))
        print("\n".join(lines))
        return

    def fill() -> None:
        for name, fn in fns.items():
            lines.append(measure_row(name, fn, xs, grad_o, want, bench))

    rows_until_cap(lines, fill, f"| (the rest) | {CUT} | | |")
    if "fla" not in fns:
        lines.append("| graphtrain fla, fla | fla-core not installed | | |")
    table = "\n".join(lines)
    if args.no_record:
        print(table)
    else:
        docs = f", {args.documents} documents per row" if args.documents > 1 else ""
        record(f"gated_delta_rule: B={B}, T={T}, {H} heads of {D}, bf16{docs}", table)


if __name__ == "__main__":
    main()
