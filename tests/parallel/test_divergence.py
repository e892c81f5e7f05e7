"""Rank divergence: a clean 2-rank run passes the replica check; one rank's parameter or
optimizer state perturbed by one ulp is named, with the ranks, on every rank."""

from __future__ import annotations

import torch
from parallel_dist import run_ranks
from parallel_scenarios import batch, build_gpt, config

CASES = [
    ({"tp": 2}, "param", "layers.1.ffn_norm.weight (ranks 0 vs ranks 1)"),
    (
        {"dp_replicate": 2, "dp_shard": 1},
        "exp_avg",
        "layers.1.ffn_norm.weight (optimizer exp_avg) (ranks 0 vs ranks 1)",
    ),
]


def _cases(rank: int, world_size: int) -> list[list[str]]:
    """Every case in one spawn (process start and imports are most of the cost)."""
    return [_check_after_a_step(rank, world_size, dims, perturb) for dims, perturb, _ in CASES]


def _check_after_a_step(rank: int, world_size: int, dims: dict, perturb: str) -> list[str]:
    """Messages of the replica check (empty: passed) on a clean model after one AdamW step,
    then with rank 1's `perturb` (the parameter or its exp_avg) one ulp off."""
    from torch.distributed.tensor import DTensor

    from graphtrain.parallel import ParallelDims, build_mesh, parallelize_model
    from graphtrain.parallel.divergence import ReplicaDivergenceError, check_replicas
    from models.gpt_plan import GPT_TP_PLAN

    dims = ParallelDims(**dims, world_size=world_size)
    mesh = build_mesh(dims, "cpu")
    with torch.device("meta"):
        model = build_gpt(config())
    parallelize_model(
        model,
        mesh,
        dims,
        plan=GPT_TP_PLAN,
        ac_mode="none",
        compile_options=None,
        param_dtype=torch.float32,
        reduce_dtype=torch.float32,
    )
    model.to_empty(device="cpu")
    model.init_weights(0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = batch(mask=False)
    if dims.dp_size > 1:  # each replica its own rows: the gradients must be reduced to agree
        data = {k: v[rank::world_size] for k, v in data.items()}
    model(**data).backward()
    optimizer.step()
    messages = []
    for what in ("nothing", perturb):
        if what != "nothing" and rank == 1:
            param = dict(model.named_parameters())["layers.1.ffn_norm.weight"]
            target = param if what == "param" else optimizer.state[param]["exp_avg"]
            local = target.to_local() if isinstance(target, DTensor) else target
            with torch.no_grad():  # one ulp of one element
                local.view(-1)[3] = torch.nextafter(local.view(-1)[3], torch.tensor(9.0))
        try:
            check_replicas(model, optimizer, step=7)
            messages.append("")
        except ReplicaDivergenceError as e:
            messages.append(str(e))
    return messages


def test_a_perturbed_rank_is_named():
    results = run_ranks(_cases, 2)
    for (_, _, named), *per_rank in zip(CASES, *results, strict=True):
        for clean, perturbed in per_rank:
            assert clean == ""
            assert perturbed.startswith("replicas diverged at step 7: " + named)
