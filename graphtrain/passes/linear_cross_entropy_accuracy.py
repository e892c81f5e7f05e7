"""The top-1 accuracy fold of the linear_cross_entropy pass: argmax-accuracy -> the op's count.

What
    A plain-torch accuracy on the same logits as a matched loss,
    ((logits.argmax(-1) == labels) [& or * (labels != ignore_index)]) [.float()] .sum() or
    .mean(), with labels the loss's target, is read from the fused op's top-1 count
    (graphtrain.linear_cross_entropy_with_stats): the logits are still never materialised.
    _find_accuracy finds the pattern; _fold_accuracy rewrites it after the loss was fused.

Numerics
    Equal to the plain value except for ties for the row maximum (argmax picks the first
    class, the op counts the target as a hit).
"""

from __future__ import annotations

import inspect
import operator
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx
import torch.nn.functional as F

import graphtrain.custom_ops.linear_cross_entropy  # noqa: F401  (registers the ops)
from graphtrain.passes import fx

_CE_SIGNATURE = inspect.signature(F.cross_entropy)
_WITH_STATS_OP = torch.ops.graphtrain.linear_cross_entropy_with_stats.default
# Method and function spellings of the few calls an accuracy is written with, by one name.
# fx.call names -> the role they play in an accuracy (reshapes and casts are looked through).
_ACC_NAMES = {
    "argmax": "argmax",
    "eq": "eq",
    "__eq__": "eq",
    "ne": "ne",
    "__ne__": "ne",
    "and": "and",
    "__and__": "and",
    "logical_and": "and",
    "bitwise_and": "and",
    "mul": "and",  # of two bool tensors
    "sum": "sum",
    "mean": "mean",
    **dict.fromkeys(fx.REINTERPRET, "reshape"),
    **dict.fromkeys(("to", "type", *fx.DTYPE_METHODS), "cast"),
}


def _acc_call(node: Any) -> str | None:
    c = fx.call(node)
    return None if c is None or c.inplace else _ACC_NAMES.get(c.name)


def _strip_reshapes(node: Any) -> Any:
    while _acc_call(node) == "reshape":
        node = node.args[0]
    return node


@dataclass
class _Accuracy:
    """`reduce` = sum or mean of [argmax(logits, -1) == target] (masked by target !=
    ignore_index), which equals the op's top-1 count (or that count / numel for a mean)."""

    argmax: torch.fx.Node
    logits: torch.fx.Node  # the chain node argmax reads
    target: torch.fx.Node  # the loss's target: what argmax reads while the loss is matched
    reduce: torch.fx.Node
    nodes: list[torch.fx.Node]  # the pattern, argmax first
    mean_numel: int | None  # .mean(): the count it divides by


def _find_accuracy(ce: torch.fx.Node) -> _Accuracy | None:
    """A plain-torch top-1 accuracy on the logits `ce` reads, spelled
    ((logits.argmax(-1) == labels) [& / * (labels != ignore_index)]) [.float()] .sum() / .mean()
    with labels the loss's target (up to reshapes). The unmasked form only where ignore_index
    < 0 (argmax never equals it). Ties: argmax picks the first maximum, the op counts any."""
    try:
        bound = _CE_SIGNATURE.bind(*ce.args, **ce.kwargs)
    except TypeError:
        return None
    bound.apply_defaults()
    ignore_index, target = bound.arguments["ignore_index"], bound.arguments["target"]
    node, chain = bound.arguments["input"], []
    vocab = fx.val(node).shape[-1] if fx.val(node) is not None else None
    while isinstance(node, torch.fx.Node) and node.op.startswith("call") and len(chain) < 8:
        val = fx.val(node)
        if val is None or val.dim() < 1 or val.shape[-1] != vocab:
            break
        chain.append(node)
        node = node.args[0] if node.args else None
    for x in chain:
        for argmax in x.users:
            found = _accuracy_from(argmax, x, target, ignore_index)
            if found is not None:
                return found
    return None


def _accuracy_from(
    argmax: torch.fx.Node, logits: torch.fx.Node, target: Any, ignore_index: Any
) -> _Accuracy | None:
    dim = argmax.args[1] if len(argmax.args) > 1 else argmax.kwargs.get("dim")
    ndim = fx.val(logits).dim()
    if _acc_call(argmax) != "argmax" or dim not in (-1, ndim - 1) or argmax.kwargs.get("keepdim"):
        return None
    if not isinstance(target, torch.fx.Node):
        return None
    base_target = _strip_reshapes(target)
    nodes = [argmax]

    def sole_user(n: torch.fx.Node) -> torch.fx.Node | None:
        return next(iter(n.users)) if len(n.users) == 1 else None

    eq = sole_user(argmax)
    if _acc_call(eq) != "eq" or len(eq.args) != 2:
        return None
    labels = eq.args[1] if eq.args[0] is argmax else eq.args[0]
    if _strip_reshapes(labels) is not base_target:
        return None
    nodes.append(eq)
    node = sole_user(eq)
    masked = False
    if _acc_call(node) == "and" and len(node.args) == 2:
        mask = node.args[1] if node.args[0] is eq else node.args[0]
        if _acc_call(mask) != "ne" or mask.args[1:] != (ignore_index,):
            return None
        if _strip_reshapes(mask.args[0]) is not base_target:
            return None
        masked = True
        nodes.append(node)
        node = sole_user(node)
    if not masked and not (isinstance(ignore_index, int) and ignore_index < 0):
        return None
    if _acc_call(node) == "cast":
        nodes.append(node)
        node = sole_user(node)
    kind = _acc_call(node)
    if kind not in ("sum", "mean") or len(node.args) > 1 or node.kwargs:
        return None  # a full reduction only
    numel = fx.val(eq).numel() if kind == "mean" else None
    return _Accuracy(argmax, logits, target, node, [*nodes, node], numel)


def _fold_accuracy(gm: torch.fx.GraphModule, fused: torch.fx.Node, acc: _Accuracy) -> None:
    """Make `fused` the with-stats op and let acc.reduce read its top-1 count; the argmax
    pattern goes. Nodes that read the accuracy but came before the op move after it."""
    graph = gm.graph
    loss_val = fx.val(fused)
    with loss_val.fake_mode:
        stats_val = torch.empty(2, dtype=torch.int64, device=loss_val.device)
    fused.target = _WITH_STATS_OP
    fused.meta["example_value"] = (loss_val, stats_val)
    with graph.inserting_before(fused.next):  # in order, right after the op
        loss = fx.emit(graph, "call_function", operator.getitem, (fused, 0), like=fused)
        stats = fx.emit(graph, "call_function", operator.getitem, (fused, 1), like=acc.reduce)
        hits = fx.emit(graph, "call_function", torch.select, (stats, 0, 0), like=acc.reduce)
        value = fx.emit(
            graph, "call_method", "to", (hits, fx.val(acc.reduce).dtype), like=acc.reduce
        )
        if acc.mean_numel is not None:
            value = fx.emit(
                graph, "call_function", operator.truediv, (value, acc.mean_numel), like=acc.reduce
            )
    fused.replace_all_uses_with(loss, delete_user_cb=lambda u: u is not loss and u is not stats)
    acc.reduce.replace_all_uses_with(value)
    for node in reversed(acc.nodes):
        graph.erase_node(node)
    # Readers of the accuracy written before the loss: move them (and what reads them) after.
    order = {n: i for i, n in enumerate(graph.nodes)}
    late, anchor = [], value
    todo = [u for u in value.users]
    while todo:
        node = todo.pop()
        if node.op != "output" and order[node] < order[value] and node not in late:
            late.append(node)
            todo.extend(node.users)
    for node in sorted(late, key=order.__getitem__):
        anchor.append(node)
        anchor = node
