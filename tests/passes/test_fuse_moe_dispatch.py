"""Tests of the fuse_moe_dispatch pass: where it inserts moe_permute / moe_unpermute (the model's
dispatch and other spellings), where it must not, and that the rewritten graph's outputs and
gradients equal the unrewritten one.

Graphs come from Dynamo through graphtrain's own backend (inner="aot_eager", dumps on); the
tests read what the pass did from the dump, as `graphtrain inspect` shows it.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from conftest import module_grads, pass_step
from torch import nn

from graphtrain.compile import backend
from models import MODEL_PRESETS, build_model

PASS = "fuse_moe_dispatch"
PERMUTE, UNPERMUTE = "graphtrain.moe_permute.default", "graphtrain.moe_unpermute.default"
T, D, E, K = 13, 8, 5, 3


def _pass_step(dump: Path) -> dict:
    return pass_step(dump, PASS)


def _counts(step: dict) -> tuple[int, int]:
    return step["op_counts"].get(PERMUTE, 0), step["op_counts"].get(UNPERMUTE, 0)


class Dispatch(nn.Module):
    """A router stand-in (fixed random expert choices, learned weights) around a dispatch
    written in one of the spellings the pass reads; `spelling` picks it."""

    def __init__(self, spelling: str = "model") -> None:
        super().__init__()
        self.spelling = spelling
        self.gate = nn.Linear(D, K, bias=False)
        self.expert = nn.Linear(D, D, bias=False)
        g = torch.Generator().manual_seed(0)
        self.register_buffer("experts", torch.randint(0, E, (T, K), generator=g))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s = self.spelling
        weights = torch.softmax(self.gate(x), dim=-1)  # (T, k)
        flat = self.experts.flatten()
        order = flat.argsort(stable=True) if s == "method-argsort" else torch.argsort(flat)
        if s == "sort-indices":
            order = torch.sort(flat, stable=True).indices
        if s == "index_select-div":
            xs = torch.index_select(x, 0, torch.div(order, K, rounding_mode="floor"))
        else:
            xs = x[order // K]
        ys = torch.tanh(self.expert(xs))
        base = torch.zeros_like(ys) if s == "zeros_like-unflatten" else torch.empty_like(ys)
        y = base.index_copy_(0, order, ys)
        if s == "zeros_like-unflatten":
            y = y.unflatten(0, (T, K))
        else:
            y = y.view(T, K, -1)
        if s == "index-none-sum-dim":
            return torch.sum(weights[..., None] * y, dim=-2)
        return (y.float() * weights.unsqueeze(-1)).sum(1).to(x.dtype)


SPELLINGS = [
    "model",
    "method-argsort",
    "sort-indices",
    "index_select-div",
    "zeros_like-unflatten",
    "index-none-sum-dim",
]


@pytest.mark.parametrize("spelling", SPELLINGS)
def test_fuses_once_and_matches(spelling, tmp_path):
    torch.manual_seed(0)
    module = Dispatch(spelling)
    x = torch.randn(T, D)
    want, want_grads = module_grads(module, x, None)
    got, got_grads = module_grads(module, x, tmp_path)
    assert _counts(_pass_step(tmp_path)) == (1, 1), _pass_step(tmp_path)["notes"]
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    for g, w in zip(got_grads, want_grads, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-6)


class NotAPermutation(Dispatch):
    """x[idx // k] with an index that is not an argsort (a gather with repeats)."""

    def forward(self, x):
        idx = self.experts.flatten()
        return torch.tanh(x[idx // K]).sum()


class OrderGiven(Dispatch):
    """x[order // k] with an order the graph receives as it is (a buffer: an input of the
    graph, not known to be a permutation)."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("order", torch.randperm(T * K, generator=torch.Generator()))

    def forward(self, x):
        return torch.tanh(x[self.order // K]).sum()


class SlotsReturned(Dispatch):
    """The [T*k, D] slot buffer is also returned: the combine must stay."""

    def forward(self, x):
        weights = torch.softmax(self.gate(x), dim=-1)
        order = torch.argsort(self.experts.flatten())
        ys = self.expert(x[order // K])
        y = torch.empty_like(ys).index_copy_(0, order, ys)
        return (y.view(T, K, D) * weights.unsqueeze(-1)).sum(1), y


class MeanCombine(Dispatch):
    """A mean over the k copies instead of a weighted sum."""

    def forward(self, x):
        order = torch.argsort(self.experts.flatten())
        ys = self.expert(x[order // K])
        y = torch.empty_like(ys).index_copy_(0, order, ys)
        return y.view(T, K, D).mean(1)


@pytest.mark.parametrize(
    "module,permutes,unpermutes,note",
    [
        (NotAPermutation(), 0, 0, "is not an argsort"),
        (OrderGiven(), 0, 0, "is not an argsort"),
        (SlotsReturned(), 1, 0, "not only by the combine"),
        (MeanCombine(), 1, 0, "are not multiplied by the weights"),
    ],
)
def test_refusals_are_noted(module, permutes, unpermutes, note, tmp_path):
    x = torch.randn(T, D)
    torch._dynamo.reset()
    fn = torch.compile(
        module, backend=backend(inner="aot_eager", dump_dir=tmp_path), fullgraph=True
    )
    torch.testing.assert_close(fn(x), module(x))
    step = _pass_step(tmp_path)
    assert _counts(step) == (permutes, unpermutes)
    assert any(note in n for n in step["notes"]), step["notes"]


def test_no_dispatch_is_a_quiet_note(tmp_path):
    torch._dynamo.reset()
    fn = torch.compile(nn.Linear(D, D), backend=backend(inner="aot_eager", dump_dir=tmp_path))
    fn(torch.randn(T, D))
    assert _pass_step(tmp_path)["notes"] == ["no MoE token permutation or combine in this graph"]


@pytest.mark.parametrize("autocast", [False, True])
def test_moe_layer_fuses_and_matches(autocast, tmp_path):
    """The MoE layer of models/moe.py: both ops once, autocast's two casts of the slots folded
    into the permute; outputs and every gradient equal the unfused layer (fp32: to rounding;
    bf16 autocast: the sums over k run in another order)."""
    cfg = dataclasses.replace(MODEL_PRESETS["moe-debug"], first_k_dense=0)
    model = build_model(cfg)
    model.init_weights(seed=0)
    moe = model.layers["0"].moe
    x = torch.randn(2, 11, cfg.dim, generator=torch.Generator().manual_seed(2))
    want, want_grads = module_grads(moe, x, None, autocast)
    got, got_grads = module_grads(moe, x, tmp_path, autocast)
    step = _pass_step(tmp_path)
    assert _counts(step) == (1, 1), step["notes"]
    assert step["op_counts"].get("Tensor.index_copy_", 0) == 0
    if autocast:
        assert any("dtype=torch.bfloat16 (folded 2 cast(s))" in n for n in step["notes"])
    tol = 1e-2 if autocast else 1e-5
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)
    for g, w in zip(got_grads, want_grads, strict=True):
        torch.testing.assert_close(g, w, rtol=tol, atol=tol)
