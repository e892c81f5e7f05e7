"""Tests of the fuse_sibling_grouped_mm pass: two grouped GEMMs of one input become one over the
concatenated weights (the experts' gate and up projections), where it must not fire, and that
outputs and every gradient equal the unfused graph.

Graphs come from Dynamo through graphtrain's own backend (inner="aot_eager", dumps on).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from conftest import module_grads, pass_step
from torch import nn

from graphtrain.compile import backend
from graphtrain.config import load_config
from graphtrain.passes.fuse_sibling_grouped_mm import concatenated_weights
from models import MODEL_PRESETS, build_model

PASS = "fuse_sibling_grouped_mm"
GMM = "torch._grouped_mm"
E, D, FA, FB = 3, 8, 16, 8  # gate and up of different widths


def _step(dump: Path) -> dict:
    return pass_step(dump, PASS)


class Siblings(nn.Module):
    """silu(x @ Wa[e].T) * (x @ Wb[e].T) per expert group; `variant` spells the weights."""

    def __init__(self, variant: str = "plain") -> None:
        super().__init__()
        self.variant = variant
        self.wa = nn.Parameter(torch.randn(E, FA if variant != "same-width" else FB, D) * 0.3)
        self.wb = nn.Parameter(torch.randn(E, FB, D) * 0.3)
        self.register_buffer("offs", torch.tensor([4, 4, 11], dtype=torch.int32))  # empty group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = torch._grouped_mm(x, self.wa.transpose(-2, -1), offs=self.offs)
        if self.variant == "weight-late":  # wb's producer after the first GEMM's use
            a = F.silu(a)
            wb = (self.wb * 1.0).transpose(-2, -1)
        else:
            wb = self.wb.transpose(-2, -1)
        b = torch._grouped_mm(x, wb, offs=self.offs)
        a = a if self.variant == "weight-late" else F.silu(a)
        return (a[:, :FB] * b).sum(-1, keepdim=True) * b


@pytest.mark.parametrize("variant", ["plain", "weight-late", "same-width"])
def test_fuses_and_matches(variant, tmp_path):
    module = Siblings(variant)
    x = torch.randn(11, D, generator=torch.Generator().manual_seed(0))
    want, want_grads = module_grads(module, x, None)
    got, got_grads = module_grads(module, x, tmp_path)
    step = _step(tmp_path)
    assert step["op_counts"][GMM] == 1, step["notes"]
    assert step["op_diff"] == {
        GMM: -1,
        "Tensor.transpose": -1,
        "torch.cat": 1,
        "torch.narrow": 2,
    }
    if variant == "weight-late":
        assert "moved" in step["notes"][0]
    # fp32: the same dot products, summed in another order by another GEMM (gradients of
    # magnitude ~3 were seen 5e-6 apart)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    for g, w in zip(got_grads, want_grads, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)


class WeightReturned(Siblings):
    """The transposed weight is also an output: the pair stays as it is."""

    def forward(self, x):
        wt = self.wb.transpose(-2, -1)
        a = torch._grouped_mm(x, self.wa.transpose(-2, -1), offs=self.offs)
        return a[:, :FB] * torch._grouped_mm(x, wt, offs=self.offs), wt


class NotTransposed(Siblings):
    """Weights stored [E, D, F] (no transpose): not the layout the pass concatenates."""

    def __init__(self):
        super().__init__()
        self.wc = nn.Parameter(torch.randn(E, D, FB))

    def forward(self, x):
        a = torch._grouped_mm(x, self.wa.transpose(-2, -1), offs=self.offs)
        return a[:, :FB] * torch._grouped_mm(x, self.wc, offs=self.offs)


class OneGemm(Siblings):
    def forward(self, x):
        return torch._grouped_mm(x, self.wa.transpose(-2, -1), offs=self.offs)


@pytest.mark.parametrize(
    "module,note",
    [
        (WeightReturned(), "has other users"),
        (NotTransposed(), "is not W.transpose(-2, -1)"),
        (OneGemm(), "no two grouped GEMMs share an input: nothing to fuse"),
    ],
)
def test_left_unchanged_with_a_note(module, note, tmp_path):
    x = torch.randn(11, D)
    torch._dynamo.reset()
    fn = torch.compile(
        module, backend=backend(inner="aot_eager", dump_dir=tmp_path), fullgraph=True
    )
    torch.testing.assert_close(fn(x), module(x))
    step = _step(tmp_path)
    assert step["op_diff"] == {}
    assert any(note in n for n in step["notes"]), step["notes"]


@pytest.mark.parametrize("autocast", [False, True])
def test_moe_layer_gate_and_up_fuse(autocast, tmp_path):
    """models/moe.py's experts: after fuse_moe_dispatch gives w1 and w3 one input (under
    autocast: its two casts folded), they become one grouped GEMM; the layer's output and
    gradients equal the unfused layer's (fp32 to rounding, bf16 autocast within its rounding)."""
    cfg = dataclasses.replace(MODEL_PRESETS["moe-debug"], first_k_dense=0)
    model = build_model(cfg)
    model.init_weights(seed=0)
    moe = model.layers["0"].moe
    x = torch.randn(2, 11, cfg.dim, generator=torch.Generator().manual_seed(2))
    want, want_grads = module_grads(moe, x, None, autocast)
    got, got_grads = module_grads(moe, x, tmp_path, autocast)
    step = _step(tmp_path)
    assert step["op_counts"][GMM] == 2, step["notes"]  # w1|w3, then w2
    tol = 1e-2 if autocast else 1e-5
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)
    for g, w in zip(got_grads, want_grads, strict=True):
        torch.testing.assert_close(g, w, rtol=tol, atol=tol)


def test_concatenated_weights_are_what_the_pass_concatenates(tmp_path):
    """concatenated_weights (the weights graphtrain.precision gives no working copy) are each
    MoE layer's experts.w1 and experts.w3, the two the pass's note says it concatenated in a
    compiled layer; none with the pass switched off or compile off."""
    cfg = load_config(["--preset", "moe-debug"])
    model = build_model(cfg.model)
    names = {id(p): name for name, p in model.named_parameters()}
    got = [names[id(p)] for p in concatenated_weights(model, cfg.compile)]
    assert got == [f"layers.{i}.moe.experts.{w}" for i in (1, 2) for w in ("w1", "w3")]
    for off in (
        dataclasses.replace(cfg.compile, passes=[f"-{PASS}"]),
        dataclasses.replace(cfg.compile, enable=False),
    ):
        assert concatenated_weights(model, off) == []
    x = torch.randn(2, 11, cfg.model.dim, generator=torch.Generator().manual_seed(2))
    module_grads(model.layers["1"].moe, x, tmp_path)
    (note,) = _step(tmp_path)["notes"]
    weights = "l_self_modules_experts_parameters_w1_, l_self_modules_experts_parameters_w3_"
    assert f"cat([{weights}], 1)" in note, note
