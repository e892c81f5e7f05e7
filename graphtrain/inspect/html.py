"""The Report as one self-contained HTML page: inline CSS and JS, no network resource.

Sections: summary; passes, led by the fusions that fired (where: graphs, module, source line;
what they replaced and save; their notes), then the other rewrites, the passes that found
nothing (one line each, collapsed) and every pass on every graph (collapsed); the profile
(with `--profile`: where the step goes by source line, per graph, per kernel, each fusing pass
before/after); graphtrain custom ops, graph breaks, recompiles, compile time per stage,
caches, then every compiled graph with each step's diff, its full graph text and Inductor's generated code.
Built for a laptop screen: one-column diffs and code in panes that scroll (or wrap, with the
header's switch) inside the page width; long things are collapsed until opened.
The search box keeps the lines (and the graphs and steps) that contain the text typed.
"""

from __future__ import annotations

import os
from collections import Counter
from html import escape
from typing import TYPE_CHECKING

from graphtrain.inspect.report import (
    CompiledGraph,
    GeneratedCode,
    Report,
    Step,
    fired,
    measured,
    result_notes,
    unmatched,
)

if TYPE_CHECKING:
    from graphtrain.inspect.profile import Profile

# Generated modules longer than this are cut in the page (the dump keeps them whole).
MAX_CODE_CHARS = 150_000
# Kernel rows shown open in the profile; the rest sit in a collapsed table.
TOP_KERNELS = 25
# Source lines with a smaller share of the kernel time sit in a collapsed table.
MINOR_SHARE = 0.01

_CSS = """
body{font-family:system-ui,sans-serif;margin:0;color:#1b1f24;background:#fafbfc}
header{position:sticky;top:0;background:#24292f;color:#fff;padding:6px 12px;display:flex;
 flex-wrap:wrap;gap:6px 14px;align-items:center;z-index:1;font-size:13px}
header h1{font-size:17px;margin:0}
header a{color:#c9d1d9;text-decoration:none}header a:hover{text-decoration:underline}
#search{flex:1;min-width:160px;max-width:360px;padding:3px 6px;font-size:13px}
main{padding:4px 12px;max-width:100%;box-sizing:border-box}
h2{font-size:16px;border-bottom:1px solid #d0d7de;padding-bottom:3px;margin:16px 0 6px}
table{border-collapse:collapse;font-size:13px;margin:4px 0;max-width:100%}
td,th{border:1px solid #d0d7de;padding:2px 6px;vertical-align:top;text-align:left;
 overflow-wrap:break-word}
th{background:#f0f3f6}td.num{text-align:right;font-variant-numeric:tabular-nums;
 white-space:nowrap}
.ok{color:#1a7f37;font-weight:600}.no{color:#9a6700;font-weight:600}.off{color:#6e7781}
.ok,.no,.off{white-space:nowrap}
.brk{color:#cf222e}
details{margin:3px 0 3px 10px}summary{cursor:pointer}
.graph>summary{font-weight:600;font-size:15px}
pre{font-family:ui-monospace,monospace;font-size:12px;white-space:pre;background:#fff;
 border:1px solid #d0d7de;padding:4px;margin:4px 0;overflow:auto;max-height:70vh;
 max-width:100%;box-sizing:border-box}
body.wrap pre{white-space:pre-wrap;overflow-wrap:anywhere}body.wrap pre .line{width:auto}
.del{background:#ffebe9}.add{background:#dafbe1}.hunk{color:#6e7781;background:#f6f8fa}
.line{display:block;min-height:1em}pre .line{width:max-content;min-width:100%}.hit{background:#fff8c5}.hidden{display:none}
.note{font-size:13px;margin:2px 0}.muted{color:#57606a;font-size:13px}
.bar{display:inline-block;height:9px;background:#0969da;vertical-align:middle;margin-right:4px}
code{overflow-wrap:anywhere}
td.src{white-space:nowrap}td.code{font-family:ui-monospace,monospace;font-size:12px;
 min-width:280px}td.small{font-size:11px;color:#57606a;max-width:420px}
"""

_JS = """
const wrap = document.getElementById('wrap');
wrap.addEventListener('change', () => document.body.classList.toggle('wrap', wrap.checked));
const box = document.getElementById('search');
box.addEventListener('input', () => {
  const q = box.value.toLowerCase();
  document.querySelectorAll('.line').forEach(el => {
    const hit = q && el.textContent.toLowerCase().includes(q);
    el.classList.toggle('hit', !!hit);
    el.classList.toggle('hidden', !!q && !hit);
  });
  document.querySelectorAll('details.searchable').forEach(d => {
    const hit = !q || d.querySelector('.line.hit') !== null;
    d.classList.toggle('hidden', !hit);
    if (q && hit) d.open = true;
  });
});
"""


def _lines(text: str) -> str:
    return "".join(f'<span class="line">{escape(line)}</span>' for line in text.splitlines())


def _diff(diff: str) -> str:
    """A unified diff in one column (fits a laptop screen): removed lines red, added green."""
    rows = []
    for line in diff.splitlines():
        if line.startswith(("---", "+++")):
            continue
        kind = {"@": "hunk", "-": "del", "+": "add"}.get(line[:1], "")
        rows.append(f'<span class="line {kind}">{escape(line)}</span>')
    return f'<pre class="diff">{"".join(rows)}</pre>'


def _step(step: Step, index: int) -> str:
    # A step that changed the graph opens on its diff; the others stay closed.
    opened = " open" if step.diff.strip() else ""
    parts = [f'<details class="searchable"{opened}><summary>{index:02d} {escape(step.label)}']
    if step.op_diff:
        parts.append(
            " &mdash; " + escape(", ".join(f"{n:+d} {op}" for op, n in step.op_diff.items()))
        )
    if step.seconds is not None:
        parts.append(f' <span class="muted">({step.seconds * 1e3:.1f} ms)</span>')
    parts.append("</summary>")
    parts += [f'<div class="note">{escape(n)}</div>' for n in step.notes]
    if step.diff.strip():
        parts.append(_diff(step.diff))
    parts.append(
        f'<details class="searchable"><summary>graph</summary><pre>{_lines(step.text)}</pre>'
        "</details></details>"
    )
    return "".join(parts)


def _table(
    headers: list[str], rows: list[list[str]], cells: tuple[int, ...] | dict[int, str] = ()
) -> str:
    """A table of already escaped cells; `cells`: the numeric columns, or {column: class}."""
    classes = cells if isinstance(cells, dict) else dict.fromkeys(cells, "num")
    head = "".join(f"<th>{escape(h)}</th>" for h in headers)
    body = "".join(
        "<tr>"
        + "".join(
            f'<td class="{classes[k]}">{c}</td>' if k in classes else f"<td>{c}</td>"
            for k, c in enumerate(row)
        )
        + "</tr>"
        for row in rows
    )
    return f"<table><tr>{head}</tr>{body}</table>"


def _short(source: str) -> str:
    """A source location without the folders above the current directory (or all but the
    last two), the full one being the cell's title."""
    path, sep, rest = source.partition(":")
    if not sep:
        return source
    cwd = os.getcwd() + os.sep
    short = path[len(cwd) :] if path.startswith(cwd) else os.sep.join(path.split(os.sep)[-2:])
    return f"{short}:{rest}"


def _source_cell(source: str | None) -> str:
    """A table cell's source location: short, the full one as its title."""
    if not source:
        return "?"
    return f'<span title="{escape(source)}">{escape(_short(source))}</span>'


def _kernel_list(kernels: list[str], shown: int = 4) -> str:
    counts = Counter(kernels)
    names = [f"{k} x{n}" if n > 1 else k for k, n in counts.items()]
    return ", ".join(names[:shown]) + (
        f" ... ({len(names) - shown} more)" if len(names) > shown else ""
    )


def _s(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds:.2f}"


def _ms(ms: float | None) -> str:
    return "-" if ms is None else f"{ms:.3f}"


_SECTIONS = (
    ("passes", "Passes"),
    ("profile", "Profile"),
    ("custom-ops", "Custom ops"),
    ("breaks", "Graph breaks"),
    ("recompiles", "Recompiles"),
    ("compile-time", "Compile time"),
    ("caches", "Caches"),
    ("graphs", "Graphs"),
)


def _header(report: Report) -> str:
    links = " ".join(
        f'<a href="#{key}">{title}</a>'
        for key, title in _SECTIONS
        if key != "profile" or report.profile is not None
    )
    return (
        '<header><h1>graphtrain inspect</h1><input id="search" type="search" '
        f'placeholder="search nodes, ops, lines..."><nav>{links}</nav>'
        '<label><input id="wrap" type="checkbox"> wrap long lines</label></header>'
    )


def _collapsed(summary: str, body: str) -> str:
    """`body` folded under a clickable `summary` (both HTML)."""
    return f"<details><summary>{summary}</summary>{body}</details>"


def _profile(report: Report) -> list[str]:
    prof = report.profile
    share = prof.attributed_ms / prof.kernel_ms if prof.kernel_ms else 0.0
    out = [
        '<h2 id="profile">Profile: where the step goes</h2>',
        f"<p>{prof.steps} forward+backward step(s) on {escape(prof.device)}: "
        f"{prof.step_ms:.2f} ms per step (wall); {prof.region_ms:.2f} ms inside compiled "
        f"regions' calls, of which {prof.kernel_ms:.2f} ms measured kernel time; "
        f"{share:.0%} of that attributed to generated kernels and extern calls.</p>",
    ]
    out += [f'<p class="note brk">{escape(n)}</p>' for n in prof.notes]
    out += _profile_lines(prof)
    out.append("<h3>By graph</h3>")
    rows = [[escape(g), _ms(ms)] for g, ms in prof.graphs.items()]
    out.append(_table(["graph", "kernel ms/step"], rows, cells=(1,)))
    if prof.passes:
        out.append("<h3>Fusing passes: the region's kernel time with and without the pass</h3>")
        rows = [
            [
                escape(t.name),
                escape(t.region),
                _ms(t.before_ms),
                _ms(t.after_ms),
                f"{t.before_ms / t.after_ms:.2f}x" if t.before_ms and t.after_ms else "-",
                escape(t.note),
            ]
            for t in prof.passes
        ]
        headers = ["pass", "region", "before ms/step", "after ms/step", "speed-up", "what"]
        out.append(_table(headers, rows, cells=(2, 3, 4)))
    return out + _profile_kernels(prof)


def _profile_lines(prof: Profile) -> list[str]:
    """The profile by source line: the lines of at least MINOR_SHARE, the rest collapsed."""

    def line_rows(lines: list) -> list[list[str]]:
        return [
            [
                f'<span class="bar" style="width:{max(1, round(line.share * 120))}px"></span>'
                f"{line.share:.1%}",
                _ms(line.ms),
                _source_cell(line.source),
                escape(line.code),
                escape(_kernel_list(line.kernels)),
            ]
            for line in lines
        ]

    cells = {0: "src", 1: "num", 2: "src", 3: "code", 4: "small"}
    headers = ["share", "ms/step", "source", "code", "kernels"]
    major = [line for line in prof.lines if line.share >= MINOR_SHARE]
    minor = [line for line in prof.lines if line.share < MINOR_SHARE]
    out = ["<h3>By source line</h3>", _table(headers, line_rows(major), cells)]
    if minor:
        out.append(
            _collapsed(
                f"{len(minor)} more line(s), each under {MINOR_SHARE:.0%}",
                _table(headers, line_rows(minor), cells),
            )
        )
    return out


def _profile_kernels(prof: Profile) -> list[str]:
    """The profile by kernel: the TOP_KERNELS first, the rest collapsed."""

    def kernel_rows(kernels: list) -> list[list[str]]:
        return [
            [
                escape(k.graph),
                f"<code>{escape(k.kernel)}</code>",
                _ms(k.ms),
                str(k.calls),
                escape(", ".join(k.nodes)),
                escape("; ".join(_short(source) for source in k.sources)),
            ]
            for k in kernels
        ]

    headers = ["graph", "kernel", "ms/step", "calls", "FX nodes", "source lines"]
    cells = {2: "num", 3: "num", 4: "small"}
    out = ["<h3>By kernel</h3>", _table(headers, kernel_rows(prof.kernels[:TOP_KERNELS]), cells)]
    if len(prof.kernels) > TOP_KERNELS:
        rest = prof.kernels[TOP_KERNELS:]
        out.append(
            _collapsed(f"{len(rest)} more kernel(s)", _table(headers, kernel_rows(rest), cells))
        )
    return out


def _compile_sections(report: Report) -> list[str]:
    out = ['<h2 id="recompiles">Recompiles</h2>']
    rows = [[escape(r.graph), escape(r.compile_id), escape(r.reason)] for r in report.recompiles]
    out.append(
        _table(["graph", "compile id", "why (torch's guard failure)"], rows)
        if rows
        else "<p>none</p>"
    )
    out.append('<h2 id="compile-time">Compile time per stage (seconds)</h2>')
    rows = []
    for g in report.graphs:
        t = g.times
        grad = {True: "train", False: "no_grad", None: "?"}[g.grad_enabled]
        if t is None:
            rows.append([escape(g.name), escape(g.compile_id or "?"), grad] + ["-"] * 6)
            continue
        rows.append(
            [
                escape(g.name),
                escape(g.compile_id or "?"),
                grad,
                _s(t.dynamo),
                _s(t.graphtrain_passes),
                _s(t.aot_autograd),
                _s(t.inductor),
                _s(t.inductor_codegen),
                _s(t.total),
            ]
        )
    headers = [
        "graph",
        "compile id",
        "mode",
        "Dynamo",
        "graphtrain passes",
        "AOT autograd",
        "Inductor",
        "of which codegen",
        "total",
    ]
    out.append(_table(headers, rows, cells=(3, 4, 5, 6, 7, 8)))
    out.append(
        "<p class=\"muted\">As torch's compile metrics report them: Dynamo = the frame's compile "
        "minus the backend; AOT autograd without the Inductor time inside it; the backward's "
        "compile (at the first backward) counted in AOT autograd and Inductor. Each pass's own "
        "time is beside it in the graphs below.</p>"
    )
    out.append('<h2 id="caches">Caches</h2>')
    rows = [[escape(k), str(v)] for k, v in report.cache_counters.items()]
    rows += [
        [escape(f"{g.name}: {k.removesuffix('_count')}"), str(v)]
        for g in report.graphs
        for k, v in g.cache.items()
        if v
    ]
    out.append(_table(["counter", "count"], rows, cells=(1,)) if rows else "<p>none</p>")
    out.append(
        '<p class="muted">While graphs are dumped, the post-grad hook gives Inductor no cache '
        "key (graphtrain.compile), so the FX graph cache is bypassed and every graph is "
        "compiled and dumped; a training run without dumps hits it.</p>"
    )
    return out


def _generated_code(code: GeneratedCode, index: int) -> str:
    text = code.code
    cut = ""
    if len(text) > MAX_CODE_CHARS:
        cut = (
            f'<p class="muted">cut after {MAX_CODE_CHARS} of {len(text)} characters: the dump '
            f"(graphs/&lt;graph&gt;/{escape(code.stage)}/output_code_{index}.py) has it all</p>"
        )
        text = text[:MAX_CODE_CHARS]
    kernels = len({k.rpartition(":")[0] for k in code.kernels})
    tracked = f"{kernels} kernel(s) tracked" if kernels else "no kernel provenance recorded"
    return (
        f'<details class="searchable"><summary>{escape(code.stage)}: Inductor\'s generated '
        f"module ({len(code.code.splitlines())} lines, {tracked}) "
        f'<span class="muted">{escape(code.path)}</span></summary>{cut}'
        f"<pre>{_lines(text)}</pre></details>"
    )


def _graph(report: Report, g: CompiledGraph) -> list[str]:
    out = [
        f'<details class="graph searchable" id="{escape(g.name)}" open><summary>{escape(g.name)}'
        f" (region {escape(g.region)})</summary>"
    ]
    if g.grad_enabled is False:
        out.append('<p class="note">compiled under no_grad: forward only, no backward graph</p>')
    counts: dict[str, int] = {}
    for code in g.output_code:
        out.append(_generated_code(code, counts.get(code.stage, 0)))
        counts[code.stage] = counts.get(code.stage, 0) + 1
    if not g.output_code and report.inner == "aot_eager":
        out.append(
            '<p class="note">No generated code: aot_eager runs the aten graphs as they are.</p>'
        )
    for stage in g.stages:
        out.append(f'<details class="searchable" open><summary>{escape(stage.stage)}</summary>')
        out += [_step(step, i) for i, step in enumerate(stage.steps)]
        out.append("</details>")
    out.append("</details>")
    return out


def _diff_cell(op_diff: dict[str, int]) -> str:
    return escape(", ".join(f"{n:+d} {op}" for op, n in op_diff.items()) or "-")


def _passes(report: Report) -> list[str]:
    """The page's lead: the fusions that fired, where and what they save; then the other
    rewrites; the passes that found nothing summarised and collapsed; every pass on every
    graph last, collapsed."""
    done = fired(report)
    out = ['<h2 id="passes">Passes: what fired</h2>', _fusions(report, done)]
    rewrites = [f for f in done if not f.fusion]
    if rewrites:
        rows = [
            [
                escape(f.name),
                escape(", ".join(f.graphs)),
                escape(f.replaced()),
                "; ".join(map(escape, f.notes)),
            ]
            for f in rewrites
        ]
        out.append(
            _collapsed(
                f"Other rewrites: {escape(', '.join(dict.fromkeys(f.name for f in rewrites)))}",
                _table(["pass", "graphs", "replaced", "notes"], rows, {3: "small"}),
            )
        )
    nothing = unmatched(report)
    if nothing:
        rows = [
            [
                escape(u.name),
                f"{len(u.graphs)}: {escape(', '.join(u.graphs))}",
                escape("; ".join(u.notes)),
            ]
            for u in nothing
        ]
        out.append(
            _collapsed(
                f"{len(nothing)} pass(es) found nothing to rewrite: "
                f"{escape(', '.join(u.name for u in nothing))}",
                _table(["pass", "graphs", "why"], rows),
            )
        )
    for p in report.passes:
        if not p.enabled:
            out.append(
                f'<p class="note"><span class="off">{escape(p.name)} off</span>: '
                f"{escape(p.reason)}</p>"
            )
    return [*out, _every_pass(report)]


def _fusions(report: Report, done: list) -> str:
    """The table of the fusions that fired: graphs, module and source, what they replaced and
    what they save."""
    rows = []
    for f in (f for f in done if f.fusion):
        where = "<br>".join(
            f"{escape(s.module_path or '(root)')}, {_source_cell(s.source)}" for s in f.sites
        )
        saves = [escape(f.saves)] if f.saves else []
        saves += [f"<b>{escape(m)}</b>" for m in measured(report, f.name)]
        rows.append(
            [
                f'<span class="ok">{escape(f.name)}</span>',
                escape(", ".join(f.graphs)) + (f"<br>{where}" if where else ""),
                escape(f.replaced()),
                "<br>".join(saves) or "-",
                "<br>".join(escape(n) for n in f.notes),
            ]
        )
    headers = ["fusion", "where (graphs; module, source)", "replaced", "saves", "notes"]
    return (
        _table(headers, rows, {4: "small"}) if rows else "<p>No fusion fired in these graphs.</p>"
    )


def _every_pass(report: Report) -> str:
    """Every pass on every graph (and the passes that are off), collapsed."""
    rows = []
    for p in report.passes:
        if not p.enabled:
            rows.append(
                [escape(p.name), p.stage, "-", '<span class="off">off</span>', escape(p.reason)]
            )
        for r in (r for r in report.pass_results if r.name == p.name):
            status = (
                '<span class="ok">matched</span>'
                if r.matched
                else '<span class="no">no match</span>'
            )
            notes = "; ".join(result_notes(r))
            rows.append(
                [escape(p.name), escape(r.graph), _diff_cell(r.op_diff), status, escape(notes)]
            )
    return _collapsed(
        f"Every pass on every graph ({len(rows)} rows)",
        _table(["pass", "graph", "op diff", "result", "notes"], rows),
    )


def render_html(report: Report) -> str:
    out = [
        '<!DOCTYPE html><html lang="en"><head><meta charset="utf-8">',
        '<meta name="viewport" content="width=device-width, initial-scale=1">',
        "<title>graphtrain inspect</title>",
        f"<style>{_CSS}</style></head><body>",
        _header(report),
        "<main>",
        f"<p>{len(report.graphs)} compiled graph(s) in regions "
        f"<b>{escape(', '.join(report.regions) or '-')}</b>; inner backend "
        f"{escape(report.inner or 'unknown')}; dumps in <code>{escape(report.dump_dir)}</code></p>",
    ]
    if report.pipeline:
        out.append('<h2 id="pipeline">Pipeline stages</h2>')
        rows = [
            [str(s["stage"]), str(s["pp_rank"]), escape(s["holds"]),
             escape(", ".join(s["graphs"]) or "(eager)")]
            for s in report.pipeline
        ]  # fmt: skip
        out.append(_table(["stage", "pp rank", "holds", "graphs"], rows))
    out += _passes(report)
    if report.profile is not None:
        out += _profile(report)
    out.append('<h2 id="custom-ops">graphtrain custom ops</h2>')
    rows = [
        [
            escape(s.op),
            escape(s.graph),
            escape(s.module_path or "(root)"),
            _source_cell(s.source),
            escape(", ".join(f"{k}={v!r}" for k, v in s.options.items())),
        ]
        for s in report.custom_op_sites
    ]
    out.append(
        _table(["op", "graph", "module", "source", "options"], rows) if rows else "<p>none</p>"
    )
    out.append('<h2 id="breaks">Graph breaks</h2>')
    rows = [
        [escape(b.graph), _source_cell(b.source), f'<span class="brk">{escape(b.reason)}</span>']
        for b in report.graph_breaks
    ]
    out.append(_table(["graph", "source", "reason"], rows) if rows else "<p>none</p>")
    out += _compile_sections(report)
    out.append('<h2 id="graphs">Compiled graphs</h2>')
    for g in report.graphs:
        out += _graph(report, g)
    out.append(f"</main><script>{_JS}</script></body></html>")
    return "\n".join(out) + "\n"
