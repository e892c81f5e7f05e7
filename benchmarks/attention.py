"""Benchmark: causal attention over packed documents, forward and forward + backward, at a
preset's attention shape: the ~23 ms a 1b step spends in attention (first contact's profile).

What
    One block's attention of --preset (default 1b: 16 query heads and 8 key/value heads of 128),
    --batch x --seq tokens (default 2 x 4096) of the default corpus packed as the trainer packs
    it (its loader's first micro-batch: the documents of the e2e rows), bf16; rows:
        flex (Triton)     models.gpt.attend with graphtrain's document BlockMask, compiled:
                          the CUDA default (training.attention=flex)
        flex TMA          the same call with kernel_options USE_TMA: the Triton kernel loading
                          q, k and v with Hopper's tensor memory accelerator (off by default
                          on CUDA in torch 2.11; it compiles for sm_90 on the CPU machine)
        flex FLASH (FA4)  the same call with kernel_options BACKEND=FLASH: FlexAttention's
                          FlashAttention-4 backend (torch 2.11 has it; it needs the
                          flash-attn-4 package, flash_attn.cute, and nvidia-cutlass-dsl, whose
                          CUDA library wheel alone is ~92 MB)
        varlen (FA2)      models.gpt.attend with the DocumentSpans: torch's varlen_attn,
                          FlashAttention-2's variable-length kernel (training.attention=varlen)
        sdpa causal       one causal sequence per row, no documents: what attention costs
                          without document masking (more pairs: a bound, not the same work)
    Reported: the median time (triton.testing.do_bench) of the forward and of forward +
    backward (the gradients of q, k and v for a fixed output gradient), TFLOP/s of the
    document rows over the pairs the mask allows (4 x pairs x head_dim x heads forward, 2.5x
    that backward), and each document row's output and gradients against float32 math (SDPA
    with the dense document mask) as SNR in dB, the smallest of the four. A row that cannot run
    says why.

Run
    python benchmarks/attention.py [--preset 1b --batch 2 --seq 4096] [--no-record]
    python benchmarks/attention.py --cpu-smoke   # no GPU: tiny shape, the document rows that run
                                                 # on CPU against the reference
The table is printed and appended to benchmarks/RESULTS.md unless --no-record.
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import os
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
import triton.testing
from harness import (  # run as a script: benchmarks/ on sys.path
    CUT,
    parse_args,
    record,
    rows_until_cap,
    sqnr,
    why_not,
)
from torch.nn.attention.flex_attention import flex_attention

from graphtrain.attention import build_attention_mask, document_causal_mask
from graphtrain.config import load_config
from graphtrain.data.build import build_data
from graphtrain.data.packing import pack_rows
from models.gpt import attend

SNR_FLOOR_DB = 30.0  # bf16 inputs, fp32 softmax: a correct kernel lands near 40-50 dB


def corpus_document_ids(preset: str, batch: int, seq: int) -> tuple[torch.Tensor, int]:
    """(B, T) document ids of the trainer's first micro-batch for `preset` (default corpus and
    tokenizer, its vocabulary), and the pairs its mask allows."""
    cfg = load_config(["--preset", preset])
    cache = os.environ.get("GRAPHTRAIN_CACHE", Path.home() / ".cache" / "graphtrain")
    data = build_data(
        paths=None,
        tokenizer_path=None,
        vocab_size=cfg.model.vocab_size,
        seq_len=seq,
        micro_batch_size=batch,
        dp_rank=0,
        dp_world_size=1,
        seed=cfg.training.seed,
        cache_dir=Path(cache),
    )
    first = next(iter(data.train))
    return first["document_ids"], first["num_attention_pairs"]


def reference(q, k, v, grad_out, document_ids) -> list[torch.Tensor]:
    """Output and q, k, v gradients of float32 math attention with the dense document mask."""
    xs = [t.detach().float().requires_grad_() for t in (q, k, v)]
    out = attend(*xs, document_causal_mask(document_ids).to(q.device))
    return [out.detach(), *torch.autograd.grad(out, xs, grad_out.float())]


def flex_with(q, k, v, block_mask, kernel_options):
    """models.gpt.attend's FlexAttention call with kernel_options (USE_TMA, BACKEND=FLASH)."""
    B, T = q.shape[:2]
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    out = flex_attention(
        q, k, v, block_mask=block_mask, enable_gqa=True, kernel_options=kernel_options
    )
    return out.transpose(1, 2).reshape(B, T, -1)


def candidates(document_ids: torch.Tensor, device: torch.device) -> dict[str, Callable | str]:
    """Row name -> fn(q, k, v) (compiled where the model's region would be), or why not."""
    rows: dict[str, Callable | str] = {}
    block_mask = build_attention_mask(document_ids, "flex", device)
    rows["flex (Triton)"] = functools.partial(torch.compile(attend), attn_mask=block_mask)
    if device.type != "cuda":
        rows["flex TMA"] = rows["flex FLASH (FA4)"] = rows["varlen (FA2)"] = "not run: needs CUDA"
        return rows
    compiled = torch.compile(flex_with, dynamic=False)
    rows["flex TMA"] = functools.partial(
        compiled, block_mask=block_mask, kernel_options={"USE_TMA": True}
    )
    if importlib.util.find_spec("flash_attn") is None or (
        importlib.util.find_spec("flash_attn.cute") is None
    ):
        rows["flex FLASH (FA4)"] = "not run: flash_attn.cute (flash-attn-4) is not installed"
    else:
        rows["flex FLASH (FA4)"] = functools.partial(
            compiled, block_mask=block_mask, kernel_options={"BACKEND": "FLASH"}
        )
    spans = build_attention_mask(document_ids.cpu(), "varlen", device)
    rows["varlen (FA2)"] = functools.partial(attend, attn_mask=spans)
    rows["sdpa causal, no documents"] = functools.partial(torch.compile(attend), attn_mask=None)
    return rows


def measure(fn, q, k, v, grad_out, want, timed: bool) -> dict:
    """The row's smallest SNR against `want` (output, then the gradients: on CUDA only, where
    FlexAttention has a backward) and, timed, its forward and forward + backward times."""
    if q.is_cuda:
        out = fn(q, k, v)
        got = [out, *torch.autograd.grad(out, (q, k, v), grad_out)]
    else:  # CPU FlexAttention refuses inputs that require grad
        got = [fn(q.detach(), k.detach(), v.detach())]
    row = {"snr": min(sqnr(g, w) for g, w in zip(got, want[: len(got)], strict=True))}
    if timed:

        def forward():
            with torch.no_grad():
                fn(q, k, v)

        def forward_backward():
            torch.autograd.grad(fn(q, k, v), (q, k, v), grad_out)

        row["fwd"] = triton.testing.do_bench(forward, return_mode="median")
        row["fwd_bwd"] = triton.testing.do_bench(forward_backward, return_mode="median")
    return row


def run(preset, document_ids, pairs, device, dtype, timed: bool) -> list[tuple[str, dict | str]]:
    """Every row on random q, k, v (and output gradient) of the preset's attention shape."""
    model = load_config(["--preset", preset]).model
    B, T = document_ids.shape
    H, Hkv, D = model.num_heads, model.num_kv_heads, model.head_dim
    gen = torch.Generator(device=device).manual_seed(0)
    q, k, v = (
        torch.randn(B, T, h, D, device=device, generator=gen).to(dtype).requires_grad_()
        for h in (H, Hkv, Hkv)
    )
    grad_out = torch.randn(B, T, H * D, device=device, generator=gen).to(dtype)
    want = reference(q, k, v, grad_out, document_ids)
    results: list[tuple[str, dict | str]] = []

    def fill() -> None:
        for name, fn in candidates(document_ids.to(device), device).items():
            results.append((name, fn if isinstance(fn, str) else measured(name, fn)))

    def measured(name: str, fn) -> dict | str:
        try:
            row = measure(fn, q, k, v, grad_out, want, timed)
        except Exception as e:  # a backend that fails on this torch is a row that says so
            return why_not(e)
        if name.startswith("sdpa causal"):
            row["snr"] = None  # other work: not comparable with the document reference
        if timed:
            flops = 4 * pairs * D * H
            row["tflops"] = (flops + 2.5 * flops) / (row["fwd_bwd"] * 1e-3) / 1e12
        return row

    return rows_until_cap(results, fill, ("(the rest)", CUT))


def table(results: list[tuple[str, dict | str]]) -> str:
    lines = [
        "| row | fwd ms | fwd+bwd ms | fwd+bwd TFLOP/s (document pairs) | min SNR vs fp32 dB |",
        "|---|---|---|---|---|",
    ]
    for name, row in results:
        if isinstance(row, str):
            lines.append(f"| {name} | {row} | | | |")
            continue
        snr = "other work" if row["snr"] is None else f"{row['snr']:.1f}"
        tflops = "" if name.startswith("sdpa causal") else f"{row['tflops']:.0f}"
        lines.append(f"| {name} | {row['fwd']:.2f} | {row['fwd_bwd']:.2f} | {tflops} | {snr} |")
    return "\n".join(lines)


def cpu_smoke() -> None:
    """Rows of 64 tokens: documents of 5, 20 and 39, and one of 64; debug's heads, fp32: the
    document rows that run on CPU (FlexAttention's forward) agree with the reference."""
    eos = 0
    rows = np.arange(2 * 65).reshape(2, 65) % 7 + 1
    rows[0, [4, 24]] = eos
    batch = pack_rows(rows, eos)
    document_ids, pairs = batch["document_ids"], batch["num_attention_pairs"]
    assert document_ids[0].max() == 2 and document_ids[1].max() == 0
    results = run("debug", document_ids, pairs, torch.device("cpu"), torch.float32, timed=False)
    ran = {name: row for name, row in results if isinstance(row, dict)}
    assert set(ran) == {"flex (Triton)"}, results
    assert all(row["snr"] > 100 for row in ran.values()), results  # fp32 against fp32 math
    print("cpu smoke: the document rows that run on CPU agree with float32 math")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--preset", default="1b")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=4096)
    args = parse_args(parser, cpu_smoke)
    if args is None:
        return
    document_ids, pairs = corpus_document_ids(args.preset, args.batch, args.seq)
    device = torch.device("cuda")
    results = run(args.preset, document_ids, pairs, device, torch.bfloat16, timed=True)
    body = describe(args.preset, document_ids, pairs, results)
    if args.no_record:
        print(body)
    else:
        record(f"attention: causal over packed documents, {args.preset}, fwd+bwd, bf16", body)


def describe(preset: str, document_ids: torch.Tensor, pairs: int, results: list) -> str:
    """The table, the documents it ran on, and the rows below the SNR floor."""
    B, T = document_ids.shape
    counts = (document_ids.max(dim=1).values + 1).tolist()
    text = (
        f"{table(results)}\n\n{preset}'s attention: {B} x {T} tokens, {counts} documents per "
        f"row, {pairs:,} allowed pairs ({pairs / (B * T * (T + 1) / 2):.0%} of causal)."
    )
    low = [
        name
        for name, row in results
        if isinstance(row, dict) and row["snr"] is not None and row["snr"] < SNR_FLOOR_DB
    ]
    if low:
        text += f" Below the {SNR_FLOOR_DB:.0f} dB floor: {', '.join(low)}."
    return text


if __name__ == "__main__":
    main()
