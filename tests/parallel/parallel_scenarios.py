"""A small training run, single-process (the reference) or on ranks with a parallel layout.

Both build the "debug" GPT on the meta device, init it with the same seed and take STEPS AdamW
steps on the same global batch; a rank with data parallelism reads its dp slice of the rows.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch

from models import tp_plan
from models.gpt import PRESETS, build_gpt

SEED = 1234
STEPS = 3
BATCH, SEQ = 4, 16  # SEQ divisible by tp=2 (sequence parallel), BATCH by dp=4
LR = 1e-2  # large enough that 3 steps move the loss well beyond the tolerance


def config(tie: bool = False, mtp: int = 0):
    return dataclasses.replace(PRESETS["debug"], tie_embeddings=tie, mtp_depth=mtp)


def batch(mask: bool) -> dict[str, torch.Tensor]:
    """The global batch. mask=True: two documents per row (block-diagonal causal bool mask,
    positions restarting at each document, document ids for the MTP shifts), the
    packed-sequence path."""
    g = torch.Generator().manual_seed(SEED + 1)
    vocab = config().vocab_size
    out = {
        "input_ids": torch.randint(0, vocab, (BATCH, SEQ), generator=g),
        "labels": torch.randint(0, vocab, (BATCH, SEQ), generator=g),
    }
    if mask:
        cut = 6  # document boundary, not at the tp shard boundary on purpose
        doc = (torch.arange(SEQ) >= cut).long()
        same_doc = doc[:, None] == doc[None, :]
        causal = torch.ones(SEQ, SEQ, dtype=torch.bool).tril()
        out["attn_mask"] = (same_doc & causal).expand(BATCH, 1, SEQ, SEQ).clone()
        pos = torch.arange(SEQ) - torch.where(doc.bool(), cut, 0)
        out["position_ids"] = pos.expand(BATCH, SEQ).clone()
        out["document_ids"] = doc.expand(BATCH, SEQ).clone()
    return out


def _train(
    model: torch.nn.Module, data: dict[str, torch.Tensor], reduce_loss, finish_grads=None
) -> list[float]:
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)
    losses = []
    for _ in range(STEPS):
        loss = model(**data)
        loss.backward()
        if finish_grads is not None:
            finish_grads()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(reduce_loss(loss.detach()))
    return losses


def reference(tie: bool = False, mask: bool = False, mtp: int = 0) -> dict[str, Any]:
    """Single process: initial parameters and the STEPS losses."""
    with torch.device("meta"):
        model = build_gpt(config(tie, mtp))
    model.to_empty(device="cpu")
    model.init_weights(SEED)
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    return {"params": params, "losses": _train(model, batch(mask), lambda loss: loss.item())}


def run_specs(
    rank: int, world_size: int, specs: list[dict[str, Any]], checks: tuple = ()
) -> dict[str, Any]:
    """Entry point for parallel_dist.run_ranks: the AOTAutograd cache switch (before anything
    else compiles), mesh checks, parallel_run for each spec, then each of `checks` (module-level
    functions of rank and world size), all in the same processes (one spawn: process start and
    imports are most of the cost). Results by spec name and check name."""
    results = {"aot_cache": aot_cache_after_compile(rank, world_size)}
    results["mesh"] = mesh_checks(world_size)
    for spec in specs:
        # Compiled regions of the previous spec's model are dead; drop them so Dynamo's
        # per-code-object recompile count starts from zero for each model.
        torch._dynamo.reset()
        results[spec["name"]] = parallel_run(rank, world_size, spec)
    for check in checks:
        torch._dynamo.reset()
        results[check.__name__] = check(rank, world_size)
    return results


def mesh_checks(world_size: int) -> dict[str, Any]:
    from graphtrain.parallel import ParallelDims, build_mesh, dp_mesh

    try:
        build_mesh(ParallelDims(world_size=world_size * 2), "cpu")
        wrong_world = "no error"
    except ValueError as e:
        wrong_world = str(e)
    mesh = build_mesh(ParallelDims(tp=2, world_size=world_size), "cpu")
    return {
        "wrong_world": wrong_world,
        "names": mesh.mesh_dim_names,
        "shape": tuple(mesh.shape),
        "dp_size": dp_mesh(mesh).size(),
        "tp_size": mesh["tp"].size(),
    }


def parallel_run(rank: int, world_size: int, spec: dict[str, Any]) -> dict[str, Any]:
    """On each rank: build, parallelize per spec, NaN-fill, init, train. Returns the names of
    parameters/buffers still NaN after init, the full initial parameters (rank 0), the losses
    (averaged over dp), and whether a tied head is still the embedding's Parameter."""
    from torch.distributed.tensor import DTensor

    from graphtrain.parallel import (
        ParallelDims,
        build_mesh,
        dp_mesh,
        parallelize_model,
        partial_grad_params,
        reduce_partial_grads,
    )

    dims = ParallelDims(**spec["dims"], world_size=world_size)
    mesh = build_mesh(dims, "cpu")
    tie = spec.get("tie", False)
    cfg = config(tie, spec.get("mtp", 0))
    with torch.device("meta"):
        model = build_gpt(cfg)
    plan = tp_plan(cfg)
    parallelize_model(
        model,
        mesh,
        dims,
        plan=plan,
        ac_mode=spec.get("ac", "none"),
        compile_options=spec.get("compile"),
        param_dtype=torch.float32,
        reduce_dtype=torch.float32,
    )
    model.to_empty(device="cpu")
    with torch.no_grad():
        for t in [*model.parameters(), *model.buffers()]:
            (t.to_local() if isinstance(t, DTensor) else t).fill_(math.nan)
    model.init_weights(SEED)

    def local(t: torch.Tensor) -> torch.Tensor:
        return t.to_local() if isinstance(t, DTensor) else t

    named = [*model.named_parameters(), *model.named_buffers()]
    still_nan = [n for n, t in named if local(t).isnan().any()]
    # full_tensor() is a collective: every rank calls it, in the same order.
    params = {
        n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
        for n, p in model.named_parameters()
    }
    tied = model.output.weight is model.tok_embeddings.weight

    data = batch(spec.get("mask", False))
    dp = dp_mesh(mesh)
    dp_rank, dp_size = dp.get_local_rank(), dp.size()
    rows = BATCH // dp_size
    data = {k: v[dp_rank * rows : (dp_rank + 1) * rows] for k, v in data.items()}
    dp_group = dp.get_group()

    def reduce_loss(loss: torch.Tensor) -> float:
        # The mean over the global batch: every dp rank has the same number of tokens (all
        # labels valid), so the average of the per-rank means is the global mean.
        loss = loss.clone()
        torch.distributed.all_reduce(loss, group=dp_group)
        return loss.item() / dp_size

    # What the trainer does after backward: parameters the plan leaves replicated on tp
    # ranks that see different tokens (an MTP layer's eh_proj) get their gradients summed.
    partial = partial_grad_params(model, plan) if dims.tp > 1 else []
    losses = _train(model, data, reduce_loss, lambda: reduce_partial_grads(partial, mesh["tp"]))
    return {
        "still_nan": still_nan,
        "params": params if rank == 0 else None,
        "losses": losses,
        "tied": tied,
    }


def aot_cache_after_compile(rank: int, world_size: int) -> tuple[bool, bool]:
    """The AOTAutograd cache switch before and after graphtrain compiles a function on a rank."""
    from graphtrain.compile import backend

    before = torch._functorch.config.enable_autograd_cache
    fn = torch.compile(lambda x: (x * 2).sin(), backend=backend(inner="aot_eager"))
    fn(torch.randn(4, requires_grad=True)).sum().backward()
    after = torch._functorch.config.enable_autograd_cache
    torch._functorch.config.enable_autograd_cache = before
    return before, after


# Rank divergence: each case's layout, what rank 1 perturbs, and the name check_replicas reports.
DIVERGENCE_CASES = [
    ({"tp": 2}, "param", "layers.1.ffn_norm.weight (ranks 0 vs ranks 1)"),
    (
        {"dp_replicate": 2, "dp_shard": 1},
        "exp_avg",
        "layers.1.ffn_norm.weight (optimizer exp_avg) (ranks 0 vs ranks 1)",
    ),
]


def replica_divergence(rank: int, world_size: int) -> list[list[str]]:
    """For each of DIVERGENCE_CASES, the messages of the replica check (empty: passed) on a
    clean model after one AdamW step, then with rank 1's parameter or its exp_avg one ulp off."""
    return [_check_after_a_step(rank, world_size, dims, what) for dims, what, _ in DIVERGENCE_CASES]


def _check_after_a_step(rank: int, world_size: int, dims: dict, perturb: str) -> list[str]:
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
