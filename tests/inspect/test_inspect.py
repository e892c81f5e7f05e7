"""graphtrain inspect: the Report on the debug GPT, pass switches, graph breaks, recompiles,
compile times, HTML, CLI, trace; on the MoE debug model: its own block graphs and the fused
router; with Inductor: the generated code in the page and the profile's attribution."""

import dataclasses
import json
import re
import shutil
import subprocess
from html.parser import HTMLParser
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from graphtrain.cli import main as cli_main
from graphtrain.config import load_config, to_toml
from graphtrain.inspect import inspect, inspect_config, load_report, write_report
from graphtrain.inspect.cli import default_out_dir
from graphtrain.inspect.html import render_html
from graphtrain.inspect.profile import PassTime
from graphtrain.inspect.report import PASS_NEEDS, fired, measured, unmatched
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
        _config("--compile.passes=-fuse_linear_cross_entropy"),
        device="cpu",
        inner="aot_eager",
        validation=False,
    )


def _head_loss_line() -> int:
    lines = Path(GPT_SOURCE).read_text().splitlines()
    return next(i for i, line in enumerate(lines, 1) if "F.cross_entropy(" in line)


def test_regions_and_aot_graphs(report):
    assert report.regions == ["block", "head_loss"]
    # Identical blocks share one compiled graph per region for training (-0), and the
    # validation forward under no_grad compiles each region again, forward only (-1).
    assert [g.name for g in report.graphs] == ["block-0", "block-1", "head_loss-0", "head_loss-1"]
    for g in report.graphs:
        training = g.name.endswith("-0")
        stages = ["pre_grad", "forward", "backward"] if training else ["pre_grad", "forward"]
        assert [s.stage for s in g.stages] == stages
        assert g.grad_enabled is training
        assert g.compile_reason["graph_break"] is False
        assert g.output_code == []  # aot_eager generates no code
    assert report.graph_breaks == []


def test_recompile_reason_for_validation(report, tmp_path):
    """The forward-only graphs of validation are explained: Dynamo's guard failure (grad mode)
    and what it means, in the Report, the summary and the page."""
    assert [(r.graph, r.compile_id) for r in report.recompiles] == [
        ("block-1", "0/1"),
        ("head_loss-1", "1/1"),
    ]
    for r in report.recompiles:
        assert "GLOBAL_STATE changed: grad_mode" in r.reason, r.reason
        assert "torch.no_grad()" in r.reason and "forward-only" in r.reason
    assert "GLOBAL_STATE changed: grad_mode" in render_summary(report)
    page = write_report(report, tmp_path).read_text()
    assert 'id="recompiles"' in page and "GLOBAL_STATE changed: grad_mode" in page


def test_compile_time_per_stage_and_caches(report):
    for g in report.graphs:
        t = g.times
        assert t is not None and t.total > 0 and t.dynamo > 0 and t.aot_autograd > 0, g.name
        # each pass's time, measured by the backend, adds up to the graph's pass time
        steps = [s for stage in g.stages for s in stage.steps if s.seconds is not None]
        assert len(steps) == sum(len(stage.steps) - 1 for stage in g.stages)
        assert t.graphtrain_passes == pytest.approx(sum(s.seconds for s in steps))
        assert t.dynamo + t.graphtrain_passes + t.aot_autograd <= t.total * 1.001
        assert t.inductor is None  # aot_eager: no Inductor
    assert set(report.cache_counters) >= {
        "inductor.fxgraph_cache_hit",
        "inductor.fxgraph_cache_miss",
        "aot_autograd.autograd_cache_miss",
    }
    page = render_html(report)
    assert 'id="compile-time"' in page and 'id="caches"' in page


def test_fused_op_once_with_location_and_options(report):
    assert report.custom_ops == {FUSED: 2}  # training's graph and validation's
    site, validation_site = report.custom_op_sites
    assert (site.graph, validation_site.graph) == ("head_loss-0", "head_loss-1")
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
    router, the token permutation, the combine and the experts' weighted SwiGLU fused once each
    in the MoE block graph, the head fused as for the dense model."""
    report = inspect_config(
        load_config(["--preset", "moe-debug", "--training.micro_batch_size=2"]),
        device="cpu",
        inner="aot_eager",
        validation=False,
    )
    assert [g.name for g in report.graphs] == ["block-0", "block-1", "head_loss-0"]
    assert report.custom_ops == {
        FUSED: 1,
        "graphtrain.moe_route.default": 1,
        "graphtrain.moe_permute.default": 1,
        "graphtrain.moe_unpermute.default": 1,
        "graphtrain.moe_weighted_swiglu.default": 1,
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


def test_summary_and_page_lead_with_what_fired(report):
    """The one fusion that fired comes first, with where and what it saves; the passes that
    found nothing follow, one line each and collapsed in the page, none without a reason."""
    (lce,) = [f for f in fired(report) if f.fusion]
    assert (lce.name, lce.graphs) == ("fuse_linear_cross_entropy", ["head_loss-0", "head_loss-1"])
    assert [(s.module_path, s.source) for s in lce.sites] == [
        ("output", f"{GPT_SOURCE}:{_head_loss_line()} in head_loss")
    ]
    gone, new = lce.replaced().split(" -> ")
    assert "-1 torch.nn.functional.cross_entropy" in gone and f"+1 {FUSED}" in new
    assert lce.replaced(shown=1) == (
        "-1 torch.nn.functional.cross_entropy, ... 2 more -> +1 Tensor.reshape, ... 1 more"
    )
    assert "logits" in lce.saves and "mode='fast'" in lce.notes[0]
    assert [f.name for f in fired(report) if not f.fusion] == ["canonicalize"] * 2
    nothing = {u.name: u for u in unmatched(report)}
    enabled = {p.name for p in report.passes if p.enabled}
    assert set(nothing) == enabled - {"canonicalize", "fuse_linear_cross_entropy"}
    assert all(u.notes and all(u.notes) for u in nothing.values())
    # A post-grad pass that says nothing on a single-rank run: what it needs to fire.
    assert nothing["overlap_tp_comm"].notes == [PASS_NEEDS["overlap_tp_comm"]]
    # every AOT graph: forward of all four, backward of the two training ones
    assert len(nothing["overlap_tp_comm"].graphs) == 6

    # What it saves in time, where --profile timed the region with the pass off and on.
    assert measured(report, lce.name) == []
    timing = PassTime(lce.name, "head_loss", after_ms=1.0, before_ms=2.5)
    timed = dataclasses.replace(report, profile=SimpleNamespace(passes=[timing]))
    assert measured(timed, lce.name) == [
        "measured in head_loss: 2.500 ms/step kernel time without the pass, 1.000 with it (2.50x)"
    ]

    lines = render_summary(report).splitlines()
    lead = lines.index("Fusions that fired")
    assert lead < 5 and lines[lead + 1] == "fuse_linear_cross_entropy in head_loss-0, head_loss-1"
    block = lines[lead + 1 : lines.index("Other rewrites")]
    assert f"  at output, {GPT_SOURCE}:{_head_loss_line()} in head_loss" in block
    assert any(line.startswith("  saves: the (tokens x vocab) logits") for line in block)
    rest = lines[lines.index("Passes that changed nothing") :]
    assert "no match" not in "\n".join(lines[: len(lines) - len(rest)])
    for name in nothing:
        assert sum(line.startswith(f"{name} (no match, ") for line in rest) == 1, name
    assert not [line for line in lines if line.rstrip().endswith(":")]  # no empty note

    page = render_html(report)
    passes = page[page.index('<h2 id="passes">') : page.index('<h2 id="custom-ops">')]
    shown = re.sub(r"<details>.*?</details>", "", passes, flags=re.S)  # what is open
    assert '<span class="ok">fuse_linear_cross_entropy</span>' in shown and "logits" in shown
    assert "gpt.py:" in shown and "no match" not in shown and "canonicalize" not in shown
    assert passes.count("<details>") == 3  # other rewrites, nothing to rewrite, every pass
    assert "<td></td>" not in passes
    assert passes.index("fuse_linear_cross_entropy") < passes.index("no match")


def test_pass_switched_off(report_off):
    assert report_off.custom_ops == {}
    assert report_off.recompiles == []  # validation=False: one graph per region
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
    assert json.loads((tmp_path / "report.json").read_text())["custom_ops"] == {FUSED: 2}
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


def test_cli_smoke_writes_into_the_run_directory(tmp_path, capsys, monkeypatch):
    """Given a run directory and no --out, the report goes to RUN_DIR/inspect; nothing is
    written in the current directory."""
    run_dir = tmp_path / "runs" / "debug-1"
    run_dir.mkdir(parents=True)
    (run_dir / "config.toml").write_text(to_toml(_config()))
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    code = cli_main(["inspect", str(run_dir), "--backend", "aot_eager", "--device", "cpu"])
    assert code == 0
    printed = capsys.readouterr().out
    assert "head_loss-0" in printed and FUSED in printed and "\033[" not in printed
    out = run_dir / "inspect"
    assert (out / "report.html").is_file() and (out / "graphs" / "head_loss-0").is_dir()
    assert f"report: {out / 'report.html'}" in printed
    assert list(cwd.iterdir()) == []
    assert cli_main(["inspect", "--device", "tpu", "--preset", "debug"]) == 2
    assert cli_main(["inspect", "--preset", "debug", "--profile", "x"]) == 2


def test_compare_names_the_passes_to_time_with_the_pass_off(monkeypatch, tmp_path, capsys):
    """--compare reaches inspect_config as the set of passes (None for all, the default; empty
    for none); an unknown pass is refused with its name and the known ones (exit 2)."""
    import graphtrain.inspect.cli as inspect_cli

    seen = []

    def fake_inspect(cfg, **kwargs):
        seen.append(kwargs["compare"])
        raise SystemExit(0)  # stop before any compile

    monkeypatch.setattr(inspect_cli, "inspect_config", fake_inspect)
    base = ["inspect", "--preset", "debug", "--out", str(tmp_path), "--profile", "1"]
    two = "--compare=fold_routing_weights,fuse_moe_dispatch"
    for extra in ([], ["--compare", "all"], ["--compare", "none"], [two]):
        with pytest.raises(SystemExit):
            cli_main([*base, *extra])
    assert seen == [None, None, set(), {"fold_routing_weights", "fuse_moe_dispatch"}]
    assert cli_main([*base, "--compare", "fuse_nothing"]) == 2
    assert "unknown: fuse_nothing" in capsys.readouterr().err


def test_default_out_dir():
    assert default_out_dir("runs/mine", "debug") == Path("runs/mine/inspect")
    fresh = default_out_dir("", "debug")
    assert fresh.parent == Path("runs") and fresh.name.startswith("inspect-debug-")


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
            "--window-size=1366,768",  # a laptop screen
            page.as_uri(),
        ],
        check=True,
        capture_output=True,
        timeout=120,
    )
    assert png.stat().st_size > 10_000


@pytest.fixture(scope="module")
def profiled(tmp_path_factory):
    """The debug GPT through Inductor, profiled over 2 steps, the fused cross-entropy's region
    compiled again without it (the slowest fixture here: ~6 Inductor compiles)."""
    return inspect_config(
        _config(),
        device="cpu",
        inner="inductor",
        dump_dir=tmp_path_factory.mktemp("inductor"),
        validation=False,
        profile_steps=2,
    )


@pytest.mark.slow  # six Inductor compiles of the debug GPT: ~20 s with a warm Inductor
# cache, ~140 s cold on 2 cores shared with other work
def test_generated_code_is_in_the_page(profiled, tmp_path):
    for g in profiled.graphs:
        assert [c.stage for c in g.output_code] == ["forward", "backward"]
        for code in g.output_code:
            assert "def call(" in code.code
            # Inductor's provenance: every kernel and extern call names its FX nodes
            assert code.kernels and all(k["nodes"] for k in code.kernels.values())
    page = write_report(profiled, tmp_path).read_text()
    (forward, _) = profiled.graphs[0].output_code
    kernel = next(name for name in forward.kernels if name.startswith("cpp_fused"))
    # the C++ kernel's source itself, escaped, not a path to a file of this machine
    assert f"{kernel.rpartition(':')[0]} = async_compile.cpp_pybinding(" in page
    assert "extern &quot;C&quot;" in page
    assert "in the page" in render_summary(profiled)


def _model_line(source: str) -> str:
    file, _, rest = source.partition(":")
    line = int(rest.split(" in ")[0])
    return Path(file).read_text().splitlines()[line - 1].strip()


@pytest.mark.slow  # shares the fixture above
def test_profile_attributes_kernel_time_to_model_lines(profiled):
    prof = profiled.profile
    assert prof.steps == 2 and 0 < prof.kernel_ms <= prof.region_ms <= prof.step_ms
    # every measured kernel inside the compiled calls is matched to a generated kernel or
    # extern call, and the per-graph, per-kernel and per-line tables each add up to it
    assert prof.attributed_ms >= 0.9 * prof.kernel_ms
    assert sum(prof.graphs.values()) == pytest.approx(prof.kernel_ms)
    assert sum(k.ms for k in prof.kernels) == pytest.approx(prof.attributed_ms)
    assert sum(line.ms for line in prof.lines) == pytest.approx(prof.kernel_ms)
    assert set(prof.graphs) == {
        "block-0/forward",
        "block-0/backward",
        "head_loss-0/forward",
        "head_loss-0/backward",
    }
    models = str(Path(GPT_SOURCE).parent)
    named = [line for line in prof.lines if line.source.startswith(models)]
    assert sum(line.ms for line in named) >= 0.9 * prof.kernel_ms
    for line in named:  # real lines of models/, their code as it stands in the file
        assert _model_line(line.source) == line.code, line
    sources = {line.source.rpartition(" in ")[0] for line in named}
    assert f"{GPT_SOURCE}:{_head_loss_line()}" in sources  # the fused cross-entropy
    attention = next(k for k in prof.kernels if "scaled_dot_product" in k.kernel)
    assert "scaled_dot_product_attention" in " ".join(attention.codes)
    (fused,) = prof.passes
    assert (fused.name, fused.region) == ("fuse_linear_cross_entropy", "head_loss")
    assert fused.after_ms == pytest.approx(
        prof.graphs["head_loss-0/forward"] + prof.graphs["head_loss-0/backward"]
    )
    assert fused.before_ms is not None and fused.before_ms > 0
    page = render_html(profiled)
    assert 'id="profile"' in page and "By source line" in page
    assert "Profile: where the step goes" in render_summary(profiled)


def test_inspecting_a_module_leaves_it_as_it_was():
    """A user who inspects and then trains starts from their own gradients, not the inspection's."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(8, 6), torch.nn.BatchNorm1d(6), torch.nn.Linear(6, 3)
    )
    model[0].weight.grad = torch.ones_like(model[0].weight)  # the caller's own accumulation
    running = model[1].running_mean.clone()
    x = torch.randn(5, 8, requires_grad=True)
    inspect(model, x)  # forward and backward: the output needs a gradient
    assert torch.equal(model[0].weight.grad, torch.ones_like(model[0].weight))
    assert model[0].bias.grad is None and model[2].weight.grad is None and x.grad is None
    assert torch.equal(model[1].running_mean, running)
    assert model.training
