"""tests/backend_agreement.py (every layout under Inductor against aot_eager, run by hand): its
layouts are valid configs, its verdicts say what they should, and one layout runs through it."""

import pytest
from backend_agreement import FP32, LAYOUTS, main, verdict
from conftest import job

from graphtrain.config import load_config


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_every_layout_is_a_valid_config(name, corpus, tmp_path):
    _, args, _ = LAYOUTS[name]
    load_config(job(corpus, tmp_path, *args, "--compile.backend=inductor"))


def test_the_verdicts():
    ref = [(6.0, 2.0), (5.0, 2.5)]
    off = [(6.0, 2.0), (5.0, 2.5 * (1 + 1e-5))]  # the router defect's grad norm was 2.6e-6 off
    both = {"aot_eager": ref, "inductor": ref}
    assert verdict(both, {}, FP32, 2)["status"] == "ok"
    got = verdict({"aot_eager": ref, "inductor": off}, {}, FP32, 2)
    assert got["status"] == "DIFFERS" and got["grad_norm"] == pytest.approx(1e-5)
    assert verdict(both, {}, FP32, 3)["status"] == "FAILED"  # a run stopped early
    one = {"inductor": "LoweringException: ..."}
    assert verdict({"aot_eager": ref}, one, FP32, 2)["status"] == "FAILED"
    same = {"aot_eager": "error: needs torch >= 2.12", "inductor": "error: needs torch >= 2.12"}
    assert verdict({}, same, FP32, 2)["status"] == "refused"


def test_one_layout_through_the_tool(tmp_path, capsys):
    assert main(["one", "--steps", "2", "--out", str(tmp_path / "r.json")]) == 0
    assert capsys.readouterr().out.startswith("one ")
    assert '"status": "ok"' in (tmp_path / "r.json").read_text()
