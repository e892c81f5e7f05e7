"""MoE layouts on CPU (gloo): expert parallel (ep=2 trains exactly like ep=1), tensor
parallel of MoE models (expert TP size 1 or tp) and their compositions with FSDP/HSDP follow the
single process; bad layouts are refused."""

from __future__ import annotations

import pytest
from conftest import job, torchrun_metrics

from graphtrain.config import load_config
from graphtrain.parallel import ParallelDims, apply_ep
from graphtrain.trainer import train
from models import MODEL_PRESETS, build_model


def test_ep2_gives_the_losses_and_gradients_of_ep1(corpus, tmp_path):
    """Two ranks, dp_shard=2: experts replicated and FSDP-sharded (ep=1), or split over the two
    ranks with all-to-all dispatch (ep=2). moe-debug has every aux loss on (global_aux counts
    all-reduced across ranks) and the expert bias; same data, same init. The grad norm covers
    every gradient, expert weights included. Tolerance: reduction order only (fp32)."""
    common = [
        "--preset=moe-debug",
        "--training.steps=4",
        "--training.micro_batch_size=2",
        "--parallel.dp_shard=2",
        "--metrics.log_interval=1",
        "--metrics.val_interval=0",
    ]
    runs = {
        ep: [
            m
            for m in torchrun_metrics(
                2, job(corpus, tmp_path / f"ep{ep}", *common, f"--parallel.ep={ep}")
            )
            if "loss" in m
        ]
        for ep in (1, 2)
    }
    assert len(runs[1]) == len(runs[2]) == 4
    for a, b in zip(runs[1], runs[2], strict=True):
        for key in ("loss", "grad_norm", "param_norm", "moe/layers.1/load_max_over_mean"):
            assert b[key] == pytest.approx(a[key], rel=1e-5), key


_SPLIT = ("--parallel.tp=2", "--parallel.dp_shard=2")


@pytest.mark.parametrize(
    ("nproc", "layout"),
    [
        (2, ["--parallel.tp=2", "--training.micro_batch_size=4"]),
        (2, ["--parallel.tp=2", "--parallel.etp=2", "--training.micro_batch_size=4"]),
        (4, [*_SPLIT, "--parallel.ep=2", "--training.micro_batch_size=2"]),
        (4, [*_SPLIT, "--parallel.etp=2", "--training.micro_batch_size=2"]),
        (
            4,
            [
                "--parallel.dp_replicate=2",
                "--parallel.dp_shard=2",
                "--parallel.ep=2",
                "--training.micro_batch_size=1",
            ],
        ),
    ],
    ids=["tp2", "tp2_etp2", "dp2_tp2_ep2", "dp2_tp2_etp2", "hsdp_ep2"],
)
def test_tensor_and_expert_parallel_follow_the_single_process(corpus, tmp_path, nproc, layout):
    """Same global batch (4 rows), same init, one process against:
    tp=2, expert TP 1 (each tp rank routes its own sequence slice; MoE gradients summed over
    tp); tp=2 with expert TP 2 (experts split on their hidden dim, sequence gathered, router
    gradients summed over tp); dp_shard=2 x tp=2 with ep=2 (FSDP, TP and the all-to-all
    together) or with etp=2 (FSDP over tp-split experts); HSDP 2 x 2 with ep=2 (expert weights
    replicated over dp_replicate: their gradients summed over the replicas).
    Every aux loss is on, with the expert bias, where the tokens each router sees are whole
    sequences; with expert TP 1 and tp=2 the per-slice ones (aux, seq_aux) are off. Tolerance
    1e-4: reduction order, and dp weighting each rank's tokens within the rank (as in the dense
    two-process test)."""
    common = ["--preset=moe-debug", "--training.steps=4", "--metrics.log_interval=1"]
    common.append("--metrics.val_interval=0")
    if "--parallel.tp=2" in layout and "--parallel.etp=2" not in layout:
        common += ["--model.aux_loss_coef=0", "--model.seq_aux_loss_coef=0"]
    single = train(
        load_config(job(corpus, tmp_path / "one", *common, "--training.micro_batch_size=4"))
    )
    multi = [
        m
        for m in torchrun_metrics(nproc, job(corpus, tmp_path / "many", *common, *layout))
        if "loss" in m
    ]
    assert len(multi) == 4
    for a, b in zip(single.losses, multi, strict=True):
        assert b["loss"] == pytest.approx(a, rel=1e-4)


def test_expert_tp_must_span_tp_and_not_meet_ep():
    with pytest.raises(ValueError, match=r"parallel.etp=2 must be 1 or parallel.tp=4"):
        ParallelDims(tp=4, etp=2, world_size=4)
    with pytest.raises(ValueError, match="expert tensor parallel and expert parallel together"):
        ParallelDims(dp_shard=2, tp=2, ep=2, etp=2, world_size=4)


def test_ep_must_divide_dp_shard():
    with pytest.raises(
        ValueError, match=r"parallel.ep=3 must be >= 1 and divide parallel.dp_shard=4"
    ):
        ParallelDims(dp_shard=4, ep=3, world_size=4)


def test_ep_needs_an_moe_model():
    class Mesh:
        def size(self) -> int:
            return 2

    with pytest.raises(ValueError, match="needs an MoE model"):
        apply_ep(build_model(MODEL_PRESETS["debug"]), Mesh())
