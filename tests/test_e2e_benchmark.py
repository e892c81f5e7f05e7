"""benchmarks/e2e.py's rows on CPU (debug model, a few steps): the trainer's step, the plain
torch.compile loop and the torchtitan row run, so a change to the trainer's build or step
breaks here rather than on the GPU; the GPU stages' e2e.py commands parse. Nothing is timed or
recorded."""

import importlib.util
import math
import shlex
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


@pytest.fixture(scope="module")
def e2e():
    spec = importlib.util.spec_from_file_location("e2e_benchmark", BENCHMARKS / "e2e.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def _args(corpus: Path, tmp_path: Path, *extra: str) -> list[str]:
    return [
        "--device=cpu",
        "--model=debug",
        "--seq-len=32",
        "--batch=2",
        "--grad-accum=2",
        "--warmup=1",
        "--steps=2",
        f"--set=--data.paths={corpus / 'docs.jsonl'}",
        f"--set=--data.tokenizer={corpus / 'tokenizer.json'}",
        f"--set=--data.cache_dir={tmp_path / 'cache'}",
        "--set=--compile.backend=aot_eager",
        *extra,
    ]


def test_rows_train_the_same_batches_alike_and_fp8_stays_close(e2e, corpus, tmp_path, capsys):
    # fp8.min_dim=16 lets the debug model's linears run in FP8 (the reference kernels on CPU).
    # Two variant rows: graphtrain's AdamW (an A/B of optim.implementation) and another seed
    # (other batches, which its name must say).
    copies, seed = "--optim.implementation=graphtrain", "--training.seed=1"
    variants = [f"--variant={copies}", f"--variant={seed}"]
    rows = e2e.main(_args(corpus, tmp_path, "--fp8", "--set=--fp8.min_dim=16", *variants))
    assert [r.name for r in rows] == [
        "torch.compile (plain) bf16",
        "graphtrain bf16",
        "graphtrain fp8",
        f"graphtrain bf16 {copies}",
        f"graphtrain bf16 {seed} (other batches)",
    ]
    for row in rows:
        assert not row.note and row.tokens_per_s > 0 and math.isfinite(row.loss)
        assert math.isnan(row.mfu) and math.isnan(row.peak_mem_gib)  # no peak FLOPs on CPU
    plain, bf16, fp8, adamw_copies, other_seed = rows
    # The same steps with graphtrain's AdamW kernel (its CPU reference: torch's foreach ops in
    # another order than the fused kernel): a few fp32 roundings apart after three steps.
    assert adamw_copies.loss == pytest.approx(bf16.loss, rel=1e-5)
    assert other_seed.loss != bf16.loss
    # Same model, init, batches (the trainer's loader, replayed), optimizer and learning rate,
    # fp32 on CPU, numerics-preserving default passes: the hand-written loop and the trainer's
    # step give the same loss after three steps of two micro-batches.
    assert bf16.loss == plain.loss
    assert fp8.loss != bf16.loss  # FP8 did change the GEMMs
    assert fp8.loss == pytest.approx(plain.loss, rel=e2e.FP8_LOSS_RTOL)
    assert "within 2% (FP8_LOSS_RTOL)" in capsys.readouterr().out


def test_torchtitan_row_says_why_it_did_not_run(e2e, tmp_path):
    args = e2e.parse_args(["--device=cpu", "--model=debug", "--seq-len=64"])
    row = e2e.torchtitan_row("torchtitan 0.3.0", e2e.job_config(args, str(tmp_path)), [], 0, None)
    assert row.note == "not run: torchtitan's trainer needs CUDA" and math.isnan(row.loss)
    text = e2e.table([e2e.Row("plain", tokens_per_s=10.0, loss=1.0), row], args)
    assert "| torchtitan 0.3.0 | not run: torchtitan's trainer needs CUDA |" in text
    moe = e2e.job_config(
        e2e.parse_args(["--device=cpu", "--model=moe-debug", "--seq-len=64"]), str(tmp_path)
    )
    assert "Llama 3 (dense)" in e2e.torchtitan_row("t", moe, [], 0, None).note


def test_a_failing_variant_is_a_row_that_says_why(e2e, tmp_path, monkeypatch):
    def fail(*args, **kwargs):
        raise RuntimeError("the variant's build failed\nsecond line")

    monkeypatch.setattr(e2e, "graphtrain_row", fail)
    args = e2e.parse_args(
        ["--device=cpu", "--model=debug", "--seq-len=64", "--variant=--training.fp8=true"]
    )
    row = e2e.variant_row(args, str(tmp_path), args.variant[0], [])
    assert row.name == "graphtrain --training.fp8=true"
    assert row.note == "not run: RuntimeError: the variant's build failed"


def test_a_run_stopped_part_way_keeps_the_rows_it_measured(e2e, monkeypatch, capsys):
    # The GPU stage's cap sends SIGINT: the rows measured so far still make the table.
    measured = e2e.Row("graphtrain", tokens_per_s=5.0, loss=2.0)
    monkeypatch.setattr(e2e, "graphtrain_row", lambda *args: (measured, [], None))

    def interrupted(*args):
        raise KeyboardInterrupt

    monkeypatch.setattr(e2e, "plain_compile_row", interrupted)
    rows = e2e.main(["--device=cpu", "--model=debug", "--seq-len=64"])
    assert rows[0] is measured and "stopped by SIGINT" in rows[1].note
    assert "| graphtrain | 5 | nan% | nan | nanx |" in capsys.readouterr().out  # no plain row


def test_bad_arguments_are_named(e2e, capsys):
    with pytest.raises(SystemExit):
        e2e.parse_args(["--device=cpu", "--model=debug", "--seq-len=8192"])
    assert "training.seq_len=8192 exceeds" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        e2e.parse_args(["--device=cpu", "--variant=--optim.implementaton=graphtrain"])
    assert "--variant='--optim.implementaton=graphtrain'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        e2e.parse_args(["--device=cpu", "--model=debug", "--force-balance"])
    with pytest.raises(SystemExit):
        e2e.parse_args(["--device=cpu", "--steps=0"])


def test_the_gpu_stages_e2e_commands_parse(e2e):
    """Every e2e.py command of benchmarks/gpu_session.sh passes e2e.py's own checks (presets,
    every --set and --variant override against the config), so a misspelt key fails here and
    not minutes into a GPU stage."""
    script = (BENCHMARKS / "gpu_session.sh").read_text().replace("\\\n", " ")
    commands = [
        shlex.split(line.split("e2e.py", 1)[1])
        for line in script.splitlines()
        if line.strip().startswith("bench ") and " e2e.py " in line
    ]
    assert len(commands) >= 6, commands
    for argv in commands:
        args = e2e.parse_args([*argv, "--device=cpu"])
        assert args.model in e2e.JOB_PRESETS, argv
