"""A training process SIGKILLed while it saves loses nothing but the save in flight; a run saved
on 2 ranks (FSDP, dp_shard=2; or an MoE model with tp=2) resumes on 1 process."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import job, torchrun_metrics

from graphtrain.checkpoint import complete_checkpoints
from graphtrain.config import load_config
from graphtrain.trainer import train

HOOK = Path(__file__).parent / "pause_save"


def test_kill_during_save_resumes_from_the_previous_checkpoint(corpus, tmp_path):
    steps = ["--training.steps=6", "--checkpoint.interval=2"]
    args = job(corpus, tmp_path, *steps)
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(HOOK), os.environ.get("PYTHONPATH", "")]),
        "GRAPHTRAIN_TEST_PAUSE_SAVE": "step-0000004.tmp",
        "OMP_NUM_THREADS": "1",
    }
    proc = subprocess.Popen(
        [sys.executable, "-m", "graphtrain", "train", *args],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    ckpts = tmp_path / "run" / "checkpoints"
    paused = ckpts / "step-0000004.tmp" / "paused"
    deadline = time.monotonic() + 120
    while not paused.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    assert paused.exists(), f"the save never paused (exit code {proc.poll()})"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert (ckpts / "step-0000004.tmp").is_dir()  # the save in flight, left half-done
    assert [p.name for p in complete_checkpoints(tmp_path / "run")] == ["step-0000002"]

    straight = train(load_config(job(corpus, tmp_path / "s", "--training.steps=6")))
    resumed = train(load_config([*args, "--checkpoint.resume=latest"]))
    assert resumed.losses == straight.losses[2:]
    # The next save removed the stale folder; the run ended with its own complete checkpoints.
    assert sorted(p.name for p in ckpts.iterdir()) == ["step-0000004", "step-0000006"]


def test_resume_on_fewer_ranks_than_saved(corpus, tmp_path):
    """Saved by 2 processes (FSDP over dp_shard=2, bf16 moments) at step 4 of 6, resumed by 1.

    The global batch (4 rows) and the data order are the same, so the resumed losses follow a
    single-process run; tolerance 1e-3 relative as for the 2-rank curve in test_trainer.py (the
    2-rank steps average per-rank means and reduce in another order)."""
    common = ["--optim.state_dtype=bfloat16", "--metrics.log_interval=1"]
    single = train(
        load_config(
            job(
                corpus,
                tmp_path / "one",
                "--training.steps=6",
                "--training.micro_batch_size=4",
                *common,
            )
        )
    )
    two = job(
        corpus,
        tmp_path / "two",
        "--training.steps=6",
        "--parallel.dp_shard=2",
        "--training.micro_batch_size=2",
        "--checkpoint.interval=4",
        *common,
    )
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    out = subprocess.run(
        [*launcher, "-m", "graphtrain", "train", *two],
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        timeout=300,
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    run = tmp_path / "two" / "run"
    saved = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    saved_losses = [x["loss"] for x in saved if "loss" in x][:4]
    shutil.rmtree(run / "checkpoints" / "step-0000006")  # continue from step 4
    one = [a for a in two if not a.startswith(("--parallel", "--training.micro"))]
    resumed = train(
        load_config([*one, "--training.micro_batch_size=4", "--checkpoint.resume=latest"])
    )
    for a, b in zip(single.losses, saved_losses + resumed.losses, strict=True):
        assert b == pytest.approx(a, rel=1e-3)


def test_moe_saved_with_tensor_parallel_resumes_on_one_rank(corpus, tmp_path):
    """tp=2 leaves the MoE layers plain tensors beside the DTensors, so the optimizer has more
    parameter groups there than on 1 rank: the hyperparameters are saved per parameter name and
    the resumed steps equal the 2-rank run's own (no aux losses: those are per sequence slice
    under tp, so they would differ)."""
    args = job(
        corpus,
        tmp_path,
        "--preset",
        "moe-debug",
        "--training.steps=6",
        "--checkpoint.interval=4",
        "--metrics.log_interval=1",
        *(
            f"--model.{k}=0"
            for k in ("aux_loss_coef", "seq_aux_loss_coef", "global_aux_loss_coef", "z_loss_coef")
        ),
    )
    lines = torchrun_metrics(2, [*args, "--parallel.tp=2"])
    two = [x["loss"] for x in lines if "loss" in x]
    shutil.rmtree(tmp_path / "run" / "checkpoints" / "step-0000006")  # continue from step 4
    resumed = train(load_config([*args, "--checkpoint.resume=latest"]))
    assert resumed.losses == pytest.approx(two[4:], rel=1e-5)
