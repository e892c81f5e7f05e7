"""Graph dumps: each compiled graph as captured, after every pass, op-count diffs and pass notes.

Layout under the dump root (one folder per graph the backend compiles; a region that recompiles
or breaks into several graphs gets region-1, region-2, ...):

    <region>-<k>/
        00_captured.txt            the graph as Dynamo handed it over
        01_<pass>.txt              the graph after that pass ...
        01_<pass>.diff.txt         unified diff of the code against the step before
        summary.json               [{label, file, op_counts, op_diff, notes}, ...] in order;
                                   entries also carry custom_ops (every graphtrain::* node:
                                   op, node, module_path, source, options) and the first one
                                   compile_reason (why Dynamo ended this graph: a graph break
                                   with its reason and user stack, or the return)
        forward/, backward/        the same for the AOT forward and backward graphs (aten IR),
                                   as partitioned and after each post-grad pass

`graphtrain inspect` reads these; they are plain text so `diff` and `grep` work on them too.
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


_FRAME = re.compile(r'File "(?P<file>[^"]+)", line (?P<line>\d+), in (?P<fn>\S+)')


def source_line(stack_trace: str | None) -> str | None:
    """ "file:line in fn" of the innermost user frame of a node's meta["stack_trace"]."""
    frames = _FRAME.findall(stack_trace or "")
    if not frames:
        return None
    file, line, fn = frames[-1]
    return f"{file}:{line} in {fn}"


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

    def snapshot(self, label: str, gm: torch.fx.GraphModule, notes: Sequence[str] = ()) -> None:
        """Record `gm` after the step `label` (a pass name, or "captured" first)."""
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
