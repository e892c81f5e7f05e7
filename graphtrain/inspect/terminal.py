"""The terminal summary of a Report: plain-text tables, ANSI colours only on a terminal.

It opens on what fired: each fusion with its graphs, module and source line, what it replaced,
what it saves (measured, with --profile) and its notes; then the other rewrites, one line per
pass that changed nothing (with its reason, or what it needs to fire) and the passes switched
off; then compiled graphs, custom ops, graph breaks, recompiles and the profile. Every pass on
every graph is in the page.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Sequence

from graphtrain.inspect.report import Report, fired, measured, unmatched

_COLOURS = {"green": "32", "yellow": "33", "red": "31", "bold": "1", "dim": "2"}


def use_color(stream=None) -> bool:
    """Colours when writing to a terminal and NO_COLOR (https://no-color.org) is unset."""
    stream = stream or sys.stdout
    return stream.isatty() and "NO_COLOR" not in os.environ


def _table(headers: Sequence[str], rows: list[Sequence[str]]) -> list[str]:
    widths = [max(len(str(c)) for c in col) for col in zip(headers, *rows, strict=True)]

    def line(cells: Sequence[str]) -> str:
        return "  ".join(str(c).ljust(w) for c, w in zip(cells, widths, strict=True)).rstrip()

    return [line(headers), line(["-" * w for w in widths]), *(line(r) for r in rows)]


def _diff_text(op_diff: dict[str, int]) -> str:
    return ", ".join(f"{n:+d} {op}" for op, n in op_diff.items()) or "-"


def _passes(report: Report, paint: Callable[[str, str], str]) -> list[str]:
    """What fired, where and what it saves first; the passes that found nothing one line each."""
    done = fired(report)
    out = ["", paint("Fusions that fired", "bold")]
    fusions = [f for f in done if f.fusion]
    for f in fusions:
        out.append(f"{paint(f.name, 'green')} in {', '.join(f.graphs)}")
        for site in f.sites:
            out.append(f"  at {site.module_path or '(root)'}, {site.source or '?'}")
        out.append(f"  replaced {f.replaced(shown=6)}")  # all of it in the page
        if f.saves:
            out.append(f"  saves: {f.saves}")
        out += [f"  {m}" for m in measured(report, f.name)]  # on CPU, the ops' torch reference
        out += [f"  note: {n}" for n in f.notes]
    if not fusions:
        out.append("(none)")
    rewrites = [f for f in done if not f.fusion]
    if rewrites:
        out += ["", paint("Other rewrites", "bold")]
        out += [f"{f.name} in {', '.join(f.graphs)}: {f.replaced(shown=4)}" for f in rewrites]
    nothing = unmatched(report)
    off = [p for p in report.passes if not p.enabled]
    if nothing or off:
        out += ["", paint("Passes that changed nothing", "bold")]
        for u in nothing:
            count = f"{len(u.graphs)} graph(s)"
            out.append(f"{u.name} ({paint('no match', 'yellow')}, {count}): {'; '.join(u.notes)}")
        out += [f"{p.name} ({paint('off', 'dim')}): {p.reason}" for p in off]
        out.append("(every pass on every graph: report.html, section Passes)")
    return out


def render_summary(report: Report, *, color: bool = False) -> str:
    def paint(text: str, colour: str) -> str:
        return f"\033[{_COLOURS[colour]}m{text}\033[0m" if color else text

    out = [paint("graphtrain inspect", "bold")]
    out.append(
        f"{len(report.graphs)} compiled graph(s) in {len(report.regions)} region(s): "
        f"{', '.join(report.regions) or '-'}; inner backend: {report.inner or 'unknown'}"
    )
    if report.pipeline:
        out += [
            "",
            paint("Pipeline stages (each pp rank's regions, compiled as that rank does)", "bold"),
        ]
        rows = [
            [str(s["stage"]), str(s["pp_rank"]), s["holds"], ", ".join(s["graphs"]) or "(eager)"]
            for s in report.pipeline
        ]
        out += _table(["stage", "pp rank", "holds", "graphs"], rows)
    out += _passes(report, paint)
    out.append("")
    out.append(paint("Compiled graphs", "bold"))
    rows = []
    for g in report.graphs:
        if g.grad_enabled is False:
            g_name = f"{g.name} (no_grad)"
        else:
            g_name = g.name
        pre = g.stage("pre_grad")
        ops = sum(pre.steps[-1].op_counts.values()) if pre else 0
        aot = ", ".join(s.stage for s in g.stages if s.stage != "pre_grad") or "-"
        if report.inner == "inductor":
            kernels = sum(len({k.rpartition(":")[0] for k in c.kernels}) for c in g.output_code)
            code = f"{len(g.output_code)} module(s), {kernels} kernel(s) (in the page)"
        elif report.inner == "aot_eager":
            code = "none (aot_eager runs the aten graphs)"
        else:
            code = "-"
        total = "-" if g.times is None or g.times.total is None else f"{g.times.total:.1f}"
        rows.append([g_name, str(ops), aot, total, code])
    out += _table(["graph", "ops", "AOT graphs", "compile s", "generated code"], rows)

    out.append("")
    out.append(paint("graphtrain custom ops", "bold"))
    rows = [
        [
            s.op,
            s.graph,
            s.module_path or "(root)",
            s.source or "?",
            ", ".join(f"{k}={v!r}" for k, v in s.options.items()),
        ]
        for s in report.custom_op_sites
    ]
    out += _table(["op", "graph", "module", "source", "options"], rows) if rows else ["(none)"]

    out.append("")
    out.append(paint("Graph breaks", "bold"))
    if report.graph_breaks:
        rows = [[b.graph, b.source or "?", b.reason] for b in report.graph_breaks]
        out += [paint(line, "red") for line in _table(["graph", "source", "reason"], rows)]
    else:
        out.append("(none)")

    out.append("")
    out.append(paint("Recompiles", "bold"))
    rows = [[r.graph, r.compile_id, r.reason] for r in report.recompiles]
    out += _table(["graph", "compile id", "why"], rows) if rows else ["(none)"]
    if report.profile is not None:
        out += _profile(report)
    return "\n".join(out) + "\n"


def _profile(report: Report, top: int = 12) -> list[str]:
    prof = report.profile
    share = prof.attributed_ms / prof.kernel_ms if prof.kernel_ms else 0.0
    out = [
        "",
        "Profile: where the step goes (by source line)",
        f"{prof.step_ms:.2f} ms/step wall, {prof.kernel_ms:.2f} ms kernel time in compiled "
        f"regions, {share:.0%} attributed",
        *prof.notes,
    ]
    rows = [[f"{line.share:.1%}", f"{line.ms:.3f}", line.source, line.code] for line in prof.lines]
    out += _table(["share", "ms/step", "source", "code"], rows[:top])
    if len(rows) > top:
        out.append(f"... {len(rows) - top} more lines in the page")
    if prof.passes:
        out.append("")
        rows = [
            [
                t.name,
                t.region,
                "-" if t.before_ms is None else f"{t.before_ms:.3f}",
                f"{t.after_ms:.3f}",
            ]
            for t in prof.passes
        ]
        out += _table(["pass", "region", "before ms/step", "after ms/step"], rows)
    return out
