"""Benchmark: the MoE router (logits -> weights, indices, counts), forward and forward+backward.

What
    65536 tokens, 256 experts, top-8, fp32 router logits, on one CUDA GPU, two routers:
        sigmoid-groups   DeepSeek-V3 routing: sigmoid scores + expert bias, 8 groups of which
                         the 4 with the best top-2 sums are kept, weights normalised, * 2.5
        softmax-aux      softmax scores, top-8, plus the load-balancing aux loss
                         E / (k T^2) * sum_e (sum_t p[t, e]) * counts[e] (p = the scores)
        softmax-aux-z    the same plus the router z-loss mean_t logsumexp(logits[t])^2
    each written as plain torch (the MoE spec's pseudo-code) and run as
        eager             the plain code
        torch.compile     the plain code under torch.compile (Inductor, default options)
        graphtrain op     torch.ops.graphtrain.moe_route called directly (the aux loss from
                          its aux_sums: the per-expert sums of p come out of the op; the
                          z-loss from its lse)
        graphtrain pass   the plain code compiled with graphtrain's backend (Inductor), where the
                          fuse_moe_router pass inserts the op
    (in the table in that order but for torch.compile's row, which comes first: the others are
    timed against it, and a run cut short by its time cap keeps the rows it measured)
    reporting, for the forward (under no_grad) and for forward + backward (d logits from a fixed
    random d weights, plus the aux loss): the median wall time (triton.testing.do_bench) and
    the GPU kernel time (the profiler's sum over kernels per call); each row's agreement with
    eager (indices, max weight error); and the memory floor: the bytes that must move (read the
    logits, write weights / indices / counts; the backward reads the logits, d weights and
    indices again and writes d logits) at the 3.0 TB/s HBM copy rate of an H100.
    The op's wall time is bound by the CPU where its kernels are short: a torch.library custom
    op with autograd costs about 0.3 ms of Python per forward + backward (H100 host, torch 2.11)
    before the kernels run; in a training step that overlaps the GPU work of other layers (and
    vanishes under CUDA graphs), so the kernel columns are the op's own cost.

Why
    MISSION.md's target: at least 10x faster than torch.compile of the plain code (2.34 ms
    measured for sigmoid-groups on an H100), forward and backward.

Run
    python benchmarks/moe_router.py                       # every router, all rows
    python benchmarks/moe_router.py --router softmax-aux --impl eager,graphtrain-op
    python benchmarks/moe_router.py --cpu-smoke           # no GPU: the plain code and the op on
                                                          # a tiny shape, the pass finds both
The table is printed and appended to benchmarks/RESULTS.md (date, device, torch/triton
versions, git commit); --no-record skips that.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch
import triton
import triton.testing
from harness import CUT, parse_args, record, rows_until_cap, why_not  # benchmarks/ on sys.path

import graphtrain  # noqa: F401  (the "graphtrain" backend and the passes)
from graphtrain.compile import backend as graphtrain_backend
from graphtrain.custom_ops import moe_route as _moe_route  # noqa: F401  (registers the op)

TOKENS, EXPERTS, TOP_K = 65536, 256, 8
GROUPS, TOPK_GROUPS, ROUTE_SCALE = 8, 4, 2.5
AUX_COEF = 1e-2
Z_COEF = 1e-3
ROUTERS = ("sigmoid-groups", "softmax-aux", "softmax-aux-z")
# torch.compile first: every other row is timed against it.
IMPLS = ("torch.compile", "eager", "graphtrain-op", "graphtrain-pass")
COLUMNS = ("fwd", "fwd kernels", "fwd+bwd", "fwd+bwd kernels")
HBM_BYTES_PER_S = 3.0e12  # MISSION.md: H100 HBM copy rate

Router = Callable[..., tuple[torch.Tensor, ...]]


# --------------------------------------------------------------------------------------------
# the plain routers (the spec's pseudo-code) and the same through the op
# --------------------------------------------------------------------------------------------


def plain_sigmoid_groups(logits: torch.Tensor, bias: torch.Tensor, top_k: int = TOP_K):
    scores = torch.sigmoid(logits)
    sel = scores + bias
    T = sel.shape[0]
    grouped = sel.view(T, GROUPS, -1)
    group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)
    kept = group_scores.topk(TOPK_GROUPS, dim=-1).indices
    dropped = torch.ones_like(group_scores, dtype=torch.bool).scatter(1, kept, False)
    sel = grouped.masked_fill(dropped.unsqueeze(-1), float("-inf")).view(T, -1)
    indices = sel.topk(top_k, dim=-1).indices
    weights = scores.gather(1, indices)
    weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20) * ROUTE_SCALE
    counts = torch.bincount(indices.flatten(), minlength=logits.shape[1])
    return weights, indices, counts


def op_sigmoid_groups(logits: torch.Tensor, bias: torch.Tensor, top_k: int = TOP_K):
    return torch.ops.graphtrain.moe_route(
        logits,
        bias,
        top_k,
        score_func="sigmoid",
        num_groups=GROUPS,
        topk_groups=TOPK_GROUPS,
        normalize=True,
        route_scale=ROUTE_SCALE,
    )[:3]


def _aux_loss(p_sum: torch.Tensor, counts: torch.Tensor, top_k: int, T: int) -> torch.Tensor:
    E = p_sum.shape[0]
    return AUX_COEF * E / (top_k * T * T) * (p_sum * counts).sum()


def plain_softmax_aux(
    logits: torch.Tensor, bias: torch.Tensor | None, top_k: int = TOP_K, z_loss: bool = False
):
    scores = torch.softmax(logits, dim=-1)
    indices = scores.topk(top_k, dim=-1).indices
    weights = scores.gather(1, indices)
    counts = torch.bincount(indices.flatten(), minlength=logits.shape[1])
    loss = _aux_loss(scores.sum(0), counts, top_k, logits.shape[0])
    if z_loss:
        loss = loss + Z_COEF * torch.logsumexp(logits, dim=-1).square().mean()
    return weights, indices, counts, loss


def op_softmax_aux(
    logits: torch.Tensor, bias: torch.Tensor | None, top_k: int = TOP_K, z_loss: bool = False
):
    T = logits.shape[0]
    weights, indices, counts, aux_sums, lse, _ = torch.ops.graphtrain.moe_route(
        logits, None, top_k, aux_seq_len=T, return_lse=z_loss
    )
    loss = _aux_loss(aux_sums.sum(0), counts, top_k, T)
    if z_loss:
        loss = loss + Z_COEF * lse.square().mean()
    return weights, indices, counts, loss


PLAIN = {
    "sigmoid-groups": plain_sigmoid_groups,
    "softmax-aux": plain_softmax_aux,
    "softmax-aux-z": partial(plain_softmax_aux, z_loss=True),
}
OP = {
    "sigmoid-groups": op_sigmoid_groups,
    "softmax-aux": op_softmax_aux,
    "softmax-aux-z": partial(op_softmax_aux, z_loss=True),
}


def build(
    router: str, impl: str, *, inner: str = "inductor", dump_dir: str | None = None
) -> Router:
    plain = PLAIN[router]
    if impl == "eager":
        return plain
    if impl == "torch.compile":
        return torch.compile(plain, fullgraph=True)
    if impl == "graphtrain-op":
        return OP[router]
    if impl == "graphtrain-pass":
        compiler = graphtrain_backend(inner=inner, dump_dir=dump_dir)
        return torch.compile(plain, backend=compiler, fullgraph=True)
    raise ValueError(f"unknown --impl {impl!r}; known: {', '.join(IMPLS)}")


def memory_floor_bytes(T: int, E: int, k: int) -> tuple[int, int]:
    """(forward, forward + backward) bytes that must move, fp32 logits, int64 indices/counts."""
    logits, routed, counts = T * E * 4, T * k * (4 + 8), E * 8
    forward = logits + E * 4 + routed + counts  # read logits (+ bias), write the outputs
    backward = logits + routed + logits  # read logits, d weights, indices; write d logits
    return forward, forward + backward


# --------------------------------------------------------------------------------------------
# measuring
# --------------------------------------------------------------------------------------------


def loss_of(outs: tuple[torch.Tensor, ...], grad_weights: torch.Tensor) -> torch.Tensor:
    loss = (outs[0] * grad_weights).sum()
    return loss + outs[3] if len(outs) > 3 else loss


def kernel_ms(fn: Callable[[], object], logits: torch.Tensor, n: int = 20) -> float:
    """GPU kernel time per call of fn (the profiler's sum over kernels: launch gaps excluded)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            fn()
            logits.grad = None
        torch.cuda.synchronize()
    return sum(e.self_device_time_total for e in prof.key_averages()) / n / 1e3


def measure(
    fn: Router, logits: torch.Tensor, bias: torch.Tensor, grad_weights: torch.Tensor
) -> tuple[dict[str, float], tuple[torch.Tensor, ...]]:
    """({fwd, fwd kernels, fwd+bwd, fwd+bwd kernels}: ms, outputs). Wall times are medians of
    triton.testing.do_bench; for a short op they include what the CPU needs to launch it."""

    def forward() -> tuple[torch.Tensor, ...]:
        with torch.no_grad():
            return fn(logits, bias)

    def step() -> None:
        loss_of(fn(logits, bias), grad_weights).backward()

    for _ in range(2):  # compile (both graphs), warm the allocator
        outs = forward()
        step()
        logits.grad = None
    torch.cuda.synchronize()
    times = {
        "fwd": triton.testing.do_bench(forward, warmup=25, rep=200, return_mode="median"),
        "fwd kernels": kernel_ms(forward, logits),
        "fwd+bwd": triton.testing.do_bench(
            step, warmup=25, rep=200, grad_to_none=[logits], return_mode="median"
        ),
        "fwd+bwd kernels": kernel_ms(step, logits),
    }
    return times, outs


def row_cells(times: dict[str, float], outs, base, reference) -> list[str]:
    """A row's cells: each time with torch.compile's over it where that row was measured, then
    its agreement with eager (indices, max weight error)."""
    cells = [f"{times[c]:.3f}" + (f" ({base[c] / times[c]:.1f}x)" if base else "") for c in COLUMNS]
    same = (outs[1] == reference[1]).all(dim=-1).float().mean().item()
    return [*cells, f"{same:.2%}", f"{(outs[0] - reference[0]).abs().max().item():.1e}"]


def fill_table(routers, impls, data, lines: list[str], verdicts: list[str]) -> None:
    """Append each router's rows to `lines` as they are measured (torch.compile's first: the
    others are timed against it), then its verdict; eager's outputs are every row's reference.
    A row that fails says why."""
    logits, bias, _ = data
    for router in routers:
        with torch.no_grad():
            reference = PLAIN[router](logits, bias)
        times: dict[str, dict[str, float]] = {}
        for impl in impls:
            torch._dynamo.reset()
            try:
                times[impl], outs = measure(build(router, impl), *data)
                cells = row_cells(times[impl], outs, times.get("torch.compile"), reference)
            except Exception as e:  # the row says why; the others are still measured
                cells = [why_not(e) + " |" * (len(COLUMNS) + 1)]  # the other cells empty
            lines.append(f"| {router} | {impl} | " + " | ".join(cells) + " |")
            print(lines[-1], flush=True)
        ours, base = times.get("graphtrain-op"), times.get("torch.compile")
        if ours and base:
            speedups = ", ".join(f"{base[c] / ours[c]:.1f}x {c}" for c in COLUMNS)
            verdicts.append(f"{router}: graphtrain-op vs torch.compile: {speedups}; target >= 10x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--router", default=",".join(ROUTERS), help=f"from {', '.join(ROUTERS)}")
    parser.add_argument(
        "--impl", default=",".join(IMPLS), help=f"comma list from {', '.join(IMPLS)}"
    )
    args = parse_args(parser, cpu_smoke)
    if args is None:
        return
    routers = [r.strip() for r in args.router.split(",") if r.strip()]
    impls = [i.strip() for i in args.impl.split(",") if i.strip()]
    for name, known in [(r, ROUTERS) for r in routers] + [(i, IMPLS) for i in impls]:
        if name not in known:
            raise SystemExit(f"unknown {name!r}; known: {', '.join(known)}")
    impls = sorted(set(impls), key=IMPLS.index)

    T, E, k = TOKENS, EXPERTS, TOP_K
    fwd_bytes, both_bytes = memory_floor_bytes(T, E, k)
    floor = (
        f"memory floor: forward {fwd_bytes / 2**20:.1f} MiB -> "
        f"{fwd_bytes / HBM_BYTES_PER_S * 1e3:.4f} ms; forward+backward "
        f"{both_bytes / 2**20:.1f} MiB -> {both_bytes / HBM_BYTES_PER_S * 1e3:.4f} ms "
        f"(at {HBM_BYTES_PER_S / 1e12:.1f} TB/s)"
    )
    print(floor)
    g = torch.Generator(device="cuda").manual_seed(0)
    logits = torch.randn(T, E, device="cuda", generator=g).requires_grad_(True)
    bias = torch.randn(E, device="cuda", generator=g) * 0.01
    grad_weights = torch.randn(T, k, device="cuda", generator=g)

    header = (
        "| router | impl | "
        + " | ".join(f"{c} ms (vs compile)" for c in COLUMNS)
        + " | indices == eager | max weight err |"
    )
    lines = [header, "|---|---|" + "---:|" * (len(COLUMNS) + 2)]
    verdicts: list[str] = []
    data = (logits, bias, grad_weights)
    fill = partial(fill_table, routers, impls, data, lines, verdicts)
    rows_until_cap(lines, fill, f"| (the rest) | {CUT} |" + " |" * (len(COLUMNS) + 2))
    body = "\n".join([floor, "", *lines, "", *(f"- {v}" for v in verdicts)])
    if args.no_record:
        print(body)
    else:
        record(f"moe_router: {T} tokens, {E} experts, top-{k}, fp32 logits", body)


def cpu_smoke() -> None:
    """Tiny shape on CPU: every router's plain code, the op and the pass agree (no timing)."""
    T, E, k = 97, 64, 4
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(T, E, generator=g).requires_grad_(True)
    bias = torch.randn(E, generator=g) * 0.01
    grad_weights = torch.randn(T, k, generator=g)
    for router in ROUTERS:
        outs = {}
        for impl in ("eager", "graphtrain-op", "graphtrain-pass"):
            torch._dynamo.reset()
            with tempfile.TemporaryDirectory() as dump:
                fn = build(router, impl, inner="aot_eager", dump_dir=dump)
                result = fn(logits, bias, k)
                (grad,) = torch.autograd.grad(loss_of(result, grad_weights), (logits,))
                outs[impl] = (*result, grad)
                if impl == "graphtrain-pass":
                    (summary,) = Path(dump).glob("*/summary.json")
                    counts = json.loads(summary.read_text())[-1]["op_counts"]
                    assert counts.get("graphtrain.moe_route.default") == 1, counts
                    assert "torch.logsumexp" not in counts, counts  # the z-loss's: the op's
        for impl in ("graphtrain-op", "graphtrain-pass"):
            for a, b in zip(outs[impl], outs["eager"], strict=True):
                if a.is_floating_point():
                    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
                else:
                    assert torch.equal(a, b), (router, impl)
        print(f"cpu smoke {router}: eager, graphtrain-op and graphtrain-pass agree")
    fwd, both = memory_floor_bytes(TOKENS, EXPERTS, TOP_K)
    print(f"memory floor at {TOKENS}x{EXPERTS} top-{TOP_K}: {fwd} and {both} bytes")


if __name__ == "__main__":
    main()
