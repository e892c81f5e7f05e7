"""Benchmark: the optimizer's part of a training step with bf16 working copies (gradient
clipping, AdamW, the copies), torch's clip + AdamW + refresh against clip + AdamWCopies
(graphtrain::adamw_step, which applies the clip coefficient as it reads the gradients).

What
    The parameters of a model preset (default moe-1b: 1,046M, 979M of them with working copies,
    graphtrain.optim.working_weight_params), fp32 masters with random gradients, on one CUDA
    GPU; the trainer's two weight-decay groups (build_optimizer). Every row first clips the
    gradients to norm MAX_NORM as TrainStep does (graphtrain.optim.clip_grad_norm_: the norm,
    then the gradients multiplied by the coefficient in place, or by AdamWCopies as it reads
    them). Rows:
        torch fused + refresh     clip, torch.optim.AdamW(fused=True).step(), then the foreach
                                  copy of the masters into the copies (WorkingWeights.refresh)
        graphtrain                clip's norm, AdamWCopies.step() scaling the gradients and
                                  writing the copies in its pass
        AdamWBF16 + refresh       bf16 moments: clip, AdamWBF16.step(), then the refresh
        graphtrain bf16 moments   AdamWCopies(state_dtype=bf16)
    reporting the median wall time of a step (triton.testing.do_bench), the bytes the row must
    move (the norm reads the grads; an in-place clip reads and writes them; param, grad, moments
    read; param, moments, copy written; with a separate refresh the masters read again;
    AdamWBF16's temporaries not counted) and their time at the 3.0 TB/s HBM copy rate of an
    H100, and each row's largest difference from the first row of its moment dtype after one
    step (params; copies must be the params rounded).
    Prediction for moe-1b (unmeasured; graphtrain.optim.adamw_copies): 47.7 against 35.4 GB,
    15.9 against 11.8 ms at 3.0 TB/s.

Run
    python benchmarks/adamw_step.py                 # moe-1b, all rows
    python benchmarks/adamw_step.py --model 1b
    python benchmarks/adamw_step.py --cpu-smoke     # no GPU: moe-tiny on CPU, rows agree
The table is printed and appended to benchmarks/RESULTS.md; --no-record skips that.
"""

from __future__ import annotations

import argparse

import torch
import triton.testing
from harness import CUT, parse_args, record, rows_until_cap, why_not  # benchmarks/ on sys.path

from graphtrain.optim import (
    AdamWCopies,
    WorkingWeights,
    build_optimizer,
    clip_grad_norm_,
    scale_grads_,
    working_weight_params,
)
from models import MODEL_PRESETS, build_model

HBM_BYTES_PER_S = 3.0e12  # MISSION.md: H100 HBM copy rate
HYPER = dict(lr=3e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
MAX_NORM = 1.0  # below the random gradients' norm (~1e-3 x sqrt(1e9) = 32): they are clipped
NO_DECAY = ["*norm*", "*bias", "tok_embeddings.*"]
ROWS = {  # name: (optimizer implementation, moments dtype)
    "torch fused + refresh": ("fused", "float32"),
    "graphtrain": ("graphtrain", "float32"),
    "AdamWBF16 + refresh": ("fused", "bfloat16"),
    "graphtrain bf16 moments": ("graphtrain", "bfloat16"),
}


def setup(preset: str, device: torch.device, implementation: str, state_dtype: str):
    """The preset's parameters (seeded), gradients, optimizer and working copies."""
    with torch.device("meta"):
        model = build_model(MODEL_PRESETS[preset])
    model.to_empty(device=device)
    gen = torch.Generator(device).manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen, device=device) * 0.02)
            p.grad = torch.randn(p.shape, generator=gen, device=device) * 1e-3
    opt = build_optimizer(
        model,
        **HYPER,
        no_decay_patterns=NO_DECAY,
        implementation=implementation,
        state_dtype=state_dtype,
    )
    weights = WorkingWeights(model, working_weight_params(model), torch.bfloat16)
    if implementation == "graphtrain":
        weights.refresh_in(opt)
    return model, opt, weights


def bytes_moved(model, weights, state_dtype: str, separate: bool) -> int:
    """At least, per step: the grads read for the norm; param, grad, moments read; param,
    moments written; the copies written; with a separate clip and refresh (torch's optimizers)
    the grads read and written again and the masters read again."""
    state = 4 if state_dtype == "float32" else 2
    n = sum(p.numel() for p in model.parameters())
    copies = sum(c.numel() for c in weights.copies)
    return n * (4 + 4 + 4 + 2 * state + 4 + 2 * state + 8 * separate) + (2 + 4 * separate) * copies


def measure_row(name: str, preset: str, device: torch.device, timed: bool, first: dict) -> str:
    """One row's table line: a step, its copies checked, its parameters against the first row
    of its moment dtype (`first` keeps them), its median time where `timed`."""
    implementation, state_dtype = ROWS[name]
    if device.type == "cpu" and implementation == "fused" and state_dtype == "float32":
        implementation = "foreach"  # the reference path on CPU
    model, opt, weights = setup(preset, device, implementation, state_dtype)
    masters = list(model.parameters())
    scale = opt.scale_grads_in_step if isinstance(opt, AdamWCopies) else scale_grads_

    def step():
        clip_grad_norm_(masters, MAX_NORM, scale=scale)
        opt.step()
        weights.refresh()  # nothing to do when the step wrote the copies

    step()
    params = [p.detach().clone() for p in model.parameters()]
    for copy, master in zip(weights.copies, weights.masters, strict=True):
        assert torch.equal(copy, master.detach().to(torch.bfloat16)), name
    ref = first.setdefault(state_dtype, params)
    diff = max((a - b).abs().max().item() for a, b in zip(params, ref, strict=True))
    ms = triton.testing.do_bench(step) if timed else float("nan")
    moved = bytes_moved(model, weights, state_dtype, implementation != "graphtrain")
    return (
        f"| {name} | {ms:.2f} | {moved / 1e9:.1f} | {moved / HBM_BYTES_PER_S * 1e3:.2f} "
        f"| {diff:.1e} |"
    )


def run(preset: str, device: torch.device, timed: bool) -> str:
    """The table: a row that fails says why, the others are still measured; stopped by the
    stage's cap, the rows measured stay."""
    lines = [
        f"{preset}: optimizer step with bf16 working copies",
        "",
        "| row | ms (median) | GB moved, at least | their ms at 3.0 TB/s | max param diff |",
        "|---|---|---|---|---|",
    ]
    first: dict[str, list[torch.Tensor]] = {}

    def fill() -> None:
        for name in ROWS:
            try:
                lines.append(measure_row(name, preset, device, timed, first))
            except Exception as e:  # an out-of-memory, a kernel that fails on this GPU
                lines.append(f"| {name} | {why_not(e)} | | | |")
            if device.type == "cuda":
                torch.cuda.empty_cache()  # the row's model and state are gone

    rows_until_cap(lines, fill, f"| (the rest) | {CUT} | | | |")
    return "\n".join(lines)


def cpu_smoke() -> None:
    """moe-tiny on CPU, untimed."""
    print(run("moe-tiny", torch.device("cpu"), timed=False))
    print("cpu smoke: every row steps and writes its copies")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="moe-1b", choices=list(MODEL_PRESETS))
    args = parse_args(parser, cpu_smoke)
    if args is None:
        return
    body = run(args.model, torch.device("cuda"), timed=True)
    if args.no_record:
        print(body)
    else:
        record(f"AdamW step with working copies, {args.model}", body)


if __name__ == "__main__":
    main()
