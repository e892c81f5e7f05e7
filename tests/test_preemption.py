"""SIGTERM/SIGINT: the ranks agree to stop after the step in progress, save it and exit with
EXIT_PREEMPTED; the run resumes exactly; a second signal stops at once."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import job, launch_env, rank_jobs

from graphtrain.checkpoint import complete_checkpoints
from graphtrain.checkpoint.manager import step_of
from graphtrain.preemption import EXIT_PREEMPTED

_TWICE = """
import os, signal, sys
from graphtrain.preemption import PreemptionHandler
handler = PreemptionHandler().install()
os.kill(os.getpid(), signal.SIG{name})
assert handler.should_stop(), "the first signal only sets the flag"
print("first signal noted", flush=True)
os.kill(os.getpid(), signal.SIG{name})
print("still running after the second signal", flush=True)
"""


def test_a_second_signal_stops_at_once():
    for name in ("TERM", "INT"):
        proc = subprocess.run(
            [sys.executable, "-c", _TWICE.format(name=name)],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert proc.returncode == -getattr(signal, f"SIG{name}"), proc.stderr
        assert proc.stdout == "first signal noted\n"
        assert f"SIG{name}: finishing this step" in proc.stderr


def _worker(parent: int, rank: int) -> int | None:
    """The pid of the torchrun worker of `rank` under process `parent`, if it runs yet."""
    for child in Path(f"/proc/{parent}/task/{parent}/children").read_text().split():
        try:
            env = Path(f"/proc/{child}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"RANK={rank}".encode() in env:
            return int(child)
    return None


@pytest.mark.slow  # a torchrun launch, then two jobs on forked ranks (conftest.rank_jobs)
def test_sigterm_to_one_rank_saves_on_every_rank_and_resumes_exactly(corpus, tmp_path):
    """A real SIGTERM to rank 1 only of a 2-rank gloo job (FSDP over dp_shard=2) while it
    trains: both ranks stop after the same step, save it, exit 75; resuming from it gives the
    loss curve of the run that was never interrupted."""
    steps = ["--training.steps=12", "--metrics.log_interval=1", "--metrics.val_interval=0"]
    args = job(corpus, tmp_path / "p", *steps, "--checkpoint.interval=100")
    metrics = tmp_path / "p" / "run" / "metrics.jsonl"
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    proc = subprocess.Popen(
        [*launch, "-m", "graphtrain", "train", *args],
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and proc.poll() is None:
        logged = metrics.read_text().count('"loss"') if metrics.exists() else 0
        if logged >= 3:
            os.kill(_worker(proc.pid, 1), signal.SIGTERM)
            break
        time.sleep(0.05)
    output = proc.communicate(timeout=240)[0]
    assert f"exitcode  : {EXIT_PREEMPTED}" in output, output[-3000:]

    (ckpt,) = complete_checkpoints(tmp_path / "p" / "run")
    stopped = step_of(ckpt)
    assert 3 <= stopped < 12
    assert f"stopped by a signal after step {stopped}; saved checkpoint {ckpt}" in output
    before = [e["loss"] for e in map(json.loads, metrics.read_text().splitlines()) if "loss" in e]
    assert len(before) == stopped

    after, straight = rank_jobs(
        2, [[*args, "--checkpoint.resume=latest"], job(corpus, tmp_path / "s", *steps)]
    )
    resumed = [e["loss"] for e in after if "loss" in e][-(12 - stopped) :]
    assert before + resumed == [e["loss"] for e in straight if "loss" in e]


def test_sigterm_during_start_up_says_so_and_exits_75(corpus, tmp_path):
    """Before the loop's handler (building the model, the first validation) a SIGTERM stops at
    once with one line, not a silent death by the default action."""
    args = job(corpus, tmp_path, "--training.steps=50", "--metrics.validate=true")
    proc = subprocess.Popen(
        [sys.executable, "-m", "graphtrain", "train", *args],
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    lines = []
    for line in proc.stdout:  # the memory plan is logged as the build starts
        lines.append(line)
        if "predicted memory per rank" in line:
            proc.send_signal(signal.SIGTERM)
            break
    output = "".join(lines) + proc.communicate(timeout=120)[0]
    assert proc.returncode == EXIT_PREEMPTED, output[-3000:]
    assert "graphtrain: SIGTERM during start-up, before the first step: stopped" in output
    assert "Traceback" not in output
    assert not complete_checkpoints(tmp_path / "run")


def _launch_sh(tmp_path: Path, args: list[str], port: str) -> subprocess.Popen:
    """launch.sh with NGPU=2 on this interpreter (conftest.launch_env)."""
    repo = Path(__file__).resolve().parent.parent
    return subprocess.Popen(
        ["bash", str(repo / "launch.sh"), *args],
        env={**launch_env(tmp_path), "NGPU": "2", "MASTER_PORT": port},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def _after_losses(proc: subprocess.Popen, metrics: Path, count: int) -> None:
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and proc.poll() is None:
        if metrics.exists() and metrics.read_text().count('"loss"') >= count:
            return
        time.sleep(0.05)


@pytest.mark.slow  # two launches of two ranks through launch.sh
def test_two_rank_preemption_through_launch_sh_exits_75_and_a_dead_rank_is_one_line(
    corpus, tmp_path
):
    """SIGTERM to launch.sh (torchrun's process) while two CPU ranks train: they save and
    launch.sh exits 75, without torchrun's failure report. Resumed, a SIGKILL of rank 1: rank 0
    says in one line which checkpoint to continue from, no gloo traceback."""
    args = job(corpus, tmp_path, "--training.steps=40", "--metrics.log_interval=1")
    args += ["--training.device=cpu", "--metrics.val_interval=0", "--checkpoint.interval=100"]
    args += ["--compile.enable=false"]  # signals and saves: the compiled run's are tested above
    metrics = tmp_path / "run" / "metrics.jsonl"
    proc = _launch_sh(tmp_path, args, str(29600 + os.getpid() % 300))
    _after_losses(proc, metrics, 3)
    proc.send_signal(signal.SIGTERM)
    output = proc.communicate(timeout=240)[0]
    assert proc.returncode == EXIT_PREEMPTED, output[-3000:]
    (ckpt,) = complete_checkpoints(tmp_path / "run")
    assert f"stopped by a signal after step {step_of(ckpt)}; saved checkpoint {ckpt}" in output
    assert "Traceback" not in output and "FAILED" not in output, output[-3000:]
    # torch 2.11's torchrun has no --shutdown-timeout: its fixed 30 s beside the estimate
    assert (
        "the ranks get 120 s to finish the step and save" in output
        or "gives the ranks 30 s to finish the step and save, where this checkpoint's estimate "
        "is 120 s"
        in output
    )

    proc = _launch_sh(
        tmp_path, [*args, "--checkpoint.resume=latest"], str(29900 + os.getpid() % 99)
    )
    _after_losses(proc, metrics, step_of(ckpt) + 2)
    os.kill(_worker(proc.pid, 1), signal.SIGKILL)
    output = proc.communicate(timeout=240)[0]
    assert proc.returncode == 1, output[-3000:]
    assert (
        "graphtrain: stopped: rank 0 lost contact with another rank" in output
        and f"the newest complete checkpoint is {ckpt}: continue with --checkpoint.resume=latest"
        in output
    ), output[-3000:]
    assert "Traceback" not in output, output[-3000:]
    assert "launch: rank 1 stopped with signal SIGKILL" in output


def test_torchrun_without_shutdown_timeout_says_its_grace(monkeypatch, capsys):
    """torch 2.11's torchrun has no --shutdown-timeout (a fixed 30 s after a signal): the
    launcher says so beside this run's estimate instead of failing on the missing option, and
    SHUTDOWN_TIMEOUT is refused with the reason. With the option (torch 2.13), the estimate is
    what torchrun gets."""
    import torch.distributed.run as torchrun

    from graphtrain import preemption

    launched = []
    monkeypatch.setattr(torchrun, "run", launched.append)  # no ranks: the namespace it gets
    args = ["--nnodes", "1", "--nproc-per-node", "2", "-m", "graphtrain", "train", "--preset",
            "debug", "--training.device=cpu"]  # fmt: skip
    monkeypatch.delenv("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", raising=False)
    real_parse = torchrun.parse_args
    if preemption._torchrun_takes_shutdown_timeout():
        assert preemption.run_torchrun(args) == 0
        assert launched.pop().shutdown_timeout >= 120  # the estimate, at least the minimum
        assert "the ranks get 1" in capsys.readouterr().err

    def parse_as_2_11(argv):
        ns = real_parse(argv)
        if hasattr(ns, "shutdown_timeout"):
            del ns.shutdown_timeout
        return ns

    monkeypatch.setattr(torchrun, "parse_args", parse_as_2_11)
    monkeypatch.setattr(preemption, "_torchrun_takes_shutdown_timeout", lambda: False)
    assert preemption.run_torchrun(args) == 0
    assert not hasattr(launched[-1], "shutdown_timeout")
    err = capsys.readouterr().err
    assert "torchrun gives the ranks 30 s" in err and "this checkpoint's estimate is" in err
    assert preemption.run_torchrun(["--shutdown-timeout", "600", *args]) == 2
    assert "SHUTDOWN_TIMEOUT needs a torchrun with --shutdown-timeout" in capsys.readouterr().err
    assert len(launched) == 1


def test_a_ranks_own_gloo_failure_is_not_a_lost_peer():
    """gloo's texts as seen on two CPU ranks: a peer gone (a connection reset or closed, on a
    plain RuntimeError or a DistError) is a lost peer, reported in one line; an enforce that
    failed with the connections up (torch 2.11's self send) is this rank's own error."""
    from torch.distributed import DistBackendError

    from graphtrain.preemption import looks_like_lost_peer

    gone = "[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:547] Connection closed by peer"
    reset = (
        "[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:538] Read error: Connection reset"
    )
    own = ("[enforce fail at /pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:789] state_ >= "
           "CONNECTED. 1 vs 4. Pair is not connected ([127.0.0.1]:34705$1 <--> [none])")  # fmt: skip
    for error in (RuntimeError(gone), RuntimeError(reset), DistBackendError(gone)):
        assert looks_like_lost_peer(error), error
    for error in (RuntimeError(own), DistBackendError(own), ValueError("gloo")):
        assert not looks_like_lost_peer(error), error
