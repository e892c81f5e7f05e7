"""`graphtrain train | inspect | export | plan | generate | eval` (also `python -m graphtrain`)."""

from __future__ import annotations

import argparse
import logging
import os
import sys

# Nothing here imports torch at module level (nor does `import graphtrain`): `graphtrain --help`
# and the argparse help of export and plan answer without it.

USAGE = """usage: graphtrain COMMAND ...

commands:
  train     train a model: graphtrain train [--preset NAME] [--config FILE.toml]
            [--section.key=value ...] (`graphtrain train --help` lists every config key);
            `graphtrain train --check ...` only checks the config and the layout for
            $WORLD_SIZE ranks (launch.sh does this once before starting the ranks)
  inspect   show what the compiler does to a model (see `graphtrain inspect --help`)
  export    write a run's model as Hugging Face safetensors (see `graphtrain export --help`)
  plan      predicted memory per rank of a layout, without a device (`graphtrain plan --help`)
  generate  continue a prompt with a run's newest checkpoint (see `graphtrain generate --help`)
  eval      loss and perplexity of a run on held-out files (see `graphtrain eval --help`)
  torchrun  torchrun's arguments: how launch.sh starts several ranks (exit 75 after a save
            on a signal, a grace period that fits the save)

presets: {presets}
"""


class DefaultsHelp(argparse.HelpFormatter):
    """--help shows each option's default (none for flags and options without one)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if action.option_strings and action.default not in (None, False, argparse.SUPPRESS):
            text += f" (default: {action.default})"
        return text


def _setup_logging() -> None:
    rank = int(os.environ.get("RANK", "0"))
    logging.basicConfig(
        level=logging.INFO if rank == 0 else logging.WARNING,
        format="%(asctime)s %(message)s"
        if rank == 0
        else f"[rank{rank}] %(levelname)s %(message)s",
        datefmt="%H:%M:%S",
    )


def _train(args: list[str]) -> int:
    from graphtrain.config import describe_keys, load_config

    if "-h" in args or "--help" in args:
        rest = [a for a in args if a not in ("-h", "--help")]
        print(USAGE.format(presets=_presets()))
        print(describe_keys(load_config(rest)))
        return 0
    if "--check" in args:
        return _check([a for a in args if a != "--check"])
    cfg = load_config(args)
    from graphtrain.trainer import train

    train(cfg)
    return 0


def _check(args: list[str]) -> int:
    """Resolve the config and check it for WORLD_SIZE ranks (graphtrain.run.check_job: the
    layout, the pass switches, the run directory, the weights to start from, the data's inputs)
    without starting anything: launch.sh runs it once, so that a bad config is one line and exit
    code 2, not one traceback per rank."""
    from graphtrain.config import load_config
    from graphtrain.run import check_job

    check_job(load_config(args), int(os.environ.get("WORLD_SIZE", "1")))
    return 0


def _inspect(args: list[str]) -> int:
    from graphtrain.inspect.cli import main as inspect_main

    return inspect_main(args)


def _export(args: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="graphtrain export",
        formatter_class=DefaultsHelp,
        description="Write a checkpoint as Hugging Face safetensors (Llama, Glm4Moe or Qwen2Moe names), config.json "
        "and the run's tokenizer, loadable by transformers.AutoModelForCausalLM.",
    )
    parser.add_argument("source", help="a run directory (its newest checkpoint) or a checkpoint")
    parser.add_argument("out_dir")
    parser.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16", help="tensor dtype")
    parser.add_argument("--overwrite", action="store_true", help="replace an earlier export")
    parser.add_argument("--max-shard-size", default="5GB", help="split files above this size")
    ns = parser.parse_args(args)
    from graphtrain.checkpoint.hf import export_hf, parse_size

    out = export_hf(
        ns.source,
        ns.out_dir,
        dtype=ns.dtype,
        overwrite=ns.overwrite,
        max_shard_size=parse_size(ns.max_shard_size),
    )
    print(f"exported to {out}")
    return 0


# The job presets (graphtrain.config.JOB_PRESETS, checked equal by a test), spelled out so that
# the usage text needs no import of the config, which imports the models and so torch.
PRESET_NAMES = (
    "tiny",
    "debug",
    "125m",
    "1b",
    "moe-tiny",
    "moe-debug",
    "moe-1b",
    "hybrid-debug",
    "hybrid-moe-debug",
    "hybrid-1b",
    "3b",
    "8b",
)


def _presets() -> str:
    return ", ".join(PRESET_NAMES)


def _plan(args: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="graphtrain plan",
        formatter_class=DefaultsHelp,
        description="Print the predicted per-rank memory of a job (no device needed); exit 2 "
        "when it does not fit the device. Other arguments are config overrides "
        "(--section.key=value), as for train.",
    )
    parser.add_argument("--preset", default="tiny", help="the job preset")
    parser.add_argument("--ngpu", type=int, default=1, help="ranks in all (the world size)")
    parser.add_argument("--device-memory", default="80GB", help="memory of one device")
    ns, rest = parser.parse_known_args(args)
    from graphtrain.checkpoint.hf import parse_size
    from graphtrain.config import load_config
    from graphtrain.metrics.memory_plan import check_fits, plan_memory

    plan = plan_memory(load_config(["--preset", ns.preset, *rest]), ns.ngpu)
    print(plan.format())
    check_fits(plan, parse_size(ns.device_memory))
    return 0


def _torchrun(args: list[str]) -> int:
    from graphtrain.preemption import run_torchrun

    return run_torchrun(args)


def _generate(args: list[str]) -> int:
    from graphtrain.generate import main as generate_main

    return generate_main(args)


def _eval(args: list[str]) -> int:
    from graphtrain.evaluate import main as eval_main

    return eval_main(args)


COMMANDS = {
    "train": _train,
    "inspect": _inspect,
    "export": _export,
    "generate": _generate,
    "eval": _eval,
    "plan": _plan,
    "torchrun": _torchrun,
}


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print(USAGE.format(presets=_presets()))
        return 0 if args else 2
    command, rest = args[0], args[1:]
    if command not in COMMANDS:
        print(
            f"graphtrain: unknown command {command!r}\n\n" + USAGE.format(presets=_presets()),
            file=sys.stderr,
        )
        return 2
    _setup_logging()
    if "-h" in rest or "--help" in rest:
        # A command's help needs none of the handlers below, whose imports bring in torch
        # (export's and plan's help answer without it).
        try:
            return COMMANDS[command](rest)
        except (ValueError, OSError) as e:  # a bad override beside train --help
            print(f"graphtrain: error: {e}", file=sys.stderr)
            return 2
    from graphtrain.parallel.divergence import ReplicaDivergenceError
    from graphtrain.preemption import (
        EXIT_PREEMPTED,
        STATUS_DIR,
        PeerLostError,
        Preempted,
        StartupStopped,
        report_status,
    )

    try:
        return COMMANDS[command](rest)
    except PeerLostError as e:  # another rank died: its own output says why
        print(f"graphtrain: stopped: {e}", file=sys.stderr)
        return 1
    # User and environment errors (config, data, checkpoint, paths, a save that failed for lack
    # of disk or permission) carry their explanation in the message: no traceback.
    except (ValueError, OSError) as e:
        print(f"graphtrain: error: {e}", file=sys.stderr)
        return 2
    except (FloatingPointError, ReplicaDivergenceError) as e:  # the run diverged
        print(f"graphtrain: stopped: {e}", file=sys.stderr)
        return 3
    except Preempted:  # SIGTERM/SIGINT during training: rank 0 logged what was saved
        report_status("preempted")
        # Under launch.sh's torchrun a rank that saved exits 0, so that torchrun reports no
        # failure; the launcher then exits EXIT_PREEMPTED.
        return 0 if os.environ.get(STATUS_DIR) else EXIT_PREEMPTED
    except StartupStopped as e:
        print(f"graphtrain: {e}", file=sys.stderr)
        report_status("startup")
        return EXIT_PREEMPTED
    except KeyboardInterrupt:  # Ctrl-C before training started: nothing to save
        print("graphtrain: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
