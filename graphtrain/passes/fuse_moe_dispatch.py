"""Pass fuse_moe_dispatch: the MoE token permutation and weighted combine -> graphtrain ops.

What
    In the Dynamo graph (pre-grad, torch IR) it finds the two data movements around the
    experts and replaces each with its op (graphtrain/custom_ops/moe_permute.py):
        permute    xs = x[order // k] (indexing or index_select) -> moe_permute(x, order, k),
                   with a cast of every user of xs to one dtype folded in (dtype=...)
        unpermute  empty_like(ys).index_copy_(0, order, ys) viewed [T, k, D], optionally cast
                   to float32, times weights[..., None], summed over k, optionally cast
                   -> moe_unpermute(ys, order, weights, k, dtype=...)
    where `order` must be an argsort of a 1-D tensor of T*k elements, x being [T, D].
    models/moe.py's routed_experts is written exactly so. Every refusal leaves the graph as
    it was and is stated in a note.

Invariant and numerics (preserves_numerics=False)
    Only the matched nodes are replaced; the graph's outputs keep their values and dtypes.
    The permutation's forward is exact; the sums (the combine over k, the gradient of x over
    its k copies, the weights' gradient over D) are fp32 in another order than Inductor's:
    results agree to rounding. The spellings it reads and its refusals:
    docs/design/moe_dispatch.md.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.fx
from torch.fx import Node

import graphtrain.custom_ops.moe_permute  # noqa: F401  (registers the ops)
from graphtrain.passes import fx
from graphtrain.passes.fx import Refuse, arg, is_call, plain_tensor, shape, val
from graphtrain.passes.registry import PassContext, register_pass

_PERMUTE = torch.ops.graphtrain.moe_permute.default
_UNPERMUTE = torch.ops.graphtrain.moe_unpermute.default


def _sole_user(node: Node, what: str) -> Node:
    if len(node.users) != 1:
        users = ", ".join(u.name for u in node.users) or "none"
        raise Refuse(f"{what} {node.name} is used by {users}, not only by the combine")
    return next(iter(node.users))


def _floordiv_operands(node: Any) -> tuple[Node, int] | None:
    """(order, k) when `node` is order // k with a constant int k."""
    if is_call(node, "floor_divide"):
        order, k = node.args[0], node.args[1]
    elif is_call(node, "div") and node.kwargs.get("rounding_mode") == "floor":
        order, k = node.args[0], arg(node, 1, "other")
    else:
        return None
    return (order, k) if isinstance(order, Node) and isinstance(k, int) and k > 0 else None


def _check_permutation(order: Node, slots: int) -> None:
    """Refuse unless `order` is an argsort of a 1-D tensor of `slots` elements."""
    if is_call(order, "argsort"):
        keys = order.args[0]
    elif (
        (item := is_call(order, "getitem")) and item.args[1] == 1 and is_call(item.args[0], "sort")
    ):
        keys = item.args[0].args[0]
    else:
        raise Refuse(
            f"the slot order {order.name} is not an argsort (not known to be a permutation)"
        )
    if shape(keys) != (slots,) or shape(order) != (slots,):
        raise Refuse(
            f"the slot order {order.name} sorts {shape(keys)} values, not the T*k = {slots} slots"
        )


# --------------------------------------------------------------------------------------------
# permute: xs = x[order // k]
# --------------------------------------------------------------------------------------------


def _permute_candidate(node: Node) -> tuple[Node, Node] | None:
    """(x, index) of a row gather x[index] / index_select(x, 0, index) whose index is // k."""
    if is_call(node, "getitem") and isinstance(node.args[1], Node):
        x, index = node.args
    elif is_call(node, "index_select") and arg(node, 1, "dim") == 0:
        x, index = node.args[0], arg(node, 2, "index")
    else:
        return None
    return (x, index) if _floordiv_operands(index) is not None else None


def _rewrite_permute(gm: torch.fx.GraphModule, xs: Node, x: Node, index: Node) -> str:
    order, k = _floordiv_operands(index)
    xv = plain_tensor(x, "the gathered tensor")
    if xv.dim() != 2:
        raise Refuse(f"the gathered tensor {x.name} is not [T, D] (shape {tuple(xv.shape)})")
    plain_tensor(order, "the slot order")
    _check_permutation(order, xv.shape[0] * k)
    casts = list(xs.users)
    dtypes = {fx.cast_dtype(u) for u in casts}
    fold = bool(casts) and None not in dtypes and len(dtypes) == 1
    dtype = dtypes.pop() if fold else None
    graph = gm.graph
    with graph.inserting_before(xs):
        new = fx.emit(graph, "call_function", _PERMUTE, (x, order, k), {"dtype": dtype}, like=xs)
    for node in casts if fold else [xs]:
        node.replace_all_uses_with(new)
    for node in [*casts, xs] if fold else [xs]:
        graph.erase_node(node)
    if not index.users:
        graph.erase_node(index)
    folded = f", dtype={dtype} (folded {len(casts)} cast(s))" if fold else ""
    return (
        f"replaced {xs.name} = {x.name}[{order.name} // {k}] with {new.name} = "
        f"graphtrain.moe_permute({x.name}, {order.name}, {k}{folded})"
    )


# --------------------------------------------------------------------------------------------
# unpermute: y = empty_like(ys).index_copy_(0, order, ys) -> view(T, k, D) -> * w -> sum(1)
# --------------------------------------------------------------------------------------------


def _unpermute_candidate(node: Node) -> bool:
    return is_call(node, "index_copy") is not None and arg(node, 1, "dim") == 0


def _weights_of(node: Any, T: int, k: int) -> Node | None:
    """w when `node` is w [T, k] made [T, k, 1]: unsqueeze(-1 / 2), w[..., None] / w[:, :, None],
    or a view / reshape to (T, k, 1)."""
    if shape(node) != (T, k, 1):
        return None
    if is_call(node, "unsqueeze"):
        ok = arg(node, 1, "dim") in (-1, 2)
    elif is_call(node, "getitem"):
        idx = node.args[1]
        ok = idx in ((Ellipsis, None), (slice(None), slice(None), None))
    elif is_call(node, "reshape"):
        ok = True
    else:
        return None
    w = node.args[0]
    return w if ok and shape(w) == (T, k) else None


def _rewrite_unpermute(gm: torch.fx.GraphModule, copy: Node) -> str:
    base, order, ys = copy.args[0], arg(copy, 2, "index"), arg(copy, 3, "source")
    ysv = plain_tensor(ys, "the expert outputs")
    if ysv.dim() != 2:
        raise Refuse(f"the expert outputs {ys.name} are not [T*k, D] (shape {tuple(ysv.shape)})")
    if not (is_call(base, "empty_like", "zeros_like") and base.args[0] is ys):
        raise Refuse(
            f"{copy.name} copies into {base.name}, not a fresh empty_like/zeros_like of {ys.name}"
        )
    if len(base.users) != 1:
        raise Refuse(f"the slot buffer {base.name} is read outside {copy.name}")
    plain_tensor(order, "the slot order")
    slots, D = ysv.shape
    chain = [base, copy]
    view = _sole_user(copy, "the slots")
    dims = shape(view)
    if not (
        is_call(view, "reshape")
        and dims is not None
        and len(dims) == 3
        and dims[2] == D
        and dims[0] * dims[1] == slots
    ):
        raise Refuse(f"{view.name} does not view the slots {copy.name} as [T, k, D]")
    T, k = dims[0], dims[1]
    _check_permutation(order, slots)
    chain.append(view)
    node = _sole_user(view, "the [T, k, D] slots")
    if fx.cast_dtype(node) == torch.float32:
        chain.append(node)
        node = _sole_user(node, "the upcast slots")
    if not is_call(node, "mul"):
        raise Refuse(f"the slots {chain[-1].name} are not multiplied by the weights ({node.name})")
    other = node.args[1] if node.args[0] is chain[-1] else node.args[0]
    weights = _weights_of(other, T, k)
    if weights is None:
        raise Refuse(
            f"{node.name} multiplies the slots by {getattr(other, 'name', other)}, "
            "not by [T, k] weights unsqueezed"
        )
    plain_tensor(weights, "the weights")
    chain.append(node)
    total = _sole_user(node, "the weighted slots")
    dim = arg(total, 1, "dim")
    if not (
        is_call(total, "sum")
        and dim in (1, -2, (1,), (-2,))
        and not arg(total, 2, "keepdim", False)
        and "dtype" not in total.kwargs
    ):
        raise Refuse(f"{total.name} is not a sum over the k axis of the weighted slots")
    chain.append(total)
    end = total
    if len(total.users) == 1 and fx.cast_dtype(next(iter(total.users))) is not None:
        end = next(iter(total.users))
        chain.append(end)
    dtype = val(end).dtype
    graph = gm.graph
    with graph.inserting_before(end):
        args = (ys, order, weights, k)
        new = fx.emit(graph, "call_function", _UNPERMUTE, args, {"dtype": dtype}, like=end)
    end.replace_all_uses_with(new)
    for n in reversed(chain):
        if not n.users:
            graph.erase_node(n)
    if not other.users:
        graph.erase_node(other)
    return (
        f"replaced the combine {copy.name} .. {end.name} with {new.name} = "
        f"graphtrain.moe_unpermute({ys.name}, {order.name}, {weights.name}, {k}, dtype={dtype})"
    )


@register_pass("fuse_moe_dispatch", preserves_numerics=False)
def fuse_moe_dispatch_pass(
    gm: torch.fx.GraphModule, example_inputs: Sequence[Any], *, ctx: PassContext
) -> torch.fx.GraphModule:
    """Replace the MoE token permutation x[order // k] and the weighted combine of the expert
    outputs with graphtrain::moe_permute / graphtrain::moe_unpermute."""
    changed = False
    found = False
    for node in list(gm.graph.nodes):
        if getattr(node, "_erased", False):  # by an earlier rewrite
            continue
        try:
            if (gather := _permute_candidate(node)) is not None:
                found = True
                ctx.note(_rewrite_permute(gm, node, *gather))
                changed = True
            elif _unpermute_candidate(node):
                found = True
                ctx.note(_rewrite_unpermute(gm, node))
                changed = True
        except Refuse as why:
            ctx.note(f"left {node.name} unchanged: {why}")
    if not found:
        ctx.note("no MoE token permutation or combine in this graph")
    return fx.finish(gm, changed)
