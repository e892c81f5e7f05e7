"""A diverging run keeps its last finite checkpoint (a save of non-finite weights is refused
before anything is written, so retention never pushes the finite one out), export refuses
non-finite weights, and a flipped bit in any file of a checkpoint, the trainer files and
checksums.json included, is refused naming the file."""

import random

import pytest
import torch
from conftest import job

from graphtrain.checkpoint import (
    CheckpointCorruptError,
    CheckpointManager,
    NonFiniteWeightsError,
    complete_checkpoints,
)
from graphtrain.checkpoint.hf import export_hf, read_model
from graphtrain.checkpoint.manager import read_trainer_files
from graphtrain.config import load_config
from graphtrain.step import TrainStep
from graphtrain.trainer import train


def test_a_diverging_run_keeps_its_last_finite_checkpoint(corpus, tmp_path, monkeypatch):
    real_call = TrainStep.__call__

    def diverge(self, batches, *, step):
        stats = real_call(self, batches, step=step)
        if step >= 3:  # from the 4th step on, as after a blow-up: the weights hold NaNs
            with torch.no_grad():
                self.optimizer.param_groups[0]["params"][0].fill_(float("nan"))
        return stats

    monkeypatch.setattr(TrainStep, "__call__", diverge)
    # Saves every step, keeps one, checks the loss only at the end: before, the saves of steps
    # 4-6 (NaN weights) pushed out step 3 and the final save kept the NaNs.
    args = job(
        corpus,
        tmp_path,
        "--training.steps=6",
        "--checkpoint.interval=1",
        "--checkpoint.keep_last=1",
        "--metrics.log_interval=100",
        "--metrics.val_interval=0",
        "--metrics.validate=true",  # the resume below stops on its validation
    )
    with pytest.raises(NonFiniteWeightsError) as e:
        train(load_config(args))
    kept = tmp_path / "run" / "checkpoints" / "step-0000003"
    message = str(e.value)
    assert "step-0000004" in message and "after step 4 are not finite" in message
    assert f"the last finite checkpoint {kept} is kept" in message
    assert [p.name for p in complete_checkpoints(tmp_path / "run")] == ["step-0000003"]
    cfg = load_config(args).model
    state, _ = read_model(kept, cfg)
    assert all(torch.isfinite(t).all() for t in state.values())

    # A checkpoint of NaN weights that got written anyway (by an older version) is not exported.
    monkeypatch.setattr("graphtrain.checkpoint.manager.nonfinite_names", lambda tensors: [])
    resume = [*args, "--checkpoint.resume=latest", "--training.steps=4"]
    with pytest.raises(FloatingPointError, match="non-finite validation loss"):
        train(load_config(resume))  # saves step 4 with NaNs, then stops on the validation
    with pytest.raises(ValueError, match=r"step-0000004 holds non-finite weights \(NaN or Inf in "):
        export_hf(tmp_path / "run", tmp_path / "hf", dtype="fp32")
    assert not (tmp_path / "hf").exists()


def test_the_save_of_nonfinite_weights_writes_nothing(tmp_path):
    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.AdamW(model.parameters())
    manager = CheckpointManager(tmp_path, keep_last=1, retain_interval=0, async_save=False)
    manager.save(1, model=model, optimizer=optimizer, trainer_state={"step": 1})
    with torch.no_grad():
        model.bias[1] = float("inf")
    with pytest.raises(NonFiniteWeightsError, match=r"Inf in bias \(1 of 2 tensors\)"):
        manager.save(2, model=model, optimizer=optimizer, trainer_state={"step": 2})
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step-0000001"]


def test_a_flipped_bit_anywhere_is_refused_naming_the_file(tmp_path):
    model = torch.nn.Linear(8, 5)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 8)).sum().backward()
    optimizer.step()
    manager = CheckpointManager(tmp_path, keep_last=1, retain_interval=0, async_save=False)
    manager.save(7, model=model, optimizer=optimizer, trainer_state={"step": 7, "data": [80]})
    ckpt = tmp_path / "checkpoints" / "step-0000007"
    names = sorted(p.name for p in ckpt.iterdir())
    assert "trainer-rank0.pt" in names and "checksums.json" in names
    read_trainer_files(ckpt)  # intact
    rng = random.Random(0)
    for name in names:
        f = ckpt / name
        data = f.read_bytes()
        positions = {0, len(data) - 1, *(rng.randrange(len(data)) for _ in range(40))}
        for pos in sorted(positions):
            flipped = bytearray(data)
            flipped[pos] ^= 1 << rng.randrange(8)
            f.write_bytes(bytes(flipped))
            with pytest.raises(CheckpointCorruptError) as e:
                read_trainer_files(ckpt)
            assert name in str(e.value), (name, pos, str(e.value))
        f.write_bytes(data)
    read_trainer_files(ckpt)

    # Without its checksums.json the trainer files would go unchecked: refused too.
    (ckpt / "checksums.json").unlink()
    with pytest.raises(CheckpointCorruptError, match=r"checksums\.json is missing"):
        read_trainer_files(ckpt)


def test_single_process_save_and_load_print_no_distributed_warning(tmp_path, recwarn):
    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.AdamW(model.parameters())
    manager = CheckpointManager(tmp_path, keep_last=1, retain_interval=0, async_save=False)
    manager.save(1, model=model, optimizer=optimizer, trainer_state={"step": 1})
    assert manager.load("latest", model=model, optimizer=optimizer)["step"] == 1
    assert not [w for w in recwarn if "torch.distributed is disabled" in str(w.message)]
