"""The TP plan and apply_tp's checks, without a process group: apply_tp validates the whole
plan before it touches the mesh. Layout correctness is tested on ranks in test_parallel_train.py."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor import Replicate, Shard

from graphtrain.parallel import STYLES, apply_tp
from models.gpt import PRESETS, build_gpt
from models.gpt_plan import GPT_TP_PLAN


@pytest.fixture
def model():
    with torch.device("meta"):
        return build_gpt(PRESETS["debug"])


def test_plan_uses_known_styles():
    assert set(GPT_TP_PLAN.values()) <= set(STYLES)


def test_every_plan_pattern_matches(model):
    # Patterns are resolved in order; the error names the first unmatched one, so reaching the
    # extra entry means every pattern of the real plan matched a module.
    with pytest.raises(ValueError, match=r"pattern 'layers\.\*\.nope' matches no module of GPT"):
        apply_tp(model, None, {**GPT_TP_PLAN, "layers.*.nope": "colwise"})


def test_unknown_style(model):
    with pytest.raises(ValueError, match=r"unknown style 'diagonal' for 'output'"):
        apply_tp(model, None, {"output": "diagonal"})


def test_pattern_component_count_must_match(model):
    # "*" is one path component: "layers.*" names blocks, never their children.
    with pytest.raises(ValueError, match=r"pattern 'layers\.\*\.wq' matches no module"):
        apply_tp(model, None, {"layers.*.wq": "colwise"})


def test_gather_sequence_leaves_rope_and_mask_alone(model):
    style = STYLES["gather_sequence"](model.layers["0"].attention)  # forward(x, rope, attn_mask)
    assert style.input_layouts == (Shard(1), None, None)
    assert style.desired_input_layouts == (Replicate(), None, None)
    style = STYLES["gather_sequence"](model.layers["0"].feed_forward)  # forward(x)
    assert style.input_layouts == (Shard(1),)


@pytest.mark.parametrize("preset", ["debug", "moe-debug"])
@pytest.mark.parametrize("etp", [1, 2])
def test_mtp_plan_matches_and_covers_the_mtp_layers(preset, etp):
    """With MTP depths the plan shards every MTP layer's block as a trunk block of its kind:
    every pattern matches a module, and each trunk block entry has its MTP twin."""
    import dataclasses

    from models import MODEL_PRESETS, build_model, tp_plan

    cfg = dataclasses.replace(MODEL_PRESETS[preset], mtp_depth=2)
    with torch.device("meta"):
        mtp_model = build_model(cfg)
    plan = tp_plan(cfg, etp=etp if preset.startswith("moe") else 1)
    assert set(plan.values()) <= set(STYLES)
    with pytest.raises(ValueError, match=r"pattern 'nope' matches no module"):
        apply_tp(mtp_model, None, {**plan, "nope": "colwise"})
    last = mtp_model.layers[str(cfg.num_layers - 1)]
    block_names = {name for name, _ in last.named_modules() if name}
    trunk = {p.removeprefix("layers.*.") for p in plan if p.startswith("layers.*.")}
    mtp = {p.removeprefix("mtp_layers.*.block.") for p in plan if p.startswith("mtp_layers.*.b")}
    assert mtp == {p for p in trunk if p in block_names}
