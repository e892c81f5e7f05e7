"""How fuse_moe_router reads a router's selection: from the expert top-k back through the
group limit and the expert bias to the scores and the logits.

Not a pass: the first half of fuse_moe_router's matcher (moe_route_outputs.py reads the
outputs side: weights, counts, aux sums, logsumexps; moe_route.py is the pass). The spellings
it reads and its refusals: docs/design/moe_route.md. Every method raises Refuse with the reason
where the graph is not what the op computes.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch.fx import Node

from graphtrain.passes import fx
from graphtrain.passes.fx import Refuse


class SelectionMatcher:
    """Reads a router's selection back from its expert top-k; raises Refuse with the reason
    otherwise. `nodes` collects what it read (the sub-graph the op replaces)."""

    def __init__(self) -> None:
        self.nodes: set[Node] = set()
        self.detached = False  # a .detach() between the scores and the top-k

    def take(self, *nodes: Node) -> None:
        self.nodes.update(nodes)

    def strip_detach(self, node: Any) -> Any:
        while (c := fx.is_call(node, "detach", "contiguous")) is not None:
            self.detached |= c.name == "detach"
            self.take(c.node)
            node = c.args[0]
        return node

    # ---- top-k / sort selection ---------------------------------------------------------

    def selection(self, node: Node) -> tuple[Node, int, list[Node], list[Node]]:
        """(input, k, index nodes, value nodes) of a descending top-k over the last dim."""
        c = fx.call(node)
        if c is None:
            raise Refuse(f"{node.name} is not a top-k")
        x = c.arg(0, "input")
        ndim = len(fx.shape(x) or ())
        values: list[Node] = []
        if c.name == "topk":
            k, dim = c.arg(1, "k"), c.arg(2, "dim", -1)
            if not c.arg(3, "largest", True):
                raise Refuse(f"{node.name} takes the smallest values (largest=False)")
            indices = [u for u in node.users if fx.getitem_index(u, node) == 1]
            values = [u for u in node.users if fx.getitem_index(u, node) == 0]
            self.take(node, *indices, *values)
        elif c.name in ("sort", "argsort"):
            dim, descending = c.arg(1, "dim", -1), c.arg(2, "descending", False)
            if not descending:
                raise Refuse(f"{node.name} sorts in ascending order")
            full = [u for u in node.users if fx.getitem_index(u, node) == 1]
            if c.name == "argsort":
                full = [node]
            indices = [u for f in full for u in f.users if fx.prefix_slice(u) is not None]
            ks = {fx.prefix_slice(u) for u in indices}
            if len(ks) != 1:
                raise Refuse(f"{node.name}: its order is not cut to one top-k ([:, :k])")
            (k,) = ks
            self.take(node, *full, *indices)
        else:
            raise Refuse(f"{node.name} is not a top-k")
        if not fx.last_dim(dim, ndim) or ndim != 2 or not isinstance(k, int):
            raise Refuse(f"{node.name} is not a top-k over the last dim with a constant k")
        return x, k, indices, values

    def selection_of(self, index: Any) -> tuple[Node, int]:
        """(input, k) of the selection whose indices `index` are."""
        c = fx.is_call(index, "getitem")
        if c is None:
            raise Refuse(f"{getattr(index, 'name', index)} are not top-k indices")
        producer = c.args[0]
        if (
            fx.prefix_slice(index) is not None
            and (full := fx.is_call(producer, "getitem")) is not None
        ):
            producer = full.args[0]  # sort(...)[1][:, :k]; argsort(...)[:, :k] is direct
        x, k, indices, _ = self.selection(producer)
        if index not in indices:
            raise Refuse(f"{index.name} are not top-k indices")
        return x, k

    # ---- group limit ----------------------------------------------------------------------

    def group_limit(self, sel_final: Node, T: int, E: int) -> tuple[Node, dict[str, Any]]:
        """(sel [T, E], group options) from the top-k's input."""
        node = self.strip_detach(sel_final)
        c = fx.call(node)
        if c is not None and fx.is_reinterpret(c) and fx.is_call(c.args[0], "masked_fill"):
            fill = fx.call(c.args[0])
            self.take(node)
            three_d = True
        elif c is not None and c.name == "masked_fill" and fx.shape(c.args[0]) == (T, E):
            fill, three_d = c, False
        else:
            return node, {}
        self.take(fill.node)
        if three_d:
            grouped = self.strip_detach(fill.args[0])
            gshape = fx.shape(grouped)
            if gshape is None or len(gshape) != 3 or gshape[0] != T or gshape[1] * gshape[2] != E:
                raise Refuse(f"{fill.node.name} does not mask a [T, G, E/G] view of the scores")
            sel = self.ungroup(grouped, T, E)
        else:
            sel = self.strip_detach(fill.args[0])
        G, topk_groups, group_score = self.group_mask(fill.arg(1, "mask"), sel, T, E, three_d)
        value = fill.arg(2, "value")  # checked after the group selection is read (and claimed)
        if not isinstance(value, float) or not (value == -math.inf or value <= -3.4e38):
            raise Refuse(
                f"{fill.node.name} masks the dropped groups with {value!r}, not -inf (the op "
                "never picks a dropped expert; with 0.0 a negative kept score loses to them)"
            )
        return sel, dict(num_groups=G, topk_groups=topk_groups, group_score=group_score)

    def ungroup(self, grouped: Node, T: int, E: int) -> Node:
        """The [T, E] node that `grouped` ([T, G, E/G]) is a row-major view of."""
        c = fx.call(grouped)
        if c is None or not fx.is_reinterpret(c) or fx.shape(c.args[0]) != (T, E):
            raise Refuse(f"{grouped.name} is not a [T, G, E/G] view of [T, E] scores")
        self.take(grouped)
        return self.strip_detach(c.args[0])

    def group_mask(
        self, cond: Any, sel: Node, T: int, E: int, three_d: bool
    ) -> tuple[int, int, str]:
        """(G, topk_groups, group_score) of the mask condition of masked_fill."""
        # Walk back from the condition to the scatter that built the [T, G] mask.
        chain: list[fx.Call] = []
        node = cond
        while True:
            c = fx.call(node)
            if c is None:
                raise Refuse(f"cannot read the group mask at {getattr(node, 'name', node)}")
            if c.name == "scatter" or c.name in fx.FILLS:
                break
            chain.append(c)
            node = c.args[0]
        scatter = self.group_scatter(c)
        base = fx.call(scatter.args[0])
        G = (fx.shape(base.node) or (0, 0))[1]
        if fx.shape(base.node) != (T, G) or G < 2 or E % G:
            raise Refuse(f"the group mask {base.node.name} is not [T, G] with G dividing E={E}")
        EPG = E // G
        fill_value = (
            base.arg(2 if base.name == "new_full" else 1, "fill_value")
            if fx.FILLS[base.name] is None
            else fx.FILLS[base.name]
        )
        value = scatter.arg(3, "value", scatter.kwargs.get("src"))
        if not isinstance(fill_value, bool | int | float) or not isinstance(
            value, bool | int | float
        ):
            raise Refuse(f"{scatter.node.name} does not scatter a constant into a constant mask")
        if bool(fill_value) == bool(value):
            raise Refuse(f"{scatter.node.name} leaves the mask {base.node.name} constant")
        marks_dropped = bool(fill_value)  # ones + False: True where dropped
        self.take(base.node, scatter.node)
        # Forward through the chain: negations flip, casts keep, layouts go
        # [T, G] -> [T, G, 1] -> (expand) [T, G, EPG] -> [T, E], checked on the shapes.
        reshapes = {((T, G), (T, G, 1)), ((T, G, EPG), (T, E))}
        shape = (T, G)
        for c in reversed(chain):
            out = fx.shape(c.node)
            if c.name == "logical_not" or (c.name == "eq" and c.args[1] in (0, False)):
                marks_dropped = not marks_dropped
                ok = out == shape
            elif fx.cast_dtype(c.node) is not None:
                ok = out == shape
            elif c.name == "expand":
                ok = shape == (T, G, 1) and out == (T, G, EPG)
            elif fx.is_reinterpret(c):
                ok = out == shape or (shape, out) in reshapes
            else:
                ok = False
            if not ok or c.inplace:
                raise Refuse(f"cannot prove {c.node.name} keeps the group mask's layout")
            self.take(c.node)
            shape = out
        wanted = ((T, G, 1), (T, G, EPG)) if three_d else ((T, E),)
        if shape not in wanted:
            raise Refuse(f"the mask {cond.name} does not broadcast group-wise onto the scores")
        if not marks_dropped:
            raise Refuse(f"the mask {cond.name} marks the kept groups, masked_fill drops them")
        # The group selection: top-k of the group scores.
        gscores, topk_groups = self.selection_of(scatter.arg(2, "index"))
        if fx.shape(gscores) != (T, G):
            raise Refuse(f"the group scores {gscores.name} are not [T, G]")
        return G, topk_groups, self.group_score(gscores, sel, T, E, G)

    def group_scatter(self, c: fx.Call) -> fx.Call:
        """The scatter writing the mask (a functional scatter, or the one in-place scatter_ on
        a constant tensor that the chain reads directly)."""
        if c.name in fx.FILLS:
            writes = [u for u in c.node.users if (s := fx.is_call(u, "scatter")) and s.inplace]
            if len(writes) != 1:
                raise Refuse(f"the mask {c.node.name} is not written by exactly one scatter_")
            c = fx.call(writes[0])
        dim = c.arg(1, "dim")
        if (
            dim not in (1, -1)
            or c.kwargs.get("reduce") is not None
            or not fx.is_call(c.args[0], *fx.FILLS)
        ):
            raise Refuse(f"{c.node.name} is not a scatter along the groups into a constant mask")
        return c

    def group_score(self, gscores: Node, sel: Node, T: int, E: int, G: int) -> str:
        c = fx.call(gscores)
        kind, grouped = None, None
        if c is not None and c.name == "amax" and fx.last_dim(c.arg(1, "dim"), 3):
            kind, grouped = "max", c.args[0]
        elif (
            c is not None
            and c.name == "getitem"
            and c.args[1] == 0
            and fx.is_call(c.args[0], "max")
        ):
            m = fx.call(c.args[0])
            if fx.last_dim(m.arg(1, "dim"), 3) and not m.arg(2, "keepdim", False):
                kind, grouped = "max", m.args[0]
                self.take(m.node)
        elif c is not None and c.name == "sum" and fx.last_dim(c.arg(1, "dim"), 3):
            top = fx.is_call(c.args[0], "getitem")
            t = top is not None and top.args[1] == 0 and fx.is_call(top.args[0], "topk")
            if (
                t
                and t.arg(1, "k") == min(2, E // G)  # models write topk(min(2, E/G))
                and fx.last_dim(t.arg(2, "dim", -1), 3)
                and t.arg(3, "largest", True)
            ):
                kind, grouped = "top2", t.args[0]
                self.take(top.node, t.node)
        if kind is None or (c.name != "getitem" and c.arg(2, "keepdim", False)):
            raise Refuse(f"the group score {gscores.name} is neither the max nor the top-2 sum")
        self.take(gscores)
        if fx.shape(grouped) != (T, G, E // G) or self.ungroup(grouped, T, E) is not sel:
            raise Refuse(f"the group score {gscores.name} is not over the selection scores")
        return kind

    # ---- scores, bias, logits -------------------------------------------------------------

    def biased(self, sel: Node, T: int, E: int) -> tuple[Node, Node | None]:
        """(scores, bias) of sel = scores (+ bias)."""
        c = fx.call(sel)
        if c is None or c.name != "add" or c.inplace or "alpha" in c.kwargs or len(c.args) != 2:
            return self.strip_detach(sel), None
        a, b = c.args
        if fx.shape(b) == (T, E) and fx.shape(a) != (T, E):
            a, b = b, a
        if fx.shape(a) != (T, E):
            return self.strip_detach(sel), None
        bias = b
        while (
            (v := fx.call(bias)) is not None
            and fx.is_reinterpret(v)
            and v.node.users.keys() <= {c.node}
        ):
            self.take(v.node)
            bias = v.args[0]
        if fx.shape(bias) != (E,) or fx.dtype(bias) != torch.float32:
            raise Refuse(
                f"the bias {getattr(bias, 'name', bias)} added to the scores is not an fp32 [E] "
                f"tensor (shape {fx.shape(bias)}, dtype {fx.dtype(bias)})"
            )
        self.take(sel)
        return self.strip_detach(a), bias

    def score_function(self, scores: Node, T: int, E: int) -> tuple[Node, str, bool]:
        """(logits, score_func, pre_softmax)."""
        if fx.dtype(scores) != torch.float32:
            if fx.cast_dtype(scores) is not None and fx.dtype(scores.args[0]) == torch.float32:
                how = (  # Megatron's softmax(logits, dtype=float32).type_as(logits)
                    f"fp32 {scores.args[0].name} cast back to it; the op keeps its scores in fp32 "
                    "(selection and weights would round differently)"
                )
            else:
                how = (
                    "the op computes in fp32 (cast the logits with .float() first, or "
                    "softmax(..., dtype=torch.float32))"
                )
            raise Refuse(f"the scores {scores.name} are {fx.dtype(scores)}: {how}")
        c = fx.call(scores)
        if c is not None and c.name == "softmax" and fx.last_dim(c.arg(1, "dim"), 2):
            if c.arg(2, "dtype") not in (None, torch.float32):
                raise Refuse(f"{scores.name}: softmax to {c.arg(2, 'dtype')}, not float32")
            logits, score_func, pre = c.args[0], "softmax", True
        elif c is not None and c.name == "sigmoid" and len(c.args) == 1:
            logits, score_func, pre = c.args[0], "sigmoid", True
        else:  # the raw logits: valid only when the weights are softmax-ed after the top-k
            return scores, "softmax", False
        if fx.shape(logits) != (T, E) or fx.dtype(logits) not in (
            torch.float32,
            torch.bfloat16,
            torch.float16,
        ):
            raise Refuse(f"the logits {logits.name} are not [T, E] fp32/bf16/fp16")
        self.take(scores)
        return logits, score_func, pre
