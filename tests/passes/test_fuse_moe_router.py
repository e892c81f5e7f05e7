"""Tests of the fuse_moe_router pass: where it fuses (the MoE spec's router with every option,
DeepSeek-V3's inference Gate, a plain softmax top-k router, and other spellings), where it must
not, and that the rewritten graph's outputs and gradients equal the unrewritten one.

Graphs come from Dynamo through graphtrain's own backend (inner="aot_eager", dumps on), so the
tests read what the pass did from the dump, as a user of `graphtrain inspect` would.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from conftest import pass_step
from torch import nn

from graphtrain.compile import backend

OP = "graphtrain.moe_route.default"
PASS = "fuse_moe_router"
T, D = 13, 8  # odd token count


def _pass_step(dump: Path) -> dict:
    return pass_step(dump, PASS)


def _run(
    fn: Callable, x: torch.Tensor, dump: Path | None, passes: tuple[str, ...] = (), grad=True
) -> tuple:
    """Outputs, and the gradients of x and of fn's parameters for a fixed random grad_output.

    dump=None runs fn eagerly (the unrewritten computation); otherwise compiled through
    graphtrain's backend with dumps.
    """
    x = x.detach().clone().requires_grad_(grad)
    params = [p for p in fn.parameters()] if isinstance(fn, nn.Module) else []
    if dump is not None:
        torch._dynamo.reset()
        fn = torch.compile(
            fn,
            backend=backend(passes=list(passes), inner="aot_eager", dump_dir=dump),
            fullgraph=True,
        )
    with torch.set_grad_enabled(grad):
        outs = fn(x)
    outs = outs if isinstance(outs, tuple) else (outs,)
    if not grad:
        return tuple(o.detach() for o in outs), ()
    g = torch.Generator().manual_seed(0)
    if not any(o.requires_grad for o in outs):
        return tuple(o.detach() for o in outs), ()
    loss = sum(
        (o.double() * torch.randn(o.shape, generator=g, dtype=torch.float64)).sum()
        for o in outs
        if o.is_floating_point() and o.requires_grad
    )
    grads = torch.autograd.grad(loss, [x, *params], allow_unused=True)
    return tuple(o.detach() for o in outs), tuple(g for g in grads if g is not None)


def _x(seed: int = 0, dtype=torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(T, D, generator=g).to(dtype)


# ------------------------------------------------------------------------------------------
# the routers
# ------------------------------------------------------------------------------------------


class SpecRouter(nn.Module):
    """The MoE spec's router pseudo-code (from the logits on), plus its aux loss on the side."""

    def __init__(
        self,
        E=16,
        k=3,
        *,
        score_func="softmax",
        pre_softmax=True,
        bias=False,
        num_groups=1,
        topk_groups=1,
        normalize=False,
        route_scale=1.0,
        counts="bincount",
        aux=True,
        select="topk",
        seq_len=None,
    ):
        super().__init__()
        torch.manual_seed(E + k)
        self.gate = nn.Linear(D, E, bias=False)
        self.register_buffer("expert_bias", torch.randn(E) * 0.1 if bias else None)
        self.E, self.k, self.score_func, self.pre_softmax = E, k, score_func, pre_softmax
        self.num_groups, self.topk_groups = num_groups, topk_groups
        self.normalize, self.route_scale = normalize, route_scale
        self.count_with, self.aux, self.select = counts, aux, select
        self.seq_len = seq_len  # also a per-sequence aux loss over sequences of seq_len tokens

    def top(self, sel, k):
        if self.select == "topk":
            return sel.topk(k, dim=-1).indices
        if self.select == "sort":
            return torch.sort(sel, dim=-1, descending=True, stable=True)[1][:, :k]
        return sel.argsort(dim=-1, descending=True, stable=True)[..., :k]

    def forward(self, x):
        logits = self.gate(x).float()
        if self.score_func == "softmax" and self.pre_softmax:
            scores = torch.softmax(logits, dim=-1)
        elif self.score_func == "softmax":
            scores = logits
        else:
            scores = torch.sigmoid(logits)
        sel = scores + self.expert_bias if self.expert_bias is not None else scores
        if self.num_groups > 1:
            n = sel.shape[0]
            grouped = sel.view(n, self.num_groups, -1)
            group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)
            kept = self.top(group_scores, self.topk_groups)
            dropped = torch.ones_like(group_scores, dtype=torch.bool).scatter(1, kept, False)
            sel = grouped.masked_fill(dropped.unsqueeze(-1), float("-inf")).view(n, -1)
        indices = self.top(sel, self.k)
        weights = scores.gather(1, indices)
        if self.score_func == "softmax" and not self.pre_softmax:
            weights = torch.softmax(weights, dim=-1)
        elif self.normalize:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        weights = weights * self.route_scale
        flat = indices.flatten()
        if self.count_with == "bincount":
            counts = torch.bincount(flat, minlength=self.E)
        elif self.count_with == "histc":
            counts = torch.histc(flat.float(), bins=self.E, min=0, max=self.E)
        elif self.count_with == "histc-2d":
            counts = torch.histc(indices.float(), bins=self.E, min=0, max=self.E - 1)
        else:
            counts = torch.zeros(self.E, dtype=torch.int64).scatter_add_(
                0, flat, torch.ones_like(flat)
            )
        if not self.aux:
            return weights, indices, counts
        # The aux probabilities and their sums (the op's aux_sums).
        if self.score_func == "sigmoid":
            p = scores / scores.sum(dim=-1, keepdim=True)
        else:
            p = scores if self.pre_softmax else torch.softmax(logits, dim=-1)
        n = p.shape[0]
        aux = self.E / (self.k * n * n) * (p.sum(dim=0) * counts[: self.E].float()).sum()
        if self.seq_len:
            p_seq = p.view(n // self.seq_len, self.seq_len, self.E).sum(1)
            aux = aux + (p_seq * torch.arange(self.E)).sum() / n
        return weights, indices, counts, aux


class DeepSeekGate(nn.Module):
    """DeepSeek-V3's public inference Gate.forward (inference/model.py), as published."""

    def __init__(self, *, score_func="sigmoid", bias=True, n_groups=4, topk_groups=2):
        super().__init__()
        torch.manual_seed(1)
        self.dim, self.topk, self.n_groups, self.topk_groups = D, 4, n_groups, topk_groups
        self.score_func, self.route_scale = score_func, 2.5
        self.weight = nn.Parameter(torch.randn(16, D) / D**0.5)
        self.bias = nn.Parameter(torch.randn(16) * 0.1) if bias else None

    def forward(self, x):
        scores = F.linear(x, self.weight)
        if self.score_func == "softmax":
            scores = scores.softmax(dim=-1, dtype=torch.float32)
        else:
            scores = scores.sigmoid()
        original_scores = scores
        if self.bias is not None:
            scores = scores + self.bias
        if self.n_groups > 1:
            scores = scores.view(x.size(0), self.n_groups, -1)
            if self.bias is None:
                group_scores = scores.amax(dim=-1)
            else:
                group_scores = scores.topk(2, dim=-1)[0].sum(dim=-1)
            indices = group_scores.topk(self.topk_groups, dim=-1)[1]
            mask = scores.new_ones(x.size(0), self.n_groups, dtype=bool).scatter_(1, indices, False)
            scores = scores.masked_fill_(mask.unsqueeze(-1), float("-inf")).flatten(1)
        indices = torch.topk(scores, self.topk, dim=-1)[1]
        weights = original_scores.gather(1, indices)
        if self.score_func == "sigmoid":
            weights /= weights.sum(dim=-1, keepdim=True)
        weights *= self.route_scale
        return weights.type_as(x), indices


class TorchtitanStyle(nn.Module):
    """Group mask built into zeros by an in-place scatter_, expanded to [T, E], ~.bool();
    unsorted top-k, so it returns the dense routing matrix (independent of the k order)."""

    def __init__(self, fill=float("-inf")):
        super().__init__()
        torch.manual_seed(2)
        self.gate = nn.Linear(D, 16, bias=False)
        self.register_buffer("expert_bias", torch.randn(16) * 0.1)
        self.fill = fill

    def forward(self, x):
        scores = torch.sigmoid(self.gate(x).float())
        choice = scores + self.expert_bias
        n = choice.shape[0]
        group_scores = choice.view(n, 4, -1).topk(2, dim=-1)[0].sum(dim=-1)
        group_idx = torch.topk(group_scores, k=2, dim=-1, sorted=False)[1]
        group_mask = torch.zeros_like(group_scores)
        group_mask.scatter_(1, group_idx, 1)
        score_mask = group_mask.unsqueeze(-1).expand(n, 4, 4).reshape(n, -1)
        choice = choice.masked_fill(~score_mask.bool(), self.fill)
        indices = torch.topk(choice, k=3, dim=-1, sorted=False)[1]
        weights = scores.gather(1, indices)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        return torch.zeros_like(scores).scatter(1, indices, weights * 1.5)


class PlainTopK(nn.Module):
    """probs = softmax; w, idx = probs.topk(k); optionally renormalised; or post-softmax; or
    with a dense 0/1 mask of the chosen experts next to the weights."""

    def __init__(self, mode="normalize"):
        super().__init__()
        torch.manual_seed(3)
        self.gate = nn.Linear(D, 12, bias=False)
        self.mode = mode

    def forward(self, x):
        logits = self.gate(x)
        if self.mode == "post":
            w, idx = logits.topk(2, -1)
            return w.softmax(-1), idx
        probs = logits.softmax(-1)
        w, idx = probs.topk(3, -1)
        if self.mode == "normalize":
            w = w / w.sum(-1, keepdim=True)
        if self.mode == "dense mask":
            return w, idx, torch.zeros_like(probs).scatter(1, idx, 1.0)
        return w, idx


class OtherEpsilon(DeepSeekGate):
    """An in-place normalisation with another epsilon: not absorbed, applied to the op's
    weights (the op normalises without it)."""

    def __init__(self):
        super().__init__(n_groups=1)

    def forward(self, x):
        scores = F.linear(x, self.weight).sigmoid()
        indices = torch.topk(scores + self.bias, self.topk, dim=-1)[1]
        weights = scores.gather(1, indices)
        weights /= weights.sum(dim=-1, keepdim=True) + 1e-6
        return weights, indices


class MegatronRouter(nn.Module):
    """Megatron-Core's topk_softmax_with_capacity (no capacity) with group_limited_topk, as
    published: scores cast back with .type_as(logits), a group mask built by zeros_like +
    scatter_(1, idx, 1), and a dense routing map zeros_like(logits).int().scatter(1, idx, 1)
    whose column sums are the tokens per expert."""

    def __init__(self, score_func="sigmoid", dtype=torch.float32):
        super().__init__()
        torch.manual_seed(6)
        self.gate = nn.Linear(D, 16, bias=False).to(dtype)
        self.register_buffer("expert_bias", torch.randn(16) * 0.1)
        self.score_func, self.topk, self.num_groups, self.group_topk = score_func, 4, 4, 2

    def group_limited_topk(self, scores):
        n, E = scores.shape
        group_scores = (
            scores.view(n, self.num_groups, -1).topk(self.topk // self.group_topk, dim=-1)[0]
        ).sum(dim=-1)
        group_idx = torch.topk(group_scores, k=self.group_topk, dim=-1, sorted=False)[1]
        group_mask = torch.zeros_like(group_scores)
        group_mask.scatter_(1, group_idx, 1)
        score_mask = (
            group_mask.unsqueeze(-1).expand(n, self.num_groups, E // self.num_groups).reshape(n, -1)
        )
        masked_scores = scores.masked_fill(~score_mask.bool(), float("-inf"))
        return torch.topk(masked_scores, k=self.topk, dim=-1)

    def forward(self, x):
        logits = self.gate(x)
        if self.score_func == "softmax":
            scores = torch.softmax(logits, dim=-1, dtype=torch.float32).type_as(logits)
            probs, top_indices = self.group_limited_topk(scores)
        else:
            scores = torch.sigmoid(logits.float()).type_as(logits)
            _, top_indices = self.group_limited_topk(scores + self.expert_bias)
            scores = torch.gather(scores, dim=1, index=top_indices).type_as(logits)
            probs = scores / (scores.sum(dim=-1, keepdim=True) + 1e-20)
        probs = probs * 2.5
        routing_probs = torch.zeros_like(logits).scatter(1, top_indices, probs)
        routing_map = torch.zeros_like(logits).int().scatter(1, top_indices, 1).bool()
        return routing_probs, routing_map, routing_map.sum(dim=0)


class TwoRouters(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = SpecRouter(score_func="sigmoid", bias=True, num_groups=4, topk_groups=2)
        self.b = SpecRouter(E=12, k=2, normalize=True, aux=False, counts="histc")

    def forward(self, x):
        wa, ia, ca, aux = self.a(x)
        wb, ib, cb = self.b(x * 2)
        return wa, ia, ca, aux, wb, ib, cb


# name -> (module, run with gradients, expected options on the op)
FUSED = {
    "spec softmax": (SpecRouter(), True, dict(score_func="softmax", aux_seq_len=T)),
    "spec softmax bias normalize scale": (
        SpecRouter(bias=True, normalize=True, route_scale=2.0),
        True,
        dict(normalize=True, route_scale=2.0),
    ),
    "spec softmax post bias": (
        SpecRouter(pre_softmax=False, bias=True, counts="histc"),
        True,
        dict(pre_softmax=False),
    ),
    "spec sigmoid groups bias normalize scale": (
        SpecRouter(
            score_func="sigmoid",
            bias=True,
            num_groups=4,
            topk_groups=2,
            normalize=True,
            route_scale=2.5,
        ),
        True,
        dict(score_func="sigmoid", num_groups=4, topk_groups=2, normalize=True, route_scale=2.5),
    ),
    "spec softmax groups, scatter_add counts": (
        SpecRouter(E=24, k=4, num_groups=6, topk_groups=3, counts="scatter_add"),
        True,
        dict(num_groups=6, topk_groups=3),
    ),
    "spec with stable sort": (
        SpecRouter(bias=True, num_groups=4, topk_groups=2, select="sort", aux=False),
        True,
        dict(num_groups=4, topk_groups=2, aux_seq_len=0),
    ),
    "spec with argsort": (
        SpecRouter(score_func="sigmoid", num_groups=8, topk_groups=3, select="argsort"),
        True,
        dict(score_func="sigmoid", num_groups=8, topk_groups=3),
    ),
    "deepseek sigmoid bias groups": (
        DeepSeekGate(),
        True,
        dict(score_func="sigmoid", num_groups=4, topk_groups=2, normalize=True, route_scale=2.5),
    ),
    # Without bias the Gate masks a view of the scores in place: eager autograd refuses
    # that (softmax needs its output), so this one is compared without gradients.
    "deepseek softmax groups, no bias (group max)": (
        DeepSeekGate(score_func="softmax", bias=False),
        False,
        dict(num_groups=4, topk_groups=2, group_score="max", route_scale=2.5),
    ),
    "deepseek softmax, no groups": (
        DeepSeekGate(score_func="softmax", bias=False, n_groups=1),
        True,
        dict(route_scale=2.5),
    ),
    "torchtitan-style 2-D mask": (
        TorchtitanStyle(),
        True,
        dict(score_func="sigmoid", num_groups=4, topk_groups=2, normalize=True, route_scale=1.5),
    ),
    "in-place normalisation with another epsilon": (OtherEpsilon(), True, dict(normalize=False)),
    "plain softmax top-k, renormalised": (PlainTopK(), True, dict(normalize=True)),
    "plain softmax top-k": (PlainTopK("plain"), True, dict(normalize=False)),
    "plain top-k, softmax after": (PlainTopK("post"), True, dict(pre_softmax=False)),
    "plain top-k with a dense mask": (PlainTopK("dense mask"), True, dict(normalize=False)),
    # Its .type_as(logits) of fp32 logits is a no-op cast that canonicalize removes.
    "megatron sigmoid bias groups, dense routing map": (
        MegatronRouter(),
        True,
        dict(score_func="sigmoid", num_groups=4, topk_groups=2, normalize=True, route_scale=2.5),
    ),
    "megatron softmax groups, dense routing map": (
        MegatronRouter("softmax"),
        True,
        dict(score_func="softmax", num_groups=4, topk_groups=2, route_scale=2.5),
    ),
    "spec sigmoid, histc of the 2-D indices": (
        SpecRouter(score_func="sigmoid", normalize=True, counts="histc-2d"),
        True,
        dict(score_func="sigmoid", normalize=True),
    ),
}


@pytest.mark.parametrize("name", list(FUSED))
def test_fuses_once_and_matches(name, tmp_path):
    module, grad, options = FUSED[name]
    x = _x()
    out, grads = _run(module, x, tmp_path, grad=grad)
    step = _pass_step(tmp_path)
    assert step["op_counts"].get(OP) == 1, step
    assert not any(k in step["op_counts"] for k in ("Tensor.topk", "torch.topk")), step
    assert not any(k in step["op_counts"] for k in ("torch.sort", "Tensor.argsort")), step
    assert any("replaced" in n for n in step["notes"]), step["notes"]
    for counting in ("torch.bincount", "torch.histc", "Tensor.scatter_add_"):
        assert counting not in step["op_counts"], step["op_counts"]
    (site,) = [s for s in step["custom_ops"] if s["op"] == OP]
    for key, value in options.items():
        assert site["options"][key] == value, (key, site["options"])
    ref_out, ref_grads = _run(module, x, None, grad=grad)  # eager: the unrewritten computation
    for a, b in zip(out, ref_out, strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape
        if a.is_floating_point():  # the op's CPU reference computes the same torch ops
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
        else:
            assert torch.equal(a, b)
    for a, b in zip(grads, ref_grads, strict=True):  # closed-form backward: a few ulps
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    "options",
    [
        dict(),
        dict(pre_softmax=False, bias=True),
        dict(score_func="sigmoid", bias=True, num_groups=4, topk_groups=2, normalize=True),
    ],
    ids=["softmax", "softmax post", "sigmoid groups"],
)
def test_aux_sums_come_from_the_op(options, tmp_path):
    """The aux losses' sums of p over all tokens and per sequence (3 of 4 tokens) become the
    op's aux_sums: the scores' softmax / sigmoid normalisation and their sums are gone, and
    the loss and its gradients are the eager ones."""
    module = SpecRouter(seq_len=4, **options)
    x = torch.randn(12, D, generator=torch.Generator().manual_seed(3))
    out, grads = _run(module, x, tmp_path)
    step = _pass_step(tmp_path)
    (site,) = [s for s in step["custom_ops"] if s["op"] == OP]
    assert site["options"]["aux_seq_len"] == 4
    assert step["op_counts"].get("torch.softmax", 0) == 0, step["op_counts"]
    assert step["op_diff"].get("Tensor.sum", 0) <= -2, step["op_diff"]  # 2 sums of p, + 1 here
    assert not any("kept (used elsewhere)" in n for n in step["notes"]), step["notes"]
    ref_out, ref_grads = _run(module, x, None)
    torch.testing.assert_close(out[3], ref_out[3], rtol=1e-6, atol=1e-7)
    for a, b in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


class BalanceRouter(SpecRouter):
    """The spec's router whose balance losses count, as DeepSeek-V3 and Megatron-Core do, the
    plain top-k of the scores (no bias, no group limit) as models/moe.py writes it: ones
    scattered into zeros [T, E], summed over the tokens (aux) and per sequence (seq_aux)."""

    def __init__(self, *, plain_seq_len=4, **options):
        super().__init__(seq_len=4, aux=False, **options)
        self.plain_seq_len = plain_seq_len

    def losses(self, logits, scores, p, indices):
        n, E, k = p.shape[0], self.E, self.k
        plain = indices
        if self.expert_bias is not None or self.num_groups > 1:
            plain = self.top(scores, k)
        hits = torch.zeros_like(scores).scatter(1, plain, 1.0)
        aux = E / (k * n * n) * (p.sum(0) * hits.sum(0)).sum()
        L = self.plain_seq_len
        p_seq = p.view(n // self.seq_len, self.seq_len, E).sum(1)
        c_seq = hits.view(n // L, L, E).sum(1)
        seq_aux = E / (k * L * L) * (p_seq.sum(0) * c_seq.sum(0)).sum() + p_seq.square().sum()
        return aux, seq_aux


class BalanceRouterFromTheSpec(BalanceRouter):
    """The spec's router written out again, its scores feeding the balance losses."""

    def forward(self, x):
        logits = self.gate(x).float()
        if self.score_func == "sigmoid":
            scores = torch.sigmoid(logits)
        else:
            scores = torch.softmax(logits, dim=-1) if self.pre_softmax else logits
        sel = scores + self.expert_bias if self.expert_bias is not None else scores
        if self.num_groups > 1:
            grouped = sel.view(sel.shape[0], self.num_groups, -1)
            group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)
            kept = self.top(group_scores, self.topk_groups)
            dropped = torch.ones_like(group_scores, dtype=torch.bool).scatter(1, kept, False)
            sel = grouped.masked_fill(dropped.unsqueeze(-1), float("-inf")).view(sel.shape[0], -1)
        indices = self.top(sel, self.k)
        weights = scores.gather(1, indices)
        if self.score_func == "softmax" and not self.pre_softmax:
            weights = torch.softmax(weights, dim=-1)
        elif self.normalize:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        counts = torch.bincount(indices.flatten(), minlength=self.E)
        if self.score_func == "sigmoid":
            p = scores / scores.sum(dim=-1, keepdim=True)
        else:
            p = scores if self.pre_softmax else torch.softmax(logits, dim=-1)
        return weights, indices, counts, *self.losses(logits, scores, p, indices)


PLAIN_CASES = {
    # no bias, no group limit: the expert top-k is the plain one (the op reuses its histogram)
    "softmax, the dispatch's own": dict(),
    "softmax post bias": dict(pre_softmax=False, bias=True),
    "sigmoid bias groups (DeepSeek-V3), sort": dict(
        score_func="sigmoid", bias=True, num_groups=4, topk_groups=2, normalize=True, select="sort"
    ),
    "softmax groups, argsort": dict(num_groups=4, topk_groups=1, select="argsort"),
}


@pytest.mark.parametrize("name", list(PLAIN_CASES))
def test_balance_losses_plain_counts_come_from_the_op(name, tmp_path):
    """The plain top-k, its map and both sums of it become the op's plain_counts
    (count_plain=True): no top-k or sort is left, and the losses and their gradients are the
    eager ones."""
    module = BalanceRouterFromTheSpec(**PLAIN_CASES[name])
    x = torch.randn(12, D, generator=torch.Generator().manual_seed(5))
    out, grads = _run(module, x, tmp_path)
    step = _pass_step(tmp_path)
    assert step["op_counts"].get(OP) == 1, step
    (site,) = [s for s in step["custom_ops"] if s["op"] == OP]
    assert site["options"]["count_plain"] is True and site["options"]["aux_seq_len"] == 4
    for gone in ("Tensor.topk", "torch.topk", "torch.sort", "Tensor.argsort", "torch.scatter"):
        assert gone not in step["op_counts"], (gone, step["op_counts"])
    assert [n for n in step["notes"] if "left" in n] == [], step["notes"]
    ref_out, ref_grads = _run(module, x, None)
    assert torch.equal(out[1], ref_out[1]) and torch.equal(out[2], ref_out[2])
    for a, b in zip(out[3:], ref_out[3:], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    for a, b in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_plain_counts_over_other_sequences_stay(tmp_path):
    """Plain counts per sequence of 3 tokens beside aux sums per sequence of 4: the op has one
    sequence length, so the plain map stays in the graph (reading the op's scores), right."""
    module = BalanceRouterFromTheSpec(
        score_func="sigmoid", bias=True, num_groups=4, topk_groups=2, plain_seq_len=3
    )
    x = torch.randn(12, D, generator=torch.Generator().manual_seed(6))
    out, grads = _run(module, x, tmp_path)
    step = _pass_step(tmp_path)
    (site,) = [s for s in step["custom_ops"] if s["op"] == OP]
    assert site["options"]["aux_seq_len"] == 4
    assert step["op_counts"].get("torch.topk") == 1, step["op_counts"]  # the plain one stays
    assert site["options"]["count_plain"] is True  # its token sum still comes from the op
    ref_out, ref_grads = _run(module, x, None)
    for a, b in zip(out[3:], ref_out[3:], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    for a, b in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_scores_read_elsewhere_stay(tmp_path):
    """Another reader of p (here its row max): the softmax stays for it, the sum still comes
    from the op, and the results are the eager ones."""
    weight = torch.randn(D, 12, generator=torch.Generator().manual_seed(5))

    def fn(x):
        scores = (x @ weight).softmax(-1)
        indices = scores.topk(3, dim=-1).indices
        return scores.gather(1, indices), scores.sum(0), scores.amax(-1)

    out, grads = _run(fn, _x(), tmp_path)
    step = _pass_step(tmp_path)
    (site,) = [s for s in step["custom_ops"] if s["op"] == OP]
    assert site["options"]["aux_seq_len"] == T
    softmaxes = sum(step["op_counts"].get(k, 0) for k in ("torch.softmax", "Tensor.softmax"))
    assert softmaxes == 1, step["op_counts"]
    assert any("kept (used elsewhere)" in n for n in step["notes"]), step["notes"]
    ref_out, ref_grads = _run(fn, _x(), None)
    for a, b in zip(out + grads, ref_out + ref_grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


class ZLossRouter(nn.Module):
    """A softmax top-k router with the router z-loss, spelled several ways."""

    def __init__(self, spelling, dtype=torch.float32):
        super().__init__()
        torch.manual_seed(4)
        self.gate = nn.Linear(D, 12, bias=False).to(dtype)
        self.spelling = spelling

    def forward(self, x):
        logits = self.gate(x)
        if self.spelling == "bf16 logits, float32 softmax and cast":
            scores = logits.softmax(-1, dtype=torch.float32)
            z_before = None
        else:
            logits = logits.float()
            # Megatron applies its z-loss to the logits before routing.
            z_before = torch.mean(torch.square(torch.logsumexp(logits, dim=-1)))
            scores = torch.softmax(logits, dim=-1)
        w, idx = scores.topk(3, dim=-1)
        if self.spelling == "bf16 logits, float32 softmax and cast":
            z = logits.float().logsumexp(-1).pow(2).mean()
        elif self.spelling == "keepdim, with another reduction":
            lse = logits.logsumexp(dim=1, keepdim=True)
            z = lse.square().mean() + logits.logsumexp(0).sum()  # over tokens: not the op's
        else:  # models/moe.py, after the top-k
            z = torch.logsumexp(logits, dim=-1).square().mean()
        return w, idx, z if z_before is None else z + z_before


@pytest.mark.parametrize(
    "spelling,dtype",
    [
        ("before and after the top-k", torch.float32),
        ("keepdim, with another reduction", torch.float32),
        ("bf16 logits, float32 softmax and cast", torch.bfloat16),
    ],
)
def test_z_loss_logsumexp_comes_from_the_op(spelling, dtype, tmp_path):
    """logsumexp(logits, -1) becomes the op's lse wherever it is (the op moves up to the first
    one); a logsumexp over the tokens stays; the z-loss and gradients are the eager ones."""
    module = ZLossRouter(spelling, dtype)
    out, grads = _run(module, _x(dtype=dtype), tmp_path)
    step = _pass_step(tmp_path)
    (site,) = [s for s in step["custom_ops"] if s["op"] == OP]
    assert site["options"]["return_lse"] is True
    remaining = sum(step["op_counts"].get(k, 0) for k in ("torch.logsumexp", "Tensor.logsumexp"))
    assert remaining == (1 if spelling.startswith("keepdim") else 0), step["op_counts"]
    ref_out, ref_grads = _run(module, _x(dtype=dtype), None)
    assert torch.equal(out[1], ref_out[1])
    tol = dict(rtol=2e-2, atol=1e-3) if dtype == torch.bfloat16 else dict(rtol=1e-5, atol=1e-6)
    for a, b in zip((out[0], out[2], *grads), (ref_out[0], ref_out[2], *ref_grads), strict=True):
        assert a.dtype == b.dtype
        torch.testing.assert_close(a.float(), b.float(), **tol)


def test_two_routers_two_ops(tmp_path):
    out, grads = _run(TwoRouters(), _x(), tmp_path)
    step = _pass_step(tmp_path)
    assert step["op_counts"].get(OP) == 2, step
    ref_out, ref_grads = _run(TwoRouters(), _x(), None)
    for a, b in zip(out + grads, ref_out + ref_grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


class _InPlaceHazard(DeepSeekGate):
    """DeepSeek's Gate without bias masks a view of the scores in place; here an extra reader
    of the scores comes after that mask, so it sees -inf: erasing the mask would change it."""

    def __init__(self):
        super().__init__(score_func="softmax", bias=False)

    def forward(self, x):
        scores = F.linear(x, self.weight).softmax(dim=-1)
        grouped = scores.view(x.size(0), 4, -1)
        indices = grouped.amax(dim=-1).topk(2, dim=-1)[1]
        mask = grouped.new_ones(x.size(0), 4, dtype=bool).scatter_(1, indices, False)
        sel = grouped.masked_fill_(mask.unsqueeze(-1), float("-inf")).flatten(1)
        indices = torch.topk(sel, 4, dim=-1)[1]
        return scores.gather(1, indices), indices, scores.exp()


def _logits_changed_inside(x):
    logits = x @ torch.ones(D, 12)
    scores = logits.softmax(-1)
    logits.mul_(2)  # the op would read the changed logits at the top-k
    indices = scores.topk(2, -1).indices
    return scores.gather(1, indices), logits


UNFUSED = {
    "top-k accuracy (no weights)": (
        lambda x: (x @ torch.ones(D, 12)).topk(3, dim=-1).indices,
        "no routing weights",
    ),
    "weights gathered from another tensor": (
        lambda x: (lg := x @ torch.ones(D, 12)).gather(1, lg.softmax(-1).topk(2, -1).indices) * 2,
        "no routing weights",
    ),
    "smallest values": (
        lambda x: (p := (x @ torch.ones(D, 12)).softmax(-1)).gather(
            1, p.topk(2, -1, largest=False).indices
        ),
        "largest=False",
    ),
    "masked with 0.0 (Hugging Face)": (TorchtitanStyle(fill=0.0), "not -inf"),
    "raw logits as weights": (
        lambda x: (lg := x @ torch.ones(D, 12)).gather(1, lg.topk(2, -1).indices),
        "raw logits",
    ),
    "3-D scores": (
        lambda x: (x.view(1, T, D) @ torch.ones(D, 12)).softmax(-1).topk(2, -1).values,
        "no top-k",
    ),
    "in-place mask read afterwards": (_InPlaceHazard(), "reads afterwards"),
    "top-k beyond the kept groups": (
        SpecRouter(E=16, k=6, num_groups=4, topk_groups=1, aux=False),
        "top_k=6 must be in [1, 4]",
    ),
    "logits changed in place inside the router": (_logits_changed_inside, "in place inside"),
    "detached top-k values": (
        lambda x: (
            (top := (x @ torch.ones(D, 12)).softmax(-1).detach().topk(2, -1)).values * x[:, :1],
            top.indices,
        ),
        "no routing weights",
    ),
}


@pytest.mark.parametrize("name", list(UNFUSED))
def test_leaves_graph_unchanged(name, tmp_path):
    fn, reason = UNFUSED[name]
    grad = name != "in-place mask read afterwards"
    out, grads = _run(fn, _x(), tmp_path, grad=grad)
    step = _pass_step(tmp_path)
    assert OP not in step["op_counts"], step
    assert step.get("op_diff") == {}, step  # nothing changed
    assert any(reason in n for n in step["notes"]), step["notes"]
    ref_out, ref_grads = _run(fn, _x(), None, grad=grad)
    for a, b in zip(out + grads, ref_out + ref_grads, strict=True):
        assert torch.equal(a, b)


def test_bf16_scores_left_unchanged(tmp_path):
    """sigmoid of bf16 logits computes the scores in bf16: the fp32 op would not reproduce it."""
    gate = DeepSeekGate().to(torch.bfloat16)
    _run(gate, _x(dtype=torch.bfloat16), tmp_path)
    step = _pass_step(tmp_path)
    assert OP not in step["op_counts"] and step["op_diff"] == {}
    assert any("torch.bfloat16" in n and "fp32" in n for n in step["notes"]), step["notes"]


def test_megatron_bf16_router_refusal_is_noted(tmp_path):
    """Megatron's router on bf16 logits casts its fp32 scores back to bf16 (.type_as) before
    the top-k: not the op's fp32 computation. Its indices scatter a constant into the routing
    map, as a group selection's do; the refusal still says why."""
    _run(MegatronRouter(dtype=torch.bfloat16), _x(dtype=torch.bfloat16), tmp_path)
    step = _pass_step(tmp_path)
    assert OP not in step["op_counts"] and step["op_diff"] == {}
    (note,) = [n for n in step["notes"] if n.startswith("left topk_")]  # the expert top-k
    assert "torch.bfloat16" in note and "fp32 sigmoid cast back" in note, step["notes"]


def test_bf16_logits_with_float32_softmax_fuse(tmp_path):
    """softmax(bf16 logits, dtype=float32) is the op's own fp32 computation: fused."""
    gate = DeepSeekGate(score_func="softmax", bias=False, n_groups=1).to(torch.bfloat16)
    out, grads = _run(gate, _x(dtype=torch.bfloat16), tmp_path)
    assert _pass_step(tmp_path)["op_counts"].get(OP) == 1
    ref_out, ref_grads = _run(gate, _x(dtype=torch.bfloat16), None)
    assert torch.equal(out[1], ref_out[1]) and torch.equal(out[0], ref_out[0])
    for a, b in zip(grads, ref_grads, strict=True):
        assert a.dtype == b.dtype == torch.bfloat16
        torch.testing.assert_close(a.float(), b.float(), rtol=2e-2, atol=1e-3)


def test_disabled_pass_changes_nothing(tmp_path):
    _run(SpecRouter(), _x(), tmp_path, passes=("-" + PASS,))
    (summary,) = list(tmp_path.glob("*/summary.json"))
    labels = [s["label"] for s in json.loads(summary.read_text())]
    assert PASS not in labels


def test_no_top_k_is_a_quiet_note(tmp_path):
    _run(lambda x: x.softmax(-1), _x(), tmp_path)
    step = _pass_step(tmp_path)
    assert step["notes"] == ["no top-k over 2-D scores in this graph: no router to fuse"]
    assert step["op_diff"] == {}


def test_moe_model_routers_fuse_and_train_the_same(tmp_path):
    """models/moe.py's Router (stable-sort top-k, unflatten groups, bincount, aux losses) is
    fused once per block graph, its aux losses' sums with it (sequences of 16 tokens); loss,
    gradients and the router's counts match eager."""
    from graphtrain.compile import apply_compile
    from models import MODEL_PRESETS, build_model

    def build():
        model = build_model(MODEL_PRESETS["moe-debug"])
        model.init_weights(seed=0)
        with torch.no_grad():  # a non-zero expert bias, so that it changes the selection
            for i, (_, router) in enumerate(model.routers()):
                router.expert_bias.copy_(torch.linspace(-0.1, 0.1, 8).roll(i))
        return model

    eager, compiled = build(), build()
    apply_compile(compiled, inner="aot_eager", dump_dir=tmp_path)
    g = torch.Generator().manual_seed(0)
    x, y = torch.randint(0, 512, (2, 2, 16), generator=g)
    loss = eager(x, y)
    loss.backward()
    closs = compiled(x, y)
    closs.backward()
    step = json.loads((tmp_path / "block-1" / "summary.json").read_text())
    (step,) = [s for s in step if s["label"] == PASS]
    assert step["op_counts"].get(OP) == 1 and "torch.sort" not in step["op_counts"], step
    (site,) = [s for s in step["custom_ops"] if s["op"] == OP]
    assert site["options"]["aux_seq_len"] == 16  # aux and global_aux sums, seq_aux's rows
    assert site["options"]["count_plain"] is True  # the balance losses' plain top-k
    assert site["options"]["return_lse"] is True  # the z-loss
    assert "torch.logsumexp" not in step["op_counts"], step["op_counts"]
    torch.testing.assert_close(closs, loss, rtol=1e-5, atol=0)
    for (name, p), q in zip(eager.named_parameters(), compiled.parameters(), strict=True):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-4, atol=1e-6, msg=name)
    for (_, r), (_, rc) in zip(eager.routers(), compiled.routers(), strict=True):
        assert torch.equal(r.last_counts, rc.last_counts)


def test_dtensor_router_left_unchanged(one_rank_group, tmp_path):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, distribute_tensor

    mesh = init_device_mesh("cpu", (1,))
    logits = distribute_tensor(_x() @ torch.ones(D, 12), mesh, [Replicate()])

    def fn(logits):
        scores = logits.softmax(-1)
        return scores.gather(1, scores.topk(2, dim=-1).indices)

    torch._dynamo.reset()
    compiled = torch.compile(
        fn, backend=backend(inner="aot_eager", dump_dir=tmp_path), fullgraph=True
    )
    out = compiled(logits)
    step = _pass_step(tmp_path)
    assert OP not in step["op_counts"] and step["op_diff"] == {}
    assert any("DTensor" in n for n in step["notes"]), step["notes"]
    torch.testing.assert_close(out.full_tensor(), fn(logits).full_tensor())
