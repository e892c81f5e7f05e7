"""linear_cross_entropy: the pure-torch reference, the CPU kernel and the test oracle.

What
    linear_cross_entropy_ref(hidden, weight, target, **options) -> (loss, lse, grad_hidden,
    grad_weight, stats), gradients for grad_output 1; linear_cross_entropy_backward_ref for
    reduction="none" (per-token grad_loss, recomputed in chunks).

Numerics
    Token-chunked (16 MiB of fp32 logits per chunk), so [N, V] is never materialised: fast
    mode's algorithm in torch. Logits are rounded to the input dtype like F.linear(...).float();
    the rest is fp32 (fp64 for fp64 inputs), grad_weight accumulated in fp32 unless fast mode
    accumulates a 16-bit weight in its own dtype (then exactly four chunks, the GPU's worst case).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from graphtrain.custom_ops.linear_cross_entropy.maths import (
    _all_reduce,
    _global_stats,
    _grad_coefs,
    _grads_or_placeholders,
    _group_rank_size,
    _local_target,
    _reduce,
    _row_scale,
    _token_terms,
)
from graphtrain.custom_ops.linear_cross_entropy.options import (
    _REF_CHUNK_ELEMENTS,
    LCEOptions,
    _at_most_four_chunks,
    _check_args,
    _input_dtype_accumulation,
)
from graphtrain.custom_ops.utils import compute_dtype as _compute_dtype


def _ref_token_chunk(N: int, V: int, opts: LCEOptions, input_dtype_accumulation: bool) -> int:
    if input_dtype_accumulation:
        # Without an explicit chunk exactly four chunks, the GPU's worst case, so the CPU path
        # has the numerics the docstring states.
        return _at_most_four_chunks(opts.token_chunk, N)
    return opts.token_chunk or max(1, _REF_CHUNK_ELEMENTS // max(V, 1))


def _ref_run(
    hidden: Tensor,
    weight: Tensor,
    target: Tensor,
    opts: LCEOptions,
    *,
    row_scale: Tensor | None,
    lse_in: Tensor | None,
) -> tuple[Tensor, Tensor, Tensor | None, Tensor | None, Tensor]:
    """Token-chunked: (loss per token, lse, grad_hidden, grad_weight, stats); [N, V] never
    exists. This is fast mode's algorithm in torch; the mode changes only grad_weight's
    accumulation dtype (fp32 unless fast mode accumulates a 16-bit weight in its own dtype).

    row_scale [N]: d(loss)/d(loss_tok) per token (0 where ignored), None for no gradients.
    lse_in: the logsumexp from the forward (backward of "none"); the loss is then not computed.
    """
    N, H = hidden.shape
    V = weight.shape[0]
    cdt = _compute_dtype(hidden.dtype)
    rank, tp = _group_rank_size(opts.group_name)
    v_global, v_start = V * tp, rank * V
    want_grads = row_scale is not None
    w_in = weight.to(hidden.dtype)  # master weights: the copy autocast's F.linear would use
    in_dtype_acc = _input_dtype_accumulation(hidden, weight, opts)

    loss_tok = torch.zeros(N, dtype=cdt, device=hidden.device)
    lse_out = torch.empty(N, dtype=cdt, device=hidden.device) if lse_in is None else lse_in
    stats = torch.zeros(2, dtype=torch.int64, device=hidden.device)
    grad_hidden = grad_weight_acc = weight_c = None
    if want_grads and opts.compute_grad_hidden:
        grad_hidden = torch.empty(N, H, dtype=hidden.dtype, device=hidden.device)
        weight_c = w_in.to(cdt)
    if want_grads and opts.compute_grad_weight:
        # fp32 (or the weight's 16-bit dtype in fast mode without the fp32 buffer).
        acc_dtype = weight.dtype if in_dtype_acc else cdt
        grad_weight_acc = torch.zeros(V, H, dtype=acc_dtype, device=hidden.device)

    chunk = _ref_token_chunk(N, V, opts, in_dtype_acc)
    for a in range(0, N, chunk):
        b = min(N, a + chunk)
        h, t = hidden[a:b], target[a:b]
        z = F.linear(h, w_in).to(cdt)  # (n, V): rounded like F.linear(...).float()
        t_idx, local = _local_target(t, opts.ignore_index, v_start, V)
        t_idx = t_idx.unsqueeze(1)
        if lse_in is None:
            m = z.amax(dim=1)
            s = torch.exp(z - m[:, None]).sum(dim=1)
            zt = z.gather(1, t_idx).squeeze(1) * local
            zsum = z.sum(dim=1) if opts.label_smoothing > 0.0 else torch.zeros_like(m)
            m, s, zt, zsum, _ = _global_stats(m, s, zt, zsum, opts.group_name)
            lse, loss_tok[a:b], chunk_stats = _token_terms(m, s, zt, zsum, t, opts, v_global)
            lse_out[a:b] = lse
            stats += chunk_stats
        else:
            lse = lse_in[a:b].to(cdt)
        if not want_grads:
            continue
        coef_a, coef_b, coef_c = _grad_coefs(lse, row_scale[a:b].to(cdt), opts, v_global)
        g = torch.exp(z - lse[:, None]) * coef_a[:, None] + coef_c[:, None]
        g = g.scatter_add(1, t_idx, torch.where(local, coef_b, 0.0)[:, None])
        if grad_hidden is not None:
            gh = g @ weight_c
            if tp > 1:
                gh = _all_reduce(gh, "sum", opts.group_name)
            grad_hidden[a:b] = gh.to(hidden.dtype)
        if grad_weight_acc is None:
            continue
        if in_dtype_acc:  # fp32 inside the product, one rounding per chunk
            grad_weight_acc.copy_(grad_weight_acc.to(cdt).addmm_(g.t(), h.to(cdt)))
        else:
            grad_weight_acc.addmm_(g.t(), h.to(cdt))
    grad_weight = None if grad_weight_acc is None else grad_weight_acc.to(weight.dtype)
    return loss_tok, lse_out, grad_hidden, grad_weight, stats


def linear_cross_entropy_ref(
    hidden: Tensor,
    weight: Tensor,
    target: Tensor,
    **options: Any,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Pure-torch forward: (loss, lse, grad_hidden, grad_weight, stats), gradients for
    grad_output 1. `options`: the fields of LCEOptions.

    Chunked over tokens, so [N, V] is never materialised. For reduction="none" no gradient is
    computed here (an empty tensor stands in): see linear_cross_entropy_backward_ref.
    """
    opts = LCEOptions(**options)
    _check_args(hidden, weight, target)
    cdt = _compute_dtype(hidden.dtype)
    valid = target != opts.ignore_index
    row_scale = None if opts.reduction == "none" else _row_scale(valid, opts.reduction, cdt)
    if not (opts.compute_grad_hidden or opts.compute_grad_weight):
        row_scale = None
    loss_tok, lse, gh, gw, stats = _ref_run(
        hidden, weight, target, opts, row_scale=row_scale, lse_in=None
    )
    return (
        _reduce(loss_tok, valid, opts.reduction),
        lse,
        *_grads_or_placeholders(gh, gw, hidden, weight),
        stats,
    )


def linear_cross_entropy_backward_ref(
    grad_loss: Tensor,
    hidden: Tensor,
    weight: Tensor,
    target: Tensor,
    lse: Tensor,
    **options: Any,
) -> tuple[Tensor, Tensor]:
    """Gradients of reduction="none" for a per-token grad_loss [N], recomputed in chunks."""
    opts = LCEOptions(**options, reduction="none")
    cdt = _compute_dtype(hidden.dtype)
    # where, not multiply: a NaN/inf grad on an ignored token must not leak in.
    row_scale = torch.where(target != opts.ignore_index, grad_loss.to(cdt), 0.0)
    _, _, gh, gw, _ = _ref_run(hidden, weight, target, opts, row_scale=row_scale, lse_in=lse)
    return _grads_or_placeholders(gh, gw, hidden, weight)
