"""Config fields with their `--help` text: option(default, doc) puts `doc` in the field's
metadata["help"], the one copy of a key's documentation (the model configs here and
graphtrain's config sections alike)."""

from __future__ import annotations

import dataclasses
from typing import Any


def option(
    default: Any = dataclasses.MISSING, doc: str = "", *, factory: Any = dataclasses.MISSING
) -> Any:
    """A dataclass field whose `--help` text is `doc` (default or factory as dataclasses.field)."""
    return dataclasses.field(default=default, default_factory=factory, metadata={"help": doc})
