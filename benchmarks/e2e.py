"""End-to-end training throughput: graphtrain against plain torch.compile of the same model.

    python benchmarks/e2e.py [--model 1b] [--seq-len 4096] [--batch 2] [--steps 20] [--warmup 5]
    python benchmarks/e2e.py --model moe-1b --force-balance   # MoE, random balanced routing

Both rows train the same model from the same init on the same random tokens, one GPU, bf16
autocast with fp32 master weights and fp32 AdamW (fused), causal attention over whole rows:
  * torch.compile: every block and the head+loss region compiled with plain Inductor;
  * graphtrain: the same regions through graphtrain's backend (default passes, Inductor).
Prints tokens/s, MFU (exact FLOPs formula, graphtrain.metrics.flops) and peak memory, and appends
the table with date, device, versions and commit to benchmarks/RESULTS.md. Needs a CUDA GPU.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import gc
import subprocess
import time
from pathlib import Path

import torch

from graphtrain.compile import apply_compile
from graphtrain.metrics import dense_causal_pairs, model_training_flops, peak_flops
from models import MODEL_PRESETS, build_model


def _plain_compile(model: torch.nn.Module) -> None:
    for block in model.layers.values():
        block.compile(backend="inductor", fullgraph=True)
    model.head_loss = torch.compile(model.head_loss, backend="inductor", fullgraph=True)


def run(name: str, compile_fn, args, data) -> dict:
    cfg = args.cfg
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    with torch.device("meta"):
        model = build_model(cfg)
    compile_fn(model)
    model.to_empty(device="cuda")
    model.init_weights(seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)

    def step(x, y):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    t0 = time.perf_counter()
    for x, y in data[: args.warmup]:
        step(x, y)
    torch.cuda.synchronize()
    compile_s = time.perf_counter() - t0
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for x, y in data[args.warmup :]:
        loss = step(x, y)
    end.record()
    torch.cuda.synchronize()
    seconds = start.elapsed_time(end) / 1e3
    tokens = args.steps * args.batch * args.seq_len
    flops = args.steps * model_training_flops(
        cfg,
        num_tokens=args.batch * args.seq_len,
        num_attention_pairs=dense_causal_pairs(args.batch, args.seq_len),
    )
    peak = peak_flops(torch.device("cuda"), torch.bfloat16)
    row = {
        "name": name,
        "tokens_per_s": tokens / seconds,
        "mfu": flops / seconds / peak if peak else float("nan"),
        "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30,
        "warmup_s": compile_s,
        "final_loss": loss.item(),
    }
    return row


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="1b", choices=list(MODEL_PRESETS))
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument(
        "--force-balance",
        action="store_true",
        help="MoE models: random routing with a straight-through gradient (balanced load)",
    )
    parser.add_argument("--results", default=str(Path(__file__).with_name("RESULTS.md")))
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/e2e.py needs a CUDA GPU")
    args.cfg = MODEL_PRESETS[args.model]
    if args.force_balance:
        if not hasattr(args.cfg, "force_balance"):
            raise SystemExit(f"--force-balance needs an MoE model; {args.model} is dense")
        args.cfg = dataclasses.replace(args.cfg, force_balance=True)
    cfg = args.cfg
    g = torch.Generator().manual_seed(0)
    data = [
        (
            torch.randint(0, cfg.vocab_size, (args.batch, args.seq_len), generator=g).cuda(),
            torch.randint(0, cfg.vocab_size, (args.batch, args.seq_len), generator=g).cuda(),
        )
        for _ in range(args.warmup + args.steps)
    ]
    rows = []
    for name, compile_fn in (
        ("torch.compile (plain)", _plain_compile),
        ("graphtrain", apply_compile),
    ):
        rows.append(run(name, compile_fn, args, data))
        gc.collect()  # the model and optimizer of the last row go before the next is built
        torch._dynamo.reset()
    base = rows[0]["tokens_per_s"]
    lines = [
        f"| run | tokens/s | MFU | peak mem GiB | vs plain | warmup s | loss after {args.warmup + args.steps} steps |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['name']} | {r['tokens_per_s']:,.0f} | {r['mfu']:.1%} | {r['peak_mem_gib']:.1f} | "
            f"{r['tokens_per_s'] / base:.2f}x | {r['warmup_s']:.0f} | {r['final_loss']:.3f} |"
        )
    table = "\n".join(lines)
    print(table)
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    import triton

    header = (
        f"\n## e2e {args.model}{' (force_balance)' if args.force_balance else ''}, seq {args.seq_len}, batch {args.batch}, bf16 autocast, fp32 master weights\n\n"
        f"{datetime.date.today()} | {torch.cuda.get_device_name()} | torch {torch.__version__} | "
        f"triton {triton.__version__} | commit {commit or 'unknown'}\n\n"
    )
    with open(args.results, "a") as f:
        f.write(header + table + "\n")


if __name__ == "__main__":
    main()
