"""linear_cross_entropy: the Triton kernels (CUDA; on CPU tensors under TRITON_INTERPRET=1).

What
    _lce_stats_kernel        online max / sum-exp / target logit / logit sum per row, P over L
    _lce_dh_kernel           acc = alpha * acc + P @ W_c in fp32 (one tile per dtype: _DH_CONFIG_*)
    _lce_dh_finalize_kernel  grad_hidden = a acc + b W[target] + c sum_v W_v (a W row per token)
    _lce_grad_kernel         G = a softmax + b onehot + c, in place of the logits
    _lce_scale_kernel        x *= g in fp32, g read on the device

Numerics
    Row statistics and accumulators in fp32; P and G are stored in the logits' dtype.
    The interpreter computes bf16 wrongly without an error: test bf16 on the GPU only.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _lce_stats_kernel(
    logits_ptr,  # [N, vc] chunk of logits, row stride stride_row; P is written over it
    target_ptr,  # [N] int64, global class ids
    m_ptr,  # [N] fp32 running max (read-only lse when KNOWN_LSE)
    s_ptr,  # [N] fp32 running sum of exp(z - m)
    zt_ptr,  # [N] fp32 target logit (accumulated: only one chunk holds it)
    zsum_ptr,  # [N] fp32 sum of logits (label smoothing)
    alpha_ptr,  # [N] fp32 out: exp(m_old - m_new), the rescale of the grad_hidden accumulator
    stride_row,
    vc,
    v_offset,  # global class id of the chunk's first column
    BLOCK_V: tl.constexpr,
    KNOWN_LSE: tl.constexpr,
    WRITE_P: tl.constexpr,
    SMOOTHING: tl.constexpr,  # zsum wanted (label smoothing)
):
    # One program per token row; the whole chunk row is in registers, so the logits are read
    # once and P written once. Its speed is the instructions a logit costs (~19 on sm_90 in
    # fast mode; 2 bytes read take less), so the target logit is one load (a masked sum over
    # the row made it ~30) and the logits' sum is taken only for label smoothing.
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_V)
    mask = cols < vc
    ptrs = logits_ptr + row * stride_row + cols
    z = tl.load(ptrs, mask=mask, other=float("-inf")).to(tl.float32)
    t_local = tl.load(target_ptr + row) - v_offset
    here = (t_local >= 0) & (t_local < vc)  # the target column is in this chunk
    t_col = tl.where(here, t_local, 0)
    z_t = tl.load(logits_ptr + row * stride_row + t_col, mask=here, other=0.0).to(tl.float32)
    tl.store(zt_ptr + row, tl.load(zt_ptr + row) + z_t)
    if KNOWN_LSE:
        # Backward of "none": P = softmax itself, no running statistics.
        e = tl.exp(z - tl.load(m_ptr + row))
    else:
        m_old = tl.load(m_ptr + row)
        m_new = tl.maximum(m_old, tl.max(z, axis=0))
        # m_old = -inf on the first chunk gives alpha = 0 (m_new is finite for finite logits).
        alpha = tl.exp(m_old - m_new)
        e = tl.exp(z - m_new)  # masked columns: exp(-inf) = 0
        tl.store(s_ptr + row, tl.load(s_ptr + row) * alpha + tl.sum(e, axis=0))
        tl.store(m_ptr + row, m_new)
        tl.store(alpha_ptr + row, alpha)
        if SMOOTHING:
            z_sum = tl.sum(tl.where(mask, z, 0.0), axis=0)
            tl.store(zsum_ptr + row, tl.load(zsum_ptr + row) + z_sum)
    if WRITE_P:
        # The target column is left out of P and added exactly in fp32 by the finalize kernel.
        p = tl.where(cols == t_local, 0.0, e)
        tl.store(ptrs, p.to(logits_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _lce_dh_kernel(
    p_ptr,  # [M, K] P chunk (input dtype), row stride stride_pm, column stride stride_pk
    w_ptr,  # [K, N_OUT] the weight chunk's rows, row stride stride_wk, unit column stride
    acc_ptr,  # [M, N_OUT] fp32 accumulator, row stride stride_am
    alpha_ptr,  # [M] fp32 per-row rescale of acc (online softmax)
    M,
    N_OUT,
    stride_pm,
    stride_pk,
    stride_wk,
    stride_am,
    # constexpr: a chunk width (two values per shape at most: the chunk and the remainder);
    # known loop bounds, and the interpreter cannot range() over a runtime scalar.
    K: tl.constexpr,
    FIRST: tl.constexpr,
    HAS_ALPHA: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    # acc = alpha[:, None] * acc + P @ W_c. The rescale rides on the accumulator load, so the
    # online softmax costs no extra pass over the [N, H] fp32 buffer.
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N_OUT, BLOCK_N)
    # Grouped launch order: neighbouring programs share P row-blocks in L2.
    per_group = GROUP_M * num_n
    first_m = (pid // per_group) * GROUP_M
    group_rows = min(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_rows
    pid_n = (pid % per_group) // group_rows
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    m_mask = rm < M
    n_mask = rn < N_OUT
    acc_ptrs = acc_ptr + rm.to(tl.int64)[:, None] * stride_am + rn[None, :]
    if FIRST:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    else:
        acc = tl.load(acc_ptrs, mask=m_mask[:, None] & n_mask[None, :], other=0.0)
        if HAS_ALPHA:
            acc = acc * tl.load(alpha_ptr + rm, mask=m_mask, other=0.0)[:, None]
    p_ptrs = p_ptr + rm.to(tl.int64)[:, None] * stride_pm + rk.to(tl.int64)[None, :] * stride_pk
    w_ptrs = w_ptr + rk.to(tl.int64)[:, None] * stride_wk + rn[None, :]
    for k in range(0, K, BLOCK_K):
        k_mask = (k + rk) < K
        a = tl.load(p_ptrs, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        b = tl.load(w_ptrs, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
        acc = tl.dot(a, b, acc, input_precision=INPUT_PRECISION)
        p_ptrs += BLOCK_K * stride_pk
        w_ptrs += BLOCK_K * stride_wk
    tl.store(acc_ptrs, acc, mask=m_mask[:, None] & n_mask[None, :])


@triton.jit
def _lce_dh_finalize_kernel(
    acc_ptr,  # [N, H] fp32
    wt_ptr,  # [N, H] per token, its target's weight row (local shard; any row where b is 0)
    wsum_ptr,  # [H] fp32 sum of the weight rows (label smoothing)
    out_ptr,  # [N, H] output (may be acc_ptr itself: each element is read before written)
    a_ptr,  # [N] fp32 coefficient of acc
    b_ptr,  # [N] fp32 coefficient of W[target] (0 where the target is ignored or not local)
    c_ptr,  # [N] fp32 coefficient of wsum
    H,
    stride_acc,
    stride_wt,
    stride_out,
    HAS_SMOOTHING: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask = cols < H
    x = tl.load(a_ptr + row) * tl.load(acc_ptr + row * stride_acc + cols, mask=mask, other=0.0)
    w_t = tl.load(wt_ptr + row * stride_wt + cols, mask=mask, other=0.0).to(tl.float32)
    x += tl.load(b_ptr + row) * w_t
    if HAS_SMOOTHING:
        x += tl.load(c_ptr + row) * tl.load(wsum_ptr + cols, mask=mask, other=0.0)
    tl.store(out_ptr + row * stride_out + cols, x.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _lce_grad_kernel(
    logits_ptr,  # [N, vc] chunk of logits; G is written over it
    target_ptr,  # [N] int64 global class ids
    lse_ptr,  # [N] fp32 logsumexp over the whole (global) vocab
    a_ptr,  # [N] fp32 coefficient of the softmax      (_grad_coefs)
    b_ptr,  # [N] fp32 added at the target column
    c_ptr,  # [N] fp32 added to every column (label smoothing)
    stride_row,
    vc,
    v_offset,
    BLOCK_V: tl.constexpr,
):
    # Grid (rows, column blocks): G = a softmax + c, plus b at the target; program_id(1) walks
    # a full vocab row in BLOCK_V pieces (fast mode), or is 0 for one chunk row (low memory).
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    mask = cols < vc
    ptrs = logits_ptr + row * stride_row + cols
    z = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(a_ptr + row) * tl.exp(z - tl.load(lse_ptr + row)) + tl.load(c_ptr + row)
    t_local = tl.load(target_ptr + row) - v_offset
    g = tl.where(cols == t_local, g + tl.load(b_ptr + row), g)
    tl.store(ptrs, g.to(logits_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _lce_scale_kernel(x_ptr, g_ptr, numel, BLOCK: tl.constexpr):
    # x *= g in fp32, in place; g is read on the device (no .item()).
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    g = tl.load(g_ptr).to(tl.float32)
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32) * g
    tl.store(x_ptr + offs, x.to(x_ptr.dtype.element_ty), mask=mask)


# One tile per operand dtype, no autotuning. Compiled for sm_90 with the triton wheel's ptxas at
# the launchers' benchmark shapes, of the five Hopper tiles autotuned before only this 16-bit
# one is spill-free in every variant (FIRST, HAS_ALPHA, P transposed): the others spilled
# 24-200 B per thread once acc is loaded before the K loop. fp32 (ieee: no tensor cores, the
# path of fp32 compute) spilled 10-18 KB at those tiles and one needed 245,760 B of shared
# memory; 64x128x16 takes 128 registers and 16 KiB. Without autotuning nothing benchmarks the
# kernel on the live accumulator it updates in place (restore_value cloned it: 2.1 GB for an
# fp32 grad_weight at V = 128256, H = 4096, once per shape). Table: the design note.
_DH_CONFIG_16BIT = {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "GROUP_M": 8}
_DH_LAUNCH_16BIT = {"num_warps": 8, "num_stages": 4}
_DH_CONFIG_FP32 = {"BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K": 16, "GROUP_M": 8}
_DH_LAUNCH_FP32 = {"num_warps": 8, "num_stages": 2}
# Small fixed tiles for the interpreter (and tiny problems, where big tiles are mostly padding).
_DH_SMALL = {"BLOCK_M": 32, "BLOCK_N": 32, "BLOCK_K": 32, "GROUP_M": 4}
