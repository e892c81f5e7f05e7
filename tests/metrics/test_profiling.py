"""metrics.profile_steps / metrics.memory_snapshot: the range parser, a trace on CPU, the
trainer's hook, and the clear refusal of a memory snapshot without CUDA."""

import json
import re

import pytest
import torch

from graphtrain.config import load_config
from graphtrain.metrics.profiling import StepProfiler, parse_step_range


def test_step_ranges():
    assert parse_step_range("") is None
    assert parse_step_range("10-12") == (10, 12)
    assert parse_step_range("7") == (7, 7)
    for bad in ("0-2", "5-3", "a-b", "3-", "1,2"):
        with pytest.raises(ValueError, match=re.escape(f"metrics.profile_steps='{bad}' is not")):
            parse_step_range(bad)
    with pytest.raises(ValueError, match=re.escape("metrics.profile_steps='5-3'")):
        load_config(["--metrics.profile_steps=5-3"])


def _names(trace):
    return {e.get("name") for e in json.loads(trace.read_text())["traceEvents"]}


def test_the_trace_holds_the_steps_of_the_range_only(tmp_path):
    profiler = StepProfiler(
        tmp_path, steps="2-3", memory_snapshot=False, device=torch.device("cpu"), rank=0
    )
    a = torch.randn(64, 64)
    for step in range(1, 5):
        profiler.before_step(step)
        # A different op per step shows which steps the trace covers.
        {1: torch.mm, 2: torch.add, 3: torch.mul, 4: torch.sub}[step](a, a)
        profiler.after_step(step)
    profiler.close()
    names = _names(tmp_path / "profile" / "rank0-steps-2-3.json")
    assert {"aten::add", "aten::mul"} <= names
    assert not {"aten::mm", "aten::sub"} & names


def test_memory_snapshot_needs_cuda(tmp_path):
    with pytest.raises(
        ValueError, match=re.escape("metrics.memory_snapshot=true records the CUDA")
    ):
        StepProfiler(
            tmp_path, steps="1-2", memory_snapshot=True, device=torch.device("cpu"), rank=0
        )


def test_a_training_run_writes_the_trace(debug_run):
    trace = debug_run / "profile" / "rank0-steps-2-3.json"
    assert "aten::mm" in _names(trace) or "aten::addmm" in _names(trace)
    assert list((debug_run / "profile").iterdir()) == [trace]
