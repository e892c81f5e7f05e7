"""Pipeline parallelism composed with the other axes on 4 CPU ranks (gloo), resume across
pipeline sizes and Hugging Face export of a pipelined run: each against the same job without
pp (tolerances in tests/parallel/test_pipeline.py's docstring)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import job, torchrun_jobs
from safetensors.torch import load_file
from test_pipeline import LOSS_RTOL, STEPS, common_args, compare

from graphtrain.checkpoint.hf import export_hf
from graphtrain.config import load_config
from graphtrain.trainer import train

# moe-debug on two data-parallel ranks that are also its two expert-parallel ranks; one row per
# loader micro-batch, two per step and rank: the pipeline's two micro-batches are the loader's
# (the aux losses are per micro-batch).
# The exported weights after 6 steps: the same fp32 sums in another order (measured: at most
# 1.2e-7 apart); a stage's weights missing or left at their init are off by far more.
EXPORT_RTOL, EXPORT_ATOL = 1e-5, 1e-6
EP = ["--preset=moe-debug", "--training.micro_batch_size=1", "--schedule.batch_size=256",
      "--parallel.dp_shard=2", "--parallel.ep=2"]  # fmt: skip
FOUR_RANKS = {
    "pp2_fsdp2": ["--parallel.pp=2", "--parallel.dp_shard=2", "--training.micro_batch_size=2"],
    "pp2_tp2": ["--parallel.pp=2", "--parallel.tp=2"],
    "pp2_ep2": [*EP, "--parallel.pp=2", "--parallel.pp_microbatches=2"],
}


@pytest.fixture(scope="module")
def four_rank_runs(corpus, tmp_path_factory):
    """The single-process debug run, the 2-rank expert-parallel moe-debug run, and the 4-rank
    pipelined runs of FOUR_RANKS (one launch): name -> logged lines."""
    tmp = tmp_path_factory.mktemp("pipeline_four")
    common = common_args(corpus)
    single = train(load_config(job(corpus, tmp / "one", *common)))
    (ep2,) = torchrun_jobs(2, [job(corpus, tmp / "ep2", *common, *EP)])
    jobs = [job(corpus, tmp / name, *common, *args) for name, args in FOUR_RANKS.items()]
    runs = dict(zip(FOUR_RANKS, torchrun_jobs(4, jobs), strict=True))
    return single, ep2, runs


@pytest.mark.slow
def test_pp_with_fsdp_and_tp_follows_the_single_process_curve(four_rank_runs):
    """pp=2 x dp_shard=2 (FSDP2 per stage; each dp rank reads 2 of the step's 4 rows) and pp=2
    x tp=2 (sequence-parallel slices between stages), 4 ranks, against one process."""
    single, _, runs = four_rank_runs
    # dp_shard=2 weights each rank's tokens within the rank, then averages the ranks (the
    # single process weights all tokens of the step together): 1e-3, as the trainer's own
    # two-process test; tp=2 adds the same numbers in another order only.
    losses = [m["loss"] for m in runs["pp2_fsdp2"] if "loss" in m]
    assert losses == pytest.approx(single.losses, rel=1e-3)
    compare(single, runs["pp2_tp2"])


@pytest.mark.slow
def test_pp_with_ep_follows_the_expert_parallel_run(four_rank_runs):
    """pp=2 x ep=2 on moe-debug (layer 1 in stage 0, layer 2 in stage 1; the experts' all-to-all
    within each stage's ep group) against ep=2 alone: the same data-parallel ranks, so the same
    loss weighting, and the same micro-batches, so the same aux losses. Every MoE statistic of
    every step agrees: the load per layer (which the expert bias steers: a bias updated from
    one stage's counts only, or twice, routes otherwise within a step or two), the aux,
    sequence-aux, global-aux and z losses (each scaled by its micro-batch's share, summed
    over the stages), the gradient and parameter norms."""
    _, ep2, runs = four_rank_runs
    got, want = runs["pp2_ep2"], ep2
    reference = [m for m in want if "loss" in m]
    steps = [m for m in got if "loss" in m]
    assert len(steps) == STEPS
    names = [k for k in reference[-1] if k.startswith("moe/") or k.endswith("_norm")]
    assert {"moe/layers.1/load_max_over_mean", "moe/layers.2/load_max_over_mean",
            "moe/global_aux_loss", "moe/aux_loss", "grad_norm"} <= set(names)  # fmt: skip
    assert reference[-1]["moe/layers.2/bias_absmax"] > 0  # the bias did move
    for a, b in zip(reference, steps, strict=True):
        assert b["loss"] == pytest.approx(a["loss"], rel=LOSS_RTOL), a["step"]
        for name in names:
            assert b[name] == pytest.approx(a[name], rel=LOSS_RTOL, abs=1e-7), (a["step"], name)
    vals = [(m["step"], m["val_loss"]) for m in got if "val_loss" in m]
    assert vals == [(s, pytest.approx(v, rel=LOSS_RTOL)) for s, v in
                    [(m["step"], m["val_loss"]) for m in want if "val_loss" in m]]  # fmt: skip


def _export(run_dir: Path, out: Path) -> dict[str, torch.Tensor]:
    """The fp32 safetensors export of a run's newest checkpoint."""
    export_hf(run_dir, out, dtype="fp32")
    return load_file(str(out / "model.safetensors"))


@pytest.mark.slow
def test_resume_across_pipeline_sizes_and_export(corpus, tmp_path):
    """A pp=1 checkpoint resumed with pp=2 (interleaved, another layout), and a pp=2 checkpoint
    resumed with pp=1, continue the uninterrupted single-process curve; the pp=2 run's final
    checkpoint exports to the single-process run's safetensors (same names, shapes, values)."""
    common = common_args(corpus, steps=6)
    straight = train(load_config(job(corpus, tmp_path / "one", *common, "--checkpoint.interval=3")))
    from_single = f"--checkpoint.resume={tmp_path / 'one' / 'run' / 'checkpoints' / 'step-0000003'}"
    interleaved = ["--parallel.pp_schedule=interleaved_1f1b", "--parallel.pp_layout=E|t|t|L"]
    resumed_pp, saved_pp = torchrun_jobs(
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
