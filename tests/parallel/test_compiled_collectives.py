"""Collectives inside regions compiled by Inductor (the CUDA default; most CPU tests compile with
aot_eager), on two gloo ranks against eager.

Inductor (torch 2.11-2.14) computes a cat's inputs straight into the cat's buffer and then
all-reduces that buffer in place, so an input read again after the all-reduce reads the reduced
values. A MoE router all-reduces its token counts beside its plain top-k counts in one cat
(models.moe.Router, global_aux_loss_coef) and reads the local ones again for its aux loss: on
two data-parallel ranks its gate's gradient came out a third off. graphtrain's backend clones
such inputs (graphtrain.compile_fixes.unalias_all_reduce_inputs); these tests fail without it.
"""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from parallel_dist import run_ranks, scalar_cpu_kernels


def _counts_then_local(x: torch.Tensor, y: torch.Tensor, p: torch.Tensor) -> tuple:
    local = x.sum(0)  # computed into the cat's buffer by Inductor
    reduced = funcol.all_reduce(torch.cat([y, local]), "sum", dist.group.WORLD)
    return (p * local).sum(), (p * reduced[y.numel() :]).sum()


def _stacked_then_local(x: torch.Tensor, y: torch.Tensor, p: torch.Tensor) -> tuple:
    local = x.sum(0)  # a stack: a cat and a view by the time the backend sees it
    reduced = funcol.all_reduce(torch.stack([y, local]), "sum", dist.group.WORLD)
    return (p * local).sum(), (p * reduced[1]).sum()


def _small_function(rank: int, world_size: int) -> list[tuple[float, ...]]:
    from graphtrain.compile import backend

    scalar_cpu_kernels()

    torch.manual_seed(rank)
    x, y, p = torch.rand(4, 3) + rank, torch.rand(3), torch.rand(3)
    results = []
    for f in (_counts_then_local, _stacked_then_local):
        compiled = torch.compile(f, backend=backend(inner="inductor"))
        results += [tuple(t.item() for t in g(x, y, p)) for g in (f, compiled)]
    return results


def _moe_gradients(rank: int, world_size: int) -> list[dict[str, torch.Tensor]]:
    """A one-block moe-debug's gradients on this rank's tokens, eager and compiled by Inductor,
    the router's counts all-reduced over both ranks as graphtrain.balance does."""
    from graphtrain.compile import apply_compile
    from models import MODEL_PRESETS, build_model

    scalar_cpu_kernels()

    # one MoE block (the preset's router, experts and aux losses) and the head
    cfg = dataclasses.replace(MODEL_PRESETS["moe-debug"], num_layers=1, first_k_dense=0)
    assert cfg.global_aux_loss_coef > 0  # the all-reduce of counts feeds the loss
    tokens = torch.randint(
        0, cfg.vocab_size, (2, 65), generator=torch.Generator().manual_seed(rank)
    )
    grads = []
    for compiled in (False, True):
        torch._dynamo.reset()
        model = build_model(cfg)
        model.init_weights(seed=0)
        for _, router in model.routers():
            router.reduce_counts = functools.partial(
                funcol.all_reduce, reduceOp="sum", group=dist.group.WORLD
            )
        if compiled:
            apply_compile(model, inner="inductor")
        model(tokens[:, :-1], tokens[:, 1:]).backward()
        grads.append({n: p.grad for n, p in model.named_parameters()})
    return grads


def test_a_cat_or_stack_input_read_after_its_all_reduce_keeps_its_local_values():
    """A local sum, all-reduced inside a cat (or a stack) and read again: Inductor's values are
    eager's (without the clone, each rank read the sum over both ranks)."""
    for cat, cat_compiled, stack, stack_compiled in run_ranks(_small_function, 2):
        assert cat_compiled == pytest.approx(cat, rel=1e-6)
        assert stack_compiled == pytest.approx(stack, rel=1e-6)


@pytest.mark.slow
def test_moe_router_gradients_on_two_ranks_under_inductor():
    """Every gradient of a one-block moe-debug, compiled by Inductor with its counts all-reduced
    over two ranks, is eager's to fp32 rounding (without the clone: the router gate 0.24 off)."""
    for eager, compiled in run_ranks(_moe_gradients, 2, timeout=600):
        errors = {n: ((compiled[n] - g).norm() / g.norm()).item() for n, g in eager.items()}
        assert max(errors.values()) < 1e-5, sorted(errors.items(), key=lambda e: -e[1])[:4]
