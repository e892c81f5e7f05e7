"""Pipeline parallelism: the plain model cut into stages on the outermost mesh axis "pp", driven
by a torch.distributed.pipelining schedule, each stage's blocks and head+loss compiled as in one
process (graphtrain.compile), so every pass (the fused loss in the last stage) still applies.
Design and what is not done yet: docs/design/pipeline.md.

What
    parse_layout / check_pipeline: parallel.pp_layout (E, t, m, L, |, "x*n") or an even split,
        checked against the model, the schedule and the batch at start (one-line ValueError
        naming the stage and the count: `graphtrain train --check` exits 2).
    cut_model prunes the meta-device model in place to this rank's stages (the whole model's
        parameter names: TP plan, FSDP, optimizer, checkpoints unchanged) and returns the
        PipelineStageModules the schedule runs (FSDP2's root units under pp). Afterwards
        model.init_weights(seed) gives every parameter the whole model's value.
    PipelineRunner.forward_backward(batches, hooks): the step's rows split into
        pp_microbatches pieces, each loss weighted by its share of the labelled tokens; MoE
        routers scaled and counted per stage; the loss all-reduced to every pp rank.
        model(**inputs) (= PipelineRunner.forward) runs every stage in order (validation).
    clip_grad_norm_pp_ / norm_over_stages: norms over all stages.

Contract: every rank of a pp group holds the same batches (pp ranks share a data-parallel
index); every step has the same rows (the stages' activation shapes are given to the schedule,
none inferred); under tp the stages exchange plain (B, T / tp, dim) slices.
Numerics: in fp32 the loss and gradients equal the single-process step's up to the order of
fp32 sums (tested to 1e-5 relative over 10 steps; measured a few 1e-7).
"""

from __future__ import annotations

import contextlib
import dataclasses
import re
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Shard

from graphtrain.balance import RouterBalance
from graphtrain.optim import global_norm

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
_V_SCHEDULES = ("zbv", "dualpipev")
# The loader's per-row tensors: what the pipeline's micro-batches are cut from.
_ROW_KEYS = ("input_ids", "labels", "position_ids", "document_ids")
_IGNORE_INDEX = -100
_TOKEN = re.compile(r"([EtmL])(?:\*(\d+))?")


@dataclasses.dataclass(frozen=True)
class StageSpec:
    """One (virtual) pipeline stage: what of the model it holds."""

    index: int
    embedding: bool
    layers: tuple[int, ...]  # transformer layer numbers, in order
    head: bool  # final norm, output head and loss
    mtp: tuple[int, ...] = ()  # MTP depths (0-based)


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
    if schedule in _V_SCHEDULES:
        return stage if stage < pp else num_stages - 1 - stage
    return stage % pp


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
    if not layout.strip():
        if num_layers < pp * stages_per_rank(schedule):
            raise ValueError(
                f"model.num_layers={num_layers} cannot fill {pp * stages_per_rank(schedule)} "
                f"pipeline stages (parallel.pp={pp}, pp_schedule={schedule!r}); lower "
                "parallel.pp or give parallel.pp_layout"
            )
        layout = _even_layout(num_layers, mtp_depth, pp * stages_per_rank(schedule))
    texts = layout.replace(" ", "").split("|")
    num_stages = len(texts)
    per_rank = stages_per_rank(schedule)
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
    specs, next_layer, next_mtp = [], 0, 0
    seen_head = False
    for index, text in enumerate(texts):
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
        layers = tuple(range(next_layer, next_layer + count))
        num_mtp = parts.count("m")
        mtp = tuple(range(next_mtp, next_mtp + num_mtp))
        next_layer, next_mtp = next_layer + count, next_mtp + num_mtp
        seen_head = seen_head or "L" in parts
        specs.append(StageSpec(index, "E" in parts, layers, "L" in parts, mtp))
    if next_layer != num_layers:
        counts = ", ".join(f"stage {s.index}: {len(s.layers)}" for s in specs)
        raise ValueError(
            f"{where} places {next_layer} transformer layers ({counts}) but model.num_layers="
            f"{num_layers}"
        )
    if not specs[-1].head:
        raise ValueError(
            f"{where}: the last stage ({num_stages - 1}) must hold L (norm, head and loss)"
        )
    if next_mtp != mtp_depth:
        raise ValueError(
            f"{where} places {next_mtp} MTP depths (m) but model.mtp_depth={mtp_depth}"
        )
    if mtp_depth:
        # Not built yet: the stage holding m needs copies of the embedding (and head) whose
        # gradients are reduced with their owners'.
        raise ValueError(
            f"model.mtp_depth={mtp_depth} with parallel.pp={pp}: MTP in a pipeline stage is not "
            "supported yet; set model.mtp_depth=0 or parallel.pp=1"
        )
    return specs


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
    n, _ = pipeline_microbatches(cfg, dims)
    if parallel.pp_schedule in ("1f1b", "interleaved_1f1b") and n < dims.pp:
        raise ValueError(
            f"parallel.pp_schedule={parallel.pp_schedule!r} needs at least parallel.pp={dims.pp} "
            f"micro-batches per step, got {n}; raise schedule.batch_size"
        )
    if parallel.pp_schedule == "interleaved_1f1b" and n % dims.pp:
        raise ValueError(
            f"parallel.pp_schedule='interleaved_1f1b' needs micro-batches per step ({n}) to be a "
            f"multiple of parallel.pp={dims.pp}"
        )
    if (
        getattr(model_cfg, "global_aux_loss_coef", 0)
        and cfg.training.activation_checkpoint != "none"
    ):
        # The recomputed forward would read step counts that later micro-batches have added to.
        raise ValueError(
            f"model.global_aux_loss_coef={model_cfg.global_aux_loss_coef} with parallel.pp="
            f"{dims.pp} and training.activation_checkpoint="
            f"{cfg.training.activation_checkpoint!r}: set activation_checkpoint='none' or the "
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


# ------------------------------------------------------------------------------------------
# Cutting the model


def _meta_draw(fn: Callable[..., Any], device: torch.device) -> Callable[..., Any]:
    """fn, except that on a meta tensor (a part of the model another stage holds) it draws the
    same random numbers on a scratch tensor and drops them: the draws that follow then give
    this stage's parameters the whole model's values."""

    def init(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if not tensor.is_meta:
            return fn(tensor, *args, **kwargs)
        # Low-precision parameters are drawn in fp32 (graphtrain.parallel.init).
        dtype = torch.float32 if tensor.element_size() < 4 else tensor.dtype
        fn(torch.empty(tensor.shape, dtype=dtype, device=device), *args, **kwargs)
        return tensor

    return init


class _StageInit:
    """model.init_weights of a cut model: the whole model's init on a skeleton (the whole model
    on the meta device with this rank's parts put in), meta parts drawn and dropped."""

    def __init__(self, model: nn.Module, build: Callable[[], nn.Module]) -> None:
        self.model, self.build = model, build

    def __call__(self, seed: int | None = None) -> None:
        model = self.model
        with torch.device("meta"):
            skeleton = self.build()
        for name in ("tok_embeddings", "norm", "output"):
            if hasattr(model, name):
                setattr(skeleton, name, getattr(model, name))
        for name, layer in model.layers.items():
            skeleton.layers[name] = layer
        skeleton.rope = model.rope  # a buffer: init_weights fills it in place
        device = model.rope.device
        names = [n for n in dir(nn.init) if n.endswith("_") and not n.startswith("_")]
        originals = {n: getattr(nn.init, n) for n in names}
        try:
            for name, fn in originals.items():
                setattr(nn.init, name, _meta_draw(fn, device))
            type(skeleton).init_weights(skeleton, seed)
        finally:
            for name, fn in originals.items():
                setattr(nn.init, name, fn)


class PipelineStageModule(nn.Module):
    """One stage as the schedule runs it: its parts of the cut model (registered here too, so
    the schedule sees their parameters), its inputs from the previous stage (or the token ids)
    and the micro-batch's side inputs (positions, mask, labels) from the runner by index."""

    def __init__(self, model: nn.Module, spec: StageSpec) -> None:
        super().__init__()
        self.spec = spec
        self.__dict__["_model"] = model  # not a child: its parameters are not this stage's
        if spec.embedding:
            self.tok_embeddings = model.tok_embeddings
        self.layers = nn.ModuleList([model.layers[str(i)] for i in spec.layers])
        if spec.head:
            self.norm, self.output = model.norm, model.output
        self.micro_batches: list[dict[str, Any]] = []
        self.weights: list[float] = []  # each micro-batch's loss weight (its token share)
        self.balance: Any = None  # graphtrain.balance.RouterBalance of an MoE model
        self.router_layers = {f"layers.{i}" for i in spec.layers}
        self.tp_mesh: Any = None  # set under tensor parallel: activations are Shard(1) on it

    def forward(self, h: torch.Tensor, *, micro_batch: torch.Tensor) -> torch.Tensor:
        """h: token ids (B, T) on the first stage, else the previous stage's (B, T, dim).
        micro_batch: a CPU tensor holding the micro-batch's index (no device sync)."""
        return self._forward(h, int(micro_batch))

    def _forward(self, h: torch.Tensor, micro_batch: int) -> torch.Tensor:
        if self.balance is None or not self.training:
            return self._run(h, micro_batch)
        # MoE: this stage's routers get the micro-batch's aux-loss scale and count its tokens
        # after its forward (with no activation checkpointing, nothing recomputes it).
        with self.balance.micro_batch(self.weights[micro_batch], self.router_layers):
            return self._run(h, micro_batch)

    def _run(self, h: torch.Tensor, micro_batch: int) -> torch.Tensor:
        inputs = self.micro_batches[micro_batch]
        model = self._model
        rope = model.rope[inputs["position_ids"]]  # (B, T, D/2, 2)
        if self.spec.embedding:
            h = model.tok_embeddings(h)
        elif self.tp_mesh is not None:
            # Sequence parallel: the previous stage sent its (B, T/tp, dim) slice, plain (the
            # schedule's point-to-point needs no DTensor support that way, on any torch).
            h = DTensor.from_local(h, self.tp_mesh, [Shard(1)], run_check=False)
        for layer in self.layers:
            h = layer(h, rope, inputs["attn_mask"])
        if self.spec.head:
            # (1,): the schedule concatenates stage outputs, which a 0-d loss cannot be.
            return model.head_loss(h, inputs["labels"]).reshape(1)
        return h.to_local() if isinstance(h, DTensor) else h


def cut_model(
    model: nn.Module,
    specs: Sequence[StageSpec],
    pp_rank: int,
    pp: int,
    schedule: str,
    build: Callable[[], nn.Module],
) -> list[PipelineStageModule]:
    """Prune `model` (on the meta device, before parallelize_model) in place to the parts of
    this rank's stages, make model.init_weights reproduce the whole model's values, and return
    this rank's stage modules in stage order. build(): the whole model (for the init)."""
    mine = [s for s in specs if stage_rank(s.index, len(specs), pp, schedule) == pp_rank]
    layers = {i for s in mine for i in s.layers}
    for name in list(model.layers):
        if int(name) not in layers:
            del model.layers[name]
    if not any(s.embedding for s in mine):
        del model.tok_embeddings
    if not any(s.head for s in mine):
        del model.norm, model.output
    model.init_weights = _StageInit(model, build)
    return [PipelineStageModule(model, s) for s in mine]


# ------------------------------------------------------------------------------------------
# Running a step


def norm_over_stages(local: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """The 2-norm over all stages from each stage's own 2-norm (every tensor in one stage)."""
    squared = local.detach().float().square()
    dist.all_reduce(squared, group=group)
    return squared.sqrt()


def clip_grad_norm_pp_(
    parameters: Sequence[torch.Tensor], max_norm: float, group: dist.ProcessGroup
) -> torch.Tensor:
    """graphtrain.optim.clip_grad_norm_ over all stages: the 2-norm of every stage's gradients
    (each parameter lives in one stage), then the same clip coefficient on every stage."""
    grads = [p.grad for p in dict.fromkeys(parameters) if p.grad is not None]
    local = global_norm(grads) if grads else torch.zeros(())
    total = norm_over_stages(local, group)
    if max_norm > 0 and grads:
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        # The same coefficient on every rank: scaling the local shards scales the DTensors.
        locals_ = [g.to_local() if hasattr(g, "to_local") else g for g in grads]
        torch._foreach_mul_(locals_, coef.to(locals_[0].device))
    return total


class PipelineRunner:
    """The pipeline schedule over this rank's stages, and the forward of a whole batch."""

    def __init__(
        self,
        model: nn.Module,
        stages: list[PipelineStageModule],
        *,
        num_stages: int,
        pp_group: dist.ProcessGroup,
        pp: int,
        schedule: str,
        num_microbatches: int,
        micro_batch_size: int,
        seq_len: int,
        dim: int,
        act_dtype: torch.dtype,
        device: torch.device,
        make_inputs: Callable[[Any], dict[str, Any]],
        seq_split: int = 1,
    ) -> None:
        from torch.distributed.pipelining import PipelineStage

        self.model, self.stages, self.group = model, stages, pp_group
        self.num_stages, self.pp, self.schedule_name = num_stages, pp, schedule
        self.num_microbatches, self.device = num_microbatches, device
        self.dim, self.act_dtype, self.make_inputs = dim, act_dtype, make_inputs
        self.pp_rank = dist.get_rank(pp_group)
        self.seq_split = seq_split  # tp: stages exchange (B, T / tp, dim) slices
        self.rows = micro_batch_size  # of each micro-batch the schedule runs

        def meta(*shape: int, dtype: torch.dtype) -> torch.Tensor:
            return torch.empty(shape, dtype=dtype, device="meta")

        # requires_grad: the stage metadata says which inputs get a gradient sent back.
        hidden = meta(micro_batch_size, seq_len // seq_split, dim, dtype=act_dtype)
        hidden.requires_grad_()
        pipeline_stages = []
        for stage in stages:
            s = stage.spec
            # Shapes given, not inferred: inference would run the compiled regions on meta
            # tensors (a recompile) and its protocol differs between torch versions.
            inputs = meta(micro_batch_size, seq_len, dtype=torch.int64) if s.embedding else hidden
            outputs = meta(1, dtype=torch.float32).requires_grad_() if s.head else hidden
            pipeline_stages.append(
                PipelineStage(
                    stage,
                    s.index,
                    num_stages,
                    device,
                    input_args=(inputs,),
                    output_args=(outputs,),
                    group=pp_group,
                )
            )
        cls = schedule_class(schedule)
        # scale_grads=False: each micro-batch's loss already carries its token weight.
        kwargs = {"loss_fn": self._loss, "scale_grads": False}
        if schedule in ("1f1b", "gpipe"):
            self.schedule = cls(pipeline_stages[0], num_microbatches, **kwargs)
        else:
            self.schedule = cls(pipeline_stages, num_microbatches, **kwargs)
        self.first = any(s.spec.embedding for s in stages)
        self.last = any(s.spec.head for s in stages)

    def _backward_config(self) -> contextlib.AbstractContextManager[None]:
        """Zero-bubble schedules run a stage's backward in two parts (input gradients, then
        weight gradients) with retain_graph=True, which a compiled backward that donates its
        saved buffers refuses ("PP breaks under compile", torchtitan's users' complaint).
        AOT autograd reads the flag when a region compiles and again at each backward, both
        inside the schedule's step; off, the backward only reuses fewer buffers."""
        if self.schedule_name not in _V_SCHEDULES:
            return contextlib.nullcontext()
        return torch._functorch.config.patch(donated_buffer=False)

    @staticmethod
    def _loss(output: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return (output * weight).sum()

    def forward_backward(self, batches: list[Any], hooks: Sequence[Any] = ()) -> torch.Tensor:
        """The step's token-weighted loss (on every pp rank) with its gradients accumulated:
        the rows of `batches` (the step's loader micro-batches) split into the pipeline's
        micro-batches, each weighted by its share of the step's labelled tokens."""
        from tensordict import TensorDict

        rows = torch.cat([b["input_ids"] for b in batches]).shape[0]
        pieces = []
        for chunk in zip(
            *(torch.cat([b[k] for b in batches]).chunk(self.num_microbatches) for k in _ROW_KEYS),
            strict=True,
        ):
            pieces.append(TensorDict(dict(zip(_ROW_KEYS, chunk, strict=True)), [len(chunk[0])]))
        if len(pieces) != self.num_microbatches or rows % self.num_microbatches:
            raise ValueError(
                f"a step of {rows} rows does not split into parallel.pp_microbatches="
                f"{self.num_microbatches} equal micro-batches"
            )
        inputs = [self.make_inputs(piece) for piece in pieces]
        for stage in self.stages:
            stage.micro_batches = inputs
        # Counted on the loader's CPU tensors: no device sync.
        num_labels = [int((p["labels"] != _IGNORE_INDEX).sum()) for p in pieces]
        total = max(sum(num_labels), 1)
        weights = torch.tensor([n / total for n in num_labels], dtype=torch.float32)
        balance = next((h for h in hooks if isinstance(h, RouterBalance)), None)
        for stage in self.stages:
            stage.weights, stage.balance = weights.tolist(), balance
        index = torch.arange(len(pieces))  # on the CPU: the stages read it without a sync
        args = (torch.cat([i["input_ids"] for i in inputs]),) if self.first else ()
        losses: list[torch.Tensor] = []
        with self._backward_config():
            self.schedule.step(
                *args,
                target=weights.to(self.device) if self.last else None,
                losses=losses if self.last else None,
                micro_batch=index,
            )
        for stage in self.stages:
            stage.micro_batches, stage.balance = [], None
        loss = torch.zeros((), device=self.device)
        if self.last:
            loss = torch.stack([x.detach().float().reshape(()) for x in losses]).sum()
        dist.all_reduce(loss, group=self.group)  # from the last stage to every pp rank
        return loss

    def merged_statistics(self, extra: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Every stage's step statistics on every pp rank (log steps only: a host sync). Each
        name comes from one stage (its layers'), except those all stages have, which are
        summed (FP8 saturation counts)."""
        values = {name: value.float().item() for name, value in extra.items()}
        gathered: list[Any] = [None] * self.pp
        dist.all_gather_object(gathered, values, group=self.group)
        merged: dict[str, float] = {}
        for part in gathered:
            for name, value in part.items():
                merged[name] = merged.get(name, 0.0) + value
        return {name: torch.tensor(merged[name], device=self.device) for name in sorted(merged)}

    def forward(self, **inputs: Any) -> torch.Tensor:
        """The mean loss of one batch through every stage in order (validation): point-to-point
        activations between the ranks, the loss all-reduced to every pp rank. A batch of a
        multiple of the pipeline's micro-batch rows runs in pieces of that many: the compiled
        regions then see one shape only (a second one makes Dynamo compile them with a dynamic
        batch size, which breaks DTensor regions under tp on torch 2.13)."""
        B = inputs["input_ids"].shape[0]
        mask = inputs.get("attn_mask")
        if B == self.rows or B % self.rows or not (mask is None or isinstance(mask, torch.Tensor)):
            return self._forward_one(inputs)
        total = torch.zeros((), device=self.device)
        count = torch.zeros((), device=self.device)
        for i in range(0, B, self.rows):
            piece = {
                k: v[i : i + self.rows] if isinstance(v, torch.Tensor) else v
                for k, v in inputs.items()
            }
            n = (piece["labels"] != _IGNORE_INDEX).sum()  # on the device: no sync
            total = total + self._forward_one(piece) * n
            count = count + n
        return total / count.clamp(min=1)

    def _forward_one(self, inputs: dict[str, Any]) -> torch.Tensor:
        input_ids = inputs["input_ids"]
        B, T = input_ids.shape
        shape = (B, T // self.seq_split, self.dim)  # sequence parallel: this rank's T slice
        mine = {s.spec.index: s for s in self.stages}
        index = torch.zeros((), dtype=torch.int64)
        h: torch.Tensor | None = input_ids
        loss = torch.zeros((), device=self.device)
        for s in range(self.num_stages):
            owner = stage_rank(s, self.num_stages, self.pp, self.schedule_name)
            if owner != self.pp_rank:
                continue
            stage = mine[s]
            if s > 0 and stage_rank(s - 1, self.num_stages, self.pp, self.schedule_name) != owner:
                h = torch.empty(shape, dtype=self.act_dtype, device=self.device)
                prev = stage_rank(s - 1, self.num_stages, self.pp, self.schedule_name)
                dist.recv(h, src=dist.get_global_rank(self.group, prev), group=self.group)
            stage.micro_batches = [inputs]
            out = stage(h, micro_batch=index)
            stage.micro_batches = []
            if stage.spec.head:
                loss = out.reshape(()).float()
                continue
            nxt = stage_rank(s + 1, self.num_stages, self.pp, self.schedule_name)
            if nxt != owner:
                dist.send(
                    out.contiguous(), dst=dist.get_global_rank(self.group, nxt), group=self.group
                )
            h = out
        dist.all_reduce(loss, group=self.group)
        return loss


# ------------------------------------------------------------------------------------------
# The trainer's two calls


def cut_pipeline(cfg: Any, dims: Any, mesh: Any, model: nn.Module) -> list[PipelineStageModule]:
    """cut_model for job config `cfg` on this rank of mesh["pp"] (model on the meta device)."""
    from models import build_model

    stages = cut_model(
        model,
        check_pipeline(cfg, dims),
        mesh["pp"].get_local_rank(),
        dims.pp,
        cfg.parallel.pp_schedule,
        lambda: build_model(cfg.model),
    )
    for stage in stages:
        stage.tp_mesh = mesh["tp"] if dims.tp > 1 else None
    return stages


def build_runner(
    cfg: Any,
    dims: Any,
    mesh: Any,
    model: nn.Module,
    device: torch.device,
    act_dtype: torch.dtype,
) -> PipelineRunner:
    """The PipelineRunner of a model cut by cut_pipeline, materialised and initialised."""
    from graphtrain.attention import resolve_attention
    from graphtrain.step import model_inputs

    attention = resolve_attention(cfg.training.attention, device)
    num_microbatches, rows = pipeline_microbatches(cfg, dims)
    return PipelineRunner(
        model,
        model.pipeline_stages,
        num_stages=len(check_pipeline(cfg, dims)),
        pp_group=mesh["pp"].get_group(),
        pp=dims.pp,
        schedule=cfg.parallel.pp_schedule,
        num_microbatches=num_microbatches,
        micro_batch_size=rows,
        seq_len=cfg.training.seq_len,
        seq_split=dims.tp,
        dim=cfg.model.dim,
        act_dtype=act_dtype,
        device=device,
        make_inputs=lambda batch: model_inputs(batch, device, attention),
    )
