"""Tests of graphtrain::adamw_step (AdamW over a list of tensors, writing bf16 working copies).

Oracle: a float64 AdamW (torch.optim.AdamW's formula) on fresh random masters, moments and
gradients of odd sizes (one element to a few blocks), four steps, a decayed and an undecayed
group. Tolerance: each fp32 operation rounds by at most 2**-24 relative, about ten of them per
step and four steps: errors are held to 2**-19 of the value's scale (|param| + lr for the
param, |moment| + its gradient term for the moments); torch.optim.AdamW's own fp32 update
meets the same bound (checked here, so the bound is fp32 rounding and not looser), and a step
count or weight decay off by one step fails it, as does a gradient scale (clipping's
coefficient, applied as the grads are read) that is ignored. The copies must equal the new fp32
param rounded by torch's .to(torch.bfloat16), bit for bit. The Triton kernel runs on CPU under
TRITON_INTERPRET=1 (a subprocess: the variable must be set before Triton is imported).
"""

from __future__ import annotations

import sys

import pytest
import torch
from torch.optim.adamw import adamw as adamw_functional

from graphtrain.custom_ops import adamw_step as op

SIZES = [1, 5, 37, 1029, 2051]  # 1029, 2051: over one and two blocks of 1024, ragged
LR, BETAS, EPS = 1e-2, (0.9, 0.95), 1e-8
TOL = 2.0**-19
GRAD_SCALE = 0.37  # a clip coefficient: 0.37 is not a power of two, so its multiply rounds


def _inputs(seed: int, state_dtype: torch.dtype = torch.float32):
    gen = torch.Generator().manual_seed(seed)
    params = [torch.randn(n, generator=gen) for n in SIZES]
    exp_avgs = [(0.1 * torch.randn(n, generator=gen)).to(state_dtype) for n in SIZES]
    exp_avg_sqs = [torch.rand(n, generator=gen).to(state_dtype) for n in SIZES]
    grads = [[torch.randn(n, generator=gen) for n in SIZES] for _ in range(4)]
    return params, exp_avgs, exp_avg_sqs, grads


def _float64_step(p, g, m, v, *, wd, step):
    """torch.optim.AdamW's update in float64 (returns new p, m, v)."""
    b1, b2 = BETAS
    p = p * (1 - LR * wd)
    m = b1 * m + (1 - b1) * g
    v = b2 * v + (1 - b2) * g * g
    denom = v.sqrt() / (1 - b2**step) ** 0.5 + EPS
    return p - LR / (1 - b1**step) * m / denom, m, v


def _errors(step_fn, *, first_step: int = 3, grad_scale: float | None = None) -> dict[str, float]:
    """Largest scaled errors against float64 over four steps of step_fn (a kernel with
    adamw_step's signature), the grads scaled by grad_scale where given; also checks the copies
    bitwise. Two groups: SIZES[0::2] with weight decay 0.1, SIZES[1::2] without."""
    scale = None if grad_scale is None else torch.tensor(grad_scale)
    params, exp_avgs, exp_avg_sqs, grads = _inputs(0)
    ref = [[t.double() for t in ts] for ts in (params, exp_avgs, exp_avg_sqs)]
    copies = [torch.empty(n, dtype=torch.bfloat16) for n in SIZES]
    worst = {"param": 0.0, "exp_avg": 0.0, "exp_avg_sq": 0.0}
    for k, g in enumerate(grads):
        step = first_step + k
        for group, wd in ((slice(0, None, 2), 0.1), (slice(1, None, 2), 0.0)):
            step_fn(
                params[group],
                g[group],
                exp_avgs[group],
                exp_avg_sqs[group],
                copies[group],
                scale,
                lr=LR,
                beta1=BETAS[0],
                beta2=BETAS[1],
                eps=EPS,
                weight_decay=wd,
                step=float(step),
            )
            for i in range(len(SIZES))[group]:
                gi = g[i].double() * (1.0 if grad_scale is None else float(scale))
                new = _float64_step(ref[0][i], gi, ref[1][i], ref[2][i], wd=wd, step=step)
                ref[0][i], ref[1][i], ref[2][i] = new
        for i, gi in enumerate(g):
            gi = gi.double().abs()
            scales = {
                "param": ref[0][i].abs() + LR,
                "exp_avg": ref[1][i].abs() + gi,
                "exp_avg_sq": ref[2][i] + gi * gi,
            }
            for j, name in enumerate(worst):
                got = (params, exp_avgs, exp_avg_sqs)[j][i].double()
                err = ((got - ref[j][i]).abs() / scales[name]).max().item()
                worst[name] = max(worst[name], err)
            assert torch.equal(copies[i], params[i].to(torch.bfloat16)), f"copy {i}, step {step}"
    return worst


def check_within_fp32_rounding(step_fn, grad_scale: float | None = None) -> None:
    worst = _errors(step_fn, grad_scale=grad_scale)
    assert all(err <= TOL for err in worst.values()), f"scaled errors {worst} above {TOL:.1e}"


def _torch_adamw(params, grads, exp_avgs, exp_avg_sqs, copies, grad_scale=None, *, step, **hyper):
    """torch's own fp32 update, through torch.optim.adamw.adamw (functional, foreach), after
    clipping's foreach multiply where grad_scale is given; hyper: lr, beta1, beta2, eps,
    weight_decay, as both name them."""
    if grad_scale is not None:
        grads = torch._foreach_mul(grads, grad_scale)
    steps = [torch.tensor(step - 1.0) for _ in params]
    adamw_functional(
        params, grads, exp_avgs, exp_avg_sqs, [], steps, foreach=True, amsgrad=False,
        maximize=False, **hyper,
    )  # fmt: skip
    torch._foreach_copy_(copies, params)


def _off_by_one_step(*args, step, **kwargs):
    return op.adamw_step_ref(*args, step=step + 1, **kwargs)


def _decay_ignored(*args, weight_decay, **kwargs):
    return op.adamw_step_ref(*args, weight_decay=0.0, **kwargs)


def _scale_ignored(*args, **kwargs):
    return op.adamw_step_ref(*args[:5], None, **kwargs)


@pytest.mark.parametrize("grad_scale", [None, GRAD_SCALE])
def test_reference_within_fp32_rounding_of_float64(grad_scale):
    check_within_fp32_rounding(op.adamw_step_ref, grad_scale)


@pytest.mark.parametrize("grad_scale", [None, GRAD_SCALE])
def test_bound_is_fp32_rounding_torch_adamw_meets_it(grad_scale):
    check_within_fp32_rounding(_torch_adamw, grad_scale)


@pytest.mark.parametrize("bug", [_off_by_one_step, _decay_ignored, _scale_ignored])
def test_bound_catches_a_bug(bug):
    with pytest.raises(AssertionError, match="scaled errors"):
        check_within_fp32_rounding(bug, GRAD_SCALE)


def test_grad_scale_is_clippings_multiply_and_leaves_the_grads():
    """The op with grad_scale gives, bit for bit, what clipping's in-place foreach multiply and
    then the op without it give; the grads it read are unchanged."""
    a, b = _inputs(4), _inputs(4)
    kw = dict(lr=LR, beta1=BETAS[0], beta2=BETAS[1], eps=EPS, weight_decay=0.1, step=2.0)
    grads = [g.clone() for g in a[3][0]]
    torch.ops.graphtrain.adamw_step(a[0], a[3][0], a[1], a[2], [], torch.tensor(GRAD_SCALE), **kw)
    assert all(torch.equal(g, h) for g, h in zip(grads, a[3][0], strict=True))
    torch._foreach_mul_(b[3][0], torch.tensor(GRAD_SCALE))
    torch.ops.graphtrain.adamw_step(b[0], b[3][0], b[1], b[2], [], **kw)
    for x, y in zip(a[:3], b[:3], strict=True):
        assert all(torch.equal(u, v) for u, v in zip(x, y, strict=True))


def test_op_on_cpu_is_the_reference():
    a, b = _inputs(1), _inputs(1)
    kw = dict(lr=LR, beta1=BETAS[0], beta2=BETAS[1], eps=EPS, weight_decay=0.1, step=2.0)
    torch.ops.graphtrain.adamw_step(a[0], a[3][0], a[1], a[2], [], **kw)
    op.adamw_step_ref(b[0], b[3][0], b[1], b[2], [], **kw)
    for x, y in zip(a[:3], b[:3], strict=True):
        assert all(torch.equal(u, v) for u, v in zip(x, y, strict=True))


def test_opcheck():
    params, exp_avgs, exp_avg_sqs, grads = _inputs(3)
    copies = [p.to(torch.bfloat16) for p in params]
    kw = dict(lr=LR, beta1=BETAS[0], beta2=BETAS[1], eps=EPS, weight_decay=0.1, step=1.0)
    for scale in ([], [torch.tensor(GRAD_SCALE)]):
        torch.library.opcheck(
            torch.ops.graphtrain.adamw_step.default,
            (params, grads[0], exp_avgs, exp_avg_sqs, copies, *scale),
            kw,
        )


def test_bad_arguments():
    p = [torch.zeros(3)]
    kw = dict(lr=LR, beta1=0.9, beta2=0.95, eps=EPS, weight_decay=0.0, step=1.0)
    with pytest.raises(ValueError, match="2 grads for 1 params"):
        torch.ops.graphtrain.adamw_step(
            p, [torch.zeros(3)] * 2, [torch.zeros(3)], [torch.zeros(3)], [], **kw
        )
    with pytest.raises(ValueError, match="both must be float32"):
        torch.ops.graphtrain.adamw_step([torch.zeros(3, dtype=torch.bfloat16)], p, p, p, [], **kw)
    with pytest.raises(ValueError, match=r"copy 0 is torch\.float32"):
        torch.ops.graphtrain.adamw_step(
            p, [torch.zeros(3)], [torch.zeros(3)], [torch.zeros(3)], [torch.zeros(3)], **kw
        )
    with pytest.raises(ValueError, match="shape"):
        torch.ops.graphtrain.adamw_step(
            p, [torch.zeros(4)], [torch.zeros(3)], [torch.zeros(3)], [], **kw
        )
    with pytest.raises(ValueError, match=r"grad_scale must be one float32 element.*float64"):
        torch.ops.graphtrain.adamw_step(
            p,
            [torch.zeros(3)],
            [torch.zeros(3)],
            [torch.zeros(3)],
            [],
            torch.ones(()).double(),
            **kw,
        )
    with pytest.raises(ValueError, match=r"grad_scale must be one float32 element.*\(2,\)"):
        torch.ops.graphtrain.adamw_step(
            p, [torch.zeros(3)], [torch.zeros(3)], [torch.zeros(3)], [], torch.ones(2), **kw
        )


# ------------------------------------------------------------------------------------------
# the Triton kernel, under the interpreter (fp32 arithmetic; bf16 only as bits)
# ------------------------------------------------------------------------------------------


def _check_bf16_moments(step_fn) -> None:
    """bf16 moments: against the reference (AdamWBF16's maths in fp32). An fp32 rounding apart
    can flip a moment's bf16 rounding (one bf16 step, 2**-8 relative) and that moment's update
    by as much: params within 4 steps * lr * 2**-7, moments within one bf16 step, copies exact."""
    a, b = _inputs(2, torch.bfloat16), _inputs(2, torch.bfloat16)
    copies = [torch.empty(n, dtype=torch.bfloat16) for n in SIZES]
    kw = dict(lr=LR, beta1=BETAS[0], beta2=BETAS[1], eps=EPS, weight_decay=0.1)
    for k in range(4):
        step_fn(a[0], a[3][k], a[1], a[2], copies, step=k + 1.0, **kw)
        op.adamw_step_ref(b[0], b[3][k], b[1], b[2], [], step=k + 1.0, **kw)
    for got, want in zip(a[0], b[0], strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=4 * LR * 2**-7)
    for x, y in zip(a[1] + a[2], b[1] + b[2], strict=True):
        torch.testing.assert_close(x.float(), y.float(), rtol=2**-7, atol=1e-30)
    assert all(torch.equal(c, p.to(torch.bfloat16)) for c, p in zip(copies, a[0], strict=True))


def _check_rounding_specials(step_fn) -> None:
    """lr = 0 leaves the params as they are: the copies are their rounding, ties to even,
    overflow to inf, inf and NaN kept (torch's .to(torch.bfloat16) is the oracle)."""
    x = torch.tensor(
        [
            1 + 2**-8,
            1 + 3 * 2**-8,
            -(1 + 2**-8),
            3.4e38,
            -3.4e38,
            float("inf"),
            -float("inf"),
            float("nan"),
            1e-40,
            0.0,
        ]
    )
    copy = torch.empty(x.numel(), dtype=torch.bfloat16)
    z = [torch.zeros_like(x)]
    step_fn(
        [x.clone()],
        z,
        [torch.zeros_like(x)],
        [torch.ones_like(x)],
        [copy],
        lr=0.0,
        beta1=0.9,
        beta2=0.95,
        eps=EPS,
        weight_decay=0.0,
        step=1.0,
    )
    want = x.to(torch.bfloat16)
    assert (
        torch.equal(copy.view(torch.int16)[:-3], want.view(torch.int16)[:-3]) and copy[-3].isnan()
    )
    assert torch.equal(copy[-2:].view(torch.int16), want[-2:].view(torch.int16))


def _interpreter_checks() -> None:
    check_within_fp32_rounding(op.adamw_step_triton)
    check_within_fp32_rounding(op.adamw_step_triton, GRAD_SCALE)
    print("fp32 ok")
    _check_bf16_moments(op.adamw_step_triton)
    _check_rounding_specials(op.adamw_step_triton)
    print("interpreter all ok")


def test_triton_kernel_under_interpreter():
    from conftest import run_interpreter_checks  # not at the top: this file also runs as a script

    run_interpreter_checks(__file__, "interpreter all ok")


def test_reference_checks_bf16():
    _check_bf16_moments(op.adamw_step_ref)
    _check_rounding_specials(op.adamw_step_ref)


@pytest.mark.parametrize("bf16_state", [False, True])
def test_kernel_compiles_for_h100_with_vector_accesses(bf16_state):
    """Compiled for sm_90 ahead of time (no GPU needed): the CUDA path builds, and with aligned
    addresses a full block reads and writes 16 bytes per access (addresses read from the table
    would otherwise give 4-byte accesses: the ALIGNED hint and the full-block branch)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, compile

    scalars = ("lerp1", "beta2", "lerp2", "eps", "decay", "step_size", "bias2_sqrt")
    constexprs = {"BF16_STATE": bf16_state, "HAS_COPY": True, "HAS_SCALE": True}
    constexprs |= {"ALIGNED": True, "BLOCK": 1024}
    signature = {"addr_ptr": "*i64", "numel_ptr": "*i64", "blocks_ptr": "*i32"}
    signature |= dict.fromkeys(scalars, "fp32") | {"scale_ptr": "*fp32"}
    signature |= dict.fromkeys(constexprs, "constexpr")
    src = ASTSource(fn=op._adamw_step_kernel, signature=signature, constexprs=constexprs)
    ptx = compile(src, target=GPUTarget("cuda", 90, 32)).asm["ptx"]
    assert "ld.global.v4.b32" in ptx and "st.global.v4.b32" in ptx
    assert "div.rn.f32" in ptx and "sqrt.rn.f32" in ptx  # correctly rounded, as torch


def test_benchmark_smoke():
    """benchmarks/adamw_step.py runs its rows on CPU (moe-tiny) and every row writes its copies."""
    from conftest import run_benchmark_smoke

    run_benchmark_smoke("adamw_step.py", "cpu smoke: every row steps and writes its copies")


@pytest.mark.gpu
def test_cuda_kernel():
    def on_cuda(*lists, **kw):
        scale = lists[5].cuda() if len(lists) > 5 and lists[5] is not None else None
        lists = lists[:5]
        moved = [[t.cuda() for t in ts] for ts in lists]
        torch.ops.graphtrain.adamw_step(*moved, scale, **kw)
        for ts, ms in zip(lists, moved, strict=True):
            for t, m in zip(ts, ms, strict=True):
                t.copy_(m)

    check_within_fp32_rounding(on_cuda)
    check_within_fp32_rounding(on_cuda, GRAD_SCALE)
    _check_bf16_moments(on_cuda)
    _check_rounding_specials(on_cuda)


if __name__ == "__main__":
    if "--interpreter-checks" in sys.argv:
        _interpreter_checks()
