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
