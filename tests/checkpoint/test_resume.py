"""resume_differences: the lines a resumed run logs about schedules and model config."""

import dataclasses
from dataclasses import replace

from graphtrain.checkpoint import resume_differences
from graphtrain.optim import LRSchedule
from models import MODEL_PRESETS

CFG = MODEL_PRESETS["debug"]


def schedule(total_steps: int) -> LRSchedule:
    return LRSchedule(
        lr=1e-3,
        min_lr=0.0,
        warmup_steps=2,
        decay_steps=2,
        total_steps=total_steps,
        decay_style="linear",
    )


def saved(total_steps: int = 10) -> dict:
    state = schedule(total_steps).state_dict()
    return {"lr_schedule": {**state, "last_step": 7}, "model": dataclasses.asdict(CFG)}


def test_same_run_has_no_differences():
    lines = resume_differences(saved(), schedules={"lr_schedule": schedule(10)}, model_cfg=CFG)
    assert lines == []  # last_step is where the run was, not a change


def test_schedule_and_model_changes_are_named():
    new_cfg = replace(CFG, rope_theta=1.0)
    lines = resume_differences(saved(), schedules={"lr_schedule": schedule(20)}, model_cfg=new_cfg)
    assert len(lines) == 2
    # Old against new, only what changed.
    assert (
        lines[0] == "lr_schedule differs from the checkpoint's (saved -> now): total_steps 10 -> 20"
    )
    assert lines[1] == (
        "the model config differs from the checkpoint's: model.rope_theta: 10000.0 -> 1.0"
    )


def test_extending_a_finished_run_says_the_learning_rate_climbs_back():
    finished = {**saved(10), "step": 10}  # decayed to min_lr 0 at its last step
    lines = resume_differences(finished, schedules={"lr_schedule": schedule(20)}, model_cfg=CFG)
    assert lines[1] == (
        "the learning rate of step 11 is 0.001 under the new schedule, 0 under the checkpoint's"
    )


def test_fields_the_checkpoint_lacks_are_not_compared():
    old = saved()
    del old["model"]["rope_theta"]
    lines = resume_differences(
        old, schedules={}, model_cfg=replace(CFG, rope_theta=CFG.rope_theta * 2)
    )
    assert lines == []
