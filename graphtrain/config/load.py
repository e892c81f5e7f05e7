"""Resolving a JobConfig: the preset, the TOML file and --section.key=value, applied with types.

Later wins: the dataclass defaults, the job preset (`--preset NAME`, or `preset = "NAME"` at the
top of the TOML file), the TOML file (`--config FILE`), the command line (`--section.key=value`
or `--section.key value`; a bare `--section.flag` sets a bool to true). Unknown sections or keys
and values of the wrong type are errors that name the key.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from pathlib import Path
from typing import Any, Literal

import tomllib

from graphtrain.config.presets import JOB_PRESETS, preset_updates
from graphtrain.config.sections import JobConfig
from models import MODEL_PRESETS


def _type_name(tp: Any) -> str:
    if typing.get_origin(tp) is Literal:
        return "str"
    if typing.get_origin(tp) in (list, tuple):
        return "list of " + _type_name((typing.get_args(tp) or (Any,))[0])
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _cli_scalar(text: str, tp: Any) -> Any:
    """Command-line text for a bool/int/float key as that type; the text itself when it is not
    one (then _coerce names the key and the value)."""
    if tp is bool:
        lowered = text.lower()
        return lowered in ("true", "1") if lowered in ("true", "false", "1", "0") else text
    try:
        return tp(text)
    except ValueError:
        return text


def _coerce(key: str, value: Any, tp: Any) -> Any:
    """`value` as type `tp`, or a ValueError naming `key`, the value and the expected type."""
    origin = typing.get_origin(tp)
    if origin in (list, tuple):
        (item_tp, *_) = typing.get_args(tp) or (Any,)
        if isinstance(value, str):  # from the command line: "a,b,c"
            value = [v.strip() for v in value.split(",") if v.strip()]
        if not isinstance(value, list | tuple):
            raise ValueError(
                f"config key {key!r} expects a list of {_type_name(item_tp)}, got {value!r}"
            )
        return [_coerce(f"{key}[{i}]", v, item_tp) for i, v in enumerate(value)]
    if origin in (typing.Union, types.UnionType):
        raise TypeError(f"config field {key!r}: union types are not supported")  # internal
    # Numbers and booleans must be TOML numbers and booleans: a TOML string "5" for an int key
    # is refused (the command line's text was parsed before, in _cli_values).
    if tp is bool:
        if isinstance(value, bool):
            return value
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif tp is float:
        if isinstance(value, int | float) and not isinstance(value, bool):
            # No key means anything by nan or inf (TOML and float() accept both).
            if not math.isfinite(value):
                raise ValueError(f"config key {key!r} expects a finite number, got {value!r}")
            return float(value)
    elif tp is str or origin is Literal:
        if isinstance(value, str):
            return value  # a Literal's choices are checked in the section's __post_init__
    else:
        raise TypeError(f"config field {key!r} has unsupported type {tp!r}")  # internal
    raise ValueError(f"config key {key!r} expects {_type_name(tp)}, got {value!r}")


def _apply(obj: Any, updates: dict[str, Any], prefix: str) -> Any:
    """A copy of dataclass `obj` with `updates` (nested dicts for nested dataclasses) applied."""
    hints = typing.get_type_hints(type(obj))
    fields = {f.name for f in dataclasses.fields(obj)}
    changes = {}
    for name, value in updates.items():
        key = f"{prefix}{name}"
        if name not in fields:
            known = ", ".join(sorted(fields))
            raise ValueError(f"unknown config key {key!r}; known keys here: {known}")
        current = getattr(obj, name)
        if dataclasses.is_dataclass(current):
            if not isinstance(value, dict):
                raise ValueError(f"config key {key!r} is a section; got the value {value!r}")
            changes[name] = _apply(current, value, f"{key}.")
        else:
            if isinstance(value, dict):  # --training.steps.x=1: keys below a plain value
                below = ", ".join(f"{key}.{k}" for k in value)
                raise ValueError(
                    f"config key {below!r} does not exist: {key!r} is a value, not a section; "
                    f"set it as --{key}=..."
                )
            changes[name] = _coerce(key, value, hints[name])
    return dataclasses.replace(obj, **changes)


def _merge(base: dict, extra: dict) -> dict:
    out = dict(base)
    for k, v in extra.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def _parse_cli_value(text: str) -> Any:
    """A TOML literal when it is one (numbers, true/false, [lists], "strings"), else the text."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def parse_overrides(args: list[str]) -> tuple[dict[str, Any], dict[str, str]]:
    """Split argv into nested overrides {"training": {"steps": 5}} and the plain options
    {"preset": ..., "config": ...}. Values stay strings where the field type decides."""
    nested: dict[str, Any] = {}
    plain: dict[str, str] = {}
    i = 0
    while i < len(args):
        arg = args[i]
        if not arg.startswith("--") or len(arg) == 2:
            raise ValueError(f"unexpected argument {arg!r}; expected --section.key=value")
        key, has_value, value = arg[2:].partition("=")
        if not has_value:
            if i + 1 < len(args) and not args[i + 1].startswith("--"):
                value, i = args[i + 1], i + 1
            else:
                value = "true"  # a bare flag
        i += 1
        if key in ("preset", "config"):
            plain[key] = value
            continue
        if "." not in key:
            raise ValueError(f"unknown option --{key}; config keys look like --section.key=value")
        *sections, leaf = key.split(".")
        target = nested
        for depth, s in enumerate(sections):
            target = target.setdefault(s, {})
            if not isinstance(target, dict):
                parent = ".".join(sections[: depth + 1])
                raise ValueError(
                    f"config key {key!r}: {parent!r} is a value (given as --{parent}=...), "
                    f"not a section with keys"
                )
        # CLI strings: keep them raw for str and list fields (decided in _coerce via the field
        # type), parse TOML literals for the rest.
        target[leaf] = value
    return nested, plain


def _cli_values(obj: Any, updates: dict[str, Any]) -> dict[str, Any]:
    """Turn raw CLI strings into typed values, except for str fields where the text is the value."""
    hints = typing.get_type_hints(type(obj))
    out = {}
    for name, value in updates.items():
        current = getattr(obj, name, None)
        tp = hints.get(name)
        if isinstance(value, dict) and dataclasses.is_dataclass(current):
            out[name] = _cli_values(current, value)
        elif tp is str or typing.get_origin(tp) is Literal or not isinstance(value, str):
            out[name] = value
        elif tp in (bool, int, float):
            out[name] = _cli_scalar(value, tp)
        else:
            parsed = _parse_cli_value(value)
            # "a,b" for a list stays a string (split in _coerce); "[1, 2]" parses as a list.
            out[name] = value if isinstance(parsed, str) else parsed
    return out


# Keys that say the same thing two ways: a layer (file, command line) that sets one drops the
# other from the layers below it; one layer setting both is a contradiction.
_ALTERNATIVES = {("schedule", "warmup_steps"): ("schedule", "warmup_ratio")}
_ALTERNATIVES.update({b: a for a, b in _ALTERNATIVES.items()})


def _layer_over(below: dict[str, Any], layer: dict[str, Any], origin: str) -> dict[str, Any]:
    """`layer` merged over `below`, with the alternatives of the keys it sets removed first."""
    below = _merge(below, {})
    for (section, key), (alt_section, alt) in _ALTERNATIVES.items():
        if key in layer.get(section, {}) and alt in layer.get(alt_section, {}):
            raise ValueError(
                f"{origin} sets both {section}.{key} and {alt_section}.{alt}; set one of them"
            )
        if key in layer.get(section, {}) and isinstance(below.get(alt_section), dict):
            below[alt_section] = {k: v for k, v in below[alt_section].items() if k != alt}
    return _merge(below, layer)


def load_config(args: list[str] | None = None, *, file: str | Path | None = None) -> JobConfig:
    """Resolve a JobConfig from a preset, an optional TOML file and --section.key=value args."""
    overrides, plain = parse_overrides(list(args or []))
    file = plain.get("config", file)
    file_values: dict[str, Any] = {}
    if file:
        path = Path(file)
        if not path.is_file():
            raise ValueError(
                f"config file {str(path)!r} does not exist (looked for {str(Path(path).absolute())!r})"
            )
        try:
            file_values = tomllib.loads(path.read_text())
        except tomllib.TOMLDecodeError as e:
            raise ValueError(f"config file {str(path)!r} is not valid TOML: {e}") from None
    preset = plain.get("preset") or file_values.pop("preset", None) or JobConfig.preset
    file_values.pop("preset", None)
    values = _layer_over(preset_updates(preset), file_values, "the config file")
    values["preset"] = preset
    # The preset's model decides the model section's class (GPTConfig, MoEConfig, ...): its
    # keys are the ones a file or the command line may set.
    base = JobConfig(model=type(MODEL_PRESETS[JOB_PRESETS[preset]["model"]])())
    # Merge everything as plain dicts, then build each section once, so the __post_init__ checks
    # see the final values (a preset value overridden on the command line never trips a check).
    values = _layer_over(values, _cli_values(base, overrides), "the command line")
    unknown = set(values) - {f.name for f in dataclasses.fields(JobConfig)}
    if unknown:
        known = ", ".join(f.name for f in dataclasses.fields(JobConfig))
        raise ValueError(f"unknown config section(s) {sorted(unknown)}; known sections: {known}")
    return _apply(base, values, "")


def pass_options(cfg: JobConfig) -> dict[str, Any]:
    """The settings the graph passes read (graphtrain.passes.PassContext.options), by key.

    One place, so the trainer and `graphtrain inspect` hand the passes the same options.
    """
    return {
        "lce_mode": cfg.compile.lce_mode,
        "lce_memory_budget": cfg.compile.lce_memory_budget,
        "gdr_kernels": cfg.compile.gdr_kernels,
        "gdr_form": cfg.compile.gdr_form,
        **{f"fp8.{k}": v for k, v in dataclasses.asdict(cfg.fp8).items()},
        "tp_overlap_chunks": cfg.parallel.tp_overlap_chunks,
        "tp_overlap_variant": cfg.parallel.tp_overlap_variant,
    }
