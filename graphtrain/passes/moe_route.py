"""Pass fuse_moe_router: the plain MoE router sub-graph -> graphtrain::moe_route.

What
    In the Dynamo graph (pre-grad, torch IR) it finds the routing sub-graph from the router
    logits to the routing weights and expert indices, starting from each top-k (or descending
    sort) over a 2-D tensor, last first, and replaces it with one graphtrain.moe_route(logits,
    bias, top_k, ...) node: scores (softmax or sigmoid), the expert bias, the group limit
    (moe_route_selection.py), the weights' softmax / normalisation / scale, the tokens per
    expert, the aux losses' sums, the balance losses' plain counts and the z-loss's logsumexp
    (moe_route_outputs.py). It reads by meaning, not spelling, after canonicalize. The
    spellings, what stays in the graph and every refusal: docs/design/moe_route.md. The op:
    graphtrain/custom_ops/moe_route/. Matched model line: Router.forward (models/moe.py).
    Every refusal leaves the graph as it was and is stated in a note.

Invariant and numerics (preserves_numerics=False)
    Only the op's outputs are rewired; matched nodes still used elsewhere stay. Indices, counts
    and plain counts are exactly the graph's when no two scores are equal; on exact ties the op
    takes the lower expert (and group) index, as a stable descending sort does. Weights, aux
    sums and logsumexps equal the graph's up to rounding (bitwise on CPU for the spec's code;
    the backward is a closed form, a few ulps). w / w.sum() becomes w / (w.sum() + 1e-20):
    identical in fp32 unless the k weights sum below 1.7e-13, where the op gives 0, not NaN.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx
from torch._subclasses.fake_tensor import FakeTensor
from torch.fx import Node

from graphtrain.custom_ops.moe_route import check_route_args, triton_supports
from graphtrain.passes import fx
from graphtrain.passes.fx import Refuse
from graphtrain.passes.moe_route_outputs import OutputMatcher
from graphtrain.passes.registry import PassContext, register_pass

_OP = torch.ops.graphtrain.moe_route.default


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
    plain_token: list[Node]  # the plain top-k's map .sum(0): become plain_counts.sum(0)
    plain_seq: list[Node]  # its .view(B, L, E).sum(1): become plain_counts
    at: Node  # the op goes right before this node: the anchor or an earlier logsumexp
    nodes: set[Node]  # every node of the sub-graph

    @property
    def rewired(self) -> set[Node]:
        """The nodes whose readers get the op's outputs."""
        return {
            self.weights,
            *self.indices,
            *self.counts,
            *self.token_sums,
            *self.seq_sums,
            *self.lse,
            *self.plain_token,
            *self.plain_seq,
        }


def _match(m: OutputMatcher, anchor: Node) -> _Router:
    """The router around `anchor`, read by `m` (whose nodes say how far it got on a Refuse)."""
    sel_final, k, indices, values = m.selection(anchor)
    shape = fx.shape(sel_final)
    if shape is None or len(shape) != 2 or not all(isinstance(d, int) for d in shape):
        raise Refuse(f"the top-k input {sel_final.name} is not a static [T, E] tensor ({shape})")
    T, E = shape
    if not indices:
        raise Refuse("its indices are not used")
    sel, groups = m.group_limit(sel_final, T, E)
    scores, bias = m.biased(sel, T, E)
    logits, score_func, pre_softmax = m.score_function(scores, T, E)
    values_are_scores = bias is None and not m.detached
    w0 = m.weights(scores, indices, values, values_are_scores)
    weights, normalize, route_scale = m.weight_chain(w0, post_softmax=not pre_softmax)
    counts = m.counts(indices, T, E, k)
    aux_seq_len, token_sums, seq_sums = m.aux_sums(anchor, logits, scores, score_func, pre_softmax)
    reuse = bias is None and groups.get("topk_groups", 1) >= groups.get("num_groups", 1)
    seq_len = aux_seq_len if seq_sums else 0
    plain_len, plain_token, plain_seq = m.plain_counts(anchor, scores, indices, k, reuse, seq_len)
    if plain_len:
        aux_seq_len = plain_len if plain_seq else (aux_seq_len or plain_len)
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
        count_plain=bool(plain_len),
    )
    for node in (logits, bias):
        if node is not None and not isinstance(fx.val(node), FakeTensor):
            raise Refuse(
                f"{node.name} is a {type(fx.val(node)).__name__}, not a plain tensor (a DTensor "
                "under tensor or expert parallelism): the op is not wired for tensor subclasses"
            )
    try:  # the op's own checks, so that the rewrite cannot fail half-way
        check_route_args(fx.val(logits), fx.val(bias), k, **options)
    except ValueError as e:
        raise Refuse(str(e)) from None
    if not triton_supports(fx.val(logits), options["num_groups"]):
        raise Refuse(
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
        plain_token,
        plain_seq,
        at,
        m.nodes,
    )


def _rewrite(gm: torch.fx.GraphModule, r: _Router) -> tuple[Node, list[str]]:
    graph = gm.graph
    with graph.inserting_before(r.at):
        route = fx.emit(
            graph, "call_function", _OP, (r.logits, r.bias, r.top_k), r.options, like=r.anchor
        )
        parts = [
            fx.emit(graph, "call_function", operator.getitem, (route, i), like=r.anchor)
            for i in range(len(fx.val(route)))
        ]
    weights, indices, counts, aux_sums, lse, plain_counts = parts
    r.weights.replace_all_uses_with(weights)
    for node in r.indices:
        node.replace_all_uses_with(indices)
    for node in r.seq_sums:
        node.replace_all_uses_with(aux_sums)
    for node in r.token_sums:
        _replace(graph, node, torch.sum, (aux_sums, 0))
    for node in r.plain_seq:  # fp32, as the op's (the matcher checked)
        node.replace_all_uses_with(plain_counts)
    for node in r.plain_token:
        _replace(graph, node, torch.sum, (plain_counts, 0))
    for node in r.lse:
        if fx.shape(node) != fx.shape(lse):  # keepdim=True: [T, 1]
            _replace(graph, node, torch.unsqueeze, (lse, -1))
        else:
            node.replace_all_uses_with(lse)
    for node in r.counts:
        if fx.dtype(node) != torch.int64:
            _replace(graph, node, "to", (counts, fx.dtype(node)))
        else:
            node.replace_all_uses_with(counts)
    # Erase the sub-graph back to front; what is still used elsewhere stays.
    order = {n: i for i, n in enumerate(graph.nodes)}
    kept = []
    for node in sorted(r.nodes, key=order.__getitem__, reverse=True):
        if node.users:
            kept.append(node.name)
        else:
            graph.erase_node(node)
    return route, sorted(kept)


def _replace(graph: torch.fx.Graph, node: Node, target: Any, args: tuple) -> None:
    """The uses of `node` read target(*args) instead (a reduction or cast of an op output)."""
    op = "call_method" if isinstance(target, str) else "call_function"
    with graph.inserting_before(node):
        node.replace_all_uses_with(fx.emit(graph, op, target, args))


def _candidates(gm: torch.fx.GraphModule) -> list[Node]:
    """Top-k / descending sorts over a 2-D tensor."""
    return [
        n
        for n in gm.graph.nodes
        if (c := fx.is_call(n, "topk", "sort", "argsort"))
        and len(fx.shape(c.arg(0, "input")) or ()) == 2
    ]


@register_pass("fuse_moe_router", preserves_numerics=False)
def fuse_moe_router_pass(
    gm: torch.fx.GraphModule, example_inputs: Sequence[Any], *, ctx: PassContext
) -> torch.fx.GraphModule:
    """Replace the plain MoE router (scores, group limit, top-k, weights, counts) with
    graphtrain::moe_route."""
    anchors = _candidates(gm)
    if not anchors:
        ctx.note("no top-k over 2-D scores in this graph: no router to fuse")
        return gm
    # Last first: a router's expert top-k comes after its group top-k, which goes with it.
    # A top-k that an earlier attempt read as a router's group selection gets no note of its
    # own (that router's note says what happened), nor does one that a router took with it (the
    # balance losses' plain top-k, refused on its own as it feeds no weights); every other
    # refusal is noted.
    notes: list[tuple[int, Node | None, str]] = []
    erased: set[Node] = set()
    claimed: set[Node] = set()
    for position, anchor in reversed(list(enumerate(anchors))):
        if anchor in erased:
            continue
        m = OutputMatcher()
        try:
            r = _match(m, anchor)
            inputs = {r.logits} | ({r.bias} if r.bias is not None else set())
            fx.check_mutations(gm.graph, r.nodes, r.rewired, inputs, r.at)
        except Refuse as why:
            if anchor not in claimed:
                notes.append((position, anchor, f"left {anchor.name} unchanged: {why}"))
            claimed |= m.nodes
            continue
        claimed |= r.nodes
        route, kept = _rewrite(gm, r)
        erased |= {n for n in r.nodes if n.name not in kept}
        options = ", ".join(f"{k}={v!r}" for k, v in r.options.items())
        bias = r.bias.name if r.bias is not None else None
        notes.append(
            (
                position,
                None,
                f"replaced the router ending in {anchor.name} with {route.name} = "
                f"graphtrain.moe_route(logits={r.logits.name}, bias={bias}, top_k={r.top_k}, "
                f"{options}); counts from {len(r.counts)} node(s)"
                + (f"; kept (used elsewhere): {', '.join(kept)}" if kept else ""),
            )
        )
    for _, anchor, note in sorted(notes, key=lambda n: n[0]):
        if anchor is None or anchor not in erased:
            ctx.note(note)
    return fx.finish(gm, bool(erased))
