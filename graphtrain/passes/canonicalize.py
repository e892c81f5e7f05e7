"""Pass canonicalize: one spelling for the calls the fusion passes read.

What
    In the Dynamo graph (pre-grad, torch IR), before every fusion, it rewrites nodes in place
    (same node, name and provenance; only the spelling changes):
        methods    x.softmax(d), x.topk(k), x.gather(d, i), x.masked_fill(m, v), ... ->
                   torch.<name>(x, ...) (the same arguments; in-place methods stay)
        functional F.softmax(x, d, dtype=...) -> torch.softmax(...), F.sigmoid -> torch.sigmoid
        reshapes   view / reshape / flatten / unflatten, method or function ->
                   torch.reshape(x, shape) with the static output shape the node recorded
        casts      x.float(), .half(), ..., x.to(dtype=...), x.type(dtype), x.type_as(y) ->
                   x.to(dtype); a cast to the dtype x already has is removed
    Only nodes whose input is a plain tensor with static shape are touched (not DTensors,
    whose view and reshape propagate placements differently). The fusion passes match by
    meaning; with one spelling each, matchers stay short.

Invariant and numerics (preserves_numerics=True)
    Every rewrite calls the same ATen kernel with the same arguments, or is an identity: a
    view-able reshape is a view, as the view was; a cast to the tensor's own dtype returns the
    tensor itself (removing it keeps aliasing as it was). Outputs are bitwise equal, in
    forward and backward. The pass is idempotent. Every spelling it reads and why:
    docs/design/passes.md.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import Any

import torch
import torch.fx
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensor
from torch.fx import Node

from graphtrain.passes.fx import cast_dtype, finish, val
from graphtrain.passes.registry import PassContext, register_pass

# Methods whose torch.<name> function takes the same arguments after the input.
_TO_FUNCTION = {
    name: getattr(torch, name)
    for name in (
        "softmax",
        "sigmoid",
        "topk",
        "sort",
        "argsort",
        "gather",
        "logsumexp",
        "amax",
        "masked_fill",
        "scatter",
        "scatter_add",
        "index_add",
        "bincount",
        "histc",
        "logical_not",
    )
}
_RESHAPE_METHODS = ("view", "reshape", "flatten", "unflatten")
_RESHAPE_FUNCTIONS = (torch.flatten, torch.reshape, torch.unflatten)
_F_SOFTMAX = inspect.signature(F.softmax)


def _static_tensor(node: Any) -> bool:
    v = val(node)
    return isinstance(v, FakeTensor) and all(isinstance(s, int) for s in v.shape)


def _spelling(node: Node) -> str:
    if node.op == "call_method":
        return f"Tensor.{node.target}"
    module = "F" if node.target in (F.softmax, F.sigmoid) else "torch"
    return f"{module}.{getattr(node.target, '__name__', node.target)}"


def _set(node: Node, op: str, target: Any, args: tuple, kwargs: dict) -> str:
    """Respell `node` in place; returns "old -> new" for the note."""
    before = _spelling(node)
    node.op, node.target, node.args, node.kwargs = op, target, args, kwargs
    return f"{before} -> {_spelling(node)}"


def _functional(node: Node) -> str | None:
    """F.softmax / F.sigmoid -> torch.softmax / torch.sigmoid."""
    if node.op != "call_function":
        return None
    if node.target is F.sigmoid and len(node.args) == 1 and not node.kwargs:
        return _set(node, "call_function", torch.sigmoid, node.args, {})
    if node.target is not F.softmax:
        return None
    try:
        bound = _F_SOFTMAX.bind(*node.args, **node.kwargs).arguments
    except TypeError:
        return None
    dim, dtype = bound.get("dim"), bound.get("dtype")
    if not isinstance(dim, int):  # dim=None: F.softmax's implicit, deprecated choice
        return None
    return _set(
        node,
        "call_function",
        torch.softmax,
        (bound["input"], dim),
        {"dtype": dtype} if dtype else {},
    )


def _method(node: Node) -> str | None:
    """x.name(...) -> torch.name(x, ...)."""
    fn = _TO_FUNCTION.get(node.target) if node.op == "call_method" else None
    if fn is None:
        return None
    return _set(node, "call_function", fn, node.args, dict(node.kwargs))


def _reshape(node: Node) -> str | None:
    """Any reshape spelling -> torch.reshape(x, recorded shape)."""
    if not (
        (node.op == "call_method" and node.target in _RESHAPE_METHODS)
        or (node.op == "call_function" and node.target in _RESHAPE_FUNCTIONS)
    ):
        return None
    rest = [*node.args[1:], *node.kwargs.values()]
    if any(isinstance(a, torch.dtype) for a in rest):  # x.view(dtype): a bit cast
        return None
    out = val(node)
    if not isinstance(out, FakeTensor) or not all(isinstance(s, int) for s in out.shape):
        return None
    if (
        node.op == "call_function"
        and node.target is torch.reshape
        and node.args[1:] == (tuple(out.shape),)
    ):
        return None  # already canonical
    return _set(node, "call_function", torch.reshape, (node.args[0], tuple(out.shape)), {})


def _cast_target(node: Node) -> torch.dtype | None:
    """The dtype a pure dtype cast converts to, else None."""
    if node.op != "call_method":
        return None
    rest = node.args[1:]
    if node.target == "type_as" and len(rest) == 1 and not node.kwargs and _static_tensor(rest[0]):
        same_device = val(rest[0]).device == val(node.args[0]).device
        return val(rest[0]).dtype if same_device else None
    return cast_dtype(node)


def _cast(node: Node) -> str | None:
    """Every dtype cast -> x.to(dtype); a cast to x's own dtype is dropped."""
    target = _cast_target(node)
    if target is None:
        return None
    x = node.args[0]
    if val(x).dtype == target:
        before = _spelling(node)
        node.replace_all_uses_with(x)
        node.graph.erase_node(node)
        return f"{before} to the input's own dtype -> removed"
    if node.target == "to" and node.args == (x, target) and not node.kwargs:
        return None  # already canonical
    return _set(node, "call_method", "to", (x, target), {})


def canonicalize(gm: torch.fx.GraphModule) -> dict[str, int]:
    """Rewrite `gm` in place; returns how many nodes each rewrite ("old -> new") changed."""
    done: dict[str, int] = {}
    for node in list(gm.graph.nodes):
        if node.op not in ("call_method", "call_function") or not node.args:
            continue
        if not _static_tensor(node.args[0]):
            continue
        for rule in (_functional, _method, _reshape, _cast):
            rewrite = rule(node)
            if rewrite is not None:
                done[rewrite] = done.get(rewrite, 0) + 1
                break
    return done


@register_pass("canonicalize", preserves_numerics=True)
def canonicalize_pass(
    gm: torch.fx.GraphModule, example_inputs: Sequence[Any], *, ctx: PassContext
) -> torch.fx.GraphModule:
    """Bring method calls, reshapes and casts to one spelling each, so that matchers read one."""
    done = canonicalize(gm)
    if not done:
        ctx.note("every call already has its canonical spelling")
    for key, n in sorted(done.items()):
        ctx.note(f"{key}: {n} node(s)")
    return finish(gm, bool(done))
