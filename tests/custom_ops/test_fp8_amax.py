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


def test_opcheck():
    torch.library.opcheck(torch.ops.graphtrain.fp8_amax.default, (torch.randn(6, 10),))
