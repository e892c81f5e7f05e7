"""Every checkpoint file's SHA-256 is recorded at save (off the training thread when the save is
async) and verified on load: 16 overwritten bytes inside a shard are caught, naming the file and
the previous intact checkpoint, and resume=latest falls back to that one when asked."""

import threading

import pytest
import torch
from conftest import job

from graphtrain.checkpoint import CheckpointCorruptError, CheckpointManager
from graphtrain.checkpoint.integrity import file_digest
from graphtrain.config import load_config
from graphtrain.trainer import train


def test_overwritten_bytes_in_a_shard_are_caught_and_latest_can_fall_back(corpus, tmp_path):
    args = job(corpus, tmp_path, "--training.steps=4", "--checkpoint.interval=2")
    first = train(load_config(args))
    ckpts = tmp_path / "run" / "checkpoints"
    shard = ckpts / "step-0000004" / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    middle = len(data) // 2  # inside the tensor data, far from DCP's per-tensor headers
    data[middle : middle + 16] = bytes(16)
    shard.write_bytes(bytes(data))

    resume = [*args, "--checkpoint.resume=latest"]
    with pytest.raises(CheckpointCorruptError) as e:
        train(load_config(resume))
    message = str(e.value)
    assert "__0_0.distcp is corrupted: its SHA-256 differs" in message
    assert f"the previous intact checkpoint is {ckpts / 'step-0000002'}" in message
    assert "\n" not in message and "Traceback" not in message

    resumed = train(load_config([*resume, "--checkpoint.fallback_on_corruption=true"]))
    assert resumed.losses == first.losses[2:]
    # The damaged step was written again by the resumed run, intact.
    train_state = torch.load(ckpts / "step-0000004" / "trainer-rank0.pt", weights_only=True)
    assert train_state["files"]["__0_0.distcp"]["sha256"] == file_digest(shard)


def test_async_save_hashes_on_a_background_thread(tmp_path, monkeypatch):
    threads = []

    def digest(path):
        threads.append((path.name, threading.current_thread().name))
        return file_digest(path)

    monkeypatch.setattr("graphtrain.checkpoint.integrity.file_digest", digest)
    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.AdamW(model.parameters())
    manager = CheckpointManager(tmp_path, keep_last=1, retain_interval=0, async_save=True)
    manager.save(1, model=model, optimizer=optimizer, trainer_state={"step": 1})
    manager.wait()
    ckpt = tmp_path / "checkpoints" / "step-0000001"
    files = torch.load(ckpt / "trainer-rank0.pt", weights_only=True)["files"]
    assert set(files) == {".metadata", "__0_0.distcp"}
    assert all(files[name]["sha256"] == file_digest(ckpt / name) for name in files)
    # DCP's files on the background thread; the small trainer file (for checksums.json) after.
    dcp_files = [thread for name, thread in threads if name in files]
    assert len(dcp_files) == 2 and all(t.startswith("ckpt-digest") for t in dcp_files)
