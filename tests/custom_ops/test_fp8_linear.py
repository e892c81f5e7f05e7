"""Tests of graphtrain::fp8_linear (and fp8_linear_backward) and the saturation statistics.

Two oracles:
  * tight: float64 GEMMs of the same FP8-rounded operands (each operand cast by fp8_cast_ref
    with its own amax, dequantised exactly in float64). The op may differ from it only by its
    fp32 accumulation and the rounding of its output: relative 1e-6 in fp32, 2^-8 in bf16.
  * loose: the unquantised fp32 linear, by signal-to-noise ratio. Rounding to a grid with m
    mantissa bits leaves a relative error uniform within +-2^-(m+1) of the binade, RMS about
    2^-m / sqrt(12) of the value: 29 dB for one E4M3 operand, 23 dB for E5M2. A dot product's
    error power is the sum of both operands' (random signs, independent): about 26 dB for
    out = x W^T (E4M3 x E4M3), about 22 dB for the gradients (E5M2 x E4M3). The bounds are
    those less about 1 dB for the spread of a few thousand samples (measured: 28 and 24 dB);
    an upper bound of 40 dB checks that the GEMMs really ran in FP8 (bf16 would give ~50 dB).
CPU runs the op's reference path (torch._scaled_mm on CPU); the casts' Triton kernels are
tested in test_fp8_cast.py; tp=2 runs on gloo.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from parallel_dist import run_ranks

import graphtrain.custom_ops  # noqa: F401  (registers the ops)
from graphtrain.custom_ops import fp8_cast as fc
from graphtrain.custom_ops.fp8_amax import fp8_amax_ref
from graphtrain.custom_ops.fp8_cast import fp8_cast_ref

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def sqnr(got: torch.Tensor, want: torch.Tensor) -> float:
    """Signal-to-noise ratio of got against want, in dB."""
    want = want.double()
    noise = (got.double() - want).pow(2).sum().clamp_min(1e-300)
    return (10 * torch.log10(want.pow(2).sum() / noise)).item()


def rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want.double()).norm() / want.double().norm()).item()


def dequant(t: torch.Tensor, float8_dtype: torch.dtype, pow2: bool = False) -> torch.Tensor:
    """t rounded exactly as the op rounds it, in float64."""
    t2 = t.reshape(-1, t.shape[-1])
    y, _, s_inv, _ = fp8_cast_ref(t2, fp8_amax_ref(t2), float8_dtype, pow2, False)
    return (y.double() * s_inv.double()).view(t.shape)


def _inputs(shape, K, N, seed, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, K, generator=g).to(dtype)
    w = (torch.randn(N, K, generator=g) / K**0.5).to(dtype)
    b = torch.randn(N, generator=g).to(dtype)
    grad = torch.randn(*shape, N, generator=g)
    return x, w, b, grad


def _run(x, w, b, grad, **options):
    x, w = x.clone().requires_grad_(), w.clone().requires_grad_()
    b = b.clone().requires_grad_() if b is not None else None
    out = torch.ops.graphtrain.fp8_linear(x, w, b, **options)[0]
    inputs = [x, w] + ([b] if b is not None else [])
    return out, torch.autograd.grad(out, inputs, grad.to(out.dtype))


CASES = [  # (leading shape, K, N, bias, options)
    ((2, 7), 33, 45, True, {}),
    ((13,), 64, 16, False, {"e4m3_grads": True}),
    ((3, 5), 48, 40, True, {"pow2_scale": True}),
    ((31,), 17, 9, False, {"out_dtype": torch.bfloat16}),
]


@pytest.mark.parametrize("shape,K,N,bias,options", CASES)
def test_matches_float64_on_fp8_operands(shape, K, N, bias, options):
    x, w, b, grad = _inputs(shape, K, N, seed=K)
    b = b if bias else None
    out, grads = _run(x, w, b, grad, **options)
    pow2 = options.get("pow2_scale", False)
    gdtype = E4M3 if options.get("e4m3_grads") else E5M2
    x8, w8 = dequant(x, E4M3, pow2), dequant(w, E4M3, pow2)
    g8 = dequant(grad.to(out.dtype).float(), gdtype, pow2)
    want = x8 @ w8.T + (b.double() if b is not None else 0)
    tol = 1e-6 if out.dtype == torch.float32 else 2.0**-8
    assert out.dtype == options.get("out_dtype", x.dtype) and out.shape == (*shape, N)
    assert rel(out, want) < tol
    assert rel(grads[0], g8 @ w8) < 1e-6  # grad_x in x's dtype (fp32)
    assert rel(grads[1], g8.reshape(-1, N).T @ x8.reshape(-1, K)) < 1e-6
    if b is not None:
        assert rel(grads[2], grad.double().reshape(-1, N).sum(0)) < 1e-6


def spy_fast_accum(monkeypatch, name: str, fn=None) -> list[bool]:
    """Replace torch.<name> (or with fn) by a wrapper that records each call's use_fast_accum."""
    flags, real = [], fn or getattr(torch, name)

    def call(*args, **kwargs):
        flags.append(kwargs.get("use_fast_accum", False))
        return real(*args, **kwargs)

    monkeypatch.setattr(torch, name, call)
    return flags


def test_forward_accumulates_fast_the_gradients_promote(monkeypatch):
    """The forward GEMM asks for Hopper's fast accumulation (FORWARD_FAST_ACCUM, as
    TransformerEngine's Float8CurrentScaling fprop), the dgrad and wgrad for fp32 promotion.
    CPU sums in fp32 either way, so the flags are what is checked here; the accumulator's
    error is the gpu test's."""
    flags = spy_fast_accum(monkeypatch, "_scaled_mm")
    x, w, b, grad = _inputs((8,), 32, 16, seed=3)
    out = torch.ops.graphtrain.fp8_linear(x, w.requires_grad_(), b)[0]
    assert flags == [True]
    out.backward(grad)
    assert flags == [True, False, False]


@pytest.mark.parametrize("e4m3_grads", [False, True])
def test_sqnr_against_fp32_linear(e4m3_grads):
    x, w, b, grad = _inputs((8, 32), 256, 192, seed=5)
    out, (gx, gw, gb) = _run(x, w, b, grad, e4m3_grads=e4m3_grads)
    x, w, b = x.requires_grad_(), w.requires_grad_(), b.requires_grad_()
    want = F.linear(x, w, b)
    wgx, wgw, wgb = torch.autograd.grad(want, [x, w, b], grad)
    grad_bound = 24.0 if e4m3_grads else 21.0  # both operands E4M3 for e4m3_grads: ~26 dB
    assert 25.0 < sqnr(out, want) < 40.0
    assert grad_bound < sqnr(gx, wgx) < 40.0
    assert grad_bound < sqnr(gw, wgw) < 40.0
    assert rel(gb, wgb) < 1e-6  # the bias gradient is not quantised


def test_saves_fp8_copies_not_the_input():
    """What autograd keeps for the backward: the FP8 copies and 0-d scales only."""
    saved = []

    def pack(t):
        saved.append((t.dtype, t.dim()))
        return t

    x, w, b, grad = _inputs((4,), 32, 16, seed=0)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        _run(x, w, b, grad)
    assert sorted(saved, key=str) == sorted(
        [(E4M3, 2), (torch.float32, 0), (E4M3, 2), (torch.float32, 0)], key=str
    )


def test_nonfinite_inputs_give_nan():
    """NaN or inf in x makes the output NaN (the trainer's non-finite check then stops)."""
    x, w, b, _ = _inputs((4,), 32, 16, seed=0)
    for bad in (float("nan"), float("inf")):
        x[1, 3] = bad
        out = torch.ops.graphtrain.fp8_linear(x, w, b)[0]
        assert out.isnan().any() and not out.isinf().any()


def test_saturation_stats():
    """Counters per tensor class: a value 1e6 times the rest flushes the rest to zero in E4M3."""
    fc.fp8_saturation_stats(reset=True)
    x, w, b, grad = _inputs((8,), 32, 16, seed=0)
    x[0, 0] = 1e6
    _run(x, w, b, grad)
    stats = fc.fp8_saturation_stats()
    # below half the smallest E4M3 subnormal (2^-9) after scaling by 448 / 1e6: rounds to 0
    expected = (x.abs() * (448.0 / 1e6) <= 2.0**-10).sum() / x.numel()
    assert stats["fp8/flushed/activation"].item() == pytest.approx(expected.item(), rel=1e-12)
    assert expected > 0.9
    assert stats["fp8/flushed/weight"].item() < 0.01
    assert all(stats[f"fp8/clipped/{c}"].item() == 0 for c in fc.TENSOR_CLASSES)
    assert stats["fp8/flushed/gradient"].item() < 0.01
    after = fc.fp8_saturation_stats()
    assert after["fp8/flushed/activation"].item() == 0  # reset


def test_saturation_stats_land_on_the_accelerator():
    """A CPU cast first (a reference in the same process), then one on another device: the
    fractions are summed over both onto the non-CPU device (the step's), not the first one seen
    (the trainer stacks them with the step's statistics; a GPU run failed on mixed devices)."""
    fc.fp8_saturation_stats(reset=True)
    fc.record_saturation("activation", torch.tensor([1, 2]), 10)
    fc.record_saturation("activation", torch.tensor([3, 0], device="meta"), 30)
    stats = fc.fp8_saturation_stats(reset=False)
    assert {v.device.type for v in stats.values()} == {"meta"}
    fc._COUNTERS.pop(torch.device("meta"))
    assert fc.fp8_saturation_stats()["fp8/clipped/activation"].item() == pytest.approx(1 / 10)
    fc.fp8_saturation_stats(reset=True)


def test_compiled_equals_eager():
    x, w, b, grad = _inputs((3, 4), 32, 16, seed=2)
    eager = _run(x, w, b, grad)

    def fn(x, w, b):
        return torch.ops.graphtrain.fp8_linear(x, w, b)[0]

    compiled = torch.compile(fn, backend="aot_eager", fullgraph=True)
    xc, wc, bc = (t.clone().requires_grad_() for t in (x, w, b))
    out = compiled(xc, wc, bc)
    grads = torch.autograd.grad(out, [xc, wc, bc], grad)
    assert torch.equal(out, eager[0])
    assert all(torch.equal(u, v) for u, v in zip(grads, eager[1], strict=True))


def test_bad_arguments():
    x, w = torch.randn(4, 8), torch.randn(6, 8)
    with pytest.raises(ValueError, match=r"x \[\.\.\., K\] and weight \[N, K\]"):
        torch.ops.graphtrain.fp8_linear(x, w[:, :5], None)
    with pytest.raises(ValueError, match=r"bias must be \[N\] = \[6\]"):
        torch.ops.graphtrain.fp8_linear(x, w, torch.randn(5))
    with pytest.raises(ValueError, match="x must be one of"):
        torch.ops.graphtrain.fp8_linear(x.double(), w, None)


def test_opcheck():
    # test_schema and the backward half of test_aot_dispatch compare or sum FP8 tensors with
    # CPU kernels torch does not have for float8 ("mul_cpu_reduced_float", "sum_cpu"): run the
    # checks that work on CPU, with inputs that do not require grad.
    utils = ("test_faketensor", "test_autograd_registration", "test_aot_dispatch_dynamic")
    x, w, b, grad = _inputs((5,), 32, 16, seed=1)
    op = torch.ops.graphtrain
    torch.library.opcheck(op.fp8_linear.default, (x, w, b), test_utils=utils)
    torch.library.opcheck(
        op.fp8_linear.default,
        (x.bfloat16(), w, None),
        {"out_dtype": torch.bfloat16},
        test_utils=utils,
    )
    _, x8_t, sx, w8_t, sw = op.fp8_linear(x, w, b)
    kwargs = dict(e4m3_grads=False, pow2_scale=False, tp_group=None)
    kwargs.update(x_dtype=torch.float32, w_dtype=torch.float32)
    args = (grad, x8_t, sx, w8_t, sw, True)
    torch.library.opcheck(op.fp8_linear_backward.default, args, kwargs, test_utils=utils)
    # grad_out cast already (E5M2), as before a tensor-parallel all-gather: the same results
    g8, _, sg, counts = op.fp8_cast(grad, op.fp8_amax(grad), torch.float8_e5m2, False, False)
    args = (g8, x8_t, sx, w8_t, sw, False, sg, counts)
    torch.library.opcheck(op.fp8_linear_backward.default, args, kwargs, test_utils=utils)
    plain = op.fp8_linear_backward(grad, x8_t, sx, w8_t, sw, False, **kwargs)
    precast = op.fp8_linear_backward(*args, **kwargs)
    assert all(torch.equal(a, b) for a, b in zip(plain, precast, strict=True))
    with pytest.raises(ValueError, match="no bias"):
        op.fp8_linear_backward(g8, x8_t, sx, w8_t, sw, True, sg, counts, **kwargs)
    x8 = x8_t.t().contiguous()
    counts = torch.zeros(2, dtype=torch.int64)
    kwargs = dict(pow2_scale=False, tp_group=None, out_dtype=torch.float32)
    args = (x8, sx, counts, w, None, b)
    torch.library.opcheck(op.fp8_linear_precast.default, args, kwargs, test_utils=utils)
    args = (x, None, None, w8_t.t().contiguous(), sw, b)
    torch.library.opcheck(op.fp8_linear_precast.default, args, kwargs, test_utils=utils)


@pytest.mark.parametrize("pow2", [False, True])
def test_precast_entry_is_the_same_forward(pow2):
    # fp8_linear_precast from the bytes and scale fp8_linear made of x gives its five outputs
    # bit for bit, and so from the weight's (what the FP8 all-gathers rely on); a wrong dtype
    # or no FP8 operand is refused.
    x, w, b, _ = _inputs((3, 5), 32, 16, seed=2)
    outs = torch.ops.graphtrain.fp8_linear(x.bfloat16(), w, b, pow2_scale=pow2)
    x8 = outs[1].t().contiguous().view(3, 5, 32)
    counts = torch.zeros(2, dtype=torch.int64)
    kwargs = dict(pow2_scale=pow2, tp_group=None, out_dtype=torch.bfloat16)
    w8 = outs[3].t().contiguous()
    precast = torch.ops.graphtrain.fp8_linear_precast
    for args in [(x8, outs[2], counts, w, None, b), (x.bfloat16(), None, None, w8, outs[4], b)]:
        for a, c in zip(outs, precast(*args, **kwargs), strict=True):
            if a.dtype == torch.float8_e4m3fn:  # torch.equal has no float8 kernel on CPU
                a, c = a.view(torch.uint8), c.view(torch.uint8)
            assert a.dtype == c.dtype and torch.equal(a, c)
    with pytest.raises(ValueError, match=r"x with a scale_inv must be torch\.float8_e4m3fn"):
        precast(x8.float(), outs[2], counts, w, None, b, **kwargs)
    with pytest.raises(ValueError, match="needs x or the weight in FP8"):
        precast(x, None, None, w, None, b, **kwargs)


# ------------------------------------------------------------------------------------------
# tensor parallel: tp=2 on gloo
# ------------------------------------------------------------------------------------------


def _tp_worker(rank: int, world: int) -> None:
    import torch.distributed as dist

    group = dist.group.WORLD.group_name
    x, w, _, grad = _inputs((6,), 64, 32, seed=0)
    w[16:] *= 10  # the shards' own amaxes differ: only the reduced one gives equal scales
    full_out, (full_gx, full_gw) = _run(x, w, None, grad)
    # column parallel: W split on its rows (N); x whole; grad_out split like out
    rows = slice(rank * 16, (rank + 1) * 16)
    for tp_group, must_match in ((group, True), (None, False)):
        out, (gx, gw) = _run(x, w[rows], None, grad[:, rows], tp_group=tp_group)
        dist.all_reduce(gx)  # the caller's (DTensor's) reduction of partial input gradients
        errors = [rel(out, full_out[:, rows]), rel(gw, full_gw[rows]), rel(gx, full_gx)]
        assert (max(errors) < 1e-6) == must_match, (rank, tp_group, errors)
    # row parallel: x and W split on K; the partial outputs sum to the full output
    cols = slice(rank * 32, (rank + 1) * 32)
    out, (gx, gw) = _run(x[:, cols], w[:, cols], None, grad, tp_group=group)
    dist.all_reduce(out)
    assert rel(out, full_out) < 1e-6
    assert rel(gx, full_gx[:, cols]) < 1e-6 and rel(gw, full_gw[:, cols]) < 1e-6


def test_tp2_amax_reduction_gloo():
    """Shards with their amax max-reduced over tp equal the single-rank op; without the
    reduction (tp_group None) they do not."""
    run_ranks(_tp_worker, 2)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_matches_float64_on_fp8_operands(dtype):
    x, w, b, grad = (t.cuda() for t in _inputs((64,), 128, 96, seed=0, dtype=dtype))
    out, (gx, gw, gb) = _run(x, w, b, grad)
    x8, w8 = dequant(x.float(), E4M3), dequant(w.float(), E4M3)
    g8 = dequant(grad.to(dtype).float(), E5M2)
    # fp32: the tensor cores' FP8 accumulator, not fp32 rounding: Hopper keeps about 14
    # mantissa bits between its promotions to fp32 (the DeepSeek-V3 report, 3.3.2); an H200 gave
    # 9.4e-5 (~2^-13.4) on out (K = 128), so 2^-11 bounds it with 4x to spare. bf16: the
    # output's rounding (2^-9) dominates.
    tol = 2.0**-11 if dtype == torch.float32 else 2.0**-8
    errors = {
        "out": rel(out, x8 @ w8.T + b.double()),
        "grad_x": rel(gx, g8 @ w8),
        "grad_w": rel(gw, g8.T @ x8),
        "grad_b": rel(gb, grad.double().sum(0)),
    }
    assert max(errors.values()) < tol, (errors, _diagnose(x, w, grad.to(dtype)))


def _diagnose(x, w, grad) -> dict:
    """Where a wrong GPU gradient comes from (2026-11-30, H200: grad_x 2.5% off in bf16 only):
    the op's FP8 copies and the gradient's cast against fp8_cast_ref's bytes and scales, and
    the backward's GEMMs on the reference's operands (in the gradient's dtype and in fp32)
    against float64."""
    _, x8_t, sx, w8_t, sw = torch.ops.graphtrain.fp8_linear(x, w, None)
    ref = {
        name: fp8_cast_ref(t, fp8_amax_ref(t), dtype, False, True)
        for name, t, dtype in (("x", x, E4M3), ("w", w, E4M3), ("grad", grad, E5M2))
    }
    amax = torch.ops.graphtrain.fp8_amax(grad)  # the backward's kernels, its record too
    g8, g8_t, sg, _ = torch.ops.graphtrain.fp8_cast(
        grad, amax, E5M2, False, True, record="gradient"
    )
    same = {
        "grad amax": torch.equal(amax, fp8_amax_ref(grad)),
        "x8_t": torch.equal(x8_t.view(torch.uint8), ref["x"][1].view(torch.uint8)),
        "w8_t": torch.equal(w8_t.view(torch.uint8), ref["w"][1].view(torch.uint8)),
        "x/w scale_inv": (torch.equal(sx, ref["x"][2]), torch.equal(sw, ref["w"][2])),
        "g8": torch.equal(g8.view(torch.uint8), ref["grad"][0].view(torch.uint8)),
        "g8_t": torch.equal(g8_t.view(torch.uint8), ref["grad"][1].view(torch.uint8)),
        "grad scale_inv": torch.equal(sg, ref["grad"][2]),
    }
    (r8, _, rs, _), (_, rw8_t, rws, _) = ref["grad"], ref["w"]
    exact = (r8.double() * rs.double()) @ (rw8_t.double() * rws.double()).T
    for out_dtype in (grad.dtype, torch.float32):
        gx = torch._scaled_mm(r8, rw8_t.t(), rs, rws, out_dtype=out_dtype)
        same[f"grad_x GEMM on the reference's operands, {out_dtype}"] = rel(gx, exact)
    return same


@pytest.mark.gpu
def test_cuda_fast_accumulated_forward_at_large_k():
    """The forward's fast-accumulated sums at K = 8192 (dense 3b's w2 reads 8192 and more).
    Hopper's FP8 accumulator keeps about 14 bits (the DeepSeek-V3 report saw up to ~2% on
    single elements at K = 4096; the error over all of out is smaller): against float64 on the
    same FP8 operands within 2^-6 relative, and against the unquantised linear the bound of
    small K (25 dB: out's two E4M3 roundings give ~26-28 dB, so the accumulator may cost about
    1 dB at most). The same operands with fp32 promotion (use_fast_accum off) give the
    accumulator's own share, printed for the record."""
    x, w, _, _ = (t.cuda() for t in _inputs((512,), 8192, 256, seed=1, dtype=torch.bfloat16))
    out, x8_t, sx, w8_t, sw = torch.ops.graphtrain.fp8_linear(x, w, None)
    x8, w8 = dequant(x.float(), E4M3), dequant(w.float(), E4M3)
    fast = rel(out, x8 @ w8.T)
    x8_rows, w8_rows = x8_t.t().contiguous(), w8_t.t().contiguous()  # the op's own operands
    promoted = torch._scaled_mm(x8_rows, w8_rows.t(), sx, sw, out_dtype=torch.bfloat16)
    promoted = rel(promoted, x8 @ w8.T)
    print(f"K = 8192, relative to float64: fast {fast:.2e}, promoted {promoted:.2e}")
    assert fast < 2.0**-6
    assert sqnr(out, x.double() @ w.double().T) > 25.0


def test_benchmark_cpu_smoke():
    from conftest import run_benchmark_smoke

    run_benchmark_smoke("fp8_linear.py", "graphtrain equals the plain recipe")
