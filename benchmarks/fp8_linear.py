"""Benchmark: a linear layer's forward + backward in FP8 (per-tensor current scaling) against bf16.

What
    For (M, K, N) = 16384x4096x4096, 16384x8192x8192, 8192x2048x8192 (MISSION.md's anchors):
    x [M, K] bf16, W [N, K] bf16, out = x W^T, then d x and d W for a fixed random d out; one
    timed call runs all three GEMMs and, for the FP8 rows, every amax and cast:
        bf16            F.linear under torch.compile (the baseline)
        fp8 compiled    the same recipe as graphtrain's (E4M3 x and W, E5M2 d out, one scale
                        per tensor from its current amax, torch._scaled_mm for the three
                        GEMMs, the forward's fast-accumulated) written in plain torch and
                        compiled by Inductor: what torchao's tensorwise recipe does
        graphtrain      graphtrain::fp8_linear (Triton amax and cast+transpose kernels, then
                        torch._scaled_mm)
        torchao         torchao.float8 Float8Linear, tensorwise recipe, compiled (when torchao
                        imports and runs on this torch; otherwise the row says why)
    then two kinds of rows that say where the FP8 speed-up is bounded:
        GEMMs only      the three GEMMs alone, bf16 torch.mm against torch._scaled_mm on
                        operands cast beforehand, with their TFLOP/s: the rate that decides
                        whether the targets can be met at all (benchmarks/RESULTS.md, FP8);
                        again with the forward GEMM promoted to fp32 (use_fast_accum off):
                        what the fast-accumulated forward (FORWARD_FAST_ACCUM) gains
        rmsnorm + linear   x = rms_norm(x0) feeding the linear, compiled: bf16, and graphtrain's
                        fp8_linear pass with the post-grad pass fp8_cast_once off and on (on, the
                        amax of x is computed by the RMSNorm's own kernel; predicted saving
                        2 bytes per element of x, ~0.045 ms at the first shape)
    and the grouped experts at moe-1b's shapes (64 experts, 16384 tokens x top-6 = 98304 rows:
    the fused w1|w3 W [64, 1024, 1024] with the rows split evenly and with a skewed routing
    whose groups are no multiples of 16, and w2 W [64, 1024, 512]): torch._grouped_mm in bf16
    against graphtrain::fp8_grouped_mm (on sm90 three torch._scaled_grouped_mm, the wgrad's
    operands cast straight into groups padded on the device, the experts' weights cast in one
    launch; elsewhere its loop of torch._scaled_mm per expert), then each of the op's three
    grouped GEMMs alone (forward, dgrad, wgrad; bf16 against FP8 on operands cast beforehand,
    with their TFLOP/s: the GEMMs' share of the op's time, the rest being its casts; each
    also with the other accumulation: the forward promoted to fp32, the dgrad and wgrad
    fast-accumulated, which the op does not do). Each row: median ms (triton.testing.do_bench),
    speedup over bf16, SQNR (dB) of out, d x, d W against the bf16 row.

Run
    python benchmarks/fp8_linear.py [--shapes 16384x4096x4096,...] [--no-record]
    python benchmarks/fp8_linear.py --kernels --shapes 16384x4096x4096   # where the FP8 rows'
        # time goes, kernel by kernel (printed; the grouped w1|w3 shape too)
    python benchmarks/fp8_linear.py --cpu-smoke   # no GPU: tiny shapes, fp32, every FP8 row
                                                  # agrees with the fp32 linear by SQNR and
                                                  # graphtrain's op with the plain recipe
The table is printed and appended to benchmarks/RESULTS.md unless --no-record.
"""

from __future__ import annotations

import argparse
from collections.abc import Iterator

import torch
import torch.nn.functional as F
import triton
import triton.testing
from harness import (
    CUT,
    kernel_table,
    parse_args,
    record,
    rows_until_cap,
    sqnr,
    why_not,
)  # run as a script: benchmarks/ on sys.path

import graphtrain.custom_ops  # noqa: F401  (registers graphtrain::fp8_linear, fp8_grouped_mm)
from graphtrain.compile import backend
from graphtrain.custom_ops import fp8_grouped_mm as grouped_op

SHAPES = ((16384, 4096, 4096), (16384, 8192, 8192), (8192, 2048, 8192))
# moe-1b's experts: 16384 tokens x top-6 slots, 64 experts, dim 1024, width 512 (w1|w3 fused)
GROUPED_SHAPES = (
    ("experts w1|w3 98304x1024x1024 (E=64, even)", 1024, 1024, False),
    ("experts w1|w3 98304x1024x1024 (E=64, skewed)", 1024, 1024, True),
    ("experts w2 98304x512x1024 (E=64, even)", 512, 1024, False),
)
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def _cast(t: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain-torch per-tensor current scaling: (t8, 1 / scale)."""
    fp8_max = torch.finfo(dtype).max
    scale = fp8_max / t.abs().amax().float().clamp_min(1e-12)
    return (t.float() * scale).clamp(-fp8_max, fp8_max).to(dtype), scale.reciprocal()


class PlainFp8Linear(torch.autograd.Function):
    """The recipe in plain torch (the compiled peer): Inductor fuses each amax and cast."""

    @staticmethod
    def forward(ctx, x, w):
        x8, sx = _cast(x, E4M3)
        w8, sw = _cast(w, E4M3)
        ctx.save_for_backward(x8, sx, w8, sw)
        return torch._scaled_mm(x8, w8.t(), sx, sw, out_dtype=x.dtype, use_fast_accum=True)

    @staticmethod
    def backward(ctx, grad):
        x8, sx, w8, sw = ctx.saved_tensors
        g8, sg = _cast(grad, E5M2)
        # _scaled_mm: first operand row-major, second column-major
        grad_x = torch._scaled_mm(g8, w8.t().contiguous().t(), sg, sw, out_dtype=grad.dtype)
        grad_w = torch._scaled_mm(
            g8.t().contiguous(), x8.t().contiguous().t(), sg, sx, out_dtype=grad.dtype
        )
        return grad_x, grad_w


def plain_fp8(x, w):
    return PlainFp8Linear.apply(x, w)


def graphtrain_fp8(x, w):
    return torch.ops.graphtrain.fp8_linear(x, w, None)[0]


def torchao_fp8():
    """A function (x, w) -> out through torchao's Float8Linear (tensorwise), or the reason."""
    try:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    except Exception as e:  # not installed, or built for another torch
        return f"torchao.float8 does not import: {type(e).__name__}: {e}"[:160]
    cache: dict = {}

    def run(x, w):
        # w enters as the module's weight for this call (functional_call), so that autograd
        # reaches the benchmark's w: a Parameter made from it would cut the graph there
        if w.shape not in cache:
            lin = torch.nn.Linear(w.shape[1], w.shape[0], bias=False, device=w.device)
            config = Float8LinearConfig.from_recipe_name("tensorwise")
            module = convert_to_float8_training(lin.to(w.dtype), config=config)
            cache[w.shape] = torch.compile(
                lambda x, w: torch.func.functional_call(module, {"weight": w}, (x,))
            )
        return cache[w.shape](x, w)

    return run


def fwd_bwd(fn, x, w, grad):
    out = fn(x, w)
    return (out, *torch.autograd.grad(out, [x, w], grad))


def linear_inputs(M, K, N, device, dtype):
    g = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(M, K, device=device, generator=g).to(dtype).requires_grad_()
    w = (torch.randn(N, K, device=device, generator=g) / K**0.5).to(dtype).requires_grad_()
    grad = torch.randn(M, N, device=device, generator=g).to(dtype)
    return x, w, grad


def grouped_inputs(tokens, E, K, N, device, dtype, skewed=False):
    g = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(tokens, K, device=device, generator=g).to(dtype).requires_grad_()
    w = (torch.randn(E, N, K, device=device, generator=g) / K**0.5).to(dtype).requires_grad_()
    counts = torch.full((E,), tokens // E, dtype=torch.int64)
    if skewed:  # expert e gets a share growing as e + 1/3: group sizes no multiples of 16
        share = torch.arange(E, dtype=torch.float64) + 1 / 3
        counts = (share / share.sum() * tokens).long()
    counts[-1] += tokens - counts.sum()
    offs = counts.cumsum(0).to(device=device, dtype=torch.int32)
    grad = torch.randn(tokens, N, device=device, generator=g).to(dtype)
    return x, w, offs, grad


def linear_rows():
    """[(impl, callable or the reason it cannot run)]."""
    return [
        ("bf16 (compiled)", torch.compile(F.linear)),
        ("fp8 plain recipe (compiled)", torch.compile(plain_fp8)),
        ("graphtrain fp8_linear", graphtrain_fp8),
        ("torchao Float8Linear tensorwise", torchao_fp8()),
    ]


def gemm_rows(x, w, grad):
    """[(impl, fn)] of the three GEMMs alone (forward, dgrad, wgrad), on tensors prepared here:
    bf16 torch.mm, and torch._scaled_mm on E4M3 x, W and E5M2 d out in the layouts it takes."""
    x, w = x.detach(), w.detach()

    def bf16():
        return x @ w.t(), grad @ w, grad.t() @ x

    def fp8_operand(t, dtype):
        t8, scale_inv = _cast(t, dtype)
        return t8, t8.t().contiguous(), scale_inv

    (x8, x8_t, sx), (w8, w8_t, sw), (g8, g8_t, sg) = (
        fp8_operand(x, E4M3),
        fp8_operand(w, E4M3),
        fp8_operand(grad, E5M2),
    )

    def fp8(fast_forward: bool):
        kwargs = dict(out_dtype=torch.bfloat16)
        return lambda: (
            torch._scaled_mm(x8, w8.t(), sx, sw, use_fast_accum=fast_forward, **kwargs),
            torch._scaled_mm(g8, w8_t.t(), sg, sw, **kwargs),
            torch._scaled_mm(g8_t, x8_t.t(), sg, sx, **kwargs),
        )

    return [
        ("bf16 3 GEMMs only (torch.mm)", bf16),
        ("fp8 3 GEMMs only (torch._scaled_mm, forward fast-accumulated)", fp8(True)),
        ("fp8 3 GEMMs only, forward promoted to fp32 (use_fast_accum off)", fp8(False)),
    ]


def measure_gemms(x, w, grad, label, results):
    """Time gemm_rows; the rate is 3 x 2MKN FLOP over the median time."""
    M, K, N = x.shape[0], x.shape[1], w.shape[0]
    base = None
    for impl, fn in gemm_rows(x, w, grad):
        ms = triton.testing.do_bench(fn, return_mode="median")
        base = base or ms
        tflops = 3 * 2 * M * K * N / ms / 1e9
        results.append(f"| {label} | {impl} | {ms:.3f} | {base / ms:.2f}x | {tflops:.0f} TFLOP/s |")


def rms_norm_linear(x, w):
    return F.linear(F.rms_norm(x, x.shape[-1:]), w)


def producer_rows(min_dim: int = 4096):
    """[(impl, fn)] of rms_norm + linear: bf16 compiled, then the fp8_linear pass through
    graphtrain's backend with fp8_cast_once off and on (min_dim: the pass's fp8.min_dim)."""

    def fp8(cast_once: bool):
        passes = ["+fp8_linear", "+fp8_cast_once" if cast_once else "-fp8_cast_once"]
        gt = backend(passes=passes, pass_options={"fp8.min_dim": min_dim})
        return torch.compile(rms_norm_linear, backend=gt)

    return [
        ("bf16 rmsnorm + linear (compiled)", torch.compile(rms_norm_linear)),
        ("graphtrain pass fp8, fp8_cast_once off", fp8(False)),
        ("graphtrain pass fp8, fp8_cast_once on", fp8(True)),
    ]


def measure(rows, args, label, results):
    """Time each row's forward + backward; SQNR of its outputs against the first row's."""
    want = fwd_bwd(rows[0][1], *args)
    base = None
    for impl, fn in rows:
        if isinstance(fn, str):
            results.append(f"| {label} | {impl} | skipped: {fn} | | |")
            continue
        try:
            got = fwd_bwd(fn, *args)  # compiles
        except Exception as e:  # a peer that does not run here: the row says why
            if impl.startswith("graphtrain"):
                raise  # our own rows must run
            results.append(f"| {label} | {impl} | {why_not(e, 'skipped')} |")
            continue
        ms = triton.testing.do_bench(lambda fn=fn: fwd_bwd(fn, *args), return_mode="median")
        base = base or ms
        dbs = " / ".join(f"{sqnr(g, w):.1f}" for g, w in zip(got, want, strict=True))
        results.append(f"| {label} | {impl} | {ms:.3f} | {base / ms:.2f}x | {dbs} |")


def grouped_rows():
    def bf16(x, w, offs):
        return torch._grouped_mm(x, w.transpose(-2, -1), offs=offs)

    def fp8(x, w, offs):
        return torch.ops.graphtrain.fp8_grouped_mm(x, w, offs)[0]

    return [("bf16 torch._grouped_mm", bf16), ("graphtrain fp8_grouped_mm", fp8)]


def grouped_fwd_bwd(fn, x, w, offs, grad):
    out = fn(x, w, offs)
    return (out, *torch.autograd.grad(out, [x, w], grad))


def grouped_gemm_rows(x, w, offs, grad):
    """[(impl, fn)] of the op's three grouped GEMMs one at a time (forward, dgrad, wgrad), bf16
    torch._grouped_mm against the FP8 GEMMs graphtrain::fp8_grouped_mm runs (on sm90 one
    torch._scaled_grouped_mm each, its scales expanded per row as the op does; elsewhere its
    loop per expert) on operands cast beforehand: which of the three holds the op's time;
    each FP8 GEMM also with the other accumulation (what fast accumulation buys)."""
    x, w = x.detach(), w.detach()
    E, N, K = w.shape
    grouped = grouped_op.grouped_kernel_runs(x, E, N, K)
    rows, experts = (
        (grouped_op._rows_grouped, grouped_op._experts_grouped)
        if grouped
        else (grouped_op._rows_loop, grouped_op._experts_loop)
    )
    x8, x8_t, sx, w8, w8_t, sw = grouped_op._cast_operands(x, w, offs, False)
    g8, g8_t, sg = grouped_op._cast_grad(grad, E4M3, False, offs)
    padded = grouped_op.padded_offsets(offs)
    dtype = x.dtype
    return [
        ("bf16 forward GEMM (torch._grouped_mm)",
         lambda: torch._grouped_mm(x, w.transpose(-2, -1), offs=offs)),
        ("fp8 forward GEMM (fast-accumulated)", lambda: rows(x8, sx, w8, sw, offs, dtype, True)),
        ("fp8 forward GEMM, promoted to fp32 (use_fast_accum off)",
         lambda: rows(x8, sx, w8, sw, offs, dtype, False)),
        ("bf16 dgrad GEMM (torch._grouped_mm)", lambda: torch._grouped_mm(grad, w, offs=offs)),
        ("fp8 dgrad GEMM", lambda: rows(g8, sg, w8_t, sw, offs, dtype, False)),
        ("fp8 dgrad GEMM, fast-accumulated (not the op's)",
         lambda: rows(g8, sg, w8_t, sw, offs, dtype, True)),
        ("bf16 wgrad GEMM (torch._grouped_mm)", lambda: torch._grouped_mm(grad.t(), x, offs=offs)),
        ("fp8 wgrad GEMM", lambda: experts(g8_t, sg, x8_t, sx, offs, padded, dtype, False)),
        ("fp8 wgrad GEMM, fast-accumulated (not the op's)",
         lambda: experts(g8_t, sg, x8_t, sx, offs, padded, dtype, True)),
    ]  # fmt: skip


def measure_grouped_gemms(x, w, offs, grad, label, results):
    """Time grouped_gemm_rows; each FP8 GEMM against the bf16 one before it, the rate 2MKN FLOP
    over the median time."""
    M, (_, N, K) = x.shape[0], w.shape
    base = 0.0
    for impl, fn in grouped_gemm_rows(x, w, offs, grad):
        ms = triton.testing.do_bench(fn, return_mode="median")
        base = ms if impl.startswith("bf16") else base
        tflops = 2 * M * K * N / ms / 1e9
        results.append(f"| {label} | {impl} | {ms:.3f} | {base / ms:.2f}x | {tflops:.0f} TFLOP/s |")


def kernel_tables(shapes: list[tuple[int, int, int]], grouped: bool, device: str) -> Iterator[str]:
    """--kernels: where the FP8 rows' fwd+bwd time goes, kernel by kernel (harness.kernel_table):
    the plain recipe compiled, graphtrain's op, its pass with fp8_cast_once off and on, at each
    linear shape; then (grouped) bf16 and FP8 grouped GEMMs at moe-1b's w1|w3 shape. Yielded
    line by line, for the log to keep the tables measured when a stage's cap stops it."""
    for M, K, N in shapes:
        inputs = linear_inputs(
            M, K, N, device, torch.bfloat16 if device == "cuda" else torch.float32
        )
        rows = [*linear_rows()[1:3], *producer_rows(16 if device == "cpu" else 4096)[1:]]
        for impl, fn in rows:
            torch._dynamo.reset()
            yield from ["", f"### {impl}, {M}x{K}x{N}", ""]
            yield from kernel_table(lambda fn=fn, a=inputs: fwd_bwd(fn, *a))  # 1st call compiles
    if grouped:
        tokens, E, K, N = (16384 * 6, 64, 1024, 1024) if device == "cuda" else (64, 4, 32, 16)
        x, w, offs, grad = grouped_inputs(tokens, E, K, N, device, torch.bfloat16, skewed=False)
        for impl, fn in grouped_rows():
            yield from ["", f"### {impl}, {tokens}x{K}x{N} (E={E}, even)", ""]
            yield from kernel_table(lambda fn=fn: grouped_fwd_bwd(fn, x, w, offs, grad))


def cpu_smoke() -> None:
    x, w, grad = linear_inputs(64, 32, 48, "cpu", torch.float32)
    want = fwd_bwd(F.linear, x, w, grad)
    plain = fwd_bwd(plain_fp8, x, w, grad)
    ours = fwd_bwd(graphtrain_fp8, x, w, grad)
    for got in (plain, ours):
        dbs = [sqnr(g, t) for g, t in zip(got, want, strict=True)]
        assert min(dbs) > 20.0, dbs
    for a, b in zip(plain, ours, strict=True):  # one recipe: equal up to fp32 rounding
        assert sqnr(a, b) > 100.0
    x, w, offs, grad = grouped_inputs(64, 4, 32, 16, "cpu", torch.float32, skewed=True)
    (_, bf16), (_, fp8) = grouped_rows()
    want = grouped_fwd_bwd(bf16, x, w, offs, grad)
    got = grouped_fwd_bwd(fp8, x, w, offs, grad)
    assert min(sqnr(g, t) for g, t in zip(got, want, strict=True)) > 20.0
    gemms = {impl: fn() for impl, fn in grouped_gemm_rows(x, w, offs, grad)}
    base = None
    for impl, out in gemms.items():  # each FP8 GEMM against the bf16 one before it
        base = out if impl.startswith("bf16") else base
        assert sqnr(out, base) > 20.0, impl
    wgrad = next(out for impl, out in gemms.items() if impl.startswith("bf16 wgrad"))
    torch.testing.assert_close(wgrad, want[2], rtol=1e-5, atol=1e-5)  # wgrad = autograd's
    x, w, grad = linear_inputs(64, 32, 48, "cpu", torch.float32)
    (_, bf16), *fp8_rows = gemm_rows(x, w, grad)
    for _, fp8 in fp8_rows:
        assert min(sqnr(g, t) for g, t in zip(fp8(), bf16(), strict=True)) > 20.0
    (_, norm), (_, off), (_, on) = producer_rows(min_dim=16)
    want = fwd_bwd(norm, x, w, grad)
    got_off, got_on = fwd_bwd(off, x, w, grad), fwd_bwd(on, x, w, grad)
    assert min(sqnr(g, t) for g, t in zip(got_on, want, strict=True)) > 20.0
    assert all(torch.equal(a, b) for a, b in zip(got_on, got_off, strict=True))  # fp32: bitwise
    peer = torchao_fp8()
    if not isinstance(peer, str):  # where torchao imports: its row runs and agrees too
        want = fwd_bwd(F.linear, x, w, grad)
        assert min(sqnr(g, t) for g, t in zip(fwd_bwd(peer, x, w, grad), want, strict=True)) > 20
    print(f"torchao row: {peer if isinstance(peer, str) else 'runs, agrees by SQNR'}")
    table = list(kernel_tables([(64, 32, 48)], grouped=False, device="cpu"))
    assert sum(line.startswith("| all ") for line in table) == 4, table  # --kernels' tables
    print(
        "cpu smoke: fp8 rows agree with fp32 by SQNR, graphtrain equals the plain recipe, "
        "fp8_cast_once on equals off"
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--shapes", default=",".join("x".join(map(str, s)) for s in SHAPES))
    parser.add_argument(
        "--kernels",
        action="store_true",
        help="instead of the timed table: the FP8 rows' kernels under torch.profiler (printed)",
    )
    args = parse_args(parser, cpu_smoke)
    if args is None:
        return
    shapes = [tuple(int(d) for d in shape.split("x")) for shape in args.shapes.split(",")]
    if args.kernels:
        for line in kernel_tables(shapes, grouped=True, device="cuda"):
            print(line, flush=True)
        return
    lines = [
        "| shape | impl | fwd+bwd ms | vs first row of its kind | SQNR dB out / dx / dW vs that row "
        "(GEMM rows: their rate) |",
        "|---|---|---:|---:|---|",
    ]

    def fill() -> None:
        for M, K, N in shapes:
            shape = f"{M}x{K}x{N}"
            torch._dynamo.reset()
            inputs = linear_inputs(M, K, N, "cuda", torch.bfloat16)
            measure(linear_rows(), inputs, shape, lines)
            measure_gemms(*inputs, shape, lines)
            measure(producer_rows(), inputs, shape, lines)
        for label, K, N, skewed in GROUPED_SHAPES:
            x, w, offs, grad = grouped_inputs(16384 * 6, 64, K, N, "cuda", torch.bfloat16, skewed)
            rows = [
                (impl, lambda x, w, fn=fn, offs=offs: fn(x, w, offs)) for impl, fn in grouped_rows()
            ]
            measure(rows, (x, w, grad), label, lines)
            measure_grouped_gemms(x, w, offs, grad, label, lines)

    rows_until_cap(lines, fill, f"| (the rest) | {CUT} | | | |")
    table = "\n".join(lines)
    if args.no_record:
        print(table)
    else:
        record("fp8_linear: forward + backward incl. amax and casts", table)


if __name__ == "__main__":
    main()
