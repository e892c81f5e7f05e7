import pytest
import torch

from graphtrain.compile import backend
from graphtrain.passes import order, registry
from graphtrain.passes.order import PASS_ORDER
from graphtrain.passes.registry import PassSpec, all_passes, register_pass, resolve_passes


@pytest.fixture
def fresh_registry(monkeypatch):
    monkeypatch.setattr(registry, "_REGISTRY", {})
    test_order = (
        ("pre_grad", "a_pre", "first"),
        ("pre_grad", "b_pre", "second"),
        ("post_grad", "late_post", "post"),
        ("pre_grad", "canonicalize", "listed for the stage check"),
    )
    monkeypatch.setattr(order, "PASS_ORDER", test_order)
    monkeypatch.setattr(registry, "PASS_ORDER", test_order)

    def noop(gm, example_inputs, *, ctx):
        """Does nothing."""
        return gm

    register_pass("late_post", stage="post_grad", default_on=True, preserves_numerics=True)(noop)
    register_pass("b_pre", stage="pre_grad", default_on=True, preserves_numerics=True)(noop)
    register_pass("a_pre", stage="pre_grad", default_on=False, preserves_numerics=False)(noop)


def test_run_order_is_stage_then_pass_order(fresh_registry):
    assert [p.name for p in all_passes()] == ["a_pre", "b_pre", "late_post"]
    assert all_passes()[0].description == "Does nothing."


def test_switches(fresh_registry):
    assert [p.name for p in resolve_passes()] == ["b_pre", "late_post"]
    assert [p.name for p in resolve_passes(["+a_pre", "-late_post"])] == ["a_pre", "b_pre"]
    assert [p.name for p in resolve_passes(["-b_pre", "+b_pre"])] == ["b_pre", "late_post"]


@pytest.mark.parametrize("switch", ["a_pre", "+nope", "-", "*b_pre"])
def test_bad_switch_names_known_passes(fresh_registry, switch):
    with pytest.raises(ValueError) as e:
        resolve_passes([switch])
    assert repr(switch) in str(e.value) and "a_pre, b_pre, late_post" in str(e.value)


def test_registration_errors(fresh_registry):
    with pytest.raises(ValueError, match="registered twice"):
        register_pass("b_pre", stage="pre_grad", default_on=True, preserves_numerics=True)(
            lambda gm, x, *, ctx: gm
        )
    with pytest.raises(ValueError, match="stage must be one of"):
        register_pass("x", stage="mid_grad", default_on=True, preserves_numerics=True)
    with pytest.raises(ValueError, match="'unlisted' is not listed in PASS_ORDER"):
        register_pass("unlisted", stage="pre_grad", default_on=True, preserves_numerics=True)


def test_a_stage_listed_elsewhere_in_pass_order_is_an_error(fresh_registry):
    with pytest.raises(ValueError, match="PASS_ORDER lists it under 'pre_grad'"):
        register_pass("canonicalize", stage="post_grad", default_on=True, preserves_numerics=True)


def test_every_pass_is_listed_once_in_pass_order_and_runs_in_its_order():
    listed = [(stage, name) for stage, name, _why in PASS_ORDER]
    assert len(set(listed)) == len(listed)
    assert [(p.stage, p.name) for p in all_passes()] == listed
    assert all(why for _stage, _name, why in PASS_ORDER)


def test_a_compile_runs_the_passes_in_pass_order(monkeypatch):
    """Every pass switched on, on a graph with a forward and a backward: the pre-grad passes
    run once in PASS_ORDER, then the post-grad ones on the forward and on the backward."""
    ran: list[str] = []
    call = PassSpec.__call__

    def recording(self, gm, example_inputs, ctx):
        ran.append(self.name)
        return call(self, gm, example_inputs, ctx)

    monkeypatch.setattr(PassSpec, "__call__", recording)
    switches = [f"+{name}" for _stage, name, _why in PASS_ORDER]
    compiled = torch.compile(
        lambda x, w: torch.nn.functional.linear(x, w).relu().sum(),
        backend=backend(passes=switches, inner="aot_eager"),
        fullgraph=True,
    )
    w = torch.randn(8, 4, requires_grad=True)
    compiled(torch.randn(3, 4), w).backward()
    pre = [name for stage, name, _why in PASS_ORDER if stage == "pre_grad"]
    post = [name for stage, name, _why in PASS_ORDER if stage == "post_grad"]
    assert ran == pre + post + post
