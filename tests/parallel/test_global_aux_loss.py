"""The global aux loss does not depend on the data-parallel size (docs/design/moe_balance.md).

One global batch of 4 sequences is split over dp = 1, 2 and 4 gloo ranks (one micro-batch each;
the three layouts share one launch of 4 ranks through process groups).
Every rank's Router sums its plain top-k counts over the ranks (graphtrain.balance's reducer);
data parallelism averages the ranks' gradients (FSDP's reduce-scatter), so the loss it trains
on is the ranks' mean. That mean, and the mean gate gradient, must equal the global-batch loss
coef * E / (k N^2) * sum_e P_e G_e (N tokens, P_e the summed aux probabilities, G_e the plain
top-k counts of the whole batch) and its gradient, computed here in float64 on one process.
"""

from __future__ import annotations

import functools
from dataclasses import replace

import pytest
import torch
import torch.distributed as dist
from parallel_dist import run_ranks

from graphtrain.balance import _sum_over
from models.moe import MoEConfig, Router

CFG = MoEConfig(
    vocab_size=64,
    dim=16,
    num_layers=2,
    num_heads=2,
    num_kv_heads=2,
    ffn_dim=32,
    max_seq_len=32,
    num_experts=8,
    top_k=2,
    score_func="sigmoid",
    num_groups=4,
    topk_groups=2,
    aux_loss_coef=0.0,
    seq_aux_loss_coef=0.0,
    global_aux_loss_coef=0.3,
)
B, L = 4, 8  # the global batch: 4 sequences of 8 tokens


def _inputs() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(x [B, L, dim], gate weight, expert bias): fresh random, the same on every rank."""
    g = torch.Generator().manual_seed(31)
    x = torch.randn(B, L, CFG.dim, generator=g)
    weight = torch.randn(CFG.num_experts, CFG.dim, generator=g) * 0.5
    # A bias large enough to move the dispatch away from the plain top-k.
    bias = torch.randn(CFG.num_experts, generator=g)
    return x, weight, bias


def _loss_and_grad(
    rank: int, dp: int, group: dist.ProcessGroup | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Data-parallel rank `rank` of `dp` in `group`: (mean loss over the ranks, mean gate
    gradient)."""
    x, weight, bias = _inputs()
    router = Router(CFG)
    with torch.no_grad():
        router.gate.weight.copy_(weight)
        router.expert_bias.copy_(bias)
    if dp > 1:
        router.reduce_counts = functools.partial(_sum_over, group_name=group.group_name)
    rows = B // dp
    _, _, _, loss = router(x[rank * rows : (rank + 1) * rows])
    (grad,) = torch.autograd.grad(loss, router.gate.weight)
    loss = loss.detach().clone()
    if dp > 1:  # what data parallelism trains on: the mean over the ranks
        for t in (loss, grad):
            dist.all_reduce(t, group=group)
            t /= dp
    return loss, grad


def _every_dp(rank: int, world_size: int) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """On 4 ranks: dp = 4 (all of them), dp = 2 (ranks 0-1 and 2-3, each pair the whole batch)
    and dp = 1 (each rank alone): one launch for the three."""
    assert world_size == 4
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    return {
        1: _loss_and_grad(0, 1, None),
        2: _loss_and_grad(rank % 2, 2, pairs[rank // 2]),
        4: _loss_and_grad(rank, 4, dist.group.WORLD),
    }


def _global_batch_f64() -> tuple[torch.Tensor, torch.Tensor]:
    """The global-batch loss and its gate gradient in float64, from the formula."""
    x, weight, _ = _inputs()
    w = weight.double().requires_grad_(True)
    scores = torch.sigmoid(x.flatten(0, 1).double() @ w.T)  # (N, E)
    N, E, k = scores.shape[0], CFG.num_experts, CFG.top_k
    p = scores / scores.sum(-1, keepdim=True)
    plain = scores.detach().topk(k, dim=-1).indices  # no bias, no group limit (no ties here)
    G = torch.bincount(plain.flatten(), minlength=E).double()
    loss = CFG.global_aux_loss_coef * E / (k * N * N) * (p.sum(0) * G).sum()
    (grad,) = torch.autograd.grad(loss, w)
    return loss.detach(), grad


@pytest.mark.slow  # a launch of 4 ranks: about 20 s of CPU, a minute on a loaded machine
def test_global_aux_loss_and_gradient_do_not_depend_on_dp():
    ref_loss, ref_grad = _global_batch_f64()
    per_rank = run_ranks(_every_dp, 4)
    for dp in (1, 2, 4):
        for rank, results in enumerate(per_rank):
            loss, grad = results[dp]
            where = f"dp={dp} rank {rank}"
            torch.testing.assert_close(loss.double(), ref_loss, rtol=1e-5, atol=0, msg=where)
            torch.testing.assert_close(grad.double(), ref_grad, rtol=1e-4, atol=1e-8, msg=where)


def test_the_bias_changes_the_dispatch_not_the_counted_experts():
    """The inputs above do route otherwise than the plain top-k (so the test counts the right
    experts, not the dispatch's)."""
    x, weight, bias = _inputs()
    router = Router(replace(CFG, global_aux_loss_coef=0.0))
    with torch.no_grad():
        router.gate.weight.copy_(weight)
        router.expert_bias.copy_(bias)
    _, indices, _, _ = router(x)
    plain = torch.sigmoid(router.gate(x.flatten(0, 1))).topk(CFG.top_k, dim=-1).indices
    assert not torch.equal(indices.sort(-1).values, plain.sort(-1).values)
