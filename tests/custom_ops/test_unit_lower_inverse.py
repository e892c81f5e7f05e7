"""graphtrain::unit_lower_inverse: the reference and the Triton kernel (under TRITON_INTERPRET=1,
a child process) against float64's torch.linalg.inv of I + tril(L, -1), the backward (matmuls)
against float64 autograd through the reference, the checks, opcheck; a GPU test at the Gated
DeltaNet op's shape."""

import sys

import pytest
import torch

from graphtrain.custom_ops.unit_lower_inverse import (
    MAX_TRITON_SIZE,
    UnitLowerInverse,
    unit_lower_inverse_ref,
    unit_lower_inverse_triton,
)
from graphtrain.custom_ops.utils import interpreting
from models.gated_deltanet import l2norm

OP = torch.ops.graphtrain.unit_lower_inverse


def _lower(*shape, seed=0, device="cpu"):
    """A Gated DeltaNet chunk's L (beta_i k_i.k_j, j < i, keys of norm one sharing a mean
    direction, so the inverse is far from I), float64, with junk on and above the diagonal
    (the op must not read it)."""
    gen = torch.Generator().manual_seed(seed)
    *batch, C, _ = shape
    k = l2norm(torch.randn(*batch, C, 32, generator=gen, dtype=torch.float64) + 0.5)
    beta = torch.rand(*batch, C, 1, generator=gen, dtype=torch.float64)
    junk = torch.randn(*shape, generator=gen, dtype=torch.float64).triu()
    return (((k * beta) @ k.mT).tril(-1) + junk).to(device)


def _want(lower):
    eye = torch.eye(lower.shape[-1], dtype=torch.float64, device=lower.device)
    return torch.linalg.inv(lower.double().tril(-1) + eye)


def rel(got, want):
    return ((got.double() - want).norm() / want.norm()).item()


SHAPES = [(3, 1, 1), (2, 4, 4), (5, 16, 16), (2, 3, 24, 24), (4, 64, 64)]


@pytest.mark.parametrize("shape", [*SHAPES, (2, 100, 100)])
def test_reference_and_gradient_against_float64(shape):
    lower = _lower(*shape)
    assert rel(OP(lower), _want(lower)) < 1e-13
    assert rel(OP(lower.float()), _want(lower)) < 1e-6
    leaf = lower.clone().requires_grad_()
    grad = torch.randn(shape, dtype=torch.float64)
    (want,) = torch.autograd.grad(_want(leaf), leaf, grad)
    (got,) = torch.autograd.grad(UnitLowerInverse.apply(leaf), leaf, grad)
    assert torch.count_nonzero(want.triu()) == 0 and (want.abs().max() > 0 or shape[-1] == 1)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


def test_bad_arguments_raise():
    with pytest.raises(ValueError, match=r"\[\.\.\., C, C\] matrices, got \(4, 3\)"):
        OP(torch.zeros(4, 3))
    with pytest.raises(ValueError, match=r"float32 or float64, got torch\.bfloat16"):
        OP(torch.zeros(4, 4, dtype=torch.bfloat16))


def test_opcheck():
    torch.library.opcheck(OP, (_lower(2, 8, 8).float(),))


def _interpreter_checks() -> None:
    """Run in a child with TRITON_INTERPRET=1: the kernel on fp32 against float64 (the
    reference's fp32 solve as the bar: the kernel may not be much worse), sizes below, at and
    between the 16-row blocks, up to MAX_TRITON_SIZE; the op takes the kernel on CPU here."""
    assert interpreting()
    for shape in SHAPES:
        lower = _lower(*shape, seed=shape[-1])
        got = unit_lower_inverse_triton(lower.float())
        bar = rel(unit_lower_inverse_ref(lower.float()), _want(lower))
        assert rel(got, _want(lower)) < max(2 * bar, 1e-7), (shape, rel(got, _want(lower)), bar)
        assert torch.equal(OP(lower.float()), got)
        print(f"interpreter {shape} ok")
    assert MAX_TRITON_SIZE == SHAPES[-1][-1]
    print("interpreter all ok")


def test_kernel_under_interpreter():
    if interpreting():
        _interpreter_checks()
        return
    from conftest import run_interpreter_checks

    run_interpreter_checks(__file__, "interpreter all ok")


@pytest.mark.gpu
def test_cuda_matches_float64_at_the_gated_deltanet_shape():
    lower = _lower(1, 32, 64, 64, 64, device="cuda")  # 32 heads x 64 chunks of 64
    got = OP(lower.float())
    bar = rel(unit_lower_inverse_ref(lower.float()), _want(lower))
    assert rel(got, _want(lower)) < max(2 * bar, 1e-7), (rel(got, _want(lower)), bar)


if __name__ == "__main__":
    if "--interpreter-checks" in sys.argv:
        _interpreter_checks()
