"""`graphtrain inspect` of a pipelined job (parallel.pp > 1): every pp rank's cut model
compiled as that rank compiles it, its stages run in one process in stage order (forward,
backward, and the validation forward), each rank's graphs named `pp<rank>.<region>-<k>` and the
stages with their regions written to the dump's pipeline.json."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from graphtrain.compile import apply_compile
from graphtrain.config import JobConfig, pass_options
from graphtrain.inspect.capture import recording
from graphtrain.inspect.report import PIPELINE_FILE
from graphtrain.parallel.pipeline import StageSpec, check_pipeline, cut_model, stage_rank


def pipeline_specs(cfg: JobConfig) -> list[StageSpec]:
    """The job's stages, after the trainer's start checks of its layout (a ValueError naming
    the bad value otherwise)."""
    from graphtrain.parallel import check_layout

    p = cfg.parallel
    world = p.pp * p.dp_replicate * max(p.dp_shard, 1) * p.tp
    return check_pipeline(cfg, check_layout(cfg, world))


def _holds(spec: StageSpec) -> str:
    parts = ["embedding"] if spec.embedding else []
    if spec.layers:
        first, last = spec.layers[0], spec.layers[-1]
        parts.append(f"layer {first}" if first == last else f"layers {first}-{last}")
    if spec.head:
        parts.append("norm, head and loss")
    parts += [f"MTP depth {k + 1}" for k in spec.mtp]
    return ", ".join(parts)


def _regions(spec: StageSpec, rank: int) -> list[str]:
    """The compiled regions (graphtrain.compile.apply_compile) a stage runs, named as in the
    dump; the embedding runs eager."""
    names = ["block"] if spec.layers else []
    names += [f"mtp_{k + 1}" for k in spec.mtp]  # all depths in one stage: numbered from 1
    names += ["head_loss"] if spec.head or spec.mtp else []  # the depths' loss: the head's region
    return [f"pp{rank}.{name}" for name in names]


def _stage_inputs(inputs: tuple[torch.Tensor, torch.Tensor]) -> dict[str, Any]:
    """The side inputs of a stage (graphtrain.step.model_inputs' keys) for one row-per-document
    batch with causal attention, as the whole-model inspection runs it."""
    input_ids, labels = inputs
    B, T = input_ids.shape
    return {
        "input_ids": input_ids,
        "labels": labels,
        "position_ids": torch.arange(T, device=input_ids.device).expand(B, T),
        "attn_mask": None,
        "document_ids": None,
    }


def _run_stages(stages: Sequence[nn.Module], input_ids: torch.Tensor, last: int) -> Any:
    """Stages 0..last in order, each one's output the next one's input, in one process."""
    index = torch.zeros((), dtype=torch.int64)
    args: tuple = (input_ids,)
    for stage in stages[: last + 1]:
        out = stage(*args, micro_batch=index)
        args = out if isinstance(out, tuple) else (out,)
    return args[-1]


@contextlib.contextmanager
def _micro_batch(stages: Sequence[nn.Module], inputs: dict[str, Any]) -> Iterator[None]:
    for stage in stages:
        stage.micro_batches, stage.weights = [inputs], [1.0]
    try:
        yield
    finally:
        for stage in stages:
            stage.micro_batches, stage.stats = [], {}


def build_pipeline(
    cfg: JobConfig, target: torch.device, *, inner: str, dump_dir: Path
) -> tuple[list[nn.Module], list[nn.Module], list[dict[str, Any]]]:
    """Each pp rank's cut model, compiled with its graph dumps under dump_dir/pp<rank>,
    materialised and initialised (the whole model's values); every stage module in stage order;
    the stage table of pipeline.json."""
    from models import build_model

    specs = pipeline_specs(cfg)
    pp, schedule = cfg.parallel.pp, cfg.parallel.pp_schedule
    models, by_index = [], {}
    for rank in range(pp):
        with torch.device("meta"):
            model = build_model(cfg.model)
        stages = cut_model(model, specs, rank, pp, schedule, lambda: build_model(cfg.model))
        apply_compile(
            model,
            passes=cfg.compile.passes,
            inner=inner,
            dump_dir=dump_dir / f"pp{rank}",
            pass_options=pass_options(cfg),
            activation_memory_budget=cfg.training.activation_memory_budget,
        )
        if target.type != "meta":
            model.to_empty(device=target)
            model.init_weights(seed=cfg.training.seed)
        models.append(model)
        by_index |= {stage.spec.index: stage for stage in stages}
    table = []
    for spec in specs:
        rank = stage_rank(spec.index, len(specs), pp, schedule)
        row = {"stage": spec.index, "pp_rank": rank, "holds": _holds(spec)}
        table.append(row | {"regions": _regions(spec, rank)})
    return models, [by_index[i] for i in range(len(specs))], table


def capture_pipeline(
    cfg: JobConfig,
    inputs: tuple[torch.Tensor, torch.Tensor],
    *,
    dump_dir: Path,
    inner: str,
    trace_dir: str | Path | None = None,
    validation: bool = True,
) -> None:
    """build_pipeline, then one forward and backward through every stage and (validation) one
    forward in eval mode under no_grad up to the head's stage, as the pipeline's validation
    runs; then each rank's graph dumps moved to dump_dir/pp<rank>.<graph> and the stage table
    written. Resets Dynamo first."""
    torch._dynamo.reset()
    models, stages, table = build_pipeline(cfg, inputs[0].device, inner=inner, dump_dir=dump_dir)
    with recording(dump_dir, trace_dir):
        _run(models, stages, inputs, validation)
    for rank in range(len(models)):
        folder = dump_dir / f"pp{rank}"
        for graph in sorted(folder.iterdir()) if folder.is_dir() else ():
            graph.rename(dump_dir / f"pp{rank}.{graph.name}")
        if folder.is_dir():
            folder.rmdir()
    (dump_dir / PIPELINE_FILE).write_text(json.dumps(table, indent=1) + "\n")


def _run(
    models: Sequence[nn.Module],
    stages: Sequence[nn.Module],
    inputs: tuple[torch.Tensor, torch.Tensor],
    validation: bool,
) -> None:
    """The stages' forward and backward, then the validation forward."""
    side = _stage_inputs(inputs)
    head = next(i for i, stage in enumerate(stages) if stage.spec.head)
    with _micro_batch(stages, side):
        _run_stages(stages, inputs[0], len(stages) - 1).sum().backward()
        if validation:
            for model in models:
                model.eval()
            try:
                with torch.no_grad():
                    _run_stages(stages, inputs[0], head)
            finally:
                for model in models:
                    model.train()
