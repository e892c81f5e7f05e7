"""A training process SIGKILLed while it saves loses nothing but the save in flight; a run saved
on 2 ranks (FSDP, dp_shard=2; or an MoE model with tp=2) resumes on 1 process."""

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import job, rank_jobs

from graphtrain.checkpoint import complete_checkpoints
from graphtrain.config import load_config
from graphtrain.trainer import train

HOOK = Path(__file__).parent / "pause_save"


def test_kill_during_save_resumes_from_the_previous_checkpoint(
    corpus, tmp_path, straight_six_steps
):
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

    resumed = train(load_config([*args, "--checkpoint.resume=latest"]))
    assert resumed.losses == straight_six_steps.losses[2:]
    # The next save removed the stale folder; the run ended with its own complete checkpoints.
    assert sorted(p.name for p in ckpts.iterdir()) == ["step-0000004", "step-0000006"]


_STEPS = "--training.steps=6"
_SAVE = "--checkpoint.interval=4"
# Saved by 2 processes: FSDP over dp_shard=2 with bf16 moments; an MoE model with tp=2 (no aux
# losses: those are per sequence slice under tp, so they would differ from one rank's). Eager:
# the checkpoints' layouts are under test (compiled layouts: tests/parallel).
_EAGER = "--compile.enable=false"
_FSDP = ("--optim.state_dtype=bfloat16", "--metrics.log_interval=1", _EAGER)
_FSDP_TWO = ("--parallel.dp_shard=2", "--training.micro_batch_size=2")
_MOE = (
    "--preset",
    "moe-debug",
    "--metrics.log_interval=1",
    _EAGER,
    *(
        f"--model.{k}=0"
        for k in ("aux_loss_coef", "seq_aux_loss_coef", "global_aux_loss_coef", "z_loss_coef")
    ),
)


@pytest.fixture(scope="module")
def saved_on_two_ranks(corpus, tmp_path_factory) -> dict[str, tuple[list[str], list[float]]]:
    """(one-process arguments of the run dir, losses logged by the 2 ranks) of the FSDP and the
    MoE tp=2 runs, both trained in one launch (conftest.rank_jobs), each with a checkpoint at
    step 4 of 6."""
    tmp = tmp_path_factory.mktemp("two_ranks")
    one = {
        "fsdp": job(corpus, tmp / "fsdp", _STEPS, _SAVE, *_FSDP),
        "moe_tp": job(corpus, tmp / "moe", *_MOE, _STEPS, _SAVE),
    }
    two = {"fsdp": [*one["fsdp"], *_FSDP_TWO], "moe_tp": [*one["moe_tp"], "--parallel.tp=2"]}
    runs = rank_jobs(2, list(two.values()))
    return {
        name: (one[name], [x["loss"] for x in lines if "loss" in x])
        for name, lines in zip(two, runs, strict=True)
    }


def _resume_on_one_process(args: list[str], *extra: str):
    """The run of `args` resumed from its step-4 checkpoint by one process."""
    run = next(a.split("=", 1)[1] for a in args if a.startswith("--training.run_dir="))
    shutil.rmtree(Path(run) / "checkpoints" / "step-0000006")  # continue from step 4
    return train(load_config([*args, *extra, "--checkpoint.resume=latest"]))


def test_resume_on_fewer_ranks_than_saved(corpus, tmp_path, saved_on_two_ranks):
    """Saved by 2 processes (FSDP over dp_shard=2, bf16 moments) at step 4 of 6, resumed by 1.

    The global batch (4 rows) and the data order are the same, so the resumed losses follow a
    single-process run; tolerance 1e-3 relative as for the 2-rank curve in test_trainer.py (the
    2-rank steps average per-rank means and reduce in another order)."""
    args, two = saved_on_two_ranks["fsdp"]
    mb = "--training.micro_batch_size=4"
    single = train(load_config(job(corpus, tmp_path / "one", _STEPS, mb, *_FSDP)))
    resumed = _resume_on_one_process(args, mb)
    for a, b in zip(single.losses, two[:4] + resumed.losses, strict=True):
        assert b == pytest.approx(a, rel=1e-3)


def test_moe_saved_with_tensor_parallel_resumes_on_one_rank(saved_on_two_ranks):
    """tp=2 leaves the MoE layers plain tensors beside the DTensors, so the optimizer has more
    parameter groups there than on 1 rank: the hyperparameters are saved per parameter name and
    the resumed steps equal the 2-rank run's own."""
    args, two = saved_on_two_ranks["moe_tp"]
    resumed = _resume_on_one_process(args)
    assert resumed.losses == pytest.approx(two[4:], rel=1e-5)
