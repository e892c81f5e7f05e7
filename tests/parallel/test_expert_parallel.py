"""MoE layouts on CPU (gloo): expert parallel, tensor parallel of MoE models (expert TP size 1
or tp), both together, and their compositions with FSDP/HSDP train exactly like plain data
parallelism; bad layouts are refused."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from conftest import job, rank_jobs

from graphtrain.config import load_config
from graphtrain.parallel import ParallelDims, apply_ep
from graphtrain.trainer import train
from models import MODEL_PRESETS, build_model

_COMMON = (
    "--preset=moe-debug",
    "--training.steps=4",
    "--metrics.log_interval=1",
    "--metrics.val_interval=0",
)
# With tp=2 and expert TP 1 each router sees a slice of each sequence: the per-slice aux losses
# (aux, seq_aux) would differ from the reference's by design, so both runs turn them off.
_SLICED = ("--model.aux_loss_coef=0", "--model.seq_aux_loss_coef=0")
_SPLIT = ("--parallel.tp=2", "--parallel.dp_shard=2")
_KEYS = ("loss", "grad_norm", "moe/layers.1/load_max_over_mean")
_DUMP = "--compile.dump_graphs=true"
_EAGER = "--compile.enable=false"
_VALIDATE = "--metrics.validate=true"  # the held-out loss at steps 0 and 4 (dp2 and dp2_ep2)
_MB = {dp: f"--training.micro_batch_size={4 // dp}" for dp in (1, 2, 4)}  # global batch: 4 rows

# Every run of this file: name -> (ranks, arguments beyond _COMMON).
RUNS = {
    # Plain data parallelism, the references: eager, but for dp2, whose compiled graphs the
    # compiled-ops test reads (compiled and eager agree to ~1e-7). dp1: the resume test's.
    "dp1": (1, (_EAGER, _MB[1])),
    "dp1_sliced": (1, (_EAGER, *_SLICED, _MB[1])),
    "dp2": (2, ("--parallel.dp_shard=2", _MB[2], _DUMP, _VALIDATE)),
    "dp4": (4, (_EAGER, "--parallel.dp_shard=4", _MB[4])),
    # The layouts: compiled where expert parallelism meets tp and expert TP (the all-to-all, the
    # routers' sums over tp, the expert-TP collectives and the fused router and dispatch in one
    # graph: dp2_tp2_ep2_etp2) and dp2_ep2, whose graphs the compiled-ops test reads; the others
    # eager (a compiled 4-rank run costs 3-4x an eager one on 2 cores; tp=2's sliced routing
    # compiled: test_pipeline_layouts' pp2_tp2_moe). Expert TP alone (tp=2, etp=2) is in both
    # dp2_tp2_etp2 and dp2_tp2_ep2_etp2.
    "tp2": (2, (_EAGER, *_SLICED, "--parallel.tp=2", _MB[1])),
    # With graphtrain's AdamW (AdamWCopies, "auto"'s choice on CUDA) against the reference's
    # torch AdamW: its step on FSDP, TP and expert-parallel shards, the clip in its step.
    "dp2_tp2_ep2": (
        4,
        (_EAGER, *_SPLIT, "--parallel.ep=2", _MB[2], "--optim.implementation=graphtrain"),
    ),
    "dp2_tp2_etp2": (4, (_EAGER, *_SPLIT, "--parallel.etp=2", _MB[2])),
    # Saves at step 2 too, for the resume test.
    "dp2_tp2_ep2_etp2": (
        4,
        (*_SPLIT, "--parallel.ep=2", "--parallel.etp=2", _MB[2], "--checkpoint.interval=2"),
    ),
    "hsdp_ep2": (
        4,
        (_EAGER, "--parallel.dp_replicate=2", "--parallel.dp_shard=2", "--parallel.ep=2", _MB[4]),
    ),
    "dp2_ep2": (2, ("--parallel.dp_shard=2", "--parallel.ep=2", _MB[2], _DUMP, _VALIDATE)),
}
# Each layout and the reference with its data-parallel ranks (same rows per rank, same loss
# weighting) and its aux losses.
LAYOUTS = {
    "tp2": "dp1_sliced",
    "dp2_tp2_ep2": "dp2",
    "dp2_tp2_etp2": "dp2",
    "dp2_tp2_ep2_etp2": "dp2",
    "hsdp_ep2": "dp4",
}


@pytest.fixture(scope="module")
def runs(corpus, tmp_path_factory) -> dict[str, tuple[Path, list[dict]]]:
    """(run directory, logged steps) of every run of RUNS, by name. The one-process runs train
    in this process; all the runs of 2 ranks share one launch (conftest.rank_jobs), those of 4
    another (process start and imports cost more than such a run)."""
    root = tmp_path_factory.mktemp("ep")
    args = {name: job(corpus, root / name, *_COMMON, *extra) for name, (_, extra) in RUNS.items()}
    metrics = {}
    for name, (nproc, _) in RUNS.items():
        if nproc == 1:
            train(load_config(args[name]))
            metrics[name] = _lines(root / name / "run")
    for nproc in (2, 4):
        names = [name for name, (n, _) in RUNS.items() if n == nproc]
        metrics.update(zip(names, rank_jobs(nproc, [args[n] for n in names]), strict=True))
    return {
        name: (root / name / "run", [m for m in lines if "loss" in m])
        for name, lines in metrics.items()
    }


def _lines(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _assert_trains_like(got: list[dict], ref: list[dict]) -> None:
    """Tolerance: fp32 reduction order. The first step (forward, gradients, grad norm) agrees to
    1e-5; later losses to 1e-4, because AdamW divides by the root of each parameter's second
    moment, so in near-zero gradients (where tp's other summation order is all there is) a few
    ulps become a visible change of the update (seen: 1.4e-5 at step 3 with tp=2, expert TP 1)."""
    assert len(ref) == len(got) == 4
    for key in _KEYS:
        assert got[0][key] == pytest.approx(ref[0][key], rel=1e-5), key
    for a, b in zip(ref, got, strict=True):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-4), a["step"]


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_tensor_and_expert_parallel_train_like_data_parallel(runs, layout):
    """Each layout against plain data parallelism over the same number of data-parallel ranks
    (so the same rows per rank and the same loss weighting), same global batch of 4 rows, same
    init, 4 steps:
    tp=2 with expert TP 1 (each tp rank routes its own sequence slice; MoE gradients summed
    over tp); dp_shard=2 x tp=2 with ep=2 (FSDP, TP and the all-to-all together; graphtrain's
    AdamW, against torch's in the reference), with etp=2 (experts split on their hidden dim,
    sequence gathered, router gradients summed over tp; FSDP over the tp-split experts) or
    with both (each rank's experts split over tp); HSDP 2 x 2 with ep=2 (expert weights
    replicated over dp_replicate: their gradients summed over the replicas). ep=2 alone
    (experts split over the two ranks, all-to-all dispatch): the compiled-ops test.
    moe-debug has every aux loss on (global_aux counts all-reduced across ranks) and the
    expert bias. The grad norm covers every gradient, expert weights included. Tolerances: see
    _assert_trains_like."""
    _assert_trains_like(runs[layout][1], runs[LAYOUTS[layout]][1])


def _fused_op_counts(run_dir) -> dict[str, dict[str, int]]:
    """Per compiled region: the graphtrain ops, grouped GEMMs and all-to-alls after the last
    pass (the dumps of --compile.dump_graphs). The all-to-alls are counted under one name:
    torch 2.11 records the autograd one as _c10d_functional_autograd.all_to_all_single, later
    versions as _c10d_functional.all_to_all_single (the base op gained autograd)."""
    counts = {}
    for summary in sorted((run_dir / "graphs").glob("*/summary.json")):
        ops = {}
        for op, n in json.loads(summary.read_text())[-1]["op_counts"].items():
            op = "all_to_all_single" if op.endswith(".all_to_all_single") else op
            if op.startswith("graphtrain.") or op == "torch._grouped_mm" or "all_to_all" in op:
                ops[op] = ops.get(op, 0) + n
        counts[summary.parent.name] = ops
    return counts


def _notes(run_dir, label: str) -> list[str]:
    """The notes pass `label` left in every compiled region of the run (its graph dumps)."""
    return [
        note
        for summary in sorted((run_dir / "graphs").glob("*/summary.json"))
        for entry in json.loads(summary.read_text())
        if entry["label"] == label
        for note in entry.get("notes") or []
    ]


@pytest.mark.slow
def test_expert_parallel_compiles_to_the_ops_of_data_parallel(runs):
    """dp_shard=2 with ep=2 (experts split over the two ranks, all-to-all dispatch) against
    plain data parallelism over the same two ranks, both compiled (aot_eager) with graph dumps:
    every compiled region holds the same graphtrain ops (moe_route, moe_permute,
    moe_unpermute) and the same number of grouped GEMMs (w1|w3 fused: 2 per MoE layer), the
    all-to-alls (tokens per expert, rows out, rows back) being the only additions, all in one
    graph per block, except fold_routing_weights' moe_weighted_swiglu (the expert outputs come
    back through an all-to-all: refused, with that note); and the run trains like data
    parallelism (_assert_trains_like), its
    held-out loss (no_grad, through the same all-to-alls) equal to 1e-5 at steps 0 and 4."""
    (ref_dir, ref), (got_dir, got) = runs["dp2"], runs["dp2_ep2"]
    want_ops = _fused_op_counts(ref_dir)
    got_ops = _fused_op_counts(got_dir)
    route = "graphtrain.moe_route.default"
    # The MoE blocks' compiled graphs (they may share one: one block class).
    moe_regions = [r for r, ops in want_ops.items() if route in ops]
    assert moe_regions, want_ops
    assert got_ops.keys() == want_ops.keys()
    for region, ops in want_ops.items():
        if region in moe_regions:
            assert ops[route] == ops["graphtrain.moe_unpermute.default"] == 1, ops
            assert ops["torch._grouped_mm"] == 2, ops
            assert ops.pop("graphtrain.moe_weighted_swiglu.default") == 1, ops
            ops = {**ops, "all_to_all_single": 3}
        assert got_ops[region] == ops, (region, got_ops)
    folds = [n for n in _notes(got_dir, "fold_routing_weights") if "unchanged" in n]
    assert folds and all("are not a grouped GEMM's" in n for n in folds), folds
    _assert_trains_like(got, ref)
    want_val, got_val = (
        {m["step"]: m["val_loss"] for m in _lines(d) if "val_loss" in m} for d in (ref_dir, got_dir)
    )
    assert list(want_val) == list(got_val) == [0, 4]
    for step, loss in want_val.items():
        assert got_val[step] == pytest.approx(loss, rel=1e-5), step


@pytest.mark.slow
def test_expert_and_expert_tp_checkpoint_resumes_on_one_process(corpus, runs):
    """Saved at step 2 of 4 by dp_shard=2 x tp=2 with ep=2 and etp=2 (expert weights and their
    AdamW moments split over ("ep", "tp")), resumed by one process with the same global batch:
    its steps 3 and 4 follow the one-process run (1e-4, as above)."""
    run_dir = runs["dp2_tp2_ep2_etp2"][0]
    shutil.rmtree(run_dir / "checkpoints" / "step-0000004")  # continue from step 2
    args = job(corpus, run_dir.parent, *_COMMON, "--checkpoint.interval=2", _MB[1])
    resumed = train(load_config([*args, "--checkpoint.resume=latest"]))
    straight = [m["loss"] for m in runs["dp1"][1]]
    assert resumed.losses == pytest.approx(straight[2:], rel=1e-4)


def test_expert_tp_must_span_tp():
    with pytest.raises(ValueError, match=r"parallel.etp=2 must be 1 or parallel.tp=4"):
        ParallelDims(tp=4, etp=2, world_size=4)


def test_ep_must_divide_dp_shard():
    with pytest.raises(
        ValueError, match=r"parallel.ep=3 must be >= 1 and divide parallel.dp_shard=4"
    ):
        ParallelDims(dp_shard=4, ep=3, world_size=4)


def test_ep_leaves_a_model_without_experts_alone():
    """A pipeline rank whose stages hold dense layers only (moe-debug's layer 0 on pp=2) has
    no experts to split: it trains as it is (it was refused, and that rank's start failed).
    The config refuses ep > 1 for a dense preset (tests/test_user_errors.py)."""

    class Mesh:
        mesh_dim_names = ("ep",)

    model = build_model(MODEL_PRESETS["debug"])
    before = dict(model.named_parameters())
    apply_ep(model, Mesh())
    after = dict(model.named_parameters())
    assert after.keys() == before.keys() and all(after[n] is p for n, p in before.items())


def test_only_expert_parallel_weights_bypass_fsdp(one_rank_group):
    """expert_params lists the weights FSDP must leave alone and reduce_expert_grads reduces:
    those split over an "ep" axis (alone or with "tp"), never experts split by tp alone (expert
    TP without ep), which are ordinary TP parameters that FSDP shards and averages over dp."""
    from torch.distributed.device_mesh import init_device_mesh

    from graphtrain.parallel import apply_tp, expert_params

    mesh = init_device_mesh("cpu", (1, 1), mesh_dim_names=("ep", "tp"))
    cfg = MODEL_PRESETS["moe-debug"]
    num_moe = cfg.num_layers - cfg.first_k_dense
    for ep_mesh in (mesh["ep"], mesh["ep", "tp"]):
        with torch.device("meta"):
            model = build_model(cfg)
        apply_ep(model, ep_mesh)
        params = expert_params(model)
        assert len(params) == 3 * num_moe
        assert all(p.device_mesh.mesh_dim_names == ep_mesh.mesh_dim_names for p in params)
    with torch.device("meta"):
        model = build_model(cfg)
    apply_tp(model, mesh["tp"], {"layers.*.moe.experts": "experts_hidden"})
    assert expert_params(model) == []
