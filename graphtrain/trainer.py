"""A training job: build the run (graphtrain.run), then the loop (step, log, validate,
checkpoint).

    train(cfg) -> init_distributed -> build_run(cfg) -> Run -> _train_loop(run) -> TrainResult

The loop pulls each step's micro-batches from the loader, hands them to the step once, and logs,
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
import signal
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

from graphtrain.balance import NONFINITE
from graphtrain.checkpoint import (
    complete_checkpoints,
)
from graphtrain.checkpoint.safe_load import brief
from graphtrain.config import JobConfig
from graphtrain.inspect import write_report
from graphtrain.inspect.capture import record_output_code
from graphtrain.metrics import memory_stats
from graphtrain.metrics.energy import energy_metrics
from graphtrain.metrics.hardware import describe_memory
from graphtrain.metrics.logger import recorded
from graphtrain.optim import (
    global_norm,
)
from graphtrain.parallel import (
    destroy_distributed,
    init_distributed,
)
from graphtrain.parallel.divergence import check_replicas
from graphtrain.parallel.pipeline import (
    norm_over_stages,
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
from graphtrain.run import Run, build_run
from graphtrain.step import StepStats, loss_sums

logger = logging.getLogger("graphtrain")

# "No step yet" for the first step with a non-finite loss, which is kept as min over steps.
_NO_STEP = torch.iinfo(torch.int64).max


@dataclasses.dataclass
class TrainResult:
    run_dir: Path
    steps: int
    losses: list[float]  # training loss at every step (gathered at log steps, so no extra syncs)
    val_losses: dict[int, float]  # step -> validation loss (step 0: before training)


def train(cfg: JobConfig) -> TrainResult:
    """Run one training job described by `cfg`; returns the losses it logged."""
    with stop_during_startup():  # a SIGTERM before the loop: one line, not a silent death
        device, rank, world_size = init_distributed(cfg.training.device)
    # Every group ends here, not in the interpreter's exit (destroy_distributed), once the run
    # is gone: _train's frame held it (its model's FSDP states, its groups).
    try:
        result = _train(cfg, device, rank, world_size)
    except (Preempted, StartupStopped) as e:  # stopped as asked: exit 75
        traceback.clear_frames(e.__traceback__)  # the run lives on in the traceback's frames
        destroy_distributed()
        raise
    except BaseException:
        # Failed: the CLI's line first. The launcher stops the other ranks as soon as one
        # fails, and would stop this one (SIGTERM) during the longer teardown.
        destroy_distributed(release=False)
        raise
    destroy_distributed()
    return result


def _train(cfg: JobConfig, device: torch.device, rank: int, world_size: int) -> TrainResult:
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


# ------------------------------------------------------------------------------------------
# The loop


def _train_loop(run: Run, preemption: PreemptionHandler) -> TrainResult:
    """Steps until training.steps: each step's micro-batches from the loader into the step,
    then log, validate, compare replicas and save at their intervals; a SIGTERM/SIGINT on any
    rank saves and stops every rank after the step (Preempted)."""
    cfg, progress = run.cfg, run.progress
    total = cfg.training.steps
    result = TrainResult(run_dir=run.run_dir, steps=total, losses=[], val_losses={})
    if cfg.metrics.validate and run.data.val is None and run.rank == 0:
        logger.warning("no held-out data large enough for one batch: validation is skipped")
    preemption.install()
    if progress.step == 0:
        _validate(run, result, step=0)
    elif progress.step == total and run.rank == 0:  # a finished run resumed (a requeued job)
        logger.info("resumed at step %d = training.steps: nothing left to train", total)
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
        values = torch.stack([stats.extra[name].to(run.device, torch.float32) for name in names])
        values = values.tolist()
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
    if val is None or not run.cfg.metrics.validate:
        return
    cfg, model = run.cfg, run.model
    rows = cfg.metrics.val_rows or cfg.metrics.val_batches * cfg.training.micro_batch_size
    model.eval()
    with torch.no_grad(), run.train_step.forward.weights.installed():
        total = loss_sums(run.train_step.forward, val.eval_batches(rows))
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
