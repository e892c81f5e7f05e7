"""graphtrain::moe_route: the MoE router (token -> experts) from the router logits on, as one op.

What
    moe_route(logits [T, E], bias [E] or None, top_k, *, score_func="softmax", pre_softmax=True,
              num_groups=1, topk_groups=1, normalize=False, route_scale=1.0, group_score="top2",
              aux_seq_len=0, return_lse=False, count_plain=False)
        -> (weights [T, k] fp32, indices [T, k] int64, counts [E] int64, aux_sums [S, E] fp32,
            lse [T] fp32, plain_counts [S, E] fp32)
    is the router of the MoE spec (models/moe.py's Router writes it out): scores (softmax or
    sigmoid), the biased selection, the group limit, the top-k, the weights, the tokens per
    expert, and what the balance losses and the z-loss need; step by step in moe_route_ref's
    docstring. moe_route_backward(...) -> grad_logits is the backward, an op of its own.
    The pass: graphtrain/passes/moe_route.py. Why and the CUDA algorithm: docs/design/moe_route.md.

Contract
    Ties go to the lower expert/group index, in the reference and the kernels alike; weights,
    aux_sums, lse differentiable w.r.t. logits; bad input: ValueError naming it, at trace time.

Numerics
    fp32 from the logits (bf16/fp16 upcast on load; fp64 stays fp64). The kernels' softmax sums
    in another order than torch's: weights differ from the reference by a few ulps, and scores
    within an ulp of each other may be ordered differently. No host synchronisation.

Files: options (options, checks, shapes, schema), reference (CPU kernel and oracle), kernels
(Triton), cuda (launchers, tiles), registration.
"""

# What other modules and the tests import from here: the op, its options and checks, the
# references, and the kernels and launchers with their tile choices that the tests drive.
from graphtrain.custom_ops.moe_route.cuda import (
    _FWD_TILE,
    _FWD_WARPS,
    _bwd_config,
    _tile,
    moe_route_backward_triton,
    moe_route_triton,
    triton_supports,
)
from graphtrain.custom_ops.moe_route.kernels import _moe_route_bwd_kernel, _moe_route_fwd_kernel
from graphtrain.custom_ops.moe_route.options import (
    _SIGMOID,
    _SOFTMAX_POST,
    _SOFTMAX_PRE,
    GROUP_SCORES,
    NORMALIZE_EPS,
    SCORE_FUNCS,
    RouteOptions,
    check_route_args,
)
from graphtrain.custom_ops.moe_route.reference import moe_route_backward_ref, moe_route_ref
from graphtrain.custom_ops.moe_route.registration import moe_route, moe_route_backward
from graphtrain.custom_ops.utils import interpreting as _interpreting

__all__ = [
    "GROUP_SCORES",
    "NORMALIZE_EPS",
    "SCORE_FUNCS",
    "_FWD_TILE",
    "_FWD_WARPS",
    "_SIGMOID",
    "_SOFTMAX_POST",
    "_SOFTMAX_PRE",
    "RouteOptions",
    "_bwd_config",
    "_interpreting",
    "_moe_route_bwd_kernel",
    "_moe_route_fwd_kernel",
    "_tile",
    "check_route_args",
    "moe_route",
    "moe_route_backward",
    "moe_route_backward_ref",
    "moe_route_backward_triton",
    "moe_route_ref",
    "moe_route_triton",
    "triton_supports",
]
