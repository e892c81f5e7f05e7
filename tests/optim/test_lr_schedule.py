"""LRSchedule: exact values per phase and decay style, boundaries, state dict, errors.

Expected values are written out by hand from the formulas (lr 1.0, min_lr 0.1, 4 warmup steps,
4 decay steps, 12 steps in all: warmup steps 0-3, stable 4-7, decay 8-11 with r = 1/4 .. 1).
"""

import pytest
import torch

from graphtrain.optim import LRSchedule


def make(style: str, **overrides) -> LRSchedule:
    kwargs = dict(
        lr=1.0, min_lr=0.1, warmup_steps=4, decay_steps=4, total_steps=12, decay_style=style
    )
    kwargs.update(overrides)
    return LRSchedule(**kwargs)


# Decay steps 8, 9, 10, 11 have r = 0.25, 0.5, 0.75, 1.0.
EXPECTED_DECAY = {
    # 0.1 + 0.9 * (1 - r)
    "linear": [0.775, 0.55, 0.325, 0.1],
    # 0.1 + 0.45 * (1 + cos(pi r)); cos(pi/4) = 0.7071067811865476
    "cosine": [0.8681980515339464, 0.55, 0.23180194846605365, 0.1],
    # 0.1 ** r
    "exponential": [0.5623413251903491, 0.31622776601683794, 0.1778279410038923, 0.1],
    # 0.1 + 0.9 * (1 - sqrt(r)); sqrt(0.5) = 0.7071067811865476, sqrt(0.75) = 0.8660254037844386
    "minus_sqrt": [0.55, 0.36360389693210724, 0.22057713659400525, 0.1],
}


@pytest.mark.parametrize("style", sorted(EXPECTED_DECAY))
def test_every_phase_exact(style):
    schedule = make(style)
    got = [schedule.lr_at(step) for step in range(14)]
    warmup = [0.25, 0.5, 0.75, 1.0]
    stable = [1.0, 1.0, 1.0, 1.0]
    past_end = [0.1, 0.1]
    expected = warmup + stable + EXPECTED_DECAY[style] + past_end
    assert got == pytest.approx(expected, rel=1e-12, abs=0)


def test_boundaries():
    schedule = make("linear")
    assert schedule.lr_at(0) == 0.25  # first step: lr / warmup_steps, not 0
    assert schedule.lr_at(3) == 1.0  # last warmup step reaches lr
    assert schedule.lr_at(4) == 1.0  # first stable step
    assert schedule.decay_start == 8
    assert schedule.lr_at(7) == 1.0  # last stable step
    assert schedule.lr_at(8) < 1.0  # first decay step already decays
    assert schedule.lr_at(11) == pytest.approx(0.1)  # last step at min_lr


def test_no_warmup_no_decay():
    schedule = make("cosine", warmup_steps=0, decay_steps=0)
    assert [schedule.lr_at(s) for s in (0, 5, 11, 20)] == [1.0, 1.0, 1.0, 1.0]


def test_exponential_min_lr_zero_is_an_error():
    with pytest.raises(ValueError, match="min_lr > 0"):
        make("exponential", min_lr=0.0)
    # Without a decay phase min_lr is unused, so 0 is fine.
    make("exponential", min_lr=0.0, decay_steps=0)


def test_apply_sets_every_group():
    params = [torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(2))]
    opt = torch.optim.SGD([{"params": params[:1]}, {"params": params[1:]}], lr=123.0)
    schedule = make("linear")
    assert schedule.apply(opt, 1) == 0.5
    assert [g["lr"] for g in opt.param_groups] == [0.5, 0.5]
    assert schedule.last_step == 1
    # A tensor lr is filled in place (capturable / compiled optimizers).
    lr_tensor = torch.tensor(9.0)
    opt.param_groups[0]["lr"] = lr_tensor
    schedule.apply(opt, 9)
    assert opt.param_groups[0]["lr"] is lr_tensor
    assert lr_tensor.item() == pytest.approx(0.55)


def test_state_dict_round_trip():
    schedule = make("minus_sqrt")
    schedule.last_step = 7
    state = schedule.state_dict()
    other = make("linear", lr=5.0, min_lr=0.0, warmup_steps=0, decay_steps=1, total_steps=2)
    other.load_state_dict(state)
    assert other.state_dict() == state
    assert other.last_step == 7
    assert [other.lr_at(s) for s in range(13)] == [schedule.lr_at(s) for s in range(13)]


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        (dict(warmup_steps=8, decay_steps=5), r"warmup_steps \(8\) \+ decay_steps \(5\).*12"),
        (dict(warmup_steps=-1), "warmup_steps.*-1"),
        (dict(decay_steps=-2), "decay_steps.*-2"),
        (dict(total_steps=0, warmup_steps=0, decay_steps=0), "total_steps.*0"),
        (dict(decay_style="step"), "'step'"),
        (dict(min_lr=2.0), r"min_lr \(2.0\).*lr \(1.0\)"),
        (dict(lr=0.0, min_lr=0.0), "lr must be positive"),
    ],
)
def test_errors_name_the_values(overrides, match):
    with pytest.raises(ValueError, match=match):
        make("linear", **overrides)


def test_negative_step_is_an_error():
    with pytest.raises(ValueError, match="-1"):
        make("linear").lr_at(-1)
