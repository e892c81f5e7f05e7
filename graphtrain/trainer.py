"""The training loop: data -> step (gradient accumulation) -> clip -> optimizer -> schedule ->
metrics -> checkpoint.

The loop knows nothing of the graph passes: it builds the model on the meta device, hands it to
graphtrain.parallel (tensor parallel, activation checkpointing, compile regions, FSDP2, in that
order), materialises and initialises it, and runs. Host synchronisation happens only at log,
validation and checkpoint steps; in between, losses and the non-finite check stay on the device.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import os
import shutil
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from graphtrain.attention import build_attention_mask, resolve_attention
from graphtrain.balance import RouterBalance
from graphtrain.checkpoint import CheckpointManager, complete_checkpoints, resolve
from graphtrain.checkpoint.hf import load_hf_into
from graphtrain.config import JobConfig, pass_options, to_toml
from graphtrain.data import build_data
from graphtrain.inspect import write_report
from graphtrain.metrics import (
    MetricsLogger,
    memory_stats,
    model_training_flops,
    peak_flops,
    write_run_info,
)
from graphtrain.metrics.banner import start_banner
from graphtrain.metrics.energy import EnergyMeter, energy_metrics
from graphtrain.metrics.profiling import StepProfiler
from graphtrain.optim import (
    BatchSizeSchedule,
    FP32GradAccumulator,
    LRSchedule,
    build_optimizer,
    cast_parameters_,
    clip_grad_norm_,
    global_norm,
)
from graphtrain.parallel import (
    ParallelDims,
    build_mesh,
    dp_mesh,
    expert_dp_mesh,
    expert_params,
    parallelize_model,
    partial_grad_params,
    reduce_expert_grads,
    reduce_partial_grads,
    validate_model_for_tp,
)
from models import build_model, tp_plan
from models.moe import MoEConfig, active_params

logger = logging.getLogger("graphtrain")

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclasses.dataclass
class TrainResult:
    run_dir: Path
    steps: int
    losses: list[float]  # training loss at every step (gathered at log steps, so no extra syncs)
    val_losses: dict[int, float]  # step -> validation loss (step 0: before training)


def _init_distributed(device_choice: str) -> tuple[torch.device, int, int]:
    """Start the process group when launched by torchrun; pick this rank's device."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    if device_choice == "auto":
        device_choice = "cuda" if torch.cuda.is_available() else "cpu"
    if device_choice == "cuda":
        if not torch.cuda.is_available():
            raise ValueError("training.device='cuda' but no CUDA device is visible")
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    if world_size > 1 and not dist.is_initialized():
        dist.init_process_group(
            "nccl" if device.type == "cuda" else "gloo",
            device_id=device if device.type == "cuda" else None,
        )
    return device, rank, world_size


def _run_dir(cfg: JobConfig, rank: int, world_size: int) -> Path:
    """The run directory, the same on every rank (rank 0 names it and tells the others)."""
    name = [cfg.training.run_dir or f"runs/{cfg.preset}-{time.strftime('%Y%m%d-%H%M%S')}"]
    if world_size > 1:
        dist.broadcast_object_list(name, src=0)
    # Created (rank 0) only once the start has passed its checks: a failed start leaves no
    # empty run directory behind.
    return Path(name[0])


def _param_dtype(cfg: JobConfig, device: torch.device) -> torch.dtype:
    if cfg.training.master_dtype != "float32":  # pure low-precision: compute in it too
        return _DTYPES[cfg.training.master_dtype]
    if cfg.training.dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return _DTYPES[cfg.training.dtype]


def _all_reduce(t: torch.Tensor, group, op=dist.ReduceOp.SUM) -> torch.Tensor:
    if group is not None:
        dist.all_reduce(t, op=op, group=group)
    return t


def check_layout(cfg: JobConfig, world_size: int) -> ParallelDims:
    """The parallel axes of `cfg` on `world_size` ranks, checked against the model (a ValueError
    naming the numbers otherwise); also `graphtrain train --check`, before any rank starts."""
    p = cfg.parallel
    dims = ParallelDims(
        dp_replicate=p.dp_replicate,
        dp_shard=p.dp_shard,
        tp=p.tp,
        ep=p.ep,
        etp=p.etp,
        world_size=world_size,
    )
    validate_model_for_tp(cfg.model, dims.tp, seq_len=cfg.training.seq_len, etp=dims.etp)
    return dims


def train(cfg: JobConfig) -> TrainResult:
    """Run one training job described by `cfg`; returns the losses it logged."""
    device, rank, world_size = _init_distributed(cfg.training.device)
    # A job starts from a clean compiler state: code compiled for an earlier job in this process
    # (another model, other passes) must neither be reused nor count against the recompile limit.
    torch._dynamo.reset()
    try:
        result = _train(cfg, device, rank, world_size)
        if dist.is_initialized():
            # Every rank done with its collectives before the group is torn down: destroying it
            # while a peer still talks aborts that peer (seen with gloo).
            dist.barrier()
        return result
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _train(cfg: JobConfig, device: torch.device, rank: int, world_size: int) -> TrainResult:
    t_cfg, m_cfg = cfg.training, cfg.model
    # Layout and model checks first: nothing large is allocated before they pass.
    dims = check_layout(cfg, world_size)
    attention = resolve_attention(t_cfg.attention, device)
    if cfg.checkpoint.async_save and device.type != "cuda":
        raise ValueError(
            f"checkpoint.async_save=true needs CUDA but training runs on {device.type}; "
            "set checkpoint.async_save=false"
        )
    # One process needs no mesh: every axis is 1 and nothing is sharded.
    mesh = build_mesh(dims, device.type) if world_size > 1 else None
    dp_group = dp_mesh(mesh).get_group() if dims.dp_size > 1 else None
    dp_rank = dp_mesh(mesh).get_local_rank() if dims.dp_size > 1 else 0

    run_dir = _run_dir(cfg, rank, world_size)
    profiler = StepProfiler(  # checks metrics.memory_snapshot against the device, allocates nothing
        run_dir,
        steps=cfg.metrics.profile_steps,
        memory_snapshot=cfg.metrics.memory_snapshot,
        device=device,
        rank=rank,
    )
    saved = complete_checkpoints(run_dir)
    if saved and not cfg.checkpoint.resume:
        # A fresh start would overwrite and prune these: never lose saved work silently.
        raise ValueError(
            f"training.run_dir={str(run_dir)!r} already holds checkpoints (newest {saved[-1].name}); "
            "continue it with --checkpoint.resume=latest or choose another training.run_dir"
        )
    if cfg.checkpoint.resume:
        start = resolve(run_dir, cfg.checkpoint.resume)  # a wrong name stops here, before any work
        if saved and start.resolve() not in {p.resolve() for p in saved}:
            # Its saves would replace this run's checkpoints of the same steps.
            raise ValueError(
                f"training.run_dir={str(run_dir)!r} already holds checkpoints (newest "
                f"{saved[-1].name}); continue {start} in an empty training.run_dir"
            )

    cache_dir = Path(
        cfg.data.cache_dir
        or os.environ.get("GRAPHTRAIN_CACHE", Path.home() / ".cache" / "graphtrain")
    )
    data = build_data(
        paths=cfg.data.paths or None,
        tokenizer_path=cfg.data.tokenizer or None,
        vocab_size=m_cfg.vocab_size,
        seq_len=t_cfg.seq_len,
        micro_batch_size=t_cfg.micro_batch_size,
        dp_rank=dp_rank,
        dp_world_size=dims.dp_size,
        seed=t_cfg.seed,
        cache_dir=cache_dir,
        val_paths=cfg.data.val_paths or None,
        token_dtype=cfg.data.token_dtype,
        weights=cfg.data.weights or None,  # a blend of the paths
    )
    if data.vocab_size_needed > m_cfg.vocab_size:
        raise ValueError(
            f"the data needs a vocabulary of {data.vocab_size_needed} tokens but "
            f"model.vocab_size={m_cfg.vocab_size}; raise model.vocab_size or use another tokenizer"
        )
    batch_schedule = BatchSizeSchedule.parse(
        cfg.schedule.batch_size or t_cfg.micro_batch_size * t_cfg.seq_len * dims.dp_size
    )
    # Every entry must split into whole micro-batches on every rank: checked before training.
    batch_schedule.check(
        micro_batch_size=t_cfg.micro_batch_size, seq_len=t_cfg.seq_len, dp_world_size=dims.dp_size
    )

    param_dtype = _param_dtype(cfg, device)
    fsdp = dims.dp_size > 1
    with torch.device("meta"):
        model = build_model(m_cfg)
    if t_cfg.master_dtype != "float32":
        cast_parameters_(model, _DTYPES[t_cfg.master_dtype])  # before sharding: FSDP2 keeps it
    compile_options, dump_dir = None, None
    if cfg.compile.enable:
        dump_dir = run_dir / "graphs" if cfg.compile.dump_graphs and rank == 0 else None
        compile_options = {
            "passes": cfg.compile.passes,
            "inner": cfg.compile.backend,
            "dump_dir": dump_dir,
            # Expert parallel's all-to-all has data-dependent sizes and runs outside the graph:
            # an MoE block compiles as two graphs around it.
            "fullgraph": dims.ep == 1,
            "pass_options": pass_options(cfg),
        }
    plan = tp_plan(m_cfg, dims.etp, dims.ep)
    parallelize_model(
        model,
        mesh,
        dims,
        plan=plan,
        ac_mode=t_cfg.activation_checkpoint,
        compile_options=compile_options,
        param_dtype=param_dtype,
        reduce_dtype=_DTYPES[t_cfg.reduce_dtype],
    )
    model.to_empty(device=device)
    model.init_weights(seed=t_cfg.seed)
    if cfg.checkpoint.init_from_hf and not cfg.checkpoint.resume:
        load_hf_into(model, Path(cfg.checkpoint.init_from_hf))
    model.train()
    # FSDP2 casts parameters for compute itself; without it, autocast does, and the fp32
    # parameters stay the master weights either way.
    autocast = (
        torch.autocast(device.type, dtype=param_dtype)
        if not fsdp and param_dtype != torch.float32
        else contextlib.nullcontext()
    )

    o = cfg.optim
    optimizer = build_optimizer(
        model,
        lr=o.lr,
        betas=tuple(o.betas),
        eps=o.eps,
        weight_decay=o.weight_decay,
        no_decay_patterns=o.no_decay,
        implementation=o.implementation,
        state_dtype=o.state_dtype,
    )
    fp32_grads = FP32GradAccumulator(model, o.fp32_grad_accum)
    ep_params = expert_params(model)
    # MoE layers (etp=1) or their routers (etp=tp): gradients partial over tp.
    tp_partial = partial_grad_params(model, plan) if dims.tp > 1 else []
    # Ranks holding the same experts (none besides this one when ep covers every dp rank).
    ep_grad_group = expert_dp_mesh(mesh).get_group() if 1 < dims.ep < dims.dp_size else None
    balance = RouterBalance(
        model,
        # Ranks that route different tokens: the dp ranks, and with tp and expert TP size 1
        # the sequence slices too (with etp = tp every tp rank routes the whole sequence).
        count_group=dist.group.WORLD if dims.tp > 1 and dims.etp == 1 else dp_group,
        token_slices=dims.tp,
        bias_update_rate=getattr(m_cfg, "bias_update_rate", 0.0),
    )
    # AdamW keeps two moments per parameter element; report what they cost on this rank.
    local_numel = sum(
        (p.to_local() if isinstance(p, DTensor) else p).numel() for p in model.parameters()
    )
    optim_state = {
        # torch's AdamW keeps its moments in the parameters' dtype, AdamWBF16 in bf16.
        "optim_state_bytes": 2
        * local_numel
        * min(_DTYPES[o.state_dtype].itemsize, _DTYPES[t_cfg.master_dtype].itemsize),
        "optim_state_bytes_fp32": 2 * local_numel * 4,
    }
    if rank == 0:
        logger.info(
            "optimizer moments: %.1f MiB per rank (%.1f MiB in float32)",
            optim_state["optim_state_bytes"] / 2**20,
            optim_state["optim_state_bytes_fp32"] / 2**20,
        )
    lr_schedule = LRSchedule(
        lr=o.lr,
        min_lr=cfg.schedule.min_lr,
        warmup_steps=cfg.warmup_steps,
        decay_steps=cfg.decay_steps,
        total_steps=t_cfg.steps,
        decay_style=cfg.schedule.decay_style,
    )
    checkpoints = CheckpointManager(
        run_dir,
        keep_last=cfg.checkpoint.keep_last,
        retain_interval=cfg.checkpoint.retain_interval,
        async_save=cfg.checkpoint.async_save,
    )
    step, consumed_tokens = 0, 0
    if cfg.checkpoint.resume:
        saved_state = checkpoints.load(cfg.checkpoint.resume, model=model, optimizer=optimizer)
        step, consumed_tokens = saved_state["step"], saved_state["consumed_tokens"]
        data.train.load_state_dict(saved_state["data"])
        # Both schedules are functions of (step, consumed tokens) and the config: the config
        # wins, so a run can be extended or re-scheduled; a change is worth a line in the log.
        for name, sched in (("lr_schedule", lr_schedule), ("batch_schedule", batch_schedule)):
            saved_sched = saved_state[name]
            current = {k: v for k, v in sched.state_dict().items() if k != "last_step"}
            if {k: v for k, v in saved_sched.items() if k != "last_step"} != current and rank == 0:
                logger.warning("%s differs from the checkpoint's: %s", name, current)
        changed = {
            k: (saved_state["model"][k], v)
            for k, v in dataclasses.asdict(m_cfg).items()
            if k in saved_state.get("model", {}) and saved_state["model"][k] != v
        }
        if changed and rank == 0:
            logger.warning(
                "the model config differs from the checkpoint's: %s",
                ", ".join(f"model.{k}: {a!r} -> {b!r}" for k, (a, b) in changed.items()),
            )
    # The run dir describes the run only once it has started: a start that fails (a bad
    # checkpoint, a wrong resume) leaves the previous config.toml and tokenizer.json, which
    # `graphtrain export` reads, as they were.
    if rank == 0:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.toml").write_text(to_toml(cfg))
        write_run_info(run_dir, {"world_size": world_size, "parallel": str(dims)})
        if data.tokenizer is not None and data.tokenizer.path is not None:
            # The run dir holds its tokenizer, so `graphtrain export` can always find it.
            shutil.copyfile(data.tokenizer.path, run_dir / "tokenizer.json")

    if rank == 0:  # the start banner: what this run is about to do
        logger.info(
            "\n%s",
            start_banner(
                cfg,
                run_dir=run_dir,
                dims=dims,
                num_params=sum(p.numel() for p in model.parameters()),  # DTensor: global numel
                active_params=active_params(m_cfg) if isinstance(m_cfg, MoEConfig) else None,
                param_dtype=str(param_dtype).removeprefix("torch."),
                device=device.type,
                micro_batches_per_step=batch_schedule.micro_batches_per_step(
                    consumed_tokens,
                    micro_batch_size=t_cfg.micro_batch_size,
                    seq_len=t_cfg.seq_len,
                    dp_world_size=dims.dp_size,
                ),
            ),
        )

    peak = (
        cfg.metrics.peak_tflops * 1e12
        if cfg.metrics.peak_tflops
        else peak_flops(device, param_dtype)
    )
    metrics = MetricsLogger(
        run_dir,
        rank=rank,
        tensorboard=cfg.metrics.tensorboard,
        total_steps=t_cfg.steps,
        # Rows after the checkpoint's step are superseded; a fresh run starts a new record.
        resume_step=step if cfg.checkpoint.resume else None,
    )
    metrics.log(step, optim_state)
    result = TrainResult(run_dir=run_dir, steps=t_cfg.steps, losses=[], val_losses={})

    def forward(td) -> torch.Tensor:
        if device.type == "cuda":
            td = td.pin_memory()  # so that the copy below is really asynchronous
        td = td.to(device, non_blocking=True)
        mask = build_attention_mask(td["document_ids"], attention)
        with autocast:
            return model(td["input_ids"], td["labels"], td["position_ids"], mask)

    def validate() -> float | None:
        """Mean loss over the first metrics.val_batches batches of the held-out data."""
        if data.val is None:
            return None
        model.eval()
        data.val.reset()  # the same batches at every validation
        total = torch.zeros((), device=device)
        with torch.no_grad():
            for _ in range(cfg.metrics.val_batches):
                total += forward(next(data.val)).float()
        model.train()
        total = _all_reduce(total, dp_group) / (cfg.metrics.val_batches * dims.dp_size)
        return total.item()  # host sync: validation steps only

    def log_validation(at: int) -> None:
        val_loss = validate()
        if val_loss is not None:
            result.val_losses[at] = val_loss
            metrics.log(at, {"val_loss": val_loss})

    if data.val is None and rank == 0:
        logger.warning("no held-out data large enough for one batch: validation is skipped")
    if step == 0:
        log_validation(0)

    train_iter = iter(data.train)
    energy = EnergyMeter(device)  # energy per token where NVML reads the GPU's counter
    # Losses of the steps since the last log, and the first step with a non-finite loss, stay
    # on the device until a log step.
    pending: list[torch.Tensor] = []
    first_bad = torch.full((), 2**62, dtype=torch.int64, device=device)
    window_tokens, window_flops, window_start = 0, 0, time.perf_counter()
    while step < t_cfg.steps:
        num_micro = batch_schedule.micro_batches_per_step(
            consumed_tokens,
            micro_batch_size=t_cfg.micro_batch_size,
            seq_len=t_cfg.seq_len,
            dp_world_size=dims.dp_size,
        )
        profiler.before_step(step + 1)  # metrics.profile_steps
        lr = lr_schedule.apply(optimizer, step)
        step_loss = torch.zeros((), device=device)
        batches = [next(train_iter) for _ in range(num_micro)]
        # Each micro-batch's mean loss weighted by its share of the step's labelled tokens: the
        # step's loss is the mean over all its tokens on this rank, whatever the micro-batches
        # hold (FSDP then averages the ranks). Counts come from the loader: no device sync.
        num_labels = [td["num_label_tokens"] for td in batches]
        for td, n in zip(batches, num_labels, strict=True):
            # Exact FLOPs of this rank's micro-batch (document-causal attention pairs included),
            # counted on the host from the loader's CPU-side numbers: no device sync.
            window_flops += model_training_flops(
                m_cfg,
                num_tokens=td["input_ids"].numel(),
                num_attention_pairs=int(td["num_attention_pairs"]),
            )
            weight = n / max(sum(num_labels), 1)
            balance.before_micro_batch(weight)
            loss = forward(td)
            (loss * weight).backward()
            balance.after_micro_batch(weight)
            fp32_grads.after_backward()
            step_loss += loss.detach().float() * weight
        fp32_grads.finalize()
        if dims.ep > 1:
            reduce_expert_grads(ep_params, ep_grad_group, dims.dp_size)
        if tp_partial:
            reduce_partial_grads(tp_partial, mesh["tp"])
        grad_norm = clip_grad_norm_(list(model.parameters()), o.max_norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        balance.after_step()  # expert biases move once per optimizer step
        step += 1
        tokens = num_micro * t_cfg.micro_batch_size * t_cfg.seq_len * dims.dp_size
        consumed_tokens += tokens
        window_tokens += tokens
        # min(first_bad, step) where the loss is not finite; clamp takes the step as a Python
        # number (a torch.tensor(step) would be a blocking host-to-device copy every step).
        first_bad = torch.where(torch.isfinite(step_loss), first_bad, first_bad.clamp(max=step))
        pending.append(step_loss)

        profiler.after_step(step)
        last = step == t_cfg.steps
        if step % cfg.metrics.log_interval == 0 or last:
            losses = _all_reduce(torch.stack(pending), dp_group) / dims.dp_size
            bad = _all_reduce(first_bad.clone(), dp_group, dist.ReduceOp.MIN).item()  # host sync
            if bad < 2**62:
                raise FloatingPointError(
                    f"non-finite training loss at step {bad} (lr {lr_schedule.lr_at(bad - 1):.3g}); "
                    f"stopping. Check the learning rate, the data, or the last checkpoint."
                )
            result.losses.extend(losses.tolist())
            pending.clear()
            elapsed = time.perf_counter() - window_start
            entry = {
                "loss": result.losses[-1],
                "lr": lr,
                "grad_norm": grad_norm.item(),
                # Every rank joins this reduction (a collective), also one with empty shards.
                "param_norm": global_norm(list(model.parameters())).item(),
                "tokens_per_s": window_tokens / elapsed,
                "consumed_tokens": consumed_tokens,
                "micro_batches": num_micro,
            }
            device_flops = window_flops / dims.tp  # tensor parallel splits each matmul
            entry["tflops_per_device"] = device_flops / elapsed / 1e12
            if peak:
                entry["mfu"] = device_flops / elapsed / peak
            entry.update(memory_stats(device))
            if energy.available:  # NVML's energy counter, summed over the ranks
                joules = energy.joules_since_last()
                total = torch.tensor(joules, dtype=torch.float64, device=device)
                total = _all_reduce(total, dist.group.WORLD if world_size > 1 else None).item()
                entry.update(energy_metrics(joules, total, tokens=window_tokens, seconds=elapsed))
            entry.update(balance.metrics())
            metrics.log(step, entry)
            window_tokens, window_flops, window_start = 0, 0, time.perf_counter()
        val_interval = cfg.metrics.val_interval
        if last or (val_interval and step % val_interval == 0):
            log_validation(step)
            window_start = time.perf_counter()  # keep validation out of tokens/s
        ckpt = cfg.checkpoint
        if (ckpt.interval and step % ckpt.interval == 0) or (
            last and (ckpt.interval or ckpt.final)
        ):
            checkpoints.save(
                step,
                model=model,
                optimizer=optimizer,
                trainer_state={
                    "step": step,
                    "consumed_tokens": consumed_tokens,
                    "data": data.train.state_dict(),
                    "lr_schedule": lr_schedule.state_dict(),
                    "batch_schedule": batch_schedule.state_dict(),
                    "model": dataclasses.asdict(m_cfg),
                },
            )
            window_start = time.perf_counter()
    checkpoints.wait()  # an async save in flight is complete before train() returns
    profiler.close()  # a range past the last step still writes what it recorded
    metrics.close()
    if dump_dir is not None:  # what the compiler did, as `graphtrain inspect` shows it
        write_report(dump_dir, run_dir / "inspect", inner=cfg.compile.backend)
    if rank == 0 and len(result.val_losses) > 1:
        first, final = (
            result.val_losses[min(result.val_losses)],
            result.val_losses[max(result.val_losses)],
        )
        logger.info("validation loss %.3f -> %.3f (%.2f nats)", first, final, first - final)
    if not all(math.isfinite(v) for v in result.val_losses.values()):
        raise FloatingPointError(f"non-finite validation loss: {result.val_losses}")
    return result
