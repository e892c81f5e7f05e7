"""Pipeline parallelism (graphtrain.parallel.pipeline): the layout string and its start checks,
the stages' init against the whole model's, and pp=2 training on CPU (gloo) against one process.

Training: `debug` (2 layers), 10 steps, fp32; compiled with graphtrain's backend (aot_eager
inner) where the compile meets the pipeline (1F1B's stages, the V schedule's split backward),
eager where a run checks the schedule's arithmetic (GPipe, interleaved, dualpipev, MoE
statistics, fp32 sums) and for the single-process references (compiled and eager agree to
~1e-7, and test_pipeline_layouts.py compiles MoE and MTP stages). The pipeline splits each
step's rows into micro-batches weighted by their labelled tokens, which is the single-process
step's loss written as a sum: losses equal within LOSS_RTOL = 1e-5 (measured: a few 1e-7
relative, fp32 sums in another order). A gradient missing from one stage, scaled twice, or a
stage initialised with other values moves the loss by more than 1e-3 within a few steps at LR
1e-3.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import gloo_runs, job, rank_jobs
from parallel_dist import run_ranks

from graphtrain.config import load_config
from graphtrain.parallel import check_layout
from graphtrain.parallel.pipeline import (
    bubble_fraction,
    cut_model,
    fsdp_roots,
    in_flight_micro_batches,
    parse_layout,
    schedule_class,
    stage_rank,
)
from graphtrain.trainer import train
from models import GPTConfig, build_model

REPO = Path(__file__).resolve().parents[2]
LOSS_RTOL = 1e-5
STEPS = 10
EAGER = "--compile.enable=false"


def _parts(specs):
    return [(s.embedding, s.layers, s.head) for s in specs]


def test_even_split_puts_extra_layers_first():
    specs = parse_layout("", num_layers=5, mtp_depth=0, pp=2, schedule="1f1b")
    assert _parts(specs) == [(True, (0, 1, 2), False), (False, (3, 4), True)]
    specs = parse_layout("", num_layers=4, mtp_depth=0, pp=2, schedule="interleaved_1f1b")
    assert [s.layers for s in specs] == [(0,), (1,), (2,), (3,)]
    assert specs[0].embedding and specs[-1].head


def test_layout_string_with_repeats():
    specs = parse_layout("Et*3|t*4 | t L", num_layers=8, mtp_depth=0, pp=3, schedule="gpipe")
    assert _parts(specs) == [
        (True, (0, 1, 2), False),
        (False, (3, 4, 5, 6), False),
        (False, (7,), True),
    ]
    # Embedding and head alone in their stages (four virtual stages on two ranks).
    specs = parse_layout("E|t|t|L", num_layers=2, mtp_depth=0, pp=2, schedule="zbv")
    assert _parts(specs) == [(True, (), False), (False, (0,), False), (False, (1,), False),
                             (False, (), True)]  # fmt: skip


def test_stage_placement():
    assert [stage_rank(s, 4, 2, "interleaved_1f1b") for s in range(4)] == [0, 1, 0, 1]
    assert [stage_rank(s, 4, 2, "zbv") for s in range(4)] == [0, 1, 1, 0]
    assert [stage_rank(s, 2, 2, "1f1b") for s in range(2)] == [0, 1]


@pytest.mark.parametrize(
    ("layout", "schedule", "message"),
    [
        ("Et*3|tL", "1f1b", r"places 4 transformer layers \(stage 0: 3, stage 1: 1\) but "
                            r"model.num_layers=2"),
        ("Et|t|L", "1f1b", r"has 3 stages but parallel.pp=2 with pp_schedule='1f1b' needs 2"),
        ("Et|tL", "zbv", r"has 2 stages but parallel.pp=2 with pp_schedule='zbv' needs 4"),
        ("Et|tL", "interleaved_1f1b", r"has 2 stages; interleaved_1f1b with parallel.pp=2 needs"),
        ("Et||tL", "interleaved_1f1b", r"has 3 stages"),
        ("Et|t|t|L", "gpipe", r"has 4 stages"),
        ("Ett||L|", "zbv", r"stage 1 is empty"),
        ("tt|EL", "1f1b", r"stage 0 starts with 't'"),
        ("Et|Lt", "1f1b", r"stage 1 has layers after L"),
        ("Et|tX", "1f1b", r"stage 1 'tX' has 'X' at 1"),
        ("Ett|t", "1f1b", r"places 3 transformer layers"),
        ("Et|t", "1f1b", r"the last stage \(1\) must hold L"),
    ],
)  # fmt: skip
def test_bad_layouts_name_the_stage_and_the_count(layout, schedule, message):
    with pytest.raises(ValueError, match=message):
        parse_layout(layout, num_layers=2, mtp_depth=0, pp=2, schedule=schedule)


def test_mtp_layouts():
    """The MTP depths (m) after L in the head's stage, or alone in the stage right after it
    (which then gets the head's hidden state with its loss)."""

    def parse(layout, depth=1, schedule="interleaved_1f1b"):
        return parse_layout(layout, num_layers=2, mtp_depth=depth, pp=2, schedule=schedule)

    specs = parse("E|t|tL|m")
    assert [(s.mtp, s.hidden_to_mtp) for s in specs] == [((), False), ((), False),
                                                         ((), True), ((0,), False)]  # fmt: skip
    (_, head) = parse("Et|tLmm", depth=2, schedule="1f1b")
    assert head.mtp == (0, 1) and not head.hidden_to_mtp
    assert parse("Et|t|L|m")[2].hidden_to_mtp  # the head alone in its stage
    for layout, depth, message in [
        ("E|t|tmL|t", 1, r"stage 2 has m before L"),
        ("E|tm|tL|m", 2, r"stage 1 has 1 MTP depths \(m\) but not after L"),
        ("E|t|tLm|m", 2, r"stage 3 has 1 MTP depths \(m\) after 1 in an earlier stage"),
        ("E|t|tL|m", 2, r"places 1 MTP depths \(m\) but model.mtp_depth=2"),
    ]:
        with pytest.raises(ValueError, match=message):
            parse(layout, depth)


def _check(*args: str, world_size: int = 2) -> None:
    check_layout(load_config(["--preset", "debug", *args]), world_size)


def test_start_checks():
    _check("--parallel.pp=2")  # the default layout of `debug` on two ranks
    with pytest.raises(ValueError, match=r"pp=2 \* dp_replicate=1 \* dp_shard=1 \* tp=1 = 2 != "):
        _check("--parallel.pp=2", "--parallel.dp_shard=1", world_size=4)
    with pytest.raises(ValueError, match=r"pp_microbatches=3 does not divide the 4 rows"):
        _check("--parallel.pp=2", "--parallel.pp_microbatches=3")
    with pytest.raises(ValueError, match=r"model.num_layers=2 cannot fill 4 pipeline stages"):
        _check("--parallel.pp=2", "--parallel.pp_schedule=interleaved_1f1b")
    _check("--parallel.pp=2", "--model.mtp_depth=1", "--parallel.pp_layout=Et|tLm")
    _check("--parallel.pp=2", "--parallel.tp=2", "--model.mtp_depth=1", world_size=4)
    v = ("--parallel.pp=2", "--parallel.pp_layout=E|t|t|L", "--training.device=cuda")
    _check(*v, "--parallel.pp_schedule=dualpipev", "--parallel.dp_shard=2", world_size=4)
    _check(*v, "--parallel.pp_schedule=zbv", "--parallel.dp_replicate=2", world_size=4)
    # MTP beside the embedding on rank 0 under FSDP2 (its own root: stages.fsdp_roots)
    _check(*v, "--parallel.pp_layout=E|t|tL|m", "--model.mtp_depth=1",
           "--parallel.pp_schedule=dualpipev", "--parallel.dp_shard=2", world_size=4)  # fmt: skip
    with pytest.raises(ValueError, match=r"a micro-batch per stage at least \(4 stages\), got "
                                         r"parallel.pp_microbatches=2"):  # fmt: skip
        _check(*v, "--parallel.pp_schedule=dualpipev", "--parallel.pp_microbatches=2")
    always = "--parallel.fsdp_reshard_after_forward=always"
    with pytest.raises(ValueError, match=r"fsdp_reshard_after_forward='always' with parallel.pp_"
                                         r"schedule='zbv': its split backward needs"):  # fmt: skip
        _check(*v, "--parallel.pp_schedule=zbv", "--parallel.dp_shard=2", always, world_size=4)
    _check(*v, "--parallel.pp_schedule=zbv", always)  # no data parallelism: nothing resharded
    _check("--parallel.pp=2", "--parallel.dp_shard=2", always, world_size=4)
    with pytest.raises(ValueError, match=r"pp_schedule must be one of"):
        load_config(["--preset", "debug", "--parallel.pp_schedule=zb"])
    # A recomputed forward would read global-aux step counts later micro-batches have added to.
    moe = ("--preset", "moe-debug", "--model.global_aux_loss_coef=0.01", "--parallel.pp=2")
    check_layout(load_config([*moe]), 2)
    for recompute in ("activation_checkpoint=full", "activation_memory_budget=0.5"):
        with pytest.raises(ValueError, match=r"recompute nothing .* global aux loss to 0"):
            check_layout(load_config([*moe, f"--training.{recompute}"]), 2)


@pytest.mark.parametrize("version", ["2.11.0+cu130", "2.13.0+cpu"])
def test_v_schedules_on_gloo_need_torch_2_12(monkeypatch, version):
    """torch 2.11's pipelining sends from a rank to itself at the start of a V schedule, which
    gloo refuses (seen: "Pair is not connected", zbv and dualpipev on two CPU ranks): refused at
    the start on CPU with it, allowed on CUDA (NCCL) and with later torch."""
    monkeypatch.setattr(torch, "__version__", version)
    v = ("--parallel.pp=2", "--parallel.pp_layout=E|t|t|L", "--parallel.pp_schedule=zbv")
    _check("--parallel.pp=2", "--training.device=cpu")  # 1f1b: one stage per rank
    if version.startswith("2.11"):
        with pytest.raises(ValueError, match=r"pp_schedule='zbv' on CPU ranks \(gloo\) needs "):
            _check(*v, "--training.device=cpu")
    else:
        _check(*v, "--training.device=cpu")
    _check(*v, "--training.device=cuda")


def test_bubble_and_in_flight_micro_batches_of_each_schedule():
    # (pp - 1) / (v n + pp - 1): 3 / 11 for 1F1B at pp=4, n=8; 3 / 19 interleaved with v=2.
    assert bubble_fraction("1f1b", 4, 8, 1) == pytest.approx(3 / 11)
    assert bubble_fraction("gpipe", 4, 8, 1) == pytest.approx(3 / 11)
    assert bubble_fraction("interleaved_1f1b", 4, 8, 2) == pytest.approx(3 / 19)
    assert bubble_fraction("zbv", 4, 8, 2) == 0.0  # n >= 2 pp
    assert bubble_fraction("dualpipev", 4, 6, 2) == pytest.approx(3 / 9)  # at most 1F1B's
    assert [in_flight_micro_batches("1f1b", 4, r, 8) for r in range(4)] == [4, 3, 2, 1]
    assert [in_flight_micro_batches("gpipe", 4, r, 8) for r in range(4)] == [8] * 4
    # Interleaved warm-up, v=2: (v - 1) pp + 2 (pp - 1 - r) + 1 stage forwards, over v.
    assert in_flight_micro_batches("interleaved_1f1b", 4, 0, 8) == pytest.approx(11 / 2)
    assert in_flight_micro_batches("interleaved_1f1b", 4, 3, 8) == pytest.approx(5 / 2)


def test_step_timeline_counts_the_time_outside_the_stages_work_as_idle(monkeypatch):
    """The log's pp/bubble_measured (StepTimeline, host clock on CPU): a 10 s step whose two
    actions take 3 and 4 s, one of them raising, is 30% idle; the next step starts afresh."""
    from graphtrain.parallel.pipeline import runner

    clock = iter([0.0, 1.0, 4.0, 5.0, 9.0, 10.0, 20.0, 21.0, 22.0, 25.0])
    monkeypatch.setattr(runner, "perf_counter", lambda: next(clock))
    timeline = runner.StepTimeline(torch.device("cpu"))
    with pytest.raises(RuntimeError, match="before a step ended"):
        timeline.idle_fraction()
    timeline.begin()
    with timeline.action():
        pass
    with pytest.raises(ValueError), timeline.action():
        raise ValueError
    timeline.end()
    assert timeline.idle_fraction() == pytest.approx(0.3)
    timeline.begin()
    with timeline.action():
        pass
    timeline.end()
    assert timeline.idle_fraction() == pytest.approx(0.8)  # 1 of 5 s: the old actions gone


@pytest.mark.gpu
def test_step_timeline_times_the_gpus_work_with_cuda_events():
    """On a GPU the actions are the GPU's time (CUDA events): queued back to back, two large
    matmuls leave the step almost busy however little the host spent calling them; a host
    pause of 0.2 s between two small ones is GPU idle time, most of the step."""
    import time

    from graphtrain.parallel.pipeline.runner import StepTimeline

    a = torch.randn(4096, 4096, device="cuda")
    (a @ a).sum().item()  # the first GEMM's set-up out of the way
    timeline = StepTimeline(torch.device("cuda"))
    for pause, small in ((0.0, False), (0.2, True)):
        x = a[:64, :64] if small else a
        timeline.begin()
        for _ in range(2):
            with timeline.action():
                for _ in range(1 if small else 20):
                    x = x @ x / x.shape[0] ** 0.5  # the scale kept
            time.sleep(pause)
        timeline.end()
        idle = timeline.idle_fraction()
        assert (idle > 0.8) if small else (idle < 0.1), (pause, idle)


def test_plan_gives_each_pipeline_rank_and_the_bubble():
    """`graphtrain plan` under pp: the stages' parameters add up to the whole model's, the
    first 1F1B rank keeps pp micro-batches' activations of its layers, the last the head."""
    from graphtrain.metrics.memory_plan import plan_memory

    args = ["--preset", "1b", "--schedule.batch_size=131072", "--training.micro_batch_size=4"]
    whole = plan_memory(load_config(args), 1)
    piped = plan_memory(load_config([*args, "--parallel.pp=4"]), 4)
    (note,) = piped.notes
    assert "1f1b, pp=4, 4 stages, 4 micro-batches of 8 rows" in note
    assert f"predicted bubble {3 / 7:.1%}" in note
    totals = [float(x) for x in re.findall(r"rank \d ([\d.]+)", note)]
    assert len(totals) == 4 and totals[0] == max(totals)  # 4 micro-batches in flight
    assert piped.items["activations of 4 micro-batches"] > 0 and "loss buffers" not in piped.items
    # Rank 0 holds the embedding and 4 of the 16 layers: more than a quarter of the model.
    assert whole.items["parameters"] / 4 < piped.items["parameters"] < whole.items["parameters"]
    assert whole.notes == ()


def test_a_schedule_torch_lacks_is_a_clear_error(monkeypatch):
    import torch.distributed.pipelining as pipelining

    monkeypatch.delattr(pipelining, "ScheduleDualPipeV")
    with pytest.raises(ValueError, match=r"'dualpipev' needs torch.distributed.pipelining."):
        schedule_class("dualpipev")


def test_launch_sh_check_refuses_a_bad_layout_before_any_rank_starts():
    env = {
        **os.environ,
        "NGPU": "2",
        "NNODES": "1",
        "VIRTUAL_ENV": str(Path(os.sys.executable).parents[1]),
    }
    out = subprocess.run(
        ["bash", str(REPO / "launch.sh"), "--preset", "debug", "--parallel.pp=2",
         "--parallel.pp_layout=Et*3|tL"],
        capture_output=True, text=True, env=env, timeout=120,
    )  # fmt: skip
    assert out.returncode == 2, out.stderr
    # One line, after launch.sh's install lines where the venv had no install stamp (a venv the
    # tests run in without launch.sh: it installs there once).
    assert out.stderr.strip().splitlines()[-1] == (
        "graphtrain: error: parallel.pp_layout='Et*3|tL' places 4 transformer layers "
        "(stage 0: 3, stage 1: 1) but model.num_layers=2"
    )
    assert "Traceback" not in out.stderr
    assert "torch.distributed.run" not in out.stdout + out.stderr


@pytest.mark.parametrize(
    ("schedule", "layout", "mtp_depth"),
    [("1f1b", "", 0), ("zbv", "", 0), ("interleaved_1f1b", "Et|t|t|tLm", 1),
     ("interleaved_1f1b", "Et|t|t*2L|m", 1), ("zbv", "Et|t|t*2L|m", 1)],
)  # fmt: skip
def test_stages_start_from_the_whole_models_weights(schedule, layout, mtp_depth):
    """Each rank's cut model, initialised alone, holds the whole model's values (bitwise),
    the MTP stage's copies of the embedding, norm and head included. Under zbv the MTP stage
    (3) is on rank 0 beside the embedding's (0): they share the embedding, neither as a child
    (FSDP2 makes it a root of its own) but each with its parameters (the weight half's)."""
    cfg = GPTConfig(vocab_size=96, dim=32, num_layers=4, num_heads=2, num_kv_heads=1, ffn_dim=48,
                    mtp_depth=mtp_depth)  # fmt: skip
    whole = build_model(cfg)
    whole.init_weights(seed=3)
    expected = dict(whole.named_parameters())
    specs = parse_layout(layout, num_layers=4, mtp_depth=mtp_depth, pp=2, schedule=schedule)
    seen = []
    for rank in range(2):
        with torch.device("meta"):
            model = build_model(cfg)
        stages = cut_model(model, specs, rank, 2, schedule, lambda: build_model(cfg))
        model.to_empty(device="cpu")
        model.init_weights(seed=3)
        for name, p in model.named_parameters():
            assert torch.equal(p, expected[name]), name
            seen.append(name)
        assert {s.spec.index for s in stages} == {
            s.index for s in specs if stage_rank(s.index, len(specs), 2, schedule) == rank
        }
        users = [s for s in stages if s.spec.embedding or s.spec.mtp]
        embedding = model.tok_embeddings if len(users) == 2 else None
        for stage in stages:
            assert stage.shared_embedding is embedding
            assert "tok_embeddings" not in dict(stage.named_modules()) or embedding is None
        for stage in users:
            assert any(p is model.tok_embeddings.weight for p in stage.parameters())
        assert fsdp_roots(stages) == [*([embedding] if embedding else []), *stages]
    assert set(seen) == set(expected)  # every parameter lives in a rank's stages
    shared = ["tok_embeddings.weight", "norm.weight", "output.weight"]
    # Interleaved: rank 1 holds the MTP stage (3), rank 0 the embedding and the head (stage 2
    # of 4, or the MTP stage's own with the head in it on rank 1): the copies are on rank 1.
    # zbv: rank 0 holds the embedding's stage (0) and the MTP stage (3), rank 1 the head's (2).
    copies = {name for name in seen if seen.count(name) == 2}
    want = {
        ("interleaved_1f1b", "Et|t|t|tLm"): {"tok_embeddings.weight"},
        ("interleaved_1f1b", "Et|t|t*2L|m"): set(shared),
        ("zbv", "Et|t|t*2L|m"): set(shared[1:]),  # on rank 0; the embedding is its own
    }
    assert copies == want.get((schedule, layout), set())


def _reduced_once_rank(rank: int, world_size: int) -> None:
    """An embedding FSDP2-sharded as a root of its own over 2 ranks, three forward and backward
    passes inside reduced_once: gathered throughout, no gradient reduced until the end, then
    the six passes' gradients reduced once (FSDP2's mean over the ranks), sharded."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    from graphtrain.parallel.pipeline.runner import reduced_once

    torch.manual_seed(0)
    reference = torch.nn.Embedding(10, 4)
    embedding = torch.nn.Embedding(10, 4)
    embedding.load_state_dict(reference.state_dict())
    fully_shard(embedding, mesh=init_device_mesh("cpu", (world_size,)))
    sharded = embedding.weight
    assert isinstance(sharded, DTensor)
    ids = torch.randint(0, 10, (world_size, 3, 5))  # each rank's 3 passes
    weight = torch.randn(5, 4)
    with reduced_once(embedding):
        for i in range(3):
            (embedding(ids[rank, i]) * weight).sum().backward()
            assert embedding.weight is not sharded  # still gathered
            assert sharded.grad is None  # nothing reduced yet
    assert embedding.weight is sharded  # resharded
    for r in range(world_size):
        for i in range(3):
            (reference(ids[r, i]) * weight).sum().backward()
    torch.testing.assert_close(sharded.grad.full_tensor(), reference.weight.grad / world_size)


def test_a_shared_embedding_root_reduces_its_gradient_once_per_step():
    run_ranks(_reduced_once_rank, 2)


def _resharding_stage_rank(rank: int, world_size: int) -> list[tuple[list, list]]:
    """_resharding_stage without and with the runner's resharding."""
    import torch.distributed as dist

    groups = [dist.new_group([r]) for r in range(world_size)]  # every rank makes every group
    return [_resharding_stage(rank, world_size, groups[rank], r) for r in (False, True)]


def _resharding_stage(rank: int, world_size: int, group: Any, reshard: bool) -> tuple[list, list]:
    """One stage (two FSDP2 blocks over the 2 ranks, each rank its own one-stage pipeline) run
    by GPipe over two micro-batches with the runner's stage class: whether the blocks were
    sharded after each backward, and the step's gradients."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.pipelining import ScheduleGPipe
    from torch.distributed.tensor import DTensor

    from graphtrain.parallel.pipeline.runner import StepTimeline, _stage_class

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))
    mesh = init_device_mesh("cpu", (world_size,))
    for block in model:
        fully_shard(block, mesh=mesh)  # resharded after forward
    fully_shard(model, mesh=mesh, reshard_after_forward=False)
    sharded: list[bool] = []

    class Probe(_stage_class(lambda: None, StepTimeline(torch.device("cpu")), reshard)):
        def backward_one_chunk(self, *args: Any, **kwargs: Any) -> Any:
            out = super().backward_one_chunk(*args, **kwargs)
            sharded.append(all(isinstance(p, DTensor) for p in model[0].parameters()))
            return out

    rows = torch.empty(2, 8)
    stage = Probe(model, 0, 1, torch.device("cpu"), input_args=(rows,), output_args=(rows,),
                  group=group)  # fmt: skip
    schedule = ScheduleGPipe(stage, 2, loss_fn=lambda out, y: ((out - y) ** 2).sum())
    torch.manual_seed(1 + rank)
    schedule.step(torch.randn(4, 8), target=torch.randn(4, 8))
    return sharded, [p.grad.full_tensor() for p in model.parameters()]


def test_the_stages_reshard_after_backward_with_always():
    """parallel.fsdp_reshard_after_forward=always under pp: torch's stage keeps its FSDP2 units
    gathered from a backward to the step's end (measured here: gathered after both backwards
    without the runner's resharding); the runner's stage reshards them after each backward,
    with the same gradients (the micro-batches' sums stay unsharded until the reduce)."""
    for (kept_flags, kept_grads), (flags, grads) in run_ranks(_resharding_stage_rank, 2):
        assert kept_flags == [False, False] and flags == [True, True]
        for a, b in zip(kept_grads, grads, strict=True):
            torch.testing.assert_close(b, a, rtol=0, atol=0)


@pytest.fixture(scope="module")
def single_run(corpus, tmp_path_factory):
    """The single-process run of common_args (the reference of several pipelines), eager: its
    compiled form agrees to ~1e-7 and is not what the pipelines' tests test."""
    args = job(corpus, tmp_path_factory.mktemp("single"), *common_args(corpus), EAGER)
    return train(load_config(args))


@pytest.fixture(scope="module")
def pipeline_runs(corpus, tmp_path_factory, single_run):
    """Single-process runs and pp=2 runs of the same jobs (one launch for all:
    conftest.rank_jobs)."""
    tmp = tmp_path_factory.mktemp("pipeline")
    common = common_args(corpus)
    # Two loader micro-batches of 4 rows per step: gpipe splits the 8 rows in 4.
    two_micro = ["--schedule.batch_size=512"]
    # MoE: the pipeline's micro-batches are the single process's (the aux losses depend on
    # them): two loader micro-batches of 2 rows, split back into the same two.
    moe = ["--preset=moe-debug", "--training.micro_batch_size=2", "--schedule.batch_size=256"]
    # Pure bf16 with every gradient summed in fp32, four one-row micro-batches, no clipping.
    bf16 = ["--training.master_dtype=bfloat16", "--optim.fp32_grad_accum=*",
            "--optim.max_norm=0", "--training.micro_batch_size=1", "--schedule.batch_size=256"]  # fmt: skip
    mtp = ["--model.mtp_depth=1"]
    # Every pipeline but 1F1B eager (docstring); every reference eager.
    single = {
        "one": single_run,
        "two": train(load_config(job(corpus, tmp / "two", *common, EAGER, *two_micro))),
        "moe": train(load_config(job(corpus, tmp / "moe", *common, EAGER, *moe))),
        "bf16": train(load_config(job(corpus, tmp / "bf16", *common, EAGER, *bf16))),
        "bf16_mtp": train(load_config(job(corpus, tmp / "bf16_mtp", *common, EAGER, *mtp, *bf16))),
    }
    layouts = {
        "1f1b": ("one", ["--parallel.pp_microbatches=4"]),
        "gpipe": ("two", [EAGER, *two_micro, "--parallel.pp_schedule=gpipe",
                          "--parallel.pp_microbatches=4"]),
        "moe_1f1b": ("moe", [EAGER, *moe, "--parallel.pp_microbatches=2"]),
        "bf16_1f1b": ("bf16", [EAGER, *bf16, "--parallel.pp_microbatches=4"]),
        "bf16_mtp_stage": ("bf16_mtp", [EAGER, *bf16, *mtp, "--parallel.pp_microbatches=4",
                                        "--parallel.pp_schedule=interleaved_1f1b",
                                        "--parallel.pp_layout=E|t|tL|m"]),
    }  # fmt: skip
    jobs = [
        job(corpus, tmp / name, *common, "--parallel.pp=2", *args)
        for name, (_, args) in layouts.items()
    ]
    runs = dict(zip(layouts, rank_jobs(2, jobs), strict=True))
    return {name: (single[ref], runs[name]) for name, (ref, _) in layouts.items()}


def common_args(corpus, steps: int = STEPS) -> list[str]:
    """A short fp32 run logging every step, validated at its start and end."""
    return [
        f"--training.steps={steps}",
        "--metrics.log_interval=1",
        "--metrics.val_interval=0",
        "--metrics.validate=true",
        f"--data.val_paths={corpus / 'docs.jsonl'}",
    ]


def compare(single, metrics) -> None:
    losses = [m["loss"] for m in metrics if "loss" in m]
    assert len(losses) == len(single.losses) > 0
    assert losses == pytest.approx(single.losses, rel=LOSS_RTOL)
    vals = {m["step"]: m["val_loss"] for m in metrics if "val_loss" in m}
    assert vals.keys() == single.val_losses.keys()
    for step, value in vals.items():
        assert value == pytest.approx(single.val_losses[step], rel=LOSS_RTOL)


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_pp2_follows_the_single_process_curve(pipeline_runs, schedule):
    single, metrics = pipeline_runs[schedule]
    compare(single, metrics)
    # The schedule's predicted bubble beside tokens/s and MFU: (pp - 1) / (n + pp - 1).
    bubbles = [m["pp/bubble_predicted"] for m in metrics if "loss" in m]
    assert bubbles == [pytest.approx(1 / (4 + 1))] * STEPS
    _assert_measured_bubble(metrics)
    # Gradient and parameter norms are over every stage, not rank 0's alone.
    lines = (single.run_dir / "metrics.jsonl").read_text().splitlines()
    reference = [json.loads(x) for x in lines]
    for key in ("grad_norm", "param_norm"):
        want = [m[key] for m in reference if key in m]
        got = [m[key] for m in metrics if key in m]
        assert len(got) == STEPS
        assert got == pytest.approx(want, rel=LOSS_RTOL)


@pytest.mark.slow
def test_fp32_gradient_sums_take_each_pipeline_micro_batch(pipeline_runs):
    """Pure bf16 with optim.fp32_grad_accum = ["*"]: each of the schedule's four micro-batches'
    gradients goes into the fp32 sums after its backward (the stages' after_backward), as each
    loader micro-batch's does in one process: the same bits every step (clipping off: the
    bf16 norm is taken per stage under pp, at once in one process). Summed by autograd in bf16
    across the schedule's micro-batches, as before, the first step's gradients were 6e-3 off."""
    single, metrics = pipeline_runs["bf16_1f1b"]
    assert [m["loss"] for m in metrics if "loss" in m] == single.losses
    # With MTP in a stage of its own, whose copies of the embedding, norm and head sum their
    # gradients with their owners' once the fp32 sums are back as .grad: each side rounded to
    # bf16 before that sum, where one process rounds once (measured: 3.5e-5 over 10 steps;
    # summed before the fp32 sums came back, the copies missed it: 8e-4 at step 2).
    single, metrics = pipeline_runs["bf16_mtp_stage"]
    got = [m["loss"] for m in metrics if "loss" in m]
    assert got == pytest.approx(single.losses, rel=1e-4)


@pytest.mark.slow
def test_moe_pp2_follows_the_single_process_curve(pipeline_runs):
    """moe-debug's layers 1 (stage 0) and 2 (stage 1) are MoE: aux losses scaled per
    micro-batch, global aux over the step's micro-batches, expert bias updated on each stage;
    every layer's statistics reach the log."""
    single, metrics = pipeline_runs["moe_1f1b"]
    compare(single, metrics)
    lines = (single.run_dir / "metrics.jsonl").read_text().splitlines()
    reference = [json.loads(x) for x in lines if '"loss"' in x]
    got = [m for m in metrics if "loss" in m]
    names = [k for k in reference[-1] if k.startswith("moe/")]
    assert {"moe/layers.1/bias_absmax", "moe/layers.2/bias_absmax", "moe/global_aux_loss"} <= set(
        names
    )
    assert reference[-1]["moe/layers.2/bias_absmax"] > 0  # the bias did move
    for want, have in zip(reference, got, strict=True):
        for name in names:
            assert have[name] == pytest.approx(want[name], rel=LOSS_RTOL, abs=1e-7), name


MULTI_STAGE = ["interleaved_1f1b", "zbv", "dualpipev"]


@pytest.fixture(scope="module")
def multi_stage_runs(corpus, tmp_path_factory, single_run):
    """Two virtual stages per rank (E|t|t|L on two ranks) for each multi-stage schedule."""
    tmp = tmp_path_factory.mktemp("pipeline_multi")
    common = common_args(corpus)
    layout = ["--parallel.pp=2", "--parallel.pp_layout=E|t|t|L"]
    names = [name for name in MULTI_STAGE if gloo_runs(name)]
    # zbv compiled (its split backward), the others eager (docstring)
    jobs = [
        job(corpus, tmp / name, *common, *layout, f"--parallel.pp_schedule={name}",
            *(() if name == "zbv" else (EAGER,)))
        for name in names
    ]  # fmt: skip
    return single_run, dict(zip(names, rank_jobs(2, jobs), strict=True))


@pytest.mark.slow
@pytest.mark.parametrize("schedule", MULTI_STAGE)
def test_multi_stage_schedules_follow_the_single_process_curve(multi_stage_runs, schedule):
    """Interleaved 1F1B and the zero-bubble V schedules (split input / weight backward; zbv
    compiled: AOT autograd's donated buffers off) give the single-process losses."""
    single, runs = multi_stage_runs
    if schedule not in runs:
        pytest.skip(f"torch {torch.__version__} runs no {schedule} on gloo (refused at start)")
    compare(single, runs[schedule])
    _assert_measured_bubble(runs[schedule])


def _assert_measured_bubble(metrics: list[dict]) -> None:
    """Every logged step has its measured bubble, the mean over the pp ranks of the time
    each spent outside its stages' work: some (a rank waits for the other's first forward or
    last backward at least), never all of it. Its value on loaded CPU ranks says nothing of a
    GPU's (so no tighter bound)."""
    measured = [m["pp/bubble_measured"] for m in metrics if "loss" in m]
    assert len(measured) == STEPS and all(0 < x < 1 for x in measured), measured


def _zbv_as_interleaved(
    corpus: Path, tmp_path: Path, nproc: int, *args: str, also: tuple[str, ...] = ()
) -> None:
    """zbv and interleaved 1F1B, E|t|t|L with two micro-batches on `nproc` CPU ranks (eager),
    give the same losses and gradient norms over 3 steps (measured: bitwise equal); and so
    does interleaved 1F1B with the arguments `also`, if given."""
    if not gloo_runs("zbv"):
        pytest.skip(f"torch {torch.__version__} runs no zbv on gloo (refused at start)")
    common = ["--training.steps=3", "--metrics.log_interval=1", "--compile.enable=false",
              "--parallel.pp=2", "--parallel.pp_layout=E|t|t|L", "--parallel.pp_microbatches=2",
              *args]  # fmt: skip
    runs = {n: (f"--parallel.pp_schedule={n}",) for n in ("interleaved_1f1b", "zbv")}
    if also:
        runs["also"] = ("--parallel.pp_schedule=interleaved_1f1b", *also)
    jobs = [job(corpus, tmp_path / name, *common, *extra) for name, extra in runs.items()]
    interleaved, *others = ([m for m in lines if "loss" in m] for lines in rank_jobs(nproc, jobs))
    for name, metrics in zip(list(runs)[1:], others, strict=True):
        assert len(metrics) == len(interleaved) == 3, name
        for a, b in zip(interleaved, metrics, strict=True):
            for key in ("loss", "grad_norm"):
                assert b[key] == pytest.approx(a[key], rel=1e-6), (name, a["step"], key)


@pytest.mark.slow  # 4 ranks, two jobs
def test_zbv_with_fsdp_trains_as_interleaved_1f1b(corpus, tmp_path):
    """zbv under FSDP2 (pp=2 x dp_shard=2): the same stages and micro-batches on the same
    data-parallel ranks as interleaved 1F1B. Eager: what went wrong was FSDP2's resharding,
    not the compiler. When FSDP2 resharded a block after its forward, its stage's parameters
    were sharded when torch's input half of the split backward listed the parameters its
    weight half differentiates: none found, so the weight halves of stage 1's first
    micro-batches gave no gradient (grad norm 2.3220 against 2.3253 at the first step).
    Interleaved 1F1B with parallel.fsdp_reshard_after_forward=always (each block gathered again
    for each micro-batch's forward and backward) trains the same."""
    _zbv_as_interleaved(corpus, tmp_path, 4, "--parallel.dp_shard=2",
                        "--training.micro_batch_size=2", "--schedule.batch_size=256",
                        also=("--parallel.fsdp_reshard_after_forward=always",))  # fmt: skip


@pytest.mark.slow  # 2 ranks, two jobs
def test_zbv_with_working_copies_trains_as_interleaved_1f1b(corpus, tmp_path):
    """bf16 compute on fp32 masters with their bf16 working copies (training.working_weights).
    zbv's weight half sets each copy's .grad itself, which runs no post-accumulate-grad hook:
    the pipeline moves those gradients into the masters after each backward
    (WorkingWeights.collect_grads). Without that the masters stepped without them (loss 6.53
    against 6.03 after 10 steps), and the copies were turned off under the zero-bubble
    schedules."""
    _zbv_as_interleaved(corpus, tmp_path, 2, "--training.dtype=bfloat16")


def compiled_head_stage(dump_dir: Path) -> tuple[Any, torch.Tensor]:
    """The head stage of a 2-layer model on pp=2, its block and head+loss regions
    compiled with graphtrain's backend (aot_eager inner), one micro-batch set; and an input
    for it (no process group needed to run a stage)."""
    from graphtrain.compile import apply_compile

    torch._dynamo.reset()
    cfg = GPTConfig(vocab_size=96, dim=32, num_layers=2, num_heads=2, num_kv_heads=1, ffn_dim=48)
    specs = parse_layout("", num_layers=2, mtp_depth=0, pp=2, schedule="1f1b")
    with torch.device("meta"):
        model = build_model(cfg)
    (stage,) = cut_model(model, specs, 1, 2, "1f1b", lambda: build_model(cfg))
    apply_compile(model, inner="aot_eager", dump_dir=dump_dir, regions={"block", "head_loss"})
    model.to_empty(device="cpu")
    model.init_weights(seed=0)
    B, T = 2, 16
    labels = torch.randint(0, cfg.vocab_size, (B, T))
    positions = torch.arange(T).expand(B, T)
    stage.micro_batches = [{"labels": labels, "position_ids": positions, "attn_mask": None}]
    return stage, torch.randn(B, T, cfg.dim)


def test_last_stage_compiles_the_fused_loss(tmp_path):
    """The head stage's head+loss region, compiled with graphtrain's backend, gets the fused
    linear + cross-entropy op, as in one process."""
    stage, h = compiled_head_stage(tmp_path)
    h.requires_grad_()
    loss = stage(h, micro_batch=torch.tensor([0]))
    loss.sum().backward()
    assert loss.shape == (1,) and h.grad is not None
    fused = 0
    for summary in tmp_path.glob("*/summary.json"):
        for step in json.loads(summary.read_text()):
            fused += step["op_counts"].get("graphtrain.linear_cross_entropy.default", 0)
    assert fused >= 1


def test_split_backward_reaches_the_weights_of_a_compiled_stage(tmp_path):
    """A zero-bubble schedule's two halves as torch's pipelining runs them on a compiled stage
    (stage_backward_input, which detaches the stage's outputs, then stage_backward_weight from
    the nodes it found) give one backward's gradients. The weight half starts from the compiled
    region's node, which only the detached outputs held: on torch 2.11 and 2.12 it was freed
    and the half raised ("Attribute '_input_metadata' is invalid ..."; seen on 2.12.1 in the
    zbv and dualpipev runs) unless the stage keeps views of its outputs (`graphs`, a list while
    the runner's _split_backward is on). 2.13 keeps that node itself, so this passes there
    either way; on 2.11 and 2.12 it fails with `graphs` None."""
    from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight

    from graphtrain.compile import split_backward_flags
    from graphtrain.parallel.pipeline.runner import PipelineRunner

    stage, h0 = compiled_head_stage(tmp_path)
    weights = list(stage.parameters())

    def gradients(split: bool) -> list[torch.Tensor]:
        stage.zero_grad(set_to_none=True)
        h = h0.clone().requires_grad_()
        stage.graphs = [] if split else None
        # The schedule's loss_fn on the stage's output, which nothing else holds.
        loss = PipelineRunner._loss(stage(h, micro_batch=torch.tensor([0])), torch.ones(1))
        if split:
            _, groups = stage_backward_input([loss], None, [h], iter(weights))
            assert loss.grad_fn is None and len(stage.graphs) == 1  # detached; one view kept
            stage_backward_weight(iter(weights), groups)
        else:
            loss.backward()
        stage.graphs = None
        return [h.grad, *(p.grad for p in weights)]

    with split_backward_flags():  # as the runner's _split_backward: a second backward call
        want, split = gradients(split=False), gradients(split=True)
    for got, ref in zip(split, want, strict=True):
        torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-7)


def test_hybrid_stages_give_the_whole_models_loss_and_gradients():
    """hybrid-debug (Gated DeltaNet layers 0-2, attention 3) cut into two stages run one after
    the other in one process, on rows of two packed documents: the loss and every gradient are
    the whole model's, bitwise (eager fp32, the same ops in the same order). A recurrent layer
    not given the document ids carries its state across the boundary (measured: the loss 2e-5
    off); a stage initialised without the Gated DeltaNet's own draws, 1.6e-2."""
    from graphtrain.attention import build_attention_mask

    cfg = load_config(["--preset", "hybrid-debug"]).model
    specs = parse_layout("", num_layers=cfg.num_layers, mtp_depth=0, pp=2, schedule="1f1b")
    whole = build_model(cfg)
    whole.init_weights(seed=0)
    stages = []
    for rank in range(2):
        with torch.device("meta"):
            model = build_model(cfg)
        stages += cut_model(model, specs, rank, 2, "1f1b", lambda: build_model(cfg))
        model.to_empty(device="cpu")
        model.init_weights(seed=0)
    B, T = 2, 48
    torch.manual_seed(1)
    tokens = torch.randint(0, cfg.vocab_size, (B, T + 1))
    documents = (torch.arange(T) >= 20).long().expand(B, T)  # a boundary at position 20
    positions = torch.where(documents == 0, torch.arange(T), torch.arange(T) - 20)
    inputs = {"input_ids": tokens[:, :-1], "labels": tokens[:, 1:], "position_ids": positions,
              "attn_mask": build_attention_mask(documents, "sdpa"), "document_ids": documents}  # fmt: skip
    want = whole(**inputs)
    want.backward()
    h = inputs["input_ids"]
    for stage in stages:
        stage.micro_batches = [inputs]
        h = stage(h, micro_batch=torch.tensor(0))
    h.sum().backward()
    assert torch.equal(h.reshape(()), want)
    grads = {n: p.grad for stage in stages for n, p in stage._model.named_parameters()}
    assert grads.keys() == dict(whole.named_parameters()).keys()
    for name, p in whole.named_parameters():
        assert torch.equal(grads[name], p.grad), name


def test_split_backward_gradients_take_their_parameters_layout(tmp_path):
    """torch's weight half of a zero-bubble step sets each weight's gradient as autograd.grad
    returns it: a compiled MoE stage's experts' w1 and w3 (one fused GEMM) get strided views,
    which torch's fused AdamW on CPU reads as if contiguous (one expert's update applied to
    another: measured on 2.13). The runner's _grads_in_param_layout copies them into their
    parameters' layout, values unchanged; the fused step then equals the one-backward step."""
    from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight

    from graphtrain.compile import apply_compile, split_backward_flags
    from graphtrain.parallel.pipeline.runner import _grads_in_param_layout

    torch._dynamo.reset()
    cfg = load_config(["--preset", "moe-debug", "--model.num_layers=2"]).model
    specs = parse_layout("", num_layers=2, mtp_depth=0, pp=2, schedule="1f1b")
    with torch.device("meta"):
        model = build_model(cfg)
    (stage,) = cut_model(model, specs, 1, 2, "1f1b", lambda: build_model(cfg))  # MoE layer 1
    apply_compile(model, inner="aot_eager", dump_dir=tmp_path, regions={"block", "head_loss"})
    model.to_empty(device="cpu")
    model.init_weights(seed=0)
    B, T = 2, 16
    torch.manual_seed(0)
    stage.micro_batches = [{"labels": torch.randint(0, cfg.vocab_size, (B, T)),
                            "position_ids": torch.arange(T).expand(B, T), "attn_mask": None}]  # fmt: skip
    h0 = torch.randn(B, T, cfg.dim)
    weights = [p for p in stage.parameters() if p.requires_grad]

    def step(split: bool) -> list[torch.Tensor]:
        model.init_weights(seed=0)
        stage.zero_grad(set_to_none=True)
        h = h0.clone().requires_grad_()
        stage.graphs = [] if split else None  # as the runner's _split_backward (torch 2.11)
        loss = stage(h, micro_batch=torch.tensor([0])).sum()
        if split:
            _, groups = stage_backward_input([loss], None, [h], iter(weights))
            stage_backward_weight(iter(weights), groups)
            assert any(not p.grad.is_contiguous() for p in weights)  # the experts' w1, w3
            grads = [p.grad.clone() for p in weights]
            _grads_in_param_layout(weights)
            assert all(p.grad.is_contiguous() for p in weights)
            assert all(torch.equal(p.grad, g) for p, g in zip(weights, grads, strict=True))
        else:
            loss.backward()
        torch.optim.AdamW(weights, lr=1e-3, fused=True).step()
        return [p.detach().clone() for p in weights]

    with split_backward_flags():
        for got, want in zip(step(split=True), step(split=False), strict=True):
            torch.testing.assert_close(got, want, rtol=0, atol=1e-7)
    stage.graphs = None
