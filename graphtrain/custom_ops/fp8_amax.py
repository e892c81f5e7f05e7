"""graphtrain::fp8_amax: max |x| of a whole tensor, on the device (per-tensor current scaling).

What
    fp8_amax(x) -> amax, a 0-d float32 tensor: max over all elements of |x|, NaN if any element
    is NaN, inf if any is +-inf (and none is NaN). This is the "current" in current scaling: the
    scale of an FP8 cast is computed from the tensor as it is now, no history.

Why
    The scale (graphtrain.custom_ops.fp8_cast.fp8_scale) must come from the tensor's own
    amax without a host synchronisation: amax stays a device tensor, and the cast kernel reads
    it through a pointer. Under tensor parallelism the caller max-reduces it over the tp group
    (a functional all_reduce) before the cast, so a shard is scaled as the unsharded tensor.

Kernel
    _amax_kernel  one read of x: each program reduces BLOCK contiguous elements to one fp32
                  partial (NaN when its block holds a NaN: tl.max would drop it); the partials
                  (numel / BLOCK of them) are reduced by torch.amax, which propagates NaN.
    A maximum is exact in any order, so the kernel and fp8_amax_ref agree bit for bit.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from torch import Tensor

_BLOCK = 4096


def fp8_amax_ref(x: Tensor) -> Tensor:
    """max |x| in float32 (0 for an empty tensor); NaN propagates."""
    if x.numel() == 0:
        return torch.zeros((), dtype=torch.float32, device=x.device)
    return x.detach().abs().amax().to(torch.float32)


@triton.jit
def _amax_kernel(x_ptr, partial_ptr, n, BLOCK: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    a = tl.abs(tl.load(x_ptr + offs, mask=offs < n, other=0.0).to(tl.float32))
    num_nan = tl.sum((a != a).to(tl.int32), axis=0)
    m = tl.max(a, axis=0)
    tl.store(partial_ptr + pid, tl.where(num_nan > 0, float("nan"), m))


def fp8_amax_triton(x: Tensor) -> Tensor:
    n = x.numel()
    if n == 0:
        return torch.zeros((), dtype=torch.float32, device=x.device)
    x = x.contiguous()
    grid = triton.cdiv(n, _BLOCK)
    partial = torch.empty(grid, dtype=torch.float32, device=x.device)
    _amax_kernel[(grid,)](x, partial, n, BLOCK=_BLOCK)
    return partial.amax()


def _use_triton(x: Tensor) -> bool:
    interpreting = os.environ.get("TRITON_INTERPRET", "0") == "1"
    return x.dtype != torch.float64 and (x.is_cuda or interpreting)


@torch.library.custom_op("graphtrain::fp8_amax", mutates_args=())
def fp8_amax(x: Tensor) -> Tensor:
    """max |x| as a 0-d float32 device tensor (no host sync). The body is the CPU kernel."""
    return fp8_amax_ref(x)


@fp8_amax.register_fake
def _fp8_amax_fake(x):
    return x.new_empty((), dtype=torch.float32)


@fp8_amax.register_kernel("cuda")
def _fp8_amax_cuda(x):
    return fp8_amax_triton(x) if _use_triton(x) else fp8_amax_ref(x)
