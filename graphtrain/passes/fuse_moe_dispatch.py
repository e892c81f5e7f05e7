"""Pass fuse_moe_dispatch: the MoE token permutation and weighted combine -> graphtrain ops.

What
    In the Dynamo graph (pre-grad, torch IR) it finds the two data movements around the
    experts and replaces each with its op (graphtrain/custom_ops/moe_permute.py):
        permute    xs = x[order // k]  (indexing, x.index_select(0, ...) or torch.index_select)
                   -> graphtrain.moe_permute(x, order, k); when every user of xs casts it to
                   one dtype (autocast's explicit casts before the grouped GEMMs), the casts
                   are folded in: moe_permute(x, order, k, dtype=...)
        unpermute  y = torch.empty_like(ys).index_copy_(0, order, ys) (zeros_like, or the
                   out-of-place index_copy) -> y.view(T, k, D) (reshape, view(T, k, -1),
                   unflatten(0, (T, k))) -> optionally .float() / .to(float32) ->
                   * weights.unsqueeze(-1) (weights [T, k]; also weights[..., None] or a view
                   to [T, k, 1]; either operand order) -> .sum(1) (dim=1 or -2) -> optionally
                   a cast  ->  graphtrain.moe_unpermute(ys, order, weights, k, dtype=...)
    where `order` must be a permutation of the T*k slots: an argsort (torch.argsort, .argsort,
    or the indices of a sort) of a 1-D tensor of T*k elements, x being [T, D]; `order // k`
    written with //, torch.div(..., rounding_mode="floor") or floor_divide.
    models/moe.py's GroupedExperts.forward is written exactly so.

Why
    The plain gather's backward is a scatter-add with an fp32 atomic per element into a zeroed
    [T, D] buffer; the combine materialises the [T*k, D] slots twice (index_copy, then the
    weighted view) and its backward gathers again. The ops move each row once, gather-only
    (deterministic), both directions. Measured on moe-1b in benchmarks/RESULTS.md.

Refusals (the graph is left as it was and ctx.note says why)
    an index that is not provably a permutation (any gather of x[idx // k] whose idx is not
    an argsort of a 1-D tensor of T*k elements); a slot buffer or an intermediate of the
    combine with other users (the [T*k, D] or [T, k, D] tensors are returned or read again);
    a combine that is not a sum over the k axis of slots times weights; DTensors; symbolic
    shapes.

Invariant and numerics (preserves_numerics=False)
    Only the matched nodes are replaced; the graph's outputs keep their values and dtypes.
    The permutation's forward is exact; the sums (the combine over k, the gradient of x over
    its k copies, the weights' gradient over D) are fp32 in another order than Inductor's:
    results agree to rounding.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import Any

import torch
import torch.fx
from torch.fx import Node

import graphtrain.custom_ops.moe_permute  # noqa: F401  (registers the ops)
from graphtrain.passes.registry import PassContext, register_pass

_PERMUTE = torch.ops.graphtrain.moe_permute.default
_UNPERMUTE = torch.ops.graphtrain.moe_unpermute.default
_META_KEYS = ("stack_trace", "nn_module_stack", "source_fn_stack")


class _Refuse(Exception):
    """Why a candidate is left alone (becomes the pass note)."""


def _val(node: Any) -> Any:
    return node.meta.get("example_value") if isinstance(node, Node) else None


def _shape(node: Any) -> tuple | None:
    v = _val(node)
    return tuple(v.shape) if isinstance(v, torch.Tensor) else None


def _is_fn(node: Any, *targets: Any) -> bool:
    return isinstance(node, Node) and node.op == "call_function" and node.target in targets


def _is_method(node: Any, *names: str) -> bool:
    return isinstance(node, Node) and node.op == "call_method" and node.target in names


def _arg(node: Node, i: int, name: str, default: Any = None) -> Any:
    return node.args[i] if len(node.args) > i else node.kwargs.get(name, default)


def _plain_tensor(node: Node, what: str) -> torch.Tensor:
    v = _val(node)
    if not isinstance(v, torch.Tensor):
        raise _Refuse(f"{what} {node.name} has no recorded tensor value")
    if type(v).__name__ == "DTensor" or hasattr(v, "_local_tensor"):
        raise _Refuse(f"{what} {node.name} is a DTensor")
    if not all(isinstance(s, int) for s in v.shape):
        raise _Refuse(f"{what} {node.name} has symbolic shape {tuple(v.shape)}")
    return v


def _sole_user(node: Node, what: str) -> Node:
    if len(node.users) != 1:
        users = ", ".join(u.name for u in node.users) or "none"
        raise _Refuse(f"{what} {node.name} is used by {users}, not only by the combine")
    return next(iter(node.users))


def _floordiv_operands(node: Any) -> tuple[Node, int] | None:
    """(order, k) when `node` is order // k with a constant int k."""
    if _is_fn(node, operator.floordiv, torch.floor_divide) or _is_method(node, "floor_divide"):
        order, k = node.args[0], node.args[1]
    elif (_is_fn(node, torch.div) or _is_method(node, "div")) and node.kwargs.get(
        "rounding_mode"
    ) == "floor":
        order, k = node.args[0], _arg(node, 1, "other")
    else:
        return None
    return (order, k) if isinstance(order, Node) and isinstance(k, int) and k > 0 else None


def _check_permutation(order: Node, slots: int) -> None:
    """Refuse unless `order` is an argsort of a 1-D tensor of `slots` elements."""
    if _is_fn(order, torch.argsort) or _is_method(order, "argsort"):
        keys = order.args[0]
    elif (
        _is_fn(order, operator.getitem)
        and order.args[1] == 1
        and (_is_fn(order.args[0], torch.sort) or _is_method(order.args[0], "sort"))
    ):
        keys = order.args[0].args[0]
    else:
        raise _Refuse(
            f"the slot order {order.name} is not an argsort (not known to be a permutation)"
        )
    if _shape(keys) != (slots,) or _shape(order) != (slots,):
        raise _Refuse(
            f"the slot order {order.name} sorts {_shape(keys)} values, not the T*k = {slots} slots"
        )


def _copy_meta(src: Node, dst: Node) -> None:
    for key in _META_KEYS:
        if key in src.meta:
            dst.meta[key] = src.meta[key]


# --------------------------------------------------------------------------------------------
# permute: xs = x[order // k]
# --------------------------------------------------------------------------------------------


def _permute_candidate(node: Node) -> tuple[Node, Node] | None:
    """(x, index) of a row gather x[index] / index_select(x, 0, index) whose index is // k."""
    if _is_fn(node, operator.getitem) and isinstance(node.args[1], Node):
        x, index = node.args
    elif (_is_fn(node, torch.index_select) or _is_method(node, "index_select")) and _arg(
        node, 1, "dim"
    ) == 0:
        x, index = node.args[0], _arg(node, 2, "index")
    else:
        return None
    return (x, index) if _floordiv_operands(index) is not None else None


def _rewrite_permute(gm: torch.fx.GraphModule, xs: Node, x: Node, index: Node) -> str:
    order, k = _floordiv_operands(index)
    xv = _plain_tensor(x, "the gathered tensor")
    if xv.dim() != 2:
        raise _Refuse(f"the gathered tensor {x.name} is not [T, D] (shape {tuple(xv.shape)})")
    _plain_tensor(order, "the slot order")
    _check_permutation(order, xv.shape[0] * k)
    casts = list(xs.users)
    dtypes = {_cast_dtype(u) for u in casts}
    fold = bool(casts) and None not in dtypes and len(dtypes) == 1
    dtype = dtypes.pop() if fold else None
    graph = gm.graph
    with graph.inserting_before(xs):
        new = graph.call_function(_PERMUTE, (x, order, k), {"dtype": dtype})
    with _val(x).fake_mode:
        new.meta["example_value"] = _PERMUTE(_val(x), _val(order), k, dtype=dtype)
    _copy_meta(xs, new)
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


def _cast_dtype(node: Node) -> torch.dtype | None:
    """The dtype of a plain `.to(dtype)` / `.float()` cast, else None."""
    if _is_method(node, "float") and len(node.args) == 1 and not node.kwargs:
        return torch.float32
    if _is_method(node, "to"):
        args = [*node.args[1:], *node.kwargs.values()]
        if len(args) == 1 and isinstance(args[0], torch.dtype) and set(node.kwargs) <= {"dtype"}:
            return args[0]
    return None


# --------------------------------------------------------------------------------------------
# unpermute: y = empty_like(ys).index_copy_(0, order, ys) -> view(T, k, D) -> * w -> sum(1)
# --------------------------------------------------------------------------------------------


def _unpermute_candidate(node: Node) -> bool:
    return (_is_method(node, "index_copy_", "index_copy") or _is_fn(node, torch.index_copy)) and (
        _arg(node, 1, "dim") == 0
    )


def _weights_of(node: Any, T: int, k: int) -> Node | None:
    """w when `node` is w [T, k] made [T, k, 1]: unsqueeze(-1 / 2), w[..., None] / w[:, :, None],
    or a view / reshape to (T, k, 1)."""
    if _shape(node) != (T, k, 1):
        return None
    if _is_method(node, "unsqueeze") or _is_fn(node, torch.unsqueeze):
        ok = _arg(node, 1, "dim") in (-1, 2)
    elif _is_fn(node, operator.getitem):
        idx = node.args[1]
        ok = idx in ((Ellipsis, None), (slice(None), slice(None), None))
    elif _is_method(node, "view", "reshape"):
        ok = True
    else:
        return None
    w = node.args[0]
    return w if ok and _shape(w) == (T, k) else None


def _rewrite_unpermute(gm: torch.fx.GraphModule, copy: Node) -> str:
    base, order, ys = copy.args[0], _arg(copy, 2, "index"), _arg(copy, 3, "source")
    ysv = _plain_tensor(ys, "the expert outputs")
    if ysv.dim() != 2:
        raise _Refuse(f"the expert outputs {ys.name} are not [T*k, D] (shape {tuple(ysv.shape)})")
    if not (_is_fn(base, torch.empty_like, torch.zeros_like) and base.args[0] is ys):
        raise _Refuse(
            f"{copy.name} copies into {base.name}, not a fresh empty_like/zeros_like of {ys.name}"
        )
    if len(base.users) != 1:
        raise _Refuse(f"the slot buffer {base.name} is read outside {copy.name}")
    _plain_tensor(order, "the slot order")
    slots, D = ysv.shape
    chain = [base, copy]
    view = _sole_user(copy, "the slots")
    shape = _shape(view)
    if not (
        _is_method(view, "view", "reshape", "unflatten")
        and shape is not None
        and len(shape) == 3
        and shape[2] == D
        and shape[0] * shape[1] == slots
    ):
        raise _Refuse(f"{view.name} does not view the slots {copy.name} as [T, k, D]")
    T, k = shape[0], shape[1]
    _check_permutation(order, slots)
    chain.append(view)
    node = _sole_user(view, "the [T, k, D] slots")
    if _cast_dtype(node) == torch.float32:
        chain.append(node)
        node = _sole_user(node, "the upcast slots")
    if not (_is_fn(node, operator.mul, torch.mul) or _is_method(node, "mul")):
        raise _Refuse(f"the slots {chain[-1].name} are not multiplied by the weights ({node.name})")
    other = node.args[1] if node.args[0] is chain[-1] else node.args[0]
    weights = _weights_of(other, T, k)
    if weights is None:
        raise _Refuse(
            f"{node.name} multiplies the slots by {getattr(other, 'name', other)}, "
            "not by [T, k] weights unsqueezed"
        )
    _plain_tensor(weights, "the weights")
    chain.append(node)
    total = _sole_user(node, "the weighted slots")
    dim = _arg(total, 1, "dim")
    if not (
        (_is_method(total, "sum") or _is_fn(total, torch.sum))
        and dim in (1, -2, (1,), (-2,))
        and not _arg(total, 2, "keepdim", False)
        and "dtype" not in total.kwargs
    ):
        raise _Refuse(f"{total.name} is not a sum over the k axis of the weighted slots")
    chain.append(total)
    end = total
    if len(total.users) == 1 and _cast_dtype(next(iter(total.users))) is not None:
        end = next(iter(total.users))
        chain.append(end)
    dtype = _val(end).dtype
    graph = gm.graph
    with graph.inserting_before(end):
        new = graph.call_function(_UNPERMUTE, (ys, order, weights, k), {"dtype": dtype})
    with _val(ys).fake_mode:
        new.meta["example_value"] = _UNPERMUTE(ysv, _val(order), _val(weights), k, dtype=dtype)
    _copy_meta(end, new)
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


@register_pass(
    "fuse_moe_dispatch",
    stage="pre_grad",
    order=30,
    default_on=True,
    preserves_numerics=False,
)
def fuse_moe_dispatch_pass(
    gm: torch.fx.GraphModule, example_inputs: Sequence[Any], *, ctx: PassContext
) -> torch.fx.GraphModule:
    """Replace the MoE token permutation x[order // k] and the weighted combine of the expert
    outputs with graphtrain::moe_permute / graphtrain::moe_unpermute."""
    # Order 30: after fuse_moe_router (20), whose indices the slot order sorts.
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
        except _Refuse as why:
            ctx.note(f"left {node.name} unchanged: {why}")
    if not found:
        ctx.note("no MoE token permutation or combine in this graph")
    if changed:
        gm.graph.lint()
        gm.recompile()
    return gm
