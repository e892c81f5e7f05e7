"""The resolved config as text: the TOML the run directory keeps, and `train --help`."""

from __future__ import annotations

import dataclasses
import textwrap
import typing
from typing import Any, Literal

from graphtrain.config.load import _type_name
from graphtrain.config.sections import JobConfig


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(value, list | tuple):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    raise TypeError(f"cannot write {value!r} as TOML")


def _unused_alternatives(cfg: JobConfig) -> set[tuple[str, str]]:
    return {("schedule", "warmup_ratio" if cfg.schedule.warmup_steps >= 0 else "warmup_steps")}


def to_toml(cfg: JobConfig) -> str:
    lines = [f"preset = {_toml_value(cfg.preset)}"]
    for f in dataclasses.fields(cfg):
        section = getattr(cfg, f.name)
        if not dataclasses.is_dataclass(section):
            continue
        lines.append(f"\n[{f.name}]")
        for k, v in dataclasses.asdict(section).items():
            if (f.name, k) in _unused_alternatives(cfg):
                continue  # written, it would contradict the key in effect
            lines.append(f"{k} = {_toml_value(v)}")
    return "\n".join(lines) + "\n"


def field_help(cls: type, name: str) -> str:
    """The `--help` text of field `name`: its metadata["help"] (models.fields.option)."""
    return {f.name: f for f in dataclasses.fields(cls)}[name].metadata.get("help", "")


def describe_key(section: Any, name: str, tp: Any) -> str:
    """`name`'s type, allowed values and description, for `--help`."""
    kind = _type_name(tp)
    if typing.get_origin(tp) is Literal:
        kind += ": " + " | ".join(typing.get_args(tp))
    return f"({kind}) {field_help(type(section), name)}".rstrip()


def describe_keys(cfg: JobConfig) -> str:
    """Every section and key of `cfg` with its value in `cfg` (the default for this preset), type,
    allowed values and description, for `graphtrain train --help`."""
    out = []
    for f in dataclasses.fields(cfg):
        section = getattr(cfg, f.name)
        if not dataclasses.is_dataclass(section):
            continue
        out.append(f"[{f.name}]")
        hints = typing.get_type_hints(type(section))
        for k, v in dataclasses.asdict(section).items():
            out.append(f"  --{f.name}.{k}={_toml_value(v)}")
            out.extend(
                textwrap.wrap(
                    describe_key(section, k, hints[k]),
                    width=100,
                    initial_indent=" " * 6,
                    subsequent_indent=" " * 6,
                )
            )
    return "\n".join(out)
