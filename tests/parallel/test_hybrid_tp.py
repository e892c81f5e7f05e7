"""Tensor parallelism of the hybrid models (models/hybrid_plan.py): Gated DeltaNet mixers split
by head, on 2 CPU ranks (gloo), and with FSDP on 4 (dp_shard=2 x tp=2), against one process of
the same fp32 model.

hybrid-debug ("GGG*": 3 GDN blocks, one attention block) on rows of two packed documents (the
boundary not at the tp shard boundary): the first step's loss and every parameter's gradient
(full tensors, after the partial gradients are summed over tp), then the losses of STEPS AdamW
steps, eager and compiled (aot_eager with graphtrain's passes, so the recurrence runs as the
gated_delta_rule pass's op). Under FSDP each dp rank takes its own rows, its loss averaged over
dp. Tolerances: the layouts add the same fp32 numbers in another order (matmuls split over
heads, reduce-scattered; norm weight gradients summed over ranks), a few ulps; a wrong split (a
head's conv channels or decay on another rank, a gradient not summed) moves gradients by O(1)
relative and the losses by > 1e-3 after one step at LR 1e-2.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from parallel_dist import run_ranks

from models import MODEL_PRESETS, build_model, tp_plan

SEED, STEPS, LR = 1234, 3, 1e-2
BATCH, SEQ, CUT = 2, 16, 5
# Under tp an MoE layer routes each rank's own tokens (models/moe_plan.py, expert TP 1), so its
# balance losses would see slices of the sequences: off, the layouts then compute one loss.
_NO_AUX = {"aux_loss_coef": 0.0, "seq_aux_loss_coef": 0.0}
SPECS = {
    "tp": {"preset": "hybrid-debug", "compile": None, "dp_shard": 1},
    "tp_compile": {"preset": "hybrid-debug", "compile": {"inner": "aot_eager"}, "dp_shard": 1},
    "tp_moe": {"preset": "hybrid-moe-debug", "compile": None, "dp_shard": 1},
    "fsdp_tp": {"preset": "hybrid-debug", "compile": None, "dp_shard": 2},
}
TP_SPECS = sorted(name for name, spec in SPECS.items() if spec["dp_shard"] == 1)


def _batch(vocab: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(SEED + 1)
    doc = (torch.arange(SEQ) >= CUT).long()
    mask = (doc[:, None] == doc[None, :]) & torch.ones(SEQ, SEQ, dtype=torch.bool).tril()
    return {
        "input_ids": torch.randint(0, vocab, (BATCH, SEQ), generator=g),
        "labels": torch.randint(0, vocab, (BATCH, SEQ), generator=g),
        "position_ids": (torch.arange(SEQ) - CUT * doc).expand(BATCH, SEQ).clone(),
        "attn_mask": mask.expand(BATCH, 1, SEQ, SEQ).clone(),
        "document_ids": doc.expand(BATCH, SEQ).clone(),
    }


def _full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone()


def _run(model: torch.nn.Module, finish_grads, rows=slice(None), dp_group=None) -> dict:
    """First step's loss and full gradients, then the losses of STEPS AdamW steps, on `rows`
    of the batch; the losses averaged over `dp_group` (each rank's rows the same size)."""
    data = {k: v[rows] for k, v in _batch(model.cfg.vocab_size).items()}
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)
    losses, grads = [], {}
    for step in range(STEPS):
        loss = model(**data)
        loss.backward()
        finish_grads()
        if step == 0:
            grads = {n: _full(p.grad) for n, p in model.named_parameters()}
        opt.step()
        opt.zero_grad(set_to_none=True)
        if dp_group is not None:
            loss = loss.detach()
            torch.distributed.all_reduce(loss, group=dp_group)
            loss /= torch.distributed.get_world_size(dp_group)
        losses.append(loss.item())
    return {"losses": losses, "grads": grads}


def _config(preset: str):
    cfg = MODEL_PRESETS[preset]
    return dataclasses.replace(cfg, **_NO_AUX) if hasattr(cfg, "aux_loss_coef") else cfg


def _reference(preset: str) -> dict:
    with torch.device("meta"):
        model = build_model(_config(preset))
    model.to_empty(device="cpu")
    model.init_weights(SEED)
    return _run(model, lambda: None)


def _tp_split(p: torch.Tensor) -> bool:
    """Whether parameter p is sharded over the tp axis (under FSDP every one is a DTensor)."""
    names = getattr(p, "device_mesh", None) and p.device_mesh.mesh_dim_names
    return bool(names) and "tp" in names and p.placements[names.index("tp")].is_shard()


def tp_ranks(rank: int, world_size: int, names: list[str]) -> dict:
    """Specs `names` (all of one dp_shard, tp=2 on the remaining ranks) on this rank."""
    from graphtrain.parallel import ParallelDims, build_mesh, parallelize_model

    (dp_shard,) = {SPECS[name]["dp_shard"] for name in names}
    dims = ParallelDims(dp_shard=dp_shard, tp=2, world_size=world_size)
    mesh = build_mesh(dims, "cpu")
    dp_rank = mesh["dp_shard"].get_local_rank()
    rows = slice(dp_rank * BATCH // dp_shard, (dp_rank + 1) * BATCH // dp_shard)
    dp_group = mesh["dp_shard"].get_group() if dp_shard > 1 else None
    out = {}
    for name in names:
        spec = SPECS[name]
        torch._dynamo.reset()
        cfg = _config(spec["preset"])
        with torch.device("meta"):
            model = build_model(cfg)
        finish_grads = parallelize_model(
            model,
            mesh,
            dims,
            plan=tp_plan(cfg),
            ac_mode="none",
            compile_options=spec["compile"],
            param_dtype=torch.float32,
            reduce_dtype=torch.float32,
        )
        model.to_empty(device="cpu")
        with torch.no_grad():
            for p in model.parameters():
                (p.to_local() if hasattr(p, "to_local") else p).fill_(math.nan)
        model.init_weights(SEED)
        out[name] = _run(model, finish_grads, rows, dp_group)
        out[name]["split"] = sorted(n for n, p in model.named_parameters() if _tp_split(p))
    return out


@pytest.fixture(scope="module")
def ranks() -> list[dict]:
    return run_ranks(tp_ranks, 2, TP_SPECS)


# ~70 s on 2 cores for the three (one spawn of 2 ranks, three models, one compiled).
@pytest.mark.slow
@pytest.mark.parametrize("name", TP_SPECS)
def test_tp2_equals_one_process(ranks, name):
    _check(ranks, name)


@pytest.mark.slow
def test_fsdp2_x_tp2_equals_one_process():
    """dp_shard=2 x tp=2 on 4 ranks: FSDP2 shards the tp shards (2-D parameters), each dp rank
    trains on one of the two rows, the gradients reduce-scattered over dp and the shared norm
    weights' summed over tp."""
    _check(run_ranks(tp_ranks, 4, ["fsdp_tp"]), "fsdp_tp")


def _check(ranks: list[dict], name: str) -> None:
    ref = _reference(SPECS[name]["preset"])
    assert ref["losses"][-1] < ref["losses"][0] - 0.1  # it learns: equal losses mean something
    for r in ranks:
        result = r[name]
        assert result["losses"] == pytest.approx(ref["losses"], rel=1e-5), name
        assert result["grads"].keys() == ref["grads"].keys()
        for key, expected in ref["grads"].items():
            torch.testing.assert_close(
                result["grads"][key], expected, rtol=1e-4, atol=1e-6, msg=f"{name}: {key}"
            )
    # Every per-head tensor of the GDN mixers is split, the shared gated-norm weight is not.
    split = ranks[0][name]["split"]
    for part in ("in_proj_qkvz", "in_proj_ba", "conv1d", "A_log", "dt_bias", "out_proj"):
        assert f"layers.0.linear_attention.{part}" in " ".join(split), part
    assert "layers.0.linear_attention.norm.weight" not in split


@pytest.mark.parametrize("preset", ["hybrid-debug", "hybrid-moe-debug"])
@pytest.mark.parametrize("pattern", ["GGG*", "G", "*"])
@pytest.mark.parametrize("mtp", [0, 1])
def test_every_plan_pattern_matches_a_module(preset, pattern, mtp):
    """Whatever the layer pattern (GDN only, attention only) and with an MTP layer (an
    attention block), every entry of the plan matches a module: apply_tp checks all of them
    before it touches the mesh, so reaching the extra entry's error means they all matched."""
    from graphtrain.parallel import STYLES, apply_tp

    cfg = dataclasses.replace(MODEL_PRESETS[preset], layer_pattern=pattern, mtp_depth=mtp)
    with torch.device("meta"):
        model = build_model(cfg)
    plan = tp_plan(cfg)
    assert set(plan.values()) <= set(STYLES)
    assert any(p.startswith("layers.*.linear_attention") for p in plan) == ("G" in pattern)
    with pytest.raises(ValueError, match=r"pattern 'nope' matches no module"):
        apply_tp(model, None, {**plan, "nope": "colwise"})
