"""graphtrain inspect of a pipelined job: each pp rank's regions, compiled as that rank does,
and the stage table in the report, the summary and the page."""

import json

import pytest

from graphtrain.config import load_config
from graphtrain.inspect import inspect_config, load_report, write_report
from graphtrain.inspect.terminal import render_summary

# debug (2 layers) with MTP depth 1 in a stage of its own, interleaved over two ranks: rank 0
# runs the embedding and layer 1 with the head, rank 1 layer 0 and the MTP depth.
PIPELINE = ["--preset=debug", "--training.micro_batch_size=2", "--schedule.batch_size=256",
            "--model.mtp_depth=1", "--parallel.pp=2", "--parallel.pp_schedule=interleaved_1f1b",
            "--parallel.pp_layout=E|t|tL|m", "--parallel.pp_microbatches=2"]  # fmt: skip
FUSED = "graphtrain.linear_cross_entropy"


@pytest.fixture(scope="module")
def dump_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("pipeline_dumps")


@pytest.fixture(scope="module")
def report(dump_dir):
    return inspect_config(load_config(PIPELINE), device="cpu", inner="aot_eager", dump_dir=dump_dir)


def test_each_pp_rank_compiles_its_own_regions(report):
    # The MTP depth's loss runs through rank 1's copy of the head's region.
    assert report.regions == ["pp0.block", "pp0.head_loss", "pp1.block", "pp1.head_loss",
                              "pp1.mtp_1"]  # fmt: skip
    names = {g.name: g for g in report.graphs}
    # Training compiles forward and backward; the validation forward (up to the head's stage)
    # compiles each of its regions again under no_grad; MTP is a training loss only.
    assert set(names) == {"pp0.block-0", "pp0.block-1", "pp0.head_loss-0", "pp0.head_loss-1",
                          "pp1.block-0", "pp1.block-1", "pp1.head_loss-0", "pp1.mtp_1-0"}  # fmt: skip
    for name in ("pp0.block-0", "pp0.head_loss-0", "pp1.block-0", "pp1.mtp_1-0"):
        assert [s.stage for s in names[name].stages] == ["pre_grad", "forward", "backward"]
    # The fused loss in the head's stage, and in the MTP stage's copy of the head (with the
    # acceptance statistics).
    ops = {site.graph: site.op for site in report.custom_op_sites}
    assert ops["pp0.head_loss-0"].startswith(FUSED)
    assert ops["pp1.head_loss-0"] == f"{FUSED}_with_stats.default"


def test_stage_table(report, dump_dir):
    want = [
        (0, 0, "embedding", []),
        (1, 1, "layer 0", ["pp1.block-0", "pp1.block-1"]),
        (2, 0, "layer 1, norm, head and loss",
         ["pp0.block-0", "pp0.block-1", "pp0.head_loss-0", "pp0.head_loss-1"]),
        (3, 1, "MTP depth 1", ["pp1.head_loss-0", "pp1.mtp_1-0"]),
    ]  # fmt: skip
    got = [(s["stage"], s["pp_rank"], s["holds"], s["graphs"]) for s in report.pipeline]
    assert got == want
    # The dump holds it: a report read back from the directory has the same table.
    assert load_report(dump_dir).pipeline == report.pipeline
    stage = json.loads((dump_dir / "pipeline.json").read_text())[3]
    assert stage["regions"] == ["pp1.mtp_1", "pp1.head_loss"]


def test_stage_table_in_summary_and_page(report, tmp_path):
    summary = render_summary(report)
    assert "Pipeline stages" in summary
    assert "layer 1, norm, head and loss" in summary
    page = write_report(report, tmp_path).read_text()
    assert '<h2 id="pipeline">Pipeline stages</h2>' in page
    assert "pp1.mtp_1-0" in page


def test_profile_under_pp_is_refused():
    with pytest.raises(ValueError, match=r"--profile with parallel.pp=2: .* --parallel.pp=1"):
        inspect_config(load_config(PIPELINE), device="cpu", inner="inductor", profile_steps=1)


def test_a_bad_layout_is_refused_before_compiling():
    cfg = load_config([*PIPELINE, "--parallel.pp_layout=E|t|t|tLm"])
    with pytest.raises(ValueError, match=r"places 3 transformer layers .* model.num_layers=2"):
        inspect_config(cfg, device="cpu", inner="aot_eager")
