"""Bad input a new user gives is one clear error naming it, before any work: model numbers that
would train to NaN, expert parallel on a dense model, keys below a plain value, a memory plan
that cannot fit this machine, a run directory that is a file or cannot be written; relative
paths given to launch.sh are the caller's; settings of a parallel axis that is off are named; a
resume past training.steps is refused; `graphtrain train --check` (launch.sh's check before the
ranks start) finds what the ranks would each refuse."""

import logging
import shutil
import subprocess
from pathlib import Path

import pytest
from conftest import job, launch_env

from graphtrain.checkpoint import complete_checkpoints
from graphtrain.cli import main
from graphtrain.config import load_config
from graphtrain.parallel import unused_axis_settings
from graphtrain.trainer import train


@pytest.mark.parametrize(
    "args, message",
    [
        (
            ["--model.norm_eps=-1"],
            "model.norm_eps must be > 0 (RMSNorm's epsilon, e.g. 1e-5), got -1",
        ),
        (["--model.rope_theta=0"], "model.rope_theta must be > 0 (RoPE's base frequency"),
        (["--model.init_std=-0.02"], "model.init_std must be > 0 (the standard deviation"),
        (
            ["--parallel.ep=2"],
            "parallel.ep=2 splits the routed experts of an MoE model, but preset 'debug' builds "
            "a dense model",
        ),
        (
            ["--training.steps.x=1"],
            "config key 'training.steps.x' does not exist: 'training.steps' is a value, not a "
            "section; set it as --training.steps=...",
        ),
        (
            ["--training.steps=3", "--training.steps.x=1"],
            "config key 'training.steps.x': 'training.steps' is a value",
        ),
    ],
)
def test_bad_config_names_the_key(args, message):
    with pytest.raises(ValueError) as e:
        load_config(["--preset", "debug", *args])
    assert message in str(e.value)
    assert "repeats" not in str(e.value)


def test_moe_models_still_take_expert_parallel():
    assert load_config(["--preset", "moe-tiny", "--parallel.ep=2"]).parallel.ep == 2


def test_a_memory_plan_beyond_this_machine_is_refused_before_any_work(corpus, tmp_path):
    args = job(corpus, tmp_path, "--training.micro_batch_size=10000000", "--training.steps=1")
    with pytest.raises(ValueError, match=r"needs about .+ GiB per rank but this machine's memory"):
        train(load_config(args))
    assert not (tmp_path / "run").exists()


def test_a_run_dir_that_is_a_file_or_unwritable_is_named(corpus, tmp_path, monkeypatch):
    a_file = tmp_path / "taken"
    a_file.write_text("")
    for run_dir, message in [
        (a_file, "is a file, not a directory"),
        (a_file / "run", f"cannot be created: {str(a_file)!r} is a file"),
    ]:
        args = job(corpus, tmp_path, "--training.steps=1", f"--training.run_dir={run_dir}")
        with pytest.raises(ValueError, match=f"training.run_dir={str(run_dir)!r}") as e:
            train(load_config(args))
        assert message in str(e.value)
    # (The tests may run as root, whom no permission stops: the check is what is tested.)
    monkeypatch.setattr("graphtrain.run.os.access", lambda path, mode: False)
    args = job(corpus, tmp_path / "ro", "--training.steps=1")
    with pytest.raises(ValueError, match="cannot be written: this user may not write to"):
        train(load_config(args))


@pytest.mark.slow  # a training run through launch.sh and its start-up (~70 s on 2 busy cores)
def test_launch_sh_resolves_relative_paths_where_the_caller_stands(corpus, tmp_path):
    """`CONFIG=job.toml ../graphtrain/launch.sh --data.paths=docs.jsonl` from the user's own
    folder: the config, the data and the default runs/ folder are theirs, not the repository's."""
    repo = Path(__file__).resolve().parent.parent
    work = tmp_path / "work"
    work.mkdir()
    shutil.copy(corpus / "docs.jsonl", work / "docs.jsonl")
    shutil.copy(corpus / "tokenizer.json", work / "tokenizer.json")
    (work / "job.toml").write_text(
        'preset = "debug"\n[training]\nsteps = 2\n[metrics]\nval_interval = 0\ntensorboard = false\n'
    )
    env = launch_env(tmp_path)
    args = [
        "--data.paths=docs.jsonl",
        "--data.tokenizer=tokenizer.json",
        "--compile.backend=aot_eager",
    ]
    args.append(f"--data.cache_dir={tmp_path / 'cache'}")
    before = set((repo / "runs").iterdir()) if (repo / "runs").is_dir() else set()
    out = subprocess.run(
        ["bash", str(repo / "launch.sh"), *args],
        cwd=work,
        env={**env, "CONFIG": "job.toml", "NGPU": "1"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    (run,) = (work / "runs").iterdir()
    assert complete_checkpoints(run)
    after = set((repo / "runs").iterdir()) if (repo / "runs").is_dir() else set()
    assert after == before

    missing = subprocess.run(
        ["bash", str(repo / "launch.sh")],
        cwd=work,
        env={**env, "CONFIG": "nosuch.toml", "NGPU": "1"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert missing.returncode == 2
    assert (
        f"config file 'nosuch.toml' does not exist (looked for {str(work / 'nosuch.toml')!r})"
        in missing.stderr
    )


@pytest.mark.parametrize(
    "command, shown",
    [
        ("export", "(default: bf16)"),
        ("plan", "(default: 80GB)"),
        ("generate", "(default: 0.95)"),
        ("eval", "(default: auto)"),
    ],
)
def test_help_shows_the_defaults(command, shown, capsys):
    with pytest.raises(SystemExit):
        main([command, "--help"])
    assert shown in capsys.readouterr().out


def test_settings_of_an_axis_that_is_off_are_named_at_start(corpus, tmp_path, caplog):
    """Pipeline settings with pp 1 and tp-overlap settings with tp 1 do nothing: the trainer
    says so in one line each (a forgotten axis, most likely), and trains."""
    unused = ("--parallel.pp_schedule=gpipe", "--parallel.pp_layout=Et|tL")
    args = job(corpus, tmp_path, "--compile.enable=false", "--training.steps=1", *unused,
               "--parallel.tp_overlap_chunks=2")  # fmt: skip
    with caplog.at_level(logging.WARNING, logger="graphtrain"):
        train(load_config(args))
    assert [
        r.getMessage() for r in caplog.records if " nothing with parallel." in r.getMessage()
    ] == [
        "parallel.pp_schedule='gpipe', parallel.pp_layout='Et|tL' do nothing with parallel.pp=1",
        "parallel.tp_overlap_chunks=2 does nothing with parallel.tp=1",
    ]
    assert complete_checkpoints(tmp_path / "run")
    for axes in ([], ["--parallel.pp=2", "--parallel.tp=2"]):
        cfg = load_config(["--preset", "debug", *unused, *axes, "--parallel.tp_overlap_chunks=2"])
        assert bool(unused_axis_settings(cfg.parallel)) == (not axes)


def test_a_resume_past_training_steps_is_refused_and_one_at_them_says_so(
    corpus, tmp_path, caplog, capsys
):
    """A checkpoint past training.steps would end the run at once, having trained nothing:
    refused before any work, naming both. One at training.steps (a finished run started again,
    as a requeued job is) ends at once, saying so."""
    common = ("--compile.enable=false", "--training.steps=2")
    train(load_config(job(corpus, tmp_path / "done", *common)))
    (step2,) = complete_checkpoints(tmp_path / "done" / "run")
    again = job(corpus, tmp_path / "done", *common, "--checkpoint.resume=latest")
    past = (
        "checkpoint.resume='latest' (step-0000002) is past training.steps=1: raise "
        "training.steps to continue it"
    )
    with pytest.raises(ValueError) as e:
        train(load_config([*again, "--training.steps=1"]))
    assert str(e.value) == past
    # `train --check`, which launch.sh runs once before the ranks start, says it too.
    assert main(["train", "--check", *again, "--training.steps=1"]) == 2
    assert capsys.readouterr().err == f"graphtrain: error: {past}\n"
    with caplog.at_level(logging.INFO, logger="graphtrain"):
        assert train(load_config(again)).losses == []
    assert "resumed at step 2 = training.steps: nothing left to train" in caplog.text
    assert complete_checkpoints(tmp_path / "done" / "run") == [step2]


def test_train_check_names_bad_inputs_before_any_rank_starts(corpus, tmp_path, capsys):
    """`graphtrain train --check` (launch.sh's one check before the ranks) reads the data's
    inputs without tokenizing: a glob matching nothing, a missing tokenizer, a tokenizer larger
    than the model's vocabulary; the config of the Hugging Face weights to start from; a pass
    switch naming no pass."""
    for args, message in [
        ([f"--data.paths={tmp_path / 'none*.jsonl'}"], "none*.jsonl' matches no files"),
        ([f"--data.tokenizer={tmp_path / 'nope.json'}"], "nope.json' does not exist"),
        (
            ["--model.vocab_size=256"],  # below any byte-level BPE's
            "tokens but the model vocab_size is 256; raise model.vocab_size",
        ),
        ([f"--checkpoint.init_from_hf={tmp_path}"], f"init_from_hf='{tmp_path}' has no config"),
        (["--compile.passes=+fuse_everything"], "entry '+fuse_everything' is not '+name' or"),
    ]:
        assert main(["train", "--check", *job(corpus, tmp_path, *args)]) == 2, args
        (line,) = capsys.readouterr().err.splitlines()
        assert line.startswith("graphtrain: error: ") and message in line, line
    assert main(["train", "--check", *job(corpus, tmp_path)]) == 0
