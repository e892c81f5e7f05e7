"""benchmarks/first_contact.sh's CPU dry run (FIRST_CONTACT_DRY_RUN=1: tiny shapes, aot_eager,
SDPA), so the first GPU command cannot rot: every item runs and exits 0 (the dense e2e rows
aside: tests/test_e2e_benchmark.py trains them), $OUT keeps to what a device run brings back,
and summary.txt says what the GPU run must say (passes fired, CUDA graphs, energy). The
summary's parser is then checked on the real run directories it read, and on copies changed to
look like a CUDA run (graphs captured, skipped; energy logged)."""

import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
import first_contact  # noqa: E402


@pytest.fixture(scope="module")
def dry_run(corpus, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("first_contact")
    out, work = tmp / "out", tmp / "work"
    data = f"--data.paths={corpus / 'docs.jsonl'} --data.tokenizer={corpus / 'tokenizer.json'}"
    env = {
        **os.environ,
        "OUT": str(out),
        "PYTHON": sys.executable,
        "FIRST_CONTACT_DRY_RUN": "1",
        "FIRST_CONTACT_WORK": str(work),
        "FIRST_CONTACT_DATA": data,
        "GRAPHTRAIN_CACHE": str(tmp / "cache"),
        "OMP_NUM_THREADS": "1",
    }
    env.pop("PYTHONPATH", None)  # the script puts the repository (and its wheels) there itself
    proc = subprocess.run(
        ["bash", str(ROOT / "benchmarks" / "first_contact.sh")],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    return proc, out, work


@pytest.mark.slow  # seven processes importing torch, three small aot_eager compiles: ~1 min
def test_dry_run_runs_every_item_and_summarizes(dry_run):
    proc, out, _ = dry_run
    summary = (out / "summary.txt").read_text()
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    # What comes back from a device run: at most 8 files, plain names, no folders.
    files = sorted(p.name for p in out.iterdir())
    assert len(files) <= 8 and all(re.fullmatch(r"[\w.-]+", f) for f in files), files
    assert all((out / f).is_file() for f in files)
    assert {"summary.txt", "artifacts.tar.gz", "smoke-moe.log", "gpu-tests.log"} <= set(files)
    # Items a-d in the order, each exited 0.
    started = re.findall(r"^=== ([\w-]+) \(cap", summary, flags=re.M)
    # check-gpu-config: the GPU branch's training config, validated (dry run only).
    assert started == [
        "check-gpu-config",
        "smoke-moe",
        "e2e-moe-1b",
        "gpu-tests",
        "inspect-debug",
    ]
    for name in started:
        assert f"=== {name}: exit 0 after" in summary, name
    assert "every item exited 0" in summary
    assert "=== e2e-1b: not run in a dry run" in summary  # its rows: test_e2e_benchmark.py
    # The facts the GPU run must report.
    for pass_name in ("fuse_linear_cross_entropy", "fuse_moe_router", "fuse_moe_dispatch",
                      "fp8_linear", "fp8_cast_once"):  # fmt: skip
        assert re.search(rf"^  pass fired: {pass_name} in ", summary, flags=re.M), pass_name
    assert "graphtrain.fp8_grouped_mm.default +" in summary
    assert "MTP CUDA graphs: not used" in summary and "CUDA graphs need a CUDA device" in summary
    assert "energy metric: ABSENT (not a CUDA run" in summary
    assert "attention: scaled_dot_product_attention" in summary
    # e2e rows: the plain and the graphtrain row, with the same loss.
    rows = re.findall(
        r"^  \| (torch.compile \(plain\)|graphtrain) \|.*\| ([\d.]+) \|$", summary, re.M
    )
    assert [r[0] for r in rows] == ["torch.compile (plain)", "graphtrain"], rows
    assert rows[0][1] == rows[1][1]


def test_summary_parser_on_the_real_run(dry_run, tmp_path):
    _, out, _ = dry_run
    with tarfile.open(out / "artifacts.tar.gz") as tar:
        tar.extractall(tmp_path, filter="data")
    run = tmp_path / "smoke-moe"
    lines = first_contact.summarize_run(run, out / "smoke-moe.log")
    # The same lines as the script wrote, from the run directory that came back.
    summary = (out / "summary.txt").read_text().splitlines()
    assert all(line in summary for line in lines)
    losses = json.loads(lines[0].split("losses: ")[1])
    steps = [json.loads(s) for s in (run / "metrics.jsonl").read_text().splitlines()]
    assert losses == [round(s["loss"], 4) for s in steps if "loss" in s] and len(losses) == 2

    # A CUDA run, as first_contact.py train records it: graphs recorded without a skip ...
    cuda = tmp_path / "cuda"
    shutil.copytree(run, cuda)
    info = {"exit_code": 0, "cuda": True, "cudagraph_skips": 0, "cudagraph_trees_recorded": 2}
    (cuda / first_contact.INFO_FILE).write_text(json.dumps(info))
    # ... and the energy metric in the log steps.
    with (cuda / "metrics.jsonl").open("a") as f:
        f.write(json.dumps({"step": 3, "loss": 1.5, "energy/joules_per_token": 0.25}) + "\n")
    text = "\n".join(first_contact.summarize_run(cuda, None))
    assert "MTP CUDA graphs: CAPTURED (2 cudagraph tree root(s) recorded, no skip)" in text
    assert "energy metric: PRESENT (energy/joules_per_token=0.25)" in text

    # Skipped by Inductor, its reason from the log; NVML's reason for no energy.
    info.update(cudagraph_skips=3, cudagraph_trees_recorded=0)
    (cuda / first_contact.INFO_FILE).write_text(json.dumps(info))
    (cuda / "metrics.jsonl").write_text((run / "metrics.jsonl").read_text())
    log = tmp_path / "cuda.log"
    log.write_text(
        "W1126 skipping cudagraphs due to mutated inputs (1 instances)\n"
        "20:00:00 energy per token not logged: NVML cannot read the energy (Not Supported)\n"
    )
    text = "\n".join(first_contact.summarize_run(cuda, log))
    assert "MTP CUDA graphs: SKIPPED by Inductor (3 skip(s))" in text
    assert "inductor: skipping cudagraphs due to mutated inputs" in text
    assert "energy metric: ABSENT: energy per token not logged: NVML cannot" in text

    # A run that died before its first step: no metrics, no info, no dumps.
    empty = tmp_path / "empty"
    empty.mkdir()
    text = "\n".join(first_contact.summarize_run(empty, None))
    assert "steps logged: 0" in text and "no graph dumps found" in text
    assert "MTP CUDA graphs: unknown (no first_contact.json" in text


def test_the_fp32_fused_loss_cases_run_last_exist():
    """The script defers the fp32 cases of test_cuda_matches_float64 by their pytest ids
    (dtype1-<reduction>): the ids must still name the fp32 cases, or --deselect drops nothing and
    the leftover item runs nothing."""
    import importlib.util

    import torch

    path = ROOT / "tests" / "custom_ops" / "test_linear_cross_entropy.py"
    spec = importlib.util.spec_from_file_location("lce_tests_for_first_contact", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    marks = {
        m.args[0]: list(m.args[1])
        for m in module.test_cuda_matches_float64.pytestmark
        if m.name == "parametrize"
    }
    assert marks["dtype"].index(torch.float32) == 1
    text = (ROOT / "benchmarks" / "first_contact.sh").read_text()
    assert f"lce={path.relative_to(ROOT)}::test_cuda_matches_float64" in text
    ids = re.findall(r'"\$lce\[dtype1-(\w+)\]"', text)
    assert sorted(ids) == sorted(marks["reduction"]), ids
