"""`inspect --profile`'s join on a synthetic CUDA profiler event tree (no GPU needed): Inductor
opens a record named after each Triton kernel it launches; that kernel's device time must land
in the kernel and source-line tables, not only in the totals (issue 26, defect 1)."""

from types import SimpleNamespace

import pytest
import torch

from graphtrain.inspect.profile import attribute
from graphtrain.inspect.report import GeneratedCode

_CODE = """
triton_poi_fused_add_0 = async_compile.triton('triton_poi_fused_add_0', '''...''')
triton_red_fused_sum_1 = async_compile.triton('triton_red_fused_sum_1', '''...''')

def call(args):
    # [Provenance debug handles] triton_poi_fused_add_0:1
    triton_poi_fused_add_0.run(buf0, arg0_1, stream=stream0)
    # [Provenance debug handles] extern_kernels.mm:2
    extern_kernels.mm(buf0, arg1_1, out=buf1)
    # [Provenance debug handles] triton_red_fused_sum_1:3
    triton_red_fused_sum_1.run(buf1, buf2, stream=stream0)
"""


def _event(name, children=(), kernels=(), start=0):
    event = SimpleNamespace(
        name=name,
        cpu_children=list(children),
        kernels=[SimpleNamespace(name=k, duration=us) for k, us in kernels],
        time_range=SimpleNamespace(start=start),
        cpu_time_total=5.0,
        cpu_parent=None,
    )
    for child in event.cpu_children:
        child.cpu_parent = event
    return event


def _launch(kernel, us, start):
    """Inductor's record of one Triton launch, the driver call under it, the device kernel."""
    return _event(kernel, [_event("cuLaunchKernelEx", kernels=[(kernel, us)])], start=start)


def _report():
    """A report of one graph whose generated module is _CODE."""
    code = GeneratedCode(
        stage="forward",
        path="output_code_0.py",
        code=_CODE,
        kernels={
            "triton_poi_fused_add_0:1": {"nodes": ["add"], "stack_traces": []},
            "extern_kernels.mm:2": {"nodes": ["mm"], "stack_traces": []},
            "triton_red_fused_sum_1:3": {"nodes": ["sum_1"], "stack_traces": []},
        },
        node_sources={
            "add": ["models/m.py:10 in forward", "y = x + 1"],
            "mm": ["models/m.py:11 in forward", "z = y @ w"],
            "sum_1": ["models/m.py:12 in forward", "return z.sum()"],
        },
    )
    return SimpleNamespace(graphs=[SimpleNamespace(name="block-0", output_code=[code])])


def _extern(op, kernel, us, start):
    """An operator record (an extern call) and the device kernel it launched."""
    return _event(op, [_event("cudaLaunchKernel", kernels=[(kernel, us)])], start=start)


def _profile(steps, *extra):
    """`steps` calls of _CODE's module, each with `extra` records after its three."""
    calls = [
        _event(
            f"## Call CompiledFxGraph fabc{step} ##",
            [
                _launch("triton_poi_fused_add_0", 30.0, 1),
                _extern("aten::mm", "sm90_gemm", 70.0, 2),
                _launch("triton_red_fused_sum_1", 20.0, 3),
                *extra,
            ],
        )
        for step in range(steps)
    ]
    return SimpleNamespace(events=lambda: calls)


def test_triton_launch_records_are_generated_kernels_on_cuda():
    steps = 2
    profile = attribute(
        _profile(steps), _report(), steps=steps, step_ms=1.0, device=torch.device("cuda")
    )
    assert profile.kernel_ms == pytest.approx(0.12)
    # Every microsecond matched: before the fix the Triton launches were read as extern calls,
    # matched none and fell out of the tables (attributed 0.07 of 0.12 ms).
    assert profile.attributed_ms == pytest.approx(0.12)
    rows = {k.kernel: (k.ms, k.calls, k.sources) for k in profile.kernels}
    assert rows == {
        "triton_poi_fused_add_0": (pytest.approx(0.03), 1, ["models/m.py:10 in forward"]),
        "extern_kernels.mm": (pytest.approx(0.07), 1, ["models/m.py:11 in forward"]),
        "triton_red_fused_sum_1": (pytest.approx(0.02), 1, ["models/m.py:12 in forward"]),
    }
    lines = {line.code: line.ms for line in profile.lines}
    assert lines == {
        "y = x + 1": pytest.approx(0.03),
        "z = y @ w": pytest.approx(0.07),
        "return z.sum()": pytest.approx(0.02),
    }
    assert profile.graphs == {"block-0/forward": pytest.approx(0.12)}


def test_pass_off_model_shares_the_weights_instead_of_copying_them():
    """Issue 26, defect 6: the pass-off model of `inspect --profile` holds the profiled model's
    own tensors (no second or third copy of the weights)."""
    from graphtrain.compile import apply_compile
    from graphtrain.config import load_config
    from graphtrain.inspect.api import _build
    from graphtrain.inspect.profile import share_weights

    cfg = load_config(["--preset", "debug", "--model.num_layers=1"])
    model = _build(cfg, torch.device("cpu"))
    apply_compile(model, passes=cfg.compile.passes, inner="aot_eager")  # lazy: nothing compiles
    without = share_weights(model, _build(cfg, torch.device("meta")))
    theirs = dict(model.named_parameters()) | dict(model.named_buffers())
    mine = dict(without.named_parameters()) | dict(without.named_buffers())
    assert set(mine) == set(theirs) and len(mine) > 5
    assert all(mine[name] is theirs[name] for name in mine)
    assert not any(t.is_meta for t in mine.values())  # the non-persistent rope cache too
    tokens = torch.randint(0, cfg.model.vocab_size, (1, 17))
    with torch.no_grad():
        torch.testing.assert_close(
            without(tokens[:, :-1], tokens[:, 1:]), model(tokens[:, :-1], tokens[:, 1:])
        )
    other = load_config(["--preset", "debug", "--model.num_layers=2"])
    with pytest.raises(AttributeError):
        share_weights(model, _build(other, torch.device("meta")))


def test_unattributed_time_names_its_operators():
    # Two extern calls the module does not make (the generated code has one mm): their time is
    # kernel time of the region but no line's, and the (unattributed) line names them.
    steps = 2
    extra = (
        _extern("aten::addmm", "sm90_gemm_bias", 50.0, 4),
        _extern("aten::_efficient_attention_backward", "fmha_bwd", 10.0, 5),
    )
    profile = attribute(
        _profile(steps, *extra), _report(), steps=steps, step_ms=1.0, device=torch.device("cuda")
    )
    assert profile.kernel_ms == pytest.approx(0.18)
    assert profile.attributed_ms == pytest.approx(0.12)
    line = next(line for line in profile.lines if line.source == "(unattributed)")
    assert line.ms == pytest.approx(0.06)
    assert line.code.endswith(": addmm 0.050 ms, _efficient_attention_backward 0.010 ms")


def test_a_foreign_kernel_leaves_the_rest_of_its_call_attributed():
    # A device kernel that the module does not generate, hung directly on the call (launched
    # outside any record): before, one such kernel left the whole call unmatched (attributed 0
    # of 0.125 ms, every line lost); now only its own time is unattributed, under its name.
    steps = 2
    profile = attribute(
        _profile(steps, _event("cuLaunchKernelEx", kernels=[("nvjet_tst_128x256", 5.0)], start=4)),
        _report(),
        steps=steps,
        step_ms=1.0,
        device=torch.device("cuda"),
    )
    assert profile.kernel_ms == pytest.approx(0.125)
    assert profile.attributed_ms == pytest.approx(0.12)
    assert profile.graphs == {"block-0/forward": pytest.approx(0.125)}
    line = next(line for line in profile.lines if line.source == "(unattributed)")
    assert line.ms == pytest.approx(0.005) and line.code.endswith(": nvjet_tst_128x256 0.005 ms")
    assert not profile.notes


def test_a_call_of_another_module_is_not_taken_for_this_one():
    # Most of its kernels are not this module's: the call matches none, and the note says how
    # many calls of which stage went unmatched.
    steps = 1
    other = _event(
        "## Call CompiledFxGraph fother ##",
        [_launch("triton_poi_fused_mul_0", 30.0, 1), _launch("triton_poi_fused_add_0", 10.0, 2)],
    )
    prof = _profile(steps)
    calls = [*prof.events(), other]
    profile = attribute(
        SimpleNamespace(events=lambda: calls),
        _report(),
        steps=steps,
        step_ms=1.0,
        device=torch.device("cuda"),
    )
    assert profile.attributed_ms == pytest.approx(0.12)
    assert profile.graphs["(unmatched compiled call)"] == pytest.approx(0.04)
    assert profile.notes == [
        "1 of 2 compiled calls matched no generated module (1 forward): their time is in the "
        "(unattributed) line"
    ]
