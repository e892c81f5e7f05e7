"""`graphtrain inspect [CONFIG_OR_RUN_DIR] [--preset NAME] [--out DIR] ...`."""

from __future__ import annotations

import sys
from pathlib import Path

from graphtrain.inspect.api import inspect_config, write_report
from graphtrain.inspect.terminal import render_summary, use_color

USAGE = """usage: graphtrain inspect [CONFIG.toml | RUN_DIR] [--preset NAME] [--out DIR]
                          [--backend aot_eager|inductor] [--device auto|cpu|cuda|meta]
                          [--trace DIR] [--section.key=value ...]

Compiles the configured model's regions through the graphtrain backend without training (one
forward and backward on random tokens) and reports every compiled graph, each pass's result
and notes, the graphtrain custom ops inserted, graph breaks and Inductor's output files.
Writes DIR/report.html (one self-contained page), report.json, summary.txt and the raw graph
dumps in DIR/graphs (default DIR: RUN_DIR/inspect, or inspect-<preset>).
  --device meta   trace only, no weights allocated (large presets on a laptop; aot_eager)
  --trace DIR     also write torch's structured trace there (TORCH_TRACE format, for tlparse)
"""

_OPTIONS = ("out", "backend", "device", "trace")


def _split(args: list[str]) -> tuple[str | None, dict[str, str], list[str]]:
    """(CONFIG_OR_RUN_DIR, inspect's own options, the rest for load_config)."""
    source = None
    if args and not args[0].startswith("--"):
        source, args = args[0], args[1:]
    own: dict[str, str] = {}
    rest: list[str] = []
    i = 0
    while i < len(args):
        key, has_value, value = args[i][2:].partition("=")
        if args[i].startswith("--") and key in _OPTIONS:
            if not has_value:
                if i + 1 >= len(args):
                    raise ValueError(f"--{key} needs a value")
                value, i = args[i + 1], i + 1
            own[key] = value
        else:
            rest.append(args[i])
        i += 1
    return source, own, rest


def main(args: list[str]) -> int:
    from graphtrain.config import load_config

    if "-h" in args or "--help" in args:
        print(USAGE)
        return 0
    source, own, rest = _split(args)
    config_file, default_out = None, None
    if source is not None:
        path = Path(source)
        if path.is_dir():
            config_file = path / "config.toml"
            if not config_file.is_file():
                raise ValueError(f"run directory {source!r} has no config.toml")
            default_out = path / "inspect"
        elif path.is_file():
            config_file = path
        else:
            raise ValueError(f"{source!r} is neither a TOML config file nor a run directory")
    elif not any(a.startswith("--preset") for a in rest):
        raise ValueError("give a config file, a run directory, or --preset NAME")
    cfg = load_config(rest, file=config_file)
    out = Path(own.get("out") or default_out or f"inspect-{cfg.preset}")
    backend = own.get("backend")
    if backend is not None and backend not in ("aot_eager", "inductor"):
        raise ValueError(f"--backend must be aot_eager or inductor, got {backend!r}")
    report = inspect_config(
        cfg,
        device=own.get("device", "auto"),
        inner=backend,
        dump_dir=out / "graphs",
        trace_dir=own.get("trace"),
    )
    page = write_report(report, out)
    sys.stdout.write(render_summary(report, color=use_color()))
    print(f"\nreport: {page}")
    if "trace" in own:
        print(f"structured trace (tlparse): {own['trace']}")
    return 0
