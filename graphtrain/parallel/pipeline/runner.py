"""Running a pipelined step: the schedule over this rank's stages, the validation forward
through every stage, and the norms and clipping over all stages."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Collection, Iterable, Sequence
from time import perf_counter
from types import SimpleNamespace
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from graphtrain.balance import RouterBalance
from graphtrain.data.packing import IGNORE_INDEX
from graphtrain.optim.clip import GradScale, clip_coefficient, global_norm, scale_grads_
from graphtrain.parallel.fsdp import reshards_after_forward
from graphtrain.parallel.pipeline.layout import (
    V_SCHEDULES,
    bubble_fraction,
    check_pipeline,
    pipeline_microbatches,
    schedule_class,
    stage_rank,
)
from graphtrain.parallel.pipeline.stages import PipelineStageModule, cut_model

# The loader's per-row tensors: what the pipeline's micro-batches are cut from.
_ROW_KEYS = ("input_ids", "labels", "position_ids", "document_ids")
_IDLE = "pp/idle"  # each rank's measured idle fraction, before the mean over the pp ranks


def norm_over_stages(local: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """The 2-norm over all stages from each stage's own 2-norm (every tensor in one stage)."""
    squared = local.detach().float().square()
    dist.all_reduce(squared, group=group)
    return squared.sqrt()


def clip_grad_norm_pp_(
    parameters: Sequence[torch.Tensor],
    max_norm: float,
    group: dist.ProcessGroup,
    copies: Collection[torch.Tensor] = (),
    *,
    scale: GradScale = scale_grads_,
) -> torch.Tensor:
    """graphtrain.optim.clip_grad_norm_ over all stages: the 2-norm of every stage's gradients
    (each parameter counted on the rank that owns it, `copies` not), then the same clip
    coefficient on every stage and copy (applied by `scale`, as there)."""
    grads = [p.grad for p in dict.fromkeys(parameters) if p.grad is not None]
    skip = {id(p) for p in copies}
    owned = [p.grad for p in dict.fromkeys(parameters) if p.grad is not None and id(p) not in skip]
    local = global_norm(owned) if owned else torch.zeros(())
    total = norm_over_stages(local, group)
    if max_norm > 0 and grads:
        scale(grads, clip_coefficient(total, max_norm))
    return total


class StepTimeline:
    """This rank's busy time in a pipelined step: begin() and end() around the schedule's step,
    action() around each forward and backward of its stages; idle_fraction() is the share of
    the step spent outside them (waiting for another rank, sending, receiving). On a GPU the
    marks are CUDA events on the current stream, so what is timed is the GPU's work, not its
    launches (a stage's forward is queued after the wait for its input); on a CPU, the host
    clock."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.step: tuple[Any, Any] | None = None
        self.actions: list[tuple[Any, Any]] = []
        self._start: Any = None

    def _mark(self) -> Any:
        if not self.cuda:
            return perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def _seconds(self, start: Any, end: Any) -> float:
        return start.elapsed_time(end) / 1e3 if self.cuda else end - start

    def begin(self) -> None:
        self.actions, self._start = [], self._mark()

    def end(self) -> None:
        self.step = (self._start, self._mark())

    @contextlib.contextmanager
    def action(self) -> Any:
        start = self._mark()
        try:
            yield
        finally:
            self.actions.append((start, self._mark()))

    def idle_fraction(self) -> float:
        """Of the last step (on a GPU this waits for its end)."""
        if self.step is None:
            raise RuntimeError("idle_fraction() before a step ended")
        if self.cuda:
            self.step[1].synchronize()
        total = self._seconds(*self.step)
        busy = sum(self._seconds(*a) for a in self.actions)
        return 1.0 - busy / total if total > 0 else 0.0


def _stage_class(
    after_backward: Callable[[], None], timeline: StepTimeline, reshard: bool = False
) -> type:
    """torch's PipelineStage calling `after_backward` after each backward it runs (the
    schedule runs every micro-batch's backward, and a split one's weight half sets .grad
    itself: no hook on the parameters would see it), each forward and backward timed as a
    `timeline` action. reshard (parallel.fsdp_reshard_after_forward=always): the stage's FSDP2
    units resharded after each (whole) backward too, which torch's stage keeps gathered until
    the step's end; the gradients summed unsharded stay (FSDP2's no-sync)."""
    from torch.distributed.pipelining import PipelineStage

    class Stage(PipelineStage):
        def forward_one_chunk(self, *args: Any, **kwargs: Any) -> Any:
            with timeline.action():
                return super().forward_one_chunk(*args, **kwargs)

        def backward_one_chunk(self, *args: Any, **kwargs: Any) -> Any:
            with timeline.action():
                out = super().backward_one_chunk(*args, **kwargs)
                after_backward()
                for module in self.submod.modules() if reshard else ():
                    if isinstance(module, FSDPModule):
                        module.reshard()
            return out

        def backward_weight_one_chunk(self, *args: Any, **kwargs: Any) -> Any:
            with timeline.action():
                out = super().backward_weight_one_chunk(*args, **kwargs)
                after_backward()
            return out

    return Stage


def _grads_in_param_layout(params: Iterable[torch.Tensor]) -> None:
    """After a zero-bubble step: torch's pipelining sets the weight half's gradients as
    autograd.grad returns them, without the layout autograd's accumulation gives (the
    parameter's). A slice of a fused weight's gradient (an MoE layer's w1 and w3, one GEMM) is
    then a strided view, which torch's fused AdamW on CPU reads as if contiguous (seen: one
    expert's update applied to another) and graphtrain's AdamW refuses. Such a gradient is
    copied into its (contiguous) parameter's layout."""
    for p in params:
        grad = p.grad
        if grad is not None:
            local = grad.to_local() if isinstance(grad, DTensor) else grad
            if not local.is_contiguous():
                p.grad = grad.contiguous()


# The whole model's modules an MTP stage runs besides its own layers: (name, the part of the
# layout that owns it).
_SHARED = (("tok_embeddings", "embedding"), ("norm", "head"), ("output", "head"))


class SharedCopies:
    """The embedding, final norm and head an MTP stage holds where another rank's stage owns
    them (Megatron-Core's MTP stage does the same): both start from the same init (the whole
    model's), and reduce() sums their gradients between the two ranks once per step, so the
    same optimizer step keeps them equal. `copies`: this rank's copies (counted once in norms,
    on the owner). One process group per pair of pp ranks and position on the other axes."""

    def __init__(self, model: nn.Module, specs: Sequence[Any], mesh: Any, schedule: str) -> None:
        pp = mesh["pp"].size()
        me = mesh["pp"].get_local_rank()
        rank_of = {s.index: stage_rank(s.index, len(specs), pp, schedule) for s in specs}
        mtp = [rank_of[s.index] for s in specs if s.mtp]
        self._reduce: list[tuple[nn.Module, dist.ProcessGroup]] = []
        self.copies: list[nn.Parameter] = []
        if not mtp:
            return
        columns = mesh.mesh.reshape(pp, -1)  # global ranks: pp x (the other axes)
        groups: dict[tuple[int, int], dist.ProcessGroup | None] = {}
        for name, part in _SHARED:
            owner = next(rank_of[s.index] for s in specs if getattr(s, part))
            if owner == mtp[0]:
                continue
            pair = (owner, mtp[0])
            if pair not in groups:  # every rank creates every group, in the same order
                for column in columns.T.tolist():
                    group = dist.new_group([column[owner], column[mtp[0]]])
                    if dist.get_rank() in (column[owner], column[mtp[0]]):
                        groups[pair] = group
                groups.setdefault(pair, None)
            if me in pair:
                self._reduce.append((getattr(model, name), groups[pair]))
                if me != owner:
                    self.copies += list(getattr(model, name).parameters())

    @torch.no_grad()
    def reduce(self) -> None:
        """Sum the gradients of each shared module and its copy (after the step's backward)."""
        for module, group in self._reduce:
            for p in module.parameters():
                if p.grad is not None:
                    grad = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
                    dist.all_reduce(grad, group=group)


@contextlib.contextmanager
def reduced_once(root: FSDPModule | None) -> Any:
    """Around a step: an FSDP2 root the schedule does not know (the embedding two stages of
    this rank share: stages.fsdp_roots) run as torch's schedule runs a stage's root: kept
    gathered, its gradient summed unsharded over every backward of the step, then
    reduce-scattered and resharded once: by FSDP2's manual finalization where torch has it
    (2.15), before that by torch's own code for a stage (perform_reduce_grad, which there reads
    only the stage's module). Left to FSDP2's defaults, every backward through it would
    reduce-scatter its gradient and reshard it, and the next forward gather it again: a
    reduce-scatter and an all-gather of the whole embedding per micro-batch and stage, where
    one reduce-scatter per step does (the gradients come out the same, measured)."""
    if root is None:
        yield
        return
    manual = hasattr(root, "finalize_backward")
    if manual:
        root.set_manual_backward_finalization(True)
    else:
        root.set_is_last_backward(False)
    root.set_reshard_after_backward(False)
    root.set_requires_gradient_sync(False)
    yield
    if manual:
        root.set_requires_gradient_sync(True)
        root.set_reshard_after_backward(True)
        root.finalize_backward()
        root.set_manual_backward_finalization(False)
    else:
        from torch.distributed.pipelining import PipelineStage

        PipelineStage.perform_reduce_grad(SimpleNamespace(submod=root), 1)


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
        shared: SharedCopies | None = None,
        head_stage: int | None = None,
        after_backward: Callable[[], None] = lambda: None,
        reshard_after_backward: bool = False,
    ) -> None:
        """after_backward: run after each micro-batch's backward (both halves of a split one)
        of each stage: the working copies' gradients into their masters, the fp32 gradient
        sums (graphtrain.optim.FP32GradAccumulator). reshard_after_backward: the stages'
        FSDP2 units resharded after each backward (parallel.fsdp_reshard_after_forward=always;
        never with a split backward, refused at start)."""
        self.model, self.stages, self.group = model, stages, pp_group
        self.num_stages, self.pp, self.schedule_name = num_stages, pp, schedule
        self.num_microbatches, self.device = num_microbatches, device
        self.dim, self.act_dtype, self.make_inputs = dim, act_dtype, make_inputs
        self.pp_rank = dist.get_rank(pp_group)
        self.seq_split = seq_split  # tp: stages exchange (B, T / tp, dim) slices
        self.rows = micro_batch_size  # of each micro-batch the schedule runs
        self.shared = shared
        # The stage with the final norm and head: the last, or the one before an MTP stage.
        self.head_stage = num_stages - 1 if head_stage is None else head_stage
        self.copies = shared.copies if shared is not None else []
        self.statistics: dict[str, torch.Tensor] = {}  # the MTP depths' of the last step
        self.timeline = StepTimeline(device)
        stage_class = _stage_class(after_backward, self.timeline, reshard_after_backward)
        self.torch_stages = self._torch_stages(seq_len, stage_class)
        cls = schedule_class(schedule)
        # scale_grads=False: each micro-batch's loss already carries its token weight.
        kwargs = {"loss_fn": self._loss, "scale_grads": False}
        if schedule in ("1f1b", "gpipe"):
            self.schedule = cls(self.torch_stages[0], num_microbatches, **kwargs)
        else:
            self.schedule = cls(self.torch_stages, num_microbatches, **kwargs)
        self.first = any(s.spec.embedding for s in stages)
        # The embedding two of this rank's stages share, where FSDP2 made it a root of its own.
        self.embedding_root = next(
            (e for s in stages if isinstance(e := s.shared_embedding, FSDPModule)), None
        )
        self.last = any(s.spec.index == num_stages - 1 for s in stages)
        # Logged beside tokens/s and MFU, which are over the whole pipeline: its idle time is
        # in their wall-clock time, this says how much of it the schedule predicts.
        self.bubble = bubble_fraction(schedule, pp, num_microbatches, num_stages // pp)

    def _torch_stages(self, seq_len: int, stage_class: type) -> list[Any]:
        """torch's PipelineStage (stage_class) of each of this rank's stages, with the shapes
        of what it receives and sends. Shapes given, not inferred: inference would run the
        compiled regions on meta tensors (a recompile) and its protocol differs between torch
        versions."""

        def meta(*shape: int, dtype: torch.dtype) -> torch.Tensor:
            return torch.empty(shape, dtype=dtype, device="meta")

        # requires_grad: the stage metadata says which inputs get a gradient sent back.
        hidden = meta(self.rows, seq_len // self.seq_split, self.dim, dtype=self.act_dtype)
        hidden.requires_grad_()
        loss = meta(1, dtype=torch.float32).requires_grad_()
        out = []
        for stage in self.stages:
            s = stage.spec
            if s.embedding:
                inputs: tuple = (meta(self.rows, seq_len, dtype=torch.int64),)
            else:  # an MTP stage of its own also gets the head's loss
                inputs = (hidden, loss) if s.mtp and not s.head else (hidden,)
            if s.hidden_to_mtp:
                outputs: tuple = (hidden, loss)
            else:
                outputs = (loss,) if s.head or s.mtp else (hidden,)
            out.append(
                stage_class(
                    stage,
                    s.index,
                    self.num_stages,
                    self.device,
                    input_args=inputs,
                    output_args=outputs,
                    group=self.group,
                )
            )
        return out

    @contextlib.contextmanager
    def _split_backward(self) -> Any:
        """Around a step of a zero-bubble schedule, which splits each backward in two (input
        gradients, then weight gradients from the autograd nodes the first half found): AOT
        autograd's flags for a second backward call (graphtrain.compile), and each stage keeps
        views of its outputs until the step ends. torch's pipelining detaches a stage's
        outputs after the input half; where the node it later starts the weight half from is a
        Python autograd.Function's (a compiled region's, a custom op's), only those outputs
        held it, and on torch 2.11 and 2.12 the weight half then fails ("Attribute
        '_input_metadata' is invalid for this instance of _C._FunctionBase"; 2.13 keeps it
        itself). The views hold no more than that half needs: the nodes between the outputs
        and those it starts from save nothing of size (the loss's scaling, reshapes)."""
        if self.schedule_name not in V_SCHEDULES:
            yield
            return
        from graphtrain.compile import split_backward_flags

        for stage in self.stages:
            stage.graphs = []
        try:
            with split_backward_flags():
                yield
        finally:
            for stage in self.stages:
                stage.graphs = None
        _grads_in_param_layout(self.model.parameters())

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
        num_labels = [int((p["labels"] != IGNORE_INDEX).sum()) for p in pieces]
        total = max(sum(num_labels), 1)
        weights = torch.tensor([n / total for n in num_labels], dtype=torch.float32)
        balance = next((h for h in hooks if isinstance(h, RouterBalance)), None)
        for stage in self.stages:
            stage.weights, stage.balance, stage.stats = weights.tolist(), balance, {}
        index = torch.arange(len(pieces))  # on the CPU: the stages read it without a sync
        args = (torch.cat([i["input_ids"] for i in inputs]),) if self.first else ()
        losses: list[torch.Tensor] = []
        with self._split_backward(), reduced_once(self.embedding_root):
            self.timeline.begin()
            self.schedule.step(
                *args,
                target=weights.to(self.device) if self.last else None,
                losses=losses if self.last else None,
                micro_batch=index,
            )
            self.timeline.end()
        for stage in self.stages:
            stage.micro_batches, stage.balance = [], None
        for stage in self.torch_stages:
            # torch keeps the step's outputs until the next step. Their autograd graphs hold
            # FSDP's hooks, which hold the model, which holds this runner: a cycle through
            # autograd's nodes, which Python's collector cannot see, so the model and its
            # process groups outlived the job (docs/design/parallel.md, "The end of a job").
            stage.output_chunks.clear()
        self.statistics = {k: v for stage in self.stages for k, v in stage.stats.items()}
        loss = torch.zeros((), device=self.device)
        if self.last:
            loss = torch.stack([x.detach().float().reshape(()) for x in losses]).sum()
        dist.all_reduce(loss, group=self.group)  # from the last stage to every pp rank
        return loss

    def reduce_copies(self) -> None:
        """The MTP stage's copies' gradients summed with their owners' (SharedCopies), once the
        step's gradients are whole: after the fp32 sums are back as .grad (the stages moved
        them there after each backward)."""
        if self.shared is not None:
            self.shared.reduce()

    def clip_grad_norm_(
        self, parameters: Sequence[torch.Tensor], max_norm: float, *, scale: GradScale
    ) -> torch.Tensor:
        """clip_grad_norm_pp_ over this pipeline's stages, its shared copies counted once."""
        return clip_grad_norm_pp_(parameters, max_norm, self.group, self.copies, scale=scale)

    def owned(self, parameters: Any) -> list[torch.Tensor]:
        """`parameters` without this rank's copies of other stages' (norms count them once)."""
        skip = {id(p) for p in self.copies}
        return [p for p in parameters if id(p) not in skip]

    def merged_statistics(self, extra: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Every stage's step statistics on every pp rank (log steps only: a host sync). Each
        name comes from one stage (its layers'), except those all stages have, which are
        summed (FP8 saturation counts); and the schedule's predicted bubble fraction beside the
        measured one: the last step's idle fraction (StepTimeline), the mean over the pp
        ranks."""
        values = {name: value.float().item() for name, value in extra.items()}
        values[_IDLE] = self.timeline.idle_fraction()
        gathered: list[Any] = [None] * self.pp
        dist.all_gather_object(gathered, values, group=self.group)
        merged: dict[str, float] = {}
        for part in gathered:
            for name, value in part.items():
                merged[name] = merged.get(name, 0.0) + value
        merged["pp/bubble_measured"] = merged.pop(_IDLE) / self.pp
        merged["pp/bubble_predicted"] = self.bubble
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
            n = (piece["labels"] != IGNORE_INDEX).sum()  # on the device: no sync
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
        # Up to the head's stage: the MTP depths are a training loss only (as in one process).
        for s in range(self.head_stage + 1):
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
    after_backward: Callable[[], None],
) -> PipelineRunner:
    """The PipelineRunner of a model cut by cut_pipeline, materialised and initialised;
    after_backward: PipelineRunner's."""
    from graphtrain.attention import resolve_attention
    from graphtrain.step import model_inputs

    attention = resolve_attention(cfg.training.attention, device)
    num_microbatches, rows = pipeline_microbatches(cfg, dims)
    specs = check_pipeline(cfg, dims)
    return PipelineRunner(
        model,
        model.pipeline_stages,
        num_stages=len(specs),
        head_stage=next(s.index for s in specs if s.head),
        shared=SharedCopies(model, specs, mesh, cfg.parallel.pp_schedule),
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
        after_backward=after_backward,
        reshard_after_backward=dims.dp_size > 1
        and reshards_after_forward(cfg.parallel.fsdp_reshard_after_forward, dims.pp),
    )
