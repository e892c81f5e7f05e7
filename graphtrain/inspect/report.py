"""The inspection Report: what the compiler did, as data, read from a graph dump directory.

A dump directory (graphtrain.passes.dump) holds one folder per graph the backend compiled,
`<region>-<k>/`, with the pre-grad steps and forward/ backward/ subfolders for the AOT graphs.
`load_report(dump_dir)` turns it into a Report: the compiled graphs of every region, each pass's
result on each graph (matched or not, its notes, op-count diff, graph before and after), the
graphtrain custom ops in the final graphs with their module path, source line and options, and
the graph breaks with their reasons and source lines. A registered pass that appears in no dump
was switched off (compile.passes) and is reported as such.
"""

from __future__ import annotations

import itertools
import json
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from graphtrain.passes import PassSpec, all_passes

AOT_STAGES = ("forward", "backward")


@dataclass
class Step:
    """One graph snapshot: as captured, or after a pass."""

    label: str
    text: str
    op_counts: dict[str, int]
    notes: list[str] = field(default_factory=list)
    op_diff: dict[str, int] = field(default_factory=dict)
    diff: str = ""  # unified diff against the step before ("" for the first, or no change)
    custom_ops: list[dict[str, Any]] = field(default_factory=list)


@dataclass
class GraphStages:
    """The steps of one graph at one stage: pre_grad (Dynamo graph), forward or backward (AOT)."""

    stage: str
    steps: list[Step]


@dataclass
class CompiledGraph:
    """One graph the backend compiled (a region, or one piece of it after a graph break)."""

    name: str  # the dump folder, e.g. "head_loss-0"
    region: str
    stages: list[GraphStages]
    compile_reason: dict[str, Any] | None = None
    output_code: list[str] = field(default_factory=list)  # Inductor's generated files

    def stage(self, name: str) -> GraphStages | None:
        return next((s for s in self.stages if s.stage == name), None)


@dataclass
class PassResult:
    """What one pass did to one graph."""

    name: str
    graph: str  # e.g. "head_loss-0" or "head_loss-0/forward"
    matched: bool  # it changed the graph
    notes: list[str]
    op_diff: dict[str, int]
    before: str
    after: str
    diff: str


@dataclass
class PassInfo:
    name: str
    stage: str
    enabled: bool
    description: str
    reason: str  # why it did not run, when it did not


@dataclass
class CustomOpSite:
    op: str  # e.g. "graphtrain.linear_cross_entropy.default"
    graph: str
    node: str
    module_path: str  # relative to the compiled region's root ("output" in head_loss)
    source: str | None  # "file:line in function" of the code it replaced
    options: dict[str, Any]


@dataclass
class GraphBreak:
    graph: str  # the graph that the break ended
    region: str
    reason: str
    source: str | None  # innermost user frame, "file:line in function"
    user_stack: list[str]


@dataclass
class Report:
    dump_dir: str
    inner: str | None  # "inductor", "aot_eager", or None when unknown (a trainer dump)
    graphs: list[CompiledGraph]
    passes: list[PassInfo]
    pass_results: list[PassResult]
    custom_op_sites: list[CustomOpSite]
    graph_breaks: list[GraphBreak]

    @property
    def regions(self) -> list[str]:
        return sorted({g.region for g in self.graphs})

    @property
    def custom_ops(self) -> Counter[str]:
        """graphtrain custom ops in the final pre-grad graphs, counted by op name."""
        return Counter(site.op for site in self.custom_op_sites)

    def pass_notes(self, name: str) -> list[str]:
        """Everything pass `name` said, on every graph; why it is off when it did not run."""
        info = next((p for p in self.passes if p.name == name), None)
        if info is not None and not info.enabled:
            return [info.reason]
        return [note for r in self.pass_results if r.name == name for note in r.notes]

    def to_dict(self) -> dict[str, Any]:
        return {
            **asdict(self),
            "regions": self.regions,
            "custom_ops": dict(self.custom_ops),
        }


def _read_steps(directory: Path) -> list[Step]:
    summary = json.loads((directory / "summary.json").read_text())
    steps = []
    for entry in summary:
        diff_file = entry.get("diff_file")
        steps.append(
            Step(
                label=entry["label"],
                text=(directory / entry["file"]).read_text(),
                op_counts=entry.get("op_counts", {}),
                notes=entry.get("notes", []),
                op_diff=entry.get("op_diff", {}),
                diff=(directory / diff_file).read_text() if diff_file else "",
                custom_ops=entry.get("custom_ops", []),
            )
        )
    return steps


def _graph_dirs(dump_dir: Path) -> list[Path]:
    dirs = [p.parent for p in dump_dir.glob("*/summary.json")]

    # "block-10" after "block-9": sort on the region, then the number.
    def key(p: Path) -> tuple[str, int]:
        region, _, k = p.name.rpartition("-")
        return (region, int(k)) if k.isdigit() else (p.name, -1)

    return sorted(dirs, key=key)


def _pass_results(graph: str, steps: list[Step]) -> list[PassResult]:
    return [
        PassResult(
            name=after.label,
            graph=graph,
            matched=bool(after.diff.strip()),
            notes=after.notes,
            op_diff=after.op_diff,
            before=before.text,
            after=after.text,
            diff=after.diff,
        )
        for before, after in itertools.pairwise(steps)
    ]


def _why_off(spec: PassSpec, ran: set[str], graphs: list[CompiledGraph]) -> str:
    if spec.name in ran:
        return ""
    if not graphs:
        return "no graph was compiled"
    if spec.default_on:
        return f"switched off: compile.passes has '-{spec.name}'"
    return f"off by default: add '+{spec.name}' to compile.passes to run it"


def load_report(
    dump_dir: str | Path,
    *,
    inner: str | None = None,
    output_code: dict[str, list[str]] | None = None,
) -> Report:
    """Build a Report from the graph dumps under `dump_dir`; `output_code` maps a graph stage
    ("head_loss-0/forward") to the files Inductor wrote for it."""
    dump_dir = Path(dump_dir)
    if not dump_dir.is_dir():
        raise FileNotFoundError(f"graph dump directory {str(dump_dir)!r} does not exist")
    output_code = output_code or {}
    graphs, results, sites, breaks = [], [], [], []
    for directory in _graph_dirs(dump_dir):
        name = directory.name
        region = name.rpartition("-")[0] or name
        stages = [GraphStages("pre_grad", _read_steps(directory))]
        for stage in AOT_STAGES:
            if (directory / stage / "summary.json").is_file():
                stages.append(GraphStages(stage, _read_steps(directory / stage)))
        first = json.loads((directory / "summary.json").read_text())[0]
        reason = first.get("compile_reason")
        code = [f for stage in AOT_STAGES for f in output_code.get(f"{name}/{stage}", [])]
        graphs.append(CompiledGraph(name, region, stages, reason, code))
        for s in stages:
            label = name if s.stage == "pre_grad" else f"{name}/{s.stage}"
            results.extend(_pass_results(label, s.steps))
        for site in stages[0].steps[-1].custom_ops:
            sites.append(
                CustomOpSite(
                    op=site["op"],
                    graph=name,
                    node=site["node"],
                    module_path=site.get("module_path", ""),
                    source=site.get("source"),
                    options=site.get("options", {}),
                )
            )
        if reason and reason.get("graph_break"):
            stack = reason.get("user_stack", [])
            breaks.append(
                GraphBreak(name, region, reason["reason"], stack[-1] if stack else None, stack)
            )
    ran = {r.name for r in results}
    passes = [
        PassInfo(p.name, p.stage, p.name in ran, p.description, _why_off(p, ran, graphs))
        for p in all_passes()
    ]
    return Report(str(dump_dir), inner, graphs, passes, results, sites, breaks)
