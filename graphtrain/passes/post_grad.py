"""Shared helpers of graphtrain's post-grad passes, which rewrite the aten graphs AOT autograd
hands to Inductor (after its decompositions): matching calls (`is_op`, `is_aten_view`,
`only_user`, `match_sequence_gather`) and writing them (`AtenBuilder`, which records each new
node's fake value and refuses an op Inductor cannot lower there). The pre-grad helpers, and the
one way a matcher refuses (`Refuse`): graphtrain.passes.fx; in full: docs/design/passes.md."""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.fx
from torch.fx import Node
from torch.fx.node import map_arg

from graphtrain.passes.fx import Refuse


def is_op(node: Any, target: Any) -> bool:
    """`node` calls `target` (an aten / functional-collective overload)."""
    return isinstance(node, Node) and node.op == "call_function" and node.target == target


# AOT autograd writes view / _unsafe_view; Inductor's own post-grad passes turn them into reshape.
ATEN_VIEWS = (
    torch.ops.aten.view.default,
    torch.ops.aten.reshape.default,
    torch.ops.aten._unsafe_view.default,
)


def is_aten_view(node: Any) -> bool:
    return any(is_op(node, target) for target in ATEN_VIEWS)


def only_user(node: Node) -> Node | None:
    return next(iter(node.users)) if len(node.users) == 1 else None


class AtenBuilder:
    """Inserts aten nodes before `anchor`, each with its fake value (Inductor lowers from them).
    An op Inductor cannot lower at this stage is refused as it is written (`lowerable`), under
    aot_eager too, where nothing would lower it."""

    def __init__(self, graph: torch.fx.Graph, anchor: Node, fake_mode: Any) -> None:
        self.graph, self.anchor, self.fake_mode = graph, anchor, fake_mode

    def __call__(self, target: Any, *args: Any, **kwargs: Any) -> Node:
        if not lowerable(target):
            raise TypeError(
                f"{target} has a decomposition but no lowering in Inductor: a post-grad graph "
                "cannot hold it (Inductor's decompositions have run); write what it decomposes to"
            )
        with self.graph.inserting_before(self.anchor):
            node = self.graph.call_function(target, args, kwargs)
        values = map_arg((args, kwargs), lambda n: n.meta["val"])
        with self.fake_mode:
            node.meta["val"] = target(*values[0], **values[1])
        return node


@functools.cache
def lowerable(target: Any) -> bool:
    """Whether Inductor lowers `target` in a post-grad graph: its lowering asserts on an op with
    a decomposition and no lowering ("both a fallback and a decomp for same op": aten.t,
    aten.stack); other ops are lowered or run as fallbacks."""
    from torch._inductor.decomposition import select_decomp_table
    from torch._inductor.lowering import lowerings

    return target in lowerings or target not in select_decomp_table()


def match_sequence_gather(ag: Node) -> tuple[Node, list[Node], Node]:
    """(wait, [split, *pieces], cat) of all_gather_into_tensor(x [B, S, D], tp, group) as AOT
    autograd writes a Shard(1) -> Replicate redistribute:
        w = wait_tensor(ag)  [tp * B, S, D], rank-major;  cat(split(w, B), dim=1)  [B, tp * S, D]
    or Refuse."""
    c10d = torch.ops._c10d_functional
    wait = only_user(ag)
    if not is_op(wait, c10d.wait_tensor.default):
        raise Refuse("its result is not waited on once")
    split, x_shape = only_user(wait), list(ag.args[0].meta["val"].shape)
    if (
        len(x_shape) != 3
        or not is_op(split, torch.ops.aten.split.Tensor)
        or split.args[1] != x_shape[0]
    ):
        raise Refuse("the gathered tensor is not split back into the ranks' [B, S, D] pieces")
    if len(split.args) > 2 and split.args[2] != 0:
        raise Refuse("the gathered tensor is split on another dim than the ranks'")
    pieces = sorted(split.users, key=lambda n: n.args[1])
    cat = only_user(pieces[0])
    if (
        not is_op(cat, torch.ops.aten.cat.default)
        or list(cat.args[0]) != pieces
        or cat.args[1:] != (1,)
    ):
        raise Refuse("the gathered pieces are not concatenated on the sequence dim")
    return wait, [split, *pieces], cat
