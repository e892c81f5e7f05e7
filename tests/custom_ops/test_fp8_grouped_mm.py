"""Tests of graphtrain::fp8_grouped_mm (the experts' grouped GEMM in FP8) and its backward.

Oracles as in test_fp8_linear.py: float64 GEMMs per expert on the same FP8-rounded operands
(x and grad_out per tensor, each expert's weight with its own scale), tight; and
torch._grouped_mm in fp32 by SQNR with the same dB bounds and reasons (E4M3 x E4M3 forward
~26 dB, E5M2 x E4M3 gradients ~22 dB, less about 1 dB of sample spread).

The CUDA path (torch._scaled_grouped_mm, sm90) has no CPU kernel: its layouts, scales and
padding run here against an exact CPU emulation of the kernel (emulated_scaled_grouped_mm)
and are compared with the reference loop within one bf16 rounding; torch's own Meta kernel
checks every call's dtypes, layouts, strides and scale shapes. The real kernel against the
reference is the gpu-marked test.
"""

from __future__ import annotations

import pytest
import torch
from test_fp8_linear import dequant, rel, spy_fast_accum, sqnr

import graphtrain.custom_ops  # noqa: F401  (registers the ops)
from graphtrain.custom_ops import fp8_cast as fc
from graphtrain.custom_ops import fp8_grouped_mm as gmm
from graphtrain.custom_ops import fp8_linear as fl

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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("pow2_scale", [False, True])
def test_batched_weight_cast_equals_per_expert(monkeypatch, dtype, pow2_scale):
    """The weights' per-slice amax and cast (one call each) give the bytes, scales and
    saturation counts of one fp8_amax and one fp8_cast per expert, bit for bit; an all-zero
    expert included."""
    x, w, offs, _ = _inputs([3, 4, 2], 16, 24, seed=5)
    w[1] = 0.0
    x, w = x.to(dtype), w.to(dtype)
    counters = {}
    monkeypatch.setattr(fc, "_COUNTERS", counters)
    *_, w8, w8_t, sw = gmm._cast_operands(x, w, offs, pow2_scale)
    batched = counters[w.device][1].clone()
    counters.clear()
    per_expert = [
        fl.cast_pair(t, torch.ops.graphtrain.fp8_amax(t), E4M3, pow2_scale, "weight")
        for t in w.unbind(0)
    ]
    for got, want in zip((w8, w8_t, sw), zip(*per_expert, strict=True), strict=True):
        assert torch.equal(_bytes(got), _bytes(torch.stack(want)))
    assert torch.equal(batched, counters[w.device][1])


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


def emulated_scaled_grouped_mm(
    mat_a, mat_b, scale_a, scale_b, offs=None, bias=None, scale_result=None, out_dtype=None,
    use_fast_accum=False,
):  # fmt: skip
    """torch._scaled_grouped_mm's row-wise FP8 semantics on CPU: the argument checks of its
    Meta kernel, the device-side checks of its sm90 kernel (2d-2d groups along K non-empty,
    all but the last a multiple of 16), then per group the FP8 values in fp32, an fp32
    matmul, the scales applied as its epilogue does (scale_b * (scale_a * acc)), rounded to
    bf16. Rows past offs[-1] are NaN (the kernel leaves them unwritten). use_fast_accum
    changes only the kernel's accumulator precision (the gpu test's): fp32 sums here."""
    meta = [torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")
            for t in (mat_a, mat_b, scale_a, scale_b, offs)]  # fmt: skip
    torch.ops.aten._scaled_grouped_mm.default(*meta, out_dtype=out_dtype)
    assert bias is None and scale_result is None
    assert out_dtype in (None, torch.bfloat16) and len(offs) <= 1023
    ends = offs.tolist()
    starts = [0, *ends[:-1]]
    a, b = mat_a.float(), mat_b.float()
    if b.dim() == 3:  # 2d-3d: groups of rows of a, one [K, N] matrix of b each
        out = torch.full((a.shape[0], b.shape[2]), float("nan"), dtype=torch.bfloat16)
        for g, (start, end) in enumerate(zip(starts, ends, strict=True)):
            acc = a[start:end] @ b[g]
            out[start:end] = (scale_b[g] * (scale_a[start:end, None] * acc)).bfloat16()
        return out
    P, Q = a.shape[0], b.shape[1]  # 2d-2d: groups along K, one [P, Q] result each
    out = torch.empty(len(ends), P, Q, dtype=torch.bfloat16)
    for g, (start, end) in enumerate(zip(starts, ends, strict=True)):
        assert end > start, f"group {g} empty: the kernel asserts"
        assert g == len(ends) - 1 or (end - start) % 16 == 0, f"group {g} misaligned"
        acc = a[:, start:end] @ b[start:end]
        sa, sb = scale_a[g * P : (g + 1) * P, None], scale_b[g * Q : (g + 1) * Q]
        out[g] = (sb * (sa * acc)).bfloat16()
    return out


def close_to_bf16(got, want, cancel=2.0**-20):
    """got within one bf16 rounding of want: the grouped path rounds each GEMM's result to
    bf16 (relative 2^-9), and its fp32 sums run in another order than the reference's, which
    can move a result across a bf16 rounding boundary (one bf16 step, relative 2^-7 at most);
    results that nearly cancel differ by fp32 rounding of the sum, hence 2^-20 of the largest
    value (seen: ~2^-28) on CPU; on Hopper the FP8 tensor cores accumulate in about 14 mantissa bits
    (see tests/custom_ops/test_fp8_linear.py), so `cancel` is 2^-12 there. The FP8 operands
    themselves carry errors of 2^-4."""
    want = want.double()
    err = (got.double() - want).abs()
    return bool((err <= 2**-7 * want.abs() + cancel * want.abs().max()).all())


def _bytes(t):
    return t.reshape(-1).view(torch.uint8)


GROUP_CASES = [
    ([5, 0, 37, 3, 0, 19], 0),  # uneven, empty experts, groups not multiples of 16
    ([16, 32], 0),  # aligned already
    ([0, 0, 7], 9),  # leading empty experts, rows past offs[-1]
    ([1], 0),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("counts, tail", GROUP_CASES)
def test_grouped_path_matches_reference(monkeypatch, counts, tail, dtype):
    """The CUDA path's layouts, scales and padding on CPU, with torch._scaled_grouped_mm
    emulated, against the reference loop (the same FP8 bytes, gradients in E4M3 in both)."""
    monkeypatch.setattr(torch, "_scaled_grouped_mm", emulated_scaled_grouped_mm)
    x, w, offs, grad = _inputs(counts, 32, 48, seed=sum(counts) + tail)
    x = torch.cat([x, torch.randn(tail, 32)]).to(dtype)
    w, grad = w.to(dtype), torch.cat([grad, torch.randn(tail, 48)]).to(dtype)
    got = gmm.fp8_grouped_mm_cuda(x, w, offs)
    want = gmm.fp8_grouped_mm_ref(x, w, offs)
    end = int(offs[-1])
    assert got[0].dtype == dtype and close_to_bf16(got[0][:end], want[0][:end])
    for g, r in zip(got[1:], want[1:], strict=True):  # FP8 copies and scales: the same
        assert g.dtype == r.dtype and torch.equal(_bytes(g), _bytes(r))
    _, x8_t, sx, w8_t, sw = want
    args = (grad, x8_t, sx, w8_t, sw, offs)
    kwargs = dict(pow2_scale=False, x_dtype=dtype, w_dtype=dtype)
    gx, gw = gmm.fp8_grouped_mm_backward_cuda(*args, e4m3_grads=False, **kwargs)
    wx, ww = gmm.fp8_grouped_mm_backward_ref(*args, e4m3_grads=True, **kwargs)
    assert gx.dtype == gw.dtype == dtype
    assert close_to_bf16(gx[:end], wx[:end]) and close_to_bf16(gw, ww)
    for e, n in enumerate(counts):
        assert n or torch.equal(gw[e], torch.zeros_like(gw[e]))  # empty expert: zero gradient
    # the gradient is E4M3 whatever e4m3_grads says
    same = gmm.fp8_grouped_mm_backward_cuda(*args, e4m3_grads=True, **kwargs)
    assert torch.equal(same[0][:end], gx[:end]) and torch.equal(same[1], gw)


@pytest.mark.parametrize("grouped", [True, False])
def test_forward_accumulates_fast_the_gradients_promote(monkeypatch, grouped):
    """Both paths as graphtrain::fp8_linear: fast accumulation in the forward GEMM(s), fp32
    promotion in the dgrad and wgrad (test_fp8_linear's test of the same name)."""
    if grouped:
        flags = spy_fast_accum(monkeypatch, "_scaled_grouped_mm", emulated_scaled_grouped_mm)
        forward, backward = gmm.fp8_grouped_mm_cuda, gmm.fp8_grouped_mm_backward_cuda
    else:
        flags = spy_fast_accum(monkeypatch, "_scaled_mm")
        forward, backward = gmm.fp8_grouped_mm_ref, gmm.fp8_grouped_mm_backward_ref
    x, w, offs, grad = _inputs([5, 0, 19], 32, 48, seed=7)
    _, x8_t, sx, w8_t, sw = forward(x, w, offs)
    assert flags == ([True] if grouped else [True, True])  # one GEMM, or one per expert with rows
    flags.clear()
    kwargs = dict(e4m3_grads=False, pow2_scale=False, x_dtype=x.dtype, w_dtype=w.dtype)
    backward(grad, x8_t, sx, w8_t, sw, offs, **kwargs)
    assert flags == [False] * (2 if grouped else 4)


def test_padded_groups():
    """The wgrad's layout, as the cast writes it (padded_offsets are the GEMM's group ends):
    each expert's rows of x (columns of x8_t) at the start of a group of max(16,
    ceil16(rows)) columns, zeros after them; rows past offs[-1] in no group."""
    counts = [5, 0, 37, 3]
    offs = torch.tensor(counts).cumsum(0).to(torch.int32)
    x = torch.arange(1, 48).float()[:, None].expand(-1, 2).contiguous()  # row i: i + 1
    assert fc.padded_offsets(offs).tolist() == [16, 32, 80, 96]
    assert fc.padded_width(47, 4) == 48 + 16 * 4
    _, padded, _, _ = torch.ops.graphtrain.fp8_cast(
        x, torch.tensor(448.0), torch.float8_e4m3fn, False, True, offs
    )
    assert padded.shape == (2, 112) and padded.dtype == torch.float8_e4m3fn
    want = torch.zeros(2, 112)
    start = 0
    for pstart, n in zip([0, 16, 32, 80], counts, strict=True):
        want[:, pstart : pstart + n] = x[start : start + n].t()
        start += n
    # scale 1; the columns from the last group's end (96) on are in no group: unspecified
    assert torch.equal(padded.float()[:, :96], want.to(torch.float8_e4m3fn).float()[:, :96])


@pytest.mark.parametrize("counts, tail", GROUP_CASES[:3])
def test_meta_kernel_takes_the_layouts(monkeypatch, counts, tail):
    """torch._scaled_grouped_mm's own Meta kernel (its dtype, layout, stride and scale-shape
    checks) on every call of the CUDA path, forward and backward, with the casts' fake
    outputs: a layout mistake fails here, without a GPU."""
    monkeypatch.setattr(fc, "_COUNTERS", {})  # the saturation counters of meta casts
    M, E, K, N = sum(counts) + tail, len(counts), 64, 48
    x = torch.empty(M, K, device="meta", dtype=torch.bfloat16)
    w = torch.empty(E, N, K, device="meta", dtype=torch.bfloat16)
    offs = torch.empty(E, device="meta", dtype=torch.int32)
    out, x8_t, sx, w8_t, sw = gmm.fp8_grouped_mm_cuda(x, w, offs, out_dtype=torch.float32)
    assert out.shape == (M, N) and out.dtype == torch.float32
    grad = torch.empty(M, N, device="meta", dtype=torch.float32)
    gx, gw = gmm.fp8_grouped_mm_backward_cuda(
        grad, x8_t, sx, w8_t, sw, offs, e4m3_grads=False, pow2_scale=False,
        x_dtype=torch.bfloat16, w_dtype=torch.float32,
    )  # fmt: skip
    assert (gx.shape, gx.dtype) == ((M, K), torch.bfloat16)
    assert (gw.shape, gw.dtype) == ((E, N, K), torch.float32)


def test_meta_kernel_refuses_a_wrong_layout():
    """The check above can fail: a row-major second operand is refused."""
    a = torch.empty(32, 64, device="meta", dtype=torch.float8_e4m3fn)
    b = torch.empty(2, 64, 48, device="meta", dtype=torch.float8_e4m3fn)
    sa, sb = torch.empty(32, device="meta"), torch.empty(2, 48, device="meta")
    offs = torch.empty(2, device="meta", dtype=torch.int32)
    with pytest.raises(RuntimeError, match="column major"):
        torch._scaled_grouped_mm(a, b, sa, sb, offs, out_dtype=torch.bfloat16)


@pytest.mark.gpu
def test_cuda_matches_cpu_reference():
    """The registered op on the GPU (torch._scaled_grouped_mm on sm90, the loop of
    torch._scaled_mm elsewhere) against the CPU reference on the same inputs: uneven groups,
    an empty expert, groups not multiples of 16 (multiples of 16 for the loop, which
    torch._scaled_mm's CUDA kernel needs); bf16 as in training."""
    grouped = gmm.grouped_kernel_runs(torch.empty(0, device="cuda"), 4, 48, 64)
    counts = [40, 0, 7, 81] if grouped else [32, 0, 48, 16]
    x, w, offs, grad = _inputs(counts, 64, 48, seed=4)
    x, w, grad = x.bfloat16(), w.bfloat16(), grad.bfloat16()
    want = _run(x, w, offs, grad, e4m3_grads=grouped)  # the grouped kernel's grads: E4M3
    got = _run(x.cuda(), w.cuda(), offs.cuda(), grad.cuda())
    assert close_to_bf16(got[0].cpu(), want[0], cancel=2.0**-12)
    for g, r in zip(got[1], want[1], strict=True):
        assert close_to_bf16(g.cpu(), r, cancel=2.0**-12)


def test_loop_meets_cuda_scaled_mm_alignment(monkeypatch):
    """Issue 26, defect 8: off sm90 the CUDA kernels run the reference loop, whose
    torch._scaled_mm on CUDA needs mat1's columns and both of mat2's dimensions to be multiples
    of 16; the wgrad's inner dimension is a group's rows. With those checks emulated on CPU,
    forward and backward run for groups of any size, and the wgrad over the padded groups
    equals the one over each expert's rows alone."""
    real = torch._scaled_mm
    inner = []

    def strict_scaled_mm(a, b, scale_a, scale_b, **kwargs):
        if a.shape[1] % 16 or b.shape[0] % 16 or b.shape[1] % 16:
            raise RuntimeError(f"_scaled_mm on CUDA refuses {tuple(a.shape)} x {tuple(b.shape)}")
        inner.append(a.shape[1])
        return real(a, b, scale_a, scale_b, **kwargs)

    counts = [5, 0, 37, 3, 19]
    x, w, offs, grad = _inputs(counts, 32, 48, seed=26)
    out, x8_t, sx, w8_t, sw = gmm.fp8_grouped_mm_ref(x, w, offs)
    monkeypatch.setattr(torch, "_scaled_mm", strict_scaled_mm)
    kwargs = dict(e4m3_grads=False, pow2_scale=False, x_dtype=x.dtype, w_dtype=w.dtype)
    got = gmm.fp8_grouped_mm_ref(x, w, offs)
    grad_x, grad_w = gmm.fp8_grouped_mm_backward_ref(grad, x8_t, sx, w8_t, sw, offs, **kwargs)
    monkeypatch.setattr(torch, "_scaled_mm", real)
    assert torch.equal(got[0], out)
    assert {48, 32} <= set(inner) and 16 in inner  # the padded groups (5 -> 16, 37 -> 48, ...)
    # The wgrad over each expert's own rows, as the loop computed it before.
    _, g8_t, sg = gmm._cast_grad(grad, E5M2, False, offs)
    dest = torch.cat([torch.arange(n) + p - max(16, -(-n // 16) * 16)
                      for n, p in zip(counts, fc.padded_offsets(offs).tolist(), strict=True)])  # fmt: skip
    x8, g8_rows = x8_t[:, dest], g8_t[:, dest]  # [K, M], [N, M]: columns back in row order
    for e, start, end in gmm._groups(offs):
        if end == start:
            assert torch.equal(grad_w[e], torch.zeros_like(grad_w[e]))
            continue
        a = g8_rows[:, start:end].contiguous()
        b = x8[:, start:end].contiguous()
        want = real(a, b.t(), sg, sx, out_dtype=torch.float32)
        torch.testing.assert_close(grad_w[e], want, rtol=1e-6, atol=0)
    assert grad_x.shape == x.shape and torch.isfinite(grad_x).all()
