"""Tests of the fp8_cast_once pass: fp8_linear taken apart in the post-grad graphs (one cast of
a shared input, amaxes as aten reductions) gives the same bits as the op, forward and backward,
under Inductor; the post-grad graphs hold the casts the pass promises; refusals are noted.

A transformer-shaped block: q, k, v read one RMSNorm output, w1 and w3 another, w2 the SwiGLU
product, wo (with a bias: its backward stays the op) the attention output. Shapes are tiny
multiples of 16 (fp8.min_dim lowered to 16); the FP8 ops run their CPU code (torch._scaled_mm
on CPU), Inductor's C++ kernels compute the amaxes.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from graphtrain.compile import backend
from graphtrain.custom_ops import fp8_cast as fc

OPTIONS = {"fp8.min_dim": 16}
FORWARD_OP, BACKWARD_OP = "graphtrain.fp8_linear.default", "graphtrain.fp8_linear_backward.default"
CAST = "graphtrain.fp8_cast.default"


class Block(nn.Module):
    def __init__(self, dim: int = 32, ffn: int = 48) -> None:
        super().__init__()
        self.wq, self.wk, self.wv = (nn.Linear(dim, dim, bias=False) for _ in range(3))
        self.wo = nn.Linear(dim, dim)
        self.w1, self.w3 = nn.Linear(dim, ffn, bias=False), nn.Linear(dim, ffn, bias=False)
        self.w2 = nn.Linear(ffn, dim, bias=False)
        self.norm = nn.Parameter(1 + 0.1 * torch.randn(dim))

    def forward(self, x):
        h = F.rms_norm(x, x.shape[-1:], self.norm)
        q, k, v = self.wq(h), self.wk(h), self.wv(h)
        attn = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1]), -1) @ v
        x = x + self.wo(attn)
        h = F.rms_norm(x, x.shape[-1:])
        return x + self.w2(F.silu(self.w1(h)) * self.w3(h))


def _run(block, xs, passes, dump, autocast):
    """[(out, grads of x and every parameter, elements cast per tensor class, saturation
    stats)] per input of xs, compiled once."""
    torch._dynamo.reset()
    fn = torch.compile(
        block,
        backend=backend(passes=passes, pass_options=OPTIONS, inner="inductor", dump_dir=dump),
        fullgraph=True,
    )
    results = []
    for x in xs:
        x = x.detach().clone().requires_grad_()
        fc.fp8_saturation_stats(reset=True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            out = fn(x)
        g = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(out.dtype)
        grads = torch.autograd.grad(out, [x, *block.parameters()], g)
        totals = dict(zip(fc.TENSOR_CLASSES, fc._COUNTERS[x.device][:, 2].tolist(), strict=True))
        stats = {k: v.item() for k, v in fc.fp8_saturation_stats().items()}
        results.append((out.detach(), grads, totals, stats))
    return results


def _post_grad(dump, kind: str) -> dict:
    """The fp8_cast_once entry of the forward or backward graph's summary."""
    (summary,) = list(dump.glob(f"*/{kind}/summary.json"))
    (step,) = [s for s in json.loads(summary.read_text()) if s["label"] == "fp8_cast_once"]
    return step


@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16-autocast"])
def test_same_bits_as_the_op(tmp_path, autocast):
    # In bf16, Inductor elides the rounding of intermediate values inside a fused kernel, so a
    # producer that absorbs an amax (the SwiGLU backward here) can round differently than in
    # the graph without the pass: ~1e-6 relative in w1/w3's gradients on CPU. With Inductor's
    # eager-precision emulation the fusions are numerically neutral and the pass's own maths
    # is checked bit for bit; in fp32 there is no such rounding.
    with torch._inductor.config.patch(emulate_precision_casts=autocast):
        _check_same_bits(tmp_path, autocast)


def _check_same_bits(tmp_path, autocast):
    torch.manual_seed(0)
    block = Block()
    with torch.no_grad():  # one column 1e6 times the rest: the others flush to zero in E4M3
        block.norm[0] = 1e6
    x = torch.randn(2, 16, 32)
    nan = x.clone()
    nan[1, 3, 5] = float("nan")
    on = _run(block, [x, nan], ["+fp8_linear", "+fp8_cast_once"], tmp_path / "on", autocast)
    off = _run(block, [x], ["+fp8_linear", "-fp8_cast_once"], tmp_path / "off", autocast)
    (out, grads, totals, stats), (want, want_grads, want_totals, want_stats) = on[0], off[0]
    assert out.dtype == want.dtype and torch.equal(out, want)
    for got, ref in zip(grads, want_grads, strict=True):
        assert got.dtype == ref.dtype and torch.equal(got, ref)
    # Saturation counts: a shared input is cast, and counted, once (the op counted it once per
    # linear: q, k, v three times, w1 and w3 twice); weights and gradients as before.
    M, D, F = 32, 32, 48
    assert want_totals == {"activation": 6 * M * D + M * F, "weight": 4 * D * D + 3 * D * F,
                           "gradient": 5 * M * D + 2 * M * F}  # fmt: skip
    assert totals == {**want_totals, "activation": 3 * M * D + M * F}
    for name in ("weight", "gradient"):
        for kind in ("clipped", "flushed"):
            assert stats[f"fp8/{kind}/{name}"] == want_stats[f"fp8/{kind}/{name}"]
    assert stats["fp8/flushed/activation"] > 0 and want_stats["fp8/flushed/activation"] > 0
    # a NaN reaches the output through the graph's amax (the trainer's non-finite check)
    assert on[1][0].isnan().any()

    forward, backward = (
        _post_grad(tmp_path / "on", "forward"),
        _post_grad(tmp_path / "on", "backward"),
    )
    counts = forward["op_counts"]
    assert counts.get(FORWARD_OP, 0) == 0, forward["notes"]
    # casts: x of q/k/v, x of w1/w3, w2's input, wo's input; and the 7 weights
    assert counts[CAST] == 4 + 7, forward["notes"]
    assert sum("one cast of" in n and "for 3 linear(s)" in n for n in forward["notes"]) == 1
    assert sum("for 2 linear(s)" in n for n in forward["notes"]) == 1
    counts = backward["op_counts"]
    assert counts[BACKWARD_OP] == 1 and counts[CAST] == 6, backward["notes"]  # wo's stays
    assert any("has a bias" in n for n in backward["notes"]), backward["notes"]
    # the amaxes are aten reductions Inductor compiles (not graphtrain::fp8_amax calls)
    assert counts.get("graphtrain.fp8_amax.default", 0) == 0
    assert counts["aten.amax.default"] == 6 and counts["aten.bitwise_and.Scalar"] == 6
