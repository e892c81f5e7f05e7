"""Benchmark: one MTP layer (models/mtp.py: two RMSNorms, the 2*dim -> dim projection, a block),
forward + backward, at several token counts.

What
    The 1b preset's block shape (dim 2048, 16 heads, 8 kv heads, ffn 8192) in bf16, causal
    attention, at 1 x 256, 2 x 1024 and 4 x 4096 tokens (MISSION.md's MTP-layer target), run as
        eager                  the plain module
        torch.compile          Inductor, default options
        reduce-overhead        torch.compile(mode="reduce-overhead"): Inductor + CUDA graphs
        graphtrain             graphtrain's backend on the layer as apply_compile builds an MTP
                               region with compile.cudagraph_mtp (Inductor's cudagraph trees,
                               "triton.cudagraphs" patched into the region's backend only)
    reporting the median time of one forward + backward (triton.testing.do_bench) and the
    largest relative error of the output and input gradients against eager; under the table,
    for the two graphed rows, Inductor's CUDA-graph counters while they compiled and captured:
    captures skipped, and the inputs each recorded graph copies in at every replay (not
    static: an input whose address is not known to stay, e.g. not a parameter).
    Every step starts with torch.compiler.cudagraph_mark_step_begin() in every row (a no-op
    without CUDA graphs), as a training loop with graphed regions does.

Run
    python benchmarks/mtp.py [--no-record]
    python benchmarks/mtp.py --cpu-smoke   # no GPU: a tiny layer, eager == graphtrain
                                           # (aot_eager) bit for bit
The table is printed and appended to benchmarks/RESULTS.md unless --no-record.
"""

from __future__ import annotations

import argparse
import dataclasses

import torch
import triton
import triton.testing
from harness import (  # run as a script: benchmarks/ on sys.path
    CUT,
    parse_args,
    record,
    rows_until_cap,
)
from torch._dynamo.utils import counters

from graphtrain.compile import backend as graphtrain_backend
from models import PRESETS, build_model

IMPLS = ("eager", "torch.compile", "reduce-overhead", "graphtrain")
SHAPES = ((1, 256), (2, 1024), (4, 4096))


def mtp_layer(cfg, device: str, dtype: torch.dtype):
    """Depth 1's layer of a one-layer model of cfg's shape, initialised, and the model's rope."""
    cfg = dataclasses.replace(cfg, num_layers=1, vocab_size=64, mtp_depth=1)
    with torch.device("meta"):
        model = build_model(cfg)
    model.to_empty(device=device)
    model.init_weights(seed=0)
    return model.mtp_layers["0"].to(dtype), model.rope


def build(impl: str, layer, inner: str = "inductor"):
    if impl == "eager":
        return layer
    if impl == "torch.compile":
        return torch.compile(layer, fullgraph=True)
    if impl == "reduce-overhead":
        return torch.compile(layer, mode="reduce-overhead", fullgraph=True)
    if impl == "graphtrain":
        options = {"triton.cudagraphs": True} if inner == "inductor" else {}
        be = graphtrain_backend(inner=inner, region="mtp_1", inductor_options=options)
        return torch.compile(layer, backend=be, fullgraph=True)
    raise ValueError(f"unknown impl {impl!r}; known: {', '.join(IMPLS)}")


def inputs(B: int, T: int, dim: int, rope, device: str, dtype: torch.dtype):
    g = torch.Generator(device=device).manual_seed(0)
    h = torch.randn(B, T, dim, device=device, generator=g).to(dtype).requires_grad_()
    emb = torch.randn(B, T, dim, device=device, generator=g).to(dtype).requires_grad_()
    keep = torch.rand(B, T, device=device, generator=g) > 0.1
    pos = torch.arange(T, device=device).expand(B, T)
    grad = torch.randn(B, T, dim, device=device, generator=g).to(dtype)
    return h, emb, keep, rope[pos], grad


def step(fn, h, emb, keep, rope, grad):
    """One forward + backward; returns the output and the input gradients."""
    torch.compiler.cudagraph_mark_step_begin()
    out = fn(h, emb, keep, rope, None)
    dh, de = torch.autograd.grad(out, [h, emb], grad)
    return out.detach(), dh, de


def _cudagraph_counts() -> str:
    """Inductor's CUDA-graph counters since the last counters.clear()."""
    c = counters["inductor"]
    return (
        f"{c['cudagraph_skips']} skipped, "
        f"{c['cudagraph_recorded_non_static_inputs']} non-static inputs recorded"
    )


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def cpu_smoke() -> None:
    layer, rope = mtp_layer(PRESETS["debug"], "cpu", torch.float32)
    data = inputs(2, 24, layer.eh_proj.out_features, rope, "cpu", torch.float32)
    want = step(layer, *data)
    got = step(build("graphtrain", layer, inner="aot_eager"), *data)
    assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))
    print("cpu smoke: eager and graphtrain agree bit for bit")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    args = parse_args(parser, cpu_smoke)
    if args is None:
        return
    layer, rope = mtp_layer(PRESETS["1b"], "cuda", torch.bfloat16)
    lines = ["| tokens | " + " | ".join(f"{i} ms" for i in IMPLS) + " | max rel err |"]
    lines.append("|---|" + "---:|" * (len(IMPLS) + 1))
    graphs = []

    def fill() -> None:
        for B, T in SHAPES:
            data = inputs(B, T, layer.eh_proj.out_features, rope, "cuda", torch.bfloat16)
            want = step(layer, *data)
            times, err = [], 0.0
            for impl in IMPLS:
                torch._dynamo.reset()
                counters.clear()
                fn = build(impl, layer)
                for _ in range(3):  # compile, warm up, capture
                    got = step(fn, *data)
                if impl in ("reduce-overhead", "graphtrain"):
                    graphs.append(f"{B} x {T} {impl}: {_cudagraph_counts()}")
                err = max(err, *(_rel(g, w) for g, w in zip(got, want, strict=True)))
                times.append(triton.testing.do_bench(lambda fn=fn, data=data: step(fn, *data)))
            cells = " | ".join(f"{t:.3f}" for t in times)
            lines.append(f"| {B} x {T} | {cells} | {err:.1e} |")

    rows_until_cap(lines, fill, f"| (the rest) | {CUT} |")
    table = "\n".join([*lines, "", "CUDA graphs, " + "; ".join(graphs)])
    if args.no_record:
        print(table)
    else:
        record("mtp: one MTP layer fwd+bwd, dim 2048 (1b block), bf16", table)


if __name__ == "__main__":
    main()
