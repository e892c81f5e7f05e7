"""The inspection Report: what the compiler did, as data, read from a graph dump directory.

A dump directory (graphtrain.passes.dump) holds one folder per graph the backend compiled,
`<region>-<k>/`, with the pre-grad steps and forward/ backward/ subfolders for the AOT graphs.
`load_report(dump_dir)` turns it into a Report: the compiled graphs of every region, each pass's
result on each graph (matched or not, its notes, op-count diff, graph before and after), the
graphtrain custom ops in the final graphs with their module path, source line and options, and
the graph breaks with their reasons and source lines, Inductor's generated code with each
kernel's provenance, the compile time of every stage, the recompiles with torch's reason, and
the caches' hits and misses (torch's compile metrics, compile_metrics.json in the dump). A
registered pass that appears in no dump was switched off (compile.passes) and is reported as such.
`fired(report)` and `unmatched(report)` digest the pass results for the two renderings: what
fired, where and what it saves, then the passes that found nothing, each with a reason.
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
# A pipelined inspection's stages: [{"stage", "pp_rank", "holds", "regions"}] (inspect.pipeline)
PIPELINE_FILE = "pipeline.json"


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
    seconds: float | None = None  # how long the pass took (None for the captured graph)


@dataclass
class GraphStages:
    """The steps of one graph at one stage: pre_grad (Dynamo graph), forward or backward (AOT)."""

    stage: str
    steps: list[Step]


@dataclass
class GeneratedCode:
    """One module Inductor generated for a graph stage, and what each of its kernels computes."""

    stage: str  # "forward" or "backward"
    path: str  # where Inductor wrote it (a cache directory of the machine that compiled)
    code: str
    # "<kernel>:<handle>" -> {"nodes": [post-grad FX nodes], "stack_traces": [...]}, from
    # Inductor's provenance tracking; {} where this torch does not track it
    kernels: dict[str, dict[str, list[str]]] = field(default_factory=dict)
    # FX node -> [source line, code] of the graph Inductor lowered (the dump's sources.json)
    node_sources: dict[str, list[str]] = field(default_factory=dict)


@dataclass
class CompileTimes:
    """Seconds per compile stage of one graph, as torch's compile metrics report them (None:
    not reported); the backward graph's AOT and Inductor time (compiled at the first backward)
    included."""

    dynamo: float | None  # tracing the frame, guards, bytecode (whole frame minus backend)
    graphtrain_passes: float  # our pre-grad and post-grad passes, measured by the backend
    aot_autograd: float | None  # AOT autograd without the Inductor time inside it
    inductor: float | None  # lowering, code generation, C++/Triton compile
    inductor_codegen: float | None  # of which code generation
    total: float | None  # the frame compile plus the backward compile


@dataclass
class CompiledGraph:
    """One graph the backend compiled (a region, or one piece of it after a graph break)."""

    name: str  # the dump folder, e.g. "head_loss-0"
    region: str
    stages: list[GraphStages]
    compile_reason: dict[str, Any] | None = None
    output_code: list[GeneratedCode] = field(default_factory=list)
    compile_id: str | None = None  # Dynamo's, "frame/compile": "0/1" is frame 0's recompile
    grad_enabled: bool | None = None  # False: compiled under no_grad (forward only)
    recompile_reason: str | None = None  # torch's: the guard that failed
    times: CompileTimes | None = None
    cache: dict[str, int] = field(default_factory=dict)  # local cache hits/misses (metrics)

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
class Recompile:
    """A graph Dynamo compiled again for a frame it had compiled before, and why."""

    graph: str
    compile_id: str
    reason: str  # torch's guard failure, with our reading of it where we know one


@dataclass
class Report:
    dump_dir: str
    inner: str | None  # "inductor", "aot_eager", or None when unknown (a trainer dump)
    graphs: list[CompiledGraph]
    passes: list[PassInfo]
    pass_results: list[PassResult]
    custom_op_sites: list[CustomOpSite]
    graph_breaks: list[GraphBreak]
    recompiles: list[Recompile] = field(default_factory=list)
    # process-wide cache counter differences ("inductor.fxgraph_cache_hit": n, ...)
    cache_counters: dict[str, int] = field(default_factory=dict)
    profile: Any = None  # a graphtrain.inspect.profile.Profile, with `inspect --profile`
    # Under parallel.pp > 1: each stage, its pp rank, what it holds and its regions' graphs.
    pipeline: list[dict[str, Any]] = field(default_factory=list)

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


# What each fusion saves, for the lead of the page and the summary (the profile, when there is
# one, adds the measured time). A pass not named here that inserts a graphtrain op still counts
# as a fusion; canonicalize and other respellings are "other rewrites".
PASS_SAVES = {
    "fuse_linear_cross_entropy": "the (tokens x vocab) logits and their gradient are never "
    "held in memory: the loss and the gradient come from one op, the gradient computed in the "
    "forward",
    "fuse_moe_router": "one op, forward and backward, for scores, group limit, top-k, weights "
    "and expert counts instead of a chain of small ops",
    "fuse_moe_dispatch": "the token permutation and the weighted combine as one op each, with "
    "their own backward, instead of indexing ops and their autograd",
    "fuse_sibling_grouped_mm": "one grouped GEMM instead of two over the same input rows (read "
    "once, one launch)",
    "fold_routing_weights": "the routing weights scale the experts' hidden rows before the down "
    "projection, so the backward keeps no copy of the expert outputs ([tokens x k, dim])",
    "gated_delta_rule": "the chunked recurrence kernel instead of the plain PyTorch recurrence",
    "fp8_linear": "the selected GEMMs (forward, dgrad, wgrad) in FP8 with current scaling",
    "fp8_all_gather": "the tensor-parallel all-gather moves FP8 bytes instead of bf16",
    "overlap_tp_comm": "the tensor-parallel collective runs while the GEMM next to it computes",
    "fp8_cast_once": "each activation cast to FP8 once for all the linears that read it",
}

# Said for a pass that found nothing and left no note: what it needs to fire.
PASS_NEEDS = {
    "fp8_all_gather": "nothing to rewrite: it needs sequence-parallel TP (tp > 1) with the "
    "fp8_linear pass on",
    "overlap_tp_comm": "nothing to rewrite: it needs tensor-parallel collectives (tp > 1)",
    "fp8_cast_once": "nothing to rewrite: it needs the fp8_linear pass on",
}
NO_NOTE = "nothing to rewrite in this graph (the pass gave no reason)"


def result_notes(result: PassResult) -> list[str]:
    """A pass result's notes, never empty: what a silent pass needs, or that it said nothing."""
    if result.notes:
        return result.notes
    if result.matched:
        return ["changed the graph (the pass gave no note)"]
    return [PASS_NEEDS.get(result.name, NO_NOTE)]


@dataclass
class Fired:
    """One pass's rewrite, the same on every graph in `graphs` (training's and validation's
    compile of one region usually)."""

    name: str
    graphs: list[str]
    op_diff: dict[str, int]
    notes: list[str]  # distinct, never empty
    sites: list[CustomOpSite]  # the graphtrain ops it inserted: module path, source line
    saves: str  # what it saves ("" for a rewrite that is no fusion)
    fusion: bool  # a fusion (PASS_SAVES, or it inserted a graphtrain op), not a respelling

    def replaced(self, shown: int | None = None) -> str:
        """The ops it took out and the ones it put in, "-1 a, -1 b -> +1 c"; `shown`: at most
        so many kinds on each side, then how many more."""

        def side(items: list[str]) -> str:
            if shown is not None and len(items) > shown:
                items = [*items[:shown], f"... {len(items) - shown} more"]
            return ", ".join(items) or "-"

        gone = [f"{n:+d} {op}" for op, n in self.op_diff.items() if n < 0]
        new = [f"{n:+d} {op}" for op, n in self.op_diff.items() if n > 0]
        return f"{side(gone)} -> {side(new)}"


@dataclass
class Unmatched:
    """A pass that ran and changed nothing, summarised over the graphs."""

    name: str
    graphs: list[str]
    notes: list[str]  # distinct, never empty


def fired(report: Report) -> list[Fired]:
    """The passes that changed a graph, fusions first, in pass order; one entry per pass and
    distinct op diff, with the graphs where it was so and their distinct notes."""
    groups: dict[tuple[Any, ...], Fired] = {}
    for r in report.pass_results:
        if not r.matched:
            continue
        # Not keyed on the notes: they can differ in numbers alone (the memory budget of the
        # cross-entropy mode, read at each compile).
        key = (r.name, tuple(r.op_diff.items()))
        if key in groups:
            groups[key].graphs.append(r.graph)
            groups[key].notes += [n for n in result_notes(r) if n not in groups[key].notes]
            continue
        inserts = any(n > 0 and op.startswith("graphtrain.") for op, n in r.op_diff.items())
        groups[key] = Fired(
            name=r.name,
            graphs=[r.graph],
            op_diff=dict(r.op_diff),
            notes=result_notes(r),
            sites=[],
            saves=PASS_SAVES.get(r.name, ""),
            fusion=inserts or r.name in PASS_SAVES,
        )
    for f in groups.values():
        seen = set()
        for site in report.custom_op_sites:
            where = (site.op, site.module_path, site.source)
            if site.graph in f.graphs and f.op_diff.get(site.op, 0) > 0 and where not in seen:
                seen.add(where)
                f.sites.append(site)
    return sorted(groups.values(), key=lambda f: not f.fusion)  # stable: pass order kept


def measured(report: Report, name: str) -> list[str]:
    """The profile's kernel time per step of each region with pass `name` off and on (none
    without --profile, or where the pass was not timed)."""
    if report.profile is None:
        return []
    return [
        f"measured in {t.region}: {t.before_ms:.3f} ms/step kernel time without the pass, "
        f"{t.after_ms:.3f} with it ({t.before_ms / t.after_ms:.2f}x)"
        for t in report.profile.passes
        if t.name == name and t.before_ms and t.after_ms
    ]


def unmatched(report: Report) -> list[Unmatched]:
    """The enabled passes that changed no graph, each with the graphs and its distinct notes
    (a pass that matched somewhere is in `fired`, its other graphs left out)."""
    matched = {r.name for r in report.pass_results if r.matched}
    out: dict[str, Unmatched] = {}
    for r in report.pass_results:
        if r.matched or r.name in matched:
            continue
        entry = out.setdefault(r.name, Unmatched(r.name, [], []))
        entry.graphs.append(r.graph)
        entry.notes += [n for n in result_notes(r) if n not in entry.notes]
    return list(out.values())


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
                seconds=entry.get("seconds"),
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


def _output_code(directory: Path) -> list[GeneratedCode]:
    """The modules Inductor generated for this graph's AOT stages (capture.record_output_code)."""
    found = []
    for stage in AOT_STAGES:
        sources_file = directory / stage / "sources.json"
        sources = json.loads(sources_file.read_text()) if sources_file.is_file() else {}
        files = sorted((directory / stage).glob("output_code_*.py"), key=lambda p: int(p.stem[12:]))
        for file in files:
            info_file = file.with_suffix(".json")
            info = json.loads(info_file.read_text()) if info_file.is_file() else {}
            found.append(
                GeneratedCode(
                    stage, info.get("path", ""), file.read_text(), info.get("kernels", {}), sources
                )
            )
    return found


def _seconds(record: dict[str, Any], key: str) -> float | None:
    value = record.get(key)
    return None if value is None else value / 1e6 if key.endswith("_us") else value


def _sum(values: list[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return sum(known) if known else None


def _compile_times(graph: CompiledGraph, records: list[dict[str, Any]]) -> CompileTimes:
    """One graph's stage times from its compile's metrics records: the frame's and, with
    Inductor, the backward's (compiled at the first backward, outside the frame's compile).
    In the frame's record (torch 2.13) the AOT autograd timer spans the whole backend call, our
    pre-grad passes and the forward's Inductor compile included."""
    passes = sum(t for s in graph.stages for t in _pass_seconds(s.steps))
    frame = next((r for r in records if r.get("entire_frame_compile_time_s") is not None), {})
    later = [r for r in records if r is not frame]
    whole, backend = frame.get("entire_frame_compile_time_s"), frame.get("backend_compile_time_s")
    aot = _seconds(frame, "aot_autograd_cumulative_compile_time_us")
    inductor = _sum([_seconds(r, "inductor_cumulative_compile_time_us") for r in records])
    codegen = _sum([_seconds(r, "inductor_code_gen_cumulative_compile_time_us") for r in records])
    frame_inductor = _seconds(frame, "inductor_cumulative_compile_time_us") or 0.0
    return CompileTimes(
        dynamo=None if whole is None or backend is None else whole - backend,
        graphtrain_passes=passes,
        aot_autograd=None if aot is None else max(0.0, aot - frame_inductor - passes),
        inductor=inductor,
        inductor_codegen=codegen,
        total=_sum([whole, *(_seconds(r, "inductor_cumulative_compile_time_us") for r in later)]),
    )


def _pass_seconds(steps: list[Step]) -> list[float]:
    return [s.seconds for s in steps if s.seconds is not None]


def _is_recompile(compile_id: str) -> bool:
    # "frame/attempt", attempt possibly followed by "_restart" (torch 2.13: "0/1", "0/1_1")
    return compile_id.rpartition("/")[2].partition("_")[0] not in ("", "0")


def _explain(reason: str | None, graph: CompiledGraph) -> str:
    """torch's recompile reason, with what it means in a graphtrain run where we know it."""
    parts = [reason] if reason else []
    if graph.grad_enabled is False:
        parts.append(
            "compiled under torch.no_grad() (validation or evaluation): a forward-only graph, "
            "no backward"
        )
    if reason and "grad_mode" in reason:
        parts.append(
            "autograd on in one compile and off in the other (training, and validation under "
            "no_grad): one graph for each, and no further recompile"
        )
    if reason and "BACKEND_MATCH" in reason:
        parts.append(
            "another pp rank's compile of the same code: inspect runs every pp rank in one "
            "process, each with its own backend; a pipelined run compiles it once per rank"
        )
    if reason and "training" in reason:
        parts.append("module.eval()/train() flips `training`, which Dynamo guards on")
    return "; ".join(p.strip() for p in parts) or "torch gave no reason"


def _pipeline(dump_dir: Path, graphs: list[CompiledGraph]) -> list[dict[str, Any]]:
    """A pipelined inspection's stage table with each stage's graphs ([] for other dumps)."""
    path = dump_dir / PIPELINE_FILE
    stages = json.loads(path.read_text()) if path.is_file() else []
    for stage in stages:
        stage["graphs"] = [g.name for g in graphs if g.region in stage["regions"]]
    return stages


def load_report(dump_dir: str | Path, *, inner: str | None = None) -> Report:
    """Build a Report from the graph dumps under `dump_dir`."""
    dump_dir = Path(dump_dir)
    if not dump_dir.is_dir():
        raise FileNotFoundError(f"graph dump directory {str(dump_dir)!r} does not exist")
    metrics_file = dump_dir / "compile_metrics.json"
    metrics = json.loads(metrics_file.read_text()) if metrics_file.is_file() else {}
    by_id: dict[str, list[dict[str, Any]]] = {}
    for record in metrics.get("compiles", []):
        by_id.setdefault(str(record.get("compile_id")), []).append(record)
    graphs, results, sites, breaks, recompiles = [], [], [], [], []
    for directory in _graph_dirs(dump_dir):
        name = directory.name
        region = name.rpartition("-")[0] or name
        stages = [GraphStages("pre_grad", _read_steps(directory))]
        for stage in AOT_STAGES:
            if (directory / stage / "summary.json").is_file():
                stages.append(GraphStages(stage, _read_steps(directory / stage)))
        first = json.loads((directory / "summary.json").read_text())[0]
        reason = first.get("compile_reason")
        graph = CompiledGraph(name, region, stages, reason, _output_code(directory))
        info_file = directory / "compile.json"
        info = json.loads(info_file.read_text()) if info_file.is_file() else {}
        graph.compile_id, graph.grad_enabled = info.get("compile_id"), info.get("grad_enabled")
        records = by_id.get(str(graph.compile_id), []) if graph.compile_id else []
        graph.recompile_reason = next(
            (r["recompile_reason"] for r in records if r.get("recompile_reason")), None
        )
        if records or any(_pass_seconds(s.steps) for s in stages):
            graph.times = _compile_times(graph, records)
        graph.cache = {
            key: sum(r.get(key) or 0 for r in records)
            for key in (
                "inductor_fx_local_cache_hit_count",
                "inductor_fx_local_cache_miss_count",
                "aotautograd_local_cache_hit_count",
                "aotautograd_local_cache_miss_count",
            )
            if any(key in r for r in records)
        }
        graphs.append(graph)
        if graph.compile_id and (_is_recompile(graph.compile_id) or graph.recompile_reason):
            recompiles.append(
                Recompile(name, graph.compile_id, _explain(graph.recompile_reason, graph))
            )
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
    counters = metrics.get("cache_counters", {})
    return Report(str(dump_dir), inner, graphs, passes, results, sites, breaks, recompiles,
                  counters, pipeline=_pipeline(dump_dir, graphs))  # fmt: skip
