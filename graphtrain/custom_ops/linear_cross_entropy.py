"""graphtrain::linear_cross_entropy: the output head and the cross-entropy loss as one op.

What
    linear_cross_entropy(hidden [N, H], weight [V, H], target [N] int64, *, ignore_index=-100,
                         label_smoothing=0.0, z_loss=0.0, reduction="mean",
                         mode="low_memory", fp32_accumulator=True, token_chunk=0) -> loss
    means F.cross_entropy(F.linear(hidden, weight).float(), target, ignore_index=...,
    label_smoothing=..., reduction=...) plus z_loss * logsumexp(logits)**2 per token, reduced like
    the loss. "mean" divides by the number of non-ignored tokens (clamped to >= 1, so an
    all-ignored batch gives loss 0 and zero gradients, never NaN); "none" gives one value per
    token, 0 where the target is ignored.
    A target outside [0, V) that is not ignore_index makes the loss NaN (its token's value under
    "none"), so the trainer's non-finite check stops the run at that step instead of training on
    a silently wrong loss; the gradients stay finite (such a token has no target column).
    weight may be fp32 with 16-bit hidden (fp32 master weights under autocast): the logits are
    computed in hidden's dtype from weight cast to it, as autocast's F.linear does, and
    grad_weight comes back fp32.
    linear_cross_entropy_vocab_parallel(..., group_name) is the same with `weight` the local
    vocab shard of a tensor-parallel group (rank r holds rows [r * V_local, (r + 1) * V_local),
    even shards) and global target ids; the per-token max, sum-exp, target logit and logit sum
    are combined over the group with functional collectives, and grad_hidden is all-reduced
    (summed), so every rank gets the full gradient of its replicated hidden.
    linear_cross_entropy_with_stats(..., group_name=None) returns (loss, stats) with stats an
    int64 [2] tensor: [0] the number of counted tokens (target not ignored, inside [0, V)) whose
    target logit equals the row maximum (top-1 acceptance; a tie for the maximum counts as a
    hit, where argmax would pick the first of the tied classes), [1] the number of targets
    outside [0, V) that are not ignore_index. Computed from the op's own row statistics (the
    logits are never materialised), on the device (no host sync), not differentiable.

Why
    The logits of an LLM head are the biggest tensor of the step (8192 tokens x 128256 vocab is
    2 GiB in bf16, 4 GiB in fp32, and eager keeps several of them). This op never holds [N, V]
    in low-memory mode and at most [token chunk, V] in fast mode, and it computes both gradients
    during the forward, so the backward only scales them by grad_output.

Layers (one op per file, DESIGN.md rule 1)
    LCEOptions                                   the options as one frozen, validated dataclass;
        only the torch.library signatures spell them out (they take no dataclass)
    linear_cross_entropy, ..._vocab_parallel, ..._with_stats   public ops,
        CompositeImplicitAutograd: they decide which gradients are needed (grad mode,
        requires_grad) and call
    linear_cross_entropy_forward                torch.library.custom_op with register_fake and
        register_autograd; returns (loss, lse, grad_hidden, grad_weight, stats); CUDA: Triton
        kernels plus cuBLAS GEMMs; CPU and everything else: linear_cross_entropy_ref
    linear_cross_entropy_backward               custom op for reduction="none": there the
        per-token grad_output is only known in the backward, and grad_weight mixes tokens, so it
        cannot be a scaled copy of a forward result; this op recomputes in chunks instead.
    The per-token maths (combining the row statistics over the tp group, the loss, the top-1 and
    invalid-target counts, the coefficients of the logits' gradient) are torch helpers that the
    reference and both CUDA modes share (_global_stats, _token_terms, _grad_coefs).

CUDA, mode="low_memory" (four GEMMs; two sweeps over vocab chunks, each chunk's logits made by
one cuBLAS GEMM)
    sweep A, chunk c:  L = hidden @ W_c^T                         GEMM 1  [N, Vc] in the input dtype
                       _lce_stats_kernel: online max / sum-exp / target logit / logit sum per
                       token, and P = exp(L - m_running) written over L (the target column 0)
                       _lce_dh_kernel: acc = acc * exp(m_old - m_new) + P @ W_c   GEMM 2  fp32
                       (the flash-attention trick with W as both keys and values)
               then    grad_hidden = a / s acc + (a p_t + b) W_t + c sum_v W_v
                                                                (_lce_dh_finalize_kernel)
    sweep B, chunk c:  L = hidden @ W_c^T (again)                 GEMM 3
                       _lce_grad_kernel: G = a softmax + b onehot + c
                       grad_weight[c] = G^T @ hidden                GEMM 4, full N reduction
    with per token a = r (1 + 2 z lse), b = -r (1 - ls), c = -r ls / V (r = d loss / d loss_tok).
    Four GEMMs where the plain code has three: the price of fp32 accumulation without a
    [V, H] fp32 buffer (2 GiB at V=128256, H=4096) or a [N, V] one. Sweep A finishes grad_hidden
    and frees its fp32 accumulator before sweep B allocates grad_weight, so the peak is
    grad_weight + grad_hidden + one chunk (about 1.07 GiB at 8192 x 4096 x 128256, bf16).

CUDA, mode="fast" (three GEMMs; token chunks of T rows, 2048-4096 on a GPU)
    chunk k:  L = hidden_k @ W^T                                  GEMM 1  [T, V] in the input dtype
              _lce_stats_kernel over the row in 8192-column pieces: max, sum-exp, target
              logit, logit sum; then (tp: combined over the group) lse, loss, counts
              _lce_grad_kernel: G = a softmax + b onehot + c, written over L in place
              grad_hidden_k = G @ W                               GEMM 2
              grad_weight += G^T @ hidden_k                       GEMM 3, accumulated over chunks
    grad_weight's accumulation:
      fp32 weight (fp32 master weights under autocast, graphtrain's default; or fp32 inputs):
          in fp32, straight into the fp32 [V, H] tensor that becomes the parameter's gradient,
          which it gets anyway (_lce_dh_kernel, fp32 accumulator loaded and stored per chunk;
          plain addmm_ for fp32 inputs). Exact like low-memory mode, at no extra memory.
      16-bit weight, fp32_accumulator=True: an fp32 [V, H] buffer (2 GiB at 128256 x 4096),
          cast once at the end; the pass picks this only when its memory budget allows.
      16-bit weight, fp32_accumulator=False: in the weight's dtype, addmm_ per chunk (fp32
          inside each GEMM, one rounding per chunk) over at most four chunks (T >= N / 4).
          Measured on CPU against float64 (N=4096, H=64, V=512, four chunks, 3 seeds): the
          relative RMS error of grad_weight is 3.9e-3, beside 3.4-3.5e-3 for the plain torch
          computation in bf16 (F.cross_entropy(F.linear(h, W).float(), t), whose grad_weight
          GEMM rounds once) and 3.4e-3 with the fp32 accumulator: 1.12x plain torch's own
          error (tests/custom_ops/test_linear_cross_entropy.py bounds it by 1.3x).
    Tensor parallel: the statistics are combined over the group per chunk (as in low-memory
    mode); grad_hidden's partial products G_k @ W_shard are rounded to the input dtype by the
    GEMM, then summed over the group in fp32 (one more rounding than low-memory mode's fp32
    accumulator; grad_weight is per shard and needs no collective).
    Extra memory over the two gradients: the [T, V] logits chunk (0.5 GiB at 2048 x 128256 in
    bf16), plus the fp32 buffer where one is used (fast_mode_extra_bytes gives the figure the
    pass compares with its budget).

Numerics
    Logits are rounded to the input dtype by the GEMM, exactly as F.linear(...).float() does;
    everything after is fp32: softmax statistics, the gradient coefficients, grad_hidden's
    accumulation, grad_weight's (except where stated above), the grad_output scaling. The
    softmax probabilities and G enter the GEMMs in the input dtype, as the reference's dlogits
    do. Low-memory mode leaves the target column out of P and adds it exactly in fp32
    (coefficient a p_t + b): rounding p_t to bf16 before subtracting 1 would lose the small
    gradients of confident tokens; fast mode rounds G (target column included) to the input
    dtype as the plain backward's bf16 dlogits do. fp64 inputs compute in fp64 (the reference).

No host synchronisation: the "mean" count and the statistics stay on the device, all loops are
over static shapes. The first CUDA call per shape autotunes _lce_dh_kernel (it benchmarks, so
warm up before capturing a CUDA graph).
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch import Tensor
from torch.utils._python_dispatch import _get_current_dispatch_mode

REDUCTIONS = ("mean", "sum", "none")
MODES = ("low_memory", "fast")

# CPU reference: logits elements per token chunk (16 MiB of fp32 logits).
_REF_CHUNK_ELEMENTS = 1 << 22
# CUDA low-memory mode: bytes of the logits chunk buffer in sweep A (no grad_weight allocated
# yet, so it can be large: fewer rescales of the fp32 accumulator) and in sweep B (lives next
# to grad_weight, so it is what the peak memory pays on top of the two gradients).
_SWEEP_A_BUFFER_BYTES = 256 << 20
_SWEEP_B_BUFFER_BYTES = 32 << 20
_MAX_VOCAB_CHUNK = 8192  # one row of a chunk is held in registers by the per-row kernels
# CUDA fast mode: the [T, V] logits buffer's bytes, and T's range (below 2048 rows the GEMMs
# lose speed; above 4096 the buffer grows without a gain).
_FAST_BUFFER_BYTES = 512 << 20
_FAST_MIN_ROWS, _FAST_MAX_ROWS = 2048, 4096
_MAX_INPUT_DTYPE_CHUNKS = 4  # 16-bit grad_weight accumulation: at most four roundings


# --------------------------------------------------------------------------------------------
# options and argument checks (shared by the real kernels and the fake, so bad input fails at
# trace time)
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class LCEOptions:
    """Everything but the tensors. The custom ops take these as flat arguments (a torch.library
    schema takes no dataclass): `forward_args` / `from_forward_args` convert, in one place."""

    ignore_index: int = -100
    label_smoothing: float = 0.0
    z_loss: float = 0.0
    reduction: str = "mean"
    group_name: str | None = None  # tensor-parallel group of a vocab-sharded weight
    compute_grad_hidden: bool = True
    compute_grad_weight: bool = True
    mode: str = "low_memory"  # "low_memory" (four GEMMs) or "fast" (three GEMMs)
    fp32_accumulator: bool = True  # fast mode, 16-bit weight: fp32 [V, H] grad_weight buffer
    token_chunk: int = 0  # fast mode and CPU: rows per token chunk; 0 = chosen from the shape

    def __post_init__(self) -> None:
        if self.reduction not in REDUCTIONS:
            raise ValueError(
                f"linear_cross_entropy: reduction must be one of {REDUCTIONS}, "
                f"got {self.reduction!r}"
            )
        if not 0.0 <= self.label_smoothing <= 1.0:
            raise ValueError(
                "linear_cross_entropy: label_smoothing must be in [0, 1], "
                f"got {self.label_smoothing}"
            )
        if self.z_loss < 0.0:
            raise ValueError(f"linear_cross_entropy: z_loss must be >= 0, got {self.z_loss}")
        if self.mode not in MODES:
            raise ValueError(
                f"linear_cross_entropy: mode must be one of {MODES}, got {self.mode!r}"
            )
        if self.token_chunk < 0:
            raise ValueError(
                f"linear_cross_entropy: token_chunk must be >= 0 (0 = automatic), "
                f"got {self.token_chunk}"
            )

    def forward_args(self) -> tuple:
        """The flat option arguments of linear_cross_entropy_forward, in schema order."""
        return tuple(getattr(self, f.name) for f in dataclasses.fields(self))

    @classmethod
    def from_forward_args(cls, *args: Any) -> LCEOptions:
        return cls(*args)

    def backward_args(self) -> tuple:
        """The flat option arguments of linear_cross_entropy_backward (no reduction: "none")."""
        return tuple(
            getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "reduction"
        )

    @classmethod
    def from_backward_args(cls, ignore_index: int, *rest: Any) -> LCEOptions:
        return cls(ignore_index, rest[0], rest[1], "none", *rest[2:])


def _check_args(hidden: Tensor, weight: Tensor, target: Tensor) -> None:
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
    master = weight.dtype == torch.float32 and hidden.dtype in (torch.bfloat16, torch.float16)
    if not hidden.dtype.is_floating_point or (hidden.dtype != weight.dtype and not master):
        raise ValueError(
            "linear_cross_entropy: hidden and weight must share one floating dtype (or weight "
            f"fp32 with bf16/fp16 hidden: master weights); got {hidden.dtype} and {weight.dtype}"
        )
    if target.dtype != torch.int64:
        raise ValueError(
            f"linear_cross_entropy: target must be int64 class ids, got {target.dtype}"
        )


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    # At least fp32, as F.cross_entropy(logits.float()); fp64 stays fp64 (tests).
    return torch.float64 if dtype == torch.float64 else torch.float32


def _input_dtype_accumulation(hidden: Tensor, weight: Tensor, opts: LCEOptions) -> bool:
    """Fast mode accumulates grad_weight in a 16-bit weight's own dtype (<= 4 roundings)."""
    return (
        opts.mode == "fast"
        and not opts.fp32_accumulator
        and weight.dtype in (torch.bfloat16, torch.float16)
    )


def _at_most_four_chunks(rows: int, N: int) -> int:
    """Rows per chunk for fast mode's 16-bit grad_weight accumulation: at most four roundings."""
    return max(rows, math.ceil(N / _MAX_INPUT_DTYPE_CHUNKS))


def _fast_token_chunk(N: int, V: int, elem_size: int, input_dtype_accumulation: bool) -> int:
    """Fast mode's rows per token chunk on a GPU: the logits buffer within _FAST_BUFFER_BYTES,
    clamped to [2048, 4096] rows, and at least N / 4 rows for 16-bit accumulation."""
    rows = _FAST_BUFFER_BYTES // max(1, V * elem_size)
    rows = max(_FAST_MIN_ROWS, min(_FAST_MAX_ROWS, rows))
    if input_dtype_accumulation:
        rows = _at_most_four_chunks(rows, N)
    return min(rows, max(N, 1))


def fast_mode_extra_bytes(
    N: int,
    H: int,
    V: int,
    input_dtype: torch.dtype,
    weight_dtype: torch.dtype,
    fp32_accumulator: bool,
) -> int:
    """Bytes fast mode holds beyond what low-memory mode does (CUDA): its [T, V] logits chunk,
    and an fp32 [V, H] grad_weight buffer for a 16-bit weight with fp32_accumulator. (An fp32
    weight's fp32 accumulator is the gradient the parameter gets anyway: not extra.)"""
    elem = torch.empty((), dtype=input_dtype).element_size()
    sixteen = weight_dtype in (torch.bfloat16, torch.float16)
    rows = _fast_token_chunk(N, V, elem, sixteen and not fp32_accumulator)
    extra = rows * V * elem
    if sixteen and fp32_accumulator:
        extra += V * H * 4
    return extra


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


# --------------------------------------------------------------------------------------------
# the per-token maths, written once: the reference and both CUDA modes call these
# --------------------------------------------------------------------------------------------


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


# --------------------------------------------------------------------------------------------
# the pure-torch reference: CPU kernel and test oracle
# --------------------------------------------------------------------------------------------


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


# --------------------------------------------------------------------------------------------
# Triton kernels (CUDA; run on CPU tensors under TRITON_INTERPRET=1 in the tests)
# --------------------------------------------------------------------------------------------


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
    args = (p, w, acc, alpha, M, n_out, p.stride(0), p.stride(1), w.stride(0), acc.stride(0))
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


def _lce_triton_low_memory(
    hidden: Tensor,
    weight: Tensor,
    target: Tensor,
    opts: LCEOptions,
    row_scale: Tensor | None,
    lse_in: Tensor | None,
    vocab_chunk: int | None,
) -> tuple[Tensor, Tensor, Tensor | None, Tensor | None, Tensor | None]:
    """mode="low_memory": two sweeps over vocab chunks (see the module docstring)."""
    N, H = hidden.shape
    V = weight.shape[0]
    f32, dev = torch.float32, hidden.device
    rank, tp = _group_rank_size(opts.group_name)
    v_global, v_start = V * tp, rank * V
    known_lse = lse_in is not None
    want_gh = row_scale is not None and opts.compute_grad_hidden
    want_gw = row_scale is not None and opts.compute_grad_weight
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
            _stats_launch(
                logits, target, m, s, zt, zsum, alpha, v_start + v0,
                known_lse=known_lse, write_p=want_gh,
            )  # fmt: skip
            if want_gh:
                _launch_dh(
                    logits, weight[v0 : v0 + vc], acc, alpha, first=i == 0, has_alpha=not known_lse
                )
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
        grad_hidden = _finalize_dh(acc, weight, t_idx, coef_a, b_final, coef_c, opts, hidden)
        del acc  # free the fp32 accumulator before grad_weight exists: the peak is sweep B's

    # ---- sweep B: grad_weight, one full-N GEMM per vocab chunk ------------------------------
    if want_gw:
        grad_weight = torch.empty_like(weight)
        buf = torch.empty(N * min(chunk_b, V), dtype=hidden.dtype, device=dev)
        lse_c = lse.contiguous()
        coefs = _grad_coefs(lse_c, row_scale, opts, v_global)
        for v0 in range(0, V, chunk_b):
            vc = min(chunk_b, V - v0)
            logits = buf[: N * vc].view(N, vc)
            torch.mm(hidden, weight[v0 : v0 + vc].t(), out=logits)
            _grad_launch(logits, target, lse_c, coefs, v_start + v0)
            # fp32 accumulation over all N tokens inside the GEMM, one rounding on store.
            torch.mm(logits.t(), hidden, out=grad_weight[v0 : v0 + vc])
        del buf, logits
    return loss_tok, lse, grad_hidden, grad_weight, stats


def _finalize_dh(
    acc: Tensor,
    weight: Tensor,
    t_idx: Tensor,
    coef_a: Tensor,
    coef_b: Tensor,
    coef_c: Tensor,
    opts: LCEOptions,
    hidden: Tensor,
) -> Tensor:
    """grad_hidden = a acc + b W[target] + c sum_v W_v (low-memory mode, after sweep A)."""
    N, H = acc.shape
    smoothing = opts.label_smoothing > 0.0
    wsum = weight.sum(dim=0, dtype=torch.float32) if smoothing else coef_c  # dummy when unused
    tp = _group_rank_size(opts.group_name)[1]
    # Tensor parallel: the partial sums are all-reduced in fp32, then cast.
    out = acc if tp > 1 else torch.empty(N, H, dtype=hidden.dtype, device=hidden.device)
    block_h = min(1024, triton.next_power_of_2(H))
    _lce_dh_finalize_kernel[(N, triton.cdiv(H, block_h))](
        acc,
        weight,
        wsum,
        out,
        t_idx,
        coef_a.contiguous(),
        coef_b.contiguous(),
        coef_c.contiguous(),
        H,
        acc.stride(0),
        weight.stride(0),
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
    """mode="fast": three GEMMs per token chunk (see the module docstring). `weight` may be
    the fp32 master weight of 16-bit hidden; grad_weight then accumulates in fp32 into the
    fp32 gradient itself."""
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
        rows = _fast_token_chunk(N, V, hidden.element_size(), in_dtype_acc)
    col_chunk = vocab_chunk or _MAX_VOCAB_CHUNK  # the stats kernel holds a piece of a row

    lse = lse_in.to(f32).contiguous() if known_lse else torch.empty(N, dtype=f32, device=dev)
    loss_tok = stats = None
    if not known_lse:
        loss_tok = torch.empty(N, dtype=f32, device=dev)
        stats = torch.zeros(2, dtype=torch.int64, device=dev)
        m = torch.empty(N, dtype=f32, device=dev)
        s, zt, zsum, alpha = (torch.empty(N, dtype=f32, device=dev) for _ in range(4))
    grad_hidden = torch.empty(N, H, dtype=hidden.dtype, device=dev) if want_gh else None
    gw_acc = None
    if want_gw:
        # The weight's dtype where it is the accumulation dtype (fp32 weights; 16-bit without
        # the fp32 buffer); else an fp32 accumulator, cast once at the end.
        same = weight.dtype == f32 and hidden.dtype == f32
        gw_dtype = weight.dtype if (same or in_dtype_acc) else f32
        gw_acc = torch.zeros(V, H, dtype=gw_dtype, device=dev)
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
        if want_gh:  # GEMM 2
            if tp > 1:  # partial sums over the vocab shards, all-reduced in fp32
                gh = _all_reduce(torch.mm(logits, w_in).float(), "sum", opts.group_name)
                grad_hidden[a:b] = gh
            else:
                torch.mm(logits, w_in, out=grad_hidden[a:b])
        if want_gw:  # GEMM 3
            if gw_acc.dtype == hidden.dtype:  # fp32 inside the GEMM, one rounding per chunk
                gw_acc.addmm_(logits.t(), h)
            else:  # 16-bit operands, accumulated in fp32 in place
                _launch_dh(logits.t(), h, gw_acc, gw_acc, first=False, has_alpha=False)
    del buf
    grad_weight = None if gw_acc is None else gw_acc.to(weight.dtype)
    return loss_tok, lse, grad_hidden, grad_weight, stats


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
    # Low-memory mode works in the input dtype throughout; a master weight is cast for it and
    # its gradient cast back, as autocast's F.linear would.
    w_in = weight.to(hidden.dtype)
    out = _lce_triton_low_memory(hidden, w_in, target, opts, row_scale, lse_in, vocab_chunk)
    loss_tok, lse, gh, gw, stats = out
    return loss_tok, lse, gh, None if gw is None else gw.to(weight.dtype), stats


def _triton_ok(hidden: Tensor) -> bool:
    return hidden.dtype in (torch.float32, torch.bfloat16, torch.float16)


# --------------------------------------------------------------------------------------------
# op registration
# --------------------------------------------------------------------------------------------


def _fake_outputs(
    hidden: Tensor, weight: Tensor, opts: LCEOptions
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    cdt = _compute_dtype(hidden.dtype)
    N = hidden.shape[0]
    loss = hidden.new_empty((N,) if opts.reduction == "none" else (), dtype=cdt)
    lse = hidden.new_empty((N,), dtype=cdt)
    gh, gw = _fake_grads(hidden, weight, opts, opts.reduction != "none")
    return loss, lse, gh, gw, hidden.new_empty((2,), dtype=torch.int64)


def _fake_grads(
    hidden: Tensor, weight: Tensor, opts: LCEOptions, with_grads: bool
) -> tuple[Tensor, Tensor]:
    gh = hidden.new_empty(hidden.shape) if with_grads and opts.compute_grad_hidden else None
    gw = weight.new_empty(weight.shape) if with_grads and opts.compute_grad_weight else None
    return _grads_or_placeholders(gh, gw, hidden, weight)


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
    mode: str = "low_memory",
    fp32_accumulator: bool = True,
    token_chunk: int = 0,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(loss, lse [N], grad_hidden, grad_weight, stats [2] int64): gradients for grad_output = 1,
    computed now; stats = [top-1 hits, invalid targets] (see the module docstring). The
    arguments after `target` are LCEOptions' fields in order.

    An empty tensor stands in for a gradient not asked for, and for both under "none".
    This body is the CPU (and any non-CUDA) kernel: the chunked torch reference.
    """
    opts = LCEOptions.from_forward_args(
        ignore_index, label_smoothing, z_loss, reduction, group_name,
        compute_grad_hidden, compute_grad_weight, mode, fp32_accumulator, token_chunk,
    )  # fmt: skip
    return linear_cross_entropy_ref(hidden, weight, target, **dataclasses.asdict(opts))


@linear_cross_entropy_forward.register_fake
def _forward_fake(hidden, weight, target, *options):
    opts = LCEOptions.from_forward_args(*options)
    _check_args(hidden, weight, target)
    return _fake_outputs(hidden, weight, opts)


@linear_cross_entropy_forward.register_kernel("cuda")
def _forward_cuda(hidden, weight, target, *options):
    opts = LCEOptions.from_forward_args(*options)
    _check_args(hidden, weight, target)
    if not _triton_ok(hidden):
        return linear_cross_entropy_ref(hidden, weight, target, **dataclasses.asdict(opts))
    valid = target != opts.ignore_index
    want = opts.reduction != "none" and (opts.compute_grad_hidden or opts.compute_grad_weight)
    row_scale = _row_scale(valid, opts.reduction, torch.float32) if want else None
    loss_tok, lse, gh, gw, stats = _lce_triton(
        hidden, weight, target, row_scale=row_scale, lse_in=None, **dataclasses.asdict(opts)
    )
    loss = _reduce(loss_tok, valid, opts.reduction)
    return loss, lse, *_grads_or_placeholders(gh, gw, hidden, weight), stats


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
    mode: str = "low_memory",
    fp32_accumulator: bool = True,
    token_chunk: int = 0,
) -> tuple[Tensor, Tensor]:
    """(grad_hidden, grad_weight) of reduction="none" for a per-token grad_loss [N]. The
    arguments after `lse` are LCEOptions' fields in order, without `reduction`."""
    opts = LCEOptions.from_backward_args(
        ignore_index, label_smoothing, z_loss, group_name,
        compute_grad_hidden, compute_grad_weight, mode, fp32_accumulator, token_chunk,
    )  # fmt: skip
    return linear_cross_entropy_backward_ref(
        grad_loss, hidden, weight, target, lse, **_backward_options(opts)
    )


def _backward_options(opts: LCEOptions) -> dict[str, Any]:
    options = dataclasses.asdict(opts)
    del options["reduction"]  # always "none" there
    return options


@linear_cross_entropy_backward.register_fake
def _backward_fake(grad_loss, hidden, weight, target, lse, *options):
    return _fake_grads(hidden, weight, LCEOptions.from_backward_args(*options), True)


@linear_cross_entropy_backward.register_kernel("cuda")
def _backward_cuda(grad_loss, hidden, weight, target, lse, *options):
    opts = LCEOptions.from_backward_args(*options)
    if not _triton_ok(hidden):
        return linear_cross_entropy_backward_ref(
            grad_loss, hidden, weight, target, lse, **_backward_options(opts)
        )
    row_scale = torch.where(target != opts.ignore_index, grad_loss.to(torch.float32), 0.0)
    _, _, gh, gw, _ = _lce_triton(
        hidden, weight, target, row_scale=row_scale, lse_in=lse, **dataclasses.asdict(opts)
    )
    return _grads_or_placeholders(gh, gw, hidden, weight)


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
    hidden, weight, target, *options = inputs
    _, lse, gh, gw, stats = output
    ctx.mark_non_differentiable(lse, gh, gw, stats)
    ctx.set_materialize_grads(False)  # no [V, H] zeros for the grads of those outputs
    ctx.opts = LCEOptions.from_forward_args(*options)
    ctx.num_options = len(options)
    if ctx.opts.reduction == "none":
        ctx.save_for_backward(hidden, weight, target, lse)
    else:
        ctx.save_for_backward(gh, gw)


def _backward(ctx: Any, grad_loss: Tensor | None, *_unused: Tensor | None) -> tuple:
    nones = (None,) * (1 + ctx.num_options)  # target and the options
    need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
    if grad_loss is None or not (need_h or need_w):
        return (None, None, *nones)
    opts = ctx.opts
    if opts.reduction == "none":
        hidden, weight, target, lse = ctx.saved_tensors
        wanted = dataclasses.replace(opts, compute_grad_hidden=need_h, compute_grad_weight=need_w)
        gh, gw = torch.ops.graphtrain.linear_cross_entropy_backward(
            grad_loss, hidden, weight, target, lse, *wanted.backward_args()
        )
    else:
        if (need_h and not opts.compute_grad_hidden) or (need_w and not opts.compute_grad_weight):
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
_OPTS = (
    'int ignore_index=-100, float label_smoothing=0.0, float z_loss=0.0, str reduction="mean", '
    'str mode="low_memory", bool fp32_accumulator=True, int token_chunk=0'
)
_LIB.define(
    f"linear_cross_entropy(Tensor hidden, Tensor weight, Tensor target, *, {_OPTS}) -> Tensor"
)
_LIB.define(
    "linear_cross_entropy_vocab_parallel(Tensor hidden, Tensor weight, Tensor target, "
    f"str group_name, *, {_OPTS}) -> Tensor"
)
_LIB.define(
    "linear_cross_entropy_with_stats(Tensor hidden, Tensor weight, Tensor target, "
    f"str? group_name=None, *, {_OPTS}) -> (Tensor, Tensor)"
)


def _call_forward(
    hidden: Tensor, weight: Tensor, target: Tensor, group_name: str | None, **options: Any
) -> tuple[Tensor, Tensor]:
    """(loss, stats) of the forward op, asking for the gradients autograd will want."""
    grad_on = torch.is_grad_enabled()
    opts = LCEOptions(
        group_name=group_name,
        compute_grad_hidden=grad_on and hidden.requires_grad,
        compute_grad_weight=grad_on and weight.requires_grad,
        **options,
    )
    loss, _lse, _gh, _gw, stats = torch.ops.graphtrain.linear_cross_entropy_forward(
        hidden, weight, target, *opts.forward_args()
    )
    return loss, stats


def _composite(hidden: Tensor, weight: Tensor, target: Tensor, **options: Any) -> Tensor:
    return _call_forward(hidden, weight, target, None, **options)[0]


def _composite_vocab_parallel(
    hidden: Tensor, weight: Tensor, target: Tensor, group_name: str, **options: Any
) -> Tensor:
    return _call_forward(hidden, weight, target, group_name, **options)[0]


def _composite_with_stats(
    hidden: Tensor, weight: Tensor, target: Tensor, group_name: str | None = None, **options: Any
) -> tuple[Tensor, Tensor]:
    return _call_forward(hidden, weight, target, group_name, **options)


_LIB.impl("linear_cross_entropy", _composite, "CompositeImplicitAutograd")
_LIB.impl(
    "linear_cross_entropy_vocab_parallel", _composite_vocab_parallel, "CompositeImplicitAutograd"
)
_LIB.impl("linear_cross_entropy_with_stats", _composite_with_stats, "CompositeImplicitAutograd")


def linear_cross_entropy(
    hidden: Tensor,
    weight: Tensor,
    target: Tensor,
    *,
    group_name: str | None = None,
    **options: Any,
) -> Tensor:
    """The loss of F.cross_entropy(F.linear(hidden, weight).float(), target, ...) + z-loss.

    group_name: the tensor-parallel group (weight is then this rank's vocab shard).
    options: ignore_index, label_smoothing, z_loss, reduction, mode, fp32_accumulator,
    token_chunk (LCEOptions).
    """
    if group_name is None:
        return torch.ops.graphtrain.linear_cross_entropy(hidden, weight, target, **options)
    return torch.ops.graphtrain.linear_cross_entropy_vocab_parallel(
        hidden, weight, target, group_name, **options
    )
