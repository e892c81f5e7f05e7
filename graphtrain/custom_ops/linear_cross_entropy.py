"""graphtrain::linear_cross_entropy: the output head and the cross-entropy loss as one op.

What
    linear_cross_entropy(hidden [N, H], weight [V, H], target [N] int64, *, ignore_index=-100,
                         label_smoothing=0.0, z_loss=0.0, reduction="mean") -> loss
    means F.cross_entropy(F.linear(hidden, weight).float(), target, ignore_index=...,
    label_smoothing=..., reduction=...) plus z_loss * logsumexp(logits)**2 per token, reduced like
    the loss. "mean" divides by the number of non-ignored tokens (clamped to >= 1, so an
    all-ignored batch gives loss 0 and zero gradients, never NaN); "none" gives one value per
    token, 0 where the target is ignored.
    linear_cross_entropy_vocab_parallel(..., group_name) is the same with `weight` the local
    vocab shard of a tensor-parallel group (rank r holds rows [r * V_local, (r + 1) * V_local),
    even shards) and global target ids; the per-token max, sum-exp, target logit and logit sum
    are combined over the group with functional collectives, and grad_hidden is all-reduced
    (summed), so every rank gets the full gradient of its replicated hidden.

Why
    The logits of an LLM head are the biggest tensor of the step (8192 tokens x 128256 vocab is
    2 GiB in bf16, 4 GiB in fp32, and eager keeps several of them). This op never holds [N, V]:
    it works on vocab chunks, and it computes both gradients during the forward, so the backward
    only scales them by grad_output.

Layers (one op per file, DESIGN.md rule 1)
    linear_cross_entropy, ..._vocab_parallel    public ops, CompositeImplicitAutograd: they
        decide which gradients are needed (grad mode, requires_grad) and call
    linear_cross_entropy_forward                torch.library.custom_op with register_fake and
        register_autograd; returns (loss, lse, grad_hidden, grad_weight); CUDA: Triton kernels
        plus cuBLAS GEMMs; CPU and everything else: linear_cross_entropy_ref
    linear_cross_entropy_backward               custom op for reduction="none": there the
        per-token grad_output is only known in the backward, and grad_weight mixes tokens, so it
        cannot be a scaled copy of a forward result; this op recomputes in chunks instead.
    The public ops return only the loss; the per-token logsumexp (for logging) is the second
    output of linear_cross_entropy_forward.

CUDA algorithm (two sweeps over vocab chunks, each chunk's logits made by one cuBLAS GEMM)
    sweep A, chunk c:  L = hidden @ W_c^T                         GEMM 1  [N, Vc] in the input dtype
                       _lce_stats_kernel: online max / sum-exp / target logit / logit sum per
                       token, and P = exp(L - m_running) written over L (the target column 0)
                       _lce_dh_kernel: acc = acc * exp(m_old - m_new) + P @ W_c   GEMM 2  fp32
                       (the flash-attention trick with W as both keys and values)
               then    grad_hidden = r * ((1 + 2 z lse) (acc / s + p_t W_t) - (1 - ls) W_t
                                     - ls mean_v W_v)           (_lce_dh_finalize_kernel)
    sweep B, chunk c:  L = hidden @ W_c^T (again)                 GEMM 3
                       _lce_grad_kernel: G = r * ((1 + 2 z lse) softmax - (1 - ls) onehot - ls / V)
                       grad_weight[c] = G^T @ hidden                GEMM 4, full N reduction
    Four GEMMs where the plain code has three: the price of fp32 accumulation without a
    [V, H] fp32 buffer (2 GiB at V=128256, H=4096) or a [N, V] one. grad_weight needs, for one
    vocab row, the exact softmax of every token, which exists only after a pass over the whole
    vocab: either the logits are kept ([N, V]), or grad_weight is accumulated over token chunks
    (in fp32: a [V, H] fp32 buffer; in bf16: one rounding per chunk, what Liger does), or the
    logits are recomputed once (here). Sweep A finishes grad_hidden and frees its fp32
    accumulator before sweep B allocates grad_weight, so the peak is
    grad_weight + grad_hidden + one chunk (about 1.07 GiB at 8192 x 4096 x 128256, bf16).

Numerics
    Logits are rounded to the input dtype by the GEMM, exactly as F.linear(...).float() does;
    everything after is fp32: softmax statistics, both GEMM accumulations (grad_weight's over all
    N tokens inside one GEMM, grad_hidden's over the vocab in an fp32 buffer), the grad_output
    scaling. The softmax probabilities and G enter the GEMMs in the input dtype, as the
    reference's dlogits do. The target column is left out of P and added exactly in fp32
    (coefficient p_t - (1 - ls)): rounding p_t to bf16 before subtracting 1 would lose the
    small gradients of confident tokens. fp64 inputs compute in fp64 (the reference path).
    Targets outside [0, V) that are not ignore_index are not checked (that would need a host
    sync); they contribute a zero target logit.

No host synchronisation: the "mean" count stays on the device, all loops are over static
shapes. The first CUDA call per shape autotunes _lce_dh_kernel (it benchmarks, so warm up
before capturing a CUDA graph).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch import Tensor
from torch.utils._python_dispatch import _get_current_dispatch_mode

REDUCTIONS = ("mean", "sum", "none")

# CPU reference: logits elements per token chunk (16 MiB of fp32 logits).
_REF_CHUNK_ELEMENTS = 1 << 22
# CUDA: bytes of the logits chunk buffer in sweep A (no grad_weight allocated yet, so it can be
# large: fewer rescales of the fp32 accumulator) and in sweep B (lives next to grad_weight, so it
# is what the peak memory pays on top of the two gradients).
_SWEEP_A_BUFFER_BYTES = 256 << 20
_SWEEP_B_BUFFER_BYTES = 32 << 20
_MAX_VOCAB_CHUNK = 8192  # one row of a chunk is held in registers by the per-row kernels


# --------------------------------------------------------------------------------------------
# argument checks (shared by the real kernels and the fake, so bad input fails at trace time)
# --------------------------------------------------------------------------------------------


def _check_args(
    hidden: Tensor,
    weight: Tensor,
    target: Tensor,
    label_smoothing: float,
    z_loss: float,
    reduction: str,
) -> None:
    if reduction not in REDUCTIONS:
        raise ValueError(
            f"linear_cross_entropy: reduction must be one of {REDUCTIONS}, got {reduction!r}"
        )
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(
            f"linear_cross_entropy: label_smoothing must be in [0, 1], got {label_smoothing}"
        )
    if z_loss < 0.0:
        raise ValueError(f"linear_cross_entropy: z_loss must be >= 0, got {z_loss}")
    if hidden.dim() != 2 or weight.dim() != 2 or target.dim() != 1:
        raise ValueError(
            "linear_cross_entropy: expected hidden [N, H], weight [V, H], target [N]; got "
            f"{tuple(hidden.shape)}, {tuple(weight.shape)}, {tuple(target.shape)}"
        )
    if hidden.shape[1] != weight.shape[1] or hidden.shape[0] != target.shape[0]:
        raise ValueError(
            "linear_cross_entropy: shapes do not fit: hidden [N, H], weight [V, H], target [N]; "
            f"got {tuple(hidden.shape)}, {tuple(weight.shape)}, {tuple(target.shape)}"
        )
    if hidden.dtype != weight.dtype or not hidden.dtype.is_floating_point:
        raise ValueError(
            "linear_cross_entropy: hidden and weight must share one floating dtype; got "
            f"{hidden.dtype} and {weight.dtype}"
        )
    if target.dtype != torch.int64:
        raise ValueError(
            f"linear_cross_entropy: target must be int64 class ids, got {target.dtype}"
        )


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    # At least fp32, as F.cross_entropy(logits.float()); fp64 stays fp64 (tests).
    return torch.float64 if dtype == torch.float64 else torch.float32


# --------------------------------------------------------------------------------------------
# tensor-parallel helpers
# --------------------------------------------------------------------------------------------


def _group_rank_size(group_name: str | None) -> tuple[int, int]:
    """(rank, size) of the tensor-parallel group; (0, 1) without one. Host-side and static."""
    if group_name is None:
        return 0, 1
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _resolve_process_group

    group = _resolve_process_group(group_name)
    return dist.get_rank(group), dist.get_world_size(group)


def _all_reduce(x: Tensor, op: str, group_name: str) -> Tensor:
    # Functional collectives: async on the stream (no host sync, CUDA-graph capturable) and
    # the same code works on gloo for the CPU tests.
    out = torch.ops._c10d_functional.all_reduce(x, op, group_name)
    return torch.ops._c10d_functional.wait_tensor(out)


def _mean_count(valid: Tensor, dtype: torch.dtype) -> Tensor:
    # On the device, clamped: an all-ignored batch divides 0 by 1 (no .item(), no NaN).
    return valid.sum().clamp_min(1).to(dtype)


def _reduce(loss_tok: Tensor, valid: Tensor, reduction: str) -> Tensor:
    if reduction == "mean":
        return loss_tok.sum() / _mean_count(valid, loss_tok.dtype)
    if reduction == "sum":
        return loss_tok.sum()
    return loss_tok


def _row_scale(valid: Tensor, reduction: str, dtype: torch.dtype) -> Tensor:
    """d(loss) / d(loss_tok) for "mean" and "sum": 1/count or 1 on kept tokens, 0 on ignored."""
    scale = valid.to(dtype)
    if reduction == "mean":
        scale = scale / _mean_count(valid, dtype)
    return scale


def _no_grad_placeholder(ref: Tensor, dtype: torch.dtype | None = None) -> Tensor:
    # A gradient that was not asked for: an empty tensor keeps the op's output list fixed.
    return ref.new_empty((0,), dtype=dtype or ref.dtype)


# --------------------------------------------------------------------------------------------
# the pure-torch reference: CPU kernel and test oracle
# --------------------------------------------------------------------------------------------


def _ref_run(
    hidden: Tensor,
    weight: Tensor,
    target: Tensor,
    *,
    ignore_index: int,
    label_smoothing: float,
    z_loss: float,
    group_name: str | None,
    row_scale: Tensor | None,
    lse_in: Tensor | None,
    compute_grad_hidden: bool,
    compute_grad_weight: bool,
    token_chunk: int | None = None,
) -> tuple[Tensor, Tensor, Tensor | None, Tensor | None]:
    """Token-chunked: (loss per token, lse, grad_hidden, grad_weight); [N, V] never exists.

    row_scale [N]: d(loss)/d(loss_tok) per token (0 where ignored), None for no gradients.
    lse_in: the logsumexp from the forward (backward of "none"); the loss is then not computed.
    """
    N, H = hidden.shape
    V = weight.shape[0]
    cdt = _compute_dtype(hidden.dtype)
    rank, tp = _group_rank_size(group_name)
    v_global, v_start = V * tp, rank * V
    eps = label_smoothing
    valid = target != ignore_index
    want_grads = row_scale is not None and (compute_grad_hidden or compute_grad_weight)

    loss_tok = torch.zeros(N, dtype=cdt, device=hidden.device)
    lse_out = torch.empty(N, dtype=cdt, device=hidden.device) if lse_in is None else lse_in
    grad_hidden = grad_weight_acc = weight_c = None
    if want_grads and compute_grad_hidden:
        grad_hidden = torch.empty(N, H, dtype=hidden.dtype, device=hidden.device)
        weight_c = weight.to(cdt)
    if want_grads and compute_grad_weight:
        # fp32 accumulator: this is the CPU path, memory is not the point here.
        grad_weight_acc = torch.zeros(V, H, dtype=cdt, device=hidden.device)

    chunk = token_chunk or max(1, _REF_CHUNK_ELEMENTS // max(V, 1))
    for a in range(0, N, chunk):
        b = min(N, a + chunk)
        h, t, ok = hidden[a:b], target[a:b], valid[a:b]
        z = F.linear(h, weight).to(cdt)  # (n, V): rounded like F.linear(...).float()
        t_loc = t - v_start
        local = ok & (t_loc >= 0) & (t_loc < V)
        t_idx = torch.where(local, t_loc, 0).unsqueeze(1)
        if lse_in is None:
            m = z.amax(dim=1)
            if tp > 1:
                m = _all_reduce(m, "max", group_name)
            stats = torch.stack(
                [
                    torch.exp(z - m[:, None]).sum(dim=1),
                    z.gather(1, t_idx).squeeze(1) * local,
                    z.sum(dim=1) if eps > 0.0 else torch.zeros_like(m),
                ]
            )
            if tp > 1:
                stats = _all_reduce(stats, "sum", group_name)
            sum_exp, z_target, z_sum = stats.unbind(0)
            lse = m + torch.log(sum_exp)
            loss = (1.0 - eps) * (lse - z_target) + z_loss * lse * lse
            if eps > 0.0:
                loss = loss + eps * (lse - z_sum / v_global)
            loss_tok[a:b] = torch.where(ok, loss, 0.0)
            lse_out[a:b] = lse
        else:
            lse = lse_in[a:b].to(cdt)
        if not want_grads:
            continue
        # d loss_tok / d z = (1 + 2 z_loss lse) softmax - (1 - ls) onehot(target) - ls / V
        g = torch.exp(z - lse[:, None]) * (1.0 + 2.0 * z_loss * lse)[:, None]
        if eps > 0.0:
            g = g - eps / v_global
        g = g.scatter_add(1, t_idx, (-(1.0 - eps) * local.to(cdt))[:, None])
        g = g * row_scale[a:b].to(cdt)[:, None]
        if grad_hidden is not None:
            gh = g @ weight_c
            if tp > 1:
                gh = _all_reduce(gh, "sum", group_name)
            grad_hidden[a:b] = gh.to(hidden.dtype)
        if grad_weight_acc is not None:
            grad_weight_acc.addmm_(g.t(), h.to(cdt))
    grad_weight = None if grad_weight_acc is None else grad_weight_acc.to(weight.dtype)
    return loss_tok, lse_out, grad_hidden, grad_weight


def linear_cross_entropy_ref(
    hidden: Tensor,
    weight: Tensor,
    target: Tensor,
    *,
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
    z_loss: float = 0.0,
    reduction: str = "mean",
    group_name: str | None = None,
    compute_grad_hidden: bool = True,
    compute_grad_weight: bool = True,
    token_chunk: int | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Pure-torch forward: (loss, lse, grad_hidden, grad_weight), gradients for grad_output 1.

    Chunked over tokens, so [N, V] is never materialised. For reduction="none" no gradient is
    computed here (an empty tensor stands in): see linear_cross_entropy_backward_ref.
    """
    _check_args(hidden, weight, target, label_smoothing, z_loss, reduction)
    cdt = _compute_dtype(hidden.dtype)
    valid = target != ignore_index
    row_scale = None if reduction == "none" else _row_scale(valid, reduction, cdt)
    loss_tok, lse, gh, gw = _ref_run(
        hidden,
        weight,
        target,
        ignore_index=ignore_index,
        label_smoothing=label_smoothing,
        z_loss=z_loss,
        group_name=group_name,
        row_scale=row_scale,
        lse_in=None,
        compute_grad_hidden=compute_grad_hidden,
        compute_grad_weight=compute_grad_weight,
        token_chunk=token_chunk,
    )
    loss = _reduce(loss_tok, valid, reduction)
    return (
        loss,
        lse,
        gh if gh is not None else _no_grad_placeholder(hidden),
        gw if gw is not None else _no_grad_placeholder(weight),
    )


def linear_cross_entropy_backward_ref(
    grad_loss: Tensor,
    hidden: Tensor,
    weight: Tensor,
    target: Tensor,
    lse: Tensor,
    *,
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
    z_loss: float = 0.0,
    group_name: str | None = None,
    compute_grad_hidden: bool = True,
    compute_grad_weight: bool = True,
    token_chunk: int | None = None,
) -> tuple[Tensor, Tensor]:
    """Gradients of reduction="none" for a per-token grad_loss [N], recomputed in chunks."""
    cdt = _compute_dtype(hidden.dtype)
    valid = target != ignore_index
    # where, not multiply: a NaN/inf grad on an ignored token must not leak in.
    row_scale = torch.where(valid, grad_loss.to(cdt), 0.0)
    _, _, gh, gw = _ref_run(
        hidden,
        weight,
        target,
        ignore_index=ignore_index,
        label_smoothing=label_smoothing,
        z_loss=z_loss,
        group_name=group_name,
        row_scale=row_scale,
        lse_in=lse,
        compute_grad_hidden=compute_grad_hidden,
        compute_grad_weight=compute_grad_weight,
        token_chunk=token_chunk,
    )
    return (
        gh if gh is not None else _no_grad_placeholder(hidden),
        gw if gw is not None else _no_grad_placeholder(weight),
    )


# --------------------------------------------------------------------------------------------
# Triton kernels (CUDA; run on CPU tensors under TRITON_INTERPRET=1 in the tests)
# --------------------------------------------------------------------------------------------


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
):
    # One program per token row; the whole chunk row is in registers, so the logits are read
    # once and P written once.
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_V)
    mask = cols < vc
    ptrs = logits_ptr + row * stride_row + cols
    z = tl.load(ptrs, mask=mask, other=float("-inf")).to(tl.float32)
    t_local = tl.load(target_ptr + row) - v_offset
    is_t = (cols == t_local) & mask
    z_t = tl.sum(tl.where(is_t, z, 0.0), axis=0)
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
        tl.store(zsum_ptr + row, tl.load(zsum_ptr + row) + tl.sum(tl.where(mask, z, 0.0), axis=0))
    if WRITE_P:
        # The target column is left out of P and added exactly in fp32 by the finalize kernel.
        p = tl.where(is_t, 0.0, e)
        tl.store(ptrs, p.to(logits_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _lce_dh_kernel(
    p_ptr,  # [M, K] P chunk (input dtype), row stride stride_pm, unit column stride
    w_ptr,  # [K, N_OUT] the weight chunk's rows, row stride stride_wk, unit column stride
    acc_ptr,  # [M, N_OUT] fp32 accumulator, row stride stride_am
    alpha_ptr,  # [M] fp32 per-row rescale of acc (online softmax)
    M,
    N_OUT,
    stride_pm,
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
    p_ptrs = p_ptr + rm.to(tl.int64)[:, None] * stride_pm + rk[None, :]
    w_ptrs = w_ptr + rk.to(tl.int64)[:, None] * stride_wk + rn[None, :]
    for k in range(0, K, BLOCK_K):
        k_mask = (k + rk) < K
        a = tl.load(p_ptrs, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        b = tl.load(w_ptrs, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
        acc = tl.dot(a, b, acc, input_precision=INPUT_PRECISION)
        p_ptrs += BLOCK_K
        w_ptrs += BLOCK_K * stride_wk
    tl.store(acc_ptrs, acc, mask=m_mask[:, None] & n_mask[None, :])


@triton.jit
def _lce_dh_finalize_kernel(
    acc_ptr,  # [N, H] fp32
    w_ptr,  # [V, H] weight (local shard)
    wsum_ptr,  # [H] fp32 sum of the weight rows (label smoothing)
    out_ptr,  # [N, H] output (may be acc_ptr itself: each element is read before written)
    tidx_ptr,  # [N] int64 local row of the target, clamped into [0, V)
    a_ptr,  # [N] fp32 coefficient of acc
    b_ptr,  # [N] fp32 coefficient of W[target] (0 where the target is ignored or not local)
    c_ptr,  # [N] fp32 coefficient of wsum
    H,
    stride_acc,
    stride_w,
    stride_out,
    HAS_SMOOTHING: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask = cols < H
    t = tl.load(tidx_ptr + row)
    x = tl.load(a_ptr + row) * tl.load(acc_ptr + row * stride_acc + cols, mask=mask, other=0.0)
    w_t = tl.load(w_ptr + t * stride_w + cols, mask=mask, other=0.0).to(tl.float32)
    x += tl.load(b_ptr + row) * w_t
    if HAS_SMOOTHING:
        x += tl.load(c_ptr + row) * tl.load(wsum_ptr + cols, mask=mask, other=0.0)
    tl.store(out_ptr + row * stride_out + cols, x.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _lce_grad_kernel(
    logits_ptr,  # [N, vc] chunk of logits; G is written over it
    target_ptr,  # [N] int64 global class ids
    lse_ptr,  # [N] fp32 logsumexp over the whole (global) vocab
    scale_ptr,  # [N] fp32 d(loss)/d(loss_tok), 0 on ignored tokens
    stride_row,
    vc,
    v_offset,
    smooth_per_class,  # label_smoothing / V_global
    target_weight,  # 1 - label_smoothing
    z_loss2,  # 2 * z_loss
    BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_V)
    mask = cols < vc
    ptrs = logits_ptr + row * stride_row + cols
    z = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
    lse = tl.load(lse_ptr + row)
    g = (1.0 + z_loss2 * lse) * tl.exp(z - lse) - smooth_per_class
    t_local = tl.load(target_ptr + row) - v_offset
    g = tl.where(cols == t_local, g - target_weight, g)
    g = g * tl.load(scale_ptr + row)
    tl.store(ptrs, g.to(logits_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _lce_scale_kernel(x_ptr, g_ptr, numel, BLOCK: tl.constexpr):
    # x *= g in fp32, in place; g is read on the device (no .item()).
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    g = tl.load(g_ptr).to(tl.float32)
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32) * g
    tl.store(x_ptr + offs, x.to(x_ptr.dtype.element_ty), mask=mask)


# Hopper-sized tiles; the best is picked once per (M, N_OUT, K). restore_value: the kernel
# updates acc in place, so autotuning must not run it more than once on live data.
_DH_CONFIGS = [
    triton.Config(
        {"BLOCK_M": 128, "BLOCK_N": 256, "BLOCK_K": 64, "GROUP_M": 8}, num_warps=8, num_stages=3
    ),
    triton.Config(
        {"BLOCK_M": 256, "BLOCK_N": 128, "BLOCK_K": 64, "GROUP_M": 8}, num_warps=8, num_stages=3
    ),
    triton.Config(
        {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "GROUP_M": 8}, num_warps=8, num_stages=4
    ),
    triton.Config(
        {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "GROUP_M": 8}, num_warps=4, num_stages=4
    ),
    triton.Config(
        {"BLOCK_M": 64, "BLOCK_N": 256, "BLOCK_K": 64, "GROUP_M": 8}, num_warps=4, num_stages=4
    ),
]
_lce_dh_kernel_tuned = triton.autotune(
    configs=_DH_CONFIGS, key=["M", "N_OUT", "K"], restore_value=["acc_ptr"]
)(_lce_dh_kernel)
# Small fixed tiles for the interpreter (and tiny problems, where autotuning is not worth it).
_DH_SMALL = {"BLOCK_M": 32, "BLOCK_N": 32, "BLOCK_K": 32, "GROUP_M": 4}


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _row_warps(block: int) -> int:
    return 4 if block <= 1024 else 8 if block <= 4096 else 16


def _vocab_chunk(N: int, V: int, elem_size: int, budget: int) -> int:
    """Power-of-two vocab chunk whose [N, chunk] buffer fits in `budget` bytes."""
    fit = max(1, budget // max(1, N * elem_size))
    chunk = 1 << (fit.bit_length() - 1)
    return max(128, min(_MAX_VOCAB_CHUNK, chunk, triton.next_power_of_2(V)))


def _launch_dh(
    p: Tensor, w: Tensor, acc: Tensor, alpha: Tensor, *, first: bool, has_alpha: bool
) -> None:
    M, K = p.shape
    n_out = w.shape[1]
    precision = "ieee" if p.dtype == torch.float32 else "tf32"  # ignored for 16-bit inputs
    args = (p, w, acc, alpha, M, n_out, p.stride(0), w.stride(0), acc.stride(0))
    if _interpreting() or M * n_out * K < (1 << 24):
        cfg = _DH_SMALL
        grid = (triton.cdiv(M, cfg["BLOCK_M"]) * triton.cdiv(n_out, cfg["BLOCK_N"]),)
        _lce_dh_kernel[grid](
            *args, K=K, FIRST=first, HAS_ALPHA=has_alpha, INPUT_PRECISION=precision, **cfg
        )
    else:

        def grid(meta: dict[str, Any]) -> tuple[int]:
            return (triton.cdiv(M, meta["BLOCK_M"]) * triton.cdiv(n_out, meta["BLOCK_N"]),)

        _lce_dh_kernel_tuned[grid](
            *args, K=K, FIRST=first, HAS_ALPHA=has_alpha, INPUT_PRECISION=precision
        )


def _lce_triton(
    hidden: Tensor,
    weight: Tensor,
    target: Tensor,
    *,
    ignore_index: int,
    label_smoothing: float,
    z_loss: float,
    group_name: str | None,
    row_scale: Tensor | None,
    lse_in: Tensor | None,
    compute_grad_hidden: bool,
    compute_grad_weight: bool,
    vocab_chunk: int | None = None,
) -> tuple[Tensor, Tensor, Tensor | None, Tensor | None]:
    """The CUDA path: (loss per token, lse, grad_hidden, grad_weight). See the module docstring.

    Same contract as _ref_run. `vocab_chunk` overrides both sweeps' chunk (tests use it to
    cover several chunks on tiny shapes).
    """
    N, H = hidden.shape
    V = weight.shape[0]
    f32, dev = torch.float32, hidden.device
    hidden, weight, target = hidden.contiguous(), weight.contiguous(), target.contiguous()
    rank, tp = _group_rank_size(group_name)
    v_global, v_start = V * tp, rank * V
    eps = label_smoothing
    valid = target != ignore_index
    known_lse = lse_in is not None
    want_gh = row_scale is not None and compute_grad_hidden
    want_gw = row_scale is not None and compute_grad_weight
    elem = hidden.element_size()
    chunk_a = vocab_chunk or _vocab_chunk(N, V, elem, _SWEEP_A_BUFFER_BYTES)
    chunk_b = vocab_chunk or _vocab_chunk(N, V, elem, _SWEEP_B_BUFFER_BYTES)

    # ---- sweep A: statistics, and the grad_hidden accumulator --------------------------------
    zt = torch.zeros(N, dtype=f32, device=dev)
    if known_lse:
        m = lse_in.to(f32).contiguous()
        s = zsum = alpha = m  # unused by the KNOWN_LSE kernel
    else:
        m = torch.full((N,), float("-inf"), dtype=f32, device=dev)
        s = torch.zeros(N, dtype=f32, device=dev)
        zsum = torch.zeros(N, dtype=f32, device=dev)
        alpha = torch.empty(N, dtype=f32, device=dev)
    acc = torch.empty(N, H, dtype=f32, device=dev) if want_gh else None
    if not known_lse or want_gh:
        buf = torch.empty(N * min(chunk_a, V), dtype=hidden.dtype, device=dev)
        for i, v0 in enumerate(range(0, V, chunk_a)):
            vc = min(chunk_a, V - v0)
            logits = buf[: N * vc].view(N, vc)
            torch.mm(hidden, weight[v0 : v0 + vc].t(), out=logits)  # cuBLAS, input dtype
            block = triton.next_power_of_2(vc)
            _lce_stats_kernel[(N,)](
                logits,
                target,
                m,
                s,
                zt,
                zsum,
                alpha,
                logits.stride(0),
                vc,
                v_start + v0,
                BLOCK_V=block,
                KNOWN_LSE=known_lse,
                WRITE_P=want_gh,
                num_warps=_row_warps(block),
            )
            if want_gh:
                _launch_dh(
                    logits, weight[v0 : v0 + vc], acc, alpha, first=i == 0, has_alpha=not known_lse
                )
        # `logits` is a view of the buffer: both go, or sweep A's chunk buffer (128 MiB at
        # 8192 tokens) would still be alive next to grad_weight (measured on an H100).
        del buf, logits

    # ---- per-token terms ------------------------------------------------------------------
    if known_lse:
        lse, loss_tok, r_scale = m, None, None
    else:
        if tp > 1:
            m_global = _all_reduce(m, "max", group_name)
            r_scale = torch.exp(m - m_global)  # local accumulator -> global max
            stats = _all_reduce(torch.stack([s * r_scale, zt, zsum]), "sum", group_name)
            s_global, zt_global, zsum_global = stats.unbind(0)
        else:
            m_global, r_scale, s_global, zt_global, zsum_global = m, None, s, zt, zsum
        lse = m_global + torch.log(s_global)
        loss_tok = (1.0 - eps) * (lse - zt_global) + z_loss * lse * lse
        if eps > 0.0:
            loss_tok = loss_tok + eps * (lse - zsum_global / v_global)
        loss_tok = torch.where(valid, loss_tok, 0.0)

    grad_hidden = grad_weight = None
    if want_gh:
        coef = 1.0 + 2.0 * z_loss * lse
        t_loc = target - v_start
        local = valid & (t_loc >= 0) & (t_loc < V)
        t_idx = torch.where(local, t_loc, 0)
        # zt is this rank's target logit: right wherever `local` holds, which is all b uses.
        p_t = torch.exp(zt - lse)
        if known_lse:
            a_coef = row_scale * coef  # P was already normalised by the lse
        else:
            a_coef = row_scale * coef / s_global
            if r_scale is not None:
                a_coef = a_coef * r_scale
        b_coef = torch.where(local, row_scale * (coef * p_t - (1.0 - eps)), 0.0)
        c_coef = -row_scale * (eps / v_global)
        wsum = weight.sum(dim=0, dtype=f32) if eps > 0.0 else c_coef  # dummy when unused
        # Tensor parallel: the partial sums are all-reduced in fp32, then cast.
        out = acc if tp > 1 else torch.empty(N, H, dtype=hidden.dtype, device=dev)
        block_h = min(1024, triton.next_power_of_2(H))
        _lce_dh_finalize_kernel[(N, triton.cdiv(H, block_h))](
            acc,
            weight,
            wsum,
            out,
            t_idx,
            a_coef.contiguous(),
            b_coef,
            c_coef.contiguous(),
            H,
            acc.stride(0),
            weight.stride(0),
            out.stride(0),
            HAS_SMOOTHING=eps > 0.0,
            BLOCK_H=block_h,
        )
        if tp > 1:
            out = _all_reduce(out, "sum", group_name).to(hidden.dtype)
        grad_hidden = out
        del acc  # free the fp32 accumulator before grad_weight exists: the peak is sweep B's

    # ---- sweep B: grad_weight, one full-N GEMM per vocab chunk ------------------------------
    if want_gw:
        grad_weight = torch.empty_like(weight)
        buf = torch.empty(N * min(chunk_b, V), dtype=hidden.dtype, device=dev)
        lse_c, scale_c = lse.contiguous(), row_scale.contiguous()
        for v0 in range(0, V, chunk_b):
            vc = min(chunk_b, V - v0)
            logits = buf[: N * vc].view(N, vc)
            torch.mm(hidden, weight[v0 : v0 + vc].t(), out=logits)
            block = triton.next_power_of_2(vc)
            _lce_grad_kernel[(N,)](
                logits,
                target,
                lse_c,
                scale_c,
                logits.stride(0),
                vc,
                v_start + v0,
                eps / v_global,
                1.0 - eps,
                2.0 * z_loss,
                BLOCK_V=block,
                num_warps=_row_warps(block),
            )
            # fp32 accumulation over all N tokens inside the GEMM, one rounding on store.
            torch.mm(logits.t(), hidden, out=grad_weight[v0 : v0 + vc])
        del buf, logits
    return loss_tok, lse, grad_hidden, grad_weight


def _triton_ok(hidden: Tensor) -> bool:
    return hidden.dtype in (torch.float32, torch.bfloat16, torch.float16)


# --------------------------------------------------------------------------------------------
# op registration
# --------------------------------------------------------------------------------------------


def _common_opts(
    ignore_index: int,
    label_smoothing: float,
    z_loss: float,
    group_name: str | None,
    compute_grad_hidden: bool,
    compute_grad_weight: bool,
) -> dict[str, Any]:
    """The keyword arguments the reference and the Triton path share."""
    return {
        "ignore_index": ignore_index,
        "label_smoothing": label_smoothing,
        "z_loss": z_loss,
        "group_name": group_name,
        "compute_grad_hidden": compute_grad_hidden,
        "compute_grad_weight": compute_grad_weight,
    }


def _fake_outputs(
    hidden: Tensor, weight: Tensor, reduction: str, compute_gh: bool, compute_gw: bool
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    cdt = _compute_dtype(hidden.dtype)
    N = hidden.shape[0]
    loss = hidden.new_empty((N,) if reduction == "none" else (), dtype=cdt)
    lse = hidden.new_empty((N,), dtype=cdt)
    with_grads = reduction != "none"
    gh = hidden.new_empty(hidden.shape) if with_grads and compute_gh else hidden.new_empty((0,))
    gw = weight.new_empty(weight.shape) if with_grads and compute_gw else weight.new_empty((0,))
    return loss, lse, gh, gw


@torch.library.custom_op("graphtrain::linear_cross_entropy_forward", mutates_args=())
def linear_cross_entropy_forward(
    hidden: Tensor,
    weight: Tensor,
    target: Tensor,
    ignore_index: int,
    label_smoothing: float,
    z_loss: float,
    reduction: str,
    group_name: str | None,
    compute_grad_hidden: bool,
    compute_grad_weight: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(loss, lse [N], grad_hidden, grad_weight): gradients for grad_output = 1, computed now.

    An empty tensor stands in for a gradient not asked for, and for both under "none".
    This body is the CPU (and any non-CUDA) kernel: the chunked torch reference.
    """
    return linear_cross_entropy_ref(
        hidden,
        weight,
        target,
        ignore_index=ignore_index,
        label_smoothing=label_smoothing,
        z_loss=z_loss,
        reduction=reduction,
        group_name=group_name,
        compute_grad_hidden=compute_grad_hidden,
        compute_grad_weight=compute_grad_weight,
    )


@linear_cross_entropy_forward.register_fake
def _forward_fake(
    hidden,
    weight,
    target,
    ignore_index,
    label_smoothing,
    z_loss,
    reduction,
    group_name,
    compute_grad_hidden,
    compute_grad_weight,
):
    _check_args(hidden, weight, target, label_smoothing, z_loss, reduction)
    return _fake_outputs(hidden, weight, reduction, compute_grad_hidden, compute_grad_weight)


@linear_cross_entropy_forward.register_kernel("cuda")
def _forward_cuda(
    hidden,
    weight,
    target,
    ignore_index,
    label_smoothing,
    z_loss,
    reduction,
    group_name,
    compute_grad_hidden,
    compute_grad_weight,
):
    _check_args(hidden, weight, target, label_smoothing, z_loss, reduction)
    opts = _common_opts(
        ignore_index, label_smoothing, z_loss, group_name, compute_grad_hidden, compute_grad_weight
    )
    if not _triton_ok(hidden):
        return linear_cross_entropy_ref(hidden, weight, target, reduction=reduction, **opts)
    valid = target != ignore_index
    row_scale = None if reduction == "none" else _row_scale(valid, reduction, torch.float32)
    loss_tok, lse, gh, gw = _lce_triton(
        hidden, weight, target, row_scale=row_scale, lse_in=None, **opts
    )
    return (
        _reduce(loss_tok, valid, reduction),
        lse,
        gh if gh is not None else _no_grad_placeholder(hidden),
        gw if gw is not None else _no_grad_placeholder(weight),
    )


@torch.library.custom_op("graphtrain::linear_cross_entropy_backward", mutates_args=())
def linear_cross_entropy_backward(
    grad_loss: Tensor,
    hidden: Tensor,
    weight: Tensor,
    target: Tensor,
    lse: Tensor,
    ignore_index: int,
    label_smoothing: float,
    z_loss: float,
    group_name: str | None,
    compute_grad_hidden: bool,
    compute_grad_weight: bool,
) -> tuple[Tensor, Tensor]:
    """(grad_hidden, grad_weight) of reduction="none" for a per-token grad_loss [N]."""
    return linear_cross_entropy_backward_ref(
        grad_loss,
        hidden,
        weight,
        target,
        lse,
        ignore_index=ignore_index,
        label_smoothing=label_smoothing,
        z_loss=z_loss,
        group_name=group_name,
        compute_grad_hidden=compute_grad_hidden,
        compute_grad_weight=compute_grad_weight,
    )


@linear_cross_entropy_backward.register_fake
def _backward_fake(
    grad_loss,
    hidden,
    weight,
    target,
    lse,
    ignore_index,
    label_smoothing,
    z_loss,
    group_name,
    compute_grad_hidden,
    compute_grad_weight,
):
    gh = hidden.new_empty(hidden.shape) if compute_grad_hidden else hidden.new_empty((0,))
    gw = weight.new_empty(weight.shape) if compute_grad_weight else weight.new_empty((0,))
    return gh, gw


@linear_cross_entropy_backward.register_kernel("cuda")
def _backward_cuda(
    grad_loss,
    hidden,
    weight,
    target,
    lse,
    ignore_index,
    label_smoothing,
    z_loss,
    group_name,
    compute_grad_hidden,
    compute_grad_weight,
):
    opts = _common_opts(
        ignore_index, label_smoothing, z_loss, group_name, compute_grad_hidden, compute_grad_weight
    )
    if not _triton_ok(hidden):
        return linear_cross_entropy_backward_ref(grad_loss, hidden, weight, target, lse, **opts)
    valid = target != ignore_index
    row_scale = torch.where(valid, grad_loss.to(torch.float32), 0.0)
    _, _, gh, gw = _lce_triton(hidden, weight, target, row_scale=row_scale, lse_in=lse, **opts)
    return (
        gh if gh is not None else _no_grad_placeholder(hidden),
        gw if gw is not None else _no_grad_placeholder(weight),
    )


def _scale_inplace_(x: Tensor, g: Tensor) -> None:
    """x *= g with the product in fp32 and one rounding, without an fp32 copy of x."""
    if x.numel() == 0:
        return
    if x.is_cuda and not _interpreting():
        block = 4096
        _lce_scale_kernel[(triton.cdiv(x.numel(), block),)](x, g, x.numel(), BLOCK=block)
        return
    if x.dtype in (torch.float32, torch.float64):
        x.mul_(g)
        return
    flat = x.view(-1)
    step = 1 << 20
    for a in range(0, flat.numel(), step):
        seg = flat[a : a + step]
        seg.copy_(seg.float() * g)


def _is_traced(t: Tensor) -> bool:
    # Under AOT autograd / make_fx / fake tensors the backward is being traced, not run.
    return type(t) is not torch.Tensor or _get_current_dispatch_mode() is not None


def _scale_grad(grad: Tensor, g: Tensor) -> Tensor:
    if grad.numel() == 0:
        return grad
    if _is_traced(grad):
        # Functional form: Inductor fuses it into one pointwise kernel and, with AOT's
        # donated buffers, can write it over the saved gradient.
        return (grad.to(g.dtype) * g).to(grad.dtype)
    # Eager: in place on our private saved gradient. A functional multiply would allocate a
    # second [V, H] (1 GiB at 128256 x 4096 bf16) at the backward's peak. The saved tensor's
    # version counter makes a second backward through the same graph fail loudly.
    _scale_inplace_(grad, g)
    return grad


def _setup_context(ctx: Any, inputs: Sequence[Any], output: Sequence[Tensor]) -> None:
    hidden, weight, target, ignore_index, ls, zl, reduction, group_name, cgh, cgw = inputs
    _, lse, gh, gw = output
    ctx.mark_non_differentiable(lse, gh, gw)
    ctx.set_materialize_grads(False)  # no [V, H] zeros for the grads of those outputs
    ctx.options = (ignore_index, ls, zl, group_name)
    ctx.reduction = reduction
    ctx.computed = (cgh, cgw)
    if reduction == "none":
        ctx.save_for_backward(hidden, weight, target, lse)
    else:
        ctx.save_for_backward(gh, gw)


def _backward(ctx: Any, grad_loss: Tensor | None, *_unused: Tensor | None) -> tuple:
    nones = (None,) * 8
    need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
    if grad_loss is None or not (need_h or need_w):
        return (None, None, *nones)
    ignore_index, ls, zl, group_name = ctx.options
    if ctx.reduction == "none":
        hidden, weight, target, lse = ctx.saved_tensors
        gh, gw = torch.ops.graphtrain.linear_cross_entropy_backward(
            grad_loss, hidden, weight, target, lse, ignore_index, ls, zl, group_name, need_h, need_w
        )
    else:
        if (need_h and not ctx.computed[0]) or (need_w and not ctx.computed[1]):
            raise RuntimeError(
                "linear_cross_entropy_forward was called with compute_grad_*=False for an input "
                "that needs a gradient; call graphtrain::linear_cross_entropy instead"
            )
        gh, gw = ctx.saved_tensors
        gh = _scale_grad(gh, grad_loss) if need_h else None
        gw = _scale_grad(gw, grad_loss) if need_w else None
    return (gh if need_h else None, gw if need_w else None, *nones)


linear_cross_entropy_forward.register_autograd(_backward, setup_context=_setup_context)


# The public ops. CompositeImplicitAutograd: they run above autograd, where it is known which
# inputs need a gradient (validation under no_grad then costs one GEMM, not four), and the
# signature stays "-> Tensor" while the op underneath returns what its backward needs.
_LIB = torch.library.Library("graphtrain", "FRAGMENT")
_OPTS = 'int ignore_index=-100, float label_smoothing=0.0, float z_loss=0.0, str reduction="mean"'
_LIB.define(
    f"linear_cross_entropy(Tensor hidden, Tensor weight, Tensor target, *, {_OPTS}) -> Tensor"
)
_LIB.define(
    "linear_cross_entropy_vocab_parallel(Tensor hidden, Tensor weight, Tensor target, "
    f"str group_name, *, {_OPTS}) -> Tensor"
)


def _call_forward(
    hidden: Tensor,
    weight: Tensor,
    target: Tensor,
    group_name: str | None,
    ignore_index: int,
    label_smoothing: float,
    z_loss: float,
    reduction: str,
) -> Tensor:
    grad_on = torch.is_grad_enabled()
    loss, _lse, _gh, _gw = torch.ops.graphtrain.linear_cross_entropy_forward(
        hidden,
        weight,
        target,
        ignore_index,
        label_smoothing,
        z_loss,
        reduction,
        group_name,
        grad_on and hidden.requires_grad,
        grad_on and weight.requires_grad,
    )
    return loss


def _composite(
    hidden: Tensor,
    weight: Tensor,
    target: Tensor,
    *,
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
    z_loss: float = 0.0,
    reduction: str = "mean",
) -> Tensor:
    return _call_forward(
        hidden, weight, target, None, ignore_index, label_smoothing, z_loss, reduction
    )


def _composite_vocab_parallel(
    hidden: Tensor,
    weight: Tensor,
    target: Tensor,
    group_name: str,
    *,
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
    z_loss: float = 0.0,
    reduction: str = "mean",
) -> Tensor:
    return _call_forward(
        hidden, weight, target, group_name, ignore_index, label_smoothing, z_loss, reduction
    )


_LIB.impl("linear_cross_entropy", _composite, "CompositeImplicitAutograd")
_LIB.impl(
    "linear_cross_entropy_vocab_parallel", _composite_vocab_parallel, "CompositeImplicitAutograd"
)


def linear_cross_entropy(
    hidden: Tensor,
    weight: Tensor,
    target: Tensor,
    *,
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
    z_loss: float = 0.0,
    reduction: str = "mean",
    group_name: str | None = None,
) -> Tensor:
    """The loss of F.cross_entropy(F.linear(hidden, weight).float(), target, ...) + z-loss.

    group_name: the tensor-parallel group (weight is then this rank's vocab shard).
    """
    opts = dict(
        ignore_index=ignore_index,
        label_smoothing=label_smoothing,
        z_loss=z_loss,
        reduction=reduction,
    )
    if group_name is None:
        return torch.ops.graphtrain.linear_cross_entropy(hidden, weight, target, **opts)
    return torch.ops.graphtrain.linear_cross_entropy_vocab_parallel(
        hidden, weight, target, group_name, **opts
    )
