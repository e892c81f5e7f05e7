"""Shared fixtures: a small synthetic corpus with its tokenizer, the argv of a debug job on it
(used by the trainer and checkpoint tests), and a torchrun launcher for multi-rank jobs."""

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

from graphtrain.data.tokenizer import train_bpe_tokenizer


@pytest.fixture(scope="session")
def corpus(tmp_path_factory):
    """Documents of a toy language (learnable quickly), and a 300-token BPE tokenizer for it."""
    root = tmp_path_factory.mktemp("corpus")
    rng = random.Random(0)
    words = ["alpha", "beta", "gamma", "delta", "omega", "sigma", "kappa", "theta"]
    docs = []
    for i in range(400):
        n = rng.randint(5, 60)
        start = rng.randrange(len(words))
        # Mostly a fixed cycle through the words: a model can learn to predict the next one.
        docs.append(
            " ".join(
                words[(start + k) % len(words)] if rng.random() < 0.9 else rng.choice(words)
                for k in range(n)
            )
            + f" end{i % 3}."
        )
    with open(root / "docs.jsonl", "w") as f:
        for d in docs:
            f.write(json.dumps({"text": d}) + "\n")
    tok = train_bpe_tokenizer(docs, 300)
    tok.save(str(root / "tokenizer.json"))
    return root


def job(corpus: Path, tmp_path: Path, *extra: str) -> list[str]:
    return [
        "--preset",
        "debug",
        f"--data.paths={corpus / 'docs.jsonl'}",
        f"--data.tokenizer={corpus / 'tokenizer.json'}",
        f"--data.cache_dir={tmp_path / 'cache'}",
        f"--training.run_dir={tmp_path / 'run'}",
        "--compile.backend=aot_eager",
        "--metrics.tensorboard=false",
        *extra,
    ]


def torchrun_metrics(nproc: int, args: list[str]) -> list[dict]:
    """Run `graphtrain train ARGS` on nproc CPU ranks (gloo); the lines of its metrics.jsonl."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc-per-node={nproc}",
            "-m",
            "graphtrain",
            "train",
            *args,
        ],
        check=True,
        env=env,
        timeout=300,
        capture_output=True,
    )
    run_dir = next(a.split("=", 1)[1] for a in args if a.startswith("--training.run_dir="))
    return [json.loads(x) for x in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
