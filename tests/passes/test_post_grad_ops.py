"""What the post-grad passes write into a graph must be lowerable by Inductor as it stands: by
then Inductor's decompositions have run, and its lowering asserts on an op that has a
decomposition but no lowering ("both a fallback and a decomp for same op"). aten.t and
aten.stack are such ops: overlap_tp_comm's FP8 gather wrote aten.t and fp8_cast_once aten.stack,
and every tensor-parallel FP8 run under Inductor failed to compile (the CPU tests compile with
aot_eager, which lowers nothing). Read from the passes' source: every op a builder call
(`b(...)`, `self(...)`) emits."""

import inspect
import re

import torch
from torch._inductor.decomposition import select_decomp_table
from torch._inductor.lowering import lowerings

import graphtrain  # noqa: F401  (registers the passes)
from graphtrain.passes.registry import all_passes

EMITTED = re.compile(r"\b(?:b|self)\(\s*(aten|prims)\.(\w+)\.(\w+)")


def test_every_op_a_post_grad_pass_emits_has_an_inductor_lowering():
    decompositions = select_decomp_table()
    modules = {inspect.getmodule(p.fn) for p in all_passes() if p.stage == "post_grad"}
    emitted, unlowerable = set(), []
    for module in modules:
        for namespace, name, overload in EMITTED.findall(inspect.getsource(module)):
            op = getattr(getattr(getattr(torch.ops, namespace), name), overload)
            emitted.add(op)
            if op in decompositions and op not in lowerings:
                unlowerable.append(f"{module.__name__}: {op}")
    assert len(emitted) >= 10, emitted  # the pattern still finds what the passes write
    assert not unlowerable, unlowerable
