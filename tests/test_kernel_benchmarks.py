"""The `kernels` GPU stage's benchmarks (adamw_step, moe_router, moe_dispatch, tp_overlap): the
code that fills their tables, which otherwise runs only on a GPU, run on CPU with the timers
stood in for (each measurement named by its order), so a broken row or a lost cut shows here.
Each keeps the rows it measured when the stage's time cap stops it part way (a SIGINT, here a
KeyboardInterrupt from the stand-in timer); a row that fails says why in one line and the
others are still measured."""

import importlib
import sys
from functools import partial
from pathlib import Path

import pytest
import torch
import triton.testing

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


@pytest.fixture(scope="module")
def bench():
    if str(BENCHMARKS) not in sys.path:  # as when they run as scripts
        sys.path.insert(0, str(BENCHMARKS))
    return importlib.import_module


def _stopped_at(n: int, measure):
    """measure as a stand-in, told its call's number (from 1) first; the n-th call raises
    KeyboardInterrupt instead (n = 0: none does)."""
    calls = []

    def counted(*args, **kwargs):
        calls.append(args)
        if len(calls) == n:
            raise KeyboardInterrupt
        return measure(len(calls), *args, **kwargs)

    return counted


def _timer(n: int, fn, *args, **kwargs) -> float:
    """A timer's stand-in: runs fn once, says its call's number in ms."""
    fn()
    return float(n)


FAILED = "not run: RuntimeError: a kernel failed / here"  # _fail's error as a row's cell


def _fail() -> None:
    """An error as Triton's: many lines, a "|" that must not split the table's cell."""
    raise RuntimeError("a kernel failed | here\nptxas: line 2 of the story")


def test_adamw_step_a_failed_row_says_why_a_cut_keeps_the_rows_before_it(bench, monkeypatch):
    adamw, harness = bench("adamw_step"), bench("harness")
    real = adamw.setup

    def setup(n, *args):
        return _fail() if n == 2 else real(*args)

    monkeypatch.setattr(adamw, "setup", _stopped_at(4, setup))
    lines = adamw.run("moe-tiny", torch.device("cpu"), timed=False).splitlines()
    assert [line.split(" | ")[:2] for line in lines[4:]] == [
        ["| torch fused + refresh", "nan"],
        ["| graphtrain", FAILED],
        ["| AdamWBF16 + refresh", "nan"],
        ["| (the rest)", harness.CUT],
    ]
    assert lines[-1] == f"| (the rest) | {harness.CUT} | | | |"


def test_moe_router_rows_are_timed_against_compile_and_kept_when_cut(bench, monkeypatch):
    router, harness = bench("moe_router"), bench("harness")

    def measure(n, fn, logits, bias, grad_weights):
        if n == 4:
            _fail()
        # A compiled row runs its plain code: compiling on CPU is not what this is about.
        with torch.no_grad():
            outs = getattr(fn, "_torchdynamo_orig_callable", fn)(logits, bias)
        return {c: float(n) for c in router.COLUMNS}, outs

    monkeypatch.setattr(router, "measure", _stopped_at(6, measure))
    g = torch.Generator().manual_seed(0)
    data = (torch.randn(97, 64, generator=g), torch.randn(64, generator=g) * 0.01, None)
    lines, verdicts = ["header"], []
    routers, impls = ["softmax-aux", "sigmoid-groups"], list(router.IMPLS)
    fill = partial(router.fill_table, routers, impls, data, lines, verdicts)
    harness.rows_until_cap(lines, fill, "cut")
    assert [line.split(" | ")[:2] for line in lines[1:-1]] == [
        *(["| softmax-aux", impl] for impl in impls),
        ["| sigmoid-groups", "torch.compile"],
    ]
    assert lines[-1] == "cut"
    # torch.compile's times are 1 ms, the others' 2, 3 ms: each cell says it against 1.
    assert lines[1].split(" | ")[2:4] == ["1.000 (1.0x)", "1.000 (1.0x)"]
    assert lines[3].split(" | ")[2] == "3.000 (0.3x)"
    for line in lines[1:4]:  # the op and the plain code agree on CPU
        same, err = line.rstrip(" |").split(" | ")[-2:]
        assert same == "100.00%" and float(err) < 1e-5, line
    assert lines[4] == f"| softmax-aux | graphtrain-pass | {FAILED} |" + " |" * 5
    assert verdicts == [
        "softmax-aux: graphtrain-op vs torch.compile: 0.3x fwd, 0.3x fwd kernels, "
        "0.3x fwd+bwd, 0.3x fwd+bwd kernels; target >= 10x"
    ]


def test_moe_dispatch_rows_in_order_a_failed_one_says_why(bench, monkeypatch, tmp_path):
    dispatch = bench("moe_dispatch")
    from graphtrain.compile import backend as graphtrain_backend

    def build(impl, dump):  # eager, bar the pass (aot_eager: no C++ compile on CPU)
        if impl == "eager":
            _fail()
        if impl != "graphtrain":
            return dispatch.plain_dispatch
        backend = graphtrain_backend(inner="aot_eager", dump_dir=dump)
        return torch.compile(dispatch.plain_dispatch, backend=backend, fullgraph=True)

    monkeypatch.setattr(dispatch, "build", build)
    monkeypatch.setattr(triton.testing, "do_bench", _stopped_at(0, _timer))
    monkeypatch.setattr(dispatch, "kernel_ms", _stopped_at(0, lambda n, *a: 2 * _timer(n, *a)))
    data = dispatch.inputs(37, 3, 24, "cpu", torch.float32)
    lines = []
    dispatch.fill_rows(data, str(tmp_path), lines)
    assert lines[1] == f"| eager | {FAILED} | | | | |"
    cells = [line.strip("| ").split(" | ") for line in (lines[0], lines[2])]
    assert [c[0] for c in cells] == ["torch.compile", "graphtrain"]
    # kernel times 2, 4 | 6, 8 ms: against torch.compile's 2 and 4.
    assert [(c[2], c[4]) for c in cells] == [
        ("2.000 (1.00x)", "4.000 (1.00x)"),
        ("6.000 (0.33x)", "8.000 (0.50x)"),
    ]
    assert all(float(c[5]) < 1e-6 for c in cells), cells
    assert dispatch._pass_fired(str(tmp_path))


def test_tp_overlap_keeps_the_rows_before_the_cut(bench, monkeypatch):
    tp, harness = bench("tp_overlap"), bench("harness")

    # tp = 2's four GEMMs, one and chunked (run at these shapes on CPU), then the cut.
    monkeypatch.setattr(triton.testing, "do_bench", _stopped_at(9, _timer))
    rows = []
    harness.rows_until_cap(rows, lambda: tp.measure(64, "cpu", rows), {"cut": harness.CUT})
    lines = tp.table(rows, 64).splitlines()
    assert [line.split(" | ")[:2] for line in lines[2:6]] == [
        ["| 2", name] for name, *_ in tp.gemms(2)
    ]
    assert lines[2].split(" | ")[3:6] == ["1.000", "2.000", "+100.0%"]  # one GEMM 1 ms, chunked 2
    assert lines[6] == f"| (the rest) | {harness.CUT} | | | | | | |" and len(lines) == 7
