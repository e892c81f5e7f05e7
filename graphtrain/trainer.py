"""A training job: build the run, then the loop (step, log, validate, checkpoint).

    train(cfg) -> init_distributed -> build_run(cfg) -> Run -> _train_loop(run) -> TrainResult

build_run checks the layout and the run directory, builds the data, the model (on the meta
device, handed to graphtrain.parallel: expert parallel, tensor parallel, compile regions,
activation checkpointing, FSDP2, in that order; materialised and initialised), the optimizer,
the schedules, resumes from a checkpoint, and builds the step (graphtrain.step.TrainStep) with
the working copies of the fp32 master weights taken from what was loaded
(graphtrain.optim.working_weights: the model computes with them, the checkpoints and the
optimizer see the masters; an AdamWCopies optimizer writes them in its step). The loop
pulls each step's micro-batches from the loader, hands them to the step once, and logs,
validates and saves. It knows nothing of the graph passes or of the parallel layout's gradient
reductions; MoE balancing and FP8 counters reach it only as step statistics (it stops on
non-finite router logits as on a non-finite loss). The loop synchronises with the device only
at log, validation and checkpoint steps; in between, losses and the non-finite checks stay on
the device (the model's own code may sync: expert parallel reads its split sizes).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import os
import shutil
import signal
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from graphtrain.attention import resolve_attention
from graphtrain.balance import NONFINITE, install_router_balance
from graphtrain.checkpoint import (
    CheckpointManager,
    complete_checkpoints,
    resolve,
    resume_differences,
)
from graphtrain.checkpoint.hf import load_hf_into
from graphtrain.checkpoint.safe_load import brief
from graphtrain.compile import step_hooks
from graphtrain.config import JobConfig, pass_options, to_toml
from graphtrain.data import build_data
from graphtrain.inspect import write_report
from graphtrain.inspect.capture import record_output_code
from graphtrain.metrics import MetricsLogger, memory_stats, peak_flops, write_run_info
from graphtrain.metrics.banner import start_banner
from graphtrain.metrics.energy import EnergyMeter, energy_metrics
from graphtrain.metrics.hardware import describe_memory, rank_memory
from graphtrain.metrics.logger import recorded
from graphtrain.metrics.memory_plan import MemoryPlan, check_fits, plan_memory
from graphtrain.metrics.profiling import StepProfiler
from graphtrain.optim import (
    AdamWCopies,
    BatchSizeSchedule,
    FP32GradAccumulator,
    LRSchedule,
    WorkingWeights,
    cast_parameters_,
    global_norm,
    optimizer_from_config,
    optimizer_state_bytes,
    working_weight_params,
)
from graphtrain.parallel import (
    GradientFinisher,
    ParallelDims,
    build_mesh,
    check_layout,
    dp_mesh,
    expert_params,
    init_distributed,
    parallelize_model,
)
from graphtrain.parallel.divergence import check_replicas
from graphtrain.parallel.pipeline import (
    build_runner,
    cut_pipeline,
    norm_over_stages,
    stage_tp_plan,
)
from graphtrain.passes.dump import start_compile_metrics, write_compile_metrics
from graphtrain.preemption import (
    PeerLostError,
    Preempted,
    PreemptionHandler,
    StartupStopped,
    looks_like_lost_peer,
    stop_during_startup,
)
from graphtrain.step import ForwardLoss, StepStats, TrainStep
from models import build_model, tp_plan
from models.moe import MoEConfig, active_params

logger = logging.getLogger("graphtrain")

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# "No step yet" for the first step with a non-finite loss, which is kept as min over steps.
_NO_STEP = torch.iinfo(torch.int64).max


@dataclasses.dataclass
class TrainResult:
    run_dir: Path
    steps: int
    losses: list[float]  # training loss at every step (gathered at log steps, so no extra syncs)
    val_losses: dict[int, float]  # step -> validation loss (step 0: before training)


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


def train(cfg: JobConfig) -> TrainResult:
    """Run one training job described by `cfg`; returns the losses it logged."""
    with stop_during_startup():  # a SIGTERM before the loop: one line, not a silent death
        device, rank, world_size = init_distributed(cfg.training.device)
    # A job starts from a clean compiler state: code compiled for an earlier job in this process
    # (another model, other passes) must neither be reused nor count against the recompile limit.
    torch._dynamo.reset()
    start_compile_metrics()  # the run's report reads this job's compiles only
    preemption = PreemptionHandler()  # SIGTERM/SIGINT: save and stop (graphtrain.preemption)
    run_dir = Path(cfg.training.run_dir) if cfg.training.run_dir else None
    try:
        with stop_during_startup():
            run = build_run(cfg, device, rank, world_size)
        run_dir = run.run_dir
        # With graph dumps, Inductor's generated code goes beside them (for the run's report).
        record = record_output_code(run.dump_dir) if run.dump_dir else contextlib.nullcontext()
        with record:
            result = _train_loop(run, preemption)
        if dist.is_initialized():
            # Every rank done with its collectives before the group is torn down: destroying it
            # while a peer still talks aborts that peer (seen with gloo).
            dist.barrier()
        return result
    except Exception as e:
        if world_size > 1 and looks_like_lost_peer(e):
            raise _peer_lost(run_dir, rank, e) from None
        raise
    finally:
        preemption.restore()
        if dist.is_initialized():
            dist.destroy_process_group()


def _peer_lost(run_dir: Path | None, rank: int, error: BaseException) -> PeerLostError:
    """One line for a collective that failed because another rank went away: which checkpoint
    the run continues from (gloo's own text is a traceback per rank)."""
    saved = complete_checkpoints(run_dir) if run_dir is not None else []
    where = (
        f"the newest complete checkpoint is {saved[-1]}: continue with --checkpoint.resume=latest"
        if saved
        else "no checkpoint of this run is complete yet"
    )
    return PeerLostError(
        f"rank {rank} lost contact with another rank ({brief(error, 120)}), which stopped or "
        f"died (its own output says why); {where}"
    )


# ------------------------------------------------------------------------------------------
# Building a run


def build_run(cfg: JobConfig, device: torch.device, rank: int, world_size: int) -> Run:
    """Check, build and (when asked) resume the job; nothing large is allocated before the
    layout, run-directory and data checks pass."""
    dims, mesh = _layout_and_mesh(cfg, device, world_size)
    memory_plan = plan_memory(cfg, world_size)  # predicted before anything large exists
    if rank == 0:
        logger.info("%s", memory_plan.format())
    available = rank_memory(device)
    if available is not None:  # a plan that cannot fit stops here, not by the OOM killer later
        check_fits(memory_plan, available[0], device=available[1])
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
    model, finish_gradients, dump_dir = _build_model(cfg, dims, mesh, device, run_dir, rank)
    optimizer, fp32_grads, lr_schedule, optim_state = _build_optimizer(cfg, model, rank)
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
        logger.info("\n%s", _banner(cfg, run_dir, dims, model, batch_schedule, device, progress))
    metrics = MetricsLogger(
        run_dir,
        rank=rank,
        tensorboard=cfg.metrics.tensorboard,
        total_steps=cfg.training.steps,
        # Rows after the checkpoint's step are superseded; a fresh run starts a new record.
        resume_step=progress.step if cfg.checkpoint.resume else None,
    )
    metrics.log(progress.step, optim_state)
    attention = resolve_attention(cfg.training.attention, device)
    autocast = _autocast(cfg, dims, device)
    # After the resume: the copies start from the masters the run continues with.
    weights = WorkingWeights(
        model, _working_masters(cfg, dims, device, model), _param_dtype(cfg, device)
    )
    if isinstance(optimizer, AdamWCopies):
        weights.refresh_in(optimizer)  # its step writes the copies
    runner = None
    if dims.pp_enabled:  # its schedule runs the step; model(...) runs every stage (validation)
        runner = build_runner(
            cfg, dims, mesh, model, device, _pipeline_act_dtype(cfg, dims, device)
        )
        model.forward = runner.forward
    train_step = TrainStep(
        forward=ForwardLoss(model, device, attention, autocast, weights),
        optimizer=optimizer,
        lr_schedule=lr_schedule,
        batch_schedule=batch_schedule,
        fp32_grads=fp32_grads,
        finish_gradients=finish_gradients,
        max_norm=cfg.optim.max_norm,
        hooks=[*([balance] if balance else []), *step_hooks(fp8=cfg.training.fp8)],
        model_cfg=cfg.model,
        micro_batch_size=cfg.training.micro_batch_size,
        seq_len=cfg.training.seq_len,
        dp_size=dims.dp_size,
        pipeline=runner,
    )
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
            else peak_flops(device, _param_dtype(cfg, device))
        ),
        dump_dir=dump_dir,
        progress=progress,
        memory_plan=memory_plan,
        profiler=profiler,
        energy=EnergyMeter(device),  # a collective: every rank agrees whether NVML works
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


def _prepare_run_dir(cfg: JobConfig, rank: int, world_size: int) -> Path:
    """The run directory, the same on every rank (rank 0 names it and tells the others); refuses
    a start that would overwrite saved checkpoints."""
    name = [cfg.training.run_dir or f"runs/{cfg.preset}-{time.strftime('%Y%m%d-%H%M%S')}"]
    if world_size > 1:
        dist.broadcast_object_list(name, src=0)
    # Created (rank 0, _describe_run_dir) only once the start has passed its checks: a failed
    # start leaves no empty run directory behind.
    run_dir = Path(name[0])
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
    return run_dir


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


def _param_dtype(cfg: JobConfig, device: torch.device) -> torch.dtype:
    """The compute dtype of the parameters."""
    if cfg.training.master_dtype != "float32":  # pure low-precision: compute in it too
        return _DTYPES[cfg.training.master_dtype]
    if cfg.training.dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return _DTYPES[cfg.training.dtype]


def _build_model(
    cfg: JobConfig,
    dims: ParallelDims,
    mesh: DeviceMesh | None,
    device: torch.device,
    run_dir: Path,
    rank: int,
) -> tuple[torch.nn.Module, GradientFinisher, Path | None]:
    """The model built on the meta device, parallelized (and compiled), materialised and
    initialised (or loaded from Hugging Face weights); its gradient finisher; the graph dump
    directory (None unless compiled with dump_graphs, on rank 0)."""
    training = cfg.training
    with torch.device("meta"):
        model = build_model(cfg.model)
    if training.master_dtype != "float32":
        cast_parameters_(model, _DTYPES[training.master_dtype])  # before sharding: FSDP2 keeps it
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
        param_dtype=_param_dtype(cfg, device),
        reduce_dtype=_DTYPES[training.reduce_dtype],
        fp8_all_gather=cfg.fp8 if cfg.fp8.fsdp_all_gather_fp8 else None,
    )
    model.to_empty(device=device)
    model.init_weights(seed=training.seed)
    if cfg.checkpoint.init_from_hf and not cfg.checkpoint.resume:
        load_hf_into(model, Path(cfg.checkpoint.init_from_hf))
    model.train()
    return model, finish_gradients, dump_dir


def _pipeline_act_dtype(cfg: JobConfig, dims: ParallelDims, device: torch.device) -> torch.dtype:
    """The dtype of the activations between pipeline stages: FSDP2's compute dtype, the
    parameters' with low-precision masters, else fp32 (autocast keeps the residual in fp32)."""
    if dims.dp_size > 1 or cfg.training.master_dtype != "float32":
        return _param_dtype(cfg, device)
    return torch.float32


def _autocast(
    cfg: JobConfig, dims: ParallelDims, device: torch.device
) -> contextlib.AbstractContextManager:
    """FSDP2 casts parameters for compute itself; without it, autocast does, and the fp32
    parameters stay the master weights either way."""
    param_dtype = _param_dtype(cfg, device)
    if dims.dp_size > 1 or param_dtype == torch.float32:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=param_dtype)


def _working_masters(
    cfg: JobConfig, dims: ParallelDims, device: torch.device, model: torch.nn.Module
) -> list[torch.nn.Parameter]:
    """The fp32 master weights that get bf16 working copies, as they would otherwise be cast on
    every use: the matmul weights under autocast (no data parallelism), or under FSDP2 the
    expert-parallel weights it leaves alone (the experts cast them to the activations' dtype);
    FSDP2 casts its own shards once per all-gather. None with fp32 compute, bf16 masters, or
    training.working_weights off."""
    if not cfg.training.working_weights or _param_dtype(cfg, device) == torch.float32:
        return []
    if cfg.training.master_dtype != "float32":  # bf16 parameters: nothing to copy
        return []
    if dims.dp_size == 1:  # autocast computes (graphtrain.trainer._autocast)
        return working_weight_params(model)
    return expert_params(model)


def _build_optimizer(
    cfg: JobConfig, model: torch.nn.Module, rank: int
) -> tuple[torch.optim.Optimizer, FP32GradAccumulator, LRSchedule, dict[str, int]]:
    """The optimizer, the fp32 gradient accumulator, the learning-rate schedule, and what the
    optimizer's moments cost on this rank (logged once)."""
    optim = cfg.optim
    optimizer = optimizer_from_config(model, optim)
    fp32_grads = FP32GradAccumulator(model, optim.fp32_grad_accum)
    optim_state = optimizer_state_bytes(
        model,
        state_dtype=_DTYPES[optim.state_dtype],
        master_dtype=_DTYPES[cfg.training.master_dtype],
    )
    if rank == 0:
        logger.info(
            "optimizer moments: %.1f MiB per rank (%.1f MiB in float32)",
            optim_state["optim_state_bytes"] / 2**20,
            optim_state["optim_state_bytes_fp32"] / 2**20,
        )
    lr_schedule = LRSchedule(
        lr=optim.lr,
        min_lr=cfg.schedule.min_lr,
        warmup_steps=cfg.warmup_steps,
        decay_steps=cfg.decay_steps,
        total_steps=cfg.training.steps,
        decay_style=cfg.schedule.decay_style,
    )
    return optimizer, fp32_grads, lr_schedule, optim_state


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
    batch_schedule: BatchSizeSchedule,
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
        param_dtype=str(_param_dtype(cfg, device)).removeprefix("torch."),
        device=device.type,
        micro_batches_per_step=batch_schedule.micro_batches_per_step(
            progress.consumed_tokens,
            micro_batch_size=training.micro_batch_size,
            seq_len=training.seq_len,
            dp_world_size=dims.dp_size,
        ),
    )


# ------------------------------------------------------------------------------------------
# The loop


def _train_loop(run: Run, preemption: PreemptionHandler) -> TrainResult:
    """Steps until training.steps: each step's micro-batches from the loader into the step,
    then log, validate, compare replicas and save at their intervals; a SIGTERM/SIGINT on any
    rank saves and stops every rank after the step (Preempted)."""
    cfg, progress = run.cfg, run.progress
    total = cfg.training.steps
    result = TrainResult(run_dir=run.run_dir, steps=total, losses=[], val_losses={})
    if run.data.val is None and run.rank == 0:
        logger.warning("no held-out data large enough for one batch: validation is skipped")
    preemption.install()
    if progress.step == 0:
        _validate(run, result, step=0)
    if preemption.should_stop():  # a signal before the first step: nothing new to save
        raise StartupStopped(preemption.signum or signal.SIGTERM)

    train_iter = iter(run.data.train)
    window = _LogWindow(run.device)
    while progress.step < total:
        num_micro = run.train_step.num_micro_batches(progress.consumed_tokens)
        batches = [next(train_iter) for _ in range(num_micro)]
        run.profiler.before_step(progress.step + 1)
        stats = run.train_step(batches, step=progress.step)
        progress.step += 1
        run.profiler.after_step(progress.step)
        progress.consumed_tokens += stats.tokens
        window.add(stats, step=progress.step)
        run.metrics.progress(progress.step)  # the terminal's progress bar (rank 0), no sync
        replica_interval = cfg.training.replica_check_interval
        if run.dims.world_size > 1 and replica_interval and progress.step % replica_interval == 0:
            check_replicas(run.model, run.train_step.optimizer, step=progress.step)

        last = progress.step == total
        if last or progress.step % cfg.metrics.log_interval == 0:
            _log_step(run, result, window, stats)
        val_interval = cfg.metrics.val_interval
        if last or (val_interval and progress.step % val_interval == 0):
            _validate(run, result, step=progress.step)
            window.restart_clock()  # keep validation out of tokens/s
        interval = cfg.checkpoint.interval
        saved = bool(interval and progress.step % interval == 0) or (last and cfg.checkpoint.final)
        if saved:
            _save_checkpoint(run)
            window.restart_clock()
        if not last and preemption.should_stop():  # every rank agrees (one host collective)
            _stop_on_signal(run, saved)
    _finish(run, result)
    return result


class _LogWindow:
    """The steps since the last log step: their losses and the first step with a non-finite
    loss stay on the device until the log step; tokens, FLOPs and the clock on the host."""

    def __init__(self, device: torch.device) -> None:
        self.losses: list[torch.Tensor] = []
        self.first_non_finite = torch.full((), _NO_STEP, dtype=torch.int64, device=device)
        self.tokens, self.flops = 0, 0
        self.first_log = True
        self.restart_clock()

    def restart_clock(self) -> None:
        self.start = time.perf_counter()

    def add(self, stats: StepStats, *, step: int) -> None:
        self.tokens += stats.tokens
        self.flops += stats.flops
        # min(first_non_finite, step) where the loss is not finite; clamp takes the step as a
        # Python number (a torch.tensor(step) would be a blocking host-to-device copy).
        self.first_non_finite = torch.where(
            torch.isfinite(stats.loss),
            self.first_non_finite,
            self.first_non_finite.clamp(max=step),
        )
        self.losses.append(stats.loss)

    def reset(self) -> None:
        self.first_log = False
        self.losses.clear()
        self.tokens, self.flops = 0, 0
        self.restart_clock()


def _all_reduce(t: torch.Tensor, group, op=dist.ReduceOp.SUM) -> torch.Tensor:
    if group is not None:
        dist.all_reduce(t, op=op, group=group)
    return t


def _log_step(run: Run, result: TrainResult, window: _LogWindow, stats: StepStats) -> None:
    """The host syncs of a log step: the window's losses (averaged over the data-parallel
    ranks) into result.losses, a non-finite loss stops the run, and one metrics line."""
    dims = run.dims
    if run.train_step.pipeline is not None:  # every stage's statistics (MoE layers) on rank 0
        stats = dataclasses.replace(
            stats, extra=run.train_step.pipeline.merged_statistics(stats.extra)
        )
    _stop_on_nonfinite_routing(run, stats)  # before the loss check: it names the layer
    losses = _all_reduce(torch.stack(window.losses), run.dp_group) / dims.dp_size
    bad = _all_reduce(window.first_non_finite.clone(), run.dp_group, dist.ReduceOp.MIN).item()
    if bad != _NO_STEP:
        lr_at_bad = run.train_step.lr_schedule.lr_at(bad - 1)
        raise FloatingPointError(
            f"non-finite training loss at step {bad} (lr {lr_at_bad:.3g}); "
            f"stopping. Check the learning rate, the data, or the last checkpoint."
        )
    result.losses.extend(losses.tolist())
    elapsed = time.perf_counter() - window.start
    entry = {
        "loss": result.losses[-1],
        "lr": stats.lr,
        "grad_norm": stats.grad_norm.item(),
        # Every rank joins this reduction (a collective), also one with empty shards.
        "param_norm": _param_norm(run).item(),
        "tokens_per_s": window.tokens / elapsed,
        "consumed_tokens": run.progress.consumed_tokens,
        "micro_batches": stats.num_micro_batches,
    }
    device_flops = window.flops / dims.tp  # tensor parallel splits each matmul
    entry["tflops_per_device"] = device_flops / elapsed / 1e12
    if run.peak_flops:
        entry["mfu"] = device_flops / elapsed / run.peak_flops
    entry.update(memory_stats(run.device))
    if run.energy.available:  # NVML's energy counter, summed over the ranks
        joules = run.energy.joules_since_last()
        total = torch.tensor(joules, dtype=torch.float64, device=run.device)
        total = _all_reduce(total, dist.group.WORLD if dims.world_size > 1 else None).item()
        entry.update(energy_metrics(joules, total, tokens=window.tokens, seconds=elapsed))
    if run.rank == 0 and window.first_log:  # the plan beside what the first steps used
        measured = describe_memory(memory_stats(run.device))
        logger.info(
            "memory: predicted %.2f GiB per rank; measured %s",
            run.memory_plan.total / 2**30,
            measured,
        )
    if stats.extra:  # one host sync for all of them
        names = list(stats.extra)
        values = torch.stack([stats.extra[name].float() for name in names]).tolist()
        entry.update(zip(names, values, strict=True))
    run.metrics.log(run.progress.step, entry)
    window.reset()


def _param_norm(run: Run) -> torch.Tensor:
    pipeline = run.train_step.pipeline
    norm = global_norm(
        pipeline.owned(run.model.parameters()) if pipeline else list(run.model.parameters())
    )
    if pipeline is not None:  # each stage holds some of the parameters (MTP copies once)
        norm = norm_over_stages(norm, pipeline.group)
    return norm


def _stop_on_nonfinite_routing(run: Run, stats: StepStats) -> None:
    """Every rank stops when any rank's router has seen non-finite logits since the start (a
    NaN weight or activation would otherwise route silently), naming the layers and counts."""
    names = [name for name in stats.extra if name.endswith(NONFINITE)]
    if not names:
        return
    counts = torch.stack([stats.extra[name].to(torch.int64) for name in names])
    counts = _all_reduce(counts, dist.group.WORLD if run.dims.world_size > 1 else None).tolist()
    bad = [f"{name.split('/')[1]}: {n} tokens" for name, n in zip(names, counts, strict=True) if n]
    if bad:
        raise FloatingPointError(
            f"non-finite MoE router logits at step {run.progress.step} ({'; '.join(bad)}); "
            "stopping. Check the learning rate, the data, or the last checkpoint."
        )


def _validate(run: Run, result: TrainResult, *, step: int) -> None:
    """Mean loss per token over a fixed set of held-out rows (metrics.val_rows, split over the
    data-parallel ranks by PackedLoader.eval_batches): the same figure for any layout and
    micro-batch size; logged and kept in result."""
    val = run.data.val
    if val is None:
        return
    cfg, model = run.cfg, run.model
    rows = cfg.metrics.val_rows or cfg.metrics.val_batches * cfg.training.micro_batch_size
    model.eval()
    total = torch.zeros(2, device=run.device)  # (sum of token losses, labelled tokens)
    with torch.no_grad(), run.train_step.forward.weights.installed():
        for batch in val.eval_batches(rows):
            loss, n = run.train_step.forward(batch).float(), batch["num_label_tokens"]
            if n:  # a batch of padding only (every rank runs it) has a 0/0 loss
                total[0] += loss * n
            total[1] += n  # n: a host int
    model.train()
    total = _all_reduce(total, run.dp_group)
    val_loss = (total[0] / total[1]).item()  # host sync: validation steps only
    result.val_losses[step] = val_loss
    run.metrics.log(step, {"val_loss": val_loss})


def _stop_on_signal(run: Run, saved: bool) -> None:
    """Save (unless this step just did, or the run saves nothing: interval 0 and no final
    checkpoint) and raise Preempted."""
    ckpt, step = run.cfg.checkpoint, run.progress.step
    keep = bool(ckpt.interval or ckpt.final) and ckpt.save_on_signal
    if keep and not saved:
        _save_checkpoint(run)
    run.checkpoints.wait()
    stopped = Preempted(step, run.checkpoints.root / f"step-{step:07d}" if keep else None)
    if run.rank == 0:
        logger.warning("%s", stopped)
    raise stopped


def _save_checkpoint(run: Run) -> None:
    progress, train_step = run.progress, run.train_step
    run.checkpoints.save(
        progress.step,
        model=run.model,
        optimizer=train_step.optimizer,
        trainer_state={
            "step": progress.step,
            "consumed_tokens": progress.consumed_tokens,
            "data": run.data.train.state_dict(),
            "lr_schedule": train_step.lr_schedule.state_dict(),
            "batch_schedule": train_step.batch_schedule.state_dict(),
            "model": dataclasses.asdict(run.cfg.model),
        },
    )


def _finish(run: Run, result: TrainResult) -> None:
    """After the last step: pending saves complete, the inspect report, the validation
    summary; a non-finite validation loss is an error."""
    run.checkpoints.wait()  # an async save in flight is complete before train() returns
    run.profiler.close()  # a range past the last step still writes what it recorded
    run.metrics.close()
    if run.dump_dir is not None:  # what the compiler did, as `graphtrain inspect` shows it
        write_compile_metrics(run.dump_dir)  # stage times, recompile reasons, cache hits
        write_report(run.dump_dir, run.run_dir / "inspect", inner=run.cfg.compile.backend)
    val_losses = result.val_losses
    # A resumed run's summary covers the whole run: its record keeps the steps before.
    whole = {**recorded(run.run_dir / "metrics.jsonl", "val_loss"), **val_losses}
    if run.rank == 0 and len(whole) > 1:  # (only rank 0 writes the record)
        (start, first), (end, final) = min(whole.items()), max(whole.items())
        logger.info(
            "validation loss %.3f (step %d) -> %.3f (step %d): %.2f nats",
            first, start, final, end, first - final,
        )  # fmt: skip
    if not all(math.isfinite(v) for v in val_losses.values()):
        raise FloatingPointError(f"non-finite validation loss: {val_losses}")
