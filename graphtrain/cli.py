"""`graphtrain train ...` (also `python -m graphtrain train ...`)."""

from __future__ import annotations

import logging
import os
import sys

USAGE = """usage: graphtrain train [--preset NAME] [--config FILE.toml] [--section.key=value ...]

commands:
  train     train a model (see `graphtrain train --help` for every config key)

presets: {presets}
"""


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
    cfg = load_config(args)
    from graphtrain.trainer import train

    train(cfg)
    return 0


def _presets() -> str:
    from graphtrain.config import JOB_PRESETS

    return ", ".join(JOB_PRESETS)


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print(USAGE.format(presets=_presets()))
        return 0 if args else 2
    command, rest = args[0], args[1:]
    if command != "train":
        print(
            f"graphtrain: unknown command {command!r}\n\n" + USAGE.format(presets=_presets()),
            file=sys.stderr,
        )
        return 2
    _setup_logging()
    try:
        return _train(rest)
    except (
        ValueError,
        FileNotFoundError,
    ) as e:  # a user error: config, data, tokenizer, checkpoint
        print(f"graphtrain: error: {e}", file=sys.stderr)
        return 2
    except FloatingPointError as e:  # the run diverged
        print(f"graphtrain: stopped: {e}", file=sys.stderr)
        return 3


if __name__ == "__main__":
    sys.exit(main())
