"""LRSchedule: exact values per phase and decay style, boundaries, state dict, errors.

Expected values are written out by hand from the formulas (lr 1.0, min_lr 0.1, 4 warmup steps,
4 decay steps, 12 steps in all: warmup steps 0-3, stable 4-7, decay 8-11 with r = 0 .. 3/4).
The peers' own step conventions are restated in float64 (Megatron-Core's get_lr at num_steps =
step, torchtitan's LambdaLR factor with its virtual last step) and compared on random shapes.
"""

import math
import random

import pytest
import torch

from graphtrain.optim import LRSchedule


def make(style: str, **overrides) -> LRSchedule:
    kwargs = dict(
        lr=1.0, min_lr=0.1, warmup_steps=4, decay_steps=4, total_steps=12, decay_style=style
    )
    kwargs.update(overrides)
    return LRSchedule(**kwargs)


# Decay steps 8, 9, 10, 11 have r = 0, 0.25, 0.5, 0.75; steps 12, 13 (past the end) r = 1.
EXPECTED_DECAY = {
    # 0.1 + 0.9 * (1 - r)
    "linear": [1.0, 0.775, 0.55, 0.325],
    # 0.1 + 0.45 * (1 + cos(pi r)); cos(pi/4) = 0.7071067811865476
    "cosine": [1.0, 0.8681980515339464, 0.55, 0.23180194846605365],
    # 0.1 + 0.9 * (2 * 0.5 ** r - 1); 0.5 ** 0.25 = 0.8408964152537145,
    # 0.5 ** 0.5 = 0.7071067811865476, 0.5 ** 0.75 = 0.5946035575013605
    "exponential": [1.0, 0.7136135474566861, 0.47279220613578563, 0.27028640350244893],
    # 0.1 + 0.9 * (1 - sqrt(r)); sqrt(0.5) = 0.7071067811865476, sqrt(0.75) = 0.8660254037844386
    "minus_sqrt": [1.0, 0.55, 0.36360389693210724, 0.22057713659400525],
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
    assert schedule.lr_at(8) == 1.0  # first decay step: r = 0
    assert schedule.lr_at(9) < 1.0
    assert schedule.lr_at(11) == pytest.approx(0.325)  # last step: r = 3/4, not min_lr
    assert schedule.lr_at(12) == pytest.approx(0.1)  # past the end: min_lr


def test_no_warmup_no_decay():
    schedule = make("cosine", warmup_steps=0, decay_steps=0)
    assert [schedule.lr_at(s) for s in (0, 5, 11, 20)] == [1.0, 1.0, 1.0, 1.0]


@pytest.mark.parametrize("style", sorted(EXPECTED_DECAY))
def test_min_lr_zero_last_step_still_trains(style):
    """min_lr = 0 is allowed for every style (exponential too, as in Megatron-Core); the last
    step trains at the value (D-1)/D through the decay, never 0."""
    schedule = make(style, min_lr=0.0, warmup_steps=0, decay_steps=5, total_steps=5)
    coeff = {
        "linear": 1 - 0.8,
        "cosine": 0.5 * (1 + math.cos(math.pi * 0.8)),
        "exponential": 2 * 0.5**0.8 - 1,
        "minus_sqrt": 1 - math.sqrt(0.8),
    }[style]
    assert schedule.lr_at(4) == pytest.approx(coeff, rel=1e-12) and schedule.lr_at(4) > 0
    assert schedule.lr_at(0) == 1.0 and schedule.lr_at(5) == 0.0


def test_exponential_matches_the_issue_numbers():
    """At min/max = 0.1: 0.71 of the peak at r = 0.25 and 0.47 at r = 0.5 (not 0.56 and 0.32 of
    max * (min/max) ** r)."""
    schedule = make("exponential", warmup_steps=0, decay_steps=4, total_steps=4)
    assert round(schedule.lr_at(1), 2) == 0.71 and round(schedule.lr_at(2), 2) == 0.47


def test_inverse_sqrt_closed_form():
    """lr * sqrt(max(W, 1) / max(step, 1)) from step W on, floored at min_lr; decay_steps unused."""
    schedule = make("inverse_sqrt")
    got = [schedule.lr_at(step) for step in range(14)]
    expected = [0.25, 0.5, 0.75, 1.0]  # warm-up as every style
    expected += [math.sqrt(4 / step) for step in range(4, 13)] + [0.1]  # past the end: min_lr
    assert got == pytest.approx(expected, rel=1e-12, abs=0)
    assert got[5] == pytest.approx(0.894427190999916, rel=1e-12)  # sqrt(4/5) by hand
    floored = make("inverse_sqrt", min_lr=0.65)
    assert floored.lr_at(9) == pytest.approx(math.sqrt(4 / 9)) and floored.lr_at(10) == 0.65
    no_warmup = make("inverse_sqrt", warmup_steps=0, decay_steps=0)
    assert [no_warmup.lr_at(s) for s in (0, 1, 4)] == pytest.approx([1.0, 1.0, 0.5])


def megatron_lr(num_steps, *, max_lr, min_lr, warmup, total, wsd_decay, style):
    """Megatron-Core's OptimizerParamScheduler.get_lr (lr_decay_steps = total, WSD with
    wsd_decay_steps = wsd_decay, or inverse-square-root), restated in float64."""
    if warmup > 0 and num_steps <= warmup:
        return max_lr * num_steps / warmup
    if num_steps > total:
        return min_lr
    if style == "inverse_sqrt":
        return max(min_lr, max_lr * max(warmup, 1) ** 0.5 / max(num_steps, 1) ** 0.5)
    anneal_start = total - wsd_decay
    if num_steps <= anneal_start:
        coeff = 1.0
    else:
        r = (num_steps - anneal_start) / wsd_decay
        coeff = {
            "linear": 1.0 - r,
            "cosine": 0.5 * (math.cos(math.pi * r) + 1.0),
            "exponential": 2.0 * 0.5**r - 1.0,
            "minus_sqrt": 1.0 - math.sqrt(r),
        }[style]
    return min_lr + coeff * (max_lr - min_lr)


def torchtitan_factor(step, *, warmup, decay, total, style, min_factor):
    """torchtitan's linear_warmup_stable_decay factor for LambdaLR's step (= the 0-based
    optimizer step), with its virtual last step (stable = total + 1 - warmup - decay)."""
    stable = total + 1 - warmup - decay
    if step < warmup:
        return (step + 1) / warmup
    if step < warmup + stable:
        return 1.0
    progress = (step + 1 - (warmup + stable)) / decay
    coeff = {
        "linear": 1 - progress,
        "minus_sqrt": 1 - math.sqrt(progress),
        "cosine": 0.5 * (1.0 + math.cos(math.pi * progress)),
    }[style]
    return min_factor + (1 - min_factor) * coeff


@pytest.mark.parametrize("style", [*sorted(EXPECTED_DECAY), "inverse_sqrt"])
def test_the_peers_conventions(style):
    """Every step from the end of warm-up on: Megatron-Core's value at num_steps = step (the
    warm-up differs by design: Megatron's step 0 trains at 0); torchtitan's at every step
    (its styles)."""
    rng = random.Random(31)
    for _ in range(30):
        total = rng.randint(2, 60)
        warmup = rng.randint(0, total - 1)
        decay = rng.randint(1, total - warmup)
        min_lr = rng.choice([0.0, 0.1, 0.3])
        schedule = LRSchedule(
            lr=1.0,
            min_lr=min_lr,
            warmup_steps=warmup,
            decay_steps=decay,
            total_steps=total,
            decay_style=style,
        )
        for step in range(warmup, total):
            want = megatron_lr(
                step,
                max_lr=1.0,
                min_lr=min_lr,
                warmup=warmup,
                total=total,
                wsd_decay=decay,
                style=style,
            )
            assert schedule.lr_at(step) == pytest.approx(want, rel=1e-12, abs=1e-15), (
                style,
                total,
                warmup,
                decay,
                step,
            )
        if style in ("linear", "cosine", "minus_sqrt"):
            for step in range(total):
                want = torchtitan_factor(
                    step, warmup=warmup, decay=decay, total=total, style=style, min_factor=min_lr
                )
                assert schedule.lr_at(step) == pytest.approx(want, rel=1e-12, abs=1e-15)


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
    assert lr_tensor.item() == pytest.approx(0.775)


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
        (dict(min_lr=-0.1), "min_lr must be >= 0"),
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
