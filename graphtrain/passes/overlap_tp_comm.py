"""Pass overlap_tp_comm: tensor-parallel all-gathers and reduce-scatters overlapped with their GEMMs.

What
    After AOT autograd, sequence-parallel TP is explicit in the forward and backward graphs
    (aten IR, functional collectives). Two shapes occur: gather -> GEMM (x [B, S, D] gathered
    to [B, T, D], read by one or more row-wise GEMMs: q, k, v; w1, w3; the backward's dgrad)
    and GEMM -> scatter (a GEMM's output reduce-scattered: wo, w2). Each is rewritten so that
    communication and compute overlap:
      chunked    (any process group, gloo included) the shard's rows in `chunks` blocks: all
                 collectives start first (on gloo one at a time: _Builder), a block's GEMMs run
                 as it arrives (or before the next scatter); outputs put back in row order.
      symm_mem   (CUDA groups with symmetric memory) torch's fused_all_gather_matmul /
                 fused_matmul_reduce_scatter.
    Options (PassContext.options): "tp_overlap_chunks" (0: the tp size), "tp_overlap_variant"
    ("auto": symm_mem where the group can have it, else chunked; "chunked"; "symm_mem").
    FP8 gathers (fp8_all_gather's, which runs first) are chunked too: each row block of the
    shard cast with the one scale, block 0 through fp8_linear_precast, the later blocks as
    the same torch._scaled_mm. Refusals are left alone with a note.

Invariant and numerics (preserves_numerics=True up to the GEMM's row blocking)
    Every output element is the same dot product over the same K values, and every
    reduce-scatter sums the same per-rank values; the tests assert bitwise equality at tp=2,
    FP8 gathers included (tests/parallel/test_overlap_tp_comm.py). Only the FP8 activation
    saturation counts change (a sample: block 0's rows).
    The rewrites in full, the FP8 form and every refusal: docs/design/tp_overlap.md.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import Any

import torch
import torch.fx
from torch.fx import Node

from graphtrain.custom_ops.fp8_linear import FORWARD_FAST_ACCUM  # (importing registers the FP8 ops)
from graphtrain.passes import fx, post_grad
from graphtrain.passes.fx import Refuse
from graphtrain.passes.registry import PassContext, register_pass

aten = torch.ops.aten
_c10d = torch.ops._c10d_functional
_FP8_CAST = torch.ops.graphtrain.fp8_cast.default
_PRECAST = torch.ops.graphtrain.fp8_linear_precast.default
_FP8_LINEAR = torch.ops.graphtrain.fp8_linear.default
_FP8_BACKWARD = torch.ops.graphtrain.fp8_linear_backward.default
# Their outputs by name (the getitem index of each), read from the schemas.
_CAST_OUT = {name: fx.op_output(_FP8_CAST, name) for name in ("y", "scale_inv", "counts")}
_PRECAST_OUT = {
    name: fx.op_output(_PRECAST, name)
    for name in ("out", "x8_t", "x_scale_inv_out", "w8_t", "w_scale_inv_out")
}


_is, _only_user = post_grad.is_op, post_grad.only_user

_is_view = post_grad.is_aten_view


def _shape(node: Node) -> list[int]:
    return list(node.meta["val"].shape)


class _Builder(post_grad.AtenBuilder):
    """post_grad.AtenBuilder, the row reorderings between sequence and rank-major layouts, and the
    blocks' collectives: each in flight until its block is needed, but on gloo (CPU tensors)
    waited on before the next starts. Two collectives in flight on one gloo group while
    another group's collective runs corrupt the heap: torch 2.11, 2.13 and 2.14 (gloo's TCP
    transport; seen as "malloc(): unaligned tcache chunk detected" and SIGSEGV in
    gloo::transport::tcp::Pair::prepareRead, in MoE layouts with expert parallelism beside
    tp). The blocks and their arithmetic stay the same (bitwise); a CPU run loses only the
    overlap of a gloo collective with a GEMM."""

    def __init__(self, graph: torch.fx.Graph, anchor: Node, fake_mode: Any, collective: Node):
        super().__init__(graph, anchor, fake_mode)
        self.one_in_flight = not collective.meta["val"].is_cuda

    def start(self, op: Any, *args: Any) -> Node:
        """A block's collective: its handle, or on gloo the tensor, already waited on."""
        handle = self(op, *args)
        return self(_c10d.wait_tensor.default, handle) if self.one_in_flight else handle

    def arrive(self, handle: Node) -> Node:
        """The block's tensor once its collective (started by `start`) is done."""
        return handle if self.one_in_flight else self(_c10d.wait_tensor.default, handle)

    def chunked(self, chunks: int) -> str:
        """The note's word for the rewrite."""
        serial = ", one collective in flight at a time (gloo)" if self.one_in_flight else ""
        return f"chunked into {chunks}{serial}"

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
    """Move `node` (a transpose or view of graph inputs or earlier values) before `before`, with
    whatever of its own inputs comes later too; anything else computed later is a refusal."""
    if not isinstance(node, Node) or _position(node) < _position(before):
        return
    if not (_is(node, aten.t.default) or _is(node, aten.permute.default) or _is_view(node)):
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


def _enable_symm_mem(group: str) -> None:
    import warnings

    from torch.distributed._symmetric_memory import enable_symm_mem_for_group

    # Deprecated as unneeded from torch 2.12 on, but is_symm_mem_enabled_for_group (which
    # torch's own micro-pipeline TP pass still asks) and torch 2.11's ops need it; local, no
    # collective.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        enable_symm_mem_for_group(group)


def _group_layout(group: str) -> tuple[str, list[int], int]:
    """(backend name, the group's global ranks, processes per node) of a process group."""
    import os

    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    pg = c10d._resolve_process_group(group)
    ranks = sorted(dist.get_process_group_ranks(pg))
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", dist.get_world_size()))
    return str(dist.get_backend(pg)), ranks, per_node


def _peer_access(devices: list[int]) -> bool:
    """Whether this process's GPU reaches every other device of the group by P2P (NVLink or
    PCIe peer access): what the fused ops' symmetric buffers need."""
    me = torch.cuda.current_device()
    return all(d == me or torch.cuda.can_device_access_peer(me, d) for d in devices)


def choose_symm_mem(group: str, *, is_cuda: bool) -> tuple[bool, str]:
    """The "auto" variant's choice for a tp group: (use symm_mem, why). Symmetric memory is
    used where torch's fused ops can run: a CUDA tensor, an NCCL group whose ranks all sit on
    this node (LOCAL_WORLD_SIZE; ranks are placed node by node, device = rank % that, as
    graphtrain.parallel.mesh sets it) and reach each other by P2P. It is then enabled for the
    group here: nothing else enables it, and "auto" used to require it enabled already, so it
    never chose symm_mem. The choice depends on the layout only, so every rank of the group
    makes the same one (the two variants issue different collectives: a split decision hangs)."""
    if not is_cuda:
        return False, "not CUDA"
    if _symm_mem_enabled(group):
        return True, "symmetric memory enabled for the group"
    backend, ranks, per_node = _group_layout(group)
    if backend != "nccl":
        return False, f"process group backend {backend!r}, symm_mem needs 'nccl'"
    if len({r // per_node for r in ranks}) > 1:
        return False, f"ranks {ranks} span nodes ({per_node} per node): no NVLink between them"
    if not _peer_access([r % per_node for r in ranks]):
        return False, "no P2P access between the group's GPUs"
    _enable_symm_mem(group)
    return True, f"NCCL group of ranks {ranks} on one node with P2P access"


# --------------------------------------------------------------------------------------------
# gather -> GEMM


def _match_gather(ag: Node) -> tuple[Node, Node, list[Node], list[Node]]:
    """(wait, full, its row GEMMs, the pieces gathered) of an all-gather, or Refuse."""
    wait, pieces, cat = post_grad.match_sequence_gather(ag)
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
    if x.meta["val"].dtype == torch.uint8:  # FP8 bytes (fp8_all_gather)
        return _overlap_fp8_gather(gm, ag, chunks, fake_mode, symm_mem)
    wait, full, gemms, pieces = _match_gather(ag)
    batch, seq, dim = _shape(x)
    block = 0 if symm_mem else _row_block(batch * seq, chunks)
    # Everything goes where the gathered tensor was made: its other users (values saved for
    # the backward) come right after it. The GEMMs' weights (transposes) move up to there.
    for gemm in gemms:
        _hoist(gemm.args[1], full)
    b = _Builder(gm.graph, full, fake_mode, ag)
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
        b.start(
            _c10d.all_gather_into_tensor.default,
            b(aten.slice.Tensor, flat, 0, j * block, (j + 1) * block),
            tp,
            group,
        )
        for j in range(chunks)
    ]
    arrived, parts = [], {gemm: [] for gemm in gemms}
    for handle in started:
        arrived.append(b.arrive(handle))
        for gemm in gemms:  # this block's GEMMs run while the later blocks are in flight
            parts[gemm].append(b(aten.mm.default, arrived[-1], gemm.args[1]))
    for gemm in gemms:
        out = b.rank_major_to_sequence(parts[gemm], tp, batch, seq)
        gemm.replace_all_uses_with(b(aten.view.default, out, _shape(gemm)))
        gm.graph.erase_node(gemm)
    _replace_rest(gm, full, lambda: b.rank_major_to_sequence(arrived, tp, batch, seq))
    _erase_chain(gm, [full, *reversed(pieces), wait, ag])
    return f"all_gather {ag.name} -> mm ({names}): {b.chunked(chunks)}"


# --------------------------------------------------------------------------------------------
# FP8 gather -> fp8_linear_precast


def _match_fp8_gather(ag: Node) -> tuple[Node, Node, list[Node], list[Node]]:
    """(the shard's fp8_cast, the gathered E4M3 [B, T, D], its fp8_linear_precast consumers,
    the nodes of the gather to erase) of an all-gather written by fp8_all_gather, or Refuse."""
    wait, pieces, cat = post_grad.match_sequence_gather(ag)
    as_fp8 = _only_user(cat)
    u8 = ag.args[0].args[0] if _is_view(ag.args[0]) else None
    getitem = u8.args[0] if _is(u8, aten.view.dtype) else None
    cast = getitem.args[0] if _is(getitem, operator.getitem) else None
    plain_cast = _is(cast, _FP8_CAST) and not fx.op_arg(cast, "transpose")
    if not _is(as_fp8, aten.view.dtype) or not plain_cast:
        raise Refuse("its uint8 bytes are not one fp8_cast of the shard viewed back as FP8")
    views = [u for u in as_fp8.users if _is_view(u)]
    reads = [(u, as_fp8) for u in as_fp8.users if u not in views]
    reads += [(u, view) for view in views for u in view.users]
    for reader, read in reads:
        if not _is(reader, _PRECAST):
            raise Refuse(f"the gathered FP8 tensor is read by {reader.name}, not by the forward "
                         "fp8_linear_precast (the backward's fp8_linear_backward runs its dgrad "
                         "and its wgrad over all rows in one op)")  # fmt: skip
        weight_scale_inv, bias = fx.op_arg(reader, "w_scale_inv"), fx.op_arg(reader, "bias")
        reads_twice = sum(a is read for a in reader.args) > 1  # as x and as another argument
        if fx.op_arg(reader, "x") is not read or reads_twice or weight_scale_inv is not None:
            raise Refuse(f"{reader.name} reads the gathered tensor otherwise than as its x")
        if bias is not None:
            raise Refuse(f"{reader.name} has a bias")
    if not reads:
        raise Refuse("the gathered FP8 tensor has no user")
    erased = [*dict.fromkeys(r for _, r in reads if r is not as_fp8), as_fp8, cat]
    erased += [*reversed(pieces), wait, ag, ag.args[0], u8, *cast.users, cast]
    return cast, as_fp8, [r for r, _ in reads], erased


def _overlap_fp8_gather(
    gm: torch.fx.GraphModule, ag: Node, chunks: int, fake_mode: Any, symm_mem: bool
) -> str:
    """The E4M3 shard cast and gathered in `chunks` row blocks; each block's forward GEMMs run
    as it arrives: the first through fp8_linear_precast (which casts the weight, records its
    saturation counts and returns the weight's FP8 copy the backward saves), the later ones as
    the same torch._scaled_mm on that copy."""
    _, tp, group = ag.args
    cast, as_fp8, linears, erased = _match_fp8_gather(ag)
    rows, amax = fx.op_arg(cast, "x"), fx.op_arg(cast, "amax")
    dtype, pow2 = fx.op_arg(cast, "float8_dtype"), fx.op_arg(cast, "pow2_scale")
    batch, seq, dim = _shape(ag.args[0])
    block = _row_block(batch * seq, chunks)
    for linear in linears:  # the weights (views of parameters) move up to the first block
        _hoist(fx.op_arg(linear, "weight"), as_fp8)
    b = _Builder(gm.graph, as_fp8, fake_mode, ag)
    started = []
    for j in range(chunks):  # the cast is elementwise with one scale: the same bytes per block
        part = b(_FP8_CAST, b(aten.slice.Tensor, rows, 0, j * block, (j + 1) * block),
                 amax, dtype, pow2, False)  # fmt: skip
        if j == 0:  # every block's scale is the same value; block 0's counts: the sample
            scale_inv = b(operator.getitem, part, _CAST_OUT["scale_inv"])
            counts = b(operator.getitem, part, _CAST_OUT["counts"])
        u8 = b(aten.view.dtype, b(operator.getitem, part, _CAST_OUT["y"]), torch.uint8)
        started.append(b.start(_c10d.all_gather_into_tensor.default, u8, tp, group))
    arrived, parts = [], {linear: [] for linear in linears}
    weights = {}  # each linear's (w8_t, w_scale_inv, E4M3 weight as _scaled_mm's operand)
    for j, handle in enumerate(started):
        arrived.append(b.arrive(handle))
        x8 = b(aten.view.dtype, arrived[-1], dtype)  # [tp * block, D], rank-major
        for linear in linears:
            if j == 0:
                weight_args = [fx.op_arg(linear, n) for n in ("weight", "w_scale_inv", "bias")]
                first = b(_PRECAST, x8, scale_inv, counts, *weight_args, **linear.kwargs)
                fx.copy_meta(linear, first)
                w8_t = b(operator.getitem, first, _PRECAST_OUT["w8_t"])
                w8 = None
                if chunks > 1:  # [N, D] row-major from the saved [D, N]: one copy per weight
                    w8 = b(aten.clone.default, b(aten.permute.default, w8_t, [1, 0]),
                           memory_format=torch.contiguous_format)  # fmt: skip
                    w8 = b(aten.permute.default, w8, [1, 0])
                w_scale_inv = b(operator.getitem, first, _PRECAST_OUT["w_scale_inv_out"])
                weights[linear] = (w8_t, w_scale_inv, w8)
                parts[linear].append(b(operator.getitem, first, _PRECAST_OUT["out"]))
                continue
            _, w_scale_inv, w8 = weights[linear]
            out_dtype = linear.kwargs["out_dtype"]
            gemm = b(aten._scaled_mm.default, x8, w8, scale_inv, w_scale_inv,
                     out_dtype=out_dtype, use_fast_accum=FORWARD_FAST_ACCUM)  # fmt: skip
            parts[linear].append(gemm)
    # The backward's FP8 copy of x (x8_t [D, B * T]), one for all the consumers.
    x8_full = b(aten.view.dtype, b.rank_major_to_sequence(arrived, tp, batch, seq), dtype)
    # permute, not t: a post-grad graph reaches Inductor's lowering, which has none for t (its
    # decomposition ran before these passes)
    x8_t = b(aten.permute.default, b(aten.view.default, x8_full, [batch * seq * tp, dim]), [1, 0])
    x8_t = b(aten.clone.default, x8_t, memory_format=torch.contiguous_format)
    for linear in linears:
        w8_t, w_scale_inv, _ = weights[linear]
        out = b.rank_major_to_sequence(parts[linear], tp, batch, seq)
        by_name = {"out": out, "x8_t": x8_t, "x_scale_inv_out": b(aten.clone.default, scale_inv),
                   "w8_t": w8_t, "w_scale_inv_out": w_scale_inv}  # fmt: skip
        outputs = {_PRECAST_OUT[name]: value for name, value in by_name.items()}
        for user in list(linear.users):
            assert _is(user, operator.getitem), user
            new = outputs[user.args[1]]
            if user.args[1] == _PRECAST_OUT["out"]:
                new = b(aten.view.default, new, _shape(user))
            user.replace_all_uses_with(new)
            gm.graph.erase_node(user)
        gm.graph.erase_node(linear)
    _erase_chain(gm, erased)
    names = ", ".join(linear.name for linear in linears)
    fused = " (symm_mem has no FP8 variant wired here: chunked)" if symm_mem else ""
    return f"fp8 all_gather {ag.name} -> fp8_linear_precast ({names}): {b.chunked(chunks)}{fused}"


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
    # An FP8 op's output reaches the sum through a view (torch 2.13+ writes one after each
    # output of a custom op) or directly (torch 2.11).
    made_by = y if gemm is None else gemm
    op = made_by.args[0] if _is(made_by, operator.getitem) else None
    if _is(op, _FP8_LINEAR) or _is(op, _FP8_BACKWARD):
        raise Refuse(f"the scattered tensor is made by {op.name}, whose one op casts all its "
                     "rows with one amax before its GEMM: not split into row blocks")  # fmt: skip
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
    b = _Builder(gm.graph, rs, fake_mode, rs)
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
        b.start(_c10d.reduce_scatter_tensor.default, block_of(terms, j), "sum", tp, group)
        for j in range(chunks)
    ]
    b.anchor = wait
    arrived = [b.arrive(handle) for handle in started]
    out = b(aten.view.default, b(aten.cat.default, arrived), _shape(wait))
    wait.replace_all_uses_with(out)
    _erase_chain(gm, [wait, rs, *between])
    return f"mm ({names}) -> reduce_scatter {rs.name}: {b.chunked(chunks)}"


@register_pass("overlap_tp_comm", preserves_numerics=True)
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
    chosen: dict[str, bool] = {}
    for node in candidates:
        chunks = ctx.options.get("tp_overlap_chunks") or node.args[-2]
        group = node.args[-1]
        if variant == "auto":
            if group not in chosen:
                chosen[group], why = choose_symm_mem(group, is_cuda=node.meta["val"].is_cuda)
                ctx.note(f"group {group}: {'symm_mem' if chosen[group] else 'chunked'} ({why})")
            symm_mem = chosen[group]
        else:
            symm_mem = variant == "symm_mem"
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
