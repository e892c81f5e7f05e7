"""Each parallel layout trained twice on CPU ranks (gloo), compile.backend = inductor against
aot_eager, everything else equal: the check that found three Inductor defects a GPU run would
have met (docs/design/compile.md; benchmarks/RESULTS.md, "Inductor against aot_eager"). The
suite compiles with aot_eager (no code generation); the CUDA default is Inductor, whose CPU code
computes the same graphs (scalar C++ here, as in every test process:
parallel_dist.scalar_cpu_kernels): a difference beyond reassociated roundings is a lead. Run it
by hand after a torch upgrade or a change to the backend or a post-grad pass (~25 min for all
the layouts on 2 cores); tests/test_backend_agreement.py runs one.

    python tests/backend_agreement.py [--steps N] [--out report.json] [LAYOUT ...]

Each run: the tests' toy corpus, 6 steps at lr 3e-3 (one warm-up step), its own launch
(conftest.rank_jobs; fresh compile caches per process). Per layout, the largest relative
difference over the steps of the loss and of the grad norm, against the layout's bound: FP32
where every operand is fp32 (reassociated reductions: seen up to 2.4e-7), LOW with bf16 compute
or FP8 (a rounding moved across a 16-bit or FP8 boundary: seen up to 7.7e-5). Inductor keeps
eager's bf16 roundings between the ops it fuses (TORCHINDUCTOR_EMULATE_PRECISION_CASTS=1, in the
runs' environment only): without it moe-debug in bf16 on ep 2, whose activations FSDP2 makes
bf16, differed by 5e-4 (loss) and 1.2e-3 (grad norm), with it by 7.7e-5. Status: ok; DIFFERS
(over the bound); FAILED (one backend failed: its error); refused (both failed the same way: the
layout does not run here, e.g. zbv on gloo with torch 2.11). A lead is followed to the
parameters by comparing AdamW's first moments after one step (the checkpoint, read with
dcp_to_torch_save). The exit status is 1 when a layout differs or failed.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path
from unittest import mock

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `models`, not tests/models

from conftest import job, make_corpus, rank_jobs

FP32, LOW = 1e-6, 2e-4
_MB = "--training.micro_batch_size="
_BF16 = "--training.dtype=bfloat16"
_FP8 = ("--training.fp8=true", "--fp8.min_dim=16")
_BUDGET = "--training.activation_memory_budget=0.3"
_ROWS4 = "--schedule.batch_size=256"  # 4 rows of 64 tokens a step
_PP = ("--parallel.pp=2", "--parallel.pp_microbatches=2")
_MTP_STAGE = ("--parallel.pp=2", "--parallel.pp_layout=E|t|tL|m", "--model.mtp_depth=1")
_ZB = (_MB + "1", _ROWS4, "--parallel.pp_microbatches=4", *_MTP_STAGE)


def _layouts() -> dict[str, tuple[int, tuple[str, ...], float]]:
    """name -> (ranks, arguments, bound)."""
    dense = {
        "one": (1, (_MB + "4",)),
        "dp2": (2, ("--parallel.dp_shard=2", _MB + "2")),
        "tp2": (2, ("--parallel.tp=2", _MB + "4")),
        "pp2": (2, (*_PP, _MB + "4")),
        "tp2_budget": (2, ("--parallel.tp=2", _MB + "4", _BUDGET)),
        "dp2_budget": (2, ("--parallel.dp_shard=2", _MB + "2", _BUDGET)),
        "dp2_full_ac": (
            2,
            ("--parallel.dp_shard=2", _MB + "2", "--training.activation_checkpoint=full"),
        ),
        "tp2_mtp": (2, ("--parallel.tp=2", _MB + "4", "--model.mtp_depth=1")),
        "tp2_lce_low_memory": (2, ("--parallel.tp=2", _MB + "4", "--compile.lce_mode=low_memory")),
        "tp2_overlap4": (2, ("--parallel.tp=2", _MB + "4", "--parallel.tp_overlap_chunks=4")),
        "mtp_stage": (
            2,
            (_MB + "2", _ROWS4, *_MTP_STAGE, "--parallel.pp_schedule=interleaved_1f1b"),
        ),
        "zbv": (2, (*_ZB, "--parallel.pp_schedule=zbv")),
        "dualpipev": (2, (*_ZB, "--parallel.pp_schedule=dualpipev")),
    }
    low = {
        "one_bf16": (1, (_MB + "4", _BF16)),
        "tp2_bf16": (2, ("--parallel.tp=2", _MB + "4", _BF16)),
        "pp2_bf16": (2, (*_PP, _MB + "4", _BF16)),
        "one_fp8": (1, (_MB + "4", *_FP8)),
        "tp2_fp8": (2, ("--parallel.tp=2", _MB + "4", *_FP8)),
        "tp2_fp8_cast_once": (
            2,
            ("--parallel.tp=2", _MB + "4", *_FP8, "--compile.passes=+fp8_cast_once"),
        ),
    }
    moe = {
        "one": (1, (_MB + "4",)),
        "dp2": (2, ("--parallel.dp_shard=2", _MB + "2")),
        "ep2": (2, ("--parallel.dp_shard=2", "--parallel.ep=2", _MB + "2")),
        "ep2_budget": (2, ("--parallel.dp_shard=2", "--parallel.ep=2", _MB + "2", _BUDGET)),
        "tp2": (2, ("--parallel.tp=2", _MB + "4")),
        "tp2_etp2": (2, ("--parallel.tp=2", "--parallel.etp=2", _MB + "4")),
        "pp2": (2, (*_PP, _MB + "4")),
        "pp2_ep2": (4, (_MB + "1", _ROWS4, "--parallel.dp_shard=2", "--parallel.ep=2", *_PP)),
        "tp2_ep2": (4, ("--parallel.dp_shard=2", "--parallel.tp=2", "--parallel.ep=2", _MB + "2")),
        "hsdp_ep2": (4, ("--parallel.dp_replicate=2", "--parallel.dp_shard=2", _MB + "1")),
        "dp2_mtp": (2, ("--parallel.dp_shard=2", _MB + "2", "--model.mtp_depth=1")),
        "dp2_accumulation": (2, ("--parallel.dp_shard=2", _MB + "1", _ROWS4)),
    }
    moe_low = {
        "dp2_fp8": (2, ("--parallel.dp_shard=2", _MB + "2", *_FP8)),
        "tp2_fp8": (2, ("--parallel.tp=2", _MB + "4", *_FP8)),
        "ep2_bf16": (2, ("--parallel.dp_shard=2", "--parallel.ep=2", _MB + "2", _BF16)),
    }
    hybrid = {
        "one": (1, (_MB + "4",)),
        "tp2": (2, ("--parallel.tp=2", _MB + "4")),
        "tp2_chunked": (2, ("--parallel.tp=2", _MB + "4", "--compile.passes=-gated_delta_rule")),
        "dp2": (2, ("--parallel.dp_shard=2", _MB + "2")),
        "pp2": (2, (*_PP, _MB + "4")),
        "budget": (1, (_MB + "4", _BUDGET)),
        "mtp": (1, (_MB + "4", "--model.mtp_depth=1")),
        "dp2_full_ac": (2, ("--parallel.dp_shard=2", _MB + "2", "--training.activation_checkpoint=full")),
    }  # fmt: skip
    out = {}
    for preset, table, bound in (
        ("debug", dense, FP32),
        ("debug", low, LOW),
        ("moe-debug", moe, FP32),
        ("moe-debug", moe_low, LOW),
        ("hybrid-debug", hybrid, FP32),
    ):
        for name, (ranks, args) in table.items():
            key = name if preset == "debug" else f"{preset.removesuffix('-debug')}_{name}"
            out[key] = (ranks, (f"--preset={preset}", *args), bound)
    out["hybrid_moe_ep2"] = (2, ("--preset=hybrid-moe-debug", *moe["ep2"][1]), FP32)
    out["hybrid_moe_pp2"] = (2, ("--preset=hybrid-moe-debug", *_PP, _MB + "4"), FP32)
    out["hybrid_fp8"] = (1, ("--preset=hybrid-debug", _MB + "4", *_FP8), LOW)
    return out


LAYOUTS = _layouts()
BACKENDS = ("aot_eager", "inductor")


def run_layout(name: str, corpus: Path, root: Path, steps: int) -> dict:
    """Both backends' runs of one layout and the verdict (module docstring)."""
    ranks, args, bound = LAYOUTS[name]
    common = (f"--training.steps={steps}", "--metrics.log_interval=1", "--metrics.val_interval=0")
    common += ("--optim.lr=3e-3", "--schedule.warmup_steps=1")
    curves, errors = {}, {}
    for backend in BACKENDS:
        argv = job(
            corpus, root / f"{name}-{backend}", *common, *args, f"--compile.backend={backend}"
        )
        try:
            with mock.patch.dict(os.environ, {"TORCHINDUCTOR_EMULATE_PRECISION_CASTS": "1"}):
                (lines,) = rank_jobs(ranks, [argv])
        except (AssertionError, OSError, ValueError) as e:  # the launch's output, or its files
            errors[backend] = _last_error(str(e))
            continue
        curves[backend] = [(m["loss"], m["grad_norm"]) for m in lines if "loss" in m]
    return {"ranks": ranks, "args": list(args), **verdict(curves, errors, bound, steps)}


def verdict(curves: dict, errors: dict, bound: float, steps: int) -> dict:
    """status, bound, errors and (both backends ran) the largest relative differences of the
    loss and the grad norm, from each backend's [(loss, grad norm)] per step or its error."""
    result = {"bound": bound, "errors": errors}
    if errors:
        same = len(errors) == len(BACKENDS) and len(set(errors.values())) == 1
        return {**result, "status": "refused" if same else "FAILED"}
    ref, got = (curves[b] for b in BACKENDS)
    if not len(ref) == len(got) == steps:
        return {**result, "status": "FAILED", "errors": {"steps": f"{len(ref)}, {len(got)}"}}
    loss = max(abs(a[0] - b[0]) / abs(a[0]) for a, b in zip(ref, got, strict=True))
    norm = max(abs(a[1] - b[1]) / abs(a[1]) for a, b in zip(ref, got, strict=True))
    status = "ok" if max(loss, norm) <= bound else "DIFFERS"
    return {**result, "status": status, "loss": loss, "grad_norm": norm, "curves": curves}


def _last_error(output: str) -> str:
    """The first line naming an error in a failed launch's output (else its last line)."""
    lines = [x.strip() for x in output.splitlines() if x.strip()]
    named = [x for x in lines if "error:" in x or "Error:" in x]
    return (named[:1] or lines[-1:] or ["(no output)"])[0][:300]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("layouts", nargs="*", help=f"default: all {len(LAYOUTS)}")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--out", type=Path, help="the results as JSON")
    args = parser.parse_args(argv)
    unknown = sorted(set(args.layouts) - set(LAYOUTS))
    if unknown:
        parser.error(f"unknown layouts {unknown}; known: {', '.join(LAYOUTS)}")
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        corpus = make_corpus(Path(tmp))
        for name in args.layouts or LAYOUTS:
            r = results[name] = run_layout(name, corpus, Path(tmp), args.steps)
            numbers = f"loss {r['loss']:.1e}, grad norm {r['grad_norm']:.1e}" if "loss" in r else ""
            why = "; ".join(f"{b}: {e}" for b, e in r["errors"].items())
            print(f"{name:24s} {r['status']:8s} {numbers} {why}".rstrip(), flush=True)
    if args.out:
        args.out.write_text(json.dumps(results, indent=1))
    return int(any(r["status"] in ("DIFFERS", "FAILED") for r in results.values()))


if __name__ == "__main__":
    sys.exit(main())
