"""Running a compile for inspection: graph dumps, Inductor's output code, a TORCH_TRACE log.

Nothing is trained: the compiled function runs forward once and, when its output needs a
gradient, backward once (AOT autograd compiles the backward graph at the first backward); a
model then also runs one forward under no_grad in eval mode, as validation does, so that the
graphs the trainer compiles for validation (and the recompile that causes) are in the report.
Graph breaks need no hook here: the backend's dumps record why Dynamo ended every graph
(graphtrain.passes.dump.compile_reason). Inductor's generated modules are copied into the dump
of the graph stage whose post-grad dump was written last before Inductor announced the file
(both run in one thread, one graph at a time), with the provenance Inductor tracked for each
kernel, so that the report holds the code wherever it is opened. At the end torch's compile
metrics (stage times, recompile reasons, cache hits) are written to the dump root.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
import torch._dynamo
import torch._logging.structured

from graphtrain.compile import apply_compile, backend, inspection_flags
from graphtrain.passes.dump import start_compile_metrics, write_compile_metrics

# Inductor logs every module it writes on this logger at DEBUG: "Output code written to: PATH".
_INDUCTOR_GRAPH_LOGGER = "torch._inductor.graph"
_OUTPUT_CODE_PREFIX = "Output code written to: "


def _kernel_provenance() -> dict[str, dict[str, list[str]]]:
    """What Inductor's provenance tracking (inspection_flags) recorded for the graph it has just
    generated: {"<kernel>:<handle>": {"nodes": [post-grad FX nodes], "stack_traces": [...]}}.
    Private module state of torch._inductor.debug (torch 2.8+), reset per graph; where it is
    missing the report shows the code without attribution."""
    import torch._inductor.debug as inductor_debug

    traces = getattr(inductor_debug, "_inductor_kernel_stack_trace", None) or {}
    nodes = getattr(inductor_debug, "_inductor_triton_kernel_to_post_grad_node_info", None) or {}
    return {
        kernel: {"nodes": list(nodes.get(kernel, [])), "stack_traces": list(traces.get(kernel, []))}
        for kernel in {**traces, **nodes}
    }


class _OutputCodeRecorder(logging.Handler):
    """Sees the logger's DEBUG records for the file names; passes on what the user would see."""

    def __init__(self, dump_dir: Path, logger: logging.Logger) -> None:
        super().__init__(logging.DEBUG)
        self.dump_dir = dump_dir
        self.logger = logger
        self.shown_level = logger.getEffectiveLevel()
        self.seen: set[str] = set()

    def emit(self, record: logging.LogRecord) -> None:
        if record.levelno >= self.shown_level and self.logger.parent is not None:
            self.logger.parent.handle(record)
        message = record.getMessage()
        if not message.startswith(_OUTPUT_CODE_PREFIX):
            return
        # A pipelined inspection dumps each pp rank's graphs a folder deeper (pp<rank>/).
        summaries = [
            p for stage in ("forward", "backward") for p in self.dump_dir.glob(f"**/{stage}/*.json")
        ]
        if not summaries:
            return
        path = message[len(_OUTPUT_CODE_PREFIX) :].strip()
        if path in self.seen:  # announced at two levels by some torch versions
            return
        self.seen.add(path)
        stage_dir = max(summaries, key=lambda p: p.stat().st_mtime_ns).parent
        k = len(list(stage_dir.glob("output_code_*.py")))
        code = Path(path).read_text() if Path(path).is_file() else ""
        (stage_dir / f"output_code_{k}.py").write_text(code)
        info = {"path": path, "kernels": _kernel_provenance()}
        (stage_dir / f"output_code_{k}.json").write_text(json.dumps(info, indent=1) + "\n")


@contextlib.contextmanager
def record_output_code(dump_dir: Path) -> Iterator[None]:
    """Copies each module Inductor writes while the block runs into its graph stage's dump
    (output_code_<k>.py, and output_code_<k>.json: its original path and kernel provenance)."""
    logger = logging.getLogger(_INDUCTOR_GRAPH_LOGGER)
    recorder = _OutputCodeRecorder(dump_dir, logger)
    level, propagate = logger.level, logger.propagate
    logger.addHandler(recorder)
    # DEBUG for the recorder only: records go on to torch's handlers through it, at the level
    # they were shown before.
    logger.setLevel(logging.DEBUG)
    logger.propagate = False
    try:
        yield
    finally:
        logger.removeHandler(recorder)
        logger.setLevel(level)
        logger.propagate = propagate


@contextlib.contextmanager
def structured_trace(trace_dir: str | Path | None) -> Iterator[None]:
    """torch's structured trace (what TORCH_TRACE=DIR writes, and tlparse reads) into trace_dir."""
    if trace_dir is None:
        yield
        return
    from torch._logging import _internal

    Path(trace_dir).mkdir(parents=True, exist_ok=True)
    handler = _internal.LazyTraceHandler(str(trace_dir))
    handler.setFormatter(_internal.TorchLogsFormatter(trace=True))
    trace_log = _internal.trace_log
    level = trace_log.level
    intern_table = getattr(torch._logging.structured, "INTERN_TABLE", None)
    if intern_table is not None and _internal.TRACE_ENV_VAR not in os.environ:
        # Strings (file names of stack frames) are written once per process, when first
        # interned; interned while nobody listened, they would be missing from this file.
        # (Not while a TORCH_TRACE log is being written: its ids would be reused.)
        intern_table.clear()
    trace_log.addHandler(handler)
    trace_log.setLevel(logging.DEBUG)
    try:
        yield
    finally:
        trace_log.removeHandler(handler)
        trace_log.setLevel(level)
        handler.close()


def _backward_target(out: Any) -> torch.Tensor | None:
    tensors = [t for t in torch.utils._pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]
    tensors = [t for t in tensors if t.requires_grad and t.is_floating_point()]
    if not tensors:
        return None
    return sum(t.sum() for t in tensors)


def run_once(fn: Callable[..., Any], example_inputs: Sequence[Any]) -> None:
    """Forward, then backward when the output needs a gradient (compiles the backward)."""
    out = fn(*example_inputs)
    target = _backward_target(out)
    if target is not None:
        target.backward()


def run_validation(model: torch.nn.Module, example_inputs: Sequence[Any]) -> None:
    """One forward as the trainer's validation runs it: eval mode, under no_grad."""
    model.eval()
    try:
        with torch.no_grad():
            model(*example_inputs)
    finally:
        model.train()


@contextlib.contextmanager
def recording(dump_dir: Path, trace_dir: str | Path | None) -> Iterator[None]:
    """Everything a capture records: the trace, Inductor's output code and provenance, and at
    the end torch's compile metrics and the cache counters of this capture."""
    since = start_compile_metrics()
    with inspection_flags(), structured_trace(trace_dir), record_output_code(dump_dir):
        yield
    write_compile_metrics(dump_dir, since)


def capture_function(
    fn: Callable[..., Any],
    example_inputs: Sequence[Any],
    *,
    dump_dir: Path,
    passes: Sequence[str] = (),
    inner: str = "aot_eager",
    fullgraph: bool = False,
    trace_dir: str | Path | None = None,
) -> None:
    """Compile `fn` (a function or module) with the graphtrain backend, region named after it,
    and run it once. Resets Dynamo first."""
    region = getattr(fn, "__name__", None) or type(fn).__name__
    be = backend(passes=passes, inner=inner, dump_dir=dump_dir, region=region)
    torch._dynamo.reset()
    with recording(dump_dir, trace_dir):
        run_once(torch.compile(fn, backend=be, fullgraph=fullgraph), example_inputs)


def capture_model(
    model: torch.nn.Module,
    example_inputs: Sequence[Any],
    *,
    dump_dir: Path,
    passes: Sequence[str] = (),
    inner: str = "aot_eager",
    trace_dir: str | Path | None = None,
    pass_options: dict[str, Any] | None = None,
    validation: bool = True,
    activation_memory_budget: float = 1.0,
) -> None:
    """Compile a GPT's regions as the trainer does (graphtrain.compile.apply_compile: one per
    block, one for head+loss), run forward+backward once on `example_inputs` and, with
    `validation`, one forward as validation does (run_validation)."""
    torch._dynamo.reset()
    apply_compile(
        model,
        passes=passes,
        inner=inner,
        dump_dir=dump_dir,
        pass_options=pass_options,
        activation_memory_budget=activation_memory_budget,
    )
    with recording(dump_dir, trace_dir):
        run_once(model, example_inputs)
        if validation:
            run_validation(model, example_inputs)
