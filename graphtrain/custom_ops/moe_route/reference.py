"""moe_route: the pure-torch reference, the CPU kernel and the tests' oracle.

What
    moe_route_ref(logits, bias, top_k, **options)   the router, step by step in its docstring:
        (weights, indices, counts, aux_sums, lse, plain_counts)
    moe_route_backward_ref(grad_weights, grad_aux_sums, grad_lse, logits, indices, **options)
        d logits

Numerics
    fp32 from the logits (fp64 for fp64 logits: the tests' gradcheck); ties go to the lower
    index (a stable sort), as in the kernels.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from graphtrain.custom_ops.moe_route.options import (
    _SIGMOID,
    _SOFTMAX_POST,
    _SOFTMAX_PRE,
    NORMALIZE_EPS,
    RouteOptions,
)
from graphtrain.custom_ops.utils import compute_dtype


def _scores(x: Tensor, code: int) -> Tensor:
    if code == _SIGMOID:
        return torch.sigmoid(x)
    if code == _SOFTMAX_PRE:
        return torch.softmax(x, dim=-1)
    return x


def _aux_probs(x: Tensor, scores: Tensor, code: int) -> Tensor:
    """The aux losses' probabilities p [T, E] (moe_route_ref's aux_sums)."""
    if code == _SIGMOID:
        return scores / scores.sum(dim=-1, keepdim=True)
    return scores if code == _SOFTMAX_PRE else torch.softmax(x, dim=-1)


def _top_indices(values: Tensor, k: int) -> Tensor:
    """The k largest per row, descending; a stable sort puts equal values in index order."""
    return torch.sort(values, dim=-1, descending=True, stable=True).indices[:, :k].contiguous()


def moe_route_ref(
    logits: Tensor,
    bias: Tensor | None,
    top_k: int,
    **options: Any,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(weights, indices, counts, aux_sums, lse, plain_counts) of the router, in plain torch,
    from `logits` on:
    scores   softmax(logits)          score_func "softmax", pre_softmax=True
             logits                   score_func "softmax", pre_softmax=False (softmax later)
             sigmoid(logits)          score_func "sigmoid"
    sel      scores + bias            (bias: the aux-loss-free expert bias; selection only)
    groups   num_groups G > 1: G runs of E/G consecutive experts; group score = sum of the
             top-2 sel values of the group (the max when E/G == 1, or with group_score="max");
             the topk_groups best groups are kept, the other experts' sel -> -inf
    indices  top-k of sel per token, in descending order of sel
    weights  scores.gather(1, indices) (never biased); then softmax over the k
             (pre_softmax=False) or, if normalize, / (sum + 1e-20); then * route_scale
    counts   tokens per expert (a bincount of indices)
    aux_sums what the load-balancing losses need: with aux_seq_len = L > 0 (dividing T),
             aux_sums[s, e] = sum over the L tokens of sequence s of p[t, e], the
             probabilities of the aux losses: softmax(logits) (score_func "softmax", before
             or after the top-k) or scores / scores.sum(-1) (sigmoid, DeepSeek-V3's
             normalised form). The aux and global_aux losses use aux_sums.sum(0), seq_aux
             the rows. aux_seq_len=0: S = 0, nothing computed.
    lse      return_lse=True: logsumexp(logits, -1) per token, what the router z-loss
             (mean of lse^2) needs; else an empty [0] tensor, nothing computed.
    plain_counts  count_plain=True (needs aux_seq_len > 0): plain_counts[s, e] = tokens of
             sequence s with e among the top-k of their scores, no bias and no group
             limit: what DeepSeek-V3's and Megatron-Core's balance losses count (f_i); else
             an empty [0, E] tensor. Without bias and group limit it is the dispatch.
    normalize has no effect after the post-top-k softmax (those weights already sum to 1).
    group_score="max" is the group score of DeepSeek-V3's public inference Gate when it
    has no bias (it takes the top-2 sum only with a bias); the spec always uses the top-2
    sum.
    """
    o = RouteOptions(top_k, **options)
    o.check(logits, bias)
    code = o.score_code
    x = logits.to(compute_dtype(logits.dtype))
    T, E = x.shape
    scores = _scores(x, code)
    sel = scores if bias is None else scores + bias.to(x.dtype)
    if o.group_limited:
        grouped = sel.view(T, o.num_groups, E // o.num_groups)
        if o.group_score == "max" or grouped.shape[-1] == 1:
            group_scores = grouped.amax(dim=-1)
        else:
            group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)
        kept = _top_indices(group_scores, o.topk_groups)
        dropped = torch.ones(T, o.num_groups, dtype=torch.bool, device=x.device).scatter(
            1, kept, False
        )
        sel = grouped.masked_fill(dropped.unsqueeze(-1), float("-inf")).view(T, E)
    indices = _top_indices(sel, o.top_k)
    weights = scores.gather(1, indices)
    if code == _SOFTMAX_POST:
        weights = torch.softmax(weights, dim=-1)
    elif o.normalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + NORMALIZE_EPS)
    weights = weights * o.route_scale
    flat = indices.flatten()
    # scatter_add, not bincount: bincount sizes its output from the data (a host sync on CUDA).
    counts = torch.zeros(E, dtype=torch.int64, device=x.device).scatter_add_(
        0, flat, torch.ones_like(flat)
    )
    S = o.sequences(T)
    aux_sums = x.new_zeros(S, E)
    if S:
        aux_sums = _aux_probs(x, scores, code).view(S, o.aux_seq_len, E).sum(1)
    lse = torch.logsumexp(x, dim=-1) if o.return_lse else x.new_zeros(0)
    plain_counts = x.new_zeros(0, E)
    if o.count_plain and S:
        plain = indices if bias is None and not o.group_limited else _top_indices(scores, o.top_k)
        hits = torch.zeros_like(x).scatter(1, plain, 1.0)
        plain_counts = hits.view(S, o.aux_seq_len, E).sum(1)
    return weights, indices, counts, aux_sums, lse, plain_counts


def moe_route_backward_ref(
    grad_weights: Tensor,
    grad_aux_sums: Tensor | None,
    grad_lse: Tensor | None,
    logits: Tensor,
    indices: Tensor,
    **options: Any,
) -> Tensor:
    """d logits for d weights, d aux_sums and d lse, in plain torch (indices: the forward's,
    distinct per row)."""
    o = RouteOptions(indices.shape[1], **options)
    code = o.score_code
    x = logits.to(compute_dtype(logits.dtype))
    scores = _scores(x, code)
    picked = scores.gather(1, indices)
    g = grad_weights.to(x.dtype) * o.route_scale
    if code == _SOFTMAX_POST:
        w = torch.softmax(picked, dim=-1)
        d_picked = w * (g - (g * w).sum(dim=-1, keepdim=True))
    elif o.normalize:
        denom = picked.sum(dim=-1, keepdim=True) + NORMALIZE_EPS
        d_picked = (g - (g * picked).sum(dim=-1, keepdim=True) / denom) / denom
    else:
        d_picked = g
    d_scores = torch.zeros_like(scores).scatter_add_(1, indices, d_picked)
    d_p = None  # d aux probabilities, [T, E]
    if grad_aux_sums is not None and o.aux_seq_len:
        d_p = grad_aux_sums.to(x.dtype).repeat_interleave(o.aux_seq_len, dim=0)
        if code == _SOFTMAX_PRE:  # p is the scores
            d_scores = d_scores + d_p
        elif code == _SIGMOID:  # p = s / sum(s)
            total = scores.sum(dim=-1, keepdim=True)
            d_scores = d_scores + (d_p - (d_p * scores).sum(dim=-1, keepdim=True) / total) / total
    if code == _SOFTMAX_PRE:
        d_x = scores * (d_scores - (d_scores * scores).sum(dim=-1, keepdim=True))
    elif code == _SIGMOID:
        d_x = d_scores * scores * (1.0 - scores)
    else:
        d_x = d_scores
        if d_p is not None:  # p = softmax(logits), apart from the scores
            p = torch.softmax(x, dim=-1)
            d_x = d_x + p * (d_p - (d_p * p).sum(dim=-1, keepdim=True))
    if grad_lse is not None:  # d logsumexp(x) / dx = softmax(x)
        d_x = d_x + grad_lse.to(x.dtype)[:, None] * torch.softmax(x, dim=-1)
    return d_x.to(logits.dtype)
