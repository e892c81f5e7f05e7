"""Memory plan: the predicted parameter shards equal those of the model parallelized on a fake
8-rank group (dense tp, dp_replicate, MoE with ep x tp), and `graphtrain plan` prints an 8B
layout on 64 ranks without any device and refuses one that cannot fit, naming the biggest item."""

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from graphtrain.cli import _plan
from graphtrain.config import load_config
from graphtrain.metrics.memory_plan import plan_memory
from graphtrain.parallel import ParallelDims, build_mesh, parallelize_model
from models import build_model, tp_plan

fake_pg = pytest.importorskip("torch.testing._internal.distributed.fake_pg")


@pytest.mark.parametrize(
    "args",
    [
        ["--preset", "debug", "--parallel.tp=2"],
        ["--preset", "debug", "--parallel.tp=2", "--parallel.dp_replicate=2"],
        ["--preset", "moe-debug", "--parallel.ep=2", "--parallel.tp=2"],
        ["--preset", "moe-debug", "--parallel.tp=2", "--parallel.etp=2"],
    ],
)
def test_parameter_shards_match_the_parallelized_model(args):
    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    cfg = load_config(args)
    p = cfg.parallel
    dist.init_process_group("fake", store=fake_pg.FakeStore(), rank=3, world_size=8)
    try:
        dims = ParallelDims(
            dp_replicate=p.dp_replicate,
            dp_shard=p.dp_shard,
            tp=p.tp,
            ep=p.ep,
            etp=p.etp,
            world_size=8,
        )
        with torch.device("meta"):
            model = build_model(cfg.model)
        parallelize_model(
            model,
            build_mesh(dims, "cpu"),
            dims,
            plan=tp_plan(cfg.model, dims.etp, dims.ep),
            ac_mode="none",
            compile_options=None,
            param_dtype=torch.float32,
            reduce_dtype=torch.float32,
        )
        local = sum(
            (q.to_local() if isinstance(q, DTensor) else q).numel() for q in model.parameters()
        )
    finally:
        dist.destroy_process_group()
    plan = plan_memory(cfg, 8)
    assert plan.items["parameters"] == local * 4  # fp32 master weights
    assert plan.items["optimizer states"] == 2 * local * 4
    assert plan.total == sum(plan.items.values())


def test_gathered_parameters_are_every_block_of_a_pipeline_rank():
    """FSDP's gathered parameters: the largest block twice (running and prefetched) without
    pp; under pp each block of the rank's stages, which stay gathered from forward to backward
    (graphtrain.parallel): 3 blocks on each of two pp ranks of a 6-layer model. With
    parallel.fsdp_reshard_after_forward, always: two blocks under pp too; never: all six
    without pp."""
    six = ["--preset", "debug", "--model.num_layers=6"]

    def gathered(*args: str) -> float:
        return plan_memory(load_config([*six, *args]), 4).items["gathered parameters"]

    block = gathered("--parallel.dp_shard=4") / 2
    assert block > 0
    piped = ("--parallel.dp_shard=2", "--parallel.pp=2")
    assert gathered(*piped) == 3 * block
    assert gathered(*piped, "--parallel.fsdp_reshard_after_forward=always") == 2 * block
    assert gathered("--parallel.dp_shard=4", "--parallel.fsdp_reshard_after_forward=never") == (
        6 * block
    )


def test_pipeline_ranks_hold_their_whole_gradient_until_the_step_ends():
    """Under pp x FSDP the stages sum the micro-batches' gradients unsharded (FSDP2's no-sync,
    torch's pipeline stages) and reduce-scatter them once per step: the rank's whole gradient
    in the reduce dtype, not its shard (measured so: tests/parallel/test_pipeline.py's
    reduced_once test sees the sharded gradient empty until the end). moe-debug's experts
    under ep are reduced by graphtrain itself, their ep shard."""
    six = ["--preset", "debug", "--model.num_layers=6"]

    def items(*args: str) -> dict[str, float]:
        return plan_memory(load_config([*six, *args]), 8).items

    flat = items("--parallel.dp_shard=8")
    assert flat["gradients"] == flat["parameters"]  # fp32 shards
    for dp in (2, 4):
        piped = items(f"--parallel.dp_shard={dp}", f"--parallel.pp={8 // dp}")
        assert piped["gradients"] == dp * piped["parameters"]
        bf16 = items(f"--parallel.dp_shard={dp}", f"--parallel.pp={8 // dp}",
                     "--training.reduce_dtype=bfloat16")  # fmt: skip
        assert bf16["gradients"] == dp * piped["parameters"] / 2
    # The routed experts E: with ep=1 FSDP shards them (E / 4 stored, E gradient in the step),
    # with ep=2 each rank holds E / 2 of parameters and of gradient.
    moe = ["--preset", "moe-debug", "--parallel.dp_shard=4", "--parallel.pp=2"]
    ep1, ep2 = (plan_memory(load_config([*moe, f"--parallel.ep={ep}"]), 8).items for ep in (1, 2))
    experts = ep2["parameters"] - ep1["parameters"]  # (E / 2 - E / 4) x 4 bytes = E
    assert experts > 0
    assert ep1["gradients"] - ep2["gradients"] == pytest.approx(2 * experts, abs=8)  # 4E - 2E


def test_plan_command_prints_a_layout_and_refuses_one_that_does_not_fit(capsys):
    assert _plan(["--preset", "8b", "--ngpu", "64", "--parallel.tp=8"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("predicted memory per rank (GiB): parameters ")
    assert "activations per micro-batch" in out and "loss buffers" in out
    with pytest.raises(ValueError, match=r"the biggest item is optimizer states \(\d+\.\d GiB\)"):
        _plan(["--preset", "8b", "--ngpu", "8", "--parallel.tp=8", "--device-memory", "10GB"])

    def activations(ac: str, budget: float = 1.0) -> int:
        args = [
            f"--training.activation_checkpoint={ac}",
            f"--training.activation_memory_budget={budget}",
        ]
        return plan_memory(load_config(["--preset", "8b", *args]), 64).items[
            "activations per micro-batch"
        ]

    full, none = activations("full"), activations("none")
    assert full < none / 4
    # The budget keeps the blocks' inputs (what full keeps, beside one block's recompute) plus
    # b of the rest, and a block's backward holds 1 - b of its recompute: full + b (none - full).
    for b in (0.5, 0.2):
        assert activations("none", b) == pytest.approx(full + b * (none - full))


def test_working_copies():
    """The bf16 working copies of the matmul weights: 2 bytes each, with one rank under bf16;
    none with data parallelism (FSDP2 casts), fp32 compute, or the key off; under FSDP with
    ep=2, the routed experts' weights that FSDP leaves alone, half of them per rank; never the
    experts' w1 and w3 where fuse_sibling_grouped_mm concatenates them (the trainer's choice)."""
    cfg = load_config(["--preset", "debug", "--training.dtype=bfloat16"])
    with torch.device("meta"):
        model = build_model(cfg.model)
    matmul = (
        sum(p.numel() for n, p in model.named_parameters() if p.ndim >= 2 and "tok_emb" not in n)
        - model.output.weight.numel()
    )
    assert plan_memory(cfg, 1).items["working copies"] == 2 * matmul
    for args, world in (
        (["--training.dtype=bfloat16"], 2),
        (["--training.dtype=float32"], 1),
        (["--training.dtype=bfloat16", "--training.working_weights=false"], 1),
    ):
        assert (
            "working copies"
            not in plan_memory(load_config(["--preset", "debug", *args]), world).items
        )
    moe = load_config(["--preset", "moe-debug", "--training.dtype=bfloat16", "--parallel.ep=2"])
    with torch.device("meta"):
        model = build_model(moe.model)
    # The routed experts' w1 and w3 are concatenated in the graph (no copies): w2 alone.
    w2 = sum(p.numel() for n, p in model.named_parameters() if n.endswith(".experts.w2"))
    assert plan_memory(moe, 2).items["working copies"] == 2 * w2 // 2
    w13 = sum(
        p.numel() for n, p in model.named_parameters() if n.endswith((".experts.w1", ".experts.w3"))
    )
    single, unfused = (
        plan_memory(load_config(["--preset", "moe-debug", "--training.dtype=bfloat16", *a]), 1)
        for a in ((), ('--compile.passes=["-fuse_sibling_grouped_mm"]',))
    )
    assert single.items["working copies"] == unfused.items["working copies"] - 2 * w13
