"""Benchmark: what overlap_tp_comm's chunked decomposition costs in compute, on one GPU.

What
    One GPU cannot time the overlap itself (there is nobody to talk to); it can time what the
    pass adds to the GEMMs. For Llama-3-8B's tensor-parallel GEMMs (dim 4096, 32 heads of 128,
    8 kv heads, ffn 14336) at T tokens per rank group (micro-batch 1 x seq 8192 by default) and
    tp = 2, 4, 8, each row compares
        one        the GEMM as the unrewritten graph runs it (the whole gathered sequence, or
                   the whole sequence before the reduce-scatter);
        chunked    the ops the pass emits on one rank, collectives left out: `chunks` (= tp)
                   row blocks, one GEMM each, plus the reassembly (gather side: the blocks'
                   outputs cat + permuted back into sequence order; scatter side: the input
                   permuted into destination-rank order first);
    in bf16, median of triton.testing.do_bench, and the communication each pair hides at
    best: min(its GEMM time, the collective's time), the collective moving (tp-1)/tp of the
    [T, 4096] bf16 activation per rank at an assumed NVLINK_BYTES_PER_S (the printed model
    says which).

Run
    python benchmarks/tp_overlap.py [--tokens 8192] [--no-record]
    python benchmarks/tp_overlap.py --cpu-smoke    # no GPU: tiny shapes, chunked == one
The table is printed and appended to benchmarks/RESULTS.md unless --no-record.
"""

from __future__ import annotations

import argparse

import torch
import triton
import triton.testing
from harness import CUT, parse_args, record, rows_until_cap  # benchmarks/ on sys.path

# Llama-3-8B
DIM, HEADS, KV_HEADS, HEAD_DIM, FFN = 4096, 32, 8, 128, 14336
# NCCL all-gather / reduce-scatter bus bandwidth on 8 NVLink-4 H100s (NVLink 450 GB/s per
# direction per GPU; NCCL reaches roughly 80% of it). An assumption until several GPUs exist.
NVLINK_BYTES_PER_S = 360e9


def gemms(tp: int) -> list[tuple[str, str, int, int]]:
    """(name, side, K, N) per tp rank: column GEMMs read the gathered sequence, row GEMMs
    feed the reduce-scatter."""
    return [
        ("wq+wk+wv", "gather", DIM, (HEADS + 2 * KV_HEADS) * HEAD_DIM // tp),
        ("wo", "scatter", HEADS * HEAD_DIM // tp, DIM),
        ("w1+w3", "gather", DIM, 2 * FFN // tp),
        ("w2", "scatter", FFN // tp, DIM),
    ]


def chunked_gather_gemm(x: torch.Tensor, w: torch.Tensor, tp: int, chunks: int) -> torch.Tensor:
    """x [T, K] as tp ranks' rows gathered in `chunks` blocks; each block's GEMM, then the
    outputs put back in sequence order (what the pass emits after each block's wait)."""
    rows = x.shape[0] // tp  # this rank's rows
    block = rows // chunks
    ranked = x.view(tp, rows, -1)
    parts = [
        ranked[:, j * block : (j + 1) * block].reshape(tp * block, -1) @ w for j in range(chunks)
    ]
    out = torch.cat([p.view(tp, block, -1) for p in parts], 1)
    return out.view(tp * rows, -1)  # batch 1: rank-major rows are sequence order already


def chunked_scatter_gemm(a: torch.Tensor, w: torch.Tensor, tp: int, chunks: int) -> torch.Tensor:
    """a [T, K]: the rows of each destination rank, `chunks` blocks, one GEMM each (what the
    pass emits before each block's reduce-scatter)."""
    rows = a.shape[0] // tp
    block = rows // chunks
    ranked = a.view(tp, rows, -1)
    return torch.cat(
        [ranked[:, j * block : (j + 1) * block].reshape(tp * block, -1) @ w for j in range(chunks)]
    )


def measure(tokens: int, device: str, rows: list[dict]) -> None:
    """Append a row to `rows` as each GEMM of each tp is measured."""
    for tp in (2, 4, 8):
        comm_ms = tokens * DIM * 2 * (tp - 1) / tp / NVLINK_BYTES_PER_S * 1e3
        for name, side, k, n in gemms(tp):
            a = torch.randn(tokens, k, device=device, dtype=torch.bfloat16)
            w = torch.randn(k, n, device=device, dtype=torch.bfloat16)
            chunked = chunked_gather_gemm if side == "gather" else chunked_scatter_gemm
            one_ms = triton.testing.do_bench(lambda a=a, w=w: a @ w)
            chunk_ms = triton.testing.do_bench(lambda a=a, w=w, c=chunked, tp=tp: c(a, w, tp, tp))
            rows.append(
                {
                    "tp": tp,
                    "gemm": name,
                    "side": side,
                    "one_ms": one_ms,
                    "chunked_ms": chunk_ms,
                    "comm_ms": comm_ms,
                    "hidden_ms": min(chunk_ms, comm_ms) - (chunk_ms - one_ms),
                }
            )


def table(rows: list[dict], tokens: int) -> str:
    lines = [
        f"| tp | GEMM (T={tokens}) | side | one GEMM ms | chunked ms | overhead | "
        f"collective ms (model) | net hidden ms |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "cut" in r:
            lines.append(f"| (the rest) | {r['cut']} | | | | | | |")
            continue
        lines.append(
            f"| {r['tp']} | {r['gemm']} | {r['side']} | {r['one_ms']:.3f} | {r['chunked_ms']:.3f} "
            f"| {r['chunked_ms'] / r['one_ms'] - 1:+.1%} | {r['comm_ms']:.3f} | {r['hidden_ms']:.3f} |"
        )
    return "\n".join(lines)


def cpu_smoke() -> None:
    for tp in (2, 4):
        a = torch.randn(8 * tp, 24)
        w = torch.randn(24, 40)
        full = a @ w
        torch.testing.assert_close(chunked_gather_gemm(a, w, tp, tp), full)
        # The scatter side's rows come block by block, each block rank-major.
        by_block = full.view(tp, tp, 8 // tp, 40).transpose(0, 1).reshape(-1, 40)
        torch.testing.assert_close(chunked_scatter_gemm(a, w, tp, tp), by_block)
    print("tp_overlap smoke: chunked == one GEMM")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=8192)
    args = parse_args(parser, cpu_smoke)
    if args is None:
        return
    rows: list[dict] = []
    rows_until_cap(rows, lambda: measure(args.tokens, "cuda", rows), {"cut": CUT})
    text = table(rows, args.tokens)
    if args.no_record:
        print(text)
    else:
        note = f"; collectives modelled at {NVLINK_BYTES_PER_S / 1e9:.0f} GB/s"
        record("tp_overlap: chunked decomposition on one GPU, Llama-3-8B TP GEMMs", text, note)


if __name__ == "__main__":
    main()
