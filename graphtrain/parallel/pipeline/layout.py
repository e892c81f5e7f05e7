"""The pipeline's layout: parallel.pp_layout parsed into stages, the stages placed on the pp
ranks, the start checks of a pipelined job, and the schedules' bubble and in-flight
micro-batches (graphtrain plan)."""

from __future__ import annotations

import dataclasses
import re
from typing import Any

import torch
from torch import nn

SCHEDULES = ("1f1b", "gpipe", "interleaved_1f1b", "zbv", "dualpipev")
# torch.distributed.pipelining class of each schedule; the last two exist only in newer torch.
_SCHEDULE_CLASSES = {
    "1f1b": "Schedule1F1B",
    "gpipe": "ScheduleGPipe",
    "interleaved_1f1b": "ScheduleInterleaved1F1B",
    "zbv": "ScheduleZBVZeroBubble",
    "dualpipev": "ScheduleDualPipeV",
}
# V-shaped schedules: rank r holds stages r and 2 pp - 1 - r (the first and the last on rank 0).
V_SCHEDULES = ("zbv", "dualpipev")
_TOKEN = re.compile(r"([EtmL])(?:\*(\d+))?")


@dataclasses.dataclass(frozen=True)
class StageSpec:
    """One (virtual) pipeline stage: what of the model it holds."""

    index: int
    embedding: bool
    layers: tuple[int, ...]  # transformer layer numbers, in order
    head: bool  # final norm, output head and loss
    mtp: tuple[int, ...] = ()  # MTP depths (0-based)
    # The head's stage when the MTP depths are the next stage's: it sends its hidden state
    # (the depths' input) with its loss, which the MTP stage adds its own to.
    hidden_to_mtp: bool = False


def stages_per_rank(schedule: str) -> int:
    """Virtual stages per rank with an even split (a layout may give interleaved more)."""
    return 1 if schedule in ("1f1b", "gpipe") else 2


def schedule_class(schedule: str) -> type:
    """The torch.distributed.pipelining schedule class, or a ValueError naming what is missing."""
    import torch.distributed.pipelining as pipelining

    if schedule not in SCHEDULES:
        raise ValueError(f"parallel.pp_schedule must be one of {SCHEDULES}, got {schedule!r}")
    cls = getattr(pipelining, _SCHEDULE_CLASSES[schedule], None)
    if cls is None:
        raise ValueError(
            f"parallel.pp_schedule={schedule!r} needs torch.distributed.pipelining."
            f"{_SCHEDULE_CLASSES[schedule]}, which torch {torch.__version__} does not have; "
            "choose 1f1b, gpipe or interleaved_1f1b"
        )
    return cls


def stage_rank(stage: int, num_stages: int, pp: int, schedule: str) -> int:
    """The pp rank that runs `stage`: round robin (loop), or V-shaped for zbv / dualpipev."""
    if schedule in V_SCHEDULES:
        return stage if stage < pp else num_stages - 1 - stage
    return stage % pp


def in_flight_micro_batches(schedule: str, pp: int, pp_rank: int, num_microbatches: int) -> float:
    """Micro-batches whose activations through all of its layers pp rank `pp_rank` holds at
    its peak (an estimate): all of them in GPipe, pp - rank in 1F1B, the interleaved warm-up's
    (v - 1) pp + 2 (pp - 1 - rank) + 1 stage forwards of v stages per rank, pp in ZB-V (the
    paper: 1F1B's peak) and pp + 1 in DualPipeV (DeepSeek-V3's table)."""
    n = num_microbatches
    if schedule == "gpipe":
        return n
    if schedule == "1f1b":
        return min(n, pp - pp_rank)
    if schedule == "interleaved_1f1b":
        v = stages_per_rank(schedule)
        return min(n * v, (v - 1) * pp + 2 * (pp - 1 - pp_rank) + 1) / v
    return min(n, pp if schedule == "zbv" else pp + 1)


def bubble_fraction(schedule: str, pp: int, num_microbatches: int, stages_per_rank: int) -> float:
    """The fraction of a step a pipeline rank idles, with a layer's forward, input backward and
    weight backward taking the same time: (pp - 1) / (v n + pp - 1) for GPipe, 1F1B and
    interleaved 1F1B with v stages per rank (Megatron-LM's), 0 for the zero-bubble V schedules
    once n >= 2 pp (the ZB-V paper; DeepSeek-V3's table for DualPipe), else at most 1F1B's."""
    n, p = num_microbatches, pp
    if schedule in ("zbv", "dualpipev"):
        return 0.0 if n >= 2 * p else (p - 1) / (n + p - 1)
    v = stages_per_rank if schedule == "interleaved_1f1b" else 1
    return (p - 1) / (v * n + p - 1)


def _even_layout(num_layers: int, mtp_depth: int, num_stages: int) -> str:
    # Earlier stages take the extra layers: the last stage also holds the head and the loss.
    base, extra = divmod(num_layers, num_stages)
    stages = ["t" * (base + (i < extra)) for i in range(num_stages)]
    stages[0] = "E" + stages[0]
    stages[-1] += "L" + "m" * mtp_depth
    return "|".join(stages)


def parse_layout(
    layout: str, *, num_layers: int, mtp_depth: int, pp: int, schedule: str
) -> list[StageSpec]:
    """The stages of parallel.pp_layout (empty: an even split), or a one-line ValueError naming
    the stage and the count that do not fit the model or pp x the schedule's virtual stages."""
    where = f"parallel.pp_layout={layout!r}"
    texts = _stage_texts(
        layout, where, num_layers=num_layers, mtp_depth=mtp_depth, pp=pp, schedule=schedule
    )
    specs, next_layer, next_mtp = [], 0, 0
    seen_head = False
    for index, text in enumerate(texts):
        parts = _stage_parts(where, index, text, seen_head)
        count = parts.count("t")
        layers = tuple(range(next_layer, next_layer + count))
        num_mtp = parts.count("m")
        if num_mtp:
            _check_mtp_stage(where, index, parts, specs, num_mtp, next_mtp)
        mtp = tuple(range(next_mtp, next_mtp + num_mtp))
        next_layer, next_mtp = next_layer + count, next_mtp + num_mtp
        seen_head = seen_head or "L" in parts
        specs.append(StageSpec(index, "E" in parts, layers, "L" in parts, mtp))
    _check_placed(where, specs, num_layers=num_layers, mtp_depth=mtp_depth)
    if not specs[-1].head:  # MTP in a stage of its own: the head's stage sends it its input
        specs[-2] = dataclasses.replace(specs[-2], hidden_to_mtp=True)
    return specs


def _stage_texts(
    layout: str, where: str, *, num_layers: int, mtp_depth: int, pp: int, schedule: str
) -> list[str]:
    """The layout's stage strings (an even split when empty), as many as pp x the schedule's
    virtual stages need."""
    per_rank = stages_per_rank(schedule)
    if not layout.strip():
        if num_layers < pp * per_rank:
            raise ValueError(
                f"model.num_layers={num_layers} cannot fill {pp * per_rank} "
                f"pipeline stages (parallel.pp={pp}, pp_schedule={schedule!r}); lower "
                "parallel.pp or give parallel.pp_layout"
            )
        layout = _even_layout(num_layers, mtp_depth, pp * per_rank)
    texts = layout.replace(" ", "").split("|")
    num_stages = len(texts)
    if schedule == "interleaved_1f1b":
        if num_stages % pp or num_stages < 2 * pp:
            raise ValueError(
                f"{where} has {num_stages} stages; interleaved_1f1b with parallel.pp={pp} needs "
                f"a multiple of {pp} and at least {2 * pp}"
            )
    elif num_stages != pp * per_rank:
        raise ValueError(
            f"{where} has {num_stages} stages but parallel.pp={pp} with pp_schedule="
            f"{schedule!r} needs {pp * per_rank}"
        )
    return texts


def _stage_parts(where: str, index: int, text: str, seen_head: bool) -> list[str]:
    """Stage `index`'s parts (E, t, m, L, each repeat written out), checked for where the
    embedding and the head may sit; seen_head: an earlier stage holds L."""
    parts: list[str] = []
    pos = 0
    while pos < len(text):
        match = _TOKEN.match(text, pos)
        if match is None:
            raise ValueError(
                f"{where}: stage {index} {text!r} has {text[pos]!r} at {pos}; a stage is "
                "E (embedding), t (layer), m (MTP depth), L (head and loss), each optionally "
                "*n"
            )
        parts += match.group(1) * int(match.group(2) or 1)
        pos = match.end()
    if not parts:
        raise ValueError(f"{where}: stage {index} is empty (0 parts); give it a layer")
    if "E" in parts and (index != 0 or parts.index("E") != 0 or parts.count("E") > 1):
        raise ValueError(f"{where}: stage {index} has E; the embedding is stage 0's first part")
    if index == 0 and parts[0] != "E":
        raise ValueError(f"{where}: stage 0 starts with {parts[0]!r}; it must start with E")
    count = parts.count("t")
    if seen_head and count:
        raise ValueError(f"{where}: stage {index} has {count} layers after L (the head)")
    if "L" in parts and (seen_head or parts.count("L") > 1):
        raise ValueError(f"{where}: stage {index} repeats L; the head is in one stage")
    if "L" in parts and "t" in parts[parts.index("L") :]:
        raise ValueError(f"{where}: stage {index} has layers after L")
    return parts


def _check_placed(where: str, specs: list[StageSpec], *, num_layers: int, mtp_depth: int) -> None:
    """All layers and MTP depths placed, and the head (or the MTP stage after it) last."""
    placed_layers = sum(len(s.layers) for s in specs)
    if placed_layers != num_layers:
        counts = ", ".join(f"stage {s.index}: {len(s.layers)}" for s in specs)
        raise ValueError(
            f"{where} places {placed_layers} transformer layers ({counts}) but model.num_layers="
            f"{num_layers}"
        )
    if not (specs[-1].head or (specs[-1].mtp and len(specs) > 1 and specs[-2].head)):
        raise ValueError(
            f"{where}: the last stage ({len(specs) - 1}) must hold L (norm, head and loss)"
        )
    placed_mtp = sum(len(s.mtp) for s in specs)
    if placed_mtp != mtp_depth:
        raise ValueError(
            f"{where} places {placed_mtp} MTP depths (m) but model.mtp_depth={mtp_depth}"
        )


def _check_mtp_stage(
    where: str, index: int, parts: list[str], specs: list[StageSpec], num_mtp: int, placed: int
) -> None:
    """The MTP depths (m) of stage `index`: all of them in one stage, after L in the head's
    stage or alone in the stage right after it (a one-line ValueError otherwise)."""
    if placed:
        raise ValueError(
            f"{where}: stage {index} has {num_mtp} MTP depths (m) after {placed} in an earlier "
            "stage; all depths go in one stage"
        )
    if "L" in parts:
        if "m" in parts[: parts.index("L")]:
            raise ValueError(f"{where}: stage {index} has m before L; the depths follow the head")
        return
    if not specs or not specs[-1].head or set(parts) != {"m"}:
        raise ValueError(
            f"{where}: stage {index} has {num_mtp} MTP depths (m) but not after L: they go in "
            "the head's stage after L, or alone in the stage right after it"
        )


def pipeline_microbatches(cfg: Any, dims: Any) -> tuple[int, int]:
    """(micro-batches per step through the pipeline, rows of each). The step's rows (its
    loader micro-batches, concatenated) are split into parallel.pp_microbatches pieces, by
    default one per stage; the rows per step must stay the same (static stage shapes)."""
    from graphtrain.optim import BatchSizeSchedule

    training = cfg.training
    per_micro = training.micro_batch_size * training.seq_len * dims.dp_size
    schedule = BatchSizeSchedule.parse(cfg.schedule.batch_size or per_micro)
    rows = sorted({size // per_micro * training.micro_batch_size for _, size in schedule.entries})
    if len(rows) > 1:
        raise ValueError(
            f"schedule.batch_size={cfg.schedule.batch_size!r} changes the rows per step "
            f"({', '.join(map(str, rows))} per data-parallel rank); under parallel.pp="
            f"{dims.pp} the stages' shapes are fixed: use one batch size"
        )
    n = cfg.parallel.pp_microbatches or dims.pp * stages_per_rank(cfg.parallel.pp_schedule)
    if rows[0] % n:
        raise ValueError(
            f"parallel.pp_microbatches={n} does not divide the {rows[0]} rows of a step per "
            f"data-parallel rank (schedule.batch_size / seq_len / {dims.dp_size} ranks); "
            "choose a divisor"
        )
    return n, rows[0] // n


def _check_v_schedule_backend(schedule: str, device: str) -> None:
    """torch 2.11's pipelining opens its stages' links by sending from each stage to its
    neighbours, and the V schedules put two neighbouring stages on one rank: a send to the rank
    itself, which NCCL takes and gloo refuses ("Pair is not connected"). 2.12 and later open
    them another way (tests/parallel/test_pipeline.py runs the V schedules on gloo: 2.12.1,
    2.13, 2.14)."""
    on_cpu = device == "cpu" or (device == "auto" and not torch.cuda.is_available())
    if (
        schedule in V_SCHEDULES
        and on_cpu
        and torch.torch_version.TorchVersion(torch.__version__) < (2, 12)
    ):
        raise ValueError(
            f"parallel.pp_schedule={schedule!r} on CPU ranks (gloo) needs torch >= 2.12: torch "
            f"{torch.__version__}'s pipelining sends from a rank to itself at the start, which "
            "gloo cannot; use 1f1b, gpipe or interleaved_1f1b here, or a CUDA device (NCCL)"
        )


def check_pipeline(cfg: Any, dims: Any) -> list[StageSpec]:
    """The start check of a pipelined job (a ValueError naming the bad value otherwise)."""
    parallel, model_cfg = cfg.parallel, cfg.model
    schedule_class(parallel.pp_schedule)
    specs = parse_layout(
        parallel.pp_layout,
        num_layers=model_cfg.num_layers,
        mtp_depth=model_cfg.mtp_depth,
        pp=dims.pp,
        schedule=parallel.pp_schedule,
    )
    if model_cfg.tie_embeddings:
        raise ValueError(
            f"model.tie_embeddings=true with parallel.pp={dims.pp}: the tied embedding and head "
            "live in different stages; untie them or set parallel.pp=1"
        )
    _check_v_schedule_backend(parallel.pp_schedule, cfg.training.device)
    if (
        parallel.pp_schedule in V_SCHEDULES
        and parallel.fsdp_reshard_after_forward == "always"
        and dims.dp_size > 1
    ):
        # torch's input half lists the stage's parameters for the weight half: resharded ones
        # would leave the weight half nothing to differentiate (the zbv bug of the design note).
        raise ValueError(
            f"parallel.fsdp_reshard_after_forward='always' with parallel.pp_schedule="
            f"{parallel.pp_schedule!r}: its split backward needs each stage's weights gathered "
            "from forward to the weight gradients; use 'default', or 1f1b / interleaved_1f1b"
        )
    n, _ = pipeline_microbatches(cfg, dims)
    if parallel.pp_schedule in ("1f1b", "interleaved_1f1b") and n < dims.pp:
        raise ValueError(
            f"parallel.pp_schedule={parallel.pp_schedule!r} needs at least parallel.pp={dims.pp} "
            f"micro-batches per step, got {n}; raise schedule.batch_size"
        )
    if parallel.pp_schedule == "dualpipev" and n < len(specs):
        raise ValueError(
            f"parallel.pp_schedule='dualpipev' needs a micro-batch per stage at least ({len(specs)}"
            f" stages), got parallel.pp_microbatches={n}; raise it, or schedule.batch_size"
        )
    if parallel.pp_schedule == "interleaved_1f1b" and n % dims.pp:
        raise ValueError(
            f"parallel.pp_schedule='interleaved_1f1b' needs micro-batches per step ({n}) to be a "
            f"multiple of parallel.pp={dims.pp}"
        )
    training = cfg.training
    recomputes = training.activation_checkpoint != "none" or training.activation_memory_budget < 1
    if getattr(model_cfg, "global_aux_loss_coef", 0) and recomputes:
        # A recomputed forward would read step counts that later micro-batches have added to.
        raise ValueError(
            f"model.global_aux_loss_coef={model_cfg.global_aux_loss_coef} with parallel.pp="
            f"{dims.pp} and training.activation_checkpoint={training.activation_checkpoint!r}, "
            f"training.activation_memory_budget={training.activation_memory_budget}: recompute "
            "nothing (activation_checkpoint='none', activation_memory_budget=1) or set the "
            "global aux loss to 0"
        )
    return specs


def stage_tp_plan(plan: dict[str, str], model: nn.Module) -> dict[str, str]:
    """The tensor-parallel plan's entries that match a module of the cut model (a stage
    without the embedding has no tok_embeddings to split)."""
    from fnmatch import fnmatchcase

    names = [name.split(".") for name, _ in model.named_modules() if name]

    def present(pattern: str) -> bool:
        pats = pattern.split(".")
        return any(
            len(parts) == len(pats) and all(map(fnmatchcase, parts, pats)) for parts in names
        )

    return {pattern: style for pattern, style in plan.items() if present(pattern)}
