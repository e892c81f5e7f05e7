"""Checkpoint save/resume: retention, failed saves, bad checkpoints, bf16 optimizer states."""

import shutil

import pytest
import torch
from conftest import job
from torch.distributed.checkpoint import FileSystemReader

from graphtrain.checkpoint import CheckpointSaveError, complete_checkpoints, to_delete
from graphtrain.config import load_config
from graphtrain.trainer import train


def _names(run_dir):
    return [p.name for p in complete_checkpoints(run_dir)]


def test_retention_keeps_the_last_and_the_retained_steps(tmp_path):
    root = tmp_path / "checkpoints"
    paths = [root / f"step-{s:07d}" for s in (2, 4, 6, 8, 10, 12)]
    gone = to_delete(paths, keep_last=2, retain_interval=4)
    assert [p.name for p in gone] == ["step-0000002", "step-0000006"]
    assert to_delete(paths, keep_last=3, retain_interval=0) == paths[:3]


def test_training_with_retention_and_bf16_states_resumes_exactly(corpus, tmp_path):
    """Saves at 2, 4, 6, 8 with keep_last=2, retain_interval=4 leave exactly 4, 6, 8; resuming
    from 4 with bf16 moments (stored as bf16) reproduces the straight run bitwise."""
    bf16 = "--optim.state_dtype=bfloat16"
    straight = train(load_config(job(corpus, tmp_path / "s", "--training.steps=8", bf16)))
    args = job(
        corpus,
        tmp_path / "r",
        "--training.steps=8",
        bf16,
        "--checkpoint.interval=2",
        "--checkpoint.keep_last=2",
        "--checkpoint.retain_interval=4",
    )
    first = train(load_config(args))
    run = tmp_path / "r" / "run"
    assert _names(run) == ["step-0000004", "step-0000006", "step-0000008"]
    meta = FileSystemReader(str(run / "checkpoints" / "step-0000004")).read_metadata()
    state = meta.state_dict_metadata["optim.state.layers.0.attention.wq.weight.exp_avg"]
    assert state.properties.dtype == torch.bfloat16
    resumed = train(load_config([*args, "--checkpoint.resume=step-0000004"]))
    assert first.losses == straight.losses
    assert resumed.losses == straight.losses[4:]


def test_a_checkpoint_with_indexed_optimizer_groups_still_resumes(corpus, tmp_path, monkeypatch):
    """Checkpoints saved before the optimizer groups were keyed by parameter name
    ("optim.param_groups.0.lr") load as saved and continue the run bitwise."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    straight = train(load_config(job(corpus, tmp_path / "s", "--training.steps=4")))
    args = job(corpus, tmp_path / "r", "--training.steps=4", "--checkpoint.interval=2")
    with monkeypatch.context() as m:
        m.setattr("graphtrain.checkpoint.manager._BY_NAME", StateDictOptions())
        train(load_config(args))
    ckpt = tmp_path / "r" / "run" / "checkpoints" / "step-0000002"
    keys = FileSystemReader(str(ckpt)).read_metadata().state_dict_metadata
    assert "optim.param_groups.0.lr" in keys
    shutil.rmtree(ckpt.with_name("step-0000004"))
    resumed = train(load_config([*args, "--checkpoint.resume=latest"]))
    assert resumed.losses == straight.losses[2:]
    keys = FileSystemReader(str(ckpt.with_name("step-0000004"))).read_metadata()
    assert "optim.param_groups.0.lr" not in keys.state_dict_metadata


def test_a_failed_save_keeps_the_previous_checkpoint_and_says_so(corpus, tmp_path, monkeypatch):
    import torch.distributed.checkpoint as dcp

    real_save = dcp.save

    def save(state, checkpoint_id):
        if checkpoint_id.endswith("step-0000004.tmp"):
            raise OSError(28, "No space left on device")
        return real_save(state, checkpoint_id=checkpoint_id)

    monkeypatch.setattr("graphtrain.checkpoint.manager.dcp.save", save)
    args = job(corpus, tmp_path, "--training.steps=4", "--checkpoint.interval=2")
    with pytest.raises(CheckpointSaveError) as e:
        train(load_config(args))
    msg = str(e.value)
    assert "step-0000004" in msg and "No space left on device" in msg
    assert "previous checkpoint" in msg and "step-0000002 is intact" in msg
    run = tmp_path / "run"
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step-0000002"]
    monkeypatch.setattr("graphtrain.checkpoint.manager.dcp.save", real_save)
    resumed = train(load_config([*args, "--checkpoint.resume=latest"]))
    assert len(resumed.losses) == 2


@pytest.fixture(scope="module")
def saved_run(corpus, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("saved")
    args = job(corpus, tmp, "--training.steps=3", "--checkpoint.interval=3")
    train(load_config(args))
    return tmp / "run", args


def test_a_checkpoint_of_another_shape_names_keys_and_shapes(saved_run, tmp_path):
    run, args = saved_run
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    args = [a for a in args if not a.startswith("--training.run_dir")]
    bad = [*args, f"--training.run_dir={copy}", "--checkpoint.resume=latest", "--model.ffn_dim=96"]
    with pytest.raises(ValueError, match="does not fit the model") as e:
        train(load_config(bad))
    assert "model.layers.0.feed_forward.w1.weight: model (96, 64), checkpoint" in str(e.value)
    assert "(160, 64)" in str(e.value)
    # A few tensors and the count, not every tensor of the model.
    assert "shapes differ in 6 tensors: " in str(e.value) and " and 3 more" in str(e.value)
    assert len(str(e.value)) < 800


@pytest.mark.parametrize(
    "damage", ["truncate_shard", "garble_shard", "garble_metadata", "truncate_trainer"]
)
def test_a_damaged_checkpoint_is_reported(saved_run, tmp_path, damage):
    run, args = saved_run
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    ckpt = copy / "checkpoints" / "step-0000003"
    if damage == "truncate_shard":
        f = ckpt / "__0_0.distcp"
        f.write_bytes(f.read_bytes()[:-100])
        match = r"truncated or damaged: __0_0.distcp was written with \d+ bytes but is \d+ bytes"
    elif damage == "garble_shard":  # the same size: its digest differs
        f = ckpt / "__0_0.distcp"
        data = f.read_bytes()
        f.write_bytes(data[:-3000] + b"\0" * 3000)
        match = "__0_0.distcp is corrupted: its SHA-256 differs"
    elif damage == "garble_metadata":
        f = ckpt / ".metadata"
        f.write_bytes(b"\0" * f.stat().st_size)
        match = ".metadata is corrupted: its SHA-256 differs"
    else:
        f = ckpt / "trainer-rank0.pt"
        f.write_bytes(f.read_bytes()[:50])
        match = r"trainer-rank0.pt was written with \d+ bytes but is 50 bytes"
    args = [a for a in args if not a.startswith("--training.run_dir")]
    config = (copy / "config.toml").read_text()
    with pytest.raises(ValueError, match=match):
        train(
            load_config(
                [
                    *args,
                    f"--training.run_dir={copy}",
                    "--checkpoint.resume=latest",
                    "--model.rope_theta=1234.0",
                ]
            )
        )
    # The failed start left the run's description alone (export reads it).
    assert (copy / "config.toml").read_text() == config


def test_a_wrong_resume_name_stops_before_any_work_and_keeps_the_config(saved_run, tmp_path):
    run, args = saved_run
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    config = (copy / "config.toml").read_text()
    args = [a for a in args if not a.startswith("--training.run_dir")]
    bad = [*args, f"--training.run_dir={copy}", "--model.rope_theta=1234.0"]
    with pytest.raises(ValueError, match="'step-0000099' is not a complete checkpoint"):
        train(load_config([*bad, "--checkpoint.resume=step-0000099"]))
    with pytest.raises(ValueError, match="is not a complete checkpoint folder"):
        train(load_config([*bad, f"--checkpoint.resume={copy / 'checkpoints' / 'step-9.tmp'}"]))
    assert (copy / "config.toml").read_text() == config


def test_another_runs_checkpoint_continues_in_an_empty_run_dir(saved_run, tmp_path, caplog):
    """resume=<path of a checkpoint folder> forks a run; a changed model key is named in the
    log; a run dir with checkpoints of its own is refused (its saves would be replaced)."""
    run, args = saved_run
    args = [a for a in args if not a.startswith("--training.run_dir")]
    ckpt = run / "checkpoints" / "step-0000003"
    fork = [
        *args,
        f"--training.run_dir={tmp_path / 'fork'}",
        f"--checkpoint.resume={ckpt}",
        "--training.steps=4",
        "--model.rope_theta=1234.0",
    ]
    with caplog.at_level("WARNING", logger="graphtrain"):
        result = train(load_config(fork))
    assert len(result.losses) == 1  # step 4 only
    assert "model.rope_theta: 10000.0 -> 1234.0" in caplog.text
    assert _names(tmp_path / "fork") == ["step-0000004"]
    with pytest.raises(ValueError, match=r"already holds checkpoints .* in an empty training"):
        train(load_config(fork))


def test_every_written_file_and_both_folders_are_fsynced(tmp_path, monkeypatch):
    """Durability: the data reaches the disk before the rename marks the checkpoint complete."""
    import os

    from graphtrain.checkpoint import CheckpointManager

    synced = []
    real_fsync = os.fsync

    def fsync(fd):
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        real_fsync(fd)

    monkeypatch.setattr("graphtrain.checkpoint.manager.os.fsync", fsync)
    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 4)).sum().backward()
    optimizer.step()
    manager = CheckpointManager(tmp_path, keep_last=1, retain_interval=0, async_save=False)
    manager.save(1, model=model, optimizer=optimizer, trainer_state={"step": 1})
    final = tmp_path / "checkpoints" / "step-0000001"
    tmp = final.with_name(final.name + ".tmp")
    files = sorted(p.name for p in final.iterdir())
    assert ".metadata" in files and "trainer-rank0.pt" in files
    # DCP syncs its shards under their final names (.metadata via .metadata.tmp), we the rest.
    synced_names = {
        os.path.basename(p).removesuffix(".tmp") for p in synced if p.startswith(f"{tmp}/")
    }
    assert set(files) <= synced_names, (files, synced_names)
    assert str(tmp) in synced and str(final.parent) in synced
    assert synced.index(str(tmp)) < synced.index(str(final.parent))
