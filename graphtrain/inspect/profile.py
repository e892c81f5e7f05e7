"""`graphtrain inspect --profile`: measured kernel time attributed to compiled regions, FX nodes
and model source lines.

A few forward+backward steps of the compiled model run under torch.profiler. Inductor marks
every call of a generated module with a record "## Call CompiledFxGraph <key> ##"; inside it
are the module's kernels: on CPU the C++ kernels' own records ("graph_<Inductor graph id>_<kernel>", with
inspection_flags' cpp.enable_kernel_profile), on CUDA the Triton kernels the launches put on
the device, and the extern kernels (aten::mm, graphtrain's custom ops...) as operator records.
The generated code kept in the dumps names, per kernel and per extern call, a provenance handle
("# [Provenance debug handles] cpp_fused_mul_0:3"), and Inductor's provenance tracking gives,
per handle, the post-grad FX nodes and their stack traces. Joining the two:

    profiled call --(its kernel names, Inductor's graph id, forward/backward)--> generated module
    kernel or extern call --(handle)--> FX nodes, source lines

A call's kernels are matched by name; its extern calls in the order the module's `call` makes
them, by operator name. A node's source line is its stack trace's innermost frame (the dump's
sources.json). An extern call is the line of its operator's node; a generated kernel that fuses
nodes of several source lines has its time split evenly over those lines. On CPU graphtrain's
custom ops run their torch reference (<op>_ref), so a CPU before/after says nothing of the GPU. Kernel time is CPU time of those records on CPU, device time on CUDA; what
remains of a compiled call (allocations, the wrapper's Python) is not kernel time.

Per fusing pass (one that put a graphtrain kernel into a graph), "after" is the kernel time
of the region where it did, in this profile; "before" is the same regions compiled with only that pass switched off, profiled over
the same steps on the same inputs (api.inspect_config builds that second model).
"""

from __future__ import annotations

import re
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from graphtrain.inspect.report import GeneratedCode, Report
from graphtrain.passes.dump import source_frame

_CALL_PREFIX = "## Call CompiledFxGraph"
_CPU_KERNEL = re.compile(r"^graph_(\d+)_(.+)$")  # Inductor's C++ kernel records
_HANDLE = re.compile(r"\[Provenance debug handles\] (\S+):(\d+)")
_KERNEL_DEF = re.compile(r"^(\w+) = async_compile\.", re.MULTILINE)
# The profiler record of a C++ kernel, in its source: "graph_<compile_fx's graph id>_<kernel>"
_CPU_RECORD = re.compile(r'"graph_(\d+)_\w+"')


@dataclass
class KernelTime:
    graph: str  # e.g. "block-0/backward"
    kernel: str  # generated kernel name, or the extern call ("extern_kernels.mm")
    nodes: list[str]  # post-grad FX nodes it computes
    sources: list[str]  # "file:line in fn" of those nodes
    ms: float  # per step
    calls: int  # per step
    codes: list[str] = field(default_factory=list)  # the sources' code, in the same order


@dataclass
class LineTime:
    source: str  # "file:line in fn", or "(unattributed)"
    code: str  # the source line's text
    ms: float  # per step
    share: float  # of the kernel time in compiled regions
    kernels: list[str]


@dataclass
class PassTime:
    name: str
    region: str
    after_ms: float  # the region's kernel time per step with the pass (this profile)
    before_ms: float | None  # the same region compiled with the pass off; None: not measured
    note: str = ""


@dataclass
class Profile:
    device: str
    steps: int
    step_ms: float  # wall time per forward+backward step
    region_ms: float  # per step, inside compiled regions' calls (kernels + wrapper)
    kernel_ms: float  # per step, measured kernel time inside compiled regions
    attributed_ms: float  # per step, of which matched to a generated kernel or extern call
    graphs: dict[str, float]  # "block-0/forward" -> kernel ms per step
    kernels: list[KernelTime]
    lines: list[LineTime]
    passes: list[PassTime] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def run_steps(
    step: Callable[[], None], *, steps: int, device: torch.device
) -> tuple[torch.profiler.profile, float]:
    """One warm-up call of `step`, then `steps` calls under torch.profiler; (profile, wall ms
    per step)."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    step()
    if device.type == "cuda":
        torch.cuda.synchronize()
    with torch.profiler.profile(activities=activities) as prof:
        start = time.perf_counter()
        for _ in range(steps):
            step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        wall = (time.perf_counter() - start) * 1e3 / steps
    return prof, wall


@dataclass
class _Item:
    """One measured thing inside a compiled call: a generated kernel or an extern call."""

    name: str  # kernel name, or operator name ("mm", "linear_cross_entropy")
    extern: bool
    us: float
    graph_id: str | None = None  # C++ kernels: the Inductor graph they belong to


def _device_us(event: Any) -> float:
    """Device time of the kernels `event` and everything under it launched."""
    own = sum(k.duration for k in getattr(event, "kernels", []))
    return own + sum(_device_us(c) for c in event.cpu_children)


def _op_name(name: str) -> str:
    """ "aten::mm" / "extern_kernels.mm" / "torch.ops.graphtrain.moe_route.default" -> "mm" ..."""
    name = name.rpartition("::")[2]
    parts = [p for p in name.split(".") if p not in ("default", "out", "Tensor")]
    return parts[-1] if parts else name


def _is_triton_launch(event: Any) -> bool:
    """Inductor's record of one Triton kernel launch: under the profiler its launcher opens a
    record named after the kernel ("triton_poi_fused_add_0"), whose device kernel has that name."""
    if event.name.startswith("triton_"):
        return True
    launched = [k.name for c in event.cpu_children for k in getattr(c, "kernels", [])]
    launched += [k.name for k in getattr(event, "kernels", [])]
    return bool(launched) and all(name == event.name for name in launched)


def _items(call: Any, on_device: bool) -> list[_Item]:
    items = []
    for child in sorted(call.cpu_children, key=lambda c: c.time_range.start):
        m = _CPU_KERNEL.match(child.name)
        if m:
            items.append(_Item(m.group(2), False, child.cpu_time_total, m.group(1)))
        elif on_device and child.name.startswith(("cuLaunch", "cudaLaunch")):
            items += [_Item(k.name, False, k.duration) for k in getattr(child, "kernels", [])]
        elif on_device and _is_triton_launch(child):
            # A generated kernel, not an extern call: read as an operator it matched no extern
            # call of the module and its time vanished from the kernel and line tables.
            items.append(_Item(child.name, False, _device_us(child)))
        else:
            us = _device_us(child) if on_device else child.cpu_time_total
            items.append(_Item(_op_name(child.name), True, us))
    items += [_Item(k.name, False, k.duration) for k in getattr(call, "kernels", [])]
    return items


def _stage(call: Any) -> str:
    parent = call.cpu_parent
    while parent is not None:
        if "Backward" in parent.name:
            return "backward"
        parent = parent.cpu_parent
    return "forward"


@dataclass
class _Module:
    """A generated module as the profile join needs it."""

    graph: str  # "block-0/forward"
    code: GeneratedCode
    graph_id: str | None  # in its C++ kernels' profiler records (None: it has none)
    kernels: dict[str, str]  # generated kernel name -> provenance key "name:handle"
    externs: list[tuple[str, str]]  # (operator name, provenance key), in call order

    @classmethod
    def parse(cls, graph: str, code: GeneratedCode) -> _Module:
        defined = set(_KERNEL_DEF.findall(code.code))
        body = code.code[code.code.find("def call(") :]
        kernels, externs = {}, []
        for name, handle in _HANDLE.findall(body):
            key = f"{name}:{handle}"
            if name in defined:
                kernels[name] = key
            else:
                externs.append((_op_name(name), key))
        record = _CPU_RECORD.search(code.code)
        return cls(graph, code, record.group(1) if record else None, kernels, externs)

    def fits(self, items: list[_Item], stage: str) -> int:
        """How well a profiled call's items match this module (-1: cannot be it). Kernels the
        module does not generate (a device kernel launched outside Inductor's records, say)
        leave it a candidate while they are fewer than the kernels it does generate; their
        time stays unattributed, under their names."""
        if self.code.stage != stage:
            return -1
        named = [i for i in items if not i.extern]
        if any(i.graph_id is not None and i.graph_id != self.graph_id for i in named):
            return -1
        foreign = sum(i.name not in self.kernels for i in named)
        if 2 * foreign >= len(named) > 0:
            return -1
        ops = {op for op, _ in self.externs}
        matched = len(named) - foreign + sum(i.name in ops for i in items if i.extern)
        # The module that matches most of its kernels and extern calls (two graphs can both
        # have a "..._0" of the same name), then the one whose call makes as many kernel and
        # extern calls as were seen.
        return 1000 * matched - abs(len(self.kernels) + len(self.externs) - len(items))


def _sources(module: _Module, key: str, extern: bool) -> list[tuple[str, str]]:
    """Distinct (source, code) of what a kernel or extern call computes (module docstring)."""
    info = module.code.kernels.get(key, {})
    nodes = list(info.get("nodes", []))
    if extern and nodes:
        op = _op_name(key.rpartition(":")[0])
        nodes = [n for n in nodes if n.startswith(op)][:1] or nodes[:1]
    found = {}
    for node in nodes:
        if node in module.code.node_sources:
            source, code = module.code.node_sources[node]
            found.setdefault(source, code)
    if not found:  # nodes not in the dump (renamed by Inductor): its own stack traces
        for trace in info.get("stack_traces", []):
            frame = source_frame(trace)
            if frame is not None:
                found.setdefault(*frame)
    return list(found.items())


def _kernel_row(module: _Module, key: str, extern: bool) -> KernelTime:
    """An empty row of the kernel table: a kernel or extern call of `module`, with its nodes
    and source lines."""
    sources = _sources(module, key, extern)
    return KernelTime(
        module.graph,
        key.rpartition(":")[0],
        list(module.code.kernels.get(key, {}).get("nodes", [])),
        [source for source, _ in sources],
        0.0,
        0,
        [code for _, code in sources],
    )


def kernel_us(prof: torch.profiler.profile, device: torch.device) -> tuple[float, float, list]:
    """(kernel us, call us, [(call event, items)]) summed over every compiled call."""
    calls = [e for e in prof.events() if e.name.startswith(_CALL_PREFIX)]
    per_call = [(c, _items(c, device.type == "cuda")) for c in calls]
    kernel = sum(i.us for _, items in per_call for i in items)
    return kernel, sum(c.cpu_time_total for c in calls), per_call


@dataclass
class _Join:
    """What attribute() gathers over the profiled calls, in microseconds."""

    graphs: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    unmatched: dict[str, float] = field(default_factory=lambda: defaultdict(float))  # by name
    lost: dict[str, int] = field(default_factory=lambda: defaultdict(int))  # stage -> calls
    rows: dict[tuple[str, str], KernelTime] = field(default_factory=dict)  # (graph, key) ->
    attributed: float = 0.0

    def add(self, items: list[_Item], module: _Module | None, stage: str, steps: int) -> None:
        """One compiled call's items, matched to `module` (None: to none: all unattributed)."""
        if module is None:
            self.lost[stage] += 1
            self.graphs["(unmatched compiled call)"] += sum(i.us for i in items)
            for item in items:
                self.unmatched[item.name] += item.us
            return
        pending = list(module.externs)
        for item in items:
            self.graphs[module.graph] += item.us
            if item.extern:
                k = next((k for k, (op, _) in enumerate(pending) if op == item.name), None)
                if k is None:  # e.g. an allocation the wrapper made: not a kernel of the graph
                    self.unmatched[item.name] += item.us
                    continue
                key = pending.pop(k)[1]
            elif item.name in module.kernels:
                key = module.kernels[item.name]
            else:  # a kernel the module does not generate (_Module.fits)
                self.unmatched[item.name] += item.us
                continue
            self.attributed += item.us
            row = self.rows.get((module.graph, key))
            if row is None:
                row = self.rows[(module.graph, key)] = _kernel_row(module, key, item.extern)
            row.ms += item.us / 1e3 / steps
            row.calls += 1


def attribute(
    prof: torch.profiler.profile,
    report: Report,
    *,
    steps: int,
    step_ms: float,
    device: torch.device,
) -> Profile:
    """Join the profile with the report's generated code (module docstring)."""
    modules = [
        _Module.parse(f"{g.name}/{code.stage}", code)
        for g in report.graphs
        for code in g.output_code
    ]
    kernel_total, call_total, per_call = kernel_us(prof, device)
    notes = []
    if not per_call:
        notes.append(
            "no compiled-graph calls in the profile: --profile needs the Inductor backend "
            "(aot_eager runs aten ops, which are not attributed)"
        )
    elif not any(m.kernels or m.externs for m in modules):
        notes.append("no provenance handles in the generated code: this torch does not track them")
    join = _Join()
    for call, items in per_call:
        stage = _stage(call)
        scored = [(m.fits(items, stage), k, m) for k, m in enumerate(modules)]
        score, _, module = max(scored, default=(-1, 0, None), key=lambda s: s[:2])
        join.add(items, module if score >= 0 else None, stage, steps)
    for row in join.rows.values():
        row.calls //= steps
    if join.lost:
        notes.append(
            f"{sum(join.lost.values())} of {len(per_call)} compiled calls matched no generated "
            "module ("
            + ", ".join(f"{n} {stage}" for stage, n in sorted(join.lost.items()))
            + "): their time is in the (unattributed) line"
        )
    lines = _by_line(
        list(join.rows.values()),
        kernel_total / 1e3 / steps,
        join.attributed / 1e3 / steps,
        {name: us / 1e3 / steps for name, us in join.unmatched.items()},
    )
    if device.type == "cpu":
        notes.append(
            "CPU: graphtrain's custom ops run their torch reference (<op>_ref) here, not their "
            "GPU kernels; their times and the passes' before/after say nothing of a GPU"
        )
    return Profile(
        device=str(device),
        steps=steps,
        step_ms=step_ms,
        region_ms=call_total / 1e3 / steps,
        kernel_ms=kernel_total / 1e3 / steps,
        attributed_ms=join.attributed / 1e3 / steps,
        graphs={g: us / 1e3 / steps for g, us in sorted(join.graphs.items())},
        kernels=sorted(join.rows.values(), key=lambda r: -r.ms),
        lines=lines,
        notes=notes,
    )


def _by_line(
    rows: list[KernelTime], kernel_ms: float, attributed_ms: float, unmatched: dict[str, float]
) -> list[LineTime]:
    """Per source line; the kernel time matched to none is one "(unattributed)" line that names
    its largest operators or kernels (`unmatched`: name -> ms per step)."""
    lines: dict[str, LineTime] = {}
    for row in rows:
        sources = list(zip(row.sources, row.codes, strict=True))
        sources = sources or [("(no source line: Inductor tracked none)", "")]
        for source, code in sources:
            line = lines.setdefault(source, LineTime(source, code, 0.0, 0.0, []))
            line.ms += row.ms / len(sources)
            line.kernels.append(f"{row.graph}:{row.kernel}")
    if kernel_ms > attributed_ms:
        top = sorted(unmatched.items(), key=lambda kv: -kv[1])[:4]
        named = ", ".join(f"{name} {ms:.3f} ms" for name, ms in top if ms > 0)
        note = "compiled calls' operators matched to no generated kernel" + (
            f": {named}" if named else ""
        )
        lines["(unattributed)"] = LineTime("(unattributed)", note, kernel_ms - attributed_ms, 0, [])
    for line in lines.values():
        line.share = line.ms / kernel_ms if kernel_ms else 0.0
    return sorted(lines.values(), key=lambda line: -line.ms)


def share_weights(source: torch.nn.Module, target: torch.nn.Module) -> torch.nn.Module:
    """Make `target` (the same architecture, built on meta, not yet compiled) hold `source`'s own
    parameter and buffer tensors, persistent or not; returns `target`.

    Why: the pass-off comparison needs a second model with the same weights. Built on the
    device and loaded with a state-dict copy, it held a second set of weights and grads, and
    the next pass's model a third while the previous one was still referenced (about 65 GB at
    `3b`). Shared tensors cost nothing; its backward accumulates into the same .grad, which the
    profile never reads. `source` may be compiled already: Module.compile keeps the names, and
    a torch.compile'd submodule is looked through (its _orig_mod)."""
    for path, module in target.named_modules():
        found: Any = source
        for part in path.split(".") if path else []:
            found = getattr(getattr(found, "_orig_mod", found), part)
        found = getattr(found, "_orig_mod", found)
        if type(found) is not type(module):
            raise ValueError(
                f"share_weights: module {path!r} is a {type(found).__name__} in the source, "
                f"a {type(module).__name__} in the target: not the same architecture"
            )
        for name in module._parameters:
            module._parameters[name] = found._parameters[name]
        for name in module._buffers:
            module._buffers[name] = found._buffers[name]
    return target


def region_ms(profile: Profile, region: str) -> float:
    """Kernel ms per step of every graph of `region` ("block", "head_loss", ...)."""
    return sum(
        ms for g, ms in profile.graphs.items() if g.partition("/")[0].rpartition("-")[0] == region
    )


def fusing_passes(report: Report) -> list[tuple[str, str]]:
    """(pass, region) for every pass that put a graphtrain kernel into a graph of that region:
    the passes whose speed the before/after comparison is about (canonicalize and the like
    only respell a graph for the fusions after them)."""
    found = {}
    for r in report.pass_results:
        if any(op.startswith("graphtrain.") and n > 0 for op, n in r.op_diff.items()):
            found[(r.name, r.graph.partition("/")[0].rpartition("-")[0])] = None
    return list(found)
