"""Build a run: everything before the first step.

    build_run(cfg, device, rank, world_size) -> Run
    check_job(cfg, world_size)    the checks needing no rank (`graphtrain train --check`)

It checks the layout and the run directory, builds the data, the model (on the meta device,
handed to graphtrain.parallel: expert parallel, tensor parallel, compile regions, activation
checkpointing, FSDP2, in that order; or cut into pipeline stages; materialised and initialised),
the optimizer, the schedules, resumes from a checkpoint, and builds the step
(graphtrain.step.TrainStep) with the working copies of the fp32 master weights taken from what
was loaded (graphtrain.optim.working_weights: the model computes with them, the checkpoints and
the optimizer see the masters; an AdamWCopies optimizer writes them in its step). The loop that
runs it: graphtrain.trainer.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from graphtrain.attention import resolve_attention
from graphtrain.balance import install_router_balance
from graphtrain.checkpoint import (
    CheckpointManager,
    complete_checkpoints,
    resolve,
    resume_differences,
    step_of,
)
from graphtrain.checkpoint.hf import check_hf_config, load_hf_into
from graphtrain.compile import step_hooks
from graphtrain.config import JobConfig, pass_options, to_toml
from graphtrain.data import build_data, check_inputs
from graphtrain.metrics import MetricsLogger, peak_flops, write_run_info
from graphtrain.metrics.banner import start_banner
from graphtrain.metrics.energy import EnergyMeter
from graphtrain.metrics.hardware import rank_memory
from graphtrain.metrics.memory_plan import MemoryPlan, check_fits, plan_memory
from graphtrain.metrics.profiling import StepProfiler
from graphtrain.optim import (
    AdamWCopies,
    BatchSizeSchedule,
    FP32GradAccumulator,
    LRSchedule,
    WorkingWeights,
    cast_parameters_,
    describe_optimizer,
    lr_schedule_from_config,
    optimizer_from_config,
    optimizer_state_bytes,
)
from graphtrain.parallel import (
    GradientFinisher,
    ParallelDims,
    build_mesh,
    check_layout,
    dp_mesh,
    parallelize_model,
    unused_axis_settings,
)
from graphtrain.parallel.pipeline import (
    build_runner,
    cut_pipeline,
    stage_tp_plan,
)
from graphtrain.passes import resolve_passes
from graphtrain.precision import Precision
from graphtrain.step import ForwardLoss, TrainStep
from models import build_model, tp_plan
from models.moe import MoEConfig, active_params

logger = logging.getLogger("graphtrain")


@dataclasses.dataclass
class Progress:
    """Where the run is: what a checkpoint saves and a resume restores (with the data's state)."""

    step: int = 0  # optimizer steps taken
    consumed_tokens: int = 0  # over all data-parallel ranks


@dataclasses.dataclass(frozen=True)
class Run:
    """Everything a built job holds; fixed once built except `progress` and the objects' own
    state (model, optimizer, data position)."""

    cfg: JobConfig
    device: torch.device
    rank: int
    dims: ParallelDims
    dp_group: dist.ProcessGroup | None  # loss averages; None with one data-parallel rank
    run_dir: Path
    data: Any  # graphtrain.data.build_data's result: train and val loaders, tokenizer
    model: torch.nn.Module
    train_step: TrainStep
    checkpoints: CheckpointManager
    metrics: MetricsLogger
    peak_flops: float | None  # per device, for MFU
    dump_dir: Path | None  # compiled graphs, for the end-of-run inspect report
    progress: Progress
    memory_plan: MemoryPlan  # predicted per-rank memory, logged beside the measured peak once
    profiler: StepProfiler  # metrics.profile_steps / memory_snapshot
    energy: EnergyMeter  # joules per token where NVML reads the GPU's energy counter


def build_run(cfg: JobConfig, device: torch.device, rank: int, world_size: int) -> Run:
    """Check, build and (when asked) resume the job; nothing large is allocated before the
    layout, run-directory and data checks pass."""
    dims, mesh = _layout_and_mesh(cfg, device, world_size)
    if rank == 0:  # settings of an axis that is off: likely a forgotten axis
        for line in unused_axis_settings(cfg.parallel):
            logger.warning("%s", line)
    precision = Precision.of(cfg, dims, device)  # every dtype decision, once
    memory_plan = _memory_plan(cfg, device, rank, world_size)
    dp_group = dp_mesh(mesh).get_group() if dims.dp_size > 1 else None
    run_dir = _prepare_run_dir(cfg, rank, world_size)
    # Checks metrics.memory_snapshot against the device now; allocates nothing.
    profiler = StepProfiler(
        run_dir,
        steps=cfg.metrics.profile_steps,
        memory_snapshot=cfg.metrics.memory_snapshot,
        device=device,
        rank=rank,
    )
    data, batch_schedule = _build_data(cfg, dims, mesh)
    model, finish_gradients, dump_dir = _build_model(
        cfg, dims, mesh, device, precision, run_dir, rank
    )
    optimizer, fp32_grads, lr_schedule, optim_state = _build_optimizer(cfg, model, precision, rank)
    balance = install_router_balance(
        model, optimizer, mesh, dims, bias_update_rate=getattr(cfg.model, "bias_update_rate", 0.0)
    )
    checkpoints = CheckpointManager(
        run_dir,
        keep_last=cfg.checkpoint.keep_last,
        retain_interval=cfg.checkpoint.retain_interval,
        async_save=cfg.checkpoint.async_save,
        fallback_on_corruption=cfg.checkpoint.fallback_on_corruption,
    )
    progress = Progress()
    if cfg.checkpoint.resume:
        schedules = {"lr_schedule": lr_schedule, "batch_schedule": batch_schedule}
        progress = _resume(cfg, checkpoints, model, optimizer, data, schedules, rank)
    _describe_run_dir(cfg, run_dir, dims, data, rank)
    if rank == 0:
        fields = (cfg, run_dir, dims, model, optimizer, batch_schedule, precision, device, progress)
        logger.info("\n%s", _banner(*fields))
    metrics = MetricsLogger(
        run_dir,
        rank=rank,
        tensorboard=cfg.metrics.tensorboard,
        total_steps=cfg.training.steps,
        # Rows after the checkpoint's step are superseded; a fresh run starts a new record.
        resume_step=progress.step if cfg.checkpoint.resume else None,
    )
    metrics.log(progress.step, optim_state)
    # After the resume: the working copies start from the masters the run continues with.
    train_step = _build_step(
        cfg, dims, mesh, device, precision, model, optimizer,
        fp32_grads=fp32_grads, lr_schedule=lr_schedule, batch_schedule=batch_schedule,
        finish_gradients=finish_gradients, hooks=[balance] if balance else [],
    )  # fmt: skip
    return Run(
        cfg=cfg,
        device=device,
        rank=rank,
        dims=dims,
        dp_group=dp_group,
        run_dir=run_dir,
        data=data,
        model=model,
        train_step=train_step,
        checkpoints=checkpoints,
        metrics=metrics,
        peak_flops=(
            cfg.metrics.peak_tflops * 1e12
            if cfg.metrics.peak_tflops
            else peak_flops(device, precision.compute)
        ),
        dump_dir=dump_dir,
        progress=progress,
        memory_plan=memory_plan,
        profiler=profiler,
        energy=EnergyMeter(device),  # a collective: every rank agrees whether NVML works
    )


def _memory_plan(cfg: JobConfig, device: torch.device, rank: int, world_size: int) -> MemoryPlan:
    """The job's memory, predicted before anything large exists; a plan that cannot fit the
    device stops here, not by the OOM killer later."""
    memory_plan = plan_memory(cfg, world_size)
    if rank == 0:
        logger.info("%s", memory_plan.format())
    available = rank_memory(device)
    if available is not None:
        check_fits(memory_plan, available[0], device=available[1])
    return memory_plan


def _build_step(
    cfg: JobConfig,
    dims: ParallelDims,
    mesh: DeviceMesh | None,
    device: torch.device,
    precision: Precision,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    *,
    fp32_grads: FP32GradAccumulator,
    lr_schedule: LRSchedule,
    batch_schedule: BatchSizeSchedule,
    finish_gradients: GradientFinisher,
    hooks: list[Any],
) -> TrainStep:
    """The step: the forward with its attention, autocast and working copies (taken from the
    masters as they are now), the pipeline's runner under pp, and the step hooks."""
    masters = precision.working_masters(model, cfg)
    weights = WorkingWeights(model, masters, precision.compute)
    if isinstance(optimizer, AdamWCopies):
        weights.refresh_in(optimizer)  # its step writes the copies
    runner = None
    if dims.pp_enabled:  # its schedule runs the step; model(...) runs every stage (validation)

        def after_backward() -> None:
            weights.collect_grads()  # a zero-bubble schedule's weight half ran no hook
            fp32_grads.after_backward()

        runner = build_runner(cfg, dims, mesh, model, device, precision.pipeline, after_backward)
        model.forward = runner.forward
    attention = resolve_attention(cfg.training.attention, device)
    return TrainStep(
        forward=ForwardLoss(model, device, attention, precision.autocast_context(device), weights),
        optimizer=optimizer,
        lr_schedule=lr_schedule,
        batch_schedule=batch_schedule,
        fp32_grads=fp32_grads,
        finish_gradients=finish_gradients,
        max_norm=cfg.optim.max_norm,
        hooks=[*hooks, *step_hooks(fp8=cfg.fp8 if cfg.training.fp8 else None)],
        model_cfg=cfg.model,
        micro_batch_size=cfg.training.micro_batch_size,
        seq_len=cfg.training.seq_len,
        dp_size=dims.dp_size,
        pipeline=runner,
    )


def _layout_and_mesh(
    cfg: JobConfig, device: torch.device, world_size: int
) -> tuple[ParallelDims, DeviceMesh | None]:
    """The parallel layout and its mesh, after the checks that need no allocation."""
    dims = check_layout(cfg, world_size)
    resolve_attention(cfg.training.attention, device)  # a wrong choice stops here
    if cfg.checkpoint.async_save and device.type != "cuda":
        raise ValueError(
            f"checkpoint.async_save=true needs CUDA but training runs on {device.type}; "
            "set checkpoint.async_save=false"
        )
    # One process needs no mesh: every axis is 1 and nothing is sharded.
    mesh = build_mesh(dims, device.type) if world_size > 1 else None
    return dims, mesh


def check_job(cfg: JobConfig, world_size: int) -> None:
    """The start checks that need no rank, device or allocation: the layout, the pass switches,
    the run directory (when named), the Hugging Face weights to start from (their config) and
    the data's inputs. `graphtrain train --check` runs them once before any rank starts
    (launch.sh), so that a mistake is one line, not one per rank; they do not depend on this
    machine's device (first_contact.sh's CPU dry run checks the GPU run's config with them)."""
    check_layout(cfg, world_size)
    resolve_passes(cfg.compile.passes)  # a pass name that does not exist
    if cfg.training.run_dir:  # else each start names a new one
        check_run_dir(cfg, Path(cfg.training.run_dir))
    if cfg.checkpoint.init_from_hf and not cfg.checkpoint.resume:
        check_hf_config(Path(cfg.checkpoint.init_from_hf), cfg.model)
    check_inputs(
        paths=cfg.data.paths or None,
        val_paths=cfg.data.val_paths or None,
        tokenizer_path=cfg.data.tokenizer or None,
        vocab_size=cfg.model.vocab_size,
    )


def _prepare_run_dir(cfg: JobConfig, rank: int, world_size: int) -> Path:
    """The run directory, the same on every rank (rank 0 names it and tells the others),
    checked (check_run_dir)."""
    name = [cfg.training.run_dir or f"runs/{cfg.preset}-{time.strftime('%Y%m%d-%H%M%S')}"]
    if world_size > 1:
        dist.broadcast_object_list(name, src=0)
    # Created (rank 0, _describe_run_dir) only once the start has passed its checks: a failed
    # start leaves no empty run directory behind.
    run_dir = Path(name[0])
    check_run_dir(cfg, run_dir)
    return run_dir


def check_run_dir(cfg: JobConfig, run_dir: Path) -> None:
    """The run directory's start checks, on the file system only (`graphtrain train --check`
    runs them too, before any rank starts): writable; no saved checkpoints that a fresh start
    would overwrite; a resume naming a complete checkpoint, of this run or into an empty run
    directory, and not past training.steps."""
    _check_writable(run_dir)
    saved = complete_checkpoints(run_dir)
    if saved and not cfg.checkpoint.resume:
        # A fresh start would overwrite and prune these: never lose saved work silently.
        raise ValueError(
            f"training.run_dir={str(run_dir)!r} already holds checkpoints (newest {saved[-1].name}); "
            "continue it with --checkpoint.resume=latest or choose another training.run_dir"
        )
    if cfg.checkpoint.resume:
        start = resolve(run_dir, cfg.checkpoint.resume)  # a wrong name stops here, before any work
        if saved and start.resolve() not in {path.resolve() for path in saved}:
            # Its saves would replace this run's checkpoints of the same steps.
            raise ValueError(
                f"training.run_dir={str(run_dir)!r} already holds checkpoints (newest "
                f"{saved[-1].name}); continue {start} in an empty training.run_dir"
            )
        if step_of(start) > cfg.training.steps:  # it would end at once, having trained nothing
            raise ValueError(
                f"checkpoint.resume={cfg.checkpoint.resume!r} ({start.name}) is past "
                f"training.steps={cfg.training.steps}: raise training.steps to continue it"
            )


def _check_writable(run_dir: Path) -> None:
    """A run directory that is a file, or that this user cannot create or write, named before
    any work (not an errno from the first save)."""
    if run_dir.exists() and not run_dir.is_dir():
        raise ValueError(
            f"training.run_dir={str(run_dir)!r} is a file, not a directory; choose another "
            "training.run_dir"
        )
    existing = run_dir
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise ValueError(
            f"training.run_dir={str(run_dir)!r} cannot be created: {str(existing)!r} is a file"
        )
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ValueError(
            f"training.run_dir={str(run_dir)!r} cannot be written: this user may not write to "
            f"{str(existing)!r}; choose another training.run_dir"
        )


def _build_data(
    cfg: JobConfig, dims: ParallelDims, mesh: DeviceMesh | None
) -> tuple[Any, BatchSizeSchedule]:
    """The loaders of this data-parallel rank and the checked batch-size schedule."""
    training = cfg.training
    cache_dir = Path(
        cfg.data.cache_dir
        or os.environ.get("GRAPHTRAIN_CACHE", Path.home() / ".cache" / "graphtrain")
    )
    data = build_data(
        paths=cfg.data.paths or None,
        tokenizer_path=cfg.data.tokenizer or None,
        vocab_size=cfg.model.vocab_size,
        seq_len=training.seq_len,
        micro_batch_size=training.micro_batch_size,
        dp_rank=dp_mesh(mesh).get_local_rank() if dims.dp_size > 1 else 0,
        dp_world_size=dims.dp_size,
        seed=training.seed,
        cache_dir=cache_dir,
        val_paths=cfg.data.val_paths or None,
        token_dtype=cfg.data.token_dtype,
        weights=cfg.data.weights or None,  # a blend of the paths
    )
    if data.vocab_size_needed > cfg.model.vocab_size:
        raise ValueError(
            f"the data needs a vocabulary of {data.vocab_size_needed} tokens but "
            f"model.vocab_size={cfg.model.vocab_size}; raise model.vocab_size or use another "
            "tokenizer"
        )
    batch_schedule = BatchSizeSchedule.parse(
        cfg.schedule.batch_size or training.micro_batch_size * training.seq_len * dims.dp_size
    )
    # Every entry must split into whole micro-batches on every rank: checked before training.
    batch_schedule.check(
        micro_batch_size=training.micro_batch_size,
        seq_len=training.seq_len,
        dp_world_size=dims.dp_size,
    )
    return data, batch_schedule


def _build_model(
    cfg: JobConfig,
    dims: ParallelDims,
    mesh: DeviceMesh | None,
    device: torch.device,
    precision: Precision,
    run_dir: Path,
    rank: int,
) -> tuple[torch.nn.Module, GradientFinisher, Path | None]:
    """The model built on the meta device, parallelized (and compiled), materialised and
    initialised (or loaded from Hugging Face weights); its gradient finisher; the graph dump
    directory (None unless compiled with dump_graphs, on rank 0)."""
    training = cfg.training
    with torch.device("meta"):
        model = build_model(cfg.model)
    if precision.master != torch.float32:
        cast_parameters_(model, precision.master)  # before sharding: FSDP2 keeps it
    if dims.pp_enabled:  # this rank's pipeline stages only (graphtrain.parallel.pipeline)
        model.pipeline_stages = cut_pipeline(cfg, dims, mesh, model)
    compile_options, dump_dir = None, None
    if cfg.compile.enable:
        dump_dir = run_dir / "graphs" if cfg.compile.dump_graphs and rank == 0 else None
        compile_options = {
            "passes": cfg.compile.passes,
            "inner": cfg.compile.backend,
            "dump_dir": dump_dir,
            # Expert parallel's all-to-all has data-dependent split sizes: its regions trace them
            # with dynamic output shapes (graphtrain.compile), one graph per block.
            "fullgraph": dims.ep == 1,
            "pass_options": pass_options(cfg),
            "cudagraph_mtp": cfg.compile.cudagraph_mtp,
            "device_type": device.type,
            "activation_memory_budget": training.activation_memory_budget,
        }
    plan = tp_plan(cfg.model, dims.etp, dims.ep)
    if dims.pp_enabled:  # the entries of this rank's stages
        plan = stage_tp_plan(plan, model)
    finish_gradients = parallelize_model(
        model,
        mesh,
        dims,
        plan=plan,
        ac_mode=training.activation_checkpoint,
        compile_options=compile_options,
        param_dtype=precision.compute,
        reduce_dtype=precision.reduce,
        fp8_all_gather=cfg.fp8 if cfg.fp8.fsdp_all_gather_fp8 else None,
        reshard_policy=cfg.parallel.fsdp_reshard_after_forward,
    )
    model.to_empty(device=device)
    model.init_weights(seed=training.seed)
    if cfg.checkpoint.init_from_hf and not cfg.checkpoint.resume:
        load_hf_into(model, Path(cfg.checkpoint.init_from_hf))
    model.train()
    return model, finish_gradients, dump_dir


def _build_optimizer(
    cfg: JobConfig, model: torch.nn.Module, precision: Precision, rank: int
) -> tuple[torch.optim.Optimizer, FP32GradAccumulator, LRSchedule, dict[str, int]]:
    """The optimizer, the fp32 gradient accumulator, the learning-rate schedule, and what the
    optimizer's moments cost on this rank (logged once)."""
    optim = cfg.optim
    optimizer = optimizer_from_config(model, optim)
    fp32_grads = FP32GradAccumulator(model, optim.fp32_grad_accum)
    optim_state = optimizer_state_bytes(
        model,
        state_dtype=precision.state,
        master_dtype=precision.master,
    )
    if rank == 0:
        logger.info(
            "optimizer moments: %.1f MiB per rank (%.1f MiB in float32)",
            optim_state["optim_state_bytes"] / 2**20,
            optim_state["optim_state_bytes_fp32"] / 2**20,
        )
    return optimizer, fp32_grads, lr_schedule_from_config(cfg), optim_state


def _resume(
    cfg: JobConfig,
    checkpoints: CheckpointManager,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    data: Any,
    schedules: dict[str, Any],
    rank: int,
) -> Progress:
    """Load cfg.checkpoint.resume into the model, optimizer and data loader; log what differs."""
    saved_state = checkpoints.load(cfg.checkpoint.resume, model=model, optimizer=optimizer)
    data.train.load_state_dict(saved_state["data"])
    if rank == 0:
        for line in resume_differences(saved_state, schedules=schedules, model_cfg=cfg.model):
            logger.warning("%s", line)
    return Progress(step=saved_state["step"], consumed_tokens=saved_state["consumed_tokens"])


def _describe_run_dir(
    cfg: JobConfig, run_dir: Path, dims: ParallelDims, data: Any, rank: int
) -> None:
    """config.toml, run_info.json and tokenizer.json. Written only once the run has started: a
    start that fails (a bad checkpoint, a wrong resume) leaves the previous ones, which
    `graphtrain export` reads, as they were."""
    if rank != 0:
        return
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.toml").write_text(to_toml(cfg))
    write_run_info(run_dir, {"world_size": dims.world_size, "parallel": str(dims)})
    if data.tokenizer is not None and data.tokenizer.path is not None:
        # The run dir holds its tokenizer, so `graphtrain export` can always find it.
        shutil.copyfile(data.tokenizer.path, run_dir / "tokenizer.json")


def _banner(
    cfg: JobConfig,
    run_dir: Path,
    dims: ParallelDims,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    batch_schedule: BatchSizeSchedule,
    precision: Precision,
    device: torch.device,
    progress: Progress,
) -> str:
    """The start banner: what this run is about to do (graphtrain.metrics.banner)."""
    training = cfg.training
    return start_banner(
        cfg,
        run_dir=run_dir,
        dims=dims,
        num_params=sum(p.numel() for p in model.parameters()),  # DTensor: global numel
        active_params=active_params(cfg.model) if isinstance(cfg.model, MoEConfig) else None,
        param_dtype=str(precision.compute).removeprefix("torch."),
        device=device.type,
        micro_batches_per_step=batch_schedule.micro_batches_per_step(
            progress.consumed_tokens,
            micro_batch_size=training.micro_batch_size,
            seq_len=training.seq_len,
            dp_world_size=dims.dp_size,
        ),
        optimizer=describe_optimizer(optimizer),
    )
