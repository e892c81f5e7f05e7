"""The Report as one self-contained HTML page: inline CSS and JS, no network resource.

Sections: summary, passes (result per graph, notes, op-count diff), graphtrain custom ops,
graph breaks, then every compiled graph with each step's side-by-side diff and full graph text.
The search box keeps the lines (and the graphs and steps) that contain the text typed.
"""

from __future__ import annotations

from html import escape

from graphtrain.inspect.report import Report, Step

_CSS = """
body{font-family:system-ui,sans-serif;margin:0;color:#1b1f24;background:#fafbfc}
header{position:sticky;top:0;background:#24292f;color:#fff;padding:8px 16px;display:flex;
 gap:16px;align-items:center;z-index:1}
header h1{font-size:18px;margin:0}
#search{flex:1;max-width:480px;padding:4px 8px;font-size:14px}
main{padding:8px 16px}
h2{font-size:16px;border-bottom:1px solid #d0d7de;padding-bottom:4px}
table{border-collapse:collapse;font-size:13px;margin:4px 0}
td,th{border:1px solid #d0d7de;padding:2px 6px;vertical-align:top;text-align:left}
th{background:#f0f3f6}
.ok{color:#1a7f37;font-weight:600}.no{color:#9a6700;font-weight:600}.off{color:#6e7781}
.brk{color:#cf222e}
details{margin:4px 0 4px 12px}summary{cursor:pointer}
.graph>summary{font-weight:600;font-size:15px}
pre,.diff td{font-family:ui-monospace,monospace;font-size:12px;white-space:pre}
pre{background:#fff;border:1px solid #d0d7de;padding:4px;overflow:auto;max-height:480px}
.diff{width:100%;table-layout:fixed}
.diff td{width:50%;white-space:pre-wrap;word-break:break-all;border:none;padding:0 4px}
.del{background:#ffebe9}.add{background:#dafbe1}.hunk{color:#6e7781;background:#f6f8fa}
.line{display:block}.hit{background:#fff8c5}.hidden{display:none}
.note{font-size:13px;margin:2px 0}
"""

_JS = """
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


def _side_by_side(diff: str) -> str:
    """A unified diff as two columns: removed lines left, added lines right, context both."""
    rows, left, right = [], [], []

    def flush() -> None:
        for i in range(max(len(left), len(right))):
            a = left[i] if i < len(left) else ""
            b = right[i] if i < len(right) else ""
            rows.append(
                f'<tr class="line"><td class="{"del" if a else ""}">{escape(a)}</td>'
                f'<td class="{"add" if b else ""}">{escape(b)}</td></tr>'
            )
        left.clear()
        right.clear()

    for line in diff.splitlines():
        if line.startswith(("---", "+++")):
            continue
        if line.startswith("@@"):
            flush()
            rows.append(f'<tr class="line hunk"><td colspan="2">{escape(line)}</td></tr>')
        elif line.startswith("-"):
            left.append(line[1:])
        elif line.startswith("+"):
            right.append(line[1:])
        else:
            flush()
            rows.append(
                f'<tr class="line"><td>{escape(line[1:])}</td><td>{escape(line[1:])}</td></tr>'
            )
    flush()
    cols = '<colgroup><col style="width:50%"><col style="width:50%"></colgroup>'
    return f'<table class="diff">{cols}{"".join(rows)}</table>'


def _step(step: Step, index: int) -> str:
    # A step that changed the graph opens on its diff; the others stay closed.
    opened = " open" if step.diff.strip() else ""
    parts = [f'<details class="searchable"{opened}><summary>{index:02d} {escape(step.label)}']
    if step.op_diff:
        parts.append(
            " &mdash; " + escape(", ".join(f"{n:+d} {op}" for op, n in step.op_diff.items()))
        )
    parts.append("</summary>")
    parts += [f'<div class="note">{escape(n)}</div>' for n in step.notes]
    if step.diff.strip():
        parts.append(_side_by_side(step.diff))
    parts.append(
        f'<details class="searchable"><summary>graph</summary><pre>{_lines(step.text)}</pre>'
        "</details></details>"
    )
    return "".join(parts)


def _table(headers: list[str], rows: list[list[str]]) -> str:
    head = "".join(f"<th>{escape(h)}</th>" for h in headers)
    body = "".join("<tr>" + "".join(f"<td>{c}</td>" for c in row) + "</tr>" for row in rows)
    return f"<table><tr>{head}</tr>{body}</table>"


def render_html(report: Report) -> str:
    out = [
        '<!DOCTYPE html><html lang="en"><head><meta charset="utf-8">',
        "<title>graphtrain inspect</title>",
        f"<style>{_CSS}</style></head><body>",
        '<header><h1>graphtrain inspect</h1><input id="search" type="search" '
        'placeholder="search nodes, ops, lines..."></header><main>',
        f"<p>{len(report.graphs)} compiled graph(s) in regions "
        f"<b>{escape(', '.join(report.regions) or '-')}</b>; inner backend "
        f"{escape(report.inner or 'unknown')}; dumps in <code>{escape(report.dump_dir)}</code></p>",
        "<h2>Passes</h2>",
    ]
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
            diff = ", ".join(f"{n:+d} {op}" for op, n in r.op_diff.items()) or "-"
            rows.append(
                [escape(p.name), escape(r.graph), escape(diff), status, escape("; ".join(r.notes))]
            )
    out.append(_table(["pass", "graph", "op diff", "result", "notes"], rows))
    out.append("<h2>graphtrain custom ops</h2>")
    rows = [
        [
            escape(s.op),
            escape(s.graph),
            escape(s.module_path or "(root)"),
            escape(s.source or "?"),
            escape(", ".join(f"{k}={v!r}" for k, v in s.options.items())),
        ]
        for s in report.custom_op_sites
    ]
    out.append(
        _table(["op", "graph", "module", "source", "options"], rows) if rows else "<p>none</p>"
    )
    out.append("<h2>Graph breaks</h2>")
    rows = [
        [escape(b.graph), escape(b.source or "?"), f'<span class="brk">{escape(b.reason)}</span>']
        for b in report.graph_breaks
    ]
    out.append(_table(["graph", "source", "reason"], rows) if rows else "<p>none</p>")
    out.append("<h2>Compiled graphs</h2>")
    for g in report.graphs:
        out.append(
            f'<details class="graph searchable" id="{escape(g.name)}" open><summary>{escape(g.name)}'
            f" (region {escape(g.region)})</summary>"
        )
        if g.output_code:
            out.append(
                "<p>Inductor output code: "
                + ", ".join(f"<code>{escape(f)}</code>" for f in g.output_code)
                + "</p>"
            )
        elif report.inner == "aot_eager":
            out.append("<p>No generated code: aot_eager runs the aten graphs as they are.</p>")
        for stage in g.stages:
            out.append(f'<details class="searchable" open><summary>{escape(stage.stage)}</summary>')
            out += [_step(step, i) for i, step in enumerate(stage.steps)]
            out.append("</details>")
        out.append("</details>")
    out.append(f"</main><script>{_JS}</script></body></html>")
    return "\n".join(out) + "\n"
