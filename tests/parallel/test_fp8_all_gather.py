"""graphtrain.parallel.fp8_all_gather in one process: which weights it wraps, what an FP8-gathered
weight computes, and that checkpoints hold plain tensors. FSDP2 gathering them on two ranks,
bitwise against the option off, is tests/parallel/test_overlap_tp_comm.py's fp8_fsdp_dp2."""

from __future__ import annotations

import io

import pytest
import torch
import torch.nn.functional as F

from graphtrain.config import Fp8Config
from graphtrain.parallel.fp8_all_gather import Fp8ShardWeight, Fp8Weight, fp8_gathered_linears
from models import MODEL_PRESETS, build_model


def test_the_filters_choose_the_weights():
    with torch.device("meta"):
        model = build_model(MODEL_PRESETS["debug"])
    paths = fp8_gathered_linears(model, Fp8Config(min_dim=16), dp=2)
    assert "output" not in paths and "layers.0.attention.wq" in paths, paths
    assert {p.split(".")[-1] for p in paths} == {"wq", "wk", "wv", "wo", "w1", "w2", "w3"}
    assert fp8_gathered_linears(model, Fp8Config(), dp=2) == []  # min_dim 4096


def test_fp8_weight_runs_fp8_linear_on_its_bytes():
    # The weight as FSDP2 hands it over (E4M3 bytes and 1 / scale, here fp8_linear's own cast
    # of w): fp8_linear's outputs and both gradients are those of the high-precision weight;
    # any other op sees the dequantized weight.
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(6, 32, generator=g), torch.randn(48, 32, generator=g)
    _, _, _, w8_t, sw = torch.ops.graphtrain.fp8_linear(x, w, None)
    grad = torch.randn(6, 48, generator=g)
    results = []
    for weight in (w.clone(), Fp8Weight(w8_t.t().contiguous(), sw, torch.float32)):
        xr, wr = x.clone().requires_grad_(), weight.requires_grad_()
        out = torch.ops.graphtrain.fp8_linear(xr, wr, None)[0]
        out.backward(grad)
        results.append((out, xr.grad, wr.grad))
    for a, b in zip(*results, strict=True):
        assert type(b) is torch.Tensor and torch.equal(a, b)
    w8 = w8_t.t().contiguous()  # the layout FSDP2 hands over; the reference dequantizes it alike
    fp8_w = Fp8Weight(w8, sw, torch.float32)
    dequantized = w8.float() * sw
    assert torch.equal(F.linear(x, fp8_w), F.linear(x, dequantized))


def test_checkpoints_hold_the_plain_tensor():
    w = torch.randn(4, 8)
    buffer = io.BytesIO()
    torch.save({"w": Fp8ShardWeight(w, pow2_scale=False)}, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=True)["w"]
    assert type(loaded) is torch.Tensor and torch.equal(loaded, w)


def test_without_fsdp_it_is_a_clear_error_before_any_work():
    from graphtrain.parallel import ParallelDims, parallelize_model

    with torch.device("meta"):
        model = build_model(MODEL_PRESETS["debug"])
    before = {n: type(p) for n, p in model.named_parameters()}
    with pytest.raises(ValueError, match=r"needs FSDP \(dp_shard > 1\) without tp, got dp_shard=1"):
        parallelize_model(
            model, None, ParallelDims(world_size=1), plan={}, ac_mode="none",
            compile_options=None, param_dtype=torch.float32, reduce_dtype=torch.float32,
            fp8_all_gather=Fp8Config(min_dim=16),
        )  # fmt: skip
    assert {n: type(p) for n, p in model.named_parameters()} == before  # nothing wrapped
