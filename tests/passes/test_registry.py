import pytest

from graphtrain.passes import registry
from graphtrain.passes.registry import all_passes, register_pass, resolve_passes


@pytest.fixture
def fresh_registry(monkeypatch):
    monkeypatch.setattr(registry, "_REGISTRY", {})

    def noop(gm, example_inputs, *, ctx):
        """Does nothing."""
        return gm

    register_pass(
        "late_post", stage="post_grad", order=1, default_on=True, preserves_numerics=True
    )(noop)
    register_pass("b_pre", stage="pre_grad", order=20, default_on=True, preserves_numerics=True)(
        noop
    )
    register_pass("a_pre", stage="pre_grad", order=10, default_on=False, preserves_numerics=False)(
        noop
    )


def test_run_order_is_stage_then_order(fresh_registry):
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
        register_pass("b_pre", stage="pre_grad", order=1, default_on=True, preserves_numerics=True)(
            lambda gm, x, *, ctx: gm
        )
    with pytest.raises(ValueError, match="stage must be one of"):
        register_pass("x", stage="mid_grad", order=1, default_on=True, preserves_numerics=True)
