"""graphtrain::moe_route: the MoE router (token -> experts) from the router logits on, as one op.

What
    moe_route(logits [T, E], bias [E] or None, top_k, *, score_func="softmax", pre_softmax=True,
              num_groups=1, topk_groups=1, normalize=False, route_scale=1.0, group_score="top2",
              aux_seq_len=0, return_lse=False, count_plain=False)
        -> (weights [T, k] fp32, indices [T, k] int64, counts [E] int64, aux_sums [S, E] fp32,
            lse [T] fp32, plain_counts [S, E] fp32)
    is the router of the MoE spec (models/moe.py's Router writes it out), from `logits` on:
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
    Ties (in sel and in the group scores) go to the lower expert/group index, in the reference
    and in the kernels alike. `weights` is differentiable w.r.t. `logits`; indices, counts,
    plain_counts and the bias get no gradient; aux_sums and lse are differentiable too. normalize has no effect after
    the post-top-k softmax (those weights already sum to 1).
    group_score="max" is the group score of DeepSeek-V3's public inference Gate when it has no
    bias (it takes the top-2 sum only with a bias); the spec itself always uses the top-2 sum.
    moe_route_backward(grad_weights, grad_aux_sums or None, grad_lse or None, logits, indices,
    ...) -> grad_logits is the backward, an op of its own (a Triton kernel on CUDA).

Why
    The plain router is a dozen small ops over [T, E] (softmax, add, view, topk, topk, scatter,
    masked_fill, topk, gather, sum, div, mul, bincount), each a kernel launch and a pass over
    memory; under torch.compile still several kernels, with sort-based top-k. Here one kernel
    reads the logits once and writes weights, indices and counts (and what the aux losses and
    the z-loss need); the backward reads the logits once more and writes d logits.

Layers (one op per file, DESIGN.md rule 1)
    moe_route            torch.library.custom_op with register_fake and register_autograd;
                         CPU (and any device without a kernel): moe_route_ref; CUDA: Triton
    moe_route_backward   custom op; CPU: moe_route_backward_ref; CUDA: Triton
    RouteOptions         the options (top_k, score function, groups, scaling, aux flags, ...) as
                         one frozen dataclass: what the reference, the launchers, the fake and
                         the autograd wiring take, and what the op schemas are written from
                         (only the custom_op signature spells them out, as keyword arguments);
                         its check() (check_route_args on the op's arguments) is shared by the
                         kernels and the fake, so bad input fails at trace time with a
                         ValueError naming the bad value

CUDA algorithm
    forward: one program per block of BLOCK_T tokens; a block's logits are one
    [BLOCK_T, G_PAD, EPG_PAD] register tile: rows of EPG experts, the groups when there are
    groups (each padded to a power of two, so any E/G works), else about 8 rows of E/8 (a
    [BLOCK_T, 1, E] tile needed 1.8x the registers); at most 4096 padded experts, beyond that
    the reference runs. Scores, bias, group scores (top-2 by max, first argmax, max of the
    rest), the topk_groups best groups and the k best experts come from iterative max +
    lowest-index-among-the-max reductions, so the tie-break is the reference's. Weights are
    recomputed from a gathered load of the chosen logit (the same arithmetic as the tile's
    scores, so no extra reduction). Each program adds its tokens' histogram to `counts` with
    one int64 atomic add per expert (integer adds: deterministic). With aux_sums, a program's
    tokens all belong to one sequence (the grid is sequences x blocks of a sequence) and it
    writes its own partial sum of p per expert; torch adds the partials of each sequence (no
    float atomics: the sums are the same on every run). That costs the forward about 0.05-0.07
    ms at the benchmark shape (H100; the sum over a block's tokens reduces across warps), the
    sigmoid backward 0.05 ms (sigmoid over the whole row): benchmarks/RESULTS.md. With
    return_lse each program also writes m + log(sum exp(x - m)) of its rows (the softmax's own
    max and sum; two more reductions for sigmoid or the post-top-k softmax). With count_plain a
    program writes its tokens' histogram of the plain top-k as fp32 partials beside the aux
    sums' (a second k-step top-k over the unbiased scores where a bias or a group limit makes
    the dispatch differ; the dispatch's own histogram otherwise).
    On an H100 at 65536 x 256, top-8 it takes 0.18 ms, about 7x the memory floor: it is bound
    by the dependent reductions, not by memory or the atomics (one packed int64 key reduction
    per pick instead of two, or no atomics at all, measured the same).
    backward: one program per block of tokens over a [BLOCK_T, E_PAD] tile: d weights -> d of the
    selected scores (through route_scale, the normalisation or the post-top-k softmax) ->
    d logits (softmax: p * (dS - sum p dS) over all E; sigmoid: s (1 - s) at the k chosen
    experts; post-top-k softmax: dS itself). d aux_sums adds its sequence's row to d p of
    every token, taken back through the aux probabilities over the whole row; d lse adds
    d lse * softmax(logits) to the row. plain_counts, like counts, is a constant of the
    losses: it enters the gradient only through d aux_sums (the losses' autograd multiplies
    them), so the backward is the same whatever the losses count.

Numerics
    Everything is computed in fp32 from the logits (bf16/fp16 logits are upcast on load, like
    logits.float()); fp64 logits compute in fp64 (the reference path, used by the tests'
    gradcheck). The kernels' softmax sums in another order than torch's, so weights differ from
    the reference by a few ulps and a pair of scores within an ulp of each other may be ordered
    differently; exact ties are resolved identically. No host synchronisation: counts stay on the
    device, all shapes are static.
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass
from typing import Any

import torch
import triton
import triton.language as tl
from torch import Tensor

SCORE_FUNCS = ("softmax", "sigmoid")
GROUP_SCORES = ("top2", "max")
NORMALIZE_EPS = 1e-20  # the spec's guard in weights / (weights.sum() + eps)
_LOGIT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
# CUDA: the forward tile holds G_PAD * EPG_PAD padded experts per token in registers.
_MAX_PADDED_EXPERTS = 4096
# Padded experts x tokens per program and warps, from a sweep on an H100 (65536 tokens, 256
# experts, top-8, sigmoid with 8 groups): forward 0.18 ms at 2048 / 8 warps (0.21 at 4 warps,
# 0.29 when a program looped over 4-8 blocks to add fewer histograms: parallelism wins over
# atomics; 4096 / 4 warps the same). Backward, per score function (the sweep's best; a clone of
# the logits takes 0.050 ms): sigmoid 0.053 ms at 4096 / 2 warps (0.059 at 1024 / 2); softmax
# over all experts 0.067 ms at 512 / 1 warp (0.123 at 1024 / 2); softmax after the top-k was
# not swept and keeps 1024 / 2.
_FWD_TILE, _FWD_WARPS = 2048, 8
# Kernel codes of the score function.
_SOFTMAX_PRE, _SOFTMAX_POST, _SIGMOID = 0, 1, 2
_BWD_TILE_WARPS = {_SOFTMAX_PRE: (512, 1), _SOFTMAX_POST: (1024, 2), _SIGMOID: (4096, 2)}
# Backward tile elements per thread (per [BLOCK_T, E] tensor) at most where the swept tiles
# spill on sm_90 (ptxas -v of the sm_90a cubin; no GPU needed): the sigmoid's 64 with d
# aux_sums or d lse (x, the softmax, d aux and d scores live at once: 255 registers and 8-276 B
# of spills at moe-1b's 16384 x 64 and at 65536 x 256; 32 still spilled 4 B there) and rows
# of 2048 or more experts (64 spilled 228-1764 B there, even without them; 1024 did not). The
# tokens per program stay the sweep's; only the warps grow.
_BWD_MAX_ELEMS, _BWD_WIDE_ROW = 16, 2048


# --------------------------------------------------------------------------------------------
# argument checks (shared by the real kernels and the fake, so bad input fails at trace time)
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RouteOptions:
    """moe_route's options, one value for the reference, the kernels, the fake, the autograd
    wiring and the registration (whose schema is written from these fields and defaults).
    Built from the op's arguments with RouteOptions(top_k, **options)."""

    top_k: int
    score_func: str = "softmax"
    pre_softmax: bool = True
    num_groups: int = 1
    topk_groups: int = 1
    normalize: bool = False
    route_scale: float = 1.0
    group_score: str = "top2"
    aux_seq_len: int = 0
    return_lse: bool = False
    count_plain: bool = False

    @property
    def score_code(self) -> int:
        """The kernels' code of the score function."""
        if self.score_func == "sigmoid":
            return _SIGMOID
        return _SOFTMAX_PRE if self.pre_softmax else _SOFTMAX_POST

    def sequences(self, T: int) -> int:
        """Rows S of aux_sums for T tokens (0 without aux sums)."""
        return T // self.aux_seq_len if self.aux_seq_len else 0

    @property
    def group_limited(self) -> bool:
        """Whether the group limit drops experts (keeping every group masks nothing)."""
        return self.num_groups > 1 and self.topk_groups < self.num_groups

    def backward_options(self) -> dict[str, Any]:
        """The keyword arguments of moe_route_backward."""
        return {name: getattr(self, name) for name in _BACKWARD_OPTIONS}

    def check(self, logits: Tensor, bias: Tensor | None) -> None:
        """Raise ValueError naming the bad value when these options and tensors do not
        describe a router. normalize and return_lse take any value."""
        self._check_choices()
        if logits.dim() != 2:
            raise ValueError(f"moe_route: logits must be [T, E], got shape {tuple(logits.shape)}")
        if logits.dtype not in _LOGIT_DTYPES:
            raise ValueError(
                "moe_route: logits must be float32, bfloat16, float16 or float64, got "
                f"{logits.dtype}"
            )
        T, E = logits.shape
        self._check_groups(E)
        if bias is not None:
            bias_dtypes = (torch.float32, torch.float64) if logits.dtype == torch.float64 else ()
            if bias.dim() != 1 or bias.shape[0] != E:
                raise ValueError(
                    f"moe_route: bias must be [E]=[{E}], got shape {tuple(bias.shape)}"
                )
            if bias.dtype != torch.float32 and bias.dtype not in bias_dtypes:
                raise ValueError(f"moe_route: bias must be float32, got {bias.dtype}")
            if bias.device != logits.device:
                raise ValueError(f"moe_route: bias is on {bias.device}, logits on {logits.device}")
        if self.aux_seq_len < 0 or (self.aux_seq_len and T % self.aux_seq_len):
            raise ValueError(
                f"moe_route: aux_seq_len={self.aux_seq_len} must be 0 (no aux sums) or divide "
                f"the number of tokens T={T}"
            )
        if self.count_plain and not self.aux_seq_len:
            raise ValueError(
                "moe_route: count_plain=True needs aux_seq_len > 0 (plain_counts has a row per "
                "sequence of aux_seq_len tokens), got aux_seq_len=0"
            )

    def _check_choices(self) -> None:
        if self.score_func not in SCORE_FUNCS:
            raise ValueError(
                f"moe_route: score_func must be one of {SCORE_FUNCS}, got {self.score_func!r}"
            )
        if self.score_func == "sigmoid" and not self.pre_softmax:
            raise ValueError(
                "moe_route: pre_softmax=False (softmax after the top-k) needs "
                "score_func='softmax', got score_func='sigmoid'"
            )
        if self.group_score not in GROUP_SCORES:
            raise ValueError(
                f"moe_route: group_score must be one of {GROUP_SCORES}, got {self.group_score!r}"
            )
        if not math.isfinite(self.route_scale):
            raise ValueError(f"moe_route: route_scale must be finite, got {self.route_scale}")

    def _check_groups(self, E: int) -> None:
        G, kept = self.num_groups, self.topk_groups
        if G < 1 or E % G != 0:
            raise ValueError(
                f"moe_route: num_groups={G} must be >= 1 and divide the number of experts E={E}"
            )
        if not 1 <= kept <= G:
            raise ValueError(f"moe_route: topk_groups={kept} must be in [1, num_groups={G}]")
        available = kept * (E // G)
        if not 1 <= self.top_k <= available:
            raise ValueError(
                f"moe_route: top_k={self.top_k} must be in [1, {available}]: the experts in the "
                f"topk_groups={kept} kept groups of E/num_groups={E // G}"
            )


# The options the backward reads (its op's keyword arguments).
_BACKWARD_OPTIONS = ("score_func", "pre_softmax", "normalize", "route_scale", "aux_seq_len")


def check_route_args(logits: Tensor, bias: Tensor | None, top_k: int, **options: Any) -> None:
    """moe_route's argument checks (RouteOptions.check) on its own arguments: ValueError
    naming the bad value."""
    RouteOptions(top_k, **options).check(logits, bias)


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    # fp32 for fp32/bf16/fp16 logits (as logits.float()); fp64 stays fp64 (tests).
    return torch.float64 if dtype == torch.float64 else torch.float32


def _empty_outputs(logits: Tensor, o: RouteOptions) -> tuple[Tensor, ...]:
    """Uninitialised (weights, indices, counts, aux_sums, lse, plain_counts) of their shapes:
    the fake's outputs and the kernels' output buffers."""
    T, E = logits.shape
    dtype = _compute_dtype(logits.dtype)
    return (
        logits.new_empty((T, o.top_k), dtype=dtype),
        logits.new_empty((T, o.top_k), dtype=torch.int64),
        logits.new_empty((E,), dtype=torch.int64),
        logits.new_empty((o.sequences(T), E), dtype=dtype),
        logits.new_empty((T if o.return_lse else 0,), dtype=dtype),
        logits.new_empty((o.sequences(T) if o.count_plain else 0, E), dtype=dtype),
    )


# --------------------------------------------------------------------------------------------
# the pure-torch reference: CPU kernel and test oracle
# --------------------------------------------------------------------------------------------


def _scores(x: Tensor, code: int) -> Tensor:
    if code == _SIGMOID:
        return torch.sigmoid(x)
    if code == _SOFTMAX_PRE:
        return torch.softmax(x, dim=-1)
    return x


def _aux_probs(x: Tensor, scores: Tensor, code: int) -> Tensor:
    """The aux losses' probabilities p [T, E] (module docstring)."""
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
    """(weights, indices, counts, aux_sums, lse, plain_counts) of the router, in plain torch
    (module docstring)."""
    o = RouteOptions(top_k, **options)
    o.check(logits, bias)
    code = o.score_code
    x = logits.to(_compute_dtype(logits.dtype))
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
    x = logits.to(_compute_dtype(logits.dtype))
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


# --------------------------------------------------------------------------------------------
# Triton kernels (CUDA; run on CPU tensors under TRITON_INTERPRET=1 in the tests)
# --------------------------------------------------------------------------------------------


@triton.jit
def _moe_route_fwd_kernel(
    logits_ptr,  # [T, E] fp32/bf16/fp16, row stride stride_t, unit column stride
    bias_ptr,  # [E] fp32 (not read without HAS_BIAS)
    weights_ptr,  # [T, K] fp32 out
    indices_ptr,  # [T, K] int64 out
    counts_ptr,  # [E] int64, zeroed by the caller; every program adds its histogram
    aux_ptr,  # [programs, E] fp32 out: each program's sum of p (not written without AUX)
    lse_ptr,  # [T] fp32 out: logsumexp of the logits (not written without LSE)
    plain_ptr,  # [programs, E] fp32 out: each program's plain top-k histogram (PLAIN > 0)
    T,
    SEQ_LEN,  # tokens per sequence: a program's rows stay in one (T without AUX)
    BLOCKS_PER_SEQ,
    stride_t,
    route_scale,
    K: tl.constexpr,
    K_PAD: tl.constexpr,
    E: tl.constexpr,
    G: tl.constexpr,  # groups (1: no group limit)
    EPG: tl.constexpr,  # experts per tile row: E / G with groups
    G_PAD: tl.constexpr,  # tile rows, a power of 2
    EPG_PAD: tl.constexpr,  # tile columns, a power of 2 >= EPG
    TOPK_GROUPS: tl.constexpr,
    SCORE: tl.constexpr,  # 0 softmax before top-k, 1 softmax after top-k, 2 sigmoid
    HAS_BIAS: tl.constexpr,
    NORMALIZE: tl.constexpr,
    GROUP_MAX: tl.constexpr,  # group score = max instead of the top-2 sum
    AUX: tl.constexpr,  # write the partial sums of the aux probabilities
    LSE: tl.constexpr,  # write the logsumexp of each row
    PLAIN: tl.constexpr,  # plain top-k histogram: 0 none, 1 the dispatch's, 2 its own top-k
    BLOCK_T: tl.constexpr,
):
    # The experts as a [1, G_PAD, EPG_PAD] grid: row g, slot j is expert g * EPG + j.
    g = tl.arange(0, G_PAD)[None, :, None]
    j = tl.arange(0, EPG_PAD)[None, None, :]
    eid = g * EPG + j
    e_ok = (j < EPG) & (eid < E)
    # The same grid without the token axis, for the per-expert outputs.
    g2 = tl.arange(0, G_PAD)[:, None]
    j2 = tl.arange(0, EPG_PAD)[None, :]
    e2 = g2 * EPG + j2
    e2_ok = (j2 < EPG) & (e2 < E)
    if HAS_BIAS:
        bias = tl.load(bias_ptr + eid, mask=e_ok, other=0.0)
    kcol = tl.arange(0, K_PAD)[None, :]
    k_ok = kcol < K
    gcol = tl.arange(0, G_PAD)[None, :]
    pid = tl.program_id(0)
    if AUX:
        in_seq = (pid % BLOCKS_PER_SEQ) * BLOCK_T + tl.arange(0, BLOCK_T)
        rows = (pid // BLOCKS_PER_SEQ) * SEQ_LEN + in_seq
        row_ok = (in_seq < SEQ_LEN) & (rows < T)
    else:  # the plain grid (the general one cost 14% on the H100 for sigmoid with groups)
        rows = pid * BLOCK_T + tl.arange(0, BLOCK_T)
        row_ok = rows < T
    row_off = rows.to(tl.int64) * stride_t
    # Rows past T (or past their sequence) read zeros (finite arithmetic); nothing of theirs
    # is stored or counted.
    x = tl.load(
        logits_ptr + row_off[:, None, None] + eid,
        mask=row_ok[:, None, None] & e_ok,
        other=0.0,
    ).to(tl.float32)
    if SCORE == 0 or (SCORE == 1 and AUX) or LSE:
        m = tl.max(tl.max(tl.where(e_ok, x, float("-inf")), 2), 1)
        ex = tl.where(e_ok, tl.exp(x - m[:, None, None]), 0.0)
        s = tl.sum(tl.sum(ex, 2), 1)
        probs = ex / s[:, None, None]
    if LSE:
        tl.store(lse_ptr + rows, m + tl.log(s), mask=row_ok)
    if SCORE == 0:
        scores = probs
    elif SCORE == 2:
        scores = tl.sigmoid(x)
    else:
        scores = x
    if AUX:
        if SCORE == 2:
            s_ok = tl.where(e_ok, scores, 0.0)
            probs = s_ok / tl.sum(tl.sum(s_ok, 2), 1)[:, None, None]
        partial = tl.sum(tl.where(row_ok[:, None, None] & e_ok, probs, 0.0), 0)
        tl.store(aux_ptr + pid.to(tl.int64) * E + e2, partial, mask=e2_ok)
    if HAS_BIAS:
        sel = scores + bias
    else:
        sel = scores
    sel = tl.where(e_ok, sel, float("-inf"))

    if G > 1 and TOPK_GROUPS < G:
        top1 = tl.max(sel, 2)  # [BLOCK_T, G_PAD]
        if GROUP_MAX or EPG == 1:
            group_score = top1
        else:
            # Second best: the max without the first slot holding the best.
            first = tl.min(tl.where(sel == top1[:, :, None], j, EPG_PAD), 2)
            top2 = tl.max(tl.where(j == first[:, :, None], float("-inf"), sel), 2)
            group_score = top1 + top2
        g_avail = tl.broadcast_to(gcol < G, (BLOCK_T, G_PAD))
        keep = tl.broadcast_to(gcol < 0, (BLOCK_T, G_PAD))
        for _ in tl.static_range(TOPK_GROUPS):
            cand = tl.where(g_avail, group_score, float("-inf"))
            best = tl.max(cand, 1)
            pick = tl.min(tl.where(g_avail & (cand == best[:, None]), gcol, G_PAD), 1)
            hit = gcol == pick[:, None]
            keep = keep | hit
            g_avail = g_avail & (gcol != pick[:, None])
        sel = tl.where(keep[:, :, None], sel, float("-inf"))

    # Top-k by iterative max; among equal maxima the lowest expert id (the reference's
    # stable sort). `avail` (not a -inf marker) keeps a -inf sel choosable, as in the sort.
    avail = tl.broadcast_to(e_ok, (BLOCK_T, G_PAD, EPG_PAD))
    w = tl.zeros((BLOCK_T, K_PAD), dtype=tl.float32)
    idx = tl.zeros((BLOCK_T, K_PAD), dtype=tl.int32)
    for i in tl.static_range(K):
        cand = tl.where(avail, sel, float("-inf"))
        best = tl.max(tl.max(cand, 2), 1)
        is_best = avail & (cand == best[:, None, None])
        pick = tl.min(tl.min(tl.where(is_best, eid, E), 2), 1)
        avail = avail & (eid != pick[:, None, None])
        # The weight from the chosen logit itself: the tile's arithmetic, no reduction.
        logit = tl.load(logits_ptr + row_off + pick, mask=row_ok & (pick < E), other=0.0).to(
            tl.float32
        )
        if SCORE == 0:
            wi = tl.exp(logit - m) / s
        elif SCORE == 2:
            wi = tl.sigmoid(logit)
        else:
            wi = logit
        w = tl.where(kcol == i, wi[:, None], w)
        idx = tl.where(kcol == i, pick[:, None], idx)
    chosen = e_ok & ~avail & row_ok[:, None, None]
    hist = tl.sum(chosen.to(tl.int32), 0)  # [G_PAD, EPG_PAD]: this block's tokens per expert

    if SCORE == 1:
        wv = tl.where(k_ok, w, float("-inf"))
        we = tl.exp(wv - tl.max(wv, 1)[:, None])
        w = we / tl.sum(we, 1)[:, None]
    elif NORMALIZE:
        w = w / (tl.sum(tl.where(k_ok, w, 0.0), 1)[:, None] + 1e-20)
    w = w * route_scale
    out = rows.to(tl.int64)[:, None] * K + kcol
    out_ok = row_ok[:, None] & k_ok
    tl.store(weights_ptr + out, w, mask=out_ok)
    tl.store(indices_ptr + out, idx.to(tl.int64), mask=out_ok)

    tl.atomic_add(counts_ptr + e2, hist.to(tl.int64), mask=e2_ok)

    if PLAIN == 2:
        # The balance losses' top-k: the unbiased scores of every expert, same tie-break.
        plain_avail = tl.broadcast_to(e_ok, (BLOCK_T, G_PAD, EPG_PAD))
        plain_sel = tl.where(e_ok, scores, float("-inf"))
        for _ in tl.static_range(K):
            cand = tl.where(plain_avail, plain_sel, float("-inf"))
            best = tl.max(tl.max(cand, 2), 1)
            is_best = plain_avail & (cand == best[:, None, None])
            pick = tl.min(tl.min(tl.where(is_best, eid, E), 2), 1)
            plain_avail = plain_avail & (eid != pick[:, None, None])
        plain = e_ok & ~plain_avail & row_ok[:, None, None]
        plain_hist = tl.sum(plain.to(tl.float32), 0)
        tl.store(plain_ptr + pid.to(tl.int64) * E + e2, plain_hist, mask=e2_ok)
    elif PLAIN == 1:
        tl.store(plain_ptr + pid.to(tl.int64) * E + e2, hist.to(tl.float32), mask=e2_ok)


@triton.jit
def _moe_route_bwd_kernel(
    grad_w_ptr,  # [T, K] d weights, contiguous
    grad_aux_ptr,  # [T / SEQ_LEN, E] d aux_sums, contiguous (not read without AUX)
    grad_lse_ptr,  # [T] d lse (not read without LSE)
    logits_ptr,  # [T, E], row stride stride_t, unit column stride
    indices_ptr,  # [T, K] int64, contiguous
    dlogits_ptr,  # [T, E] out (logits' dtype), contiguous
    T,
    E,
    SEQ_LEN,
    stride_t,
    route_scale,
    K: tl.constexpr,
    K_PAD: tl.constexpr,
    SCORE: tl.constexpr,
    NORMALIZE: tl.constexpr,
    AUX: tl.constexpr,
    LSE: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_E: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    row_ok = rows < T
    rows64 = rows.to(tl.int64)
    row_off = rows64 * stride_t
    cols = tl.arange(0, BLOCK_E)[None, :]
    c_ok = cols < E
    kcol = tl.arange(0, K_PAD)[None, :]
    k_in = kcol < K
    k_ok = row_ok[:, None] & k_in
    idx = tl.load(indices_ptr + rows64[:, None] * K + kcol, mask=k_ok, other=0)
    g = tl.load(grad_w_ptr + rows64[:, None] * K + kcol, mask=k_ok, other=0.0).to(tl.float32)
    g = g * route_scale
    picked = tl.load(logits_ptr + row_off[:, None] + idx, mask=k_ok, other=0.0).to(tl.float32)
    if SCORE == 0 or AUX or LSE:
        x = tl.load(
            logits_ptr + row_off[:, None] + cols, mask=row_ok[:, None] & c_ok, other=0.0
        ).to(tl.float32)
    if SCORE == 0 or (SCORE == 1 and AUX) or LSE:
        xm = tl.where(c_ok, x, float("-inf"))
        m = tl.max(xm, 1)[:, None]
        ex = tl.exp(xm - m)
        s = tl.sum(ex, 1)[:, None]
        p = ex / s  # softmax over all experts
    if AUX:
        seq = (rows // SEQ_LEN).to(tl.int64)
        g_aux = tl.load(
            grad_aux_ptr + seq[:, None] * E + cols, mask=row_ok[:, None] & c_ok, other=0.0
        ).to(tl.float32)
    if SCORE == 0:
        picked = tl.exp(picked - m) / s
    elif SCORE == 2:
        picked = tl.sigmoid(picked)
    # d weights -> d of the picked scores.
    # (Rows past T hold zeros: finite arithmetic, nothing stored.)
    if SCORE == 1:
        wv = tl.where(k_in, picked, float("-inf"))
        we = tl.exp(wv - tl.max(wv, 1)[:, None])
        w = we / tl.sum(we, 1)[:, None]
        d = w * (g - tl.sum(g * w, 1)[:, None])
    elif NORMALIZE:
        denom = tl.sum(tl.where(k_in, picked, 0.0), 1)[:, None] + 1e-20
        d = (g - tl.sum(tl.where(k_in, g * picked, 0.0), 1)[:, None] / denom) / denom
    else:
        d = g
    d = tl.where(k_in, d, 0.0)
    if SCORE == 2:
        d = d * picked * (1.0 - picked)
    # Scatter into the row: the k chosen experts are distinct.
    d_scores = tl.zeros((BLOCK_T, BLOCK_E), dtype=tl.float32)
    for i in tl.static_range(K):
        at = kcol == i
        col_i = tl.sum(tl.where(at, idx, 0), 1)
        d_i = tl.sum(tl.where(at, d, 0.0), 1)
        d_scores += tl.where(cols == col_i[:, None], d_i[:, None], 0.0)
    if SCORE == 0 and AUX:
        # softmax backward: p * (dP - sum_e p dP), dP = dS + d aux probabilities (= p).
        d_scores += g_aux
        d_scores = p * (d_scores - tl.sum(p * d_scores, 1)[:, None])
    elif SCORE == 0:
        # The same with dP = dS: the sum only over the k picked experts.
        d_scores = p * (d_scores - tl.sum(d * picked, 1)[:, None])
    elif SCORE == 1 and AUX:
        # The aux probabilities are softmax(logits), apart from the scores (the logits).
        d_scores += p * (g_aux - tl.sum(p * g_aux, 1)[:, None])
    elif AUX:
        # Sigmoid: p = s / sum(s), taken back through s to the logits.
        sg = tl.where(c_ok, tl.sigmoid(x), 0.0)
        total = tl.sum(sg, 1)[:, None]
        d_s = (g_aux - tl.sum(g_aux * sg, 1)[:, None] / total) / total
        d_scores += d_s * sg * (1.0 - sg)
    if LSE:  # d logsumexp(x) / dx = softmax(x)
        g_lse = tl.load(grad_lse_ptr + rows64, mask=row_ok, other=0.0).to(tl.float32)
        d_scores += g_lse[:, None] * p
    tl.store(
        dlogits_ptr + rows64[:, None] * E + cols,
        d_scores.to(dlogits_ptr.dtype.element_ty),
        mask=row_ok[:, None] & c_ok,
    )


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _tile(E: int, num_groups: int) -> tuple[int, int, int]:
    """(G_PAD, EPG, EPG_PAD): rows, experts per row and padded columns of the forward tile."""
    if num_groups > 1:
        epg = E // num_groups
        return triton.next_power_of_2(num_groups), epg, triton.next_power_of_2(epg)
    cols = max(1, triton.next_power_of_2(E) // 8)
    return triton.next_power_of_2(triton.cdiv(E, cols)), cols, cols


def triton_supports(logits: Tensor, num_groups: int) -> bool:
    """Whether the Triton kernels take this router (else the reference runs, on any device)."""
    if logits.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return False
    g_pad, _, epg_pad = _tile(logits.shape[1], num_groups)
    return g_pad * epg_pad <= _MAX_PADDED_EXPERTS


def moe_route_triton(
    logits: Tensor,
    bias: Tensor | None,
    top_k: int,
    **options: Any,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """The CUDA forward (also CPU tensors under TRITON_INTERPRET=1)."""
    o = RouteOptions(top_k, **options)
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    T, E = logits.shape
    weights, indices, counts, aux_sums, lse, plain_counts = _empty_outputs(logits, o)
    counts.zero_()
    if T == 0:
        return weights, indices, counts, aux_sums.zero_(), lse, plain_counts.zero_()
    S = o.sequences(T)
    g_pad, epg, epg_pad = _tile(E, o.num_groups)
    seq_len = o.aux_seq_len or T  # the grid: sequences x blocks of one sequence
    block_t = max(1, min(_FWD_TILE // (g_pad * epg_pad), triton.next_power_of_2(seq_len)))
    blocks_per_seq = triton.cdiv(seq_len, block_t)
    grid = (T // seq_len) * blocks_per_seq
    partials = torch.empty(grid if S else 0, E, dtype=torch.float32, device=logits.device)
    plain = 0
    if o.count_plain:
        plain = 2 if bias is not None or o.group_limited else 1
    plain_partials = torch.empty(grid if plain else 0, E, dtype=torch.float32, device=logits.device)
    _moe_route_fwd_kernel[(grid,)](
        logits,
        bias if bias is not None else logits,  # a dummy pointer, never read
        weights,
        indices,
        counts,
        partials if S else weights,  # a dummy pointer, never written
        lse if o.return_lse else weights,  # a dummy pointer, never written
        plain_partials if plain else weights,  # a dummy pointer, never written
        T,
        seq_len,
        blocks_per_seq,
        logits.stride(0),
        float(o.route_scale),
        K=o.top_k,
        K_PAD=triton.next_power_of_2(o.top_k),
        E=E,
        G=o.num_groups,
        EPG=epg,
        G_PAD=g_pad,
        EPG_PAD=epg_pad,
        TOPK_GROUPS=o.topk_groups,
        SCORE=o.score_code,
        HAS_BIAS=bias is not None,
        NORMALIZE=o.normalize,
        GROUP_MAX=o.group_score == "max",
        AUX=S > 0,
        LSE=o.return_lse,
        PLAIN=plain,
        BLOCK_T=block_t,
        num_warps=_FWD_WARPS,
    )
    # No aux sums: the empty partials themselves (no extra op on the host path).
    aux_sums = partials.view(S, blocks_per_seq, E).sum(1) if S else partials
    if plain:  # whole counts below 2**24: the fp32 sums are exact in any order
        plain_counts = plain_partials.view(S, blocks_per_seq, E).sum(1)
    return weights, indices, counts, aux_sums, lse, plain_counts


def _bwd_config(code: int, T: int, E: int, *, extras: bool) -> tuple[int, int, int]:
    """(BLOCK_T, BLOCK_E, num_warps) of the backward for score code `code`, T tokens and E
    experts; extras: d aux_sums or d lse are taken too (more of the tile live at once)."""
    block_e = triton.next_power_of_2(E)
    tile, warps = _BWD_TILE_WARPS[code]
    block_t = max(1, min(tile // block_e, triton.next_power_of_2(T)))
    elems = tile // (32 * warps)  # per thread and tile tensor, as swept
    if extras or block_e >= _BWD_WIDE_ROW:
        elems = min(elems, _BWD_MAX_ELEMS)
    # More warps, not more registers per thread, where a thread would hold more than `elems`.
    warps = min(16, max(warps, block_t * block_e // (32 * elems)))
    return block_t, block_e, warps


def moe_route_backward_triton(
    grad_weights: Tensor,
    grad_aux_sums: Tensor | None,
    grad_lse: Tensor | None,
    logits: Tensor,
    indices: Tensor,
    **options: Any,
) -> Tensor:
    """The CUDA backward (also CPU tensors under TRITON_INTERPRET=1)."""
    o = RouteOptions(indices.shape[1], **options)
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    T, E = logits.shape
    grad_logits = torch.empty(T, E, dtype=logits.dtype, device=logits.device)
    if T == 0:
        return grad_logits
    K = indices.shape[1]
    code = o.score_code
    aux = grad_aux_sums is not None and o.aux_seq_len > 0
    block_t, block_e, warps = _bwd_config(code, T, E, extras=aux or grad_lse is not None)
    _moe_route_bwd_kernel[(triton.cdiv(T, block_t),)](
        # Autograd may hand over expanded (stride 0) gradients.
        grad_weights.contiguous(),
        grad_aux_sums.contiguous() if aux else grad_weights,  # a dummy pointer without aux
        grad_lse.contiguous() if grad_lse is not None else grad_weights,  # the same
        logits,
        indices.contiguous(),
        grad_logits,
        T,
        E,
        o.aux_seq_len or T,
        logits.stride(0),
        float(o.route_scale),
        K=K,
        K_PAD=triton.next_power_of_2(K),
        SCORE=code,
        NORMALIZE=o.normalize,
        AUX=aux,
        LSE=grad_lse is not None,
        BLOCK_T=block_t,
        BLOCK_E=block_e,
        num_warps=warps,
    )
    return grad_logits


# --------------------------------------------------------------------------------------------
# op registration
# --------------------------------------------------------------------------------------------


def _schema_options(names: tuple[str, ...], *, defaults: bool) -> str:
    """The schema's keyword arguments for these RouteOptions fields (with their defaults)."""
    fields = {f.name: f for f in dataclasses.fields(RouteOptions)}
    out = []
    for name in names:
        f = fields[name]
        default = ""
        if defaults:
            default = f'="{f.default}"' if isinstance(f.default, str) else f"={f.default!r}"
        out.append(f"{f.type} {name}{default}")
    return ", ".join(out)


_OPTION_NAMES = tuple(f.name for f in dataclasses.fields(RouteOptions))[1:]  # after top_k


@torch.library.custom_op(
    "graphtrain::moe_route",
    mutates_args=(),
    schema=(
        "(Tensor logits, Tensor? bias, int top_k, *, "
        f"{_schema_options(_OPTION_NAMES, defaults=True)}) "
        "-> (Tensor weights, Tensor indices, Tensor counts, Tensor aux_sums, Tensor lse, "
        "Tensor plain_counts)"
    ),
)
def moe_route(
    logits: Tensor, bias: Tensor | None, top_k: int, **options: Any
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(weights [T, k] fp32, indices [T, k] int64, counts [E] int64, aux_sums [S, E] fp32,
    lse [T] or [0] fp32, plain_counts [S, E] or [0, E] fp32) of the MoE router; options:
    RouteOptions' fields.

    This body is the CPU (and any non-CUDA) kernel: the torch reference.
    """
    return moe_route_ref(logits, bias, top_k, **options)


@moe_route.register_fake
def _moe_route_fake(logits, bias, top_k, **options):
    o = RouteOptions(top_k, **options)
    o.check(logits, bias)
    return _empty_outputs(logits, o)


@moe_route.register_kernel("cuda")
def _moe_route_cuda(logits, bias, top_k, **options):
    o = RouteOptions(top_k, **options)
    o.check(logits, bias)
    supported = triton_supports(logits, o.num_groups)
    return (moe_route_triton if supported else moe_route_ref)(logits, bias, top_k, **options)


@torch.library.custom_op(
    "graphtrain::moe_route_backward",
    mutates_args=(),
    schema=(
        "(Tensor grad_weights, Tensor? grad_aux_sums, Tensor? grad_lse, Tensor logits, "
        f"Tensor indices, *, {_schema_options(_BACKWARD_OPTIONS, defaults=False)}) -> Tensor"
    ),
)
def moe_route_backward(
    grad_weights: Tensor,
    grad_aux_sums: Tensor | None,
    grad_lse: Tensor | None,
    logits: Tensor,
    indices: Tensor,
    **options: Any,
) -> Tensor:
    """d logits of moe_route for d weights, d aux_sums and d lse (options: RouteOptions'
    backward_options). This body is the CPU kernel: the torch reference."""
    return moe_route_backward_ref(grad_weights, grad_aux_sums, grad_lse, logits, indices, **options)


@moe_route_backward.register_fake
def _moe_route_backward_fake(grad_weights, grad_aux_sums, grad_lse, logits, indices, **options):
    return torch.empty_like(logits)


@moe_route_backward.register_kernel("cuda")
def _moe_route_backward_cuda(grad_weights, grad_aux_sums, grad_lse, logits, indices, **options):
    grads = (grad_weights, grad_aux_sums, grad_lse, logits, indices)
    if logits.dtype == torch.float64 or logits.shape[1] > _MAX_PADDED_EXPERTS:
        return moe_route_backward_ref(*grads, **options)
    return moe_route_backward_triton(*grads, **options)


def _setup_context(
    ctx: Any, inputs: tuple, keyword_only_inputs: dict[str, Any], output: tuple
) -> None:
    logits, _bias, top_k = inputs
    _weights, indices, counts, _aux_sums, _lse, plain_counts = output
    ctx.mark_non_differentiable(indices, counts, plain_counts)
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(logits, indices)
    ctx.options = RouteOptions(top_k, **keyword_only_inputs)


def _backward(
    ctx: Any,
    grad_weights: Tensor | None,
    _grad_indices: Tensor | None,
    _grad_counts: Tensor | None,
    grad_aux_sums: Tensor | None,
    grad_lse: Tensor | None,
    _grad_plain_counts: Tensor | None,
) -> tuple:
    if not ctx.options.return_lse:  # the empty lse: nothing flows from it
        grad_lse = None
    if (grad_weights is None and grad_aux_sums is None and grad_lse is None) or not (
        ctx.needs_input_grad[0]
    ):
        return None, None, None
    logits, indices = ctx.saved_tensors
    if grad_weights is None:
        grad_weights = indices.new_zeros(indices.shape, dtype=_compute_dtype(logits.dtype))
    grad_logits = torch.ops.graphtrain.moe_route_backward(
        grad_weights, grad_aux_sums, grad_lse, logits, indices, **ctx.options.backward_options()
    )
    return grad_logits, None, None


moe_route.register_autograd(_backward, setup_context=_setup_context)
