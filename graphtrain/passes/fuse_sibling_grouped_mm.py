"""Pass fuse_sibling_grouped_mm: two grouped GEMMs of one input -> one over concatenated weights.

What
    In the Dynamo graph (pre-grad, torch IR) it finds pairs of torch._grouped_mm that multiply
    the same input rows with the same group offsets,
        a = torch._grouped_mm(x, Wa.transpose(-2, -1), offs=offs)      Wa [E, Fa, D]
        b = torch._grouped_mm(x, Wb.transpose(-2, -1), offs=offs)      Wb [E, Fb, D]
    (SwiGLU experts' w1 and w3, once fuse_moe_dispatch has given both the same permuted
    input) and replaces them with
        ab = torch._grouped_mm(x, torch.cat([Wa, Wb], 1).transpose(-2, -1), offs=offs)
        a, b = ab.narrow(-1, 0, Fa), ab.narrow(-1, Fa, Fb)
    The weights' producers (autocast's casts) move before the first GEMM when they came after
    it. Every refusal leaves the graph as it was and is stated in a note; inputs with a single
    grouped GEMM get none.

Invariant and numerics (preserves_numerics=False)
    Only the two GEMMs, their transposes and their uses change; every element of a and b is
    the same dot product, but the GEMM kernel (tile shape, hence summation order) may differ.
    Why and the refusals: docs/design/moe_dispatch.md.

concatenated_weights(model, compile_cfg): the parameters it concatenates where the trainer runs
it, which graphtrain.precision gives no working copy.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.fx
from torch import nn
from torch.fx import Node

from graphtrain.passes import fx
from graphtrain.passes.fx import Refuse, val
from graphtrain.passes.registry import PassContext, register_pass, trainer_runs
from models.moe import GroupedExperts

if TYPE_CHECKING:
    from graphtrain.config import CompileConfig

PASS = "fuse_sibling_grouped_mm"


def concatenated_weights(model: nn.Module, compile_cfg: CompileConfig) -> list[nn.Parameter]:
    """Where the trainer runs this pass (compile.enable, the pass not switched off): the
    parameters it concatenates in a models/ model, each GroupedExperts' w1 and w3 (swiglu_experts
    multiplies the same rows by both); else none. The concatenation reads them once per forward
    and casts as it copies, and it is what the backward keeps: a bf16 working copy of them would
    add its 2 bytes a weight to the peak and save no cast (docs/design/working_weights.md)."""
    if not trainer_runs(PASS, compile_cfg):
        return []
    return [p for m in model.modules() if isinstance(m, GroupedExperts) for p in (m.w1, m.w3)]


def _is_grouped_mm(node: Node) -> bool:
    return node.op == "call_function" and node.target is torch._grouped_mm


def _offs(node: Node) -> Any:
    return node.args[2] if len(node.args) > 2 else node.kwargs.get("offs")


def _weight(gemm: Node) -> Node:
    """W of a grouped GEMM whose second operand is W.transpose(-2, -1), W [E, F, D]."""
    if len(gemm.args) > 3 or set(gemm.kwargs) - {"offs"}:
        raise Refuse(f"{gemm.name} has a bias or an out_dtype")
    t = gemm.args[1]
    dims = tuple(t.args[1:3]) if isinstance(t, Node) and t.op == "call_method" else ()
    if not (t.target == "transpose" and dims in ((-2, -1), (-1, -2), (1, 2), (2, 1))):
        raise Refuse(f"the weight operand of {gemm.name} is not W.transpose(-2, -1)")
    if len(t.users) != 1:
        raise Refuse(f"the transposed weight {t.name} has other users")
    w = t.args[0]
    v = val(w)
    if not isinstance(v, torch.Tensor) or v.dim() != 3:
        raise Refuse(f"the weight {getattr(w, 'name', w)} of {gemm.name} is not [E, F, D]")
    if fx.is_dtensor(v) or not all(isinstance(s, int) for s in v.shape):
        raise Refuse(f"the weight {w.name} of {gemm.name} is a DTensor or has symbolic shape")
    return w


def _late_producers(w: Node, anchor: Node, order: dict[Node, int]) -> list[Node]:
    """The nodes after `anchor` that `w` depends on, in graph order; refuse impure ones."""
    late, stack = set(), [w]
    while stack:
        n = stack.pop()
        if n in late or order[n] < order[anchor]:
            continue
        if n is anchor:
            raise Refuse(f"the weight {w.name} depends on {anchor.name}")
        impure = n.op not in ("call_method", "call_function") or (
            n.op == "call_method" and n.target.endswith("_")
        )
        if impure or n.is_impure():
            raise Refuse(f"the weight {w.name} comes from {n.name}, which cannot be moved")
        late.add(n)
        stack.extend(n.all_input_nodes)
    return sorted(late, key=order.__getitem__)


def _fuse(gm: torch.fx.GraphModule, first: Node, second: Node) -> str:
    wa, wb = _weight(first), _weight(second)
    va, vb = val(wa), val(wb)
    if va.shape[0] != vb.shape[0] or va.shape[2] != vb.shape[2] or va.dtype != vb.dtype:
        raise Refuse(
            f"the weights {wa.name} {tuple(va.shape)} {va.dtype} and {wb.name} "
            f"{tuple(vb.shape)} {vb.dtype} differ in experts, input dim or dtype"
        )
    graph = gm.graph
    order = {n: i for i, n in enumerate(graph.nodes)}
    late = _late_producers(wb, first, order)
    for n in late:
        first.prepend(n)
    x, offs = first.args[0], _offs(first)
    fa, fb = va.shape[1], vb.shape[1]
    with graph.inserting_before(first):
        cat = fx.emit(graph, "call_function", torch.cat, ([wa, wb], 1), like=first)
        t = fx.emit(graph, "call_method", "transpose", (cat, -2, -1), like=first)
        ab = fx.emit(graph, "call_function", torch._grouped_mm, (x, t), {"offs": offs}, like=first)
        parts = [
            fx.emit(graph, "call_function", torch.narrow, (ab, -1, start, length), like=first)
            for start, length in ((0, fa), (fa, fb))
        ]
    for old, new in zip((first, second), parts, strict=True):
        transpose = old.args[1]
        old.replace_all_uses_with(new)
        graph.erase_node(old)
        graph.erase_node(transpose)
    moved = f"; moved {', '.join(n.name for n in late)} before it" if late else ""
    return (
        f"fused {first.name} and {second.name} (weights {wa.name} [.., {fa}, ..] and "
        f"{wb.name} [.., {fb}, ..]) into {ab.name} = grouped_mm({x.name}, "
        f"cat([{wa.name}, {wb.name}], 1).transpose(-2, -1)){moved}"
    )


@register_pass(PASS, preserves_numerics=False)
def fuse_sibling_grouped_mm_pass(
    gm: torch.fx.GraphModule, example_inputs: Sequence[Any], *, ctx: PassContext
) -> torch.fx.GraphModule:
    """Merge two grouped GEMMs of the same input and offsets into one over concatenated
    weights (the experts' gate and up projections)."""
    groups: dict[tuple[Node, Any], list[Node]] = {}
    for node in gm.graph.nodes:
        if _is_grouped_mm(node) and isinstance(node.args[0], Node):
            groups.setdefault((node.args[0], _offs(node)), []).append(node)
    pairs = [g for g in groups.values() if len(g) >= 2]
    if not pairs:
        ctx.note("no two grouped GEMMs share an input: nothing to fuse")
        return gm
    changed = False
    for gemms in pairs:
        first, second = gemms[0], gemms[1]
        try:
            ctx.note(_fuse(gm, first, second))
            changed = True
        except Refuse as why:
            ctx.note(f"left {first.name} and {second.name} unchanged: {why}")
    return fx.finish(gm, changed)
