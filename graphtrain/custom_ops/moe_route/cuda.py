"""moe_route: the launchers of the Triton kernels and their tile choices.

What
    moe_route_triton(logits, bias, top_k, **options)   the CUDA forward, moe_route_ref's outputs
    moe_route_backward_triton(grad_weights, grad_aux_sums, grad_lse, logits, indices, **options)
        the CUDA backward
    triton_supports(logits, num_groups)   whether the kernels take this router (at most 4096
        padded experts, 16/32-bit logits); else the reference runs, on any device
    Both also run CPU tensors under TRITON_INTERPRET=1.

Numerics
    The per-program partial sums are added by torch in a fixed order (no float atomics): the
    aux sums and plain counts are the same on every run. No host synchronisation.
"""

from __future__ import annotations

from typing import Any

import torch
import triton
from torch import Tensor

from graphtrain.custom_ops.moe_route.kernels import _moe_route_bwd_kernel, _moe_route_fwd_kernel
from graphtrain.custom_ops.moe_route.options import (
    _SIGMOID,
    _SOFTMAX_POST,
    _SOFTMAX_PRE,
    RouteOptions,
    empty_outputs,
)

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
_BWD_TILE_WARPS = {_SOFTMAX_PRE: (512, 1), _SOFTMAX_POST: (1024, 2), _SIGMOID: (4096, 4)}
# Where the backward spills on sm_90 (ptxas -v of the sm_90a cubin, no GPU needed; Triton 3.6,
# 3.8 and 3.9, fp32 and bf16 logits, 64 to 2048 experts, every score function) and what
# avoids it, per thread and [BLOCK_T, E] tile tensor:
# - the sweep's sigmoid tile, 64 elements on 2 warps: 3.8 and 3.9 spill at fp32 logits (255
#   registers, 52-112 B; 3.6 held it in 150); on 4 warps (32 elements) none does. The kernel
#   reads and writes the logits once, so the thread count should not matter (not measured).
# - with d aux_sums or d lse (x, the softmax, d aux and d scores live at once): 16 elements on
#   8 warps spilled 220 B on 3.9 at 256 experts, and 8 on 16 warps too (128 registers at most a
#   thread there); at most 8 elements by fewer tokens per program on the sweep's warps spills
#   nowhere (56-168 registers below 2048 experts).
# - rows of 2048 or more experts, one or two tokens a program: at most 16 elements by more
#   warps (64 spilled 228-1764 B; at 8 on 8 warps 3.6 spilled 32-44 B).
_BWD_EXTRAS_ELEMS, _BWD_WIDE_ELEMS, _BWD_WIDE_ROW = 8, 16, 2048


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
    weights, indices, counts, aux_sums, lse, plain_counts = empty_outputs(logits, o)
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
    if extras:
        block_t = max(1, min(block_t, 32 * warps * _BWD_EXTRAS_ELEMS // block_e))
    if block_e >= _BWD_WIDE_ROW:
        warps = min(16, max(warps, block_t * block_e // (32 * _BWD_WIDE_ELEMS)))
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
