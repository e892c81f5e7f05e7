"""The shipped presets still match every fusion: each fused op appears in the compiled graphs of
`debug` (head and loss), `moe-debug` (router, dispatch, sibling expert GEMMs) and `moe-debug` with
FP8 (linears and experts), so that a model edit a matcher no longer recognises fails here
instead of leaving a pass note and a slower run. The model lines under these contracts carry a
comment naming their pass (models/gpt.py GPT.head_loss, models/moe.py Router and routed_experts).

One aot_eager compile per preset, shared by the module: `debug`'s head region, and `moe-debug`
with training.fp8 (fp8.min_dim=16: the preset's 64-wide GEMMs are below the default 4096).
fp8_linear is the last pre-grad pass (PASS_ORDER), so the graph before it is the graph
`moe-debug` compiles to without FP8.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from graphtrain.compile import apply_compile
from graphtrain.config import load_config, pass_options
from graphtrain.passes.order import PASS_ORDER
from models import build_model

RUNS = {
    "debug": (["--preset", "debug"], {"head_loss"}),
    "moe-debug-fp8": (["--preset", "moe-debug", "--training.fp8=true", "--fp8.min_dim=16"], None),
}


def _compile_and_step(args: list[str], regions: set[str] | None, dump: Path) -> dict:
    """{region graph: {pass label: op counts}} of one forward and backward of the preset."""
    cfg = load_config(args)
    torch._dynamo.reset()
    model = build_model(cfg.model)
    model.init_weights(seed=0)
    apply_compile(
        model,
        passes=cfg.compile.passes,
        inner="aot_eager",
        dump_dir=dump,
        pass_options=pass_options(cfg),
        regions=regions,
    )
    tokens = torch.randint(
        0, cfg.model.vocab_size, (2, 17), generator=torch.Generator().manual_seed(0)
    )
    model(tokens[:, :-1], tokens[:, 1:]).backward()
    torch._dynamo.reset()
    graphs = {}
    for summary in sorted(dump.glob("*/summary.json")):
        steps = json.loads(summary.read_text())
        graphs[summary.parent.name] = {s["label"]: s["op_counts"] for s in steps}
    return graphs


@pytest.fixture(scope="module")
def compiled(tmp_path_factory) -> dict[str, dict]:
    return {
        name: _compile_and_step(args, regions, tmp_path_factory.mktemp(name))
        for name, (args, regions) in RUNS.items()
    }


def _count(graphs: dict, label: str | None, op: str) -> int:
    """How often `op` appears in all region graphs after pass `label` (None: the last pass)."""
    return sum(
        steps[label or list(steps)[-1]].get(op, 0)
        for steps in graphs.values()
        if label is None or label in steps
    )


def test_fp8_linear_is_the_last_pre_grad_pass():
    pre = [name for stage, name, _why in PASS_ORDER if stage == "pre_grad"]
    assert pre[-1] == "fp8_linear"


def test_debug_head_and_loss_fuse(compiled):
    graphs = compiled["debug"]
    assert set(graphs) == {"head_loss-0"}, graphs
    assert _count(graphs, None, "graphtrain.linear_cross_entropy.default") == 1


@pytest.mark.parametrize(
    "op",
    [
        "graphtrain.linear_cross_entropy.default",
        "graphtrain.moe_route.default",
        "graphtrain.moe_permute.default",
        "graphtrain.moe_unpermute.default",
    ],
)
def test_moe_debug_fusions(compiled, op):
    """Before FP8 (the graph without it) and after: every MoE fusion took its lines."""
    graphs = compiled["moe-debug-fp8"]
    assert _count(graphs, "fuse_sibling_grouped_mm", op) >= 1, graphs
    assert _count(graphs, "fp8_linear", op) == _count(graphs, "fuse_sibling_grouped_mm", op)


def test_moe_debug_sibling_expert_gemms_merge(compiled):
    """w1 and w3 of the routed experts: three grouped GEMMs per MoE block become two."""
    graphs = compiled["moe-debug-fp8"]
    moe = {
        name: steps for name, steps in graphs.items() if "torch._grouped_mm" in steps["captured"]
    }
    assert moe, graphs
    for steps in moe.values():
        assert steps["captured"]["torch._grouped_mm"] == 3
        assert steps["fuse_sibling_grouped_mm"]["torch._grouped_mm"] == 2


@pytest.mark.parametrize(
    "op", ["graphtrain.fp8_linear.default", "graphtrain.fp8_grouped_mm.default"]
)
def test_moe_debug_with_fp8_runs_linears_and_experts_in_fp8(compiled, op):
    graphs = compiled["moe-debug-fp8"]
    assert _count(graphs, "fuse_sibling_grouped_mm", op) == 0
    assert _count(graphs, "fp8_linear", op) >= 1, graphs
