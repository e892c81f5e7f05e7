"""Pipeline parallelism composed with the other axes on 4 CPU ranks (gloo), resume across
pipeline sizes and Hugging Face export of a pipelined run: each against the same job without
pp (tolerances in tests/parallel/test_pipeline.py's docstring). Compiled: pp with tp, MoE and
an MTP stage under zbv (pp2_tp2_moe), with FSDP and an MTP stage under zbv (pp2_fsdp2_mtp), and
MTP in the head's stage; eager: the dense pp2_tp2, pp2_ep2, pp=4, the references without pp,
the other MTP stages and the resume runs (compiled and eager agree to ~1e-7; each axis is
compiled without pp in its own tests)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import gloo_runs, job, rank_jobs
from safetensors.torch import load_file
from test_pipeline import EAGER, LOSS_RTOL, STEPS, common_args, compare

from graphtrain.checkpoint.hf import export_hf
from graphtrain.config import load_config
from graphtrain.parallel.pipeline import schedule_class
from graphtrain.parallel.pipeline.layout import V_SCHEDULES
from graphtrain.trainer import train

# moe-debug on two data-parallel ranks that are also its two expert-parallel ranks; one row per
# loader micro-batch, two per step and rank: the pipeline's two micro-batches are the loader's
# (the aux losses are per micro-batch).
# The exported weights after 6 steps: the same fp32 sums in another order (measured: at most
# 1.2e-7 apart); a stage's weights missing or left at their init are off by far more.
EXPORT_RTOL, EXPORT_ATOL = 1e-5, 1e-6
ONE_ROW_MOE = ["--preset=moe-debug", "--training.micro_batch_size=1", "--schedule.batch_size=256"]
EP = [*ONE_ROW_MOE, "--parallel.dp_shard=2", "--parallel.ep=2"]
# zbv where torch runs it on gloo (2.12 and later), else interleaved 1F1B.
ZBV = f"--parallel.pp_schedule={'zbv' if gloo_runs('zbv') else 'interleaved_1f1b'}"
# moe-debug with MTP depth 1 and tp=2 (expert TP 1: each tp rank routes its sequence slice,
# the routers' counts summed over the stage's dp and tp ranks, never over the other stage's).
TP_MOE = ["--preset=moe-debug", "--training.micro_batch_size=2", "--schedule.batch_size=256",
          "--parallel.tp=2", "--model.mtp_depth=1"]  # fmt: skip
# Its pipeline: the MTP depth in a stage of its own, zbv (its weight half sets gradients
# itself, the experts' as views: _grads_in_param_layout).
TP_MOE_STAGES = ["--parallel.pp_layout=Et|t|tL|m", "--parallel.pp_microbatches=2", ZBV]
# debug with MTP depth 1: four rows per step, two per data-parallel rank under dp_shard=2.
MTP = ["--model.mtp_depth=1", "--training.micro_batch_size=2", "--schedule.batch_size=256"]
# MTP in a stage of its own: zbv (the V puts the MTP stage beside the embedding's on rank 0,
# which shares the embedding and holds copies of the final norm and head), or interleaved
# (copies of all three on the other rank).
MTP_STAGE = ["--parallel.pp=2", "--parallel.pp_layout=E|t|tL|m", "--parallel.pp_microbatches=2",
             ZBV]  # fmt: skip
# The 2-rank references of the pipelined MoE and FSDP + MTP runs.
# With MTP, the same micro-batches with and without pp (one row each; each weights the depth's
# mean by the micro-batch's share of the main loss's tokens).
FSDP_MTP = [*MTP, "--training.micro_batch_size=1", "--parallel.dp_shard=2"]
TWO_RANKS = {name: [EAGER, *args] for name, args in
             (("ep2", EP), ("tp2_moe", TP_MOE), ("fsdp2_mtp", FSDP_MTP))}  # fmt: skip
FOUR_RANKS = {
    "pp2_tp2": [EAGER, "--parallel.pp=2", "--parallel.tp=2"],  # compiled: pp2_tp2_moe
    # eager: ep compiled in test_expert_parallel's dp2_ep2, an MoE stage compiled: pp2_tp2_moe
    "pp2_ep2": [EAGER, *EP, "--parallel.pp=2", "--parallel.pp_microbatches=2"],
    "pp2_tp2_moe": [*TP_MOE, "--parallel.pp=2", *TP_MOE_STAGES],
    "pp2_fsdp2_mtp": [*FSDP_MTP, *MTP_STAGE],
    # pp=4, one part per stage (1F1B wants a micro-batch per stage at least). A stage of the
    # embedding alone: test_pipeline's E|t|t|L on two ranks.
    "pp4_moe": [
        EAGER,
        *ONE_ROW_MOE,
        "--parallel.pp=4",
        "--parallel.pp_layout=Et|t|t|L",
        "--parallel.pp_microbatches=4",
    ],
}


@pytest.fixture(scope="module")
def four_rank_runs(corpus, tmp_path_factory):
    """The single-process debug and moe-debug runs, and name -> logged lines of the 2-rank runs
    of TWO_RANKS and the 4-rank pipelined runs of FOUR_RANKS (one launch each). No validation:
    its pass through the schedules is compared in tests/parallel/test_pipeline.py, and here
    its no-grad graphs would be a third of the compile time of 10 compiled jobs."""
    tmp = tmp_path_factory.mktemp("pipeline_four")
    common = [*common_args(corpus), "--metrics.validate=false"]
    # the references eager, as in test_pipeline.py
    single = train(load_config(job(corpus, tmp / "one", *common, EAGER)))
    single_moe = train(load_config(job(corpus, tmp / "moe", *common, *ONE_ROW_MOE, EAGER)))
    runs = {}
    for ranks, layouts in ((2, TWO_RANKS), (4, FOUR_RANKS)):
        jobs = [job(corpus, tmp / name, *common, *args) for name, args in layouts.items()]
        runs |= dict(zip(layouts, rank_jobs(ranks, jobs), strict=True))
    return single, runs, single_moe


@pytest.mark.slow
def test_pp_with_tp_follows_the_single_process_curve(four_rank_runs):
    """pp=2 x tp=2 (sequence-parallel slices between stages), 4 ranks, against one process.
    pp=2 x dp_shard=2 (FSDP2 per stage): test_mtp_stage_with_fsdp_follows_the_same_run_without_pp
    and pp2_ep2 (FSDP2 over the non-expert weights)."""
    single, runs, _ = four_rank_runs
    compare(single, runs["pp2_tp2"])


@pytest.mark.slow
def test_pp4_follows_the_single_process_curve(four_rank_runs):
    """pp=4, 1F1B, one part per stage (Et|t|t|L on moe-debug: its MoE layers in stages 1 and
    2, each updating its own expert bias), against one process."""
    _, runs, single_moe = four_rank_runs
    compare(single_moe, runs["pp4_moe"])
    # (pp - 1) / (n + pp - 1) with 4 micro-batches: the bubble of four stages.
    assert [m["pp/bubble_predicted"] for m in runs["pp4_moe"] if "loss" in m] == [
        pytest.approx(3 / 7)
    ] * STEPS


@pytest.mark.slow
@pytest.mark.parametrize(("name", "reference"), [("pp2_ep2", "ep2"), ("pp2_tp2_moe", "tp2_moe")])
def test_pp_with_ep_or_tp_follows_the_same_moe_run_without_pp(four_rank_runs, name, reference):
    """pp=2 x ep=2 and pp=2 x tp=2 on moe-debug (the experts' all-to-all and the routers'
    count sums within each stage's ranks) against ep=2 or tp=2 alone: the same data-parallel
    ranks, so the same loss weighting, and the same micro-batches, so the same aux losses.
    ep: 1F1B, layer 1 in stage 0, layer 2 in stage 1. tp: MTP depth 1 (an MoE block) in a
    stage of its own after the head's, zbv where torch runs it on gloo (the stages exchange
    sequence slices, the head's stage sends its hidden state to the MTP stage; the weight half
    of the split backward leaves the experts' gradients as strided views, put back into their
    parameters' layout: before that, torch's fused AdamW on CPU applied one expert's update to
    another, the loss 2e-4 off). Every MoE statistic of every step agrees: the load per
    layer, the MTP depth's block included (which the expert bias steers: a bias updated from
    one stage's counts only, twice, or never, as the MTP block's was, routes otherwise within
    a step or two), the aux, sequence-aux, global-aux and z losses (each scaled by its
    micro-batch's share, summed over the stages), the norms, the depth's loss and acceptance."""
    _, runs, _ = four_rank_runs
    got, want = runs[name], runs[reference]
    want_steps = [m for m in want if "loss" in m]
    got_steps = [m for m in got if "loss" in m]
    assert len(got_steps) == STEPS
    keys = [k for k in want_steps[-1] if k.startswith(("moe/", "mtp/")) or k.endswith("_norm")]
    assert {"moe/layers.1/load_max_over_mean", "moe/layers.2/load_max_over_mean",
            "moe/global_aux_loss", "moe/aux_loss", "grad_norm"} <= set(keys)  # fmt: skip
    if name == "pp2_tp2_moe":
        mtp = {"moe/mtp_layers.0.block/load_max_over_mean", "mtp/loss_0", "mtp/loss_1"}
        assert mtp <= set(keys)
    assert want_steps[-1]["moe/layers.2/bias_absmax"] > 0  # the bias did move
    for a, b in zip(want_steps, got_steps, strict=True):
        assert b["loss"] == pytest.approx(a["loss"], rel=LOSS_RTOL), a["step"]
        for key in keys:
            assert b[key] == pytest.approx(a[key], rel=LOSS_RTOL, abs=1e-7), (a["step"], key)


def _export(run_dir: Path, out: Path) -> dict[str, torch.Tensor]:
    """The fp32 safetensors export of a run's newest checkpoint."""
    export_hf(run_dir, out, dtype="fp32")
    return load_file(str(out / "model.safetensors"))


@pytest.mark.slow
def test_resume_across_pipeline_sizes_and_export(corpus, tmp_path):
    """A pp=1 checkpoint resumed with pp=2 (interleaved, another layout), and a pp=2 checkpoint
    resumed with pp=1, continue the uninterrupted single-process curve; the pp=2 run's final
    checkpoint exports to the single-process run's safetensors (same names, shapes, values)."""
    common = [*common_args(corpus, steps=6), EAGER]
    straight = train(load_config(job(corpus, tmp_path / "one", *common, "--checkpoint.interval=3")))
    from_single = f"--checkpoint.resume={tmp_path / 'one' / 'run' / 'checkpoints' / 'step-0000003'}"
    interleaved = ["--parallel.pp_schedule=interleaved_1f1b", "--parallel.pp_layout=E|t|t|L"]
    resumed_pp, saved_pp = rank_jobs(
        2,
        [
            job(corpus, tmp_path / "pp_resumed", *common, "--parallel.pp=2", *interleaved,
                from_single),
            job(corpus, tmp_path / "pp_saved", *common, "--parallel.pp=2",
                "--checkpoint.interval=3"),
        ],
    )  # fmt: skip
    from_pp = (
        f"--checkpoint.resume={tmp_path / 'pp_saved' / 'run' / 'checkpoints' / 'step-0000003'}"
    )
    resumed_single = train(load_config(job(corpus, tmp_path / "one_resumed", *common, from_pp)))
    tail = straight.losses[3:]
    assert [m["loss"] for m in saved_pp if "loss" in m] == pytest.approx(
        straight.losses, rel=LOSS_RTOL
    )
    assert [m["loss"] for m in resumed_pp if "loss" in m] == pytest.approx(tail, rel=LOSS_RTOL)
    assert resumed_single.losses == pytest.approx(tail, rel=LOSS_RTOL)

    want = _export(tmp_path / "one" / "run", tmp_path / "hf_one")
    got = _export(tmp_path / "pp_saved" / "run", tmp_path / "hf_pp")
    assert got.keys() == want.keys()
    for name, tensor in want.items():
        torch.testing.assert_close(got[name], tensor, rtol=EXPORT_RTOL, atol=EXPORT_ATOL,
                                   msg=lambda m, name=name: f"{name}: {m}")  # fmt: skip
    config = json.loads((tmp_path / "hf_pp" / "config.json").read_text())
    assert config == json.loads((tmp_path / "hf_one" / "config.json").read_text())


def _installed_v_schedule() -> str | None:
    """dualpipev, else zbv, where the installed torch has it and runs it on gloo (both split
    the backward alike: one of them tests the MTP stage's outputs under the split; measured,
    they log the same)."""
    for name in reversed(V_SCHEDULES):
        try:
            schedule_class(name)
        except ValueError:
            continue
        if gloo_runs(name):
            return name
    return None


def _same_mtp_metrics(name: str, want: list[dict], got: list[dict]) -> None:
    """Every logged line agrees to 1e-5: the loss, validation loss, norms and the depths' loss
    and acceptance (the main head's as depth 0) where the reference logs them; the pipelined
    run logs them too."""
    assert len(got) == len(want), name
    for a, b in zip(want, got, strict=True):
        keys = [k for k in ("loss", "val_loss", "grad_norm", "param_norm") if k in a]
        keys += [k for k in a if k.startswith("mtp/")]
        for key in keys:
            assert b[key] == pytest.approx(a[key], rel=LOSS_RTOL), (name, a["step"], key)
    assert {"mtp/acceptance_0", "mtp/acceptance_1"} <= got[-2].keys(), name


@pytest.mark.slow
def test_mtp_stage_with_fsdp_follows_the_same_run_without_pp(four_rank_runs):
    """MTP depth 1 in a stage of its own under pp=2 x dp_shard=2 (zbv: the embedding shared
    by rank 0's two stages, an FSDP2 root of its own, its gradient reduced once per step; the
    copies of the norm and head FSDP-sharded like their owners, their gradient shards summed
    between the two pp ranks of each dp position) against dp_shard=2 alone: the same
    data-parallel ranks, so the same loss weighting: the loss, the norms and the depth's loss
    and acceptance, which dp_shard=2 alone logs too since the step's statistics survive
    FSDP2's input cast (measured: 2e-7 apart, zbv and interleaved)."""
    _, runs, _ = four_rank_runs
    assert "mtp/acceptance_1" in runs["fsdp2_mtp"][-2]  # FSDP2 copied a stats dict before
    _same_mtp_metrics("pp2_fsdp2_mtp", runs["fsdp2_mtp"], runs["pp2_fsdp2_mtp"])


@pytest.mark.slow
def test_mtp_in_a_stage_follows_the_single_process_curve(corpus, tmp_path):
    """MTP depth 1 on pp=2: in the head's stage (1F1B, Et|tLm: the stage holds a copy of the
    embedding) and in a stage of its own (interleaved, E|t|tL|m: copies of the embedding, final
    norm and head on the other rank; dualpipev, else zbv, where torch has it: the MTP stage on
    rank 0 beside the embedding, copies of the norm and head), against one process. The loss,
    the norms and the depth's loss and acceptance agree to 1e-5 every step: the copies'
    gradients summed with their owners' keep them equal (without that sum the curve leaves the
    reference by 4e-5 to 3e-3 within 5 steps, measured)."""
    common = [*common_args(corpus), *MTP]
    # The references: the same micro-batches as the pipeline's (each weights the depth's mean
    # by the micro-batch's share of the main loss's tokens: another split moves the depth's
    # loss by ~2e-5). DualPipeV needs a micro-batch per stage at least: one row each. Eager:
    # compiled, MTP agrees with it to fp32 rounding (tests/models/test_mtp.py).
    one_row = ["--training.micro_batch_size=1", "--parallel.pp_microbatches=4"]
    references = {}
    for name, rows in (("two_rows", []), ("one_row", one_row[:1])):
        train(load_config(job(corpus, tmp_path / name, *common, *rows, EAGER)))
        lines = (tmp_path / name / "run" / "metrics.jsonl").read_text().splitlines()
        references[name] = [json.loads(x) for x in lines]
    two = ["--parallel.pp_microbatches=2"]
    layouts = {
        "head_stage": ("two_rows", [*two, "--parallel.pp_layout=Et|tLm"]),
        "own_stage": ("two_rows", [*two, EAGER, "--parallel.pp_schedule=interleaved_1f1b",
                                   "--parallel.pp_layout=E|t|tL|m"]),
    }  # fmt: skip
    v_schedule = _installed_v_schedule()
    if v_schedule is not None:
        layouts[v_schedule] = ("one_row", [*one_row, EAGER,
                                           f"--parallel.pp_schedule={v_schedule}",
                                           "--parallel.pp_layout=E|t|tL|m"])  # fmt: skip
    jobs = [
        job(corpus, tmp_path / name, *common, "--parallel.pp=2", *args)
        for name, (_, args) in layouts.items()
    ]
    for (name, (reference, _)), metrics in zip(layouts.items(), rank_jobs(2, jobs), strict=True):
        _same_mtp_metrics(name, references[reference], metrics)
