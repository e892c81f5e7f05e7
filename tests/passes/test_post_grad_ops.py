"""What the post-grad passes write into a graph must be lowerable by Inductor as it stands: by
then Inductor's decompositions have run, and its lowering asserts on an op that has a
decomposition but no lowering ("both a fallback and a decomp for same op"). aten.t and
aten.stack are such ops: overlap_tp_comm's FP8 gather wrote aten.t and fp8_cast_once aten.stack,
and every tensor-parallel FP8 run under Inductor failed to compile (the CPU tests compile with
aot_eager, which lowers nothing). Two checks: the builder refuses such an op as it writes it
(any test that runs a pass's path, under aot_eager too), and every op a builder call (`b(...)`,
`self(...)`) in the passes' source emits is lowerable (the paths no CPU test reaches)."""

import inspect
import re

import pytest
import torch
import torch.fx
from torch._subclasses.fake_tensor import FakeTensorMode

import graphtrain  # noqa: F401  (registers the passes)
from graphtrain.passes.post_grad import AtenBuilder, lowerable
from graphtrain.passes.registry import all_passes

EMITTED = re.compile(r"\b(?:b|self)\(\s*(aten|prims)\.(\w+)\.(\w+)")


def test_every_op_a_post_grad_pass_emits_has_an_inductor_lowering():
    modules = {inspect.getmodule(p.fn) for p in all_passes() if p.stage == "post_grad"}
    emitted, unlowerable = set(), []
    for module in modules:
        for namespace, name, overload in EMITTED.findall(inspect.getsource(module)):
            op = getattr(getattr(getattr(torch.ops, namespace), name), overload)
            emitted.add(op)
            if not lowerable(op):
                unlowerable.append(f"{module.__name__}: {op}")
    assert len(emitted) >= 10, emitted  # the pattern still finds what the passes write
    assert not unlowerable, unlowerable


def test_the_builder_refuses_an_op_inductor_cannot_lower():
    aten = torch.ops.aten
    assert not lowerable(aten.t.default) and not lowerable(aten.stack.default)
    assert lowerable(aten.permute.default) and lowerable(aten.cat.default)
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    out = graph.output(x)
    mode = FakeTensorMode()
    x.meta["val"] = mode.from_tensor(torch.empty(2, 3))
    b = AtenBuilder(graph, out, mode)
    assert b(aten.permute.default, x, [1, 0]).meta["val"].shape == (3, 2)
    with pytest.raises(TypeError, match=r"aten\.t\.default has a decomposition but no lowering"):
        b(aten.t.default, x)
