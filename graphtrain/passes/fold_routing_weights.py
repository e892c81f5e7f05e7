"""Pass fold_routing_weights: the MoE combine's routing weights move onto the experts' hidden rows.

What
    In the Dynamo graph (pre-grad, torch IR), after fuse_moe_dispatch and
    fuse_sibling_grouped_mm, it finds
        h = silu(ab.narrow(-1, 0, F)) * ab.narrow(-1, F, F)        ab [T*k, 2F]: gate | up
        ys = torch._grouped_mm(h, W2t, offs=offs)                   [T*k, D], used only here
        out = graphtrain.moe_unpermute(ys, order, weights, k, dtype=...)
    and, the down projection being linear (W2 (w h) = w (W2 h)), rewrites it as
        ws = weights.reshape(-1).index_select(0, order)             [T*k] slot weights
        h2 = graphtrain.moe_weighted_swiglu(ab, ws)                 silu(a) * b * ws
        out = graphtrain.moe_unpermute(torch._grouped_mm(h2, W2t, offs=offs), order, None, k,
                                       dtype=...)
    Every refusal leaves the graph as it was and is stated in a note (docs/design/moe_dispatch.md).

Why
    moe_unpermute's backward needs the expert outputs ys for the weights' gradient, so the
    backward keeps them ([T*k, D]: 192 MiB a layer of moe-1b) and reads them again; after the
    rewrite that gradient is a row sum which moe_weighted_swiglu's backward computes in its one
    pass over the rows, and nothing keeps ys. Costs and measurements: docs/design/moe_dispatch.md.

Invariant and numerics (preserves_numerics=False)
    The graph's outputs keep their dtypes and, in exact arithmetic, their values; in floating
    point h2 is silu(a) b w rounded once to ab's dtype, where before h was rounded there and the
    GEMM's output weighted in fp32: one rounding of the 16-bit compute dtype for another.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.fx
from torch.fx import Node

from graphtrain.custom_ops import moe_permute, moe_swiglu  # noqa: F401  (register the ops)
from graphtrain.passes import fx
from graphtrain.passes.fx import Refuse, is_call, plain_tensor, shape, val
from graphtrain.passes.registry import PassContext, register_pass

_UNPERMUTE = torch.ops.graphtrain.moe_unpermute.default
_SWIGLU = torch.ops.graphtrain.moe_weighted_swiglu.default


def _half(node: Any, ab: Node | None, start: int, width: int) -> Node | None:
    """The [T*k, 2F] tensor of which `node` is the slice [:, start:start + width], if it is one
    (the same one as `ab` where given)."""
    c = is_call(node, "narrow")
    if c is None or c.arg(1, "dim") not in (1, -1) or (ab is not None and c.input is not ab):
        return None
    if c.arg(2, "start") != start or c.arg(3, "length") != width:
        return None
    return c.input


def _swiglu_input(h: Node) -> tuple[Node, list[Node]]:
    """(ab, the nodes h = silu(ab[:, :F]) * ab[:, F:] is made of): the SwiGLU of one grouped
    GEMM over the concatenated gate and up weights (fuse_sibling_grouped_mm's spelling)."""
    mul = is_call(h, "mul")
    F = shape(h)[1]
    for gate, up in ((0, 1), (1, 0)) if mul is not None and len(mul.args) == 2 else ():
        silu = is_call(mul.args[gate], "silu")
        ab = _half(silu.input, None, 0, F) if silu is not None else None
        if ab is not None and _half(mul.args[up], ab, F, F) is ab and shape(ab)[1] == 2 * F:
            return ab, [h, silu.node, silu.input, mul.args[up]]
    raise Refuse(
        f"the rows {h.name} are not silu(ab[:, :F]) * ab[:, F:] of one [T*k, 2F] GEMM output "
        "(the gate and up GEMMs as fuse_sibling_grouped_mm merges them)"
    )


def _fold(gm: torch.fx.GraphModule, node: Node) -> str:
    ys, order, weights, k = (fx.op_arg(node, n) for n in ("ys", "order", "weights", "top_k"))
    if weights is None:
        raise Refuse("it has no weights to fold")
    if not (isinstance(ys, Node) and ys.op == "call_function" and ys.target is torch._grouped_mm):
        raise Refuse(f"the expert outputs {getattr(ys, 'name', ys)} are not a grouped GEMM's")
    if len(ys.users) != 1:
        raise Refuse(f"the expert outputs {ys.name} have other users")
    if len(ys.args) > 3 or set(ys.kwargs) - {"offs"}:
        raise Refuse(f"{ys.name} has a bias or an out_dtype")
    h = ys.args[0]
    plain_tensor(h, "the experts' hidden rows")
    plain_tensor(weights, "the weights")
    if len(h.users) != 1:
        raise Refuse(f"the hidden rows {h.name} have other users")
    ab, swiglu = _swiglu_input(h)
    graph = gm.graph
    position = {n: i for i, n in enumerate(graph.nodes)}
    for late in (weights, order):
        if position[late] > position[ys]:
            raise Refuse(f"{late.name} is computed after the expert outputs {ys.name}")
    with graph.inserting_before(ys):
        flat = fx.emit(graph, "call_method", "reshape", (weights, -1), like=node)
        ws = fx.emit(graph, "call_function", torch.index_select, (flat, 0, order), like=node)
        h2 = fx.emit(graph, "call_function", _SWIGLU, (ab, ws), like=h)
    ys.update_arg(0, h2)
    with graph.inserting_before(node):
        dtype = val(node).dtype
        args = (ys, order, None, k)
        new = fx.emit(graph, "call_function", _UNPERMUTE, args, {"dtype": dtype}, like=node)
    node.replace_all_uses_with(new)
    graph.erase_node(node)
    for n in swiglu:  # h, silu, then the two halves: erased once nothing reads them
        if not n.users:
            graph.erase_node(n)
    return (
        f"folded the weights {weights.name} of {node.name} into the rows entering {ys.name}: "
        f"{h2.name} = graphtrain.moe_weighted_swiglu({ab.name}, {ws.name}), {new.name} = "
        f"graphtrain.moe_unpermute({ys.name}, {order.name}, None, {k}, dtype={dtype})"
    )


@register_pass("fold_routing_weights", preserves_numerics=False)
def fold_routing_weights_pass(
    gm: torch.fx.GraphModule, example_inputs: Sequence[Any], *, ctx: PassContext
) -> torch.fx.GraphModule:
    """Move the weighted combine's routing weights onto the rows entering the experts' down
    projection, so that the backward no longer keeps the expert outputs."""
    combines = [n for n in gm.graph.nodes if n.op == "call_function" and n.target is _UNPERMUTE]
    if not combines:
        ctx.note("no graphtrain.moe_unpermute in this graph")
        return gm
    changed = False
    for node in combines:
        try:
            ctx.note(_fold(gm, node))
            changed = True
        except Refuse as why:
            ctx.note(f"left {node.name} unchanged: {why}")
    return fx.finish(gm, changed)
