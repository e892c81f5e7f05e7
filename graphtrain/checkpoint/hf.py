"""Hugging Face safetensors: export a checkpoint for transformers, and start training from one.

Export (`graphtrain export RUN_OR_CHECKPOINT OUT_DIR`): the model part of a DCP checkpoint (saved
by any number of ranks) is read into one process as full tensors, its parameters cast to the
chosen dtype (buffers, the MoE routers' fp32 expert_bias, keep theirs), converted to the names
of the model's Hugging Face layout and written as `model.safetensors`, or, above `max_shard_size`
bytes, as `model-0000i-of-0000n.safetensors` plus `model.safetensors.index.json`; beside them
`config.json` and the run's tokenizer (tokenizer.json, tokenizer_config.json for
PreTrainedTokenizerFast, special_tokens_map.json). The model config and the tokenizer come from
the run directory (config.toml and tokenizer.json, which the trainer writes at start).

Layouts: the dense GPT is LlamaForCausalLM (models/gpt_hf.py); an MoE model is Glm4MoeForCausalLM
or Qwen2MoeForCausalLM by its routing, and an MoE config neither computes is refused before
anything is read or written (models/moe_hf.py says which and why); a dense hybrid is
Qwen3NextForCausalLM (models/hybrid_hf.py, which says what it refuses).

Import (`--checkpoint.init_from_hf DIR`): the same files read back, converted, shape-checked
against the model and copied into its (possibly sharded) parameters.

MTP layers (model.mtp_depth > 0): export writes them to an extra `mtp.safetensors` with
DeepSeek-V3's names (models/mtp_hf.py), outside the files and index transformers reads, so the
main model loads there unchanged. Import takes them from that file when the model has MTP depths
and the file is there; without the file the MTP layers keep their fresh initialisation (logged),
and a file is ignored by a model without MTP.
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path
from types import ModuleType

import torch
import torch.distributed.checkpoint as dcp
from safetensors import safe_open
from safetensors.torch import save_file
from torch.distributed.tensor import DTensor, distribute_tensor

from graphtrain.checkpoint.integrity import (
    CHECKSUMS,
    DCP_ERRORS,
    check_shapes,
    few,
    nonfinite_names,
    read_shapes,
)
from graphtrain.checkpoint.manager import read_trainer_files, resolve, single_process_quiet
from graphtrain.checkpoint.safe_load import brief
from models import GPTConfig, HybridConfig, MoEConfig, build_model, gpt_hf, hybrid_hf, moe_hf
from models.mtp_hf import MTP_FILE, mtp_from_hf_state, mtp_to_hf_state

logger = logging.getLogger(__name__)

EXPORT_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
_INDEX = "model.safetensors.index.json"
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
# What an export writes (with --overwrite, removed once the checkpoint has been read; other files
# in OUT_DIR are left alone).
_EXPORT_GLOBS = ("*.safetensors", _INDEX, "config.json", *_TOKENIZER_FILES)


def parse_size(text: str) -> int:
    """'5GB', '500MB', '2GiB' or a number of bytes -> bytes."""
    units = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9}
    units |= {"KIB": 2**10, "MIB": 2**20, "GIB": 2**30}
    t = text.strip().upper()
    number = t.rstrip("KMGIB")
    unit = t[len(number) :]
    try:
        value = float(number)
    except ValueError:
        value = -1.0
    if unit not in units or value <= 0:
        raise ValueError(f"--max-shard-size={text!r} is not a size such as 5GB, 500MB or 2GiB")
    return int(value * units[unit])


def _layout(cfg: GPTConfig) -> ModuleType:
    """The module that maps the model onto Hugging Face: models.hybrid_hf (Qwen3-Next) for a
    hybrid, models.moe_hf for an MoE model, models.gpt_hf (Llama) for the dense one. All have
    hf_config, config_mismatches, to_hf_state and from_hf_state."""
    if isinstance(cfg, HybridConfig):
        hybrid_hf.check_exportable(cfg)  # before anything is read or written
        return hybrid_hf
    return moe_hf if isinstance(cfg, MoEConfig) else gpt_hf


def read_model(ckpt: Path, cfg: GPTConfig) -> tuple[dict[str, torch.Tensor], set[str]]:
    """The full (unsharded) model state of a DCP checkpoint, on the CPU, and its buffers' names."""
    if any(ckpt.glob("trainer-rank*.pt")) or (ckpt / CHECKSUMS).exists():  # every file whole
        read_trainer_files(ckpt)
    with torch.device("meta"):
        model = build_model(cfg)
    model.to_empty(device="cpu")
    state = {"model": model.state_dict()}
    shapes = {k: v for k, v in read_shapes(ckpt).items() if k.startswith("model.")}
    check_shapes(
        {f"model.{k}": v.shape for k, v in state["model"].items()},
        shapes,
        source=f"checkpoint {ckpt}",
    )
    try:
        with single_process_quiet():
            dcp.load(state, checkpoint_id=str(ckpt), no_dist=True)
    except DCP_ERRORS as e:
        raise ValueError(f"checkpoint {ckpt} is corrupted: reading it failed ({brief(e)})") from e
    bad = nonfinite_names(state["model"])
    if bad:  # a diverged run's weights: nothing should be exported or evaluated from them
        raise ValueError(
            f"checkpoint {ckpt} holds non-finite weights (NaN or Inf in "
            f"{few(bad, total=len(state['model']))}); use an earlier checkpoint of the run"
        )
    return state["model"], {name for name, _ in model.named_buffers()}


def _shards(tensors: dict[str, torch.Tensor], max_bytes: int) -> list[dict[str, torch.Tensor]]:
    """Split into files of at most max_bytes (a tensor larger than that gets a file of its own)."""
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += nbytes
    return shards


def _write_tokenizer(run_dir: Path, out_dir: Path, max_seq_len: int) -> int | None:
    """Copy the run's tokenizer with the transformers side files; returns the eos id."""
    from graphtrain.data.tokenizer import load_tokenizer

    src = run_dir / "tokenizer.json"
    if not src.is_file():
        return None
    tok = load_tokenizer(src)
    shutil.copyfile(src, out_dir / "tokenizer.json")
    special = {"eos_token": tok.eos_token}
    (out_dir / "special_tokens_map.json").write_text(json.dumps(special, indent=2) + "\n")
    tok_cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": max_seq_len,
        "add_bos_token": False,
        "add_eos_token": False,
        **special,
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2) + "\n")
    return tok.eos_id


def export_hf(
    source: Path,
    out_dir: Path,
    *,
    dtype: str = "bf16",
    overwrite: bool = False,
    max_shard_size: int = 5 * 10**9,
) -> Path:
    """Export a run (its newest complete checkpoint) or one checkpoint folder to `out_dir`."""
    from graphtrain.config import load_config

    if dtype not in EXPORT_DTYPES:
        raise ValueError(f"--dtype must be one of {', '.join(EXPORT_DTYPES)}, got {dtype!r}")
    source, out_dir = Path(source), Path(out_dir)
    ckpt = resolve(source)
    run_dir = ckpt.parent.parent
    if not (run_dir / "config.toml").is_file():
        raise ValueError(f"{run_dir} has no config.toml: {ckpt} is not inside a graphtrain run")
    cfg = load_config(["--config", str(run_dir / "config.toml")]).model
    layout = _layout(cfg)
    # Refuses a model no Hugging Face architecture computes, before anything is read or removed.
    config = layout.hf_config(
        cfg, dtype=str(EXPORT_DTYPES[dtype]).removeprefix("torch."), eos_token_id=None
    )
    if out_dir.exists() and not out_dir.is_dir():
        raise ValueError(f"{out_dir} is a file, not a directory: give a folder to export into")
    occupied = out_dir.exists() and any(out_dir.iterdir())
    if occupied and not overwrite:
        raise ValueError(f"{out_dir} already holds files; pass --overwrite to replace them")
    # The checkpoint is read (and found whole) before a previous export is removed.
    state, buffers = read_model(ckpt, cfg)
    if cfg.tie_embeddings:
        state.pop("output.weight")  # the same tensor as the embedding: tie_word_embeddings
    state = {k: v if k in buffers else v.to(EXPORT_DTYPES[dtype]) for k, v in state.items()}
    main = {k: v for k, v in state.items() if not k.startswith("mtp_layers.")}
    tensors = {k: v.contiguous() for k, v in layout.to_hf_state(main, cfg).items()}
    mtp = {k: v.contiguous() for k, v in mtp_to_hf_state(state, cfg, layout.to_hf_state).items()}

    if occupied:
        for pattern in _EXPORT_GLOBS:
            for f in out_dir.glob(pattern):
                f.unlink()
    out_dir.mkdir(parents=True, exist_ok=True)
    shards = _shards(tensors, max_shard_size)
    if len(shards) == 1:
        save_file(shards[0], str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    else:
        weight_map = {}
        for i, shard in enumerate(shards):
            name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            save_file(shard, str(out_dir / name), metadata={"format": "pt"})
            weight_map |= dict.fromkeys(shard, name)
        total = sum(t.numel() * t.element_size() for t in tensors.values())
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (out_dir / _INDEX).write_text(json.dumps(index, indent=2) + "\n")
    if mtp:
        save_file(mtp, str(out_dir / MTP_FILE), metadata={"format": "pt"})
    config["eos_token_id"] = _write_tokenizer(run_dir, out_dir, cfg.max_seq_len)
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out_dir


def _hf_files(hf_dir: Path) -> list[Path]:
    index = hf_dir / _INDEX
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return [hf_dir / name for name in sorted(set(weight_map.values()))]
    single = hf_dir / "model.safetensors"
    if not single.is_file():
        raise FileNotFoundError(f"{hf_dir} holds neither model.safetensors nor {_INDEX}")
    return [single]


def _read_safetensors(paths: list[Path]) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for path in paths:
        try:
            with safe_open(str(path), framework="pt") as f:
                for name in f.keys():
                    out[name] = f.get_tensor(name)
        except Exception as e:  # safetensors raises its own error types for bad headers
            raise ValueError(f"{path} is truncated or corrupted ({e})") from e
    return out


def check_hf_config(hf_dir: Path, cfg: GPTConfig) -> None:
    """The Hugging Face directory's config.json is there and describes the model of `cfg`
    (a ValueError naming each field that differs); no tensor is read."""
    config_path = Path(hf_dir) / "config.json"
    if not config_path.is_file():
        raise FileNotFoundError(f"checkpoint.init_from_hf={str(hf_dir)!r} has no config.json")
    differ = _layout(cfg).config_mismatches(cfg, json.loads(config_path.read_text()))
    if differ:
        raise ValueError(f"{config_path} does not match the model config: " + "; ".join(differ))


def read_hf(hf_dir: Path, cfg: GPTConfig) -> dict[str, torch.Tensor]:
    """Our-named full tensors of a Hugging Face directory in the model's layout, checked
    against `cfg`."""
    hf_dir = Path(hf_dir)
    check_hf_config(hf_dir, cfg)
    layout = _layout(cfg)
    hf_tensors = _read_safetensors(_hf_files(hf_dir))
    mtp_path = hf_dir / MTP_FILE
    try:
        tensors = layout.from_hf_state(hf_tensors, cfg)
        if cfg.mtp_depth and mtp_path.is_file():
            mtp = _read_safetensors([mtp_path])
            tensors |= mtp_from_hf_state(mtp, cfg, layout.from_hf_state)
    except (KeyError, ValueError) as e:
        raise ValueError(f"{hf_dir}: {e.args[0]}") from None
    if cfg.mtp_depth and not mtp_path.is_file():
        logger.info("%s has no %s: the MTP layers keep their initialisation", hf_dir, MTP_FILE)
    if cfg.tie_embeddings:
        tensors.setdefault("output.weight", tensors.get("tok_embeddings.weight"))
    return tensors


@torch.no_grad()
def load_hf_into(model: torch.nn.Module, hf_dir: Path) -> None:
    """Copy a Hugging Face directory into `model`'s parameters and buffers (sharded or not)."""
    tensors = read_hf(hf_dir, model.cfg)
    own = model.state_dict()
    if not any(k.startswith("mtp_layers.") for k in tensors):  # an export without MTP layers
        own = {k: v for k, v in own.items() if not k.startswith("mtp_layers.")}
    check_shapes(
        {k: v.shape for k, v in own.items()},
        {k: tuple(v.shape) for k, v in tensors.items() if v is not None},
        source=f"Hugging Face directory {hf_dir}",
    )
    for name, param in own.items():
        full = tensors[name].to(param.dtype)
        if isinstance(param, DTensor):
            # Every rank holds the full tensor; each keeps its own shard of it.
            local = distribute_tensor(full, param.device_mesh, param.placements).to_local()
            param.to_local().copy_(local)
        else:
            param.copy_(full)
