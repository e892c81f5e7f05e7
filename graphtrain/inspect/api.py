"""The entry points: inspect a function or module, inspect a configured model, write a report."""

from __future__ import annotations

import contextlib
import json
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from graphtrain.config import JobConfig, pass_options
from graphtrain.inspect.capture import capture_function, capture_model
from graphtrain.inspect.html import render_html
from graphtrain.inspect.report import Report, load_report
from graphtrain.inspect.terminal import render_summary


def _dump_dir(dump_dir: str | Path | None) -> contextlib.AbstractContextManager[str]:
    if dump_dir is None:
        return tempfile.TemporaryDirectory(prefix="graphtrain-inspect-")
    Path(dump_dir).mkdir(parents=True, exist_ok=True)
    return contextlib.nullcontext(str(dump_dir))


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
    """
    with _dump_dir(dump_dir) as directory:
        files = capture_function(
            module_or_fn,
            example_inputs,
            dump_dir=Path(directory),
            passes=passes,
            inner=inner,
            fullgraph=fullgraph,
            trace_dir=trace_dir,
        )
        return load_report(directory, inner=inner, output_code=files)


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' was asked for but torch sees no CUDA device")
    if name not in ("cpu", "cuda", "meta"):
        raise ValueError(f"device must be auto, cpu, cuda or meta, got {name!r}")
    return torch.device(name)


def inspect_config(
    cfg: JobConfig,
    *,
    device: str = "auto",
    inner: str | None = None,
    dump_dir: str | Path | None = None,
    trace_dir: str | Path | None = None,
) -> Report:
    """Build the configured model, compile its regions as training would (cfg.compile.passes,
    inner backend cfg.compile.backend unless given) and run one forward+backward on random
    tokens of one micro-batch. device "meta": no weights are allocated and nothing is computed,
    only traced (with inner="aot_eager", the default there), so that large presets can be
    inspected on a laptop."""
    from models import build_model

    target = resolve_device(device)
    # On meta nothing runs, so Inductor has nothing to compile for: trace with aot_eager unless
    # the caller insists on another backend (which is then an error).
    inner = inner or ("aot_eager" if target.type == "meta" else cfg.compile.backend)
    if target.type == "meta" and inner != "aot_eager":
        raise ValueError("device 'meta' needs backend 'aot_eager': Inductor cannot run on meta")
    t = cfg.training
    with torch.device("meta"):
        model = build_model(cfg.model)
    if target.type != "meta":
        model.to_empty(device=target)
        model.init_weights(seed=t.seed)
    tokens = torch.randint(0, cfg.model.vocab_size, (t.micro_batch_size, t.seq_len + 1))
    tokens = tokens.to(target)
    # As the trainer runs it without FSDP: fp32 weights, autocast to a lower compute dtype
    # (which the passes see: the fused cross-entropy then casts h and W explicitly).
    dtype = t.dtype if t.dtype != "auto" else "bfloat16" if target.type == "cuda" else "float32"
    autocast = (
        torch.autocast(target.type, dtype=getattr(torch, dtype))
        if dtype != "float32" and target.type != "meta"
        else contextlib.nullcontext()
    )
    with _dump_dir(dump_dir) as directory, autocast:
        files = capture_model(
            model,
            (tokens[:, :-1], tokens[:, 1:]),
            dump_dir=Path(directory),
            passes=cfg.compile.passes,
            inner=inner,
            trace_dir=trace_dir,
            pass_options=pass_options(cfg),
        )
        return load_report(directory, inner=inner, output_code=files)


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
