"""Graph dumps: each compiled graph as captured, after every pass, op-count diffs and pass notes.

Layout under the dump root (one folder per graph the backend compiles; a region that recompiles
or breaks into several graphs gets region-1, region-2, ...):

    <region>-<k>/
        00_captured.txt, 01_<pass>.txt, 01_<pass>.diff.txt   the graph as Dynamo handed it
                                   over, after each pass, and the diff against the step before
        summary.json               per step: label, file, op counts and diff, notes, seconds,
                                   the graphtrain::* ops; the first entry: compile_reason
        sources.json               {node: [source line, code]} after the last step
        compile.json               Dynamo's compile id and whether autograd was on
        forward/, backward/        the same for the AOT forward and backward graphs; with
                                   Inductor also output_code_<k>.py and kernels.json (per
                                   kernel: its FX nodes and their source lines)
    compile_metrics.json           torch's compile metrics per compile id and the cache
                                   counters, written at the end (write_compile_metrics)

`graphtrain inspect` reads these; they are plain text so `diff` and `grep` work on them too.
Every file's fields in full: docs/design/passes.md.
"""

from __future__ import annotations

import difflib
import json
import re
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch.fx


def op_name(node: torch.fx.Node) -> str:
    """A stable, readable name for what a node does (None for placeholders and outputs)."""
    if node.op == "call_function":
        target = node.target
        if isinstance(target, torch._ops.OpOverload | torch._ops.OpOverloadPacket):
            return str(target)  # e.g. aten.mm.default, graphtrain.linear_cross_entropy.default
        name = getattr(target, "__name__", str(target))
        # Builtins live in private modules (torch._C._VariableFunctions...): use the public name.
        for public, namespace in (("torch", torch), ("torch.nn.functional", torch.nn.functional)):
            if getattr(namespace, name, None) is target:
                return f"{public}.{name}"
        module = getattr(target, "__module__", None) or ""
        name = getattr(target, "__qualname__", None) or name
        return f"{module}.{name}" if module else name
    if node.op == "call_method":
        return f"Tensor.{node.target}"
    if node.op == "call_module":
        return f"module:{node.target}"
    return node.op


def op_counts(gm: torch.fx.GraphModule) -> Counter[str]:
    return Counter(
        op_name(n)
        for n in gm.graph.nodes
        if n.op in ("call_function", "call_method", "call_module")
    )


def op_diff(before: Counter[str], after: Counter[str]) -> dict[str, int]:
    """Ops whose count changed: positive where the pass added, negative where it removed."""
    keys = sorted(set(before) | set(after))
    return {k: after[k] - before[k] for k in keys if after[k] != before[k]}


def graph_text(gm: torch.fx.GraphModule) -> str:
    return gm.print_readable(print_output=False)


_FRAME = re.compile(
    r'File "(?P<file>[^"]+)", line (?P<line>\d+), in (?P<fn>\S+)(?:\n(?P<code>.*))?'
)


def source_frame(stack_trace: str | None) -> tuple[str, str] | None:
    """("file:line in fn", the line's code) of the innermost frame of a stack trace (a node's
    meta["stack_trace"]: Python's traceback format)."""
    frames = list(_FRAME.finditer(stack_trace or ""))
    if not frames:
        return None
    f = frames[-1]
    return f"{f['file']}:{f['line']} in {f['fn']}", (f["code"] or "").strip()


def source_line(stack_trace: str | None) -> str | None:
    """ "file:line in fn" of the innermost user frame of a node's meta["stack_trace"]."""
    frame = source_frame(stack_trace)
    return frame[0] if frame else None


def node_sources(gm: torch.fx.GraphModule) -> dict[str, list[str]]:
    """{node name: [source, code]} for every node that knows where it came from."""
    found = {}
    for node in gm.graph.nodes:
        frame = source_frame(node.meta.get("stack_trace"))
        if frame is not None:
            found[node.name] = list(frame)
    return found


def module_path(dynamo_name: str) -> str:
    """Dynamo's source name of a module, as its path under the compiled root:
    "L['self'].layers._modules['0'].wq" -> "layers.0.wq"; the root itself is ""."""
    path = re.sub(r"^L\['self'\]\.?", "", dynamo_name)
    path = re.sub(r"^L\['([^']*)'\]", r"\1", path)
    path = re.sub(r"\._modules\['([^']*)'\]", r".\1", path)
    return re.sub(r"\['([^']*)'\]", r".\1", path).lstrip(".")


def _plain(value: Any) -> Any:
    if value is None or isinstance(value, bool | int | float | str):
        return value
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    return repr(value)


def custom_op_sites(gm: torch.fx.GraphModule) -> list[dict[str, Any]]:
    """Every graphtrain::* op in `gm`: where it sits in the model and with what options."""
    sites = []
    for node in gm.graph.nodes:
        target = node.target
        if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload):
            continue
        if target.namespace != "graphtrain":
            continue
        stack = node.meta.get("nn_module_stack") or {}
        path = module_path(list(stack.values())[-1][0]) if stack else ""
        sites.append(
            {
                "op": str(target),
                "node": node.name,
                "module_path": path,
                "source": source_line(node.meta.get("stack_trace")),
                "options": {k: _plain(v) for k, v in node.kwargs.items()},
            }
        )
    return sites


def compile_reason(gm: torch.fx.GraphModule) -> dict[str, Any] | None:
    """Why Dynamo ended this graph (a graph break, or the return), with the user's stack."""
    reason = getattr(gm, "compile_subgraph_reason", None)
    if reason is None:
        return None
    return {
        "reason": str(reason.reason),
        "graph_break": bool(reason.graph_break),
        "user_stack": [f"{f.filename}:{f.lineno} in {f.name}" for f in reason.user_stack],
    }


class GraphDumper:
    """Writes the story of one compiled graph into `directory`."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        directory.mkdir(parents=True, exist_ok=True)
        self.steps: list[dict] = []
        self._last_text: str | None = None
        self._last_counts: Counter[str] | None = None

    def snapshot(
        self,
        label: str,
        gm: torch.fx.GraphModule,
        notes: Sequence[str] = (),
        seconds: float | None = None,
    ) -> None:
        """Record `gm` after the step `label` (a pass name, or "captured" first) and how long
        that step took."""
        index = len(self.steps)
        stem = f"{index:02d}_{label}"
        text = graph_text(gm)
        (self.directory / f"{stem}.txt").write_text(text)
        counts = op_counts(gm)
        entry = {
            "label": label,
            "file": f"{stem}.txt",
            "op_counts": dict(counts),
            "notes": list(notes),
        }
        if seconds is not None:
            entry["seconds"] = seconds
        sites = custom_op_sites(gm)
        if sites:
            entry["custom_ops"] = sites
        if index == 0 and (reason := compile_reason(gm)) is not None:
            entry["compile_reason"] = reason
        if self._last_text is not None:
            diff = difflib.unified_diff(
                self._last_text.splitlines(keepends=True),
                text.splitlines(keepends=True),
                fromfile=self.steps[-1]["file"],
                tofile=entry["file"],
            )
            (self.directory / f"{stem}.diff.txt").write_text("".join(diff))
            entry["diff_file"] = f"{stem}.diff.txt"
            entry["op_diff"] = op_diff(self._last_counts, counts)
        self.steps.append(entry)
        self._last_text, self._last_counts = text, counts
        (self.directory / "summary.json").write_text(json.dumps(self.steps, indent=1) + "\n")
        # The graph's last word: what Inductor lowers (its kernels' provenance names these nodes).
        sources = json.dumps(node_sources(gm), indent=0)
        (self.directory / "sources.json").write_text(sources + "\n")


def write_compile_info(directory: Path) -> None:
    """compile.json of the graph being compiled now: Dynamo's compile id and the grad mode."""
    from torch._guards import CompileContext

    compile_id = CompileContext.current_compile_id()
    info = {
        "compile_id": str(compile_id) if compile_id is not None else None,
        "grad_enabled": torch.is_grad_enabled(),
    }
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "compile.json").write_text(json.dumps(info) + "\n")


# Counters torch keeps per process (torch._dynamo.utils.counters): the caches' hits and misses.
CACHE_COUNTERS = {
    "inductor": ("fxgraph_cache_hit", "fxgraph_cache_miss", "fxgraph_cache_bypass"),
    "aot_autograd": ("autograd_cache_hit", "autograd_cache_miss", "autograd_cache_bypass"),
}

# CompilationMetrics fields kept per compile (torch._dynamo.utils); a field that a torch
# version lacks is left out.
_METRIC_FIELDS = (
    "compile_id",
    "co_name",
    "co_filename",
    "co_firstlineno",
    "recompile_reason",
    "entire_frame_compile_time_s",
    "backend_compile_time_s",
    "dynamo_cumulative_compile_time_us",
    "aot_autograd_cumulative_compile_time_us",
    "inductor_cumulative_compile_time_us",
    "inductor_code_gen_cumulative_compile_time_us",
    "inductor_fx_local_cache_hit_count",
    "inductor_fx_local_cache_miss_count",
    "aotautograd_local_cache_hit_count",
    "aotautograd_local_cache_miss_count",
    "fail_reason",
)


def cache_counters() -> dict[str, int]:
    """The cache counters now ("inductor.fxgraph_cache_hit": n, ...)."""
    from torch._dynamo.utils import counters

    return {
        f"{group}.{name}": int(counters[group][name])
        for group, names in CACHE_COUNTERS.items()
        for name in names
    }


def start_compile_metrics() -> dict[str, int]:
    """Forget the compile metrics torch kept of earlier compiles in this process (compile ids
    restart at torch._dynamo.reset(), so they would be taken for this job's) and return the
    cache counters now, for write_compile_metrics(since=...)."""
    try:  # private; absent, write_compile_metrics finds no metrics either
        from torch._dynamo.utils import clear_compilation_metrics

        clear_compilation_metrics()
    except ImportError:
        pass
    return cache_counters()


def write_compile_metrics(dump_dir: Path, since: dict[str, int] | None = None) -> None:
    """compile_metrics.json under the dump root: torch's metrics of each compile this process
    kept (the most recent 64: torch._dynamo.utils.get_compilation_metrics, private, absent ->
    an empty list) and the cache counters, as differences from `since` (cache_counters())."""
    try:
        from torch._dynamo.utils import get_compilation_metrics

        metrics = get_compilation_metrics()
    except ImportError:
        metrics = []
    records = [
        {name: _plain(getattr(m, name)) for name in _METRIC_FIELDS if hasattr(m, name)}
        for m in metrics
    ]
    since = since or {}
    caches = {k: v - since.get(k, 0) for k, v in cache_counters().items()}
    dump_dir.mkdir(parents=True, exist_ok=True)
    text = json.dumps({"compiles": records, "cache_counters": caches}, indent=1)
    (dump_dir / "compile_metrics.json").write_text(text + "\n")
