"""Benchmark: linear + cross-entropy, forward + backward, on one CUDA GPU.

What
    For each shape (N tokens, H hidden, V vocab) and each weight precision
        bf16          hidden and weight bf16 (the MISSION.md peer numbers)
        fp32-master   fp32 hidden and weight under bf16 autocast (graphtrain's default training
                      setup: fp32 master weights and final norm, the head's GEMM in bf16, fp32
                      gradients); peers and the op get the operands cast to bf16 as autocast
                      would (the op keeps the fp32 weight: its gradient comes back fp32)
    it runs, side by side in one process:
        eager                 F.cross_entropy(F.linear(h, W).float(), t)
        torch.compile         the same code under torch.compile (Inductor, default options)
        liger                 Liger-Kernel's LigerFusedLinearCrossEntropyLoss
        liger-fp32-accum      the same with accum_dtype=torch.float32 (where its API has it)
        cut-cross-entropy     cut_cross_entropy.linear_cross_entropy (Apple's Cut Cross-Entropy,
                              its defaults, which filter small softmax gradients)
        torch-lce             torch.nn.functional.linear_cross_entropy(...,
                              options=LinearCrossEntropyOptions()) where torch has it
        graphtrain-low_memory torch.ops.graphtrain.linear_cross_entropy, mode="low_memory"
        graphtrain-fast       the same, mode="fast" (fp32 grad_weight accumulation: into the
                              fp32 gradient itself for fp32-master, an fp32 buffer for bf16)
        graphtrain-fast-bf16acc  mode="fast", fp32_accumulator=False (bf16 weights only)
        graphtrain-fast-1chunk   mode="fast", all N tokens in one chunk (token_chunk=N): no
                              fp32 buffer and no accumulation, the [N, V] logits held at once
                              (the automatic chunk takes it only where that is no more memory)
        graphtrain-pass       the plain code compiled with graphtrain's backend (Inductor); the
                              fuse_linear_cross_entropy pass inserts the op in the mode it picks
    Peers are imported when their row runs; a missing or failing one is a row saying why.
    Reported: the median fwd+bwd time (triton.testing.do_bench) and the extra peak memory:
    max_memory_allocated during one fwd+bwd minus what was allocated before it (the inputs),
    so the gradients (W.grad is 0.98 GiB at V=128256, H=4096 in bf16, 1.96 GiB in fp32) are
    included, as in the MISSION.md peer numbers. Each row is checked against eager: the loss's
    absolute difference, and the smaller signal-to-noise ratio (dB) of grad_hidden and
    grad_weight (rounding differences leave tens of dB: graphtrain's rows 50-52 dB on a CPU at
    67 x 24 x 301; Cut Cross-Entropy's gradient filter lowers its figure; halving hidden gives
    6 dB, a wrong gradient is near 0 dB).

Why
    MISSION.md / issue 15: fast mode faster than torch.compile (38.0 ms at 8192 x 4096 x 128256
    on an H100, 47.9 ms at 16384 x 2048 x 151936; the three-GEMM floor is ~33 ms for the first)
    with less extra memory than it (3.0 / 5.3 GiB); low-memory mode less memory than Liger and
    faster than Liger.

Run
    python benchmarks/cross_entropy.py                      # both shapes, both precisions
    python benchmarks/cross_entropy.py --shape 4096,2048,32000 --precision bf16 \
        --impl eager,graphtrain-fast
    python benchmarks/cross_entropy.py --cpu-smoke          # no GPU: tiny shape, the modes,
                                                            # the pass and eager agree
The table is printed and appended to benchmarks/RESULTS.md (date, device, torch/triton
versions, git commit); --no-record skips that.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import inspect
import json
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
import triton.testing

# run as a script: benchmarks/ is on sys.path
from harness import CUT, kernel_table, parse_args, record, rows_until_cap, sqnr, why_not

import graphtrain  # noqa: F401  (the "graphtrain" backend and the passes)
from graphtrain.compile import backend as graphtrain_backend
from graphtrain.custom_ops import linear_cross_entropy as _lce  # noqa: F401  (registers the op)

SHAPES = [(8192, 4096, 128256), (16384, 2048, 151936)]
PRECISIONS = ("bf16", "fp32-master")
IMPLS = (
    "eager",
    "torch.compile",
    "liger",
    "liger-fp32-accum",
    "cut-cross-entropy",
    "torch-lce",
    "graphtrain-low_memory",
    "graphtrain-fast",
    "graphtrain-fast-bf16acc",
    "graphtrain-fast-1chunk",
    "graphtrain-pass",
)
# not graphtrain's rows: one that fails here is a row that says why (ours must run)
PEERS = ("torch.compile", "liger", "liger-fp32-accum", "cut-cross-entropy", "torch-lce")
GIB = 1 << 30

LossFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def plain(h: torch.Tensor, w: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(F.linear(h, w).float(), t)


def _as_bf16(fn: LossFn) -> LossFn:
    # fp32-master rows of the peers: the operands cast to bf16, as autocast's F.linear does
    # (the casts' backward returns fp32 gradients).
    return lambda h, w, t: fn(h.to(torch.bfloat16), w.to(torch.bfloat16), t)


def _peer(impl: str) -> tuple[LossFn | None, str]:
    """A peer's loss function, or None and why it is skipped (imported only here)."""
    if impl.startswith("liger"):
        try:
            from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss
        except ImportError:
            return None, "liger-kernel not installed (pip install liger-kernel)"
        kwargs = {}
        if impl == "liger-fp32-accum":
            if "accum_dtype" not in inspect.signature(LigerFusedLinearCrossEntropyLoss).parameters:
                return None, "this liger-kernel has no accum_dtype"
            kwargs["accum_dtype"] = torch.float32
        loss = LigerFusedLinearCrossEntropyLoss(**kwargs)
        return (lambda h, w, t: loss(w, h, t)), ""  # Liger takes (weight, input, target)
    if impl == "cut-cross-entropy":
        try:
            from cut_cross_entropy import linear_cross_entropy as cce
        except ImportError:
            return None, "cut-cross-entropy not installed (pip install cut-cross-entropy)"
        return (lambda h, w, t: cce(h, w, t)), "default filter_eps (gradient filtering)"
    if impl == "torch-lce":
        fn = getattr(F, "linear_cross_entropy", None)
        options = getattr(torch.nn, "LinearCrossEntropyOptions", None)
        if fn is None or options is None:
            return None, f"torch {torch.__version__} has no F.linear_cross_entropy with options"
        return (lambda h, w, t: fn(h, w, t, ignore_index=-100, options=options())), ""
    raise ValueError(f"unknown --impl {impl!r}; known: {', '.join(IMPLS)}")


def build(
    impl: str, precision: str, inner: str = "inductor", dump_dir: str | None = None
) -> tuple[LossFn | None, str]:
    """The loss function of one row, or None and why it is skipped."""
    master = precision == "fp32-master"
    if impl == "graphtrain-fast-bf16acc" and master:
        return None, "fp32 weights accumulate in fp32 (no bf16 accumulation)"
    if impl.startswith("graphtrain-") and impl != "graphtrain-pass":
        # The op takes the fp32 master weight itself (its gradient comes back fp32) and the
        # hidden in bf16, as the pass hands them over under autocast.
        opts = {"mode": "low_memory" if impl.endswith("low_memory") else "fast"}
        if impl.endswith("bf16acc"):
            opts["fp32_accumulator"] = False
        one_chunk = impl.endswith("1chunk")
        op = torch.ops.graphtrain.linear_cross_entropy
        return (
            lambda h, w, t: op(
                h.to(torch.bfloat16), w, t, **opts, token_chunk=h.shape[0] if one_chunk else 0
            )
        ), ""
    if impl == "eager":
        fn, note = plain, ""
    elif impl == "torch.compile":
        fn, note = torch.compile(plain, fullgraph=True), ""
    elif impl == "graphtrain-pass":
        backend = graphtrain_backend(inner=inner, dump_dir=dump_dir)
        fn, note = torch.compile(plain, backend=backend, fullgraph=True), ""
    else:
        fn, note = _peer(impl)
        if fn is not None and master:
            fn = _as_bf16(fn)
    return fn, note


def _autocast(precision: str, device: str) -> contextlib.AbstractContextManager:
    return torch.autocast(device, dtype=torch.bfloat16, enabled=precision == "fp32-master")


def fwd_bwd(
    fn: LossFn,
    h: torch.Tensor,
    w: torch.Tensor,
    t: torch.Tensor,
    precision: str,
    device: str,
    fresh_grads: bool = False,
) -> torch.Tensor:
    """One row's forward and backward (h.grad and w.grad set to None first with fresh_grads);
    the loss."""
    if fresh_grads:
        h.grad = w.grad = None
    with _autocast(precision, device):
        loss = fn(h, w, t)
    loss.backward()
    return loss


def measure(
    fn: LossFn, h: torch.Tensor, w: torch.Tensor, t: torch.Tensor, precision: str
) -> tuple[tuple[float, float, float], tuple[torch.Tensor, torch.Tensor]]:
    """((median ms of fwd+bwd, extra peak GiB, loss), (grad_hidden, grad_weight))."""
    step = functools.partial(fwd_bwd, fn, h, w, t, precision, "cuda")

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
    grads = (h.grad, w.grad)
    h.grad = w.grad = None
    ms = triton.testing.do_bench(
        step, warmup=50, rep=300, grad_to_none=[h, w], return_mode="median"
    )
    return (ms, extra, value), grads


def inputs(
    N: int, H: int, V: int, precision: str, device: str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    dtype = torch.float32 if precision == "fp32-master" else torch.bfloat16
    h = torch.randn(N, H, device=device).to(dtype).requires_grad_(True)
    w = (torch.randn(V, H, device=device) * H**-0.5).to(dtype).requires_grad_(True)
    t = torch.randint(0, V, (N,), device=device)
    t[::17] = -100  # some ignored tokens, as packed sequences have
    return h, w, t


def _verdicts(label: str, results: dict[str, tuple[float, float, float]]) -> list[str]:
    out = []
    compiled, liger = results.get("torch.compile"), results.get("liger")
    for ours in ("graphtrain-fast", "graphtrain-fast-bf16acc", "graphtrain-fast-1chunk",
                 "graphtrain-pass"):  # fmt: skip
        if ours in results and compiled:
            ms, gib, _ = results[ours]
            out.append(
                f"{label}: {ours} {'faster' if ms < compiled[0] else 'NOT faster'} than "
                f"torch.compile ({ms:.1f} vs {compiled[0]:.1f} ms), "
                f"{'less' if gib < compiled[1] else 'NOT less'} extra memory "
                f"({gib:.2f} vs {compiled[1]:.2f} GiB)"
            )
    if "graphtrain-low_memory" in results and liger:
        ms, gib, _ = results["graphtrain-low_memory"]
        out.append(
            f"{label}: graphtrain-low_memory {'faster' if ms < liger[0] else 'NOT faster'} than "
            f"Liger ({ms:.1f} vs {liger[0]:.1f} ms), {'less' if gib < liger[1] else 'NOT less'} "
            f"extra memory ({gib:.2f} vs {liger[1]:.2f} GiB)"
        )
    return out


def run_table(shapes: list, precisions: list[str], impls: list[str]) -> tuple[list, list]:
    lines = [
        "| N, H, V | weights | impl | fwd+bwd ms (median) | extra peak GiB | loss err vs eager "
        "| grad SNR vs eager dB | note |",
        "|---|---|---|---:|---:|---:|---:|---|",
    ]
    verdicts: list[str] = []

    def fill() -> None:
        for N, H, V in shapes:
            for precision in precisions:
                results = _rows_at((N, H, V), precision, impls, lines)
                verdicts.extend(_verdicts(f"{N}x{H}x{V} {precision}", results))

    rows_until_cap(lines, fill, f"| (the rest) | {CUT} | | | | | | |")
    return lines, verdicts


def _rows_at(shape: tuple, precision: str, impls: list[str], lines: list[str]) -> dict:
    """Every impl's row at one shape and precision appended to `lines` (and printed) as it is
    measured; their (ms, extra GiB, loss) by impl."""
    N, H, V = shape
    h, w, t = inputs(N, H, V, precision, "cuda")
    results: dict[str, tuple[float, float, float]] = {}
    eager_grads = None
    for impl in impls:
        snr = None  # this row's gradients against eager's, where both ran
        torch._dynamo.reset()
        fn, note = build(impl, precision)
        if fn is not None:
            try:
                results[impl], grads = measure(fn, h, w, t, precision)
                if impl == "eager":
                    eager_grads = grads
                elif eager_grads is not None:
                    snr = min(map(sqnr, grads, eager_grads))
                del grads
            except torch.cuda.OutOfMemoryError:
                note = "out of memory"
            except Exception as e:  # a peer that fails on this torch/triton says so
                if impl not in PEERS:
                    raise
                note = why_not(e)
            h.grad = w.grad = None
            torch.cuda.empty_cache()
        row = f"| {N}, {H}, {V} | {precision} | {impl} |"
        if impl in results:
            ms, extra, loss = results[impl]
            err = abs(loss - results["eager"][2]) if "eager" in results else float("nan")
            db = "-" if snr is None else f"{snr:.1f}"
            lines.append(f"{row} {ms:.2f} | {extra:.2f} | {err:.1e} | {db} | {note} |")
        else:
            lines.append(f"{row} - | - | - | - | {note} |")
            print(f"skipped {impl} ({precision}): {note}", flush=True)
        print(lines[-1], flush=True)
    return results


def kernel_tables(
    shapes: list, precisions: list[str], impls: list[str], device: str
) -> Iterator[str]:
    """--kernels: where each row's fwd+bwd time goes, kernel by kernel (harness.kernel_table);
    a row that cannot run here says why. Yielded line by line, for the log to keep the tables
    measured when a stage's cap stops it."""
    for N, H, V in shapes:
        for precision in precisions:
            h, w, t = inputs(N, H, V, precision, device)
            for impl in impls:
                torch._dynamo.reset()
                fn, note = build(impl, precision)
                yield from ["", f"### {impl}, {N} x {H} x {V}, {precision}", ""]
                if fn is None:
                    yield f"not run: {note}"
                    continue
                step = functools.partial(fwd_bwd, fn, h, w, t, precision, device, True)
                yield from kernel_table(step)  # its first call, unprofiled, compiles and tunes


def cpu_smoke() -> None:
    """Tiny shape on CPU, both precisions: eager, both op modes and the pass (aot_eager) agree
    in loss and gradients, and the pass fires (no timing; peers need a GPU)."""
    N, H, V = 67, 24, 301
    for precision in PRECISIONS:
        want = None
        for impl in ("eager", "graphtrain-low_memory", "graphtrain-fast", "graphtrain-pass"):
            torch._dynamo.reset()
            h, w, t = inputs(N, H, V, precision, "cpu")
            with tempfile.TemporaryDirectory() as dump:
                fn, _ = build(impl, precision, inner="aot_eager", dump_dir=dump)
                with _autocast(precision, "cpu"):
                    loss = fn(h, w, t)
                loss.backward()
                if impl == "graphtrain-pass":
                    (summary,) = Path(dump).glob("*/summary.json")
                    steps = json.loads(summary.read_text())
                    step = next(s for s in steps if s["label"] == "fuse_linear_cross_entropy")
                    fused = step["op_counts"].get("graphtrain.linear_cross_entropy.default")
                    assert fused == 1 and "mode='fast'" in str(step["notes"]), step
            got = (loss.detach().float(), h.grad.float(), w.grad.float())
            assert w.grad.dtype == w.dtype and h.grad.dtype == h.dtype, (impl, precision)
            if want is None:
                want = got
                continue
            for a, b in zip(got, want, strict=True):  # bf16 logits: rounding-level agreement
                torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-3)
        print(f"cpu smoke {precision}: eager, graphtrain modes and the pass agree")
    for impl in ("liger", "cut-cross-entropy", "torch-lce"):
        print(f"cpu smoke: {impl} not run ({_peer(impl)[1] or 'GPU rows only'})")
    table = list(kernel_tables([(N, H, V)], ["bf16"], ["graphtrain-fast"], "cpu"))
    assert table[-1].startswith("| all ") and len(table) > 6, table  # --kernels' table
    print("\n".join(table))
    print("cpu smoke done")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--shape", action="append", help="N,H,V (repeatable); default: the two MISSION shapes"
    )
    parser.add_argument(
        "--precision", default=",".join(PRECISIONS), help=f"from {', '.join(PRECISIONS)}"
    )
    parser.add_argument(
        "--impl", default=",".join(IMPLS), help=f"comma list from {', '.join(IMPLS)}"
    )
    parser.add_argument(
        "--kernels",
        action="store_true",
        help="instead of the timed table: each row's kernels under torch.profiler (printed)",
    )
    args = parse_args(parser, cpu_smoke)
    if args is None:
        return
    shapes = [tuple(int(x) for x in s.split(",")) for s in args.shape] if args.shape else SHAPES
    impls = [i.strip() for i in args.impl.split(",") if i.strip()]
    precisions = [p.strip() for p in args.precision.split(",") if p.strip()]
    for name, known in [(i, IMPLS) for i in impls] + [(p, PRECISIONS) for p in precisions]:
        if name not in known:
            raise SystemExit(f"unknown {name!r}; known: {', '.join(known)}")

    if args.kernels:
        for line in kernel_tables(shapes, precisions, impls, "cuda"):
            print(line, flush=True)
        return
    lines, verdicts = run_table(shapes, precisions, impls)
    body = "\n".join([*lines, "", *(f"- {v}" for v in verdicts)])
    if args.no_record:
        print(body)
    else:
        record("cross_entropy: linear + cross-entropy fwd+bwd", body)


if __name__ == "__main__":
    main()
