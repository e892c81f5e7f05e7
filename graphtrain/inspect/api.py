"""The entry points: inspect a function or module, inspect a configured model, write a report."""

from __future__ import annotations

import contextlib
import json
import tempfile
from collections.abc import Callable, Collection
from pathlib import Path
from typing import Any

import torch

from graphtrain.compile import apply_compile, inspection_flags
from graphtrain.config import JobConfig, pass_options
from graphtrain.inspect.capture import capture_function, capture_model, run_once
from graphtrain.inspect.html import render_html
from graphtrain.inspect.pipeline import capture_pipeline
from graphtrain.inspect.profile import (
    PassTime,
    Profile,
    attribute,
    fusing_passes,
    kernel_us,
    region_ms,
    run_steps,
    share_weights,
)
from graphtrain.inspect.report import Report, load_report
from graphtrain.inspect.terminal import render_summary


def _dump_dir(dump_dir: str | Path | None) -> contextlib.AbstractContextManager[str]:
    if dump_dir is None:
        return tempfile.TemporaryDirectory(prefix="graphtrain-inspect-")
    Path(dump_dir).mkdir(parents=True, exist_ok=True)
    return contextlib.nullcontext(str(dump_dir))


@contextlib.contextmanager
def _left_as_it_was(module_or_fn: Any, example_inputs: tuple[Any, ...]) -> Any:
    """The caller's module and inputs as they were after the inspection's forward and backward:
    the same .grad on every parameter and input (None stays None), the same buffers (running
    statistics), the same train/eval mode. A user who inspects and then trains must not start
    from the inspection's gradients."""
    tensors = [x for x in example_inputs if isinstance(x, torch.Tensor)]
    buffers, modes = [], []
    if isinstance(module_or_fn, torch.nn.Module):
        tensors += list(module_or_fn.parameters())
        buffers = [(b, b.detach().clone()) for b in module_or_fn.buffers()]
        modes = [(m, m.training) for m in module_or_fn.modules()]
    # The backward accumulates into an existing .grad in place: keep its values too.
    grads = [(t, t.grad, None if t.grad is None else t.grad.detach().clone()) for t in tensors]
    try:
        yield
    finally:
        with torch.no_grad():
            for t, grad, values in grads:
                if grad is not None:
                    grad.copy_(values)
                t.grad = grad
            for b, saved in buffers:
                b.copy_(saved)
        for m, training in modes:
            m.training = training


def inspect(
    module_or_fn: Callable[..., Any],
    *example_inputs: Any,
    passes: list[str] | tuple[str, ...] = (),
    inner: str = "aot_eager",
    fullgraph: bool = False,
    dump_dir: str | Path | None = None,
    trace_dir: str | Path | None = None,
) -> Report:
    """Compile `module_or_fn` through the graphtrain backend, run it once on `example_inputs`
    (forward, and backward when the output needs a gradient) and report what the compiler did.

    passes: compile.passes switches ("-name", "+name"); inner: "aot_eager" or "inductor";
    dump_dir: keep the graph dumps there (default: a temporary directory); trace_dir: also
    write torch's structured trace (TORCH_TRACE, for tlparse) there. Resets Dynamo's caches.
    The module and the inputs are left as they were (gradients, buffers, train/eval mode).
    """
    with _dump_dir(dump_dir) as directory, _left_as_it_was(module_or_fn, example_inputs):
        capture_function(
            module_or_fn,
            example_inputs,
            dump_dir=Path(directory),
            passes=passes,
            inner=inner,
            fullgraph=fullgraph,
            trace_dir=trace_dir,
        )
        return load_report(directory, inner=inner)


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' was asked for but torch sees no CUDA device")
    if name not in ("cpu", "cuda", "meta"):
        raise ValueError(f"device must be auto, cpu, cuda or meta, got {name!r}")
    return torch.device(name)


def _build(cfg: JobConfig, target: torch.device) -> torch.nn.Module:
    from models import build_model

    with torch.device("meta"):
        model = build_model(cfg.model)
    if target.type != "meta":
        model.to_empty(device=target)
        model.init_weights(seed=cfg.training.seed)
    return model


def _inner_backend(
    cfg: JobConfig, target: torch.device, inner: str | None, profile_steps: int
) -> str:
    """The inner backend to use, or a ValueError for options that do not go together."""
    # On meta nothing runs, so Inductor has nothing to compile for: trace with aot_eager unless
    # the caller insists on another backend (which is then an error).
    inner = inner or ("aot_eager" if target.type == "meta" else cfg.compile.backend)
    if target.type == "meta" and inner != "aot_eager":
        raise ValueError("device 'meta' needs backend 'aot_eager': Inductor cannot run on meta")
    if profile_steps < 0:
        raise ValueError(f"profile steps must be >= 0, got {profile_steps}")
    if profile_steps and (target.type == "meta" or inner != "inductor"):
        raise ValueError(
            f"--profile measures Inductor's kernels: it needs --backend inductor and a real "
            f"device, got backend {inner!r} on {target.type!r}"
        )
    if profile_steps and cfg.parallel.pp > 1:
        raise ValueError(
            f"--profile with parallel.pp={cfg.parallel.pp}: the profile times one process's "
            "regions, which are every stage's too; profile with --parallel.pp=1"
        )
    return inner


def inspect_config(
    cfg: JobConfig,
    *,
    device: str = "auto",
    inner: str | None = None,
    dump_dir: str | Path | None = None,
    trace_dir: str | Path | None = None,
    validation: bool = True,
    profile_steps: int = 0,
    compare: Collection[str] | None = None,
) -> Report:
    """Build the configured model (under parallel.pp > 1 each pp rank's stages:
    graphtrain.inspect.pipeline), compile its regions as training would (cfg.compile.passes,
    inner backend cfg.compile.backend unless given) and run one forward+backward on random
    tokens of one micro-batch, then (validation) one forward in eval mode under no_grad as
    validation does. device "meta": no weights are allocated and nothing is computed, only
    traced (with inner="aot_eager", the default there), so that large presets can be inspected
    on a laptop.

    profile_steps > 0: then run that many forward+backward steps under torch.profiler and
    attribute the kernel time (report.profile, graphtrain.inspect.profile), then, for each
    pass that put a graphtrain kernel into a region and that `compare` names (None: every one),
    profile that region compiled with the pass off (one more compile per such pass)."""
    target = resolve_device(device)
    inner = _inner_backend(cfg, target, inner, profile_steps)
    pipelined = cfg.parallel.pp > 1
    t = cfg.training
    # Under pp: each pp rank's cut model, built by capture_pipeline.
    model = None if pipelined else _build(cfg, target)
    tokens = torch.randint(0, cfg.model.vocab_size, (t.micro_batch_size, t.seq_len + 1))
    tokens = tokens.to(target)
    inputs = (tokens[:, :-1], tokens[:, 1:])
    # As the trainer runs it without FSDP: fp32 weights, autocast to a lower compute dtype
    # (which the passes see: the fused cross-entropy then casts h and W explicitly).
    dtype = t.dtype if t.dtype != "auto" else "bfloat16" if target.type == "cuda" else "float32"
    autocast = (
        torch.autocast(target.type, dtype=getattr(torch, dtype))
        if dtype != "float32" and target.type != "meta"
        else contextlib.nullcontext()
    )
    with _dump_dir(dump_dir) as directory, autocast:
        if pipelined:
            capture_pipeline(
                cfg,
                inputs,
                dump_dir=Path(directory),
                inner=inner,
                trace_dir=trace_dir,
                validation=validation,
            )
            return load_report(directory, inner=inner)
        capture_model(
            model,
            inputs,
            dump_dir=Path(directory),
            passes=cfg.compile.passes,
            inner=inner,
            trace_dir=trace_dir,
            pass_options=pass_options(cfg),
            validation=validation,
            activation_memory_budget=t.activation_memory_budget,
        )
        report = load_report(directory, inner=inner)
        if profile_steps:
            report.profile = _profile(cfg, model, inputs, report, profile_steps, compare)
        return report


def _profile(
    cfg: JobConfig,
    model: torch.nn.Module,
    inputs: tuple[torch.Tensor, torch.Tensor],
    report: Report,
    steps: int,
    compare: Collection[str] | None,
) -> Profile:
    """The profile of `model` (already compiled) and, per fusing pass, of its region compiled
    again with that pass off, in a second model with the same weights."""
    device = inputs[0].device
    with inspection_flags():
        prof, step_ms = run_steps(lambda: run_once(model, inputs), steps=steps, device=device)
        result = attribute(prof, report, steps=steps, step_ms=step_ms, device=device)
        for name, region in fusing_passes(report):
            after = region_ms(result, region)
            if compare is not None and name not in compare:
                result.passes.append(
                    PassTime(name, region, after, None, "not measured (--compare)")
                )
                continue
            # The same weight tensors, no copy (share_weights says why).
            without = share_weights(model, _build(cfg, torch.device("meta")))
            apply_compile(
                without,
                passes=[*cfg.compile.passes, f"-{name}"],
                inner="inductor",
                pass_options=pass_options(cfg),
                regions={region},
                activation_memory_budget=cfg.training.activation_memory_budget,
            )
            prof, _ = run_steps(lambda m=without: run_once(m, inputs), steps=steps, device=device)
            before = kernel_us(prof, device)[0] / 1e3 / steps
            del without, prof  # its compiled code and graphs go before the next pass's model
            note = f"region {region!r} compiled again with '-{name}', same inputs and steps"
            result.passes.append(PassTime(name, region, after, before, note))
    return result


def write_report(
    source: Report | str | Path, out_dir: str | Path, *, inner: str | None = None
) -> Path:
    """Write report.html (one self-contained page), report.json and summary.txt into out_dir,
    from a Report or a graph dump directory (what `--compile.dump_graphs` writes to
    run_dir/graphs); returns the HTML page's path."""
    report = source if isinstance(source, Report) else load_report(source, inner=inner)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.json").write_text(json.dumps(report.to_dict(), indent=1) + "\n")
    (out / "summary.txt").write_text(render_summary(report, color=False))
    page = out / "report.html"
    page.write_text(render_html(report))
    return page
