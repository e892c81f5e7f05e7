"""A trained model back from a run directory: its config, newest complete checkpoint and
tokenizer, on one device, for `graphtrain generate` and `graphtrain eval`.

The checkpoint is read whole on the CPU (any number of training ranks; see hf.read_model, the
same reader `graphtrain export` uses), then moved to the device in the dtype the run computed
in there (float32 on CPU).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from graphtrain.checkpoint.hf import read_model
from graphtrain.checkpoint.manager import resolve
from graphtrain.config import JobConfig, load_config
from graphtrain.data.tokenizer import Tokenizer, load_tokenizer
from models import build_model


@dataclass
class TrainedModel:
    model: nn.Module  # in eval mode, on `device`
    cfg: JobConfig
    tokenizer: Tokenizer
    checkpoint: Path
    device: torch.device


def pick_device(choice: str) -> torch.device:
    """ "auto" -> cuda when available, else cpu; "cuda" without a GPU is an error."""
    if choice == "auto":
        choice = "cuda" if torch.cuda.is_available() else "cpu"
    if choice not in ("cpu", "cuda"):
        raise ValueError(f"--device must be auto, cpu or cuda, got {choice!r}")
    if choice == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device=cuda but no CUDA device is visible; use --device=cpu")
    return torch.device(choice)


def load_trained(source: str | Path, device: str = "auto") -> TrainedModel:
    """The model of run directory `source` (its newest complete checkpoint) or of one
    checkpoint folder, with the run's config and tokenizer."""
    ckpt = resolve(Path(source))  # names checkpoint.final when the run has none
    run_dir = ckpt.parent.parent
    for name in ("config.toml", "tokenizer.json"):
        if not (run_dir / name).is_file():
            raise ValueError(f"{run_dir} has no {name}: {ckpt} is not inside a graphtrain run")
    cfg = load_config(["--config", str(run_dir / "config.toml")])
    dev = pick_device(device)
    state, _ = read_model(ckpt, cfg.model)
    with torch.device("meta"):
        model = build_model(cfg.model)
    model.to_empty(device="cpu")
    model.init_weights(seed=0)  # the buffers a checkpoint does not hold (RoPE tables)
    model.load_state_dict(state)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    model = model.to(dev, dtype)
    model.eval()
    tokenizer = load_tokenizer(run_dir / "tokenizer.json")
    return TrainedModel(model, cfg, tokenizer, ckpt, dev)
