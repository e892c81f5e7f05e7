"""What changed since a checkpoint: the differences a resumed run logs (it never refuses them).

Both schedules are functions of (step, consumed tokens) and the config: the config wins, so a
run can be extended or re-scheduled; a change of a schedule or of the model config is worth a
line in the log, which resume_differences words.
"""

from __future__ import annotations

import dataclasses
from typing import Any


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
            lines.append(f"{name} differs from the checkpoint's: {current}")
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
