"""linear_cross_entropy: the torch.library registration, autograd wiring and public ops.

What
    graphtrain::linear_cross_entropy_forward   (loss, lse, grad_hidden, grad_weight, stats),
        gradients for grad_output 1 computed in the forward; register_fake, register_autograd;
        CUDA: cuda._lce_triton, everything else: the reference
    graphtrain::linear_cross_entropy_backward  reduction="none": per-token grad_loss, recomputed
    graphtrain::linear_cross_entropy, _vocab_parallel, _with_stats   CompositeImplicitAutograd
        public ops: they decide which gradients are needed (grad mode, requires_grad)
    Every schema's option arguments are generated from LCEOptions (options.schema_options).

Numerics
    The backward only scales the saved gradients by grad_output, in fp32 with one rounding
    (in place in eager, so no second [V, H] exists at the backward's peak).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch
import triton
from torch import Tensor
from torch.utils._python_dispatch import _get_current_dispatch_mode

from graphtrain.custom_ops.linear_cross_entropy.cuda import _lce_triton, _triton_ok
from graphtrain.custom_ops.linear_cross_entropy.kernels import _lce_scale_kernel
from graphtrain.custom_ops.linear_cross_entropy.maths import (
    _grads_or_placeholders,
    _reduce,
    _row_scale,
)
from graphtrain.custom_ops.linear_cross_entropy.options import (
    BACKWARD_OPTIONS,
    FORWARD_OPTIONS,
    USER_OPTIONS,
    LCEOptions,
    _check_args,
    schema_options,
)
from graphtrain.custom_ops.linear_cross_entropy.reference import (
    linear_cross_entropy_backward_ref,
    linear_cross_entropy_ref,
)
from graphtrain.custom_ops.utils import compute_dtype as _compute_dtype
from graphtrain.custom_ops.utils import interpreting as _interpreting


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


@torch.library.custom_op(
    "graphtrain::linear_cross_entropy_forward",
    mutates_args=(),
    schema=(
        "(Tensor hidden, Tensor weight, Tensor target, "
        f"{schema_options(FORWARD_OPTIONS, all_defaults=False, int_type='SymInt')}) "
        "-> (Tensor, Tensor, Tensor, Tensor, Tensor)"
    ),
)
def linear_cross_entropy_forward(
    hidden: Tensor, weight: Tensor, target: Tensor, *options: Any
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(loss, lse [N], grad_hidden, grad_weight, stats [2] int64): gradients for grad_output = 1,
    computed now; stats = [top-1 hits, invalid targets]. `options`: LCEOptions' fields in order.

    An empty tensor stands in for a gradient not asked for, and for both under "none".
    This body is the CPU (and any non-CUDA) kernel: the chunked torch reference.
    """
    opts = LCEOptions.from_forward_args(*options)
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


@torch.library.custom_op(
    "graphtrain::linear_cross_entropy_backward",
    mutates_args=(),
    schema=(
        "(Tensor grad_loss, Tensor hidden, Tensor weight, Tensor target, Tensor lse, "
        f"{schema_options(BACKWARD_OPTIONS, all_defaults=False, int_type='SymInt')}) "
        "-> (Tensor, Tensor)"
    ),
)
def linear_cross_entropy_backward(
    grad_loss: Tensor, hidden: Tensor, weight: Tensor, target: Tensor, lse: Tensor, *options: Any
) -> tuple[Tensor, Tensor]:
    """(grad_hidden, grad_weight) of reduction="none" for a per-token grad_loss [N].
    `options`: LCEOptions' fields in order, without `reduction`."""
    opts = LCEOptions.from_backward_args(*options)
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
_OPTS = schema_options(USER_OPTIONS, all_defaults=True)
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
