"""Tests of graphtrain::fp8_grouped_mm (the experts' grouped GEMM in FP8) and its backward.

Oracles as in test_fp8_linear.py: float64 GEMMs per expert on the same FP8-rounded operands
(x and grad_out per tensor, each expert's weight with its own scale), tight; and
torch._grouped_mm in fp32 by SQNR with the same dB bounds and reasons (E4M3 x E4M3 forward
~26 dB, E5M2 x E4M3 gradients ~22 dB, less about 1 dB of sample spread).
"""

from __future__ import annotations

import pytest
import torch
from test_fp8_linear import dequant, rel, sqnr

import graphtrain.custom_ops  # noqa: F401  (registers the ops)

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def _inputs(counts, K, N, seed):
    g = torch.Generator().manual_seed(seed)
    M, E = sum(counts), len(counts)
    x = torch.randn(M, K, generator=g)
    w = torch.randn(E, N, K, generator=g) * torch.logspace(-2, 1, E).view(E, 1, 1)
    offs = torch.tensor(counts).cumsum(0).to(torch.int32)
    return x, w, offs, torch.randn(M, N, generator=g)


def _run(x, w, offs, grad, **options):
    x, w = x.clone().requires_grad_(), w.clone().requires_grad_()
    out = torch.ops.graphtrain.fp8_grouped_mm(x, w, offs, **options)[0]
    return out, torch.autograd.grad(out, [x, w], grad.to(out.dtype))


@pytest.mark.parametrize("counts", [[5, 0, 11, 3], [16, 16], [7]])
@pytest.mark.parametrize("e4m3_grads", [False, True])
def test_matches_float64_on_fp8_operands(counts, e4m3_grads):
    x, w, offs, grad = _inputs(counts, 24, 20, seed=len(counts))
    out, (gx, gw) = _run(x, w, offs, grad, e4m3_grads=e4m3_grads)
    x8, g8 = dequant(x, E4M3), dequant(grad, E4M3 if e4m3_grads else E5M2)
    want_out, want_gx = torch.zeros(out.shape, dtype=torch.float64), torch.zeros_like(x8)
    want_gw = torch.zeros(w.shape, dtype=torch.float64)
    start = 0
    for e, end in enumerate(offs.tolist()):
        w8 = dequant(w[e], E4M3)  # each expert scaled by its own amax
        rows = slice(start, end)
        want_out[rows] = x8[rows] @ w8.T
        want_gx[rows] = g8[rows] @ w8
        want_gw[e] = g8[rows].T @ x8[rows]
        start = end
    assert rel(out, want_out) < 1e-6 and rel(gx, want_gx) < 1e-6
    for e in range(len(counts)):  # per expert: their norms differ by 1000x
        if counts[e]:
            assert rel(gw[e], want_gw[e]) < 1e-6
        else:
            assert torch.equal(gw[e], torch.zeros_like(gw[e]))


def test_sqnr_against_grouped_mm():
    x, w, offs, grad = _inputs([100, 37, 0, 120], 64, 48, seed=3)
    out, (gx, gw) = _run(x, w, offs, grad)
    x, w = x.requires_grad_(), w.requires_grad_()
    want = torch._grouped_mm(x, w.transpose(-2, -1), offs=offs)
    wgx, wgw = torch.autograd.grad(want, [x, w], grad)
    assert 25.0 < sqnr(out, want) < 40.0
    assert 21.0 < sqnr(gx, wgx) < 40.0
    for e in (0, 1, 3):
        assert 21.0 < sqnr(gw[e], wgw[e]) < 40.0


def test_bf16_output():
    x, w, offs, grad = _inputs([9, 7], 32, 16, seed=1)
    out, (gx, gw) = _run(x, w, offs, grad, out_dtype=torch.bfloat16)
    assert out.dtype == torch.bfloat16 and gx.dtype == gw.dtype == torch.float32
    want = torch._grouped_mm(x, w.transpose(-2, -1), offs=offs)
    assert 25.0 < sqnr(out, want) < 40.0


def test_bad_arguments():
    x, w, offs, _ = _inputs([3, 4], 8, 6, seed=0)
    with pytest.raises(ValueError, match="x \\[M, K\\] and weight \\[E, N, K\\]"):
        torch.ops.graphtrain.fp8_grouped_mm(x, w[..., :5], offs)
    with pytest.raises(ValueError, match="offs must be int32 \\[E\\] = \\[2\\]"):
        torch.ops.graphtrain.fp8_grouped_mm(x, w, offs.long())


def test_opcheck():
    # As test_fp8_linear.test_opcheck: the checks that do not need float8 CPU arithmetic.
    utils = ("test_faketensor", "test_autograd_registration", "test_aot_dispatch_dynamic")
    x, w, offs, grad = _inputs([3, 0, 6], 16, 8, seed=2)
    op = torch.ops.graphtrain
    torch.library.opcheck(op.fp8_grouped_mm.default, (x, w, offs), test_utils=utils)
    _, x8_t, sx, w8_t, sw = op.fp8_grouped_mm(x, w, offs)
    kwargs = dict(e4m3_grads=False, pow2_scale=False, x_dtype=torch.float32)
    kwargs["w_dtype"] = torch.float32
    args = (grad, x8_t, sx, w8_t, sw, offs)
    torch.library.opcheck(op.fp8_grouped_mm_backward.default, args, kwargs, test_utils=utils)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_matches_cpu_reference():
    """The CUDA path (Triton casts, _scaled_mm per expert; groups of multiples of 16 rows, as
    _scaled_mm needs on CUDA) against the CPU reference on the same inputs."""
    x, w, offs, grad = _inputs([32, 0, 48, 16], 64, 32, seed=4)
    want = _run(x, w, offs, grad)
    got = _run(x.cuda(), w.cuda(), offs.cuda(), grad.cuda())
    assert rel(got[0].cpu(), want[0]) < 1e-6
    for g, r in zip(got[1], want[1], strict=True):
        assert rel(g.cpu(), r) < 1e-6
