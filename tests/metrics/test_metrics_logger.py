"""MetricsLogger: JSONL lines, TensorBoard events, console line, rank != 0 silent."""

import io
import json
import logging
import sys

import pytest
import torch

import graphtrain.metrics.logger as logger_module
from graphtrain.metrics import MetricsLogger, ProgressBar, format_summary
from graphtrain.metrics.hardware import describe_memory


def read_jsonl(path):
    # parse_constant rejects NaN / Infinity: the file must be strict JSON.
    def reject(name):
        raise ValueError(name)

    return [json.loads(line, parse_constant=reject) for line in path.read_text().splitlines()]


def test_rank0_writes_jsonl_tensorboard_and_console(tmp_path, capsys):
    pytest.importorskip("tensorboard")
    with MetricsLogger(tmp_path, rank=0, total_steps=100) as log:
        assert log._bar is None  # stderr is not a terminal under pytest
        log.log(1, {"loss": 3.5, "lr": 1e-4, "grad_norm": 0.5, "tokens_per_s": 12345.0})
        log.log(2, {"loss": float("nan"), "mfu": 0.4125, "memory/max_rss_gib": 1.5})
        log.log(3, {"grad_norm": float("inf"), "consumed_tokens": 2**40, "val_loss": 2.0})
    rows = read_jsonl(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert rows[0]["loss"] == 3.5 and rows[0]["tokens_per_s"] == 12345.0
    assert rows[1]["loss"] == "nan" and rows[2]["grad_norm"] == "inf"
    assert rows[2]["consumed_tokens"] == 2**40 and isinstance(rows[2]["consumed_tokens"], int)
    assert all(r["time"] > 0 and r["elapsed_s"] >= 0 for r in rows)
    assert list((tmp_path / "tb").glob("events.out.tfevents.*"))
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "step 1/100 | loss 3.5000 | lr 1.00e-04 | grad_norm 0.500 | tok/s 12,345"
    assert out[1] == "step 2/100 | loss nan | mfu 41.2% | rss 1.50 GiB"
    assert out[2] == "step 3/100 | val_loss 2.0000 | grad_norm inf"


def _tb_steps(tb_dir, tag):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tb_dir))
    acc.Reload()
    return [(e.step, e.value) for e in acc.Scalars(tag)]


def test_resume_supersedes_the_rows_after_the_checkpoint(tmp_path):
    pytest.importorskip("tensorboard")
    with MetricsLogger(tmp_path, rank=0) as log:
        for step in range(1, 11):
            log.log(step, {"loss": float(step)})
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 11, "lo')  # a line cut off by a kill
    # Resumed from the checkpoint of step 5: steps 6.. are trained again.
    with MetricsLogger(tmp_path, rank=0, resume_step=5) as log:
        for step in range(6, 9):
            log.log(step, {"loss": 100.0 + step})
    rows = read_jsonl(tmp_path / "metrics.jsonl")
    assert [(r["step"], r["loss"]) for r in rows] == [
        *((s, float(s)) for s in range(1, 6)),
        *((s, 100.0 + s) for s in range(6, 9)),
    ]
    assert _tb_steps(tmp_path / "tb", "loss") == [
        *((s, float(s)) for s in range(1, 6)),
        *((s, 100.0 + s) for s in range(6, 9)),
    ]


def test_a_kill_while_resuming_keeps_the_whole_record(tmp_path, monkeypatch):
    with MetricsLogger(tmp_path, rank=0, tensorboard=False) as log:
        for step in range(1, 11):
            log.log(step, {"loss": float(step)})
    before = (tmp_path / "metrics.jsonl").read_text()
    real_rows = logger_module._rows_up_to

    def rows_then_killed(path, step):
        yield from real_rows(path, step)[:2]
        raise KeyboardInterrupt  # the process stops half-way through rewriting the record

    monkeypatch.setattr(logger_module, "_rows_up_to", rows_then_killed)
    with pytest.raises(KeyboardInterrupt):
        MetricsLogger(tmp_path, rank=0, tensorboard=False, resume_step=5)
    assert (tmp_path / "metrics.jsonl").read_text() == before


def test_a_fresh_run_never_appends_to_an_old_record(tmp_path):
    pytest.importorskip("tensorboard")
    with MetricsLogger(tmp_path, rank=0) as log:
        log.log(1, {"loss": 1.0})
        log.log(2, {"loss": 2.0})
    with MetricsLogger(tmp_path, rank=0) as log:
        log.log(1, {"loss": 5.0})
    assert [(r["step"], r["loss"]) for r in read_jsonl(tmp_path / "metrics.jsonl")] == [(1, 5.0)]
    assert _tb_steps(tmp_path / "tb", "loss") == [(1, 5.0)]


def test_other_ranks_write_nothing(tmp_path, capsys):
    run_dir = tmp_path / "run"
    log = MetricsLogger(run_dir, rank=1, total_steps=10)
    log.log(1, {"loss": 1.0})
    log.progress(2)
    log.close()
    assert not run_dir.exists()
    assert capsys.readouterr().out == ""


def test_tensor_values_rejected(tmp_path):
    with (
        MetricsLogger(tmp_path, rank=0, tensorboard=False) as log,
        pytest.raises(TypeError, match="'loss' is a Tensor"),
    ):
        log.log(1, {"loss": torch.tensor(1.0)})


def test_missing_tensorboard_warns_once(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # import raises
    monkeypatch.setattr(logger_module, "_warned_no_tensorboard", False)
    with pytest.warns(UserWarning, match="TensorBoard logging disabled"):
        MetricsLogger(tmp_path / "a", rank=0).close()
    with MetricsLogger(tmp_path / "b", rank=0) as log:  # no second warning
        log.log(1, {"loss": 2.0})
    assert read_jsonl(tmp_path / "b" / "metrics.jsonl")[0]["loss"] == 2.0


def test_format_summary_memory_and_no_total():
    line = format_summary(5, {"memory/peak_allocated_gib": 12.345, "other": 1.0})
    assert line == "step 5 | mem 12.35 GiB"


def test_progress_bar_render():
    stream = io.StringIO()
    bar = ProgressBar(stream, total=10, width=10, min_interval_s=0.0)
    bar.update(0)
    bar.update(5)
    bar.clear()
    bar.update(10)
    bar.close()
    text = stream.getvalue()
    assert "[#####.....] 5/10  50.0%" in text
    assert "[##########] 10/10 100.0%" in text
    assert text.endswith("\n")


def test_recorded_reads_one_metric_of_the_whole_record(tmp_path):
    with MetricsLogger(tmp_path, rank=0, tensorboard=False) as log:
        log.log(0, {"val_loss": 7.0})
        log.log(1, {"loss": 6.5})
        log.log(2, {"val_loss": 6.0})
    with MetricsLogger(tmp_path, rank=0, tensorboard=False, resume_step=2) as log:
        log.log(4, {"val_loss": 5.0})
    assert logger_module.recorded(tmp_path / "metrics.jsonl", "val_loss") == {
        0: 7.0,
        2: 6.0,
        4: 5.0,
    }


def test_progress_bar_eta_leaves_out_the_compiling_first_step(monkeypatch):
    clock = iter([0.0, 0.0, 100.0, 101.0, 102.0])  # created, steps 0-3: step 1 compiled 100 s
    monkeypatch.setattr("graphtrain.metrics.progress.time.monotonic", lambda: next(clock))
    stream = io.StringIO()
    bar = ProgressBar(stream, total=10, width=10, min_interval_s=0.0)
    for step in range(4):
        bar.update(step)
    assert "1.00 step/s ETA 0:00:07" in stream.getvalue().split("\r")[-1]


class _Terminal(io.StringIO):
    def isatty(self):
        return True


def test_log_lines_do_not_run_into_the_progress_bar(tmp_path, monkeypatch):
    terminal = _Terminal()
    monkeypatch.setattr(logger_module.sys, "stderr", terminal)
    handler = logging.StreamHandler(terminal)
    logging.getLogger().addHandler(handler)
    try:
        with MetricsLogger(tmp_path, rank=0, tensorboard=False, total_steps=10) as log:
            log.progress(1)
            log.progress(2)
            logging.getLogger("graphtrain").warning("a log line")
    finally:
        logging.getLogger().removeHandler(handler)
    text = terminal.getvalue()
    assert "elapsed" in text and "\ra log line\n" in text
    assert not handler.filters  # taken off again at close


def test_memory_is_described_with_units():
    assert describe_memory({"memory/max_rss_gib": 0.544}) == "peak resident 0.54 GiB"
    cuda = {"memory/peak_allocated_gib": 1.0, "memory/peak_reserved_gib": 2.0}
    assert describe_memory(cuda) == "peak allocated 1.00 GiB, peak reserved 2.00 GiB"
