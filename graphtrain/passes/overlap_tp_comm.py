"""Pass overlap_tp_comm: tensor-parallel all-gathers and reduce-scatters overlapped with their GEMMs.

What
    After AOT autograd, sequence-parallel TP (graphtrain.parallel.tensor_parallel) is explicit
    in the forward and backward graphs (aten IR, functional collectives). Two shapes occur:

    gather -> GEMM   x [B, S, D] (this rank's S = T/tp tokens)
                         ag = all_gather_into_tensor(x, tp, group); w = wait_tensor(ag)
                         full = cat(split(w, B), dim=1)                     [B, T, D]
                         y_i = mm(full.view(B*T, D), W_i)  for each consumer GEMM i
                     (q, k, v and w1, w3 share one gather in the forward; in the backward the
                     gathered gradient feeds the row GEMM's dgrad, and its wgrad reads `full`
                     transposed);
    GEMM -> scatter  y = mm(a.view(B*T, K), W).view(B, T, N)
                         rs = reduce_scatter_tensor(cat(split(y, S, dim=1)), sum, tp, group)
                     (wo and w2 in the forward).

    Each is rewritten so that communication and compute overlap, in one of two variants:
      chunked    (any process group, gloo on CPU included) the tp-shard's rows are split into
                 `chunks` blocks; every block's collective is started first (functional
                 collectives are asynchronous until their wait), then each block's GEMMs run
                 as soon as that block has arrived (gather) or before the next block's
                 collective (scatter). The outputs are reassembled in the original row order.
      symm_mem   (CUDA groups with symmetric memory enabled) torch's fused
                 symm_mem.fused_all_gather_matmul / fused_matmul_reduce_scatter, which
                 pipeline the same way over NVLink peers without the reassembly copies.
    Options (PassContext.options): "tp_overlap_chunks" (0: the tp size), "tp_overlap_variant"
    ("auto": symm_mem where the group has it, else chunked; or "chunked", "symm_mem").

Refusals (left alone with a note)
    a gather whose result has no row-wise GEMM consumer; a scatter whose input is not one
    GEMM's output used only by it (the backward's sum of several dgrads); rows that do not
    split into `chunks` blocks; shapes other than the [B, S, ...] sequence sharding above.

Invariant and numerics (preserves_numerics=True up to the GEMM's row blocking)
    Every output element is the same dot product over the same K values, and every
    reduce-scatter sums the same per-rank values; a GEMM over fewer rows may pick another
    kernel tile but not another K order on the CPU BLAS we test (the tests assert bitwise
    equality at tp=2 and state their tolerance elsewhere).
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import Any

import torch
import torch.fx
from torch.fx import Node

from graphtrain.passes import fx
from graphtrain.passes.fx import Refuse
from graphtrain.passes.registry import PassContext, register_pass

aten = torch.ops.aten
_c10d = torch.ops._c10d_functional


_is, _only_user = fx.is_op, fx.only_user

_is_view = fx.is_aten_view


def _shape(node: Node) -> list[int]:
    return list(node.meta["val"].shape)


class _Builder(fx.AtenBuilder):
    """fx.AtenBuilder and the row reorderings between sequence and rank-major layouts."""

    def rank_major_to_sequence(self, blocks: list[Node], tp: int, batch: int, seq: int) -> Node:
        """[B, tp * S, W] from blocks[j] = rows j of every rank's [B * S] rows, rank-major
        ([tp * R / chunks, W]): the layout of a sequence gathered over tp ranks."""
        width = _shape(blocks[0])[-1]
        rows = _shape(blocks[0])[0] // tp
        ranked = self(
            aten.cat.default, [self(aten.view.default, p, [tp, rows, width]) for p in blocks], 1
        )
        if batch > 1:  # with one sequence, rank-major rows are sequence order already
            ranked = self(aten.view.default, ranked, [tp, batch, seq, width])
            ranked = self(aten.permute.default, ranked, [1, 0, 2, 3])
            ranked = self(aten.clone.default, ranked, memory_format=torch.contiguous_format)
        return self(aten.view.default, ranked, [batch, tp * seq, width])

    def sequence_to_rank_major(self, x: Node, tp: int) -> Node:
        """[tp, B * S, K] from x [B, tp * S, K]: each rank's destination rows, contiguous."""
        batch, length, width = _shape(x)
        seq = length // tp
        if batch > 1:
            x = self(aten.view.default, x, [batch, tp, seq, width])
            x = self(aten.permute.default, x, [1, 0, 2, 3])
            x = self(aten.clone.default, x, memory_format=torch.contiguous_format)
        return self(aten.view.default, x, [tp, batch * seq, width])


def _row_block(rows: int, chunks: int) -> int:
    if rows % chunks:
        raise Refuse(f"its {rows} rows per rank do not split into {chunks} chunks")
    return rows // chunks


def _position(node: Node) -> int:
    return next(i for i, n in enumerate(node.graph.nodes) if n is node)


def _hoist(node: Node, before: Node) -> None:
    """Move `node` (a transpose of graph inputs or earlier values) before `before`, with whatever
    of its own inputs comes later too; anything else computed later is a refusal."""
    if _position(node) < _position(before):
        return
    if node.op != "call_function" or node.target not in (aten.t.default, aten.permute.default):
        raise Refuse(f"the GEMM operand {node.name} is computed after the collective")
    for arg in node.all_input_nodes:
        _hoist(arg, before)
    before.prepend(node)


def _erase_chain(gm: torch.fx.GraphModule, nodes: Sequence[Node]) -> None:
    """Erase the replaced nodes, users first (functional collectives are not dead code to FX)."""
    for node in nodes:
        if not node.users:
            gm.graph.erase_node(node)


def _replace_rest(gm: torch.fx.GraphModule, full: Node, rebuild: Any) -> None:
    """Drop the views of `full` that only fed the replaced GEMMs; what else reads it (the
    backward's wgrad, values saved for the backward) gets rebuild()'s node instead."""
    _erase_chain(gm, list(full.users))
    if full.users:
        full.replace_all_uses_with(rebuild())


def _symm_mem() -> Any:
    import torch.distributed._symmetric_memory

    return torch.ops.symm_mem


def _symm_mem_enabled(group: str) -> bool:
    from torch.distributed._symmetric_memory import is_symm_mem_enabled_for_group

    return is_symm_mem_enabled_for_group(group)


# --------------------------------------------------------------------------------------------
# gather -> GEMM


def _match_gather(ag: Node) -> tuple[Node, Node, list[Node], list[Node]]:
    """(wait, full, its row GEMMs, the pieces gathered) of an all-gather, or Refuse."""
    wait, pieces, cat = fx.match_sequence_gather(ag)
    gemms = []
    for view in cat.users:
        if _is_view(view) and len(view.args[1]) == 2:
            for gemm in view.users:
                if _is(gemm, aten.mm.default) and gemm.args[0] is view:
                    gemms.append(gemm)
    if not gemms:
        raise Refuse("the gathered tensor feeds no GEMM as its rows")
    return wait, cat, gemms, pieces


def _overlap_gather(
    gm: torch.fx.GraphModule, ag: Node, chunks: int, fake_mode: Any, symm_mem: bool
) -> str:
    x, tp, group = ag.args
    wait, full, gemms, pieces = _match_gather(ag)
    batch, seq, dim = _shape(x)
    block = 0 if symm_mem else _row_block(batch * seq, chunks)
    # Everything goes where the gathered tensor was made: its other users (values saved for
    # the backward) come right after it. The GEMMs' weights (transposes) move up to there.
    for gemm in gemms:
        _hoist(gemm.args[1], full)
    b = _Builder(gm.graph, full, fake_mode)
    names = ", ".join(g.name for g in gemms)
    if symm_mem:
        # (the gathered [B, T, D], [each GEMM's [B, T, N]]), pipelined over the peers.
        fused = b(
            _symm_mem().fused_all_gather_matmul.default, x, [g.args[1] for g in gemms], 1, group
        )
        outs = b(operator.getitem, fused, 1)
        # Its outputs are laid out as the op's pipeline left them (gather dim first): reshape,
        # and a contiguous copy of the gathered input for whoever reads it as `full`.
        for i, gemm in enumerate(gemms):
            out = b(aten.reshape.default, b(operator.getitem, outs, i), _shape(gemm))
            gemm.replace_all_uses_with(out)
            gm.graph.erase_node(gemm)
        gathered = b(operator.getitem, fused, 0)
        _replace_rest(
            gm, full, lambda: b(aten.clone.default, gathered, memory_format=torch.contiguous_format)
        )
        _erase_chain(gm, [full, *reversed(pieces), wait, ag])
        return f"all_gather {ag.name} -> mm ({names}): symm_mem fused_all_gather_matmul"
    flat = b(aten.view.default, x, [batch * seq, dim])
    started = [
        b(
            _c10d.all_gather_into_tensor.default,
            b(aten.slice.Tensor, flat, 0, j * block, (j + 1) * block),
            tp,
            group,
        )
        for j in range(chunks)
    ]
    arrived, parts = [], {gemm: [] for gemm in gemms}
    for handle in started:
        arrived.append(b(_c10d.wait_tensor.default, handle))
        for gemm in gemms:  # this block's GEMMs run while the later blocks are in flight
            parts[gemm].append(b(aten.mm.default, arrived[-1], gemm.args[1]))
    for gemm in gemms:
        out = b.rank_major_to_sequence(parts[gemm], tp, batch, seq)
        gemm.replace_all_uses_with(b(aten.view.default, out, _shape(gemm)))
        gm.graph.erase_node(gemm)
    _replace_rest(gm, full, lambda: b.rank_major_to_sequence(arrived, tp, batch, seq))
    _erase_chain(gm, [full, *reversed(pieces), wait, ag])
    return f"all_gather {ag.name} -> mm ({names}): chunked into {chunks}"


# --------------------------------------------------------------------------------------------
# GEMM -> scatter


def _gemm_terms(y: Node, between: list[Node]) -> Any:
    """y as a tree of adds over [B, T, N] views of row GEMMs: (mm, [B, T, K] rows) leaves and
    ("add", left, right) nodes; the visited nodes go to `between`. Refuse otherwise."""
    if len(y.users) != 1:
        raise Refuse(f"{y.name} has other users than the scatter")
    between.append(y)
    if _is(y, aten.add.Tensor) and len(y.args) == 2 and not y.kwargs:
        return ("add", _gemm_terms(y.args[0], between), _gemm_terms(y.args[1], between))
    gemm = y.args[0] if _is_view(y) else None
    if not _is(gemm, aten.mm.default) or len(gemm.users) != 1:
        raise Refuse("the scattered tensor is not made of GEMM outputs and their sums")
    rows = gemm.args[0]
    if not _is_view(rows) or len(_shape(rows.args[0])) != 3:
        raise Refuse(f"the rows of {gemm.name} are not a [B, T, K] activation")
    between += [gemm, rows]  # the 2-D view goes too where the GEMM was its only user
    return (gemm, rows.args[0])


def _first_rows(tree: Any) -> Node:
    return _first_rows(tree[1]) if tree[0] == "add" else tree[1]


def _match_scatter(rs: Node) -> tuple[Any, list[Node]]:
    """(the GEMM-sum tree, the nodes it replaces) of a reduce-scatter, or Refuse."""
    cat = rs.args[0]
    if rs.args[1] != "sum" or not _is(cat, aten.cat.default) or cat.args[1:] not in ((), (0,)):
        raise Refuse("its input is not the ranks' sequence slices concatenated")
    pieces = list(cat.args[0])
    split = pieces[0].args[0] if _is(pieces[0], operator.getitem) else None
    if (
        not _is(split, aten.split.Tensor)
        or split.args[2:] != (1,)
        or sorted(split.users, key=lambda n: n.args[1]) != pieces
    ):
        raise Refuse("its input is not one tensor split on the sequence dim")
    between = [cat, *pieces, split]
    return _gemm_terms(split.args[0], between), between


def _overlap_scatter(
    gm: torch.fx.GraphModule, rs: Node, chunks: int, fake_mode: Any, symm_mem: bool
) -> str:
    _, _, tp, group = rs.args
    terms, between = _match_scatter(rs)
    wait = _only_user(rs)
    if not _is(wait, _c10d.wait_tensor.default):
        raise Refuse("its result is not waited on once")
    gemms = [n for n in between if _is(n, aten.mm.default)]
    names = ", ".join(g.name for g in gemms)
    b = _Builder(gm.graph, rs, fake_mode)
    if symm_mem and terms[0] != "add":  # the fused op takes one GEMM, not a sum of several
        gemm, rows = terms
        fused = _symm_mem().fused_matmul_reduce_scatter.default
        wait.replace_all_uses_with(b(fused, rows, gemm.args[1], "sum", 1, group))
        _erase_chain(gm, [wait, rs, *between])
        return f"mm ({names}) -> reduce_scatter {rs.name}: symm_mem fused_matmul_reduce_scatter"
    batch, length, _ = _shape(_first_rows(terms))
    block = _row_block(batch * (length // tp), chunks)
    ranked: dict[Node, Node] = {}  # each GEMM's rows, [tp, B * S, K] by destination rank

    def block_of(tree: Any, j: int) -> Node:
        if tree[0] == "add":
            return b(aten.add.Tensor, block_of(tree[1], j), block_of(tree[2], j))
        gemm, rows = tree
        if gemm not in ranked:
            ranked[gemm] = b.sequence_to_rank_major(rows, tp)
        part = b(aten.slice.Tensor, ranked[gemm], 1, j * block, (j + 1) * block)
        part = b(aten.clone.default, part, memory_format=torch.contiguous_format)
        width = _shape(rows)[-1]
        return b(aten.mm.default, b(aten.view.default, part, [tp * block, width]), gemm.args[1])

    # Block j's scatter is in flight while block j + 1 is multiplied.
    started = [
        b(_c10d.reduce_scatter_tensor.default, block_of(terms, j), "sum", tp, group)
        for j in range(chunks)
    ]
    b.anchor = wait
    arrived = [b(_c10d.wait_tensor.default, handle) for handle in started]
    out = b(aten.view.default, b(aten.cat.default, arrived), _shape(wait))
    wait.replace_all_uses_with(out)
    _erase_chain(gm, [wait, rs, *between])
    return f"mm ({names}) -> reduce_scatter {rs.name}: chunked into {chunks}"


@register_pass(
    "overlap_tp_comm", stage="post_grad", order=10, default_on=True, preserves_numerics=True
)
def overlap_tp_comm_pass(
    gm: torch.fx.GraphModule, example_inputs: Sequence[Any], *, ctx: PassContext
) -> torch.fx.GraphModule:
    """Overlap tensor-parallel all-gathers / reduce-scatters with the GEMMs that use / make them."""
    candidates = [
        n
        for n in gm.graph.nodes
        if _is(n, _c10d.all_gather_into_tensor.default)
        or _is(n, _c10d.reduce_scatter_tensor.default)
    ]
    if not candidates:
        return gm
    fake_mode = next(n.meta["val"].fake_mode for n in candidates if "val" in n.meta)
    variant = ctx.options.get("tp_overlap_variant", "auto")
    if variant not in ("auto", "chunked", "symm_mem"):
        raise ValueError(f"tp_overlap_variant must be auto, chunked or symm_mem, got {variant!r}")
    changed = False
    for node in candidates:
        chunks = ctx.options.get("tp_overlap_chunks") or node.args[-2]
        group = node.args[-1]
        symm_mem = variant == "symm_mem" or (
            variant == "auto" and node.meta["val"].is_cuda and _symm_mem_enabled(group)
        )
        rewrite = (
            _overlap_gather
            if node.target == _c10d.all_gather_into_tensor.default
            else _overlap_scatter
        )
        try:
            ctx.note(rewrite(gm, node, chunks, fake_mode, symm_mem))
            changed = True
        except Refuse as refusal:
            ctx.note(f"{node.name} left alone: {refusal}")
    return fx.finish(gm, changed)
