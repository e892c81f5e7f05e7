"""Pass fp8_all_gather: a tensor-parallel all-gather whose consumers are fp8_linear moves FP8 bytes.

What
    Under sequence-parallel TP a column-parallel linear's input is gathered over the tp ranks
    (fx.match_sequence_gather: all_gather_into_tensor(x [B, S, D]) -> wait -> split -> cat
    [B, T, D]) and, with the fp8_linear pass on, every consumer (q, k, v; w1, w3) is
    graphtrain::fp8_linear, which casts the whole gathered x to E4M3 with the amax max-reduced
    over tp. In the post-grad forward graph this pass rewrites the gather to
        amax = all_reduce(fp8_amax(x), "max", tp)         the global amax: every rank, one scale
        x8, scale_inv, counts = fp8_cast(x, amax, E4M3)   this rank's shard only
        all_gather(x8 viewed as uint8) -> split -> cat -> view as E4M3   [B, T, D]
    and each consumer to graphtrain::fp8_linear_precast(x8, scale_inv, counts, W, ...): the
    same five outputs (the FP8 copy and scale fp8_linear_backward reads are x8's). The bytes
    move as uint8 because gloo has no float8 type; NCCL moves them as they are either way.
    As TransformerEngine does with per-tensor current scaling.

Why
    The gather moves 1 byte per element instead of 2 (bf16) or 4 (fp32): half of a bf16
    gather's bytes (B * T * D * (tp - 1) / tp per rank). The cast also runs once on 1/tp of the
    rows instead of once per consumer on all of them. Predicted saving at Llama-3-8B's shapes
    (B * T = 8192 tokens, D = 4096, tp = 8, bf16, NVLink ~ 450 GB/s per direction): a gather
    of 8192 * 4096 * 2 B * 7/8 = 58.7 MB (~130 us) becomes 29.4 MB (~65 us), twice per
    block forward (attention and MLP inputs). Unmeasured (no multi-GPU machine here).

Refusals (left alone with a note)
    a gather whose gathered tensor has any user other than fp8_linear (directly or through a
    view): that user needs the high-precision values, so the gather stays; consumers whose
    tp_group or pow2_scale differ from each other or from the gather's group; a gather not in
    the [B, S, D] sequence layout (fx.match_sequence_gather's refusals).
    The chunked overlap (overlap_tp_comm, which runs after this pass) does not chunk an FP8
    gather: its consumer is one fp8_linear_precast, not row GEMMs; it notes that and leaves it.
    The backward's gather of the output gradient before fp8_linear_backward stays as it is.

Invariant and numerics (preserves_numerics=True: bitwise)
    The max of the shards' amaxes is the gathered tensor's amax exactly, the cast is
    elementwise with that one scale, and a gather copies bytes: x8 and scale_inv are the
    bits fp8_linear computed from the gathered x, and fp8_linear_precast runs the same
    forward from there (tests/parallel/test_overlap_tp_comm.py: losses and every gradient
    equal to the FP8 run without this pass, bit for bit). Only the saturation statistics
    change: the activation counts are those of the rank's shard, counted once per consumer.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import Any

import torch
import torch.fx
from torch.fx import Node

from graphtrain.custom_ops import fp8_linear  # noqa: F401  (registers the ops)
from graphtrain.passes import fx
from graphtrain.passes.fx import Refuse
from graphtrain.passes.registry import PassContext, register_pass

aten = torch.ops.aten
_c10d = torch.ops._c10d_functional
E4M3 = torch.float8_e4m3fn


def _consumers(full: Node) -> list[tuple[Node, Node]]:
    """[(fp8_linear, the node it reads: full or a view of it)], or Refuse."""
    views = [u for u in full.users if fx.is_aten_view(u)]
    pairs = [(u, full) for u in full.users if u not in views]
    pairs += [(u, view) for view in views for u in view.users]
    for reader, read in pairs:
        if not fx.is_op(reader, torch.ops.graphtrain.fp8_linear.default):
            raise Refuse(
                f"the gathered tensor is also read by {reader.name} (not fp8_linear): "
                "it needs the high-precision values"
            )
        if reader.args[0] is not read or read in reader.args[1:]:
            raise Refuse(f"the gathered tensor is {reader.name}'s weight or bias")
    if not pairs:
        raise Refuse("the gathered tensor has no user")
    return pairs


def _fp8_gather(gm: torch.fx.GraphModule, ag: Node, fake_mode: Any) -> str:
    x, tp, group = ag.args
    wait, pieces, full = fx.match_sequence_gather(ag)
    consumers = _consumers(full)
    options = {(c.kwargs.get("tp_group"), bool(c.kwargs.get("pow2_scale"))) for c, _ in consumers}
    if len(options) != 1 or next(iter(options))[0] != group:
        raise Refuse(f"its fp8_linear consumers' (tp_group, pow2_scale) {sorted(options, key=str)} are "
                     f"not all ({group!r}, ...)")  # fmt: skip
    ((_, pow2),) = options
    batch, seq, dim = x.meta["val"].shape
    b = fx.AtenBuilder(gm.graph, ag, fake_mode)
    local_amax = b(torch.ops.graphtrain.fp8_amax.default, x)
    amax = b(_c10d.wait_tensor.default, b(_c10d.all_reduce.default, local_amax, "max", group))
    rows = b(aten.view.default, x, [batch * seq, dim])
    cast = b(torch.ops.graphtrain.fp8_cast.default, rows, amax, E4M3, pow2, False)
    x8, scale_inv, counts = (b(operator.getitem, cast, i) for i in (0, 2, 3))
    shard = b(aten.view.default, b(aten.view.dtype, x8, torch.uint8), [batch, seq, dim])
    gathered = b(
        _c10d.wait_tensor.default, b(_c10d.all_gather_into_tensor.default, shard, tp, group)
    )
    split = b(aten.split.Tensor, gathered, batch)
    ranks = [b(operator.getitem, split, r) for r in range(tp)]
    x8_full = b(aten.view.dtype, b(aten.cat.default, ranks, 1), E4M3)  # [B, T, D]
    names = []
    for linear, read in consumers:
        b.anchor = linear
        source = x8_full if read is full else b(aten.view.default, x8_full, read.args[1])
        weight, bias = linear.args[1], linear.args[2] if len(linear.args) > 2 else None
        out_dtype = linear.kwargs.get("out_dtype") or read.meta["val"].dtype
        args = (source, scale_inv, counts, weight, None, bias)
        kwargs = {"pow2_scale": pow2, "tp_group": group, "out_dtype": out_dtype}
        new = b(torch.ops.graphtrain.fp8_linear_precast.default, *args, **kwargs)
        fx.copy_meta(linear, new)
        linear.replace_all_uses_with(new)
        gm.graph.erase_node(linear)
        names.append(linear.name)
    # the high-precision gather and its views, users first (collectives are not dead code to FX)
    views = dict.fromkeys(r for _, r in consumers if r is not full)
    for node in [*views, full, *reversed(pieces), wait, ag]:
        if not node.users:
            gm.graph.erase_node(node)
    return (f"all_gather {ag.name} -> fp8_linear ({', '.join(names)}): cast to E4M3 before the "
            f"gather (global amax over {tp} ranks), 1 byte per element gathered instead of "
            f"{x.meta['val'].element_size()}")  # fmt: skip


@register_pass(
    "fp8_all_gather", stage="post_grad", order=5, default_on=True, preserves_numerics=True
)
def fp8_all_gather_pass(
    gm: torch.fx.GraphModule, example_inputs: Sequence[Any], *, ctx: PassContext
) -> torch.fx.GraphModule:
    """Cast tensor-parallel activations to FP8 before the all-gather that feeds fp8_linear."""
    # Order 5: before overlap_tp_comm (10), which would otherwise take the gathers it can chunk.
    gathers = [n for n in gm.graph.nodes if fx.is_op(n, _c10d.all_gather_into_tensor.default)]
    if not any(fx.is_op(n, torch.ops.graphtrain.fp8_linear.default) for n in gm.graph.nodes):
        return gm  # no FP8 linear here (the fp8_linear pass is off): nothing to note
    changed = False
    for ag in gathers:
        try:
            ctx.note(_fp8_gather(gm, ag, ag.meta["val"].fake_mode))
            changed = True
        except Refuse as refusal:
            ctx.note(f"{ag.name} left in high precision: {refusal}")
    return fx.finish(gm, changed)
