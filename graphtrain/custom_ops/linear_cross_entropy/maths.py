"""linear_cross_entropy: the per-token maths, written once for the reference and both CUDA modes.

What
    combining a vocab shard's row statistics over the tensor-parallel group (_global_stats), the
    loss per token, the top-1 and invalid-target counts (_token_terms), the coefficients of the
    logits' gradient (_grad_coefs), the reductions and the "mean" count.

Numerics
    Everything here is in the compute dtype (fp32, fp64 for fp64 inputs). The "mean" count
    stays on the device, clamped to >= 1 (an all-ignored batch gives 0, never NaN, no .item()).
"""

from __future__ import annotations

import torch
from torch import Tensor

from graphtrain.custom_ops.linear_cross_entropy.options import LCEOptions
from graphtrain.custom_ops.utils import all_reduce as _all_reduce
from graphtrain.custom_ops.utils import group_rank_size as _group_rank_size


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


def _local_target(target: Tensor, ignore_index: int, v_start: int, V: int) -> tuple[Tensor, Tensor]:
    """(t_idx, local): the target's column in this rank's [., V] shard (0 where it has none),
    and whether this rank holds it (ignored and invalid targets: never)."""
    t_loc = target - v_start
    local = (target != ignore_index) & (t_loc >= 0) & (t_loc < V)
    return torch.where(local, t_loc, 0), local


def _global_stats(
    m: Tensor, s: Tensor, zt: Tensor, zsum: Tensor, group_name: str | None
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor | None]:
    """Per-token (max, sum of exp(z - max), target logit, logit sum) of this rank's vocab shard
    -> the whole vocab's, plus exp(m_local - m_global) (None without tp)."""
    if group_name is None or _group_rank_size(group_name)[1] == 1:
        return m, s, zt, zsum, None
    m_global = _all_reduce(m, "max", group_name)
    r_scale = torch.exp(m - m_global)  # local sum-exp -> global max
    stats = _all_reduce(torch.stack([s * r_scale, zt, zsum]), "sum", group_name)
    s_global, zt_global, zsum_global = stats.unbind(0)
    return m_global, s_global, zt_global, zsum_global, r_scale


def _token_terms(
    m: Tensor,
    s: Tensor,
    zt: Tensor,
    zsum: Tensor,
    target: Tensor,
    opts: LCEOptions,
    v_global: int,
) -> tuple[Tensor, Tensor, Tensor]:
    """From the whole vocab's per-token statistics: (lse, loss per token, stats [2] int64).

    loss_tok = (1 - ls)(lse - z_t) + ls (lse - mean_v z_v) + z_loss lse^2, 0 where ignored,
    NaN where the target is invalid (outside [0, V), not ignore_index). stats: [top-1 hits,
    invalid targets]; a hit is a counted token whose target logit equals the row maximum
    (exact comparison: both are the same rounded logit, fp32; ties count as hits).
    """
    eps = opts.label_smoothing
    valid = target != opts.ignore_index
    invalid = valid & ((target < 0) | (target >= v_global))
    lse = m + torch.log(s)
    loss = (1.0 - eps) * (lse - zt) + opts.z_loss * lse * lse
    if eps > 0.0:
        loss = loss + eps * (lse - zsum / v_global)
    loss = torch.where(valid, loss, 0.0)
    loss = torch.where(invalid, float("nan"), loss)
    hits = valid & ~invalid & (zt == m)
    stats = torch.stack([hits.sum(), invalid.sum()])
    return lse, loss, stats


def _grad_coefs(
    lse: Tensor, row_scale: Tensor, opts: LCEOptions, v_global: int
) -> tuple[Tensor, Tensor, Tensor]:
    """d loss / d z_v = a softmax_v + b [v = target] + c, per token:
    a = r (1 + 2 z_loss lse), b = -r (1 - ls), c = -r ls / V, r = d loss / d loss_tok."""
    a = row_scale * (1.0 + 2.0 * opts.z_loss * lse)
    b = -(1.0 - opts.label_smoothing) * row_scale
    c = -(opts.label_smoothing / v_global) * row_scale
    return a, b, c


def _no_grad_placeholder(ref: Tensor, dtype: torch.dtype | None = None) -> Tensor:
    # A gradient that was not asked for: an empty tensor keeps the op's output list fixed.
    return ref.new_empty((0,), dtype=dtype or ref.dtype)


def _grads_or_placeholders(
    gh: Tensor | None, gw: Tensor | None, hidden: Tensor, weight: Tensor
) -> tuple[Tensor, Tensor]:
    return (
        gh if gh is not None else _no_grad_placeholder(hidden),
        gw if gw is not None else _no_grad_placeholder(weight),
    )
