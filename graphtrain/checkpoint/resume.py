"""What changed since a checkpoint: the differences a resumed run logs (it never refuses them).

Both schedules are functions of (step, consumed tokens) and the config: the config wins, so a
run can be extended or re-scheduled; a change of a schedule or of the model config is worth a
line in the log, which resume_differences words: each changed value, saved against new, and the
learning rate the next step gets under both (extending a finished run with more
training.steps restarts its decay: the rate climbs back towards the peak).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any


def _lr_jump(schedule: Any, saved: dict[str, Any], step: int | None) -> str | None:
    """The learning rate the next step gets under the saved schedule and under the new one, when
    they differ (extending a finished run restarts its decay from the peak)."""
    if step is None or not hasattr(schedule, "lr_at"):
        return None
    try:
        before = type(schedule)(**saved).lr_at(step)
    except (TypeError, ValueError):  # another kind of schedule: nothing to compare
        return None
    now = schedule.lr_at(step)
    if math.isclose(before, now, rel_tol=1e-6):
        return None
    return (
        f"the learning rate of step {step + 1} is {now:.3g} under the new schedule, "
        f"{before:.3g} under the checkpoint's"
    )


def resume_differences(
    saved_state: dict[str, Any], *, schedules: dict[str, Any], model_cfg: Any
) -> list[str]:
    """Lines describing how the run differs from the checkpoint's trainer state `saved_state`.

    schedules: name -> object with state_dict() (e.g. "lr_schedule"), compared without their
    "last_step" entry; model_cfg: the model's config dataclass, compared field by field with the
    checkpoint's "model" entry (fields the checkpoint lacks are not compared).
    """
    lines = []
    for name, schedule in schedules.items():
        current = {key: value for key, value in schedule.state_dict().items() if key != "last_step"}
        saved = {key: value for key, value in saved_state[name].items() if key != "last_step"}
        if saved != current:
            changes = ", ".join(
                f"{key} {saved.get(key)!r} -> {current.get(key)!r}"
                for key in dict.fromkeys([*saved, *current])
                if saved.get(key) != current.get(key)
            )
            lines.append(f"{name} differs from the checkpoint's (saved -> now): {changes}")
            lr_line = _lr_jump(schedule, saved, saved_state.get("step"))
            if lr_line:
                lines.append(lr_line)
    saved_model = saved_state.get("model", {})
    changed = {
        field: (saved_model[field], value)
        for field, value in dataclasses.asdict(model_cfg).items()
        if field in saved_model and saved_model[field] != value
    }
    if changed:
        lines.append(
            "the model config differs from the checkpoint's: "
            + ", ".join(
                f"model.{field}: {old!r} -> {new!r}" for field, (old, new) in changed.items()
            )
        )
    return lines
