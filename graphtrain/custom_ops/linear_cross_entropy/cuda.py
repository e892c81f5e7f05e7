"""linear_cross_entropy: the launchers and the two CUDA algorithms.

What
    _lce_triton(hidden, weight, target, *, row_scale, lse_in, vocab_chunk=None, **options)
    -> (loss per token, lse, grad_hidden, grad_weight, stats); the same contract as the
    reference's _ref_run. mode="low_memory": two sweeps over vocab chunks, four GEMMs
    (_lce_triton_low_memory); mode="fast": token chunks, three GEMMs (_lce_triton_fast).
    The algorithms and their memory are described in docs/design/linear_cross_entropy.md.

Numerics
    Logits rounded to the input dtype by cuBLAS; statistics, coefficients and the grad_hidden
    accumulator in fp32; grad_weight accumulated in fp32 (fast mode: in fp32 into an fp32
    weight's gradient, in an fp32 buffer, or in a 16-bit weight's own dtype over <= 4 chunks;
    16-bit operands into fp32 by cuBLAS, torch.addmm with out_dtype, reading and writing C).
    No host synchronisation; _lce_dh_kernel (low-memory mode's grad_hidden accumulator) runs
    one fixed tile per dtype (no autotuning).
"""

from __future__ import annotations

from typing import Any

import torch
import triton
from torch import Tensor

from graphtrain.custom_ops.linear_cross_entropy.kernels import (
    _DH_CONFIG_16BIT,
    _DH_CONFIG_FP32,
    _DH_LAUNCH_16BIT,
    _DH_LAUNCH_FP32,
    _DH_SMALL,
    _lce_dh_finalize_kernel,
    _lce_dh_kernel,
    _lce_grad_kernel,
    _lce_stats_kernel,
)
from graphtrain.custom_ops.linear_cross_entropy.maths import (
    _all_reduce,
    _global_stats,
    _grad_coefs,
    _group_rank_size,
    _local_target,
    _token_terms,
)
from graphtrain.custom_ops.linear_cross_entropy.options import (
    _MAX_VOCAB_CHUNK,
    _SWEEP_B_BUFFER_BYTES,
    SWEEP_A_BUFFER_BYTES,
    LCEOptions,
    _at_most_four_chunks,
    _fast_token_chunk,
    _fp32_buffer_bytes,
    _input_dtype_accumulation,
)
from graphtrain.custom_ops.utils import interpreting as _interpreting


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
    args = (p, w, acc, alpha, M, n_out, p.stride(0), p.stride(1), w.stride(0), acc.stride(0))
    if _interpreting() or M * n_out * K < (1 << 24):
        cfg, launch = _DH_SMALL, {}
    elif p.dtype == torch.float32:
        cfg, launch = _DH_CONFIG_FP32, _DH_LAUNCH_FP32
    else:
        cfg, launch = _DH_CONFIG_16BIT, _DH_LAUNCH_16BIT
    grid = (triton.cdiv(M, cfg["BLOCK_M"]) * triton.cdiv(n_out, cfg["BLOCK_N"]),)
    _lce_dh_kernel[grid](
        *args, K=K, FIRST=first, HAS_ALPHA=has_alpha, INPUT_PRECISION=precision, **cfg, **launch
    )


def _stats_launch(
    logits: Tensor,
    target: Tensor,
    m: Tensor,
    s: Tensor,
    zt: Tensor,
    zsum: Tensor,
    alpha: Tensor,
    v_offset: int,
    *,
    known_lse: bool,
    write_p: bool,
    smoothing: bool,
) -> None:
    vc = logits.shape[1]
    block = triton.next_power_of_2(vc)
    _lce_stats_kernel[(logits.shape[0],)](
        logits,
        target,
        m,
        s,
        zt,
        zsum,
        alpha,
        logits.stride(0),
        vc,
        v_offset,
        BLOCK_V=block,
        KNOWN_LSE=known_lse,
        WRITE_P=write_p,
        SMOOTHING=smoothing,
        num_warps=_row_warps(block),
    )


def _grad_launch(
    logits: Tensor,
    target: Tensor,
    lse: Tensor,
    coefs: tuple[Tensor, Tensor, Tensor],
    v_offset: int,
    max_block: int = _MAX_VOCAB_CHUNK,
) -> None:
    """G = a softmax + b onehot + c over `logits` [n, vc] in place, vc up to the whole vocab
    (in column blocks of at most max_block)."""
    n, vc = logits.shape
    block = min(triton.next_power_of_2(vc), triton.next_power_of_2(max_block))
    _lce_grad_kernel[(n, triton.cdiv(vc, block))](
        logits,
        target,
        lse,
        *(c.contiguous() for c in coefs),
        logits.stride(0),
        vc,
        v_offset,
        BLOCK_V=block,
        num_warps=_row_warps(block),
    )


def _row_statistics(N: int, lse_in: Tensor | None, dev: torch.device) -> tuple[Tensor, ...]:
    """Sweep A's per-token running statistics, initialised: (max, sum-exp, target logit, logit
    sum, rescale factor). With a known lse the first is it, and sum-exp, logit sum and rescale
    alias it (the KNOWN_LSE kernel reads none of them)."""
    f32 = torch.float32
    zt = torch.zeros(N, dtype=f32, device=dev)
    if lse_in is not None:
        m = lse_in.to(f32).contiguous()
        return m, m, zt, m, m
    m = torch.full((N,), float("-inf"), dtype=f32, device=dev)
    s = torch.zeros(N, dtype=f32, device=dev)
    zsum = torch.zeros(N, dtype=f32, device=dev)
    return m, s, zt, zsum, torch.empty(N, dtype=f32, device=dev)


def _lce_triton_low_memory(
    hidden: Tensor,
    weight: Tensor,
    target: Tensor,
    opts: LCEOptions,
    row_scale: Tensor | None,
    lse_in: Tensor | None,
    vocab_chunk: int | None,
) -> tuple[Tensor, Tensor, Tensor | None, Tensor | None, Tensor | None]:
    """mode="low_memory": two sweeps over vocab chunks (docs/design/linear_cross_entropy.md).
    `weight` may be the fp32 master weight of 16-bit hidden: each sweep casts it a chunk at a
    time, as autocast's F.linear would cast it whole, so no 16-bit copy of the whole weight is
    held; its gradient is fp32, each chunk rounded to hidden's dtype first (autocast's)."""
    N, H = hidden.shape
    V = weight.shape[0]
    f32, dev = torch.float32, hidden.device
    rank, tp = _group_rank_size(opts.group_name)
    v_global, v_start = V * tp, rank * V
    known_lse = lse_in is not None
    want_gh = row_scale is not None and opts.compute_grad_hidden
    want_gw = row_scale is not None and opts.compute_grad_weight
    elem = hidden.element_size()
    chunk_a = vocab_chunk or _vocab_chunk(N, V, elem, SWEEP_A_BUFFER_BYTES)
    chunk_b = vocab_chunk or _vocab_chunk(N, V, elem, _SWEEP_B_BUFFER_BYTES)

    # ---- sweep A: statistics, and the grad_hidden accumulator --------------------------------
    m, s, zt, zsum, alpha = _row_statistics(N, lse_in, dev)
    acc = torch.empty(N, H, dtype=f32, device=dev) if want_gh else None
    smoothing = want_gh and opts.label_smoothing > 0.0
    wsum = torch.zeros(H, dtype=f32, device=dev) if smoothing else None
    if not known_lse or want_gh:
        buf = torch.empty(N * min(chunk_a, V), dtype=hidden.dtype, device=dev)
        for i, v0 in enumerate(range(0, V, chunk_a)):
            vc = min(chunk_a, V - v0)
            logits = buf[: N * vc].view(N, vc)
            w_c = weight[v0 : v0 + vc].to(hidden.dtype)  # a master weight's chunk, cast
            torch.mm(hidden, w_c.t(), out=logits)  # cuBLAS, input dtype
            _stats_launch(
                logits, target, m, s, zt, zsum, alpha, v_start + v0,
                known_lse=known_lse, write_p=want_gh, smoothing=opts.label_smoothing > 0.0,
            )  # fmt: skip
            if want_gh:
                _launch_dh(logits, w_c, acc, alpha, first=i == 0, has_alpha=not known_lse)
            if smoothing:
                wsum += w_c.sum(dim=0, dtype=f32)
        # `logits` is a view of the buffer: both go, or sweep A's chunk buffer (128 MiB at
        # 8192 tokens) would still be alive next to grad_weight (measured on an H100).
        del buf, logits

    # ---- per-token terms ------------------------------------------------------------------
    loss_tok = stats = r_scale = None
    if known_lse:
        lse = m
    else:
        m_global, s_global, zt, zsum, r_scale = _global_stats(m, s, zt, zsum, opts.group_name)
        lse, loss_tok, stats = _token_terms(m_global, s_global, zt, zsum, target, opts, v_global)

    grad_hidden = grad_weight = None
    if want_gh:
        coef_a, coef_b, coef_c = _grad_coefs(lse, row_scale, opts, v_global)
        t_idx, local = _local_target(target, opts.ignore_index, v_start, V)
        # zt is this rank's target logit: right wherever `local` holds, which is all b uses.
        # The target column was left out of P; its coefficient a p_t + b is applied in fp32.
        b_final = torch.where(local, coef_a * torch.exp(zt - lse) + coef_b, 0.0)
        if not known_lse:  # P was normalised by this rank's running max, not by the lse
            coef_a = coef_a / s_global if r_scale is None else coef_a * r_scale / s_global
        # Each token's target row ([N, H], as cast), passed and not held: like the fp32
        # accumulator, gone before grad_weight exists (the peak is sweep B's).
        grad_hidden = _finalize_dh(
            acc, weight[t_idx].to(hidden.dtype), wsum, coef_a, b_final, coef_c, opts, hidden
        )
        del acc

    if want_gw:
        grad_weight = _sweep_b(hidden, weight, target, lse, row_scale, opts, v_start, chunk_b)
    return loss_tok, lse, grad_hidden, grad_weight, stats


def _sweep_b(
    hidden: Tensor,
    weight: Tensor,
    target: Tensor,
    lse: Tensor,
    row_scale: Tensor,
    opts: LCEOptions,
    v_start: int,
    chunk_b: int,
) -> Tensor:
    """Low-memory mode's sweep B: grad_weight, one full-N GEMM per vocab chunk."""
    N, V = hidden.shape[0], weight.shape[0]
    v_global = V * _group_rank_size(opts.group_name)[1]
    grad_weight = torch.empty_like(weight)
    buf = torch.empty(N * min(chunk_b, V), dtype=hidden.dtype, device=hidden.device)
    lse_c = lse.contiguous()
    coefs = _grad_coefs(lse_c, row_scale, opts, v_global)
    for v0 in range(0, V, chunk_b):
        vc = min(chunk_b, V - v0)
        logits = buf[: N * vc].view(N, vc)
        torch.mm(hidden, weight[v0 : v0 + vc].to(hidden.dtype).t(), out=logits)
        _grad_launch(logits, target, lse_c, coefs, v_start + v0)
        # fp32 accumulation over all N tokens inside the GEMM, one rounding on store (to the
        # input dtype: a master weight's fp32 gradient gets that chunk widened).
        g = grad_weight[v0 : v0 + vc]
        if g.dtype == hidden.dtype:
            torch.mm(logits.t(), hidden, out=g)
        else:
            g.copy_(torch.mm(logits.t(), hidden))
    return grad_weight


def _finalize_dh(
    acc: Tensor,
    w_t: Tensor,
    wsum: Tensor | None,
    coef_a: Tensor,
    coef_b: Tensor,
    coef_c: Tensor,
    opts: LCEOptions,
    hidden: Tensor,
) -> Tensor:
    """grad_hidden = a acc + b W[target] + c sum_v W_v (low-memory mode, after sweep A):
    `w_t` [N, H] each token's target row, `wsum` the rows' fp32 sum (label smoothing; None
    without)."""
    N, H = acc.shape
    smoothing = wsum is not None
    wsum = wsum if smoothing else coef_c  # a dummy pointer when unused
    tp = _group_rank_size(opts.group_name)[1]
    # Tensor parallel: the partial sums are all-reduced in fp32, then cast.
    out = acc if tp > 1 else torch.empty(N, H, dtype=hidden.dtype, device=hidden.device)
    block_h = min(1024, triton.next_power_of_2(H))
    _lce_dh_finalize_kernel[(N, triton.cdiv(H, block_h))](
        acc,
        w_t,
        wsum,
        out,
        coef_a.contiguous(),
        coef_b.contiguous(),
        coef_c.contiguous(),
        H,
        acc.stride(0),
        w_t.stride(0),
        out.stride(0),
        HAS_SMOOTHING=smoothing,
        BLOCK_H=block_h,
    )
    if tp > 1:
        out = _all_reduce(out, "sum", opts.group_name).to(hidden.dtype)
    return out


def _lce_triton_fast(
    hidden: Tensor,
    weight: Tensor,
    target: Tensor,
    opts: LCEOptions,
    row_scale: Tensor | None,
    lse_in: Tensor | None,
    vocab_chunk: int | None,
) -> tuple[Tensor, Tensor, Tensor | None, Tensor | None, Tensor | None]:
    """mode="fast": three GEMMs per token chunk (docs/design/linear_cross_entropy.md).
    `weight` may be the fp32 master weight of 16-bit hidden; grad_weight then accumulates in
    fp32 into the fp32 gradient itself."""
    N, H = hidden.shape
    V = weight.shape[0]
    f32, dev = torch.float32, hidden.device
    rank, tp = _group_rank_size(opts.group_name)
    v_global, v_start = V * tp, rank * V
    w_in = weight.to(hidden.dtype)  # master weights: the copy autocast's F.linear would make
    known_lse = lse_in is not None
    want_gh = row_scale is not None and opts.compute_grad_hidden
    want_gw = row_scale is not None and opts.compute_grad_weight
    in_dtype_acc = _input_dtype_accumulation(hidden, weight, opts)
    if opts.token_chunk:
        rows = _at_most_four_chunks(opts.token_chunk, N) if in_dtype_acc else opts.token_chunk
    else:
        fp32_buffer = _fp32_buffer_bytes(V, H, weight.dtype, opts.fp32_accumulator)
        rows = _fast_token_chunk(N, V, hidden.element_size(), in_dtype_acc, fp32_buffer)
    col_chunk = vocab_chunk or _MAX_VOCAB_CHUNK  # the stats kernel holds a piece of a row

    lse = lse_in.to(f32).contiguous() if known_lse else torch.empty(N, dtype=f32, device=dev)
    loss_tok = stats = None
    if not known_lse:
        loss_tok = torch.empty(N, dtype=f32, device=dev)
        stats = torch.zeros(2, dtype=torch.int64, device=dev)
        m = torch.empty(N, dtype=f32, device=dev)
        s, zt, zsum, alpha = (torch.empty(N, dtype=f32, device=dev) for _ in range(4))
    grad_hidden = torch.empty(N, H, dtype=hidden.dtype, device=dev) if want_gh else None
    # grad_weight's dtype: the weight's where it is the accumulation dtype (fp32 weights;
    # 16-bit without the fp32 buffer, or in one chunk: one GEMM, fp32 inside, one rounding);
    # else an fp32 accumulator, cast once at the end. The first chunk writes it, the others add.
    one_chunk = rows >= N
    gw_dtype = weight.dtype if (weight.dtype == f32 or in_dtype_acc or one_chunk) else f32
    gw = None
    buf = torch.empty(min(rows, N) * V, dtype=hidden.dtype, device=dev)
    for a in range(0, N, rows):
        b = min(N, a + rows)
        h, t = hidden[a:b], target[a:b]
        logits = buf[: (b - a) * V].view(b - a, V)
        torch.mm(h, w_in.t(), out=logits)  # GEMM 1, cuBLAS, input dtype
        if not known_lse:
            m[a:b], s[a:b], zt[a:b], zsum[a:b] = float("-inf"), 0.0, 0.0, 0.0
            for v0 in range(0, V, col_chunk):
                _stats_launch(
                    logits[:, v0 : v0 + col_chunk], t, m[a:b], s[a:b], zt[a:b], zsum[a:b],
                    alpha[a:b], v_start + v0, known_lse=False, write_p=False,
                    smoothing=opts.label_smoothing > 0.0,
                )  # fmt: skip
            m_g, s_g, zt_g, zsum_g, _ = _global_stats(
                m[a:b], s[a:b], zt[a:b], zsum[a:b], opts.group_name
            )
            lse[a:b], loss_tok[a:b], chunk_stats = _token_terms(
                m_g, s_g, zt_g, zsum_g, t, opts, v_global
            )
            stats += chunk_stats
        if not (want_gh or want_gw):
            continue
        coefs = _grad_coefs(lse[a:b], row_scale[a:b], opts, v_global)
        _grad_launch(logits, t, lse[a:b], coefs, v_start, col_chunk)  # G in place of L
        gh_rows = grad_hidden[a:b] if want_gh else None
        group = opts.group_name if tp > 1 else None
        gw = _fast_chunk_grads(logits, h, w_in, gh_rows, gw, gw_dtype if want_gw else None, group)
    del buf
    if want_gw and gw is None:  # no rows
        gw = torch.zeros(V, H, dtype=weight.dtype, device=dev)
    grad_weight = None if gw is None else gw.to(weight.dtype)
    return loss_tok, lse, grad_hidden, grad_weight, stats


def _fast_chunk_grads(
    logits: Tensor,
    h: Tensor,
    w_in: Tensor,
    grad_hidden: Tensor | None,
    gw: Tensor | None,
    gw_dtype: torch.dtype | None,
    group_name: str | None,
) -> Tensor | None:
    """Fast mode's GEMMs 2 and 3 for one token chunk whose logits hold G: its rows of
    grad_hidden (written in place) and grad_weight with its share (gw_dtype None: none wanted;
    gw None: the first chunk's, written, else added to gw), returned."""
    if grad_hidden is not None:  # GEMM 2
        if group_name is not None:  # partial sums over the vocab shards, all-reduced in fp32
            grad_hidden.copy_(_all_reduce(torch.mm(logits, w_in).float(), "sum", group_name))
        else:
            torch.mm(logits, w_in, out=grad_hidden)
    if gw_dtype is None:
        return None
    # GEMM 3: fp32 inside the GEMM; 16-bit operands into an fp32 result as cuBLAS's fp32 C.
    # The first chunk's beta=0: C neither zero-filled nor read.
    widen = {} if gw_dtype == h.dtype else {"out_dtype": torch.float32}
    first = gw is None
    if first:
        gw = torch.empty(logits.shape[1], h.shape[1], dtype=gw_dtype, device=h.device)
    return torch.addmm(gw, logits.t(), h, beta=0 if first else 1, out=gw, **widen)


def _lce_triton(
    hidden: Tensor,
    weight: Tensor,
    target: Tensor,
    *,
    row_scale: Tensor | None,
    lse_in: Tensor | None,
    vocab_chunk: int | None = None,
    **options: Any,
) -> tuple[Tensor, Tensor, Tensor | None, Tensor | None, Tensor | None]:
    """The CUDA path: (loss per token, lse, grad_hidden, grad_weight, stats); the loss and
    stats are None when lse_in is given. Same contract as _ref_run. `options`: LCEOptions'
    fields. `vocab_chunk` overrides the vocab chunk (tests use it to cover several chunks on
    tiny shapes); LCEOptions.token_chunk the fast mode's token chunk."""
    opts = LCEOptions(**options)
    hidden, weight, target = hidden.contiguous(), weight.contiguous(), target.contiguous()
    if opts.mode == "fast":
        return _lce_triton_fast(hidden, weight, target, opts, row_scale, lse_in, vocab_chunk)
    return _lce_triton_low_memory(hidden, weight, target, opts, row_scale, lse_in, vocab_chunk)


def _triton_ok(hidden: Tensor) -> bool:
    return hidden.dtype in (torch.float32, torch.bfloat16, torch.float16)
