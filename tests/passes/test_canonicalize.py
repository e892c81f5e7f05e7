"""Tests of the canonicalize pass: each rewrite gives its one spelling, outputs (and gradients)
stay bitwise equal, a second run changes nothing, and code it does not know is left alone.

The graphs are captured from Dynamo with a backend that records them (no other pass runs), so
the pass is tested on what it meets in a real compile.
"""

from __future__ import annotations

import operator

import pytest
import torch
import torch.nn.functional as F
from conftest import dynamo_graph

from graphtrain.passes.canonicalize import canonicalize, canonicalize_pass
from graphtrain.passes.registry import PassContext, all_passes


def _calls(gm: torch.fx.GraphModule) -> list[tuple[str, object]]:
    return [
        (n.op, n.target)
        for n in gm.graph.nodes
        if n.op in ("call_method", "call_function")
        and not isinstance(n.target, torch._ops.OpOverload)  # sym_size of bincount's output
    ]


def _x(*shape, dtype=torch.float32, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


# name -> (fn, inputs, the calls expected after the pass (in order), the pass's note keys)
CASES = {
    "methods to functions": (
        lambda x: (
            x.softmax(-1),
            x.sigmoid(),
            x.topk(2, dim=-1).indices,
            x.sort(-1, descending=True)[1],
            x.argsort(-1),
            x.logsumexp(-1),
            x.amax(-1),
        ),
        (_x(5, 6),),
        [
            ("call_function", torch.softmax),
            ("call_function", torch.sigmoid),
            ("call_function", torch.topk),
            ("call_function", operator.getitem),
            ("call_function", torch.sort),
            ("call_function", operator.getitem),
            ("call_function", torch.argsort),
            ("call_function", torch.logsumexp),
            ("call_function", torch.amax),
        ],
    ),
    "gather, masked_fill, scatter, counts": (
        lambda x, i: (
            x.gather(1, i),
            x.masked_fill(x > 0, float("-inf")),
            x.scatter(1, i, 0.5),
            x.scatter_add(1, i, x[:, :2]),
            i.flatten().bincount(minlength=6),
            x.histc(bins=4, min=-1, max=1),
            (x > 0).logical_not(),
        ),
        (_x(5, 6), torch.randint(0, 6, (5, 2), generator=torch.Generator().manual_seed(1))),
        [
            ("call_function", torch.gather),
            ("call_function", operator.gt),
            ("call_function", torch.masked_fill),
            ("call_function", torch.scatter),
            ("call_function", operator.getitem),
            ("call_function", torch.scatter_add),
            ("call_function", torch.reshape),
            ("call_function", torch.bincount),
            ("call_function", operator.ge),  # Dynamo's check of bincount's data-dependent size
            ("call_function", torch.histc),
            ("call_function", operator.gt),
            ("call_function", torch.logical_not),
        ],
    ),
    "F.softmax with dtype, F.sigmoid": (
        lambda x: (F.softmax(x, -1, dtype=torch.float32), F.sigmoid(x), F.softmax(x, dim=0)),
        (_x(5, 6, dtype=torch.bfloat16),),
        [
            ("call_function", torch.softmax),
            ("call_function", torch.sigmoid),
            ("call_function", torch.softmax),
        ],
    ),
    "reshapes": (
        lambda x: (
            x.view(2, -1),
            x.reshape(-1),
            x.flatten(0, 1),
            torch.flatten(x),
            x.view(-1, 3).unflatten(0, (5, 2)),
            torch.reshape(x, (3, 10)),
        ),
        (_x(5, 2, 3),),
        [("call_function", torch.reshape)] * 7,
    ),
    "casts": (
        lambda x, y: (
            x.double(),
            x.half(),
            x.bfloat16(),
            x.to(torch.float64),
            x.to(dtype=torch.int64),
            x.type(torch.int32),
            x.type_as(y),
            x.long(),
            x.bool(),
        ),
        (_x(4, 3), _x(2, dtype=torch.float16)),
        [("call_method", "to")] * 9,
    ),
    "casts to the own dtype are removed": (
        lambda x, y: (x.float() * 2, x.to(torch.float32) + 1, x.type_as(y) - 1, x.type(x.dtype)),
        (_x(4, 3), _x(2)),
        [
            ("call_function", operator.mul),
            ("call_function", operator.add),
            ("call_function", operator.sub),
        ],
    ),
}


@pytest.mark.parametrize("name", list(CASES))
def test_rewrite_spelling_bitwise_and_idempotent(name):
    fn, args, expected = CASES[name]
    gm = dynamo_graph(fn, *args)
    before = gm(*args)
    ctx = PassContext()
    gm = canonicalize_pass(gm, args, ctx=ctx)
    assert _calls(gm) == expected, gm.code
    assert ctx.notes and all("->" in n for n in ctx.notes), ctx.notes
    after = gm(*args)
    for a, b, c in zip(after, before, fn(*args), strict=True):
        assert a.dtype == b.dtype and torch.equal(a, b) and torch.equal(a, c)
    code = gm.code
    assert canonicalize(gm) == {}  # idempotent
    assert gm.code == code


def test_gradients_bitwise_equal():
    """A router-like chain in every spelling: forward and backward bitwise equal to eager."""

    def fn(x):
        p = F.softmax(x.float(), dim=-1).type_as(x)
        g = p.view(4, 2, 3).amax(-1)
        i = g.topk(1, dim=-1).indices
        m = torch.zeros_like(g).scatter(1, i, 1.0).bool()
        s = p.view(4, 2, 3).masked_fill(~m.unsqueeze(-1), 0.0).flatten(1)
        return s.gather(1, s.topk(2, -1).indices).double().sum()

    x = _x(4, 6).requires_grad_()
    gm = dynamo_graph(fn, x)
    ref = fn(x)
    (ref_grad,) = torch.autograd.grad(ref, x)
    gm = canonicalize_pass(gm, (x,), ctx=PassContext())
    methods = {n.target for n in gm.graph.nodes if n.op == "call_method"}
    assert methods == {"to", "unsqueeze", "sum"}, gm.code
    out = gm(x)
    out = out[0] if isinstance(out, tuple) else out
    (grad,) = torch.autograd.grad(out, x)
    assert torch.equal(out, ref) and torch.equal(grad, ref_grad)


UNKNOWN = {
    "in-place methods": lambda x: x.clone().mul_(2).sigmoid_(),
    "view as another dtype (a bit cast)": lambda x: x.view(torch.int32),
    "to with copy=True": lambda x: x.to(torch.float64, copy=True),
    "to a device": lambda x: x.to("cpu"),
    "type with a type name": lambda x: x.type("torch.DoubleTensor"),
    "methods it does not rewrite": lambda x: (x.exp(), x.sum(-1), x.transpose(0, 1), x.t()),
    "contiguous and unsqueeze stay": lambda x: (x.t().contiguous(), x.unsqueeze(-1)),
}


@pytest.mark.parametrize("name", list(UNKNOWN))
def test_leaves_unknown_code_alone(name):
    fn = UNKNOWN[name]
    x = _x(4, 3)
    gm = dynamo_graph(fn, x)
    code = gm.code
    ctx = PassContext()
    canonicalize_pass(gm, (x,), ctx=ctx)
    assert gm.code == code
    assert ctx.notes == ["every call already has its canonical spelling"]


def test_dtensor_reshape_left_alone(one_rank_group):
    """A DTensor's view and reshape propagate placements differently: not touched."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, distribute_tensor

    mesh = init_device_mesh("cpu", (1,))
    x = distribute_tensor(_x(4, 6), mesh, [Replicate()])
    gm = dynamo_graph(lambda t: t.view(2, 12).softmax(-1), x)
    code = gm.code
    canonicalize(gm)
    assert gm.code == code


def test_registered_first_and_numerics_preserving():
    spec = next(p for p in all_passes() if p.name == "canonicalize")
    assert (spec.stage, spec.order, spec.default_on, spec.preserves_numerics) == (
        "pre_grad",
        0,
        True,
        True,
    )
    pre = [p for p in all_passes() if p.stage == "pre_grad"]
    assert pre[0].name == "canonicalize"
