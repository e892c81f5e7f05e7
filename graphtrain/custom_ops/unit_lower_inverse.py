"""graphtrain::unit_lower_inverse: batched inverses of unit lower-triangular matrices.

What
    unit_lower_inverse(lower [..., C, C]) -> X = (I + tril(lower, -1))^-1, fp32 or float64
        Entries of `lower` on and above the diagonal are not read (the diagonal is one).
    UnitLowerInverse.apply(lower) is the differentiable form: the backward is matmuls,
        d lower = tril(-X^T dX X^T, -1).
    The Gated DeltaNet op's CUDA path inverts each chunk's system with it (models.gated_deltanet
    applies the inverse by matmuls); on CUDA this replaces cuBLAS's batched triangular solve.

Kernel
    One program a matrix, X (C x C, fp32) in registers, built by block rows of 16: the diagonal
    block (I + L_bb)^-1 by forward substitution from L_bb loaded once; then the block row
        X_b = X_bb (Q_b - L_b,<b X_<b)        Q_b: the identity's block row b
    by one product, placed into X by another with a 0/1 matrix (exact). Every product is an
    fp32 FMA dot (input_precision "ieee": TF32 would lose the inverse's accuracy). C <= 64:
    168 registers a thread at 4 warps, no spills on sm_90 (tests/triton_aot.py; C = 128 spilled
    1 KB at 8 warps); larger C takes the reference.

Numerics
    Forward substitution, blocked: the order of a triangular solve's sums up to the blocking
    (fp32 against the float64 inverse: a few ulps times the inverse's growth, as the solve).
    The reference (CPU, float64, C > 64): torch.linalg.solve_triangular against the identity.
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl
from torch import Tensor

from graphtrain.custom_ops.utils import interpreting as _interpreting
from models.gated_deltanet import unit_lower_inverse as _model_unit_lower_inverse

MAX_TRITON_SIZE = 64  # C beyond this takes the reference


def check_args(lower: Tensor) -> None:
    """ValueError naming the bad value: square matrices in the last two dims, fp32/float64."""
    if lower.dim() < 2 or lower.shape[-1] != lower.shape[-2]:
        raise ValueError(f"unit_lower_inverse takes [..., C, C] matrices, got {tuple(lower.shape)}")
    if lower.dtype not in (torch.float32, torch.float64):
        raise ValueError(f"unit_lower_inverse takes float32 or float64, got {lower.dtype}")


def unit_lower_inverse_ref(lower: Tensor) -> Tensor:
    """(I + tril(lower, -1))^-1 by the model's triangular solve against the identity."""
    return _model_unit_lower_inverse(lower.tril(-1))


@triton.jit
def _unit_lower_inverse_kernel(l_ptr, x_ptr, C: tl.constexpr, BLOCK: tl.constexpr):
    # One program, one matrix. Rows and columns past C (padding) hold the identity's and are not
    # stored; L's entries on and above the diagonal are masked off on load.
    base = tl.program_id(0).to(tl.int64) * C * C
    r16 = tl.arange(0, 16)
    idx = tl.arange(0, BLOCK)
    x = tl.zeros([BLOCK, BLOCK], dtype=tl.float32)
    for b in tl.static_range(BLOCK // 16):
        rows = b * 16 + r16
        # (I + L_bb)^-1 by forward substitution, row i = e_i - sum_{j<i} L_ij row j, from
        # L_bb loaded once, transposed (lt[j, i] = L_ij: column i is row i of L along j)
        lt = tl.load(
            l_ptr + base + rows[None, :] * C + rows[:, None],
            mask=(r16[:, None] < r16[None, :]) & (rows < C)[None, :],
            other=0.0,
        )
        xd = (r16[:, None] == r16[None, :]).to(tl.float32)
        for i in range(1, 16):
            l_i = tl.sum(tl.where(r16[None, :] == i, lt, 0.0), 1)
            xd += tl.where(r16[:, None] == i, -tl.sum(l_i[:, None] * xd, 0)[None, :], 0.0)
        # the block row X_bb (Q_b - L_b,<b X) (X's rows from b * 16 on are still zero), placed
        # into X by a product with a 0/1 matrix (exact)
        l_blk = tl.load(
            l_ptr + base + rows[:, None] * C + idx[None, :],
            mask=(rows < C)[:, None] & (idx < b * 16)[None, :],
            other=0.0,
        )
        q = (idx[None, :] == rows[:, None]).to(tl.float32)
        rhs = q - tl.dot(l_blk, x, input_precision="ieee")
        block_row = tl.dot(xd, rhs, input_precision="ieee")
        place = (idx[:, None] == rows[None, :]).to(tl.float32)  # [BLOCK, 16]
        x += tl.dot(place, block_row, input_precision="ieee")
    keep = (idx < C)[:, None] & (idx < C)[None, :]
    tl.store(x_ptr + base + idx[:, None] * C + idx[None, :], x, mask=keep)


def unit_lower_inverse_triton(lower: Tensor) -> Tensor:
    """The kernel on fp32 matrices (C <= MAX_TRITON_SIZE), one launch for the batch."""
    C = lower.shape[-1]
    lower = lower.contiguous()
    x = torch.empty_like(lower)
    if lower.numel():
        block = max(16, triton.next_power_of_2(C))
        _unit_lower_inverse_kernel[(lower.numel() // (C * C),)](
            lower, x, C=C, BLOCK=block, num_warps=4
        )
    return x


@torch.library.custom_op("graphtrain::unit_lower_inverse", mutates_args=())
def unit_lower_inverse(lower: Tensor) -> Tensor:
    """X = (I + tril(lower, -1))^-1 (module docstring): the kernel for fp32 on CUDA (and under
    Triton's interpreter) up to C = MAX_TRITON_SIZE, the reference otherwise."""
    check_args(lower)
    if (
        lower.dtype == torch.float32
        and lower.shape[-1] <= MAX_TRITON_SIZE
        and (lower.is_cuda or _interpreting())
    ):
        return unit_lower_inverse_triton(lower)
    return unit_lower_inverse_ref(lower).contiguous()


@unit_lower_inverse.register_fake
def _fake(lower: Tensor) -> Tensor:
    check_args(lower)
    return torch.empty_like(lower, memory_format=torch.contiguous_format)


class UnitLowerInverse(torch.autograd.Function):
    """unit_lower_inverse with its backward, in the forward/setup_context form that torch.func
    (the Gated DeltaNet op's backward) differentiates through."""

    @staticmethod
    def forward(lower: Tensor) -> Tensor:
        return unit_lower_inverse(lower)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: Tensor) -> None:
        ctx.save_for_backward(output)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tensor:
        (x,) = ctx.saved_tensors
        xt = x.transpose(-1, -2)
        return -(xt @ grad @ xt).tril(-1)
