"""Pass fp8_all_gather: a tensor-parallel all-gather whose consumers are fp8_linear moves FP8 bytes.

What
    Under sequence-parallel TP a column-parallel linear's input is gathered over the tp ranks
    (post_grad.match_sequence_gather) and, with the fp8_linear pass on, every consumer (q, k, v; w1,
    w3) is graphtrain::fp8_linear. In the post-grad forward graph this pass rewrites the gather
    to: the global amax (fp8_amax max-reduced over tp), this rank's shard cast to E4M3, the
    bytes gathered as uint8 (gloo has no float8 type) and viewed as E4M3; each consumer becomes
    graphtrain::fp8_linear_precast on them. The backward's mirror, the output gradient of a
    row-parallel linear gathered for fp8_linear_backward, is cast to E5M2 (E4M3 with
    fp8.e4m3_grads) before its gather the same way. As TransformerEngine does with per-tensor
    current scaling: the gather moves 1 byte per element instead of 2 or 4.
    Left alone with a note: a gathered tensor with any user that needs its high-precision
    values, consumers whose options or group differ, a backward with a bias, a gather not in
    the [B, S, D] sequence layout.

Invariant and numerics (preserves_numerics=True: bitwise)
    The max of the shards' amaxes is the gathered tensor's amax exactly, the cast is
    elementwise with that one scale, and a gather copies bytes: x8 and scale_inv are the bits
    fp8_linear (fp8_linear_backward) computed from the gathered tensor
    (tests/parallel/test_overlap_tp_comm.py). Only the saturation statistics change: the
    activation counts are those of the rank's shard, counted once per consumer.
    The rewrite in full, the predicted saving and the refusals: docs/design/fp8.md.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import Any

import torch
import torch.fx
from torch.fx import Node

from graphtrain.custom_ops import fp8_linear  # noqa: F401  (registers the ops)
from graphtrain.passes import fx, post_grad
from graphtrain.passes.fx import Refuse
from graphtrain.passes.registry import PassContext, register_pass

aten = torch.ops.aten
_c10d = torch.ops._c10d_functional
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
_FORWARD = torch.ops.graphtrain.fp8_linear.default
_BACKWARD = torch.ops.graphtrain.fp8_linear_backward.default


def _consumers(full: Node) -> list[tuple[Node, Node]]:
    """[(fp8_linear or fp8_linear_backward, the node it reads as x or grad_out: full or a view
    of it)], or Refuse."""
    views = [u for u in full.users if post_grad.is_aten_view(u)]
    pairs = [(u, full) for u in full.users if u not in views]
    pairs += [(u, view) for view in views for u in view.users]
    for reader, read in pairs:
        if not (post_grad.is_op(reader, _FORWARD) or post_grad.is_op(reader, _BACKWARD)):
            raise Refuse(
                f"the gathered tensor is also read by {reader.name} (not fp8_linear): "
                "it needs the high-precision values"
            )
        if reader.args[0] is not read or read in reader.args[1:]:
            raise Refuse(f"the gathered tensor is another input of {reader.name} than its first")
        if post_grad.is_op(reader, _BACKWARD) and (reader.args[5] or len(reader.args) > 6):
            raise Refuse(f"{reader.name} has a bias (its gradient sums the unquantised rows)")
    if not pairs:
        raise Refuse("the gathered tensor has no user")
    return pairs


def _fp8_gather(gm: torch.fx.GraphModule, ag: Node, fake_mode: Any) -> str:
    x, tp, group = ag.args
    wait, pieces, full = post_grad.match_sequence_gather(ag)
    consumers = _consumers(full)
    options = {
        (c.target, c.kwargs.get("tp_group"), bool(c.kwargs.get("pow2_scale")),
         bool(c.kwargs.get("e4m3_grads")))
        for c, _ in consumers
    }  # fmt: skip
    if len(options) != 1 or next(iter(options))[1] != group:
        raise Refuse(f"its consumers' (op, tp_group, pow2_scale, e4m3_grads) differ or are not "
                     f"on group {group!r}: {sorted(options, key=str)}")  # fmt: skip
    ((op, _, pow2, e4m3_grads),) = options
    backward = op == _BACKWARD
    dtype = E5M2 if backward and not e4m3_grads else E4M3
    batch, seq, dim = x.meta["val"].shape
    b = post_grad.AtenBuilder(gm.graph, ag, fake_mode)
    local_amax = b(torch.ops.graphtrain.fp8_amax.default, x)
    amax = b(_c10d.wait_tensor.default, b(_c10d.all_reduce.default, local_amax, "max", group))
    rows = b(aten.view.default, x, [batch * seq, dim])
    cast = b(torch.ops.graphtrain.fp8_cast.default, rows, amax, dtype, pow2, False)
    x8, scale_inv, counts = (b(operator.getitem, cast, i) for i in (0, 2, 3))
    shard = b(aten.view.default, b(aten.view.dtype, x8, torch.uint8), [batch, seq, dim])
    gathered = b(
        _c10d.wait_tensor.default, b(_c10d.all_gather_into_tensor.default, shard, tp, group)
    )
    split = b(aten.split.Tensor, gathered, batch)
    ranks = [b(operator.getitem, split, r) for r in range(tp)]
    x8_full = b(aten.view.dtype, b(aten.cat.default, ranks, 1), dtype)  # [B, T, D]
    names = []
    for linear, read in consumers:
        b.anchor = linear
        source = x8_full if read is full else b(aten.view.default, x8_full, read.args[1])
        if backward:  # the same op, given grad_out cast already
            new = b(_BACKWARD, source, *linear.args[1:6], scale_inv, counts, **linear.kwargs)
        else:
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
    return (f"all_gather {ag.name} -> {op.name()} ({', '.join(names)}): cast to "
            f"{'E5M2' if dtype == E5M2 else 'E4M3'} before the "
            f"gather (global amax over {tp} ranks), 1 byte per element gathered instead of "
            f"{x.meta['val'].element_size()}")  # fmt: skip


@register_pass("fp8_all_gather", preserves_numerics=True)
def fp8_all_gather_pass(
    gm: torch.fx.GraphModule, example_inputs: Sequence[Any], *, ctx: PassContext
) -> torch.fx.GraphModule:
    """Cast tensor-parallel activations (gradients) to FP8 before the all-gather feeding
    fp8_linear (fp8_linear_backward)."""
    gathers = [
        n for n in gm.graph.nodes if post_grad.is_op(n, _c10d.all_gather_into_tensor.default)
    ]
    if not any(
        post_grad.is_op(n, _FORWARD) or post_grad.is_op(n, _BACKWARD) for n in gm.graph.nodes
    ):
        return gm  # no FP8 linear here (the fp8_linear pass is off): nothing to note
    changed = False
    for ag in gathers:
        try:
            ctx.note(_fp8_gather(gm, ag, ag.meta["val"].fake_mode))
            changed = True
        except Refuse as refusal:
            ctx.note(f"{ag.name} left in high precision: {refusal}")
    return fx.finish(gm, changed)
