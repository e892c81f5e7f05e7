"""`graphtrain inspect [CONFIG_OR_RUN_DIR] [--preset NAME] [--out DIR] ...`."""

from __future__ import annotations

import sys
import time
from pathlib import Path

from graphtrain.inspect.api import inspect_config, write_report
from graphtrain.inspect.terminal import render_summary, use_color

USAGE = """usage: graphtrain inspect [CONFIG.toml | RUN_DIR] [--preset NAME] [--out DIR]
                          [--backend aot_eager|inductor] [--device auto|cpu|cuda|meta]
                          [--trace DIR] [--profile [STEPS]] [--compare PASSES]
                          [--section.key=value ...]

Compiles the configured model's regions through the graphtrain backend without training (one
forward and backward on random tokens, then one validation forward under no_grad) and reports
every compiled graph, each pass's result and notes, the graphtrain custom ops inserted, graph
breaks, recompiles and why, compile time per stage, cache hits, and Inductor's generated code.
Writes DIR/report.html (one self-contained page), report.json, summary.txt and the raw graph
dumps in DIR/graphs. DIR: --out, else RUN_DIR/inspect (given a run directory, or a config.toml
inside one), else training.run_dir/inspect when set, else runs/inspect-<preset>-<date>-<time>.
With parallel.pp > 1: every pp rank's regions, compiled as that rank does (graphs named
pp<rank>.<region>-<k>), and a table of the stages, their pp ranks and their graphs.
  --device meta     trace only, no weights allocated (large presets on a laptop; aot_eager)
  --trace DIR       also write torch's structured trace there (TORCH_TRACE format, for tlparse)
  --profile [N]     then run N (default 5) steps under torch.profiler and attribute the kernel
                    time to regions, FX nodes and source lines, and time each fusing pass's
                    region with the pass off (Inductor, a real device)
  --compare P[,P]   with --profile: time only these passes' regions with the pass off (one
                    compile each); "none" for none, "all" (the default) for every fusing pass
"""

_OPTIONS = ("out", "backend", "device", "trace", "profile", "compare")
DEFAULT_PROFILE_STEPS = 5


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
            if not has_value and key == "profile":
                following = args[i + 1] if i + 1 < len(args) else ""
                if following.isdigit():
                    value, i = following, i + 1
                else:
                    value = str(DEFAULT_PROFILE_STEPS)
            elif not has_value:
                if i + 1 >= len(args):
                    raise ValueError(f"--{key} needs a value")
                value, i = args[i + 1], i + 1
            own[key] = value
        else:
            rest.append(args[i])
        i += 1
    return source, own, rest


def _compare(value: str) -> set[str] | None:
    """--compare's passes: None for "all", none for "none", else the named passes (known ones)."""
    from graphtrain.passes import all_passes

    if value == "all":
        return None
    names = set() if value == "none" else {n for n in value.split(",") if n}
    unknown = names - {p.name for p in all_passes()}
    if unknown or (value != "none" and not names):
        known = ", ".join(sorted(p.name for p in all_passes()))
        raise ValueError(
            f"--compare takes all, none or pass names, got {value!r} "
            f"(unknown: {', '.join(sorted(unknown)) or 'none given'}; passes: {known})"
        )
    return names


def default_out_dir(run_dir: str, preset: str) -> Path:
    """Where the report goes without --out: inside the configured run directory, else a new
    folder beside the training runs (never the current directory itself)."""
    if run_dir:
        return Path(run_dir) / "inspect"
    return Path("runs") / f"inspect-{preset}-{time.strftime('%Y%m%d-%H%M%S')}"


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
            if (path.parent / "run_info.json").is_file():  # the config.toml of a run
                default_out = path.parent / "inspect"
        else:
            raise ValueError(f"{source!r} is neither a TOML config file nor a run directory")
    elif not any(a.startswith("--preset") for a in rest):
        raise ValueError("give a config file, a run directory, or --preset NAME")
    cfg = load_config(rest, file=config_file)
    out = Path(own.get("out") or default_out or default_out_dir(cfg.training.run_dir, cfg.preset))
    backend = own.get("backend")
    if backend is not None and backend not in ("aot_eager", "inductor"):
        raise ValueError(f"--backend must be aot_eager or inductor, got {backend!r}")
    steps = own.get("profile", "0")
    if not steps.isdigit() or ("profile" in own and int(steps) < 1):
        raise ValueError(f"--profile takes a number of steps >= 1, got {steps!r}")
    if "profile" in own and backend is None:
        backend = "inductor"  # the profile attributes Inductor's kernels
    compare = _compare(own.get("compare", "all"))
    report = inspect_config(
        cfg,
        device=own.get("device", "auto"),
        inner=backend,
        dump_dir=out / "graphs",
        trace_dir=own.get("trace"),
        profile_steps=int(steps),
        compare=compare,
    )
    page = write_report(report, out)
    sys.stdout.write(render_summary(report, color=use_color()))
    print(f"\nreport: {page}")
    if "trace" in own:
        print(f"structured trace (tlparse): {own['trace']}")
    return 0
