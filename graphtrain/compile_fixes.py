"""Graph rewrites that keep torch's compiler from miscompiling graphtrain's graphs, each with the
torch releases it was seen on and the test that fails without it. The backend (graphtrain.compile)
runs the first on every region, the second where Inductor compiles; a third defect, in Inductor's
cache key, is met in the backend's post-grad pass (its uuid). docs/design/compile.md tells all three.

    inline_regions(gm)                  before AOT autograd: every invoke_subgraph node inlined
                                        (the Gated DeltaNet block's backward came out wrong)
    unalias_all_reduce_inputs(graph)    first of the post-grad passes: each input of an
                                        all-reduced cat that is read elsewhere goes in through a
                                        clone (the MoE routers' gradients came out wrong)
"""

from __future__ import annotations

import torch


def inline_regions(gm: torch.fx.GraphModule) -> list[str]:
    """Inline every invoke_subgraph node (a torch.compiler.nested_compile_region call) of a
    Dynamo graph: the subgraph's nodes copied in its place, its users reading them; the names
    of the inlined nodes. Inductor computed wrong gradients through such a node (the Gated
    DeltaNet recurrence before its gated norm, torch 2.11-2.14:
    docs/design/gated_delta_rule.md)."""
    invoke = torch.ops.higher_order.invoke_subgraph
    graph, inlined = gm.graph, []
    for node in [n for n in graph.nodes if n.op == "call_function" and n.target is invoke]:
        holder, operands = node.args[0], node.args[2:]
        sub = getattr(gm, holder.target)
        placeholders = [n for n in sub.graph.nodes if n.op == "placeholder"]
        with graph.inserting_before(node):
            outputs = graph.graph_copy(sub.graph, dict(zip(placeholders, operands, strict=True)))
        for user in list(node.users):  # getitem(node, i)
            user.replace_all_uses_with(outputs[user.args[1]])
            graph.erase_node(user)
        graph.erase_node(node)
        if not holder.users:
            graph.erase_node(holder)
            delattr(gm, holder.target)
        inlined.append(node.name)
    if inlined:
        graph.lint()
        gm.recompile()
    return inlined


def _views(node: torch.fx.Node) -> list[torch.fx.Node]:
    """node, and the nodes it views (through view ops), down to the first that is no view."""
    chain = [node]
    while isinstance(chain[-1].target, torch._ops.OpOverload) and chain[-1].target.is_view:
        chain.append(chain[-1].args[0])
    return chain


def unalias_all_reduce_inputs(graph: torch.fx.Graph) -> int:
    """Inductor (torch 2.11-2.14) computes a cat's (or stack's) inputs straight into its buffer
    and all-reduces that buffer in place: an input read again after the all-reduce reads
    reduced values (a MoE router's local counts, all-reduced beside its plain counts: the
    router gradients a third off on two ranks). Each such input that is read elsewhere, itself
    or what it views, goes in through a clone; the number of clones."""
    c10d, clones = torch.ops._c10d_functional, 0
    for node in list(graph.nodes):
        if node.target is c10d.all_reduce.default:
            sources = [node.args[0]]
        elif node.target is c10d.all_reduce_coalesced.default:
            sources = list(node.args[0])
        else:
            continue
        joins = [_views(n)[-1] for n in sources]  # stack is a cat and a view by now
        for join in [n for n in joins if n.target is torch.ops.aten.cat.default]:
            for x in dict.fromkeys(join.args[0]):
                chain = _views(x)
                if all(u in (join, *chain) for n in chain for u in n.users):
                    continue
                with graph.inserting_before(join):
                    copy = graph.call_function(torch.ops.aten.clone.default, (x,))
                copy.meta = dict(x.meta)
                join.replace_input_with(x, copy)
                clones += 1
    return clones
