"""Init that scales: every rank of a GPT of 24 tiny blocks (FSDP over 4 ranks, and FSDP x tp)
gets bitwise its slice of the single-process init, while at most one full-size tensor (the
largest parameter, far less than the model) exists at a time on top of its shards. A bf16 model
starts from the fp32 model's init, rounded.

The ranks are simulated one after the other on a fake process group: init communicates nothing
(each rank cuts its own slice), so this checks exactly what a real rank computes, in seconds."""

from __future__ import annotations

import dataclasses
import weakref

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import distribute_tensor

import graphtrain.parallel.init as init_module
from graphtrain.optim import cast_parameters_
from graphtrain.parallel import ParallelDims, apply_reproducible_init, build_mesh, parallelize_model
from models.gpt import PRESETS, build_gpt
from models.gpt_plan import GPT_TP_PLAN

fake_pg = pytest.importorskip("torch.testing._internal.distributed.fake_pg")
CFG = dataclasses.replace(PRESETS["debug"], num_layers=24)
WORLD = 4


def _rank_init(rank: int, dims: ParallelDims, monkeypatch) -> tuple[torch.nn.Module, int]:
    """This rank's initialised model and the peak bytes of full-size tensors alive at once."""
    live, peak = [0], [0]
    allocate = init_module._full_like

    def tracked(param):
        full = allocate(param)
        nbytes = full.numel() * full.element_size()
        live[0] += nbytes
        peak[0] = max(peak[0], live[0])
        weakref.finalize(full, lambda: live.__setitem__(0, live[0] - nbytes))
        return full

    monkeypatch.setattr(init_module, "_full_like", tracked)
    dist.init_process_group("fake", store=fake_pg.FakeStore(), rank=rank, world_size=WORLD)
    try:
        with torch.device("meta"):
            model = build_gpt(CFG)
        parallelize_model(
            model,
            build_mesh(dims, "cpu"),
            dims,
            plan=GPT_TP_PLAN,
            ac_mode="none",
            compile_options=None,
            param_dtype=torch.float32,
            reduce_dtype=torch.float32,
        )
        model.to_empty(device="cpu")
        model.init_weights(seed=5)
        return model, peak[0]
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("layout", [{"dp_shard": 4}, {"dp_shard": 2, "tp": 2}])
def test_each_rank_gets_its_slice_with_one_full_tensor_at_a_time(layout, monkeypatch):
    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    with torch.device("meta"):
        reference = build_gpt(CFG)
    reference.to_empty(device="cpu")
    reference.init_weights(seed=5)
    full = dict(reference.named_parameters())
    sizes = {n: p.numel() * p.element_size() for n, p in full.items()}
    dims = ParallelDims(**layout, world_size=WORLD)
    for rank in range(WORLD):
        model, peak = _rank_init(rank, dims, monkeypatch)
        for name, p in model.named_parameters():
            mine = distribute_tensor(
                full[name].detach(), p.device_mesh, p.placements, src_data_rank=None
            )
            assert torch.equal(p.to_local(), mine.to_local()), (rank, name)
        # Before: every parameter full at once (sum(sizes): 24 blocks and the rest).
        assert peak == max(sizes.values()) < sum(sizes.values()) / 10


def test_bf16_parameters_start_from_the_fp32_init_rounded():
    """torch draws other random streams for bf16 tensors than for fp32 ones (different again
    between torch versions): init draws in fp32 and rounds once, bitwise the fp32 init."""
    models = []
    for dtype in (torch.float32, torch.bfloat16):
        with torch.device("meta"):
            model = build_gpt(PRESETS["debug"])
        cast_parameters_(model, dtype)
        apply_reproducible_init(model)
        model.to_empty(device="cpu")
        model.init_weights(seed=5)
        models.append(model)
    fp32, bf16 = (dict(m.named_parameters()) for m in models)
    for name, p in bf16.items():
        assert p.dtype == torch.bfloat16, name
        assert torch.equal(p, fp32[name].to(torch.bfloat16)), name
