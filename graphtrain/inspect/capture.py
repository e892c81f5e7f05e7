"""Running a compile for inspection: graph dumps, Inductor's output files, a TORCH_TRACE log.

Nothing is trained: the compiled function runs forward once and, when its output needs a
gradient, backward once (AOT autograd compiles the backward graph at the first backward).
Graph breaks need no hook here: the backend's dumps record why Dynamo ended every graph
(graphtrain.passes.dump.compile_reason). Inductor's generated files are matched to the graph
stage whose post-grad dump was written last before Inductor announced the file: both run in
one thread, one graph at a time.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
import torch._dynamo
import torch._logging.structured

from graphtrain.compile import apply_compile, backend

# Inductor logs every module it writes on this logger at DEBUG: "Output code written to: PATH".
_INDUCTOR_GRAPH_LOGGER = "torch._inductor.graph"
_OUTPUT_CODE_PREFIX = "Output code written to: "


class _OutputCodeRecorder(logging.Handler):
    """Sees the logger's DEBUG records for the file names; passes on what the user would see."""

    def __init__(self, dump_dir: Path, logger: logging.Logger) -> None:
        super().__init__(logging.DEBUG)
        self.dump_dir = dump_dir
        self.logger = logger
        self.shown_level = logger.getEffectiveLevel()
        self.files: dict[str, list[str]] = {}

    def emit(self, record: logging.LogRecord) -> None:
        if record.levelno >= self.shown_level and self.logger.parent is not None:
            self.logger.parent.handle(record)
        message = record.getMessage()
        if not message.startswith(_OUTPUT_CODE_PREFIX):
            return
        summaries = [
            p for stage in ("forward", "backward") for p in self.dump_dir.glob(f"*/{stage}/*.json")
        ]
        if not summaries:
            return
        latest = max(summaries, key=lambda p: p.stat().st_mtime_ns).parent
        key = f"{latest.parent.name}/{latest.name}"
        self.files.setdefault(key, []).append(message[len(_OUTPUT_CODE_PREFIX) :])


@contextlib.contextmanager
def record_output_code(dump_dir: Path) -> Iterator[dict[str, list[str]]]:
    """Yields {"<graph>/forward": [files Inductor wrote], ...}, filled while the block runs."""
    logger = logging.getLogger(_INDUCTOR_GRAPH_LOGGER)
    recorder = _OutputCodeRecorder(dump_dir, logger)
    level, propagate = logger.level, logger.propagate
    logger.addHandler(recorder)
    # DEBUG for the recorder only: records go on to torch's handlers through it, at the level
    # they were shown before.
    logger.setLevel(logging.DEBUG)
    logger.propagate = False
    try:
        yield recorder.files
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


def capture_function(
    fn: Callable[..., Any],
    example_inputs: Sequence[Any],
    *,
    dump_dir: Path,
    passes: Sequence[str] = (),
    inner: str = "aot_eager",
    fullgraph: bool = False,
    trace_dir: str | Path | None = None,
) -> dict[str, list[str]]:
    """Compile `fn` (a function or module) with the graphtrain backend, region named after it,
    run it once; returns Inductor's output files per graph stage. Resets Dynamo first."""
    region = getattr(fn, "__name__", None) or type(fn).__name__
    be = backend(passes=passes, inner=inner, dump_dir=dump_dir, region=region)
    torch._dynamo.reset()
    with structured_trace(trace_dir), record_output_code(dump_dir) as files:
        run_once(torch.compile(fn, backend=be, fullgraph=fullgraph), example_inputs)
    return files


def capture_model(
    model: torch.nn.Module,
    example_inputs: Sequence[Any],
    *,
    dump_dir: Path,
    passes: Sequence[str] = (),
    inner: str = "aot_eager",
    trace_dir: str | Path | None = None,
    pass_options: dict[str, Any] | None = None,
) -> dict[str, list[str]]:
    """Compile a GPT's regions as the trainer does (graphtrain.compile.apply_compile: one per
    block, one for head+loss) and run forward+backward once on `example_inputs`."""
    torch._dynamo.reset()
    apply_compile(model, passes=passes, inner=inner, dump_dir=dump_dir, pass_options=pass_options)
    with structured_trace(trace_dir), record_output_code(dump_dir) as files:
        run_once(model, example_inputs)
    return files
