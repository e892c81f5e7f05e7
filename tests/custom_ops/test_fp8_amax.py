"""Tests of graphtrain::fp8_amax (max |x| on the device).

The oracle is float64 max |x|. The Triton kernel is compared with fp8_amax_ref bit for bit
under TRITON_INTERPRET=1 in tests/custom_ops/test_fp8_cast.py (one interpreter child checks
the amax and the cast kernels it feeds).
"""

from __future__ import annotations

import pytest
import torch

import graphtrain.custom_ops  # noqa: F401  (registers the ops)


@pytest.mark.parametrize("shape", [(1,), (37, 45), (3, 5, 7), (4097,)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_amax_matches_float64(shape, dtype):
    x = torch.randn(shape, generator=torch.Generator().manual_seed(0)).to(dtype)
    amax = torch.ops.graphtrain.fp8_amax(x)
    assert amax.dtype == torch.float32 and amax.shape == ()
    assert amax.item() == x.double().abs().max().item()


def test_amax_specials():
    """All-zero and empty give 0; NaN propagates (a plain tl.max/amax could drop it); inf wins."""
    assert torch.ops.graphtrain.fp8_amax(torch.zeros(5, 3)).item() == 0.0
    assert torch.ops.graphtrain.fp8_amax(torch.zeros(0, 3)).item() == 0.0
    x = torch.randn(9, 11)
    x[4, 7] = float("nan")
    assert torch.ops.graphtrain.fp8_amax(x).isnan()
    x[4, 7] = -float("inf")
    assert torch.ops.graphtrain.fp8_amax(x).item() == float("inf")


def test_per_slice_matches_float64():
    """amax per leading-dim slice: an all-zero slice gives 0, a NaN stays in its slice; empty
    slices give zeros; a 0-d tensor has no slices."""
    x = torch.randn(4, 5, 7, generator=torch.Generator().manual_seed(1))
    x[1] = 0.0
    x[2, 3, 1] = float("nan")
    amax = torch.ops.graphtrain.fp8_amax(x, per_slice=True)
    want = x.double().abs().flatten(1).max(1).values
    assert amax.dtype == torch.float32 and amax.shape == (4,)
    assert torch.equal(amax.double().nan_to_num(-1.0), want.nan_to_num(-1.0))
    assert amax[2].isnan() and amax[1] == 0.0
    assert torch.equal(torch.ops.graphtrain.fp8_amax(torch.zeros(3, 0), True), torch.zeros(3))
    assert torch.ops.graphtrain.fp8_amax(torch.zeros(0, 4), True).shape == (0,)
    with pytest.raises(ValueError, match=r"per_slice takes a tensor \[E, \.\.\.\], got a 0-d"):
        torch.ops.graphtrain.fp8_amax(torch.tensor(1.0), True)


def test_opcheck():
    torch.library.opcheck(torch.ops.graphtrain.fp8_amax.default, (torch.randn(6, 10),))
    torch.library.opcheck(torch.ops.graphtrain.fp8_amax.default, (torch.randn(3, 6, 10), True))
