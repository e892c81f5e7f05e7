"""Shared fixtures: a small synthetic corpus with its tokenizer, the argv of a debug job on it
(used by the trainer and checkpoint tests), a launcher of multi-rank jobs, launch.sh's
environment, a one-rank gloo group, the TRITON_INTERPRET=1 subprocess the kernel tests run,
and for the pass tests a Dynamo graph as a pass receives it, a pass's entry in a graph dump and
a module's gradients, eager or compiled."""

import json
import os
import random
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from parallel_dist import scalar_cpu_kernels

from graphtrain.compile import backend
from graphtrain.data.tokenizer import train_bpe_tokenizer

# Under pytest-xdist (./launch.sh test: two workers on CI's two cores, beside the multi-rank
# tests' rank processes) each test process computes on one thread, and so do the processes it
# starts. With torch's default of one OpenMP thread per core, the cores are oversubscribed and
# OpenMP's spin-waiting threads slow every process down: a CPU-bound test took 132 s instead
# of 14 s with two busy processes beside it (measured, 2 cores).
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
# Inductor's CPU kernels without SIMD, in every test process (the docstring says why).
scalar_cpu_kernels()
# The processes the tests start (torchrun's ranks, launch.sh, the CLI) print every thread's
# Python stack if a fatal signal kills them, as the forked ranks do (parallel_dist, train_jobs):
# a rank's rare SIGABRT at exit (gloo, "terminate called without an active exception") then
# says where it was.
os.environ.setdefault("PYTHONFAULTHANDLER", "1")


def pytest_collection_modifyitems(config, items):
    """Markers `gpu` and `multigpu` (pyproject.toml) skip their tests where the CUDA GPUs
    they need are missing, so that no test file repeats the check."""
    gpus = torch.cuda.device_count()
    for item in items:
        if item.get_closest_marker("gpu") and gpus < 1:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU"))
        if item.get_closest_marker("multigpu") and gpus < 2:
            item.add_marker(pytest.mark.skip(reason=f"needs 2 CUDA GPUs, found {gpus}"))


@pytest.fixture(scope="session")
def corpus(tmp_path_factory):
    """Documents of a toy language (learnable quickly), and a 300-token BPE tokenizer for it."""
    return make_corpus(tmp_path_factory.mktemp("corpus"))


def make_corpus(root: Path) -> Path:
    """The `corpus` fixture's files (docs.jsonl, tokenizer.json) written into `root`."""
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
        # No held-out loss unless a test asks for it (--metrics.validate=true): its no-grad
        # graphs are ~40% of the compile time of a few-step compiled run.
        "--metrics.validate=false",
        *extra,
    ]


def gloo_runs(schedule: str) -> bool:
    """Whether graphtrain runs the pipeline schedule on CPU ranks with this torch (not the V
    schedules on torch 2.11: tests/parallel/test_pipeline.py's
    test_v_schedules_on_gloo_need_torch_2_12)."""
    from graphtrain.parallel.pipeline.layout import _check_v_schedule_backend

    try:
        _check_v_schedule_backend(schedule, "cpu")
    except ValueError:
        return False
    return True


def rank_jobs(nproc: int, jobs: list[list[str]]) -> list[list[dict]]:
    """Run `graphtrain train ARGS` on nproc CPU ranks (gloo) for each ARGS of `jobs`, one after
    the other, every rank forked from one process that imported the trainer (train_jobs.py: the
    imports cost more than a small job); the lines of each job's metrics.jsonl, in the order of
    `jobs`."""
    script = Path(__file__).resolve().parent / "train_jobs.py"
    # The script's folder comes first on its sys.path, and its tests/models folder would be
    # taken for the `models` package where graphtrain is installed in editable mode: the
    # repository root before it.
    root = str(script.parent.parent)
    pythonpath = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)
    # pyarrow's bundled jemalloc starts a background thread at import, which the ranks' forks
    # would inherit the allocator state of: off.
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": pythonpath,
           "JE_ARROW_MALLOC_CONF": "background_thread:false"}  # fmt: skip
    command = [sys.executable, str(script), str(nproc), json.dumps(jobs)]
    run_dirs = [
        Path(next(a.split("=", 1)[1] for a in args if a.startswith("--training.run_dir=")))
        for args in jobs
    ]
    # A session of its own: on a timeout the ranks go too, not only their parent.
    with subprocess.Popen(
        command,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    ) as proc:
        try:
            out, err = proc.communicate(timeout=300 * len(jobs))
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            raise
    # A rank that died of a signal printed every thread's stack (train_jobs.py): shown whole.
    crash = err.find("Fatal Python error")
    assert proc.returncode == 0, out[-3000:] + (err[crash:][:8000] if crash >= 0 else err[-5000:])
    metrics = []
    for run_dir in run_dirs:
        lines = (run_dir / "metrics.jsonl").read_text().splitlines()
        metrics.append([json.loads(x) for x in lines])
    return metrics


def launch_env(tmp_path: Path, python: str = "") -> dict[str, str]:
    """The environment of a launch.sh run on this interpreter and this checkout that installs
    nothing: VIRTUAL_ENV a stand-in whose python runs this one (or the `python` sh script given)
    and whose install stamp is fresh, this checkout first on PYTHONPATH (launch.sh checks that
    the ranks find it), one OpenMP thread."""
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True, exist_ok=True)
    shim = venv / "bin" / "python"
    shim.write_text(f'#!/bin/sh\n{python}exec "{sys.executable}" "$@"\n')
    shim.chmod(0o755)
    (venv / ".graphtrain-installed").touch()
    repo = str(Path(__file__).resolve().parent.parent)
    return {**os.environ, "VIRTUAL_ENV": str(venv), "PYTHONPATH": repo, "OMP_NUM_THREADS": "1"}


@pytest.fixture
def one_rank_group(tmp_path):
    import torch.distributed as dist

    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _run_python(args: list[str], marker: str, env: dict | None = None) -> None:
    """`python ARGS` must succeed and print `marker` (its last check)."""
    proc = subprocess.run(
        [sys.executable, *args], env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert marker in proc.stdout


def run_interpreter_checks(script: str, marker: str) -> None:
    """Run `python SCRIPT --interpreter-checks` with TRITON_INTERPRET=1 (set before Triton is
    imported, hence a subprocess); it must succeed and print `marker` (its last check)."""
    _run_python([script, "--interpreter-checks"], marker, {**os.environ, "TRITON_INTERPRET": "1"})


def poisoned_model(cfg, seed: int = 0) -> torch.nn.Module:
    """cfg's model (models.build_model) built on meta and materialised on CPU with every
    parameter and buffer NaN, then init_weights(seed): whatever init_weights forgets stays NaN."""
    from models import build_model

    with torch.device("meta"):
        model = build_model(cfg)
    model.to_empty(device="cpu")
    with torch.no_grad():
        for t in [*model.parameters(), *model.buffers()]:
            t.fill_(float("nan"))
    model.init_weights(seed=seed)
    return model


def run_benchmark_smoke(name: str, marker: str) -> None:
    """Run `python benchmarks/NAME --cpu-smoke`; it must succeed and print `marker`."""
    script = Path(__file__).resolve().parent.parent / "benchmarks" / name
    _run_python([str(script), "--cpu-smoke"], marker)


def dynamo_graph(fn, *args) -> torch.fx.GraphModule:
    """The graph Dynamo captures for fn(*args) (torch IR with example_value meta), as a
    pre-grad pass receives it, before any pass ran."""
    graphs = []

    def record(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    torch.compile(fn, backend=record, fullgraph=True)(*args)
    (gm,) = graphs
    return gm


def pass_step(dump: Path, label: str) -> dict:
    """The entry of pass `label` in the summary.json of the single graph compiled into `dump`
    (graphtrain's backend with dump_dir=dump): op counts, op diff, notes."""
    (summary,) = list(dump.glob("*/summary.json"))
    (step,) = [s for s in json.loads(summary.read_text()) if s["label"] == label]
    return step


def module_grads(module, x, dump: Path | None, autocast: bool = False) -> tuple:
    """(output, gradients of x and of every parameter) for a fixed random output gradient:
    eager (dump=None), or compiled through graphtrain's backend (aot_eager) with its graph
    dumps in `dump`; optionally under CPU bf16 autocast."""
    x = x.detach().clone().requires_grad_()
    fn = module
    if dump is not None:
        torch._dynamo.reset()
        fn = torch.compile(
            module, backend=backend(inner="aot_eager", dump_dir=dump), fullgraph=True
        )
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        out = fn(x)
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(out.dtype)
    grads = torch.autograd.grad(out, [x, *module.parameters()], g)
    return out.detach(), grads


@pytest.fixture(scope="session")
def straight_six_steps(corpus, tmp_path_factory):
    """The TrainResult of 6 steps of the debug model on the corpus with the defaults of `job`
    (compiled): the uninterrupted run that the resume tests compare with."""
    from graphtrain.config import load_config
    from graphtrain.trainer import train

    return train(
        load_config(job(corpus, tmp_path_factory.mktemp("straight"), "--training.steps=6"))
    )


@pytest.fixture(scope="session")
def debug_run(corpus, tmp_path_factory) -> Path:
    """A run directory of the debug model after a few eager steps on the corpus, with its final
    checkpoint and a profiler trace of steps 2-3 (for the tests of what reads a finished run:
    generate, eval, the trace)."""
    from graphtrain.config import load_config
    from graphtrain.trainer import train

    tmp = tmp_path_factory.mktemp("debug_run")
    args = job(
        corpus, tmp, "--training.steps=6", "--compile.enable=false", "--metrics.profile_steps=2-3"
    )
    return train(load_config(args)).run_dir
