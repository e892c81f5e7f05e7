"""moe_route: the torch.library registration and autograd wiring.

What
    graphtrain::moe_route            custom op; register_fake, register_autograd; CPU (and any
                                     device without a kernel): moe_route_ref; CUDA: Triton
    graphtrain::moe_route_backward   custom op; CPU: moe_route_backward_ref; CUDA: Triton
    Both schemas' keyword options are generated from RouteOptions (options.schema_options).

Contract
    weights, aux_sums and lse are differentiable w.r.t. logits; indices, counts, plain_counts
    and the bias get no gradient. The fake checks the arguments, so bad input fails at trace
    time.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from graphtrain.custom_ops.moe_route.cuda import (
    _MAX_PADDED_EXPERTS,
    moe_route_backward_triton,
    moe_route_triton,
    triton_supports,
)
from graphtrain.custom_ops.moe_route.options import (
    BACKWARD_OPTIONS,
    OPTION_NAMES,
    RouteOptions,
    empty_outputs,
    schema_options,
)
from graphtrain.custom_ops.moe_route.reference import moe_route_backward_ref, moe_route_ref
from graphtrain.custom_ops.utils import compute_dtype


@torch.library.custom_op(
    "graphtrain::moe_route",
    mutates_args=(),
    schema=(
        "(Tensor logits, Tensor? bias, int top_k, *, "
        f"{schema_options(OPTION_NAMES, defaults=True)}) "
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
    return empty_outputs(logits, o)


@moe_route.register_kernel("cuda")
def _moe_route_cuda(logits, bias, top_k, **options):
    o = RouteOptions(top_k, **options)
    o.check(logits, bias)
    supported = triton_supports(logits, o.num_groups)
    return (moe_route_triton if supported else moe_route_ref)(logits, bias, top_k, **options)


# d logits of moe_route for d weights, d aux_sums and d lse (options: RouteOptions'
# backward_options); the torch reference is the CPU kernel.
moe_route_backward = torch.library.custom_op(
    "graphtrain::moe_route_backward",
    mutates_args=(),
    schema=(
        "(Tensor grad_weights, Tensor? grad_aux_sums, Tensor? grad_lse, Tensor logits, "
        f"Tensor indices, *, {schema_options(BACKWARD_OPTIONS, defaults=False)}) -> Tensor"
    ),
)(moe_route_backward_ref)


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
        grad_weights = indices.new_zeros(indices.shape, dtype=compute_dtype(logits.dtype))
    grad_logits = torch.ops.graphtrain.moe_route_backward(
        grad_weights, grad_aux_sums, grad_lse, logits, indices, **ctx.options.backward_options()
    )
    return grad_logits, None, None


moe_route.register_autograd(_backward, setup_context=_setup_context)
