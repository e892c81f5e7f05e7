"""ParallelDims validation and validate_model_for_tp (no process group needed).
build_mesh runs on real ranks in test_parallel_train.py::test_mesh."""

from __future__ import annotations

import dataclasses

import pytest

from graphtrain.parallel import ParallelDims, validate_model_for_tp
from models.gpt import PRESETS


@pytest.mark.parametrize(
    ("kwargs", "shard"),
    [
        ({"world_size": 8}, 8),
        ({"tp": 2, "world_size": 8}, 4),
        ({"dp_replicate": 2, "tp": 2, "world_size": 8}, 2),
        ({"dp_replicate": 4, "world_size": 4}, 1),
        ({}, 1),
    ],
)
def test_dp_shard_minus_one_takes_the_rest(kwargs, shard):
    dims = ParallelDims(**kwargs)
    assert dims.dp_shard == shard
    assert dims.dp_replicate * dims.dp_shard * dims.tp == dims.world_size


def test_properties():
    dims = ParallelDims(dp_replicate=2, dp_shard=2, tp=2, world_size=8)
    assert (dims.dp_size, dims.fsdp_enabled, dims.hsdp, dims.tp_enabled) == (4, True, True, True)
    dims = ParallelDims(dp_replicate=2, dp_shard=1, tp=1, world_size=2)
    assert (dims.dp_size, dims.fsdp_enabled, dims.hsdp, dims.tp_enabled) == (2, False, False, False)
    dims = ParallelDims(tp=4, world_size=4)
    assert (dims.dp_size, dims.fsdp_enabled, dims.hsdp, dims.tp_enabled) == (1, False, False, True)
    with pytest.raises(dataclasses.FrozenInstanceError):
        dims.tp = 2


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (
            {"dp_replicate": 2, "dp_shard": 2, "tp": 2, "world_size": 4},
            "parallel.dp_replicate=2 * dp_shard=2 * tp=2 = 8 != world size 4",
        ),
        (
            {"dp_shard": 3, "world_size": 4},
            "parallel.dp_replicate=1 * dp_shard=3 * tp=1 = 3 != world size 4",
        ),
        (
            {"dp_replicate": 4, "tp": 1, "world_size": 6},
            "world size 6 is not divisible by parallel.dp_replicate=4 * tp=1 = 4",
        ),
        ({"tp": 0, "world_size": 4}, "parallel.tp must be >= 1, got 0"),
        ({"dp_replicate": -2, "world_size": 4}, "parallel.dp_replicate must be >= 1, got -2"),
        (
            {"dp_shard": 0, "world_size": 4},
            "parallel.dp_shard must be >= 1 or -1 (the rest), got 0",
        ),
        ({"world_size": 0}, "world size must be >= 1, got 0"),
    ],
)
def test_invalid_dims_name_the_numbers(kwargs, message):
    with pytest.raises(ValueError) as err:
        ParallelDims(**kwargs)
    assert message in str(err.value)


def test_validate_model_for_tp():
    cfg = PRESETS["debug"]  # heads 4, kv heads 2, ffn 160, vocab 512
    validate_model_for_tp(cfg, 1)
    validate_model_for_tp(cfg, 2, seq_len=16)
    with pytest.raises(ValueError, match=r"model.num_kv_heads=2 is not divisible by parallel.tp=4"):
        validate_model_for_tp(cfg, 4)
    with pytest.raises(ValueError, match=r"model.num_heads=4 is not divisible by parallel.tp=3"):
        validate_model_for_tp(cfg, 3)
    with pytest.raises(ValueError, match=r"model.ffn_dim=162 is not divisible by parallel.tp=4"):
        validate_model_for_tp(dataclasses.replace(cfg, num_kv_heads=4, ffn_dim=162), 4)
    with pytest.raises(ValueError, match=r"model.vocab_size=510 is not divisible by parallel.tp=4"):
        validate_model_for_tp(dataclasses.replace(cfg, num_kv_heads=4, vocab_size=510), 4)
    with pytest.raises(ValueError, match=r"training.seq_len=15 is not divisible by parallel.tp=2"):
        validate_model_for_tp(cfg, 2, seq_len=15)
    with pytest.raises(ValueError, match=r"parallel.etp=2 splits routed experts: it needs an MoE"):
        validate_model_for_tp(cfg, 2, etp=2)
