"""graphtrain inspect: the Report on the debug GPT, pass switches, graph breaks, HTML, CLI, trace;
and on the MoE debug model: its own block graphs and the fused router."""

import json
import re
import shutil
import subprocess
from html.parser import HTMLParser
from pathlib import Path

import pytest
import torch

from graphtrain.cli import main as cli_main
from graphtrain.config import load_config
from graphtrain.inspect import inspect, inspect_config, load_report, write_report
from graphtrain.inspect.terminal import render_summary
from graphtrain.passes import all_passes

FUSED = "graphtrain.linear_cross_entropy.default"
GPT_SOURCE = str(Path(__file__).resolve().parents[2] / "models" / "gpt.py")


def _config(*args):
    return load_config(["--preset", "debug", "--training.micro_batch_size=2", *args])


@pytest.fixture(scope="module")
def trace_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("trace")


@pytest.fixture(scope="module")
def report(tmp_path_factory, trace_dir):
    return inspect_config(
        _config(),
        device="cpu",
        inner="aot_eager",
        dump_dir=tmp_path_factory.mktemp("dumps"),
        trace_dir=trace_dir,
    )


@pytest.fixture(scope="module")
def report_off():
    return inspect_config(
        _config("--compile.passes=-fuse_linear_cross_entropy"), device="cpu", inner="aot_eager"
    )


def _head_loss_line() -> int:
    lines = Path(GPT_SOURCE).read_text().splitlines()
    return next(i for i, line in enumerate(lines, 1) if "F.cross_entropy(" in line)


def test_regions_and_aot_graphs(report):
    assert report.regions == ["block", "head_loss"]
    # Identical blocks share one compiled graph: one per region.
    assert [g.name for g in report.graphs] == ["block-0", "head_loss-0"]
    for g in report.graphs:
        assert [s.stage for s in g.stages] == ["pre_grad", "forward", "backward"]
        assert g.compile_reason["graph_break"] is False
        assert g.output_code == []  # aot_eager generates no code
    assert report.graph_breaks == []


def test_fused_op_once_with_location_and_options(report):
    assert report.custom_ops == {FUSED: 1}
    (site,) = report.custom_op_sites
    assert site.graph == "head_loss-0"
    assert site.module_path == "output"
    assert site.source == f"{GPT_SOURCE}:{_head_loss_line()} in head_loss"
    assert site.options == {
        "ignore_index": -100,
        "label_smoothing": 0.0,
        "reduction": "mean",
        # auto: the fast mode, its fp32 weight gradient accumulated in place (the budget of a
        # CPU run holds it)
        "mode": "fast",
        "fp32_accumulator": True,
    }


def test_moe_model_shows_its_blocks_and_the_fused_router():
    """moe-debug: a dense first block and MoE blocks (two graphs in the block region), the
    router, the token permutation and the combine fused once each in the MoE block graph, the
    head fused as for the dense model."""
    report = inspect_config(
        load_config(["--preset", "moe-debug", "--training.micro_batch_size=2"]),
        device="cpu",
        inner="aot_eager",
    )
    assert [g.name for g in report.graphs] == ["block-0", "block-1", "head_loss-0"]
    assert report.custom_ops == {
        FUSED: 1,
        "graphtrain.moe_route.default": 1,
        "graphtrain.moe_permute.default": 1,
        "graphtrain.moe_unpermute.default": 1,
    }
    (router,) = [
        s
        for s in report.custom_op_sites
        if s.graph == "block-1" and s.op == "graphtrain.moe_route.default"
    ]
    assert router.module_path.endswith("moe.router")
    assert report.graph_breaks == []


def test_pass_results_in_order_with_reasons(report):
    results = {r.graph: r for r in report.pass_results if r.name == "fuse_linear_cross_entropy"}
    head, block = results["head_loss-0"], results["block-0"]
    assert head.matched and head.op_diff[FUSED] == 1
    # The cross-entropy mode and why it was chosen (compile.lce_mode, default auto).
    assert "mode='fast'" in head.notes[0] and "auto: fast mode's" in head.notes[0], head.notes
    assert head.op_diff["torch.nn.functional.cross_entropy"] == -1
    assert "cross_entropy" in head.before and FUSED.rsplit(".", 1)[0] in head.after
    assert head.diff.startswith("---")
    assert not block.matched
    assert block.notes == ["no cross_entropy in this graph: nothing to fuse"]
    assert [p.name for p in report.passes] == [p.name for p in all_passes()]


def test_pass_switched_off(report_off):
    assert report_off.custom_ops == {}
    assert report_off.regions == ["block", "head_loss"]
    info = next(p for p in report_off.passes if p.name == "fuse_linear_cross_entropy")
    assert not info.enabled
    assert report_off.pass_notes("fuse_linear_cross_entropy") == [
        "switched off: compile.passes has '-fuse_linear_cross_entropy'"
    ]
    assert "switched off" in render_summary(report_off)


def test_pass_refusal_reason_is_reported():
    head = torch.nn.Linear(8, 16, bias=False)

    def loss_and_logits(h, y):  # the logits are returned too: nothing to save
        logits = head(h)
        return torch.nn.functional.cross_entropy(logits, y), logits

    r = inspect(loss_and_logits, torch.randn(4, 8), torch.randint(0, 16, (4,)))
    assert r.custom_ops == {}
    (note,) = r.pass_notes("fuse_linear_cross_entropy")
    assert "also used by the graph output" in note


def planted_break(x):
    y = x.sin()
    if y.sum().item() > 0:  # data-dependent branch: Dynamo breaks the graph here
        return y.cos()
    return y.tan()


def test_graph_break_with_source_line():
    r = inspect(planted_break, torch.randn(8, requires_grad=True))
    (brk,) = r.graph_breaks
    line = planted_break.__code__.co_firstlineno + 2
    assert brk.source == f"{__file__}:{line} in planted_break"
    assert "item" in brk.reason.lower()
    assert len(r.graphs) >= 2  # the graph before the break and the one after it


class _PageParser(HTMLParser):
    def __init__(self):
        super().__init__()
        self.urls, self.ids, self.tags = [], set(), []

    def handle_starttag(self, tag, attrs):
        self.tags.append(tag)
        for name, value in attrs:
            if name in ("src", "href", "action", "data") and value:
                self.urls.append(value)
            if name == "id":
                self.ids.add(value)


def test_html_is_self_contained(report, tmp_path):
    page = write_report(report, tmp_path)
    text = page.read_text()
    parser = _PageParser()
    parser.feed(text)
    parser.close()
    assert not [u for u in parser.urls if re.match(r"(https?:)?//", u)]
    assert not re.search(r"url\(|@import", text)  # no CSS-loaded resources either
    assert {"block-0", "head_loss-0", "search"} <= parser.ids
    for p in report.passes:
        assert p.name in text
    assert "script" in parser.tags and "style" in parser.tags
    assert json.loads((tmp_path / "report.json").read_text())["custom_ops"] == {FUSED: 1}
    assert "head_loss-0" in (tmp_path / "summary.txt").read_text()


def test_write_report_from_trainer_dumps(report, tmp_path):
    # What `graphtrain train --compile.dump_graphs` leaves in run_dir/graphs is a dump dir.
    again = load_report(report.dump_dir)
    assert again.custom_ops == report.custom_ops and again.inner is None
    assert write_report(report.dump_dir, tmp_path / "out").is_file()


def test_structured_trace_is_tlparse_format(report, trace_dir):
    (log,) = trace_dir.glob("dedicated_log_torch_trace_*.log")
    header = re.compile(r"^[VIWEC]\d{4} \d\d:\d\d:\d\d\.\d{6} +\d+ \S+:\d+\] (\{.*\})$")
    kinds = set()
    for line in log.read_text().splitlines():
        if line.startswith("\t"):  # payload lines follow a record with has_payload
            continue
        m = header.match(line)
        assert m, line
        kinds |= set(json.loads(m.group(1)))
    assert {"dynamo_start", "dynamo_output_graph", "compilation_metrics", "str"} <= kinds
    assert {"aot_forward_graph", "aot_backward_graph"} <= kinds


def test_cli_smoke(tmp_path, capsys):
    out = tmp_path / "inspect"
    code = cli_main(
        [
            "inspect",
            "--preset",
            "debug",
            "--out",
            str(out),
            "--backend",
            "aot_eager",
            "--device",
            "cpu",
            "--training.micro_batch_size=2",
        ]
    )
    assert code == 0
    printed = capsys.readouterr().out
    assert "head_loss-0" in printed and FUSED in printed and "\033[" not in printed
    assert (out / "report.html").is_file() and (out / "graphs" / "head_loss-0").is_dir()
    assert cli_main(["inspect", "--device", "tpu", "--preset", "debug"]) == 2


@pytest.mark.skipif(shutil.which("chromium") is None, reason="chromium is not installed")
def test_html_renders_in_headless_chromium(report, tmp_path):
    page = write_report(report, tmp_path)
    png = tmp_path / "report.png"
    subprocess.run(
        [
            "chromium",
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            "--no-first-run",
            f"--user-data-dir={tmp_path / 'profile'}",
            f"--screenshot={png}",
            "--window-size=1400,1000",
            page.as_uri(),
        ],
        check=True,
        capture_output=True,
        timeout=120,
    )
    assert png.stat().st_size > 10_000


def test_inductor_output_code_per_graph():
    def mlp(x, w):
        return torch.relu(x @ w).sum()

    r = inspect(mlp, torch.randn(4, 8), torch.randn(8, 3, requires_grad=True), inner="inductor")
    (graph,) = r.graphs
    assert len(graph.output_code) == 2  # forward and backward modules
    for path in graph.output_code:
        assert Path(path).is_file() and "def call(" in Path(path).read_text()
    assert "generated code" in render_summary(r) and graph.output_code[0] in render_summary(r)
