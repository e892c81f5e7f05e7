"""Pass gated_delta_rule: the Gated DeltaNet recurrence region -> graphtrain::chunk_gated_delta_rule.

What
    The model marks its recurrence (models.gated_deltanet.gated_delta_rule) with two torch-native
    markers that do nothing in eager: torch.compiler.nested_compile_region, so that the Dynamo
    graph holds the whole recurrence as one node
        out = invoke_subgraph(subgraph, name, q, k, v, g, beta[, segments]);  o = out[0]
    (graphtrain.compile keeps a region called once as such a node instead of inlining it), and
    torch.fx.traceback.annotate, which tags the subgraph's nodes with
    {REGION_KEY: {"chunk_size": C, "scale": s}}. The pass replaces each tagged node with
        o = graphtrain.chunk_gated_delta_rule(q, k, v, g, beta, segments, scale=s, chunk_size=C)
    and drops the subgraph (compile.gdr_form "inline": a call of `chunked_form`, which
    AOTAutograd traces through; docs/design/gated_delta_rule.md). Other regions stay.

Why this marker and not a pattern: docs/design/gated_delta_rule.md.

Refusals (the graph is left as it was and ctx.note says why)
    operands that are not the region's (count, shapes or dtypes not those of q, k, v, g, beta,
    segments), DTensors, symbolic shapes, a region output used other than as out[0].

Invariant and numerics (preserves_numerics=False)
    The graph's outputs keep their values and dtypes. On CPU the op runs the model's own
    chunked code and its backward is that code's vjp: results equal eager bitwise (the inline
    form is that code in the graph). On CUDA the Triton kernels (and, inline, Inductor's fused
    chunk terms) sum in another order: agreement to fp32 rounding.
"""

from __future__ import annotations

import operator
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.fx
from torch import Tensor
from torch.fx import Node

import graphtrain.custom_ops.gated_delta_rule as gdr  # registers the op
from graphtrain.passes import fx
from graphtrain.passes.fx import Refuse, plain_tensor
from graphtrain.passes.registry import PassContext, register_pass
from models.gated_deltanet import REGION_KEY

_OP = torch.ops.graphtrain.chunk_gated_delta_rule.default
_INVOKE_SUBGRAPH = torch.ops.higher_order.invoke_subgraph
FORMS = ("op", "inline")  # compile.gdr_form (module docstring)


def _region_options(gm: torch.fx.GraphModule, node: Node) -> dict[str, Any] | None:
    """The region's annotation {"chunk_size", "scale"} when `node` invokes a tagged subgraph."""
    if node.op != "call_function" or node.target is not _INVOKE_SUBGRAPH:
        return None
    holder = node.args[0]
    sub = getattr(gm, holder.target, None) if isinstance(holder, Node) else None
    if not isinstance(sub, torch.fx.GraphModule):
        return None
    for inner in sub.graph.nodes:
        options = inner.meta.get("custom", {}).get(REGION_KEY)
        if options is not None:
            return options
    return None


def _check_operands(operands: Sequence[Any]) -> list[Node | None]:
    if len(operands) not in (5, 6) or not all(isinstance(x, Node) for x in operands):
        raise Refuse(f"{len(operands)} operands, expected q, k, v, g, beta[, segments]")
    names = ("q", "k", "v", "g", "beta")
    q, k, v, g, beta = (plain_tensor(x, n) for x, n in zip(operands[:5], names, strict=True))
    if q.dim() != 4 or k.shape != q.shape or v.dim() != 4 or v.shape[:3] != q.shape[:3]:
        raise Refuse(f"q, k, v shapes {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if g.shape != q.shape[:3] or beta.shape != q.shape[:3]:
        raise Refuse(f"g, beta shapes {tuple(g.shape)}, {tuple(beta.shape)}")
    segments = None
    if len(operands) == 6:
        seg = plain_tensor(operands[5], "segments")
        if seg.dtype != torch.int64 or seg.shape != q.shape[:2]:
            raise Refuse(f"segments {seg.dtype} {tuple(seg.shape)}, expected int64 (B, T)")
        segments = operands[5]
    return [*operands[:5], segments]


def _choice(options: Mapping[str, Any]) -> tuple[str, str]:
    """(compile.gdr_kernels, compile.gdr_form), checked: a bad value, "fla" without FLA or
    with the inline form raises, naming it."""
    kernels, form = options.get("gdr_kernels", "auto"), options.get("gdr_form", "op")
    if kernels not in gdr.KERNELS:
        raise ValueError(f"compile.gdr_kernels must be one of {gdr.KERNELS}, got {kernels!r}")
    if form not in FORMS:
        raise ValueError(f"compile.gdr_form must be one of {FORMS}, got {form!r}")
    if kernels == "fla" and form == "inline":
        raise ValueError("compile.gdr_form='inline' takes graphtrain's kernels, not 'fla'")
    if kernels == "fla":
        gdr.fla_module()
    return kernels, form


def chunked_form(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, segments: Tensor | None,
    *, scale: float, chunk_size: int,
) -> Tensor:  # fmt: skip
    """The recurrence as compile.gdr_form = "inline" leaves it in the graph: the model's chunked
    form with our kernels in its slots on CUDA (the op's Triton path, not wrapped in the op), the
    model's own code elsewhere (CPU, float64), as the op's forward chooses."""
    opts = gdr.GatedDeltaRuleOptions(scale, chunk_size, "triton")
    if gdr.choose_kernels("triton", v.dtype, v.device.type) == "triton":
        return gdr.chunk_gated_delta_rule_triton(q, k, v, g, beta, segments, opts)
    return gdr.chunk_gated_delta_rule_ref(q, k, v, g, beta, segments, opts)


def _rewrite(
    gm: torch.fx.GraphModule, node: Node, options: dict[str, Any], kernels: str, form: str
) -> str:
    """Replace the region `node` with the op, or with a call of chunked_form (form "inline")."""
    args = _check_operands(node.args[2:])
    users = list(node.users)
    if not all(u.target is operator.getitem and u.args[1] == 0 for u in users):
        raise Refuse(f"its output is used other than as {node.name}[0]")
    graph = gm.graph
    kwargs = {"scale": float(options["scale"]), "chunk_size": int(options["chunk_size"])}
    if form == "inline":
        target, kernels = chunked_form, "triton"
    else:
        target, kwargs["kernels"] = _OP, kernels
    v = fx.val(args[2])
    runs = gdr.choose_kernels(kernels, v.dtype, v.device.type)
    dk = fx.val(args[0]).shape[-1]
    refusal = runs == "triton" and gdr.triton_refusal(kwargs["chunk_size"], dk)
    if refusal:
        raise Refuse(refusal)
    with graph.inserting_before(node):
        new = fx.emit(graph, "call_function", target, tuple(args), kwargs, like=node)
    for user in users:
        user.replace_all_uses_with(new)
        graph.erase_node(user)
    holder = node.args[0]
    graph.erase_node(node)
    if not holder.users:
        graph.erase_node(holder)
        delattr(gm, holder.target)
    names = ", ".join("None" if a is None else a.name for a in args)
    call = "graphtrain.chunk_gated_delta_rule" if form == "op" else "chunked_form"
    settings = ", ".join(f"{key}={value!r}" for key, value in kwargs.items() if key != "scale")
    return (
        f"replaced the region {node.name} with {new.name} = {call}({names}, "
        f"scale={kwargs['scale']:.6g}, {settings}); on {v.device.type}: {runs}"
    )


# On by default since an H200 timed hybrid-1b's step with it at 1.86x plain torch.compile of the
# chunked form, the same loss (RESULTS.md, 2026-11-30); "-gated_delta_rule" switches it off.
@register_pass("gated_delta_rule", stage="pre_grad", default_on=True, preserves_numerics=False)
def gated_delta_rule_pass(
    gm: torch.fx.GraphModule, example_inputs: Sequence[Any], *, ctx: PassContext
) -> torch.fx.GraphModule:
    """Replace each Gated DeltaNet recurrence region (models.gated_deltanet.gated_delta_rule)
    with graphtrain::chunk_gated_delta_rule (or, compile.gdr_form = "inline", chunked_form)."""
    changed = found = False
    for node in list(gm.graph.nodes):
        options = _region_options(gm, node)
        if options is None:
            continue
        found = True
        try:
            ctx.note(_rewrite(gm, node, options, *_choice(ctx.options)))
            changed = True
        except Refuse as why:
            ctx.note(f"left {node.name} unchanged: {why}")
    if not found:
        ctx.note("no Gated DeltaNet recurrence region in this graph")
    return fx.finish(gm, changed)
