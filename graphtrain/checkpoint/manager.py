"""Sharded checkpoints with torch.distributed.checkpoint (DCP): save, retention, resume.

Layout
    <run_dir>/checkpoints/step-0000100/ holds the DCP shards of the model and optimizer (every
    rank writes its own, rank 0 also `.metadata`), trainer-rank<r>.pt (step, consumed tokens,
    data loader position, schedule state, this rank's RNG states, the sizes and SHA-256
    digests of the files it wrote) and, from rank 0, checksums.json over every file
    (integrity.py; verified on load before anything is unpickled).

Contract (never losing work)
    A save is written under step-N.tmp and renamed to step-N only after every rank finished,
    its files fsynced: the final name is the completion marker, so a save killed half-way is
    never loaded (`latest` is the newest name without a suffix). A failed save raises
    CheckpointSaveError on every rank, naming the path and the untouched previous checkpoint.
    A checkpoint damaged after it was written is refused on load, naming the file (with
    fallback_on_corruption, `latest` resumes from the newest intact one). Weights holding a
    NaN or an Inf are never saved (NonFiniteWeightsError). Retention deletes, after a save
    completes, all but the last keep_last and the multiples of retain_interval.
    Async save (checkpoint.async_save) stages to host memory and writes in the background; the
    rename and retention happen at the next save or at wait(), so the marker still comes last.
    Each guarantee in full: docs/design/checkpoint.md.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import shutil
import warnings
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_state_dict,
)

from graphtrain.checkpoint.integrity import (
    CHECKSUMS,
    DCP_ERRORS,
    check_shapes,
    damaged_files,
    few,
    file_entry,
    nonfinite_names,
    read_checksums,
    read_shapes,
    write_checksums,
    written_files,
)
from graphtrain.checkpoint.safe_load import UnsafeCheckpointError, brief, load_trainer_file

logger = logging.getLogger("graphtrain")

# The optimizer's hyperparameters are saved per parameter name ("optim.param_groups.<name>.lr"),
# not per group index: how the parameters fall into groups depends on the layout (plain tensors
# and DTensors are grouped apart), and a checkpoint resumes on any layout. Checkpoints written
# before that keep indexed groups ("optim.param_groups.0.lr") and load as they were saved.
_BY_NAME = StateDictOptions(flatten_optimizer_state_dict=True)
_INDEXED_GROUPS = re.compile(r"^optim\.param_groups\.\d+\.")
_NAME = re.compile(r"^step-(\d{7})$")
_STALE = re.compile(r"^step-\d{7}\.(tmp|old)$")


class CheckpointSaveError(OSError):
    """A checkpoint could not be written; the previous checkpoints are intact."""


class NonFiniteWeightsError(FloatingPointError):
    """The weights to save hold a NaN or an Inf: nothing was written, the checkpoints are kept."""


class CheckpointCorruptError(ValueError):
    """A checkpoint's files are not those that were saved. `previous`: the newest earlier
    checkpoint of the same run whose files are intact, or None."""

    def __init__(self, message: str, previous: Path | None) -> None:
        super().__init__(message)
        self.previous = previous


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _agree_lines(lines: list[str]) -> list[str]:
    """Every rank's lines, joined in rank order without repeats, on every rank. A collective."""
    if not dist.is_initialized():
        return lines
    gathered: list[list[str] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, lines)
    return list(dict.fromkeys(line for rank_lines in gathered for line in rank_lines))


def _agree(error: BaseException | None) -> str | None:
    """Every rank's error, joined, on every rank (None when all succeeded). A collective."""
    text = None if error is None else f"rank {_rank()}: {type(error).__name__}: {error}"
    if not dist.is_initialized():
        return text
    texts: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(texts, text)
    failed = [t for t in texts if t is not None]
    return "; ".join(failed) if failed else None


def step_of(path: Path) -> int:
    return int(_NAME.match(path.name).group(1))


def complete_checkpoints(run_dir: Path) -> list[Path]:
    """Complete checkpoints of a run, oldest first."""
    root = Path(run_dir) / "checkpoints"
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if p.is_dir() and _NAME.match(p.name))


def to_delete(complete: list[Path], *, keep_last: int, retain_interval: int) -> list[Path]:
    """The checkpoints retention removes: all but the last keep_last and the retained steps."""
    keep = set(complete[-keep_last:])
    if retain_interval:
        keep |= {p for p in complete if step_of(p) % retain_interval == 0}
    return [p for p in complete if p not in keep]


def resolve(path: Path, which: str = "latest") -> Path:
    """A run dir + `latest` or a checkpoint name -> its folder; a checkpoint folder (as `path`,
    or as `which`: a checkpoint of another run to continue from) -> itself.

    A clear ValueError when there is no such complete checkpoint.
    """
    path = Path(path)
    if _NAME.match(path.name) and path.is_dir():
        return path
    given = Path(which)
    if len(given.parts) > 1:
        if _NAME.match(given.name) and given.is_dir():
            return given
        raise ValueError(
            f"checkpoint.resume={which!r} is not a complete checkpoint folder (a folder "
            "step-NNNNNNN in a run's checkpoints/; a step-NNNNNNN.tmp was never completed)"
        )
    if not path.is_dir():
        raise ValueError(f"{path} does not exist: give a run directory or a checkpoint folder")
    found = complete_checkpoints(path)
    if which == "latest":
        if not found:
            raise ValueError(
                f"{path}/checkpoints has no complete checkpoint: a run saves one when it ends "
                "(checkpoint.final, on by default) and every checkpoint.interval steps; was "
                "the run stopped early, or started with --checkpoint.final=false?"
            )
        return found[-1]
    ckpt = path / "checkpoints" / which
    if ckpt not in found:
        names = ", ".join(p.name for p in found) or "none"
        raise ValueError(
            f"checkpoint.resume={which!r} is not a complete checkpoint of {path}; found: {names}"
        )
    return ckpt


def _check(path: Path) -> tuple[list[dict[str, Any]], list[str]]:
    """(every rank's trainer state, what is wrong with checkpoint `path`), the same on every rank
    (a collective when distributed: each rank hashes its share of the files).

    With checksums.json every file, the trainer files included, is checked before any is
    unpickled; a checkpoint written before it existed is checked against the manifests in its
    trainer files (their own bytes unchecked)."""
    rank, world = _rank(), dist.get_world_size() if dist.is_initialized() else 1
    saved, problems = [], []
    try:
        checksums = read_checksums(path)
    except ValueError as e:
        checksums, problems = None, [str(e)]
    trainer_files = sorted(path.glob("trainer-rank*.pt"))
    if checksums is not None:
        problems = damaged_files(path, [checksums], rank=rank, world_size=world)
        problems += [
            f"{f.name} is not one of the files saved with the checkpoint"
            for f in trainer_files
            if f.name not in checksums
        ]
        problems = _agree_lines(problems)
        if problems:
            return saved, problems
    for f in trainer_files:
        try:
            saved.append(load_trainer_file(f))
        except UnsafeCheckpointError:
            raise
        except ValueError as e:  # every rank reads the same files: the same on every rank
            problems.append(f"{f.name} cannot be read ({brief(e.__cause__ or e)})")
    if not saved and not problems:
        problems.append("it has no trainer-rank*.pt (never completed)")
    if checksums is None and not problems:
        if any(s.get("checksums") for s in saved):
            problems.append(f"{CHECKSUMS} is missing (its trainer files were saved with one)")
        else:
            problems = damaged_files(path, [s["files"] for s in saved], rank=rank, world_size=world)
    return saved, _agree_lines(problems)


def read_trainer_files(path: Path) -> list[dict[str, Any]]:
    """Every rank's trainer-rank<r>.pt of checkpoint `path`, after checking that each file they
    list is whole and unchanged: CheckpointCorruptError naming what is not, and the previous
    intact checkpoint. Every rank calls it (a collective when distributed)."""
    saved, problems = _check(path)
    if not problems:
        return saved
    previous = None
    for earlier in reversed(complete_checkpoints(path.parent.parent)):
        if step_of(earlier) < step_of(path) and not _check(earlier)[1]:
            previous = earlier
            break
    advice = (
        f"the previous intact checkpoint is {previous}: resume from it with "
        f"--checkpoint.resume={previous.name}, or let --checkpoint.resume=latest fall back to it "
        "with --checkpoint.fallback_on_corruption=true"
        if previous
        else "no earlier intact checkpoint of this run exists"
    )
    raise CheckpointCorruptError(
        f"checkpoint {path} is truncated or damaged: {'; '.join(problems)}; {advice}", previous
    )


def _manifest_when_written(save: Future, tmp: Path, rank: int) -> dict[str, Any]:
    """This rank's file manifest once DCP's async save `save` has finished (a background thread:
    the training thread does not wait for the hashing)."""
    save.result()
    return written_files(tmp, rank)


@contextlib.contextmanager
def single_process_quiet() -> Iterator[None]:
    """DCP warns on every save and load of one process that torch.distributed is not
    initialised ("assuming the intent is to save in a single process"), which is the intent."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _fsync(path: Path) -> None:
    """Flush a file's data, or a folder's entries, to the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class CheckpointManager:
    """Saves and loads the checkpoints of one run; every rank makes the same calls."""

    def __init__(
        self,
        run_dir: Path,
        *,
        keep_last: int,
        retain_interval: int,
        async_save: bool,
        fallback_on_corruption: bool = False,
    ) -> None:
        self.root = Path(run_dir) / "checkpoints"
        self.run_dir = Path(run_dir)
        self.keep_last = keep_last
        self.retain_interval = retain_interval
        self.async_save = async_save
        self.fallback_on_corruption = fallback_on_corruption
        # An async save in flight: (future of this rank's file manifest, tmp folder, final
        # folder, trainer state).
        self._pending: tuple[Future, Path, Path, dict[str, Any]] | None = None
        self._async_group = None
        self._hasher: ThreadPoolExecutor | None = None
        if async_save:
            # Hashes the files once DCP's background write is done, off the training thread.
            self._hasher = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ckpt-digest")
        if async_save and dist.is_initialized():
            # The background thread's collectives need a group that runs on the host.
            self._async_group = dist.new_group(backend="gloo")

    def save(
        self,
        step: int,
        *,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        trainer_state: dict[str, Any],
    ) -> None:
        """Save checkpoint step-<step> (returns before it is on disk when async).

        NonFiniteWeightsError, before anything is written, when a weight holds a NaN or an Inf:
        such a checkpoint would displace the last finite one by retention (or by name)."""
        self.wait()
        final = self.root / f"step-{step:07d}"
        self._refuse_nonfinite(model, final, step)
        tmp = self.root / f"{final.name}.tmp"
        error = None
        if _rank() == 0:
            try:
                for stale in self.root.glob("step-*.*"):  # left by saves that were killed
                    if _STALE.match(stale.name):
                        shutil.rmtree(stale)
                tmp.mkdir(parents=True)
            except OSError as e:
                error = e
        self._raise_if_failed(_agree(error), final, tmp)
        state = {
            **trainer_state,
            "rng_cpu": torch.get_rng_state(),
            "rng_cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None,
        }
        model_sd, optim_sd = get_state_dict(model, optimizer, options=_BY_NAME)
        try:
            if self.async_save:
                future = dcp.async_save(
                    {"model": model_sd, "optim": optim_sd},
                    checkpoint_id=str(tmp),
                    process_group=self._async_group,
                )
                manifest = self._hasher.submit(_manifest_when_written, future, tmp, _rank())
                self._pending = (manifest, tmp, final, state)
                return
            with single_process_quiet():
                dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(tmp))
        except DCP_ERRORS as e:
            error = e
        self._raise_if_failed(_agree(error), final, tmp)
        self._complete(tmp, final, state, written_files(tmp, _rank()))

    def _refuse_nonfinite(self, model: torch.nn.Module, final: Path, step: int) -> None:
        tensors = dict(model.named_parameters()) | dict(model.named_buffers())
        bad = _agree_lines(nonfinite_names(tensors))  # every rank names its shards' tensors
        if not bad:
            return
        kept = complete_checkpoints(self.run_dir)
        advice = (
            f"the last finite checkpoint {kept[-1]} is kept: resume from it with "
            f"--checkpoint.resume={kept[-1].name} and a lower learning rate"
            if kept
            else "no earlier checkpoint exists"
        )
        raise NonFiniteWeightsError(
            f"not saving checkpoint {final}: the weights after step {step} are not finite "
            f"(NaN or Inf in {few(bad, total=len(tensors))}); {advice}"
        )

    def wait(self) -> None:
        """Finish an async save in flight (a no-op otherwise)."""
        if self._pending is None:
            return
        manifest, tmp, final, state = self._pending
        self._pending = None
        error, files = None, {}
        try:
            files = manifest.result()
        except DCP_ERRORS as e:
            error = e
        self._raise_if_failed(_agree(error), final, tmp)
        self._complete(tmp, final, state, files)

    def _complete(
        self, tmp: Path, final: Path, state: dict[str, Any], files: dict[str, Any]
    ) -> None:
        """Write the trainer state with this rank's file manifest (sizes and digests), then mark
        complete (rename) and apply retention."""
        error, entries = None, {}
        try:
            state = {**state, "files": files, "checksums": CHECKSUMS}
            trainer_file = tmp / f"trainer-rank{_rank()}.pt"
            torch.save(state, trainer_file)
            _fsync(trainer_file)  # DCP's FileSystemWriter fsyncs its own shards (sync_files)
            entries = {**files, **file_entry(trainer_file)}
        except OSError as e:
            error = e
        self._raise_if_failed(_agree(error), final, tmp)
        everyone = [entries]
        if dist.is_initialized():  # rank 0 lists every rank's files in checksums.json
            everyone = [None] * dist.get_world_size()
            dist.all_gather_object(everyone, entries)
        if _rank() == 0:
            try:
                write_checksums(
                    tmp, {k: v for rank_files in everyone for k, v in rank_files.items()}
                )
                _fsync(tmp)
                if final.exists():  # the same step saved again (a resumed run): replace it
                    old = final.with_name(f"{final.name}.old")
                    final.rename(old)
                    tmp.rename(final)
                    shutil.rmtree(old)
                else:
                    tmp.rename(final)
                _fsync(final.parent)
            except OSError as e:
                error = e
        self._raise_if_failed(_agree(error), final, tmp)
        if _rank() == 0:
            complete = complete_checkpoints(self.run_dir)
            for old in to_delete(
                complete, keep_last=self.keep_last, retain_interval=self.retain_interval
            ):
                shutil.rmtree(old)
            logger.info("saved checkpoint %s", final)
        if dist.is_initialized():
            dist.barrier()

    def _raise_if_failed(self, error: str | None, final: Path, tmp: Path) -> None:
        if error is None:
            return
        if _rank() == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        previous = [p for p in complete_checkpoints(self.run_dir) if p != final]
        intact = (
            f"the previous checkpoint {previous[-1]} is intact"
            if previous
            else "no earlier checkpoint exists"
        )
        raise CheckpointSaveError(f"saving checkpoint {final} failed ({error}); {intact}")

    def load(
        self, which: str, *, model: torch.nn.Module, optimizer: torch.optim.Optimizer
    ) -> dict[str, Any]:
        """Restore model, optimizer and RNG from checkpoint `which` ("latest", a name, or the
        path of a checkpoint folder); returns the trainer state saved with it (that of rank 0
        when resumed on more ranks than saved)."""
        path = resolve(self.run_dir, which)
        try:
            saved = read_trainer_files(path)
        except CheckpointCorruptError as e:
            if not (self.fallback_on_corruption and which == "latest" and e.previous):
                raise
            logger.warning("%s. Falling back to it (checkpoint.fallback_on_corruption)", e)
            path = e.previous
            saved = read_trainer_files(path)
        saved_keys = read_shapes(path)
        indexed = any(_INDEXED_GROUPS.match(k) for k in saved_keys)
        options = StateDictOptions() if indexed else _BY_NAME
        model_sd, optim_sd = get_state_dict(model, optimizer, options=options)
        shapes = {k: v for k, v in saved_keys.items() if k.startswith("model.")}
        expected = {f"model.{k}": v.shape for k, v in model_sd.items()}
        if dist.is_initialized() and dist.get_world_size() > 1:
            # Pipeline stages hold different parts of the model: the checkpoint must fit the
            # union of every rank's keys (the same keys on every rank without pp).
            parts: list[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(parts, expected)
            expected = {k: v for part in parts for k, v in part.items()}
        check_shapes(expected, shapes, source=f"checkpoint {path}")
        state = {"model": model_sd, "optim": optim_sd}
        try:
            with single_process_quiet():
                dcp.load(state, checkpoint_id=str(path))
        except DCP_ERRORS as e:
            raise ValueError(
                f"checkpoint {path} is corrupted: reading it failed ({brief(e)})"
            ) from e
        set_state_dict(
            model,
            optimizer,
            model_state_dict=state["model"],
            optim_state_dict=state["optim"],
            options=options,
        )
        own = path / f"trainer-rank{_rank()}.pt"
        extra = load_trainer_file(own) if own.exists() else saved[0]
        torch.set_rng_state(extra["rng_cpu"])
        if extra["rng_cuda"] is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state(extra["rng_cuda"])
        logger.info("resumed from checkpoint %s (step %d)", path, extra["step"])
        return extra
