"""Tests of the shared FX helpers (graphtrain/passes/fx.py) where they are more than a lookup:
call matching across spellings, casts, column slices, aliasing and in-place checks, and emit's
recorded values and provenance. Graphs are captured from Dynamo, as the passes receive them."""

from __future__ import annotations

import operator

import pytest
import torch
from conftest import dynamo_graph

from graphtrain.passes import fx


def _nodes(gm: torch.fx.GraphModule) -> dict[str, torch.fx.Node]:
    return {n.name: n for n in gm.graph.nodes}


def test_call_reads_every_spelling_alike():
    """Method, function and in-place operator spellings give one name, input first."""

    def fn(x, y):
        a = x.div(y)
        b = torch.div(x, y)
        c = x / y
        d = x.clone()
        d /= y
        e = x.true_divide(y)
        return a, b, c, d, e

    x, y = torch.randn(3, 4), torch.rand(3, 4) + 1
    gm = dynamo_graph(fn, x, y)
    calls = [fx.call(n) for n in gm.graph.nodes if n.op.startswith("call")]
    divs = [c for c in calls if c is not None and c.name == "div"]
    assert len(divs) == 5, gm.code
    assert [c.inplace for c in divs].count(True) == 1
    assert all(fx.val(c.args[0]) is not None and c.arg(1, "other") is not None for c in divs)
    assert fx.is_call(divs[0].node, "mul", "div") == divs[0]
    assert fx.is_call(divs[0].node, "mul") is None
    assert fx.call(next(iter(gm.graph.nodes))) is None  # a placeholder is not a call


@pytest.mark.parametrize(
    "spelling,expected",
    [
        (lambda x: x.float(), torch.float32),
        (lambda x: x.to(torch.float32), torch.float32),
        (lambda x: x.to(dtype=torch.bfloat16), torch.bfloat16),
        (lambda x: x.type(torch.float64), torch.float64),
        (lambda x: x.long(), torch.int64),
        (lambda x: x.to(torch.float32, copy=True), None),
        (lambda x: x.to("cpu", torch.float32), None),
        (lambda x: x.type("torch.DoubleTensor"), None),
        (lambda x: x.exp(), None),
    ],
)
def test_cast_dtype(spelling, expected):
    gm = dynamo_graph(spelling, torch.randn(3, dtype=torch.float16))
    (node,) = [n for n in gm.graph.nodes if n.op.startswith("call")]
    assert fx.cast_dtype(node) == expected, gm.code


def test_prefix_slice_and_reinterpret():
    def fn(x):
        return x[:, :3], x[..., :2], x[:, 1:3], x[1:, :2], x[:, None], x[..., None].flatten(1)

    gm = dynamo_graph(fn, torch.randn(4, 5))
    slices = [n for n in gm.graph.nodes if n.target is operator.getitem]
    assert [fx.prefix_slice(n) for n in slices] == [3, 2, None, None, None, None]
    reinterprets = [n.name for n in gm.graph.nodes if (c := fx.call(n)) and fx.is_reinterpret(c)]
    assert len(reinterprets) == 3, gm.code  # x[:, None], x[..., None], .flatten(1)


def test_aliases_and_check_mutations():
    """The in-place mul_ changes s through its view v, and `after` reads s afterwards: erasing
    {v, mul_} would change what `after` sees; erasing only the exp is safe."""

    def fn(x):
        s = x.softmax(-1)
        v = s.view(-1)
        v.mul_(2)
        after = s.sum()
        other = x.exp()
        return after, other

    gm = dynamo_graph(fn, torch.randn(3, 4))
    n = _nodes(gm)
    mul = next(x for x in gm.graph.nodes if (c := fx.call(x)) and c.inplace)
    assert fx.alias_root(mul) is n["s"]
    assert {n["v"], mul} <= fx.aliases(n["s"])
    with pytest.raises(fx.Refuse, match="reads afterwards"):
        fx.check_mutations(gm.graph, {n["v"], mul}, set(), set(), mul)
    fx.check_mutations(gm.graph, {n["other"]}, set(), set(), n["other"])
    # A kept in-place op between two reads of the sub-graph's tensor.
    with pytest.raises(fx.Refuse, match="in place inside"):
        fx.check_mutations(gm.graph, {n["v"], n["after"]}, set(), set(), n["after"])


def test_emit_records_value_and_provenance():
    gm = dynamo_graph(lambda x: x.softmax(-1) * 2, torch.randn(3, 4))
    (sm,) = [n for n in gm.graph.nodes if n.target == "softmax"]
    with gm.graph.inserting_after(sm):
        new = fx.emit(gm.graph, "call_function", torch.topk, (sm, 2), like=sm)
        part = fx.emit(gm.graph, "call_function", operator.getitem, (new, 1))
    assert fx.shape(part) == (3, 2) and fx.dtype(part) == torch.int64
    assert new.meta["stack_trace"] == sm.meta["stack_trace"]
    assert "stack_trace" not in part.meta


def test_plain_tensor_refuses_with_the_reason():
    gm = dynamo_graph(lambda x: x + 1, torch.randn(2))
    node = next(n for n in gm.graph.nodes if n.op == "call_function")
    assert fx.plain_tensor(node, "the sum").shape == (2,)
    del node.meta["example_value"]
    with pytest.raises(fx.Refuse, match="the sum add has no recorded tensor value"):
        fx.plain_tensor(node, "the sum")


def test_op_arg_and_op_output_read_by_schema_name():
    """An op call's arguments by name whether written by position, by keyword or left to the
    schema's default; outputs by name as getitem indices (what overlap_tp_comm reads)."""
    import graphtrain.custom_ops  # noqa: F401  (registers the ops)

    cast = torch.ops.graphtrain.fp8_cast.default
    graph = torch.fx.Graph()
    x, amax = graph.placeholder("x"), graph.placeholder("amax")
    node = graph.call_function(cast, (x, amax, torch.float8_e4m3fn, True, False), {"record": "a"})
    assert fx.op_arg(node, "x") is x and fx.op_arg(node, "amax") is amax
    assert fx.op_arg(node, "pow2_scale") is True and fx.op_arg(node, "transpose") is False
    assert fx.op_arg(node, "groups") is None
    assert fx.op_arg(node, "record") == "a"
    with pytest.raises(KeyError, match="no argument 'scale'"):
        fx.op_arg(node, "scale")
    assert [fx.op_output(cast, n) for n in ("y", "y_t", "scale_inv", "counts")] == [0, 1, 2, 3]
    with pytest.raises(KeyError, match="no output 'amax'"):
        fx.op_output(cast, "amax")
