"""Shared FX helpers of graphtrain's passes: node values, call matching, new nodes, aliasing,
and the one way a matcher refuses.

What
    Node values: `val`, `shape`, `dtype` read the fake tensors Dynamo records on every node;
        `plain_tensor` refuses a value the ops are not wired for.
    Call matching: `call(node)` is one view of a call in any spelling (method, function,
        in-place method or operator) as a `Call` with the method's name, its arguments input
        first and an `inplace` flag; `is_call(node, *names)` tests the name; DTensor's
        to_local / redistribute / from_local in both ways Dynamo records them; `transpose_of`
        finds W under W.t(), W.T, W.mT, W.transpose(...).
    New nodes: `emit` inserts a call, records its example_value from the fake values and
        copies the provenance of the node it replaces (what `graphtrain inspect` shows).
    Post-grad (aten) graphs: their own helpers, graphtrain.passes.post_grad.
    Aliasing: `alias_root` / `aliases` follow views and in-place ops, for the checks that
        erasing or moving a sub-graph cannot change what another node reads.
    Refusals: a matcher raises `Refuse(reason)` wherever it stops; the pass catches it and
        writes ctx.note(f"left {node} unchanged: {reason}"), so every refusal carries its
        reason. Each helper in full: docs/design/passes.md.
"""

from __future__ import annotations

import operator
from collections.abc import Hashable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx
import torch.nn.functional as F
from torch._guards import detect_fake_mode
from torch._subclasses.fake_tensor import FakeTensor
from torch.fx import Node
from torch.fx.node import map_arg
from torch.utils._pytree import tree_leaves

# Provenance carried from a replaced node to its replacement.
META_KEYS = ("stack_trace", "nn_module_stack", "source_fn_stack")


class Refuse(Exception):
    """A candidate the pass leaves alone; the message says why (it becomes the pass note)."""


# ---- node values ---------------------------------------------------------------------------


def val(node: Any) -> Any:
    """The value Dynamo recorded for `node` (a fake tensor, a tuple, ...), None for constants."""
    return node.meta.get("example_value") if isinstance(node, Node) else None


def shape(node: Any) -> tuple | None:
    v = val(node)
    return tuple(v.shape) if isinstance(v, torch.Tensor) else None


def dtype(node: Any) -> torch.dtype | None:
    v = val(node)
    return v.dtype if isinstance(v, torch.Tensor) else None


def is_dtensor(value: Any) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # torch built without distributed
        return False
    return isinstance(value, DTensor)


def plain_tensor(node: Node, what: str) -> torch.Tensor:
    """The recorded value of `node`; Refuse when there is none, it is a DTensor or its shape is
    symbolic (graphtrain's ops are wired for plain, static tensors)."""
    v = val(node)
    if not isinstance(v, torch.Tensor):
        raise Refuse(f"{what} {node.name} has no recorded tensor value")
    if is_dtensor(v):
        raise Refuse(f"{what} {node.name} is a DTensor")
    if not all(isinstance(s, int) for s in v.shape):
        raise Refuse(f"{what} {node.name} has symbolic shape {tuple(v.shape)}")
    return v


def fake_mode_of(nodes: Iterable[Any]) -> Any:
    """The fake mode that made the recorded values (the tracing context's may be another)."""
    for node in nodes:
        for v in tree_leaves(val(node)):  # a tensor, or a tuple of them
            v = getattr(v, "_local_tensor", v)  # a DTensor's local fake tensor
            if isinstance(v, FakeTensor):
                return v.fake_mode
    mode = detect_fake_mode()  # e.g. only an nn.Linear's real weight: the tracing context's
    if mode is None:
        raise ValueError("no recorded fake tensor among the nodes (not a Dynamo graph?)")
    return mode


# ---- call matching -------------------------------------------------------------------------

# A linear layer as Dynamo records it (F.linear, nn.Linear), and x @ W spelled as a matmul.
LINEAR_TARGETS = (F.linear, torch._C._nn.linear)
MATMUL_TARGETS = (operator.matmul, torch.matmul)

# call_function targets -> the method name they mean (call_method nodes use the name itself).
FUNCTIONS: dict[Any, str] = {
    torch.softmax: "softmax",
    torch.sigmoid: "sigmoid",
    torch.topk: "topk",
    torch.sort: "sort",
    torch.argsort: "argsort",
    torch.gather: "gather",
    operator.add: "add",
    torch.add: "add",
    operator.truediv: "div",
    torch.div: "div",
    torch.true_divide: "div",
    operator.mul: "mul",
    torch.mul: "mul",
    operator.getitem: "getitem",
    operator.invert: "logical_not",
    torch.logical_not: "logical_not",
    torch.bitwise_not: "logical_not",
    operator.eq: "eq",
    torch.eq: "eq",
    operator.ne: "ne",
    torch.ne: "ne",
    operator.and_: "and",
    torch.logical_and: "logical_and",
    torch.bitwise_and: "bitwise_and",
    torch.argmax: "argmax",
    torch.mean: "mean",
    torch.masked_fill: "masked_fill",
    torch.scatter: "scatter",
    torch.bincount: "bincount",
    torch.histc: "histc",
    torch.scatter_add: "scatter_add",
    torch.index_add: "index_add",
    torch.zeros: "zeros",
    torch.ones: "ones",
    torch.full: "full",
    torch.zeros_like: "zeros_like",
    torch.ones_like: "ones_like",
    torch.full_like: "full_like",
    torch.flatten: "flatten",
    torch.reshape: "reshape",
    torch.unsqueeze: "unsqueeze",
    torch.unflatten: "unflatten",
    torch.sum: "sum",
    torch.amax: "amax",
    torch.max: "max",
    torch.logsumexp: "logsumexp",
    torch.detach: "detach",
    torch.transpose: "transpose",
    torch.t: "t",
    torch.index_select: "index_select",
    torch.index_copy: "index_copy",
    torch.floor_divide: "floor_divide",
    operator.floordiv: "floor_divide",
    torch.empty_like: "empty_like",
    torch.narrow: "narrow",
    F.silu: "silu",
}
# In-place operators (x /= y, x[i] = v, ...): read as their method, and seen by the in-place
# checks.
INPLACE_FUNCTIONS = {
    operator.itruediv: "div",
    operator.imul: "mul",
    operator.iadd: "add",
    operator.isub: "sub",
    operator.iand: "and",
    operator.ior: "or",
    operator.ixor: "xor",
    operator.setitem: "setitem",
}
METHOD_ALIASES = {
    "true_divide": "div",
    "divide": "div",
    "multiply": "mul",
    "bitwise_not": "logical_not",
    "expand_as": "expand",
}
# Ops that reinterpret a tensor in row-major order (what they did is read from the shapes).
REINTERPRET = ("reshape", "view", "flatten", "unflatten", "unsqueeze", "contiguous")
# Constant tensors: the fill value each makes (None: the fill_value argument says).
FILLS = {
    "ones": 1,
    "ones_like": 1,
    "new_ones": 1,
    "zeros": 0,
    "zeros_like": 0,
    "new_zeros": 0,
    "full": None,
    "full_like": None,
    "new_full": None,
}
# Ops whose output may share storage with their input (conservative: for in-place checks).
ALIASING = (*REINTERPRET, "detach", "expand", "getitem", "squeeze", "t", "transpose", "permute")
# Casts with no argument -> the dtype they convert to.
DTYPE_METHODS = {
    "float": torch.float32,
    "double": torch.float64,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
    "int": torch.int32,
    "long": torch.int64,
    "short": torch.int16,
    "bool": torch.bool,
}


# torch 2.11's Dynamo records x.to_local(...), x.redistribute(...) and DTensor.from_local(x, ...)
# as a call_function of a closure it makes on the fly, named as below, whose free variables
# args_as_value / kwargs_as_value hold every argument but x (the mesh and placements too); from
# torch 2.13 on they are call_method nodes and a call of DTensor.from_local, with the arguments
# on the node (the mesh a graph input). `call` reads both as the same Call.
DYNAMO_DTENSOR_CLOSURES = {
    "prim_to_local": "to_local",
    "prim_redistribute": "redistribute",
    "prim from_local": "from_local",
}


@dataclass(frozen=True)
class Call:
    node: Node
    name: str  # the method name, in-place underscore removed
    args: tuple  # as the method receives them: the input first
    kwargs: dict
    inplace: bool

    def arg(self, i: int, name: str, default: Any = None) -> Any:
        """Argument i (0 is the input) or keyword `name`."""
        if len(self.args) > i:
            return self.args[i]
        return self.kwargs.get(name, default)

    @property
    def input(self) -> Any:
        """The tensor the call reads first (x of x.op(...), torch.op(x, ...), op(input=x))."""
        return self.arg(0, "input", self.kwargs.get("self"))


def call(node: Any) -> Call | None:
    """A uniform view of a call: method and function spellings give the same name and args."""
    if not isinstance(node, Node):
        return None
    if node.op == "call_method":
        name = node.target
        inplace = name.endswith("_") and not name.endswith("__")
        name = name[:-1] if inplace else name
        return Call(node, METHOD_ALIASES.get(name, name), node.args, node.kwargs, inplace)
    if node.op != "call_function":
        return None
    target = node.target
    name = DYNAMO_DTENSOR_CLOSURES.get(getattr(target, "__name__", ""))
    if name is not None and getattr(target, "__closure__", None):
        cells = dict(zip(target.__code__.co_freevars, target.__closure__, strict=True))
        args = (*node.args, *cells["args_as_value"].cell_contents)
        kwargs = {**cells["kwargs_as_value"].cell_contents, **node.kwargs}
        return Call(node, name, args, kwargs, False)
    if _is_dtensor_from_local(target):
        return Call(node, "from_local", node.args, node.kwargs, False)
    if target in INPLACE_FUNCTIONS:
        return Call(node, INPLACE_FUNCTIONS[target], node.args, node.kwargs, True)
    try:
        name = FUNCTIONS.get(target)
    except TypeError:  # unhashable target
        return None
    return None if name is None else Call(node, name, node.args, node.kwargs, False)


def _is_dtensor_from_local(target: Any) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # torch built without distributed
        return False
    return target is DTensor.from_local


def emit_from_local(graph: torch.fx.Graph, x: Node, mesh: Any, placements: tuple) -> Node:
    """A new node DTensor.from_local(x, mesh, placements, run_check=False), mesh as the
    from_local Call that made x's DTensor has it: a node (torch 2.13+), or on torch 2.11 the
    DeviceMesh itself, then held by the target as Dynamo does there (an FX graph has no
    spelling for a mesh constant)."""
    from torch.distributed.tensor import DTensor

    if isinstance(mesh, Node):
        return graph.call_function(DTensor.from_local, (x, mesh, placements), {"run_check": False})

    def from_local(t: torch.Tensor) -> DTensor:
        return DTensor.from_local(t, mesh, placements, run_check=False)

    return graph.call_function(from_local, (x,))


# W.T and W.mT: getattr nodes up to torch 2.13; from 2.14 on Dynamo records calls of these ops.
_TRANSPOSE_ATTRIBUTES = {torch.ops.aten.numpy_T: "T", torch.ops.aten.mT: "mT"}


def transpose_of(node: Any, dims: int) -> Node | None:
    """W when `node` transposes the last two dims of a `dims`-D W, in any spelling: W.t(),
    torch.t(W), W.transpose(a, b), torch.transpose(W, a, b), W.mT, and W.T of a 2-D W (W.T
    and W.mT as either torch version records them, `_TRANSPOSE_ATTRIBUTES`)."""
    if not isinstance(node, Node) or node.op not in ("call_method", "call_function"):
        return None
    if not node.args or not isinstance(node.args[0], Node):
        return None
    base, v = node.args[0], val(node.args[0])
    if not isinstance(v, torch.Tensor) or v.dim() != dims:
        return None
    target, args = node.target, node.args
    attribute = _TRANSPOSE_ATTRIBUTES.get(target) if isinstance(target, Hashable) else None
    if target is getattr and len(args) == 2:
        attribute = args[1]
    if attribute is not None:
        return base if attribute == "mT" or (attribute == "T" and dims == 2) else None
    if target in ("t", torch.t) and len(args) == 1:
        return base
    if target in ("transpose", torch.transpose) and len(args) == 3:
        if {d % dims for d in args[1:] if isinstance(d, int)} == {dims - 2, dims - 1}:
            return base
    return None


def is_call(node: Any, *names: str) -> Call | None:
    """call(node) when its name is one of `names`, else None."""
    c = call(node)
    return c if c is not None and c.name in names else None


def uses(node: Node, *names: str) -> list[Call]:
    """The calls named `names` among the users of `node` that take it as their input."""
    return [c for u in node.users if (c := is_call(u, *names)) is not None and c.input is node]


def arg(node: Node, i: int, name: str, default: Any = None) -> Any:
    """Positional argument i or keyword `name` of a node, as written."""
    return node.args[i] if len(node.args) > i else node.kwargs.get(name, default)


def op_arg(node: Node, name: str) -> Any:
    """Argument `name` of a call to an OpOverload, found through the op's schema: positional,
    keyword, or the schema's default where the call left it out."""
    for i, argument in enumerate(node.target._schema.arguments):
        if argument.name == name:
            if i < len(node.args) and not argument.kwarg_only:
                return node.args[i]
            default = argument.default_value if argument.has_default_value() else None
            return node.kwargs.get(name, default)
    raise KeyError(f"{node.target} has no argument {name!r}")


def op_output(op: Any, name: str) -> int:
    """The index of the output named `name` in an OpOverload's schema (its getitem index)."""
    names = [r.name for r in op._schema.returns]
    if name not in names:
        raise KeyError(f"{op} has no output {name!r}; its outputs: {names}")
    return names.index(name)


def last_dim(dim: Any, ndim: int) -> bool:
    return isinstance(dim, int) and dim in (-1, ndim - 1)


def getitem_index(node: Node, source: Node) -> Any:
    """i when `node` is source[i], else None."""
    c = is_call(node, "getitem")
    return c.args[1] if c is not None and c.args[0] is source else None


def prefix_slice(node: Node) -> int | None:
    """k when `node` is x[:, :k] / x[..., :k] of a 2-D x (a leading column slice)."""
    c = is_call(node, "getitem")
    if c is None or not isinstance(c.args[1], tuple) or len(c.args[1]) != 2:
        return None
    first, second = c.args[1]
    if not (first is Ellipsis or first == slice(None)):
        return None
    if (
        not isinstance(second, slice)
        or second.start not in (None, 0)
        or second.step not in (None, 1)
    ):
        return None
    return second.stop if isinstance(second.stop, int) and second.stop > 0 else None


def is_reinterpret(c: Call) -> bool:
    """A row-major reinterpretation: reshape-like ops and x[...] indexing with only None /
    Ellipsis / full slices."""
    if c.name in REINTERPRET:
        return True
    if c.name == "getitem" and isinstance(val(c.args[0]), torch.Tensor):
        idx = c.args[1] if isinstance(c.args[1], tuple) else (c.args[1],)
        return all(i is None or i is Ellipsis or i == slice(None) for i in idx)
    return False


def cast_dtype(node: Any) -> torch.dtype | None:
    """The dtype of a plain dtype cast, x.to(dtype) (canonicalize's form), x.float(), ...;
    None for anything else (a device move, copy=True, memory_format, ...)."""
    c = call(node)
    if c is None or c.inplace or len(c.args) < 1:
        return None
    if c.name in DTYPE_METHODS and len(c.args) == 1 and not c.kwargs:
        return DTYPE_METHODS[c.name]
    if c.name in ("to", "type"):
        rest = [*c.args[1:], *c.kwargs.values()]
        if len(rest) == 1 and isinstance(rest[0], torch.dtype) and set(c.kwargs) <= {"dtype"}:
            return rest[0]
    return None


# ---- new nodes -----------------------------------------------------------------------------


def copy_meta(src: Node, dst: Node) -> None:
    """Give `dst` the provenance of `src` (source line, module path)."""
    for key in META_KEYS:
        if key in src.meta:
            dst.meta[key] = src.meta[key]


def emit(
    graph: torch.fx.Graph,
    op: str,
    target: Any,
    args: tuple,
    kwargs: dict | None = None,
    *,
    like: Node | None = None,
) -> Node:
    """A new call_function / call_method node at the graph's insertion point, its example_value
    computed on the recorded fake values, its provenance copied from `like`."""
    kwargs = kwargs or {}
    node = graph.create_node(op, target, args, kwargs)
    vargs, vkwargs = map_arg((args, kwargs), val)
    with fake_mode_of(node.all_input_nodes):
        if op == "call_method":
            value = getattr(vargs[0], target)(*vargs[1:], **vkwargs)
        else:
            value = target(*vargs, **vkwargs)
    node.meta["example_value"] = value
    if like is not None:
        copy_meta(like, node)
    return node


def finish(gm: torch.fx.GraphModule, changed: bool) -> torch.fx.GraphModule:
    """End of every pass: check and regenerate the code when anything changed."""
    if changed:
        gm.graph.lint()
        gm.recompile()
    return gm


# ---- aliasing ------------------------------------------------------------------------------


def alias_root(node: Node) -> Node:
    """The tensor that `node` views or mutates (following views and in-place ops back)."""
    while (c := call(node)) is not None and (c.name in ALIASING or c.inplace):
        if not isinstance(val(c.input), torch.Tensor):
            break
        node = c.input
    return node


def aliases(root: Node, stop: Iterable[Node] = ()) -> set[Node]:
    """root and every node viewing or mutating it (not looking past the nodes in `stop`)."""
    stop = set(stop)
    out, todo = {root}, [root]
    while todo:
        n = todo.pop()
        if n in stop:
            continue
        for u in n.users:
            c = call(u)
            if c is not None and (c.name in ALIASING or c.inplace) and c.input is n:
                if u not in out:
                    out.add(u)
                    todo.append(u)
    return out


def check_mutations(
    graph: torch.fx.Graph, nodes: set[Node], rewired: set[Node], inputs: set[Node], at: Node
) -> None:
    """Refuse when replacing the sub-graph `nodes` by one op at `at` could change what some
    node sees: the op reads `inputs` at `at`, the readers of `rewired` get the op's outputs,
    and the other nodes of the sub-graph are erased (those still used elsewhere stay).

    An erased in-place op must not have written a tensor that a node outside the sub-graph
    reads afterwards; an in-place op outside it on a tensor the sub-graph reads must not fall
    between two of its reads (nor after the point where the op reads its inputs).
    """
    order = {n: i for i, n in enumerate(graph.nodes)}
    inputs = {alias_root(n) for n in inputs}
    watched = inputs | {alias_root(n) for n in nodes}
    for node in graph.nodes:
        c = call(node)
        if c is None or not c.inplace or not isinstance(c.input, Node):
            continue
        root = alias_root(c.input)
        if node in nodes:
            views = aliases(root, rewired)
            for a in views - rewired:
                for u in a.users:
                    if u not in nodes and u not in views and order[u] > order[node]:
                        raise Refuse(
                            f"the in-place {node.name} changes {root.name}, which {u.name} "
                            "reads afterwards"
                        )
        elif root in watched:
            reads = [order[u] for a in aliases(root) for u in a.users if u in nodes]
            if root in inputs:
                reads.append(order[at])
            before = any(o < order[node] for o in reads)
            after = any(o > order[node] for o in reads)
            if after and (before or root not in inputs):
                raise Refuse(f"{node.name} changes {root.name} in place inside the sub-graph")
