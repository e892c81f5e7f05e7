"""Pass fuse_moe_router: the plain MoE router sub-graph -> graphtrain::moe_route.

What
    In the Dynamo graph (pre-grad, torch IR) it finds the routing sub-graph from the router
    logits to the routing weights and expert indices (and, when present, the tokens-per-expert
    counts) and replaces it with one graphtrain.moe_route(logits, bias, top_k, ...) node. It
    starts from each top-k (or descending sort) over a 2-D tensor, the last one first, and reads
    backwards and forwards by meaning rather than by spelling (the shapes of the recorded fake
    values decide what a reshape does):
        scores     softmax(logits, -1) (F.softmax / torch.softmax / .softmax, dtype=float32 of
                   bf16 logits allowed) / sigmoid(logits) / the logits themselves when the
                   weights are softmax-ed after the top-k (pre_softmax=False)
        selection  scores (+ bias [E], any operand order, .detach() anywhere on this path)
        groups     sel viewed [T, G, E/G] (view / reshape / unflatten); group score = its max
                   (amax, max(dim).values) or top-2 sum (topk(2)[0].sum(-1), also topk(min(2,
                   E/G)) as models/moe.py writes it); the topk_groups
                   best groups by topk or a descending sort sliced [:, :n]; the mask built by
                   scatter into a constant [T, G] tensor (ones + False = drop mask, zeros + True
                   = keep mask, in place or not, any bool/float dtype), negated by ~ /
                   logical_not / == 0, cast, and broadcast either as [T, G, 1] onto the grouped
                   view or expanded and reshaped to [T, E]; masked_fill(-inf), then flattened
        top-k      topk(sel, k, -1) (sorted or not) or a descending sort/argsort sliced [:, :k]
        weights    scores.gather(1, indices) (torch.gather, dim 1 or -1), or the top-k values
                   themselves when they are the scores (no bias, no detach); then optionally
                   softmax (after top-k), or w / w.sum(-1, keepdim=True) (+ 1e-20), in place
                   (DeepSeek's `weights /= ...`) or not; then optionally * a constant scale
        counts     bincount(indices.flatten(), minlength=E), histc(indices.float() (flattened
                   or not), bins=E, min=0, max=E or E-1), zeros(E).scatter_add(0, flat, ones) /
                   index_add; each replaced by the op's counts cast to its dtype
        aux sums   the load-balancing losses' sums of their probabilities p (softmax(logits):
                   the scores themselves or a softmax of the logits of its own; for sigmoid
                   scores / scores.sum(-1, keepdim=True)): p.sum(0) over the tokens and
                   p.view(B, L, E).sum(1) per sequence (view / reshape / unflatten), fp32,
                   after the top-k; they become aux_sums.sum(0) and aux_sums of the op with
                   aux_seq_len=L (T when there are only token sums). models/moe.py's aux,
                   seq_aux and global_aux losses read only these.
        lse        the router z-loss's logsumexp(logits, -1) (torch / method spelling, dim -1
                   or 1, keepdim or not), of the op's logits or of their fp32 cast, fp32,
                   before or after the top-k (Megatron takes it before routing): it becomes
                   the op's lse (return_lse=True) and the op moves up to the first of them.
    This covers the MoE spec's router (every option), DeepSeek-V3's public inference
    Gate.forward (whose group score without bias is the max: the op's group_score="max") and a
    plain softmax top-k router (probs.topk(k) with or without renormalisation).

Why
    The fused op reads the logits once and writes weights, indices, counts, the aux sums and
    the logsumexp in one kernel, with its own backward; the plain router is a dozen kernels and
    several passes over [T, E], and the aux losses' softmax, the z-loss's logsumexp and their
    backwards more.

What stays
    Only the op's outputs are rewired (the weights at the end of the matched chain, the
    indices, the counts, the aux sums, the logsumexps); every matched node that is still used
    elsewhere (the scores' row max, the top-k values, the mask, ...) is kept, the others are
    erased. A chain that stops early is still right: e.g. a normalisation with another
    epsilon is not absorbed and stays in the graph, applied to the op's weights.

Refusals (the graph is left as it was and ctx.note says why)
    a top-k whose indices feed no weights (a top-k accuracy, sampling: nothing to fuse); scores
    that are neither softmax nor sigmoid of the logits unless softmax-ed after the top-k;
    scores computed in bf16/fp16 (the op computes in fp32: cast the logits first); masking
    with anything but -inf (Hugging Face's masked_fill(~mask, 0.0) differs whenever a kept
    score is negative); a bias that is not an fp32 [E] tensor; a mask or view the pass cannot
    prove to be the group layout; an in-place op whose changed tensor is read afterwards by
    a node outside the router, or an in-place op outside the router on its tensors between
    two of its reads; a top-k beyond the experts of the kept groups (the op's argument checks);
    symbolic shapes; more experts than the Triton kernel's tile (4096, padded per group).
    A group selection (its indices scatter a constant into a mask) that is not fused with its
    router gets no note of its own: the router's note says why.

Invariant and numerics (preserves_numerics=False)
    Indices and counts are exactly the graph's when no two selection scores are equal; on
    exact ties the op takes the lower expert (and group) index, as a stable descending sort
    does (models/moe.py), where torch.topk's choice is unspecified. sorted=False top-k indices
    come back sorted (a valid order). The weights, aux sums and logsumexps
    equal the graph's up to rounding: on CPU the op's reference computes the same torch ops
    (bitwise equal weights for the spec's code), its backward is a closed form (agrees to a few
    ulps); the CUDA kernels sum the softmax in another order. w / w.sum() is taken as the op's
    w / (w.sum() + 1e-20): identical in fp32 unless the k weights sum below 1.7e-13 (only
    sigmoid logits all below about -29), where the op gives 0 instead of 0/0 = NaN.
"""

from __future__ import annotations

import inspect
import math
import operator
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensor
from torch.fx import Node

import graphtrain.custom_ops.moe_route as moe_route_op
from graphtrain.passes.registry import PassContext, register_pass

_OP = torch.ops.graphtrain.moe_route.default
_F_SOFTMAX = inspect.signature(F.softmax)

# call_function targets -> the method name they mean (call_method nodes use the name itself).
_FUNCTIONS: dict[Any, str] = {
    torch.softmax: "softmax",
    F.softmax: "softmax",
    torch.sigmoid: "sigmoid",
    F.sigmoid: "sigmoid",
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
}
# In-place operators (x /= y, x[i] = v, ...): matched as "div"/"mul", and seen by the
# in-place checks.
_INPLACE_FUNCTIONS = {
    operator.itruediv: "div",
    operator.imul: "mul",
    operator.iadd: "add",
    operator.isub: "sub",
    operator.iand: "and",
    operator.ior: "or",
    operator.ixor: "xor",
    operator.setitem: "setitem",
}
_METHOD_ALIASES = {
    "true_divide": "div",
    "divide": "div",
    "multiply": "mul",
    "bitwise_not": "logical_not",
    "expand_as": "expand",
}
# Ops that reinterpret a tensor in row-major order (what they did is read from the shapes).
_REINTERPRET = ("view", "reshape", "flatten", "unflatten", "unsqueeze", "contiguous")
_CASTS = ("float", "bool", "int", "long", "double", "half", "bfloat16", "to", "type")
_FILLS = {
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
_ALIASING = (*_REINTERPRET, "detach", "expand", "getitem", "squeeze", "t", "transpose", "permute")


class _Refuse(Exception):
    """The candidate is not a router the pass can replace; the message says why."""


@dataclass(frozen=True)
class _Call:
    node: Node
    name: str  # the method name, in-place underscore removed
    args: tuple
    kwargs: dict
    inplace: bool

    def arg(self, i: int, name: str, default: Any = None) -> Any:
        if len(self.args) > i:
            return self.args[i]
        return self.kwargs.get(name, default)


def _call(node: Any) -> _Call | None:
    """A uniform view of a call: method and function spellings give the same name and args."""
    if not isinstance(node, Node):
        return None
    if node.op == "call_method":
        name = node.target
        inplace = name.endswith("_") and not name.endswith("__")
        name = name[:-1] if inplace else name
        return _Call(node, _METHOD_ALIASES.get(name, name), node.args, node.kwargs, inplace)
    if node.op != "call_function":
        return None
    target = node.target
    if target in _INPLACE_FUNCTIONS:
        return _Call(node, _INPLACE_FUNCTIONS[target], node.args, node.kwargs, True)
    try:
        name = _FUNCTIONS.get(target)
    except TypeError:  # unhashable target
        return None
    if name is None:
        return None
    if target is F.softmax:  # softmax(input, dim, _stacklevel, dtype): bind to read dtype
        bound = _F_SOFTMAX.bind(*node.args, **node.kwargs).arguments
        return _Call(
            node, name, (bound["input"], bound.get("dim")), {"dtype": bound.get("dtype")}, False
        )
    return _Call(node, name, node.args, node.kwargs, False)


def _is(node: Any, *names: str) -> _Call | None:
    c = _call(node)
    return c if c is not None and c.name in names else None


def _val(node: Any) -> Any:
    return node.meta.get("example_value") if isinstance(node, Node) else None


def _shape(node: Any) -> tuple | None:
    v = _val(node)
    return tuple(v.shape) if isinstance(v, torch.Tensor) else None


def _dtype(node: Any) -> torch.dtype | None:
    v = _val(node)
    return v.dtype if isinstance(v, torch.Tensor) else None


def _last_dim(dim: Any, ndim: int) -> bool:
    return isinstance(dim, int) and dim in (-1, ndim - 1)


def _getitem_index(node: Node, source: Node) -> Any:
    c = _is(node, "getitem")
    return c.args[1] if c is not None and c.args[0] is source else None


def _prefix_slice(node: Node) -> int | None:
    """k when `node` is x[:, :k] / x[..., :k] of a 2-D x (a leading column slice)."""
    c = _is(node, "getitem")
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


def _is_reinterpret(c: _Call) -> bool:
    """A row-major reinterpretation: reshape-like ops and x[...] indexing with only None /
    Ellipsis / full slices."""
    if c.name in _REINTERPRET:
        return True
    if c.name == "getitem" and isinstance(_val(c.args[0]), torch.Tensor):
        idx = c.args[1] if isinstance(c.args[1], tuple) else (c.args[1],)
        return all(i is None or i is Ellipsis or i == slice(None) for i in idx)
    return False


@dataclass
class _Router:
    anchor: Node  # the expert top-k (or sort): the op goes right before it
    logits: Node
    bias: Node | None
    top_k: int
    options: dict[str, Any]
    indices: list[Node]  # nodes whose uses become the op's indices
    weights: Node  # the node whose uses become the op's weights
    counts: list[Node]  # nodes whose uses become the op's counts (cast to their dtype)
    token_sums: list[Node]  # p.sum(0): become aux_sums.sum(0)
    seq_sums: list[Node]  # p.view(B, L, E).sum(1): become aux_sums
    lse: list[Node]  # logsumexp(logits, -1): become the op's lse
    at: Node  # the op goes right before this node: the anchor or an earlier logsumexp
    nodes: set[Node]  # every node of the sub-graph


class _Matcher:
    """Reads one router around a top-k anchor; raises _Refuse with the reason otherwise."""

    def __init__(self) -> None:
        self.nodes: set[Node] = set()
        self.detached = False  # a .detach() between the scores and the top-k

    def take(self, *nodes: Node) -> None:
        self.nodes.update(nodes)

    def strip_detach(self, node: Any) -> Any:
        while (c := _is(node, "detach", "contiguous")) is not None:
            self.detached |= c.name == "detach"
            self.take(c.node)
            node = c.args[0]
        return node

    # ---- top-k / sort selection ---------------------------------------------------------

    def selection(self, node: Node) -> tuple[Node, int, list[Node], list[Node]]:
        """(input, k, index nodes, value nodes) of a descending top-k over the last dim."""
        c = _call(node)
        if c is None:
            raise _Refuse(f"{node.name} is not a top-k")
        x = c.arg(0, "input")
        ndim = len(_shape(x) or ())
        values: list[Node] = []
        if c.name == "topk":
            k, dim = c.arg(1, "k"), c.arg(2, "dim", -1)
            if not c.arg(3, "largest", True):
                raise _Refuse(f"{node.name} takes the smallest values (largest=False)")
            indices = [u for u in node.users if _getitem_index(u, node) == 1]
            values = [u for u in node.users if _getitem_index(u, node) == 0]
            self.take(node, *indices, *values)
        elif c.name in ("sort", "argsort"):
            dim, descending = c.arg(1, "dim", -1), c.arg(2, "descending", False)
            if not descending:
                raise _Refuse(f"{node.name} sorts in ascending order")
            full = [u for u in node.users if _getitem_index(u, node) == 1]
            if c.name == "argsort":
                full = [node]
            indices = [u for f in full for u in f.users if _prefix_slice(u) is not None]
            ks = {_prefix_slice(u) for u in indices}
            if len(ks) != 1:
                raise _Refuse(f"{node.name}: its order is not cut to one top-k ([:, :k])")
            (k,) = ks
            self.take(node, *full, *indices)
        else:
            raise _Refuse(f"{node.name} is not a top-k")
        if not _last_dim(dim, ndim) or ndim != 2 or not isinstance(k, int):
            raise _Refuse(f"{node.name} is not a top-k over the last dim with a constant k")
        return x, k, indices, values

    def selection_of(self, index: Any) -> tuple[Node, int]:
        """(input, k) of the selection whose indices `index` are."""
        c = _is(index, "getitem")
        if c is None:
            raise _Refuse(f"{getattr(index, 'name', index)} are not top-k indices")
        producer = c.args[0]
        if _prefix_slice(index) is not None and (full := _is(producer, "getitem")) is not None:
            producer = full.args[0]  # sort(...)[1][:, :k]; argsort(...)[:, :k] is direct
        x, k, indices, _ = self.selection(producer)
        if index not in indices:
            raise _Refuse(f"{index.name} are not top-k indices")
        return x, k

    # ---- group limit ----------------------------------------------------------------------

    def group_limit(self, sel_final: Node, T: int, E: int) -> tuple[Node, dict[str, Any]]:
        """(sel [T, E], group options) from the top-k's input."""
        node = self.strip_detach(sel_final)
        c = _call(node)
        if c is not None and _is_reinterpret(c) and _is(c.args[0], "masked_fill"):
            fill = _call(c.args[0])
            self.take(node)
            three_d = True
        elif c is not None and c.name == "masked_fill" and _shape(c.args[0]) == (T, E):
            fill, three_d = c, False
        else:
            return node, {}
        self.take(fill.node)
        value = fill.arg(2, "value")
        if not isinstance(value, float) or not (value == -math.inf or value <= -3.4e38):
            raise _Refuse(
                f"{fill.node.name} masks the dropped groups with {value!r}, not -inf (the op "
                "never picks a dropped expert; with 0.0 a negative kept score loses to them)"
            )
        if three_d:
            grouped = self.strip_detach(fill.args[0])
            gshape = _shape(grouped)
            if gshape is None or len(gshape) != 3 or gshape[0] != T or gshape[1] * gshape[2] != E:
                raise _Refuse(f"{fill.node.name} does not mask a [T, G, E/G] view of the scores")
            sel = self.ungroup(grouped, T, E)
        else:
            sel = self.strip_detach(fill.args[0])
        G, topk_groups, group_score = self.group_mask(fill.arg(1, "mask"), sel, T, E, three_d)
        return sel, dict(num_groups=G, topk_groups=topk_groups, group_score=group_score)

    def ungroup(self, grouped: Node, T: int, E: int) -> Node:
        """The [T, E] node that `grouped` ([T, G, E/G]) is a row-major view of."""
        c = _call(grouped)
        if c is None or not _is_reinterpret(c) or _shape(c.args[0]) != (T, E):
            raise _Refuse(f"{grouped.name} is not a [T, G, E/G] view of [T, E] scores")
        self.take(grouped)
        return self.strip_detach(c.args[0])

    def group_mask(
        self, cond: Any, sel: Node, T: int, E: int, three_d: bool
    ) -> tuple[int, int, str]:
        """(G, topk_groups, group_score) of the mask condition of masked_fill."""
        # Walk back from the condition to the scatter that built the [T, G] mask.
        chain: list[_Call] = []
        node = cond
        while True:
            c = _call(node)
            if c is None:
                raise _Refuse(f"cannot read the group mask at {getattr(node, 'name', node)}")
            if c.name == "scatter" or c.name in _FILLS:
                break
            chain.append(c)
            node = c.args[0]
        scatter = self.group_scatter(c)
        base = _call(scatter.args[0])
        G = (_shape(base.node) or (0, 0))[1]
        if _shape(base.node) != (T, G) or G < 2 or E % G:
            raise _Refuse(f"the group mask {base.node.name} is not [T, G] with G dividing E={E}")
        EPG = E // G
        fill_value = (
            base.arg(2 if base.name == "new_full" else 1, "fill_value")
            if _FILLS[base.name] is None
            else _FILLS[base.name]
        )
        value = scatter.arg(3, "value", scatter.kwargs.get("src"))
        if not isinstance(fill_value, bool | int | float) or not isinstance(
            value, bool | int | float
        ):
            raise _Refuse(f"{scatter.node.name} does not scatter a constant into a constant mask")
        if bool(fill_value) == bool(value):
            raise _Refuse(f"{scatter.node.name} leaves the mask {base.node.name} constant")
        marks_dropped = bool(fill_value)  # ones + False: True where dropped
        self.take(base.node, scatter.node)
        # Forward through the chain: negations flip, casts keep, layouts go
        # [T, G] -> [T, G, 1] -> (expand) [T, G, EPG] -> [T, E], checked on the shapes.
        reshapes = {((T, G), (T, G, 1)), ((T, G, EPG), (T, E))}
        shape = (T, G)
        for c in reversed(chain):
            out = _shape(c.node)
            if c.name == "logical_not" or (c.name == "eq" and c.args[1] in (0, False)):
                marks_dropped = not marks_dropped
                ok = out == shape
            elif c.name in _CASTS:
                ok = out == shape
            elif c.name == "expand":
                ok = shape == (T, G, 1) and out == (T, G, EPG)
            elif _is_reinterpret(c):
                ok = out == shape or (shape, out) in reshapes
            else:
                ok = False
            if not ok or c.inplace:
                raise _Refuse(f"cannot prove {c.node.name} keeps the group mask's layout")
            self.take(c.node)
            shape = out
        wanted = ((T, G, 1), (T, G, EPG)) if three_d else ((T, E),)
        if shape not in wanted:
            raise _Refuse(f"the mask {cond.name} does not broadcast group-wise onto the scores")
        if not marks_dropped:
            raise _Refuse(f"the mask {cond.name} marks the kept groups, masked_fill drops them")
        # The group selection: top-k of the group scores.
        gscores, topk_groups = self.selection_of(scatter.arg(2, "index"))
        if _shape(gscores) != (T, G):
            raise _Refuse(f"the group scores {gscores.name} are not [T, G]")
        return G, topk_groups, self.group_score(gscores, sel, T, E, G)

    def group_scatter(self, c: _Call) -> _Call:
        """The scatter writing the mask (a functional scatter, or the one in-place scatter_ on
        a constant tensor that the chain reads directly)."""
        if c.name in _FILLS:
            writes = [u for u in c.node.users if (s := _is(u, "scatter")) and s.inplace]
            if len(writes) != 1:
                raise _Refuse(f"the mask {c.node.name} is not written by exactly one scatter_")
            c = _call(writes[0])
        dim = c.arg(1, "dim")
        if dim not in (1, -1) or c.kwargs.get("reduce") is not None or not _is(c.args[0], *_FILLS):
            raise _Refuse(f"{c.node.name} is not a scatter along the groups into a constant mask")
        return c

    def group_score(self, gscores: Node, sel: Node, T: int, E: int, G: int) -> str:
        c = _call(gscores)
        kind, grouped = None, None
        if c is not None and c.name == "amax" and _last_dim(c.arg(1, "dim"), 3):
            kind, grouped = "max", c.args[0]
        elif c is not None and c.name == "getitem" and c.args[1] == 0 and _is(c.args[0], "max"):
            m = _call(c.args[0])
            if _last_dim(m.arg(1, "dim"), 3) and not m.arg(2, "keepdim", False):
                kind, grouped = "max", m.args[0]
                self.take(m.node)
        elif c is not None and c.name == "sum" and _last_dim(c.arg(1, "dim"), 3):
            top = _is(c.args[0], "getitem")
            t = top is not None and top.args[1] == 0 and _is(top.args[0], "topk")
            if (
                t
                and t.arg(1, "k") == min(2, E // G)  # models write topk(min(2, E/G))
                and _last_dim(t.arg(2, "dim", -1), 3)
                and t.arg(3, "largest", True)
            ):
                kind, grouped = "top2", t.args[0]
                self.take(top.node, t.node)
        if kind is None or (c.name != "getitem" and c.arg(2, "keepdim", False)):
            raise _Refuse(f"the group score {gscores.name} is neither the max nor the top-2 sum")
        self.take(gscores)
        if _shape(grouped) != (T, G, E // G) or self.ungroup(grouped, T, E) is not sel:
            raise _Refuse(f"the group score {gscores.name} is not over the selection scores")
        return kind

    # ---- scores, bias, logits -------------------------------------------------------------

    def biased(self, sel: Node, T: int, E: int) -> tuple[Node, Node | None]:
        """(scores, bias) of sel = scores (+ bias)."""
        c = _call(sel)
        if c is None or c.name != "add" or c.inplace or "alpha" in c.kwargs or len(c.args) != 2:
            return self.strip_detach(sel), None
        a, b = c.args
        if _shape(b) == (T, E) and _shape(a) != (T, E):
            a, b = b, a
        if _shape(a) != (T, E):
            return self.strip_detach(sel), None
        bias = b
        while (
            (v := _call(bias)) is not None
            and _is_reinterpret(v)
            and v.node.users.keys() <= {c.node}
        ):
            self.take(v.node)
            bias = v.args[0]
        if _shape(bias) != (E,) or _dtype(bias) != torch.float32:
            raise _Refuse(
                f"the bias {getattr(bias, 'name', bias)} added to the scores is not an fp32 [E] "
                f"tensor (shape {_shape(bias)}, dtype {_dtype(bias)})"
            )
        self.take(sel)
        return self.strip_detach(a), bias

    def score_function(self, scores: Node, T: int, E: int) -> tuple[Node, str, bool]:
        """(logits, score_func, pre_softmax)."""
        if _dtype(scores) != torch.float32:
            raise _Refuse(
                f"the scores {scores.name} are {_dtype(scores)}: the op computes in fp32 (cast the "
                "logits with .float() first, or softmax(..., dtype=torch.float32))"
            )
        c = _call(scores)
        if c is not None and c.name == "softmax" and _last_dim(c.arg(1, "dim"), 2):
            if c.arg(2, "dtype") not in (None, torch.float32):
                raise _Refuse(f"{scores.name}: softmax to {c.arg(2, 'dtype')}, not float32")
            logits, score_func, pre = c.args[0], "softmax", True
        elif c is not None and c.name == "sigmoid" and len(c.args) == 1:
            logits, score_func, pre = c.args[0], "sigmoid", True
        else:  # the raw logits: valid only when the weights are softmax-ed after the top-k
            return scores, "softmax", False
        if _shape(logits) != (T, E) or _dtype(logits) not in (
            torch.float32,
            torch.bfloat16,
            torch.float16,
        ):
            raise _Refuse(f"the logits {logits.name} are not [T, E] fp32/bf16/fp16")
        self.take(scores)
        return logits, score_func, pre

    # ---- the aux losses' sums ---------------------------------------------------------------

    def aux_sums(
        self, anchor: Node, logits: Node, scores: Node, score_func: str, pre_softmax: bool
    ) -> tuple[int, list[Node], list[Node]]:
        """(aux_seq_len, token sums, sequence sums) of the aux probabilities p: sums over the
        tokens (p.sum(0)) and per sequence (p.view(B, L, E).sum(1)) that come after the
        top-k (where the op's outputs exist), fp32, without keepdim."""
        T, E = _shape(logits)
        if score_func == "sigmoid":  # p = scores / scores.sum(-1, keepdim=True)
            probs = [
                u
                for u in scores.users
                if (c := _is(u, "div")) is not None
                and not c.inplace
                and c.args[0] is scores
                and (total := _is(c.args[1], "sum")) is not None
                and total.args[0] is scores
                and _last_dim(total.arg(1, "dim"), 2)
                and total.arg(2, "keepdim", False)
                and total.kwargs.get("dtype") is None
            ]
        else:  # p = softmax(logits): the scores themselves, or a softmax of their own
            probs = [scores] if pre_softmax else []
            probs += [
                u
                for u in logits.users
                if u is not scores
                and (c := _is(u, "softmax")) is not None
                and _last_dim(c.arg(1, "dim"), 2)
                and c.arg(2, "dtype") in (None, torch.float32)
            ]
        order = {n: i for i, n in enumerate(anchor.graph.nodes)}
        token, per_seq, seq_len = [], [], 0

        def is_sum(node: Node, dim: int, shape: tuple) -> bool:
            c = _is(node, "sum")
            return (
                c is not None
                and c.arg(1, "dim") in (dim, (dim,), [dim])
                and not c.arg(2, "keepdim", False)
                and c.kwargs.get("dtype") is None
                and _shape(node) == shape
                and order[node] > order[anchor]
            )

        for p in probs:
            if _dtype(p) != torch.float32 or _shape(p) != (T, E):
                continue
            for u in p.users:
                if is_sum(u, 0, (E,)):
                    token.append(u)
                    self.take(p, u)
                    continue
                c = _call(u)
                view = _shape(u)
                if c is None or not _is_reinterpret(c) or view is None or len(view) != 3:
                    continue
                B, L = view[0], view[1]
                if B * L != T or view[2] != E or (seq_len and L != seq_len):
                    continue
                sums = [v for v in u.users if is_sum(v, 1, (B, E))]
                if sums:
                    seq_len = L
                    per_seq += sums
                    self.take(p, u, *sums)
        if score_func == "sigmoid":  # the row sums of the folded p's go with them
            self.take(*(p.args[1] for p in probs if p in self.nodes))
        if not token and not per_seq:
            return 0, [], []
        return seq_len or T, token, per_seq

    # ---- the z-loss's logsumexp ------------------------------------------------------------

    def logsumexps(self, anchor: Node, logits: Node, bias: Node | None) -> tuple[list[Node], Node]:
        """(logsumexp(logits, -1) nodes, the node the op goes before): fp32 over the last dim,
        of the logits or of their fp32 cast, anywhere after the bias exists (the op then moves
        up to the first of them)."""
        T, E = _shape(logits)
        sources = [logits] + [
            u
            for u in logits.users
            if (c := _is(u, "float", "to")) is not None
            and not c.inplace
            and c.args[0] is logits
            and _dtype(u) == torch.float32
            and _shape(u) == (T, E)
            and _val(u).device == _val(logits).device
        ]
        order = {n: i for i, n in enumerate(anchor.graph.nodes)}
        after = order[bias] if bias is not None else -1
        found = []
        for src in sources:
            for u in src.users:
                c = _is(u, "logsumexp")
                if (
                    c is not None
                    and c.args[0] is src
                    and c.arg(1, "dim") in (-1, 1, (-1,), (1,), [-1], [1])
                    and _dtype(u) == torch.float32
                    and _shape(u) in ((T,), (T, 1))
                    and order[u] > after
                ):
                    found.append(u)
                    if src is not logits:
                        self.take(src)
        self.take(*found)
        return found, min([anchor, *found], key=order.__getitem__)

    # ---- weights and counts ---------------------------------------------------------------

    def weights(
        self, scores: Node, indices: list[Node], values: list[Node], values_are_scores: bool
    ) -> Node:
        """The first weights node: scores.gather(1, indices), or the top-k values."""
        for i in indices:
            for u in i.users:
                c = _is(u, "gather")
                if (
                    c is not None
                    and c.args[0] is scores
                    and c.arg(1, "dim") in (1, -1)
                    and c.arg(2, "index") is i
                    and not c.kwargs.get("sparse_grad", False)
                    and not c.inplace
                ):
                    self.take(u)
                    return u
        used = [v for v in values if v.users]
        if values_are_scores and used:
            return used[0]
        raise _Refuse(
            "no routing weights: the indices feed no scores.gather(1, indices) and the top-k "
            "values are not the scores (nothing to fuse, e.g. a top-k accuracy)"
        )

    def weight_chain(self, w: Node, post_softmax: bool) -> tuple[Node, bool, float]:
        """(last weights node, normalize, route_scale) following the weights forward."""
        normalize, scale = False, 1.0
        if post_softmax:
            nxt = [u for u in w.users if (c := _is(u, "softmax")) and _last_dim(c.arg(1, "dim"), 2)]
            c = _call(nxt[0]) if len(nxt) == 1 else None
            if (
                c is None
                or c.arg(2, "dtype") not in (None, torch.float32)
                or _dtype(c.node) != torch.float32
            ):
                raise _Refuse(
                    "the weights are the raw logits: neither softmax/sigmoid before the top-k "
                    "nor a float32 softmax after it"
                )
            self.take(c.node)
            w = c.node
        else:
            step = self.normalization(w)
            if step is not None:
                w, normalize = step, True
        step = self.scaling(w)
        if step is not None:
            w, scale = step
        return w, normalize, scale

    def normalization(self, w: Node) -> Node | None:
        """w / (w.sum(-1, keepdim=True) [+ 1e-20]) as a user of w, or None."""
        for u in w.users:
            c = _is(u, "div")
            if c is None or c.args[0] is not w or len(c.args) != 2 or c.kwargs:
                continue
            pattern, denom = [], c.args[1]
            add = _is(denom, "add")
            if add is not None and not add.inplace and len(add.args) == 2 and not add.kwargs:
                a, b = add.args
                eps, denom = (b, a) if isinstance(b, float) else (a, b)
                if eps != moe_route_op.NORMALIZE_EPS:
                    return None
                pattern.append(add.node)
            s = _is(denom, "sum")
            if (
                s is None
                or s.args[0] is not w
                or not _last_dim(s.arg(1, "dim"), 2)
                or not s.arg(2, "keepdim", False)
                or s.arg(3, "dtype") is not None
            ):
                return None
            if c.inplace and set(w.users) != {u, s.node}:
                return None  # an in-place divide whose input is read elsewhere
            self.take(u, s.node, *pattern)
            return u
        return None

    def scaling(self, w: Node) -> tuple[Node, float] | None:
        """w * constant as a user of w, or None."""
        for u in w.users:
            c = _is(u, "mul")
            if c is None or len(c.args) != 2 or c.kwargs:
                continue
            a, b = c.args
            scale = b if a is w else a if b is w and not c.inplace else None
            if isinstance(scale, bool) or not isinstance(scale, int | float):
                continue
            if c.inplace and set(w.users) != {u}:
                return None
            self.take(u)
            return u, float(scale)
        return None

    def counts(self, indices: list[Node], T: int, E: int, k: int) -> list[Node]:
        """Nodes computing tokens per expert from the indices."""
        found = []
        sources = list(indices)  # the indices, flattened to [T * k] and/or cast to float
        for node in sources:
            for u in node.users:
                c = _call(u)
                if c is None or u in sources or c.args[0] is not node:
                    continue
                flat = _is_reinterpret(c) and _shape(u) == (T * k,)
                if flat or (c.name in ("float", "to") and _shape(u) == _shape(node)):
                    sources.append(u)
        for src in sources:
            is_flat = _shape(src) == (T * k,)
            for u in src.users:
                c = _call(u)
                if c is None or (c.args[0] is not src and c.arg(2, "index") is not src):
                    continue
                if (
                    c.name == "bincount"
                    and is_flat
                    and c.arg(1, "weights") is None
                    and c.arg(2, "minlength", 0) == E
                    and _dtype(src) == torch.int64
                ):
                    found.append(self.counting(u, src, indices))
                elif (
                    c.name == "histc"
                    and c.arg(1, "bins", 100) == E
                    and c.arg(2, "min", 0) == 0
                    and c.arg(3, "max", 0) in (E, E - 1)
                ):
                    found.append(self.counting(u, src, indices))
                elif (
                    c.name in ("scatter_add", "index_add")
                    and is_flat
                    and self.ones_into_zeros(c, src, E)
                ):
                    found.append(self.counting(u, src, indices))
        return found

    def counting(self, node: Node, flat: Node, indices: list[Node]) -> Node:
        # The flattening / casting nodes between the indices and `flat`.
        n = flat
        while n not in indices:
            self.take(n)
            n = n.args[0]
        self.take(node)
        return node

    def ones_into_zeros(self, c: _Call, flat: Node, E: int) -> bool:
        zeros, ones = _call(c.args[0]), _call(c.arg(3, "source", c.kwargs.get("src")))
        ok = (
            c.arg(1, "dim") in (0, -1)
            and c.arg(2, "index") is flat
            and zeros is not None
            and _FILLS.get(zeros.name, None) == 0
            and _shape(zeros.node) == (E,)
            and ones is not None
            and _FILLS.get(ones.name, None) == 1
            and _shape(ones.node) == _shape(flat)
            and "alpha" not in c.kwargs
        )
        if ok and c.inplace and set(zeros.node.users) != {c.node}:
            return False
        if ok:
            self.take(zeros.node, ones.node)
        return ok


def _match(anchor: Node) -> _Router:
    m = _Matcher()
    sel_final, k, indices, values = m.selection(anchor)
    shape = _shape(sel_final)
    if shape is None or len(shape) != 2 or not all(isinstance(d, int) for d in shape):
        raise _Refuse(f"the top-k input {sel_final.name} is not a static [T, E] tensor ({shape})")
    T, E = shape
    if not indices:
        raise _Refuse("its indices are not used")
    sel, groups = m.group_limit(sel_final, T, E)
    scores, bias = m.biased(sel, T, E)
    logits, score_func, pre_softmax = m.score_function(scores, T, E)
    values_are_scores = bias is None and not m.detached
    w0 = m.weights(scores, indices, values, values_are_scores)
    weights, normalize, route_scale = m.weight_chain(w0, post_softmax=not pre_softmax)
    counts = m.counts(indices, T, E, k)
    aux_seq_len, token_sums, seq_sums = m.aux_sums(anchor, logits, scores, score_func, pre_softmax)
    lse, at = m.logsumexps(anchor, logits, bias)
    options = dict(
        score_func=score_func,
        pre_softmax=pre_softmax,
        num_groups=groups.get("num_groups", 1),
        topk_groups=groups.get("topk_groups", 1),
        normalize=normalize,
        route_scale=route_scale,
        group_score=groups.get("group_score", "top2"),
        aux_seq_len=aux_seq_len,
        return_lse=bool(lse),
    )
    for node in (logits, bias):
        if node is not None and not isinstance(_val(node), FakeTensor):
            raise _Refuse(
                f"{node.name} is a {type(_val(node)).__name__}, not a plain tensor (a DTensor "
                "under tensor or expert parallelism): the op is not wired for tensor subclasses"
            )
    try:  # the op's own checks, so that the rewrite cannot fail half-way
        moe_route_op.check_route_args(_val(logits), _val(bias), k, **options)
    except ValueError as e:
        raise _Refuse(str(e)) from None
    if not moe_route_op.triton_supports(_val(logits), options["num_groups"]):
        raise _Refuse(
            f"E={E} experts in {options['num_groups']} group(s) do not fit the kernel's tile "
            "(4096 experts, each group padded to a power of 2)"
        )
    if scores is logits:
        m.nodes.discard(logits)
    return _Router(
        anchor,
        logits,
        bias,
        k,
        options,
        indices,
        weights,
        counts,
        token_sums,
        seq_sums,
        lse,
        at,
        m.nodes,
    )


def _alias_root(node: Node) -> Node:
    while (c := _call(node)) is not None and (c.name in _ALIASING or c.inplace):
        if not isinstance(_val(c.args[0]), torch.Tensor):
            break
        node = c.args[0]
    return node


def _aliases(root: Node, stop: set[Node] = frozenset()) -> set[Node]:
    """root and every node viewing or mutating it (not looking past the nodes in `stop`)."""
    out, todo = {root}, [root]
    while todo:
        n = todo.pop()
        if n in stop:
            continue
        for u in n.users:
            c = _call(u)
            if c is not None and (c.name in _ALIASING or c.inplace) and c.args[0] is n:
                if u not in out:
                    out.add(u)
                    todo.append(u)
    return out


def _check_mutations(gm: torch.fx.GraphModule, r: _Router) -> None:
    """Refuse when erasing the router's in-place ops, or computing it all at the top-k from
    the logits, could change what some node sees."""
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    # Their readers get the op's outputs.
    rewired = {r.weights, *r.indices, *r.counts, *r.token_sums, *r.seq_sums, *r.lse}
    inputs = {_alias_root(r.logits)} | ({_alias_root(r.bias)} if r.bias is not None else set())
    watched = inputs | {_alias_root(n) for n in r.nodes}
    for node in gm.graph.nodes:
        c = _call(node)
        if c is None or not c.inplace or not isinstance(c.args[0], Node):
            continue
        root = _alias_root(c.args[0])
        if node in r.nodes:
            # Erased with the router: nothing outside it may read what it wrote.
            aliases = _aliases(root, rewired)
            for a in aliases - rewired:
                for u in a.users:
                    if u in r.nodes or u in aliases or order[u] <= order[node]:
                        continue
                    raise _Refuse(
                        f"the in-place {node.name} changes {root.name}, which {u.name} reads "
                        "afterwards"
                    )
        elif root in watched:
            # Kept: every router node reading that tensor must stay on the same side of it
            # (the op reads the logits and bias where the top-k was).
            reads = [order[u] for a in _aliases(root) for u in a.users if u in r.nodes]
            if root in inputs:
                reads.append(order[r.at])
            before = any(o < order[node] for o in reads)
            after = any(o > order[node] for o in reads)
            if after and (before or root not in inputs):
                raise _Refuse(f"{node.name} changes {root.name} in place inside the router")


def _rewrite(gm: torch.fx.GraphModule, r: _Router) -> tuple[Node, list[str]]:
    graph = gm.graph
    fake_mode = _val(r.logits).fake_mode  # _match checked that it is a FakeTensor
    meta_keys = ("stack_trace", "nn_module_stack", "source_fn_stack")
    with graph.inserting_before(r.at):
        route = graph.call_function(_OP, (r.logits, r.bias, r.top_k), dict(r.options))
        with fake_mode:
            outs = _OP(_val(r.logits), _val(r.bias), r.top_k, **r.options)
        route.meta["example_value"] = outs
        parts = []
        for i in range(len(outs)):
            part = graph.call_function(operator.getitem, (route, i))
            part.meta["example_value"] = outs[i]
            parts.append(part)
        for node in (route, *parts):
            for key in meta_keys:
                if key in r.anchor.meta:
                    node.meta[key] = r.anchor.meta[key]
    weights, indices, counts, aux_sums, lse = parts
    r.weights.replace_all_uses_with(weights)
    for node in r.lse:
        replacement = lse
        if _shape(node) != _shape(lse):  # keepdim=True: [T, 1]
            with graph.inserting_before(node):
                replacement = graph.call_function(torch.unsqueeze, (lse, -1))
            with fake_mode:
                replacement.meta["example_value"] = outs[4].unsqueeze(-1)
        node.replace_all_uses_with(replacement)
    for node in r.seq_sums:
        node.replace_all_uses_with(aux_sums)
    for node in r.token_sums:
        with graph.inserting_before(node):
            total = graph.call_function(torch.sum, (aux_sums, 0))
        with fake_mode:
            total.meta["example_value"] = outs[3].sum(0)
        node.replace_all_uses_with(total)
    for node in r.indices:
        node.replace_all_uses_with(indices)
    for node in r.counts:
        replacement = counts
        dtype = _dtype(node)
        if dtype != torch.int64:
            with graph.inserting_before(node):
                replacement = graph.call_method("to", (counts, dtype))
                with fake_mode:
                    replacement.meta["example_value"] = outs[2].to(dtype)
        node.replace_all_uses_with(replacement)
    # Erase the sub-graph back to front; what is still used elsewhere stays.
    order = {n: i for i, n in enumerate(graph.nodes)}
    kept = []
    for node in sorted(r.nodes, key=order.__getitem__, reverse=True):
        if node.users:
            kept.append(node.name)
        else:
            graph.erase_node(node)
    return route, sorted(kept)


def _candidates(gm: torch.fx.GraphModule) -> list[Node]:
    """Top-k / descending sorts over a 2-D tensor."""
    return [
        n
        for n in gm.graph.nodes
        if (c := _is(n, "topk", "sort", "argsort")) and len(_shape(c.arg(0, "input")) or ()) == 2
    ]


def _selects_groups(anchor: Node) -> bool:
    """Whether the indices of `anchor` (at most three nodes down) scatter a constant into a
    mask, as a group selection does: no note when such a top-k is not a router itself."""
    level, below = [anchor], []
    for _ in range(3):
        level = [u for n in level for u in n.users]
        below += level
    scatters = [c for u in below if (c := _is(u, "scatter")) is not None]
    return any(isinstance(c.arg(3, "value"), bool | int | float) for c in scatters)


@register_pass(
    "fuse_moe_router",
    stage="pre_grad",
    order=20,
    default_on=True,
    preserves_numerics=False,
)
def fuse_moe_router_pass(
    gm: torch.fx.GraphModule, example_inputs: Sequence[Any], *, ctx: PassContext
) -> torch.fx.GraphModule:
    """Replace the plain MoE router (scores, group limit, top-k, weights, counts) with
    graphtrain::moe_route."""
    # Order 20: after fuse_linear_cross_entropy (10); the router never contains a loss head.
    anchors = _candidates(gm)
    if not anchors:
        ctx.note("no top-k over 2-D scores in this graph: no router to fuse")
        return gm
    # Last first: a router's expert top-k comes after its group top-k, which goes with it.
    notes: list[tuple[int, str]] = []
    erased: set[Node] = set()
    for position, anchor in reversed(list(enumerate(anchors))):
        if anchor in erased:
            continue
        try:
            r = _match(anchor)
            _check_mutations(gm, r)
        except _Refuse as why:
            if not _selects_groups(anchor):
                notes.append((position, f"left {anchor.name} unchanged: {why}"))
            continue
        route, kept = _rewrite(gm, r)
        erased |= {n for n in r.nodes if n.name not in kept}
        options = ", ".join(f"{k}={v!r}" for k, v in r.options.items())
        bias = r.bias.name if r.bias is not None else None
        notes.append(
            (
                position,
                f"replaced the router ending in {anchor.name} with {route.name} = "
                f"graphtrain.moe_route(logits={r.logits.name}, bias={bias}, top_k={r.top_k}, "
                f"{options}); counts from {len(r.counts)} node(s)"
                + (f"; kept (used elsewhere): {', '.join(kept)}" if kept else ""),
            )
        )
    for _, note in sorted(notes):
        ctx.note(note)
    if erased:
        gm.graph.lint()
        gm.recompile()
    return gm
