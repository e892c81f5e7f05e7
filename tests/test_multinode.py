"""Two torchrun "nodes" on localhost (NNODES=2, NODE_RANK=0/1, one CPU process each, gloo, c10d
rendezvous), started through launch.sh with the README's own command lines, follow the loss of
a single process (same global batch: 2 ranks x 2 rows = 1 x 4 rows)."""

import json
import re
import shlex
import socket
import subprocess
from pathlib import Path

import pytest
from conftest import job, launch_env

from graphtrain.config import load_config
from graphtrain.trainer import train

REPO = Path(__file__).resolve().parent.parent


def _readme_node_lines() -> list[str]:
    """The two `NNODES=2 ... ./launch.sh` lines of the README's CPU rehearsal block."""
    text = (REPO / "README.md").read_text()
    lines = re.findall(r"^NNODES=2 NODE_RANK=\d MASTER_ADDR=localhost .*$", text, re.MULTILINE)
    assert len(lines) == 2, lines
    return [line.removesuffix("&").strip() for line in lines]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


@pytest.mark.slow  # two torchrun nodes and a single-process run (~40 s on 2 busy cores)
def test_two_nodes_through_launch_sh_follow_one_process(corpus, tmp_path):
    # eager: the launch and the rendezvous are under test (compiled layouts: tests/parallel)
    common = ["--training.steps=4", "--metrics.log_interval=1", "--metrics.val_interval=0",
              "--compile.enable=false"]  # fmt: skip
    single = train(load_config(job(corpus, tmp_path / "one", *common)))
    extra = job(corpus, tmp_path / "two", *common)[2:]  # the README line has the preset
    port = str(_free_port())
    env = launch_env(tmp_path)
    nodes = []
    for line in _readme_node_lines():
        words = shlex.split(line)
        settings = dict(w.split("=", 1) for w in words if re.match(r"^[A-Z_]+=", w))
        command = words[len(settings) :]
        assert command[0] == "./launch.sh"
        nodes.append(
            subprocess.Popen(
                ["bash", str(REPO / "launch.sh"), *command[1:], *extra],
                env={**env, **settings, "MASTER_PORT": port},
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    outputs = [node.communicate(timeout=300)[0] for node in nodes]
    assert [node.returncode for node in nodes] == [0, 0], outputs
    metrics = (tmp_path / "two" / "run" / "metrics.jsonl").read_text().splitlines()
    losses = [m["loss"] for m in map(json.loads, metrics) if "loss" in m]
    # As in test_trainer's two-process test: fp32, another reduction order (rel 1e-3).
    assert losses == pytest.approx(single.losses, rel=1e-3)
