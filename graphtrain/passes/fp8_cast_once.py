"""Pass fp8_cast_once: fp8_linear taken apart in the post-grad graph, so that each activation is
cast once for all the linears that read it and its amax is computed by the kernel that makes it.

What
    In the post-grad forward graph every group of graphtrain::fp8_linear nodes that read the
    same x (the same node, or reshapes of it with the same last dim: q, k, v; w1, w3) with the
    same pow2_scale and tp_group becomes: the amax of x and of each weight as aten reductions
    (max-reduced over tp_group in one functional all_reduce), one fp8_cast of x for the group
    and one per weight, and torch._scaled_mm (+ bias) per linear; the op's other outputs (what
    the backward saves) come from the casts. In the backward graph each fp8_linear_backward
    without a bias becomes the amax of grad_out, one fp8_cast (E5M2, or E4M3 with e4m3_grads)
    and the dgrad and wgrad _scaled_mm calls. Each cast records its saturation counts once,
    as the op did. Inductor then fuses each amax into the kernel that produces its tensor.
    Left as the op, with a note: an empty x or gradient, a backward with a bias or with its
    gradient cast already (fp8_all_gather), fp8_linear_precast nodes.
    Off by default (compile.passes = ["+fp8_cast_once"] turns it on): on an H200 it made the
    compiled rmsnorm + linear slower, not faster (benchmarks/RESULTS.md, 2026-11-28).

Invariant and numerics (preserves_numerics=True: bitwise)
    A maximum is exact in any order, so the aten amax equals graphtrain::fp8_amax; the casts and
    the _scaled_mm calls are the op's own with the same arguments, so outputs and gradients are
    the same bits (tests/passes/test_fp8_cast_once.py). Runs after fp8_all_gather and
    overlap_tp_comm, which rewrite the gathered fp8_linear inputs themselves.
    The rewrite in full and the traffic it saves: docs/design/fp8.md.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import Any

import torch
import torch.fx
from torch.fx import Node

from graphtrain.custom_ops.fp8_linear import FORWARD_FAST_ACCUM  # (importing registers the ops)
from graphtrain.passes import fx, post_grad
from graphtrain.passes.fx import Refuse
from graphtrain.passes.registry import PassContext, register_pass

aten, prims = torch.ops.aten, torch.ops.prims
_c10d = torch.ops._c10d_functional
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
_FORWARD = torch.ops.graphtrain.fp8_linear.default
_BACKWARD = torch.ops.graphtrain.fp8_linear_backward.default
_CAST = torch.ops.graphtrain.fp8_cast.default


def _root(x: Node) -> Node:
    """x through reshapes (the same elements in the same order)."""
    while post_grad.is_aten_view(x):
        x = x.args[0]
    return x


def _rows(b: post_grad.AtenBuilder, t: Node) -> Node:
    """t as [M, last dim] (copied first where it is not contiguous, as the op's reshape does:
    Inductor then computes the amax in that copy's kernel), or Refuse."""
    value = t.meta["val"]
    if value.numel() == 0:
        raise Refuse(f"{t.name} is empty")
    if not value.is_contiguous():
        t = b(aten.clone.default, t, memory_format=torch.contiguous_format)
    return b(aten.view.default, t, [value.numel() // value.shape[-1], value.shape[-1]])


# float dtype -> (the integer type of its bits, mask of all bits but the sign)
_BITS = {
    torch.bfloat16: (torch.int16, 0x7FFF),
    torch.float16: (torch.int16, 0x7FFF),
    torch.float32: (torch.int32, 0x7FFFFFFF),
}


def _amaxes(b: post_grad.AtenBuilder, tensors: list[Node], tp_group: str | None) -> list[Node]:
    """max |t| of each as a 0-d float32 node in aten ops (Inductor fuses them into the producers),
    max-reduced over tp_group in one all_reduce.

    The max is taken over the bits of t with the sign cleared: non-negative floats order as
    their bits do, and every NaN's bits lie above inf's, so the result is max |t| (NaN if any
    element is NaN) exactly as graphtrain::fp8_amax computes it. Through the bits, because a
    reduction over the values fused into the kernel that makes t (bf16) would see them before
    their rounding to bf16 (Inductor elides that rounding inside a kernel) and could differ
    from the max of the stored tensor by a rounding; a bitcast needs the rounded value."""
    amaxes = []
    for t in tensors:
        dtype = t.meta["val"].dtype
        bits, mask = _BITS[dtype]
        magnitude = b(aten.bitwise_and.Scalar, b(aten.view.dtype, t, bits), mask)
        amax = b(aten.view.dtype, b(aten.amax.default, magnitude, []), dtype)
        amaxes.append(b(prims.convert_element_type.default, amax, torch.float32))
    if tp_group is None:
        return amaxes
    # a cat of [1]-views, not a stack: Inductor has no lowering for stack in a post-grad graph
    stacked = b(aten.cat.default, [b(aten.view.default, a, [1]) for a in amaxes])
    reduced = b(_c10d.all_reduce.default, stacked, "max", tp_group)
    reduced = b(_c10d.wait_tensor.default, reduced)
    return [b(aten.select.int, reduced, 0, i) for i in range(len(amaxes))]


def _cast(b: post_grad.AtenBuilder, t: Node, amax: Node, dtype: torch.dtype, pow2: bool,
          tensor_class: str) -> tuple[Node, Node, Node]:  # fmt: skip
    """(t8, t8_t, scale_inv) of the 2-D t, its counts recorded under tensor_class."""
    cast = b(_CAST, t, amax, dtype, pow2, True, record=tensor_class)
    return tuple(b(operator.getitem, cast, i) for i in range(3))


def _hand_over(gm: torch.fx.GraphModule, op: Node, outputs: Sequence[Node | None]) -> None:
    """The op's output i (its getitem users) becomes outputs[i]; then the op goes."""
    for user in list(op.users):
        assert user.target is operator.getitem and outputs[user.args[1]] is not None, user
        user.replace_all_uses_with(outputs[user.args[1]])
        gm.graph.erase_node(user)
    gm.graph.erase_node(op)


def _forward_group(gm: torch.fx.GraphModule, linears: list[Node], fake_mode: Any) -> str:
    first = linears[0]
    pow2, group = bool(first.kwargs.get("pow2_scale")), first.kwargs.get("tp_group")
    weights = list(dict.fromkeys(linear.args[1] for linear in linears))
    before_first = set()
    for node in gm.graph.nodes:
        if node is first:
            break
        before_first.add(node)
    late = [w.name for w in weights if w not in before_first]
    if late:
        raise Refuse(f"weight(s) {late} are made after {first.name}, where the casts go")
    b = post_grad.AtenBuilder(gm.graph, first, fake_mode)
    x2 = _rows(b, first.args[0])
    note = (f"{', '.join(n.name for n in linears)}: one cast of {first.args[0].name} for "
            f"{len(linears)} linear(s), its amax in the graph (fused into its producer where "
            "that is a kernel)")  # fmt: skip
    ax, *aws = _amaxes(b, [x2, *weights], group)
    x8, x8_t, sx = _cast(b, x2, ax, E4M3, pow2, "activation")
    cast_w = {w: _cast(b, w, aw, E4M3, pow2, "weight") for w, aw in zip(weights, aws, strict=True)}
    for linear in linears:
        b.anchor = linear
        w8, w8_t, sw = cast_w[linear.args[1]]
        out_val = linear.meta["val"][0]
        out = b(aten._scaled_mm.default, x8, b(aten.permute.default, w8, [1, 0]), sx, sw,
                out_dtype=out_val.dtype, use_fast_accum=FORWARD_FAST_ACCUM)  # fmt: skip
        bias = linear.args[2] if len(linear.args) > 2 else linear.kwargs.get("bias")
        if bias is not None:
            out = b(aten.add.Tensor, out,
                    b(prims.convert_element_type.default, bias, out_val.dtype))  # fmt: skip
        out = b(aten.view.default, out, list(out_val.shape))
        _hand_over(gm, linear, (out, x8_t, sx, w8_t, sw))
    return note


def _backward(gm: torch.fx.GraphModule, op: Node, fake_mode: Any) -> str:
    grad_out, x8_t, sx, w8_t, sw, has_bias, *precast = op.args
    if has_bias:
        raise Refuse("it has a bias (grad_b sums the unquantised gradient)")
    if any(a is not None for a in precast) or op.kwargs.get("grad_scale_inv") is not None:
        raise Refuse("its gradient arrives cast already (before a tensor-parallel all-gather)")
    if any(user.args[1] == 2 for user in op.users):
        raise Refuse("its grad_b output is read")
    kw = op.kwargs
    b = post_grad.AtenBuilder(gm.graph, op, fake_mode)
    g2 = _rows(b, grad_out)
    (ag,) = _amaxes(b, [g2], kw.get("tp_group"))
    dtype = E4M3 if kw["e4m3_grads"] else E5M2
    g8, g8_t, sg = _cast(b, g2, ag, dtype, bool(kw["pow2_scale"]), "gradient")
    grad_x = b(aten._scaled_mm.default, g8, b(aten.permute.default, w8_t, [1, 0]), sg, sw,
               out_dtype=kw["x_dtype"])  # fmt: skip
    grad_x = b(aten.view.default, grad_x, list(op.meta["val"][0].shape))
    grad_w = b(aten._scaled_mm.default, g8_t, b(aten.permute.default, x8_t, [1, 0]), sg, sx,
               out_dtype=kw["w_dtype"])  # fmt: skip
    note = f"{op.name}: gradient {grad_out.name}'s amax and cast in the graph"
    _hand_over(gm, op, (grad_x, grad_w, None))
    return note


def _groups(gm: torch.fx.GraphModule) -> list[list[Node]]:
    """fp8_linear nodes by (x's root, x's numel and last dim, pow2_scale, tp_group), in order."""
    groups: dict[tuple, list[Node]] = {}
    for node in gm.graph.nodes:
        if post_grad.is_op(node, _FORWARD):
            x = node.args[0].meta["val"]
            key = (_root(node.args[0]), x.numel(), x.shape[-1],
                   bool(node.kwargs.get("pow2_scale")), node.kwargs.get("tp_group"))  # fmt: skip
            groups.setdefault(key, []).append(node)
    return list(groups.values())


@register_pass("fp8_cast_once", preserves_numerics=True, default_on=False)
def fp8_cast_once_pass(
    gm: torch.fx.GraphModule, example_inputs: Sequence[Any], *, ctx: PassContext
) -> torch.fx.GraphModule:
    """Cast each FP8 linear input once for all its readers, with its amax in the graph."""
    changed = False
    for linears in _groups(gm):
        try:
            ctx.note(_forward_group(gm, linears, linears[0].args[0].meta["val"].fake_mode))
            changed = True
        except Refuse as why:
            ctx.note(f"kept {', '.join(n.name for n in linears)}: {why}")
    for op in [n for n in gm.graph.nodes if post_grad.is_op(n, _BACKWARD)]:
        try:
            ctx.note(_backward(gm, op, op.meta["val"][0].fake_mode))
            changed = True
        except Refuse as why:
            ctx.note(f"kept {op.name}: {why}")
    return fx.finish(gm, changed)
