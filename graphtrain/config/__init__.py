"""Job configuration: typed, frozen dataclasses, presets, TOML files and --section.key=value.

Resolution order, later wins: the dataclass defaults, the job preset, the TOML file, the
command line (graphtrain.config.load). The resolved config is written to the run directory as
config.toml, which `--config` reads back as it is. The `model` section is the model's own config
dataclass (models/), chosen by the preset.

Files: sections (the dataclasses and their checks), presets, load (resolution and types), text
(TOML out, `train --help`).
"""

from graphtrain.config.load import load_config, parse_overrides, pass_options
from graphtrain.config.presets import JOB_PRESETS, preset_updates
from graphtrain.config.sections import (
    CheckpointConfig,
    CompileConfig,
    DataConfig,
    Fp8Config,
    JobConfig,
    MetricsConfig,
    OptimConfig,
    ParallelConfig,
    ScheduleConfig,
    TrainingConfig,
)
from graphtrain.config.text import describe_key, describe_keys, to_toml

__all__ = [
    "JOB_PRESETS",
    "CheckpointConfig",
    "CompileConfig",
    "DataConfig",
    "Fp8Config",
    "JobConfig",
    "MetricsConfig",
    "OptimConfig",
    "ParallelConfig",
    "ScheduleConfig",
    "TrainingConfig",
    "describe_key",
    "describe_keys",
    "load_config",
    "parse_overrides",
    "pass_options",
    "preset_updates",
    "to_toml",
]
