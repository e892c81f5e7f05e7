"""WorkingWeights: bf16 working copies of fp32 masters under CPU autocast (bf16, as on a GPU).

Which parameters get copies; the train step with copies against autocast casting on every use
(bitwise, over micro-batches and steps); the copies refreshed after every optimizer step; the
gradients reaching the fp32 masters summed in fp32 (against float64); DTensor masters."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F
from test_step import CFG, SEQ, batches
from torch import nn

from graphtrain.optim import (
    BatchSizeSchedule,
    FP32GradAccumulator,
    LRSchedule,
    WorkingWeights,
    working_weight_params,
)
from graphtrain.step import ForwardLoss, TrainStep
from models import MODEL_PRESETS, build_model


def _names(model: nn.Module) -> set[str]:
    chosen = {id(p) for p in working_weight_params(model)}
    return {name for name, p in model.named_parameters() if id(p) in chosen}


def test_copies_for_matmul_weights_only():
    model = build_model(MODEL_PRESETS["moe-debug"])
    names = _names(model)
    every = dict(model.named_parameters())
    # Embedding and head stay fp32 under autocast (the fused loss's fp32 head gradient), and so
    # do the norms (1-D, applied in fp32).
    expected = {
        name
        for name, p in every.items()
        if p.ndim >= 2 and not name.startswith(("tok_embeddings.", "output."))
    }
    assert names == expected
    assert any(".experts." in n for n in names) and any(".gate." in n for n in names)
    assert not any("norm" in n for n in names)
    assert len(names) < len(every)


def _step(
    model: nn.Module,
    weights: WorkingWeights,
    num_micro: int,
    autocast: contextlib.AbstractContextManager | None = None,
) -> TrainStep:
    autocast = autocast or torch.autocast("cpu", dtype=torch.bfloat16)
    return TrainStep(
        forward=ForwardLoss(model, torch.device("cpu"), "sdpa", autocast, weights),
        optimizer=torch.optim.AdamW(model.parameters(), lr=1e-2),
        lr_schedule=LRSchedule(
            lr=1e-2, min_lr=0.0, warmup_steps=0, decay_steps=0, total_steps=10, decay_style="linear"
        ),
        batch_schedule=BatchSizeSchedule.parse(num_micro * 2 * SEQ),
        fp32_grads=FP32GradAccumulator(model, []),
        finish_gradients=lambda: None,
        max_norm=1.0,
        hooks=[],
        model_cfg=CFG,
        micro_batch_size=2,
        seq_len=SEQ,
        dp_size=1,
    )


def _model() -> nn.Module:
    model = build_model(CFG)
    model.init_weights(seed=0)
    return model


def test_train_step_equals_autocast_per_use_and_refreshes_the_copies():
    """Three steps of three micro-batches: the losses, grad norms and fp32 masters are bitwise
    those of autocast casting the fp32 weights on every use; after every optimizer step the
    copies hold the new masters rounded; outside the step the model holds its masters."""
    plain, copied = _model(), _model()
    plain_step = _step(plain, WorkingWeights(plain, [], torch.bfloat16), 3)
    weights = WorkingWeights(copied, working_weight_params(copied), torch.bfloat16)
    copied_step = _step(copied, weights, 3)
    assert len(weights.copies) > 0
    for step in range(3):
        data = batches(3)
        a, b = plain_step(data, step=step), copied_step(data, step=step)
        assert torch.equal(a.loss, b.loss) and torch.equal(a.grad_norm, b.grad_norm)
        for (name, p), q in zip(plain.named_parameters(), copied.parameters(), strict=True):
            assert q.dtype == torch.float32 and torch.equal(p, q), name
        for master, copy in zip(weights.masters, weights.copies, strict=True):
            assert copy.dtype == torch.bfloat16
            assert torch.equal(copy, master.detach().to(torch.bfloat16))
        assert all(p.grad is None for p in [*copied.parameters(), *weights.copies])
    with weights.installed():
        installed = {id(p) for p in copied.parameters()}
    assert {id(c) for c in weights.copies} <= installed
    assert not {id(c) for c in weights.copies} & {id(p) for p in copied.parameters()}


class _Probe(nn.Module):
    """loss = sum(linear(I, W) * G^T) = sum(W * G): W's gradient is G exactly, whatever the
    GEMM's precision, so each micro-batch hands the hook a chosen bf16 gradient."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(16, 16, bias=False)

    def forward(self, g: torch.Tensor) -> torch.Tensor:
        x = torch.eye(16)
        return (F.linear(x, self.proj.weight) * g.T).sum()


def test_gradients_reach_the_master_summed_in_fp32():
    """One large micro-batch gradient, then 63 small ones: in bf16 the small additions to ~1.0
    round away, in fp32 they add up; the master's .grad is fp32 and within fp32 rounding of the
    float64 sum (and bitwise autocast's fp32 accumulation)."""
    gen = torch.Generator().manual_seed(0)
    grads = [torch.ones(16, 16)] + [torch.rand(16, 16, generator=gen) * 2e-3 for _ in range(63)]
    grads = [g.to(torch.bfloat16) for g in grads]  # what a bf16 GEMM hands back

    def accumulate(with_copies: bool) -> torch.Tensor:
        model = _Probe()
        masters = working_weight_params(model) if with_copies else []
        weights = WorkingWeights(model, masters, torch.bfloat16)
        with weights.installed():
            for g in grads:
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    loss = model(g.float())
                loss.backward()
        assert model.proj.weight.dtype == torch.float32
        return model.proj.weight.grad

    total = accumulate(with_copies=True)
    exact = torch.stack([g.double() for g in grads]).sum(0)
    assert total.dtype == torch.float32
    # 64 fp32 additions of positive terms: at most 64 roundings of 2^-24 relative each.
    bound = 64 * 2.0**-24 * exact.abs()
    assert ((total.double() - exact).abs() <= bound).all()
    assert torch.equal(total, accumulate(with_copies=False))  # autocast's own fp32 sums
    # The check has teeth: bf16 accumulation loses the small gradients (~6% of the total).
    in_bf16 = grads[0].clone()
    for g in grads[1:]:
        in_bf16 += g
    assert ((in_bf16.double() - exact).abs() > 100 * bound).any()


def test_bf16_masters_are_refused():
    model = _Probe().to(torch.bfloat16)
    with pytest.raises(ValueError, match=r"need fp32 master weights, got torch\.bfloat16"):
        WorkingWeights(model, working_weight_params(model), torch.bfloat16)


def test_dtensor_masters(one_rank_group):
    """Tensor-parallel (DTensor) masters on a one-rank mesh: copies keep the placements, the
    refresh and the gradient hook work on DTensors."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (1,))
    model = _Probe()
    model.proj.weight = nn.Parameter(
        distribute_tensor(model.proj.weight.detach(), mesh, [Shard(0)])
    )
    weights = WorkingWeights(model, working_weight_params(model), torch.bfloat16)
    (copy,) = weights.copies
    assert isinstance(copy, DTensor) and copy.placements == (Shard(0),)
    g = torch.rand(16, 16)
    for _ in range(2):
        with weights.installed(), torch.autocast("cpu", dtype=torch.bfloat16):
            x = distribute_tensor(torch.eye(16), mesh, [Shard(0)])
            loss = (F.linear(x, model.proj.weight).full_tensor() * g.T).sum()
        loss.backward()
    grad = model.proj.weight.grad
    assert isinstance(grad, DTensor) and grad.dtype == torch.float32
    torch.testing.assert_close(grad.full_tensor(), 2 * g.to(torch.bfloat16).float(), rtol=0, atol=0)
    with torch.no_grad():
        model.proj.weight.mul_(3)
    weights.refresh()
    assert torch.equal(copy.full_tensor(), model.proj.weight.full_tensor().to(torch.bfloat16))


def test_no_copies_change_nothing():
    model = _Probe()
    before = model.proj.weight
    weights = WorkingWeights(model, [], torch.bfloat16)
    with weights.installed():
        assert model.proj.weight is before
    weights.refresh()
    assert weights.copies == []


@pytest.mark.parametrize("preset", ["debug", "moe-debug"])
def test_tensor_parallel_model_on_a_one_rank_mesh(one_rank_group, preset):
    """The model with its real tensor-parallel plan (DTensor masters, colwise/rowwise, sequence
    parallel; moe-debug: MoE layers with expert TP 1, their gradients partial over tp) on a
    one-rank tp mesh: two steps of two micro-batches with copies are bitwise those of autocast
    on the fp32 DTensor masters."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    from graphtrain.parallel import apply_tp
    from models import tp_plan

    cfg = MODEL_PRESETS[preset]
    mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("tp",))
    models = []
    for _ in range(2):
        model = build_model(cfg)
        apply_tp(model, mesh["tp"], tp_plan(cfg, 1, 1))
        model.init_weights(seed=0)
        models.append(model)
    plain, copied = models
    weights = WorkingWeights(copied, working_weight_params(copied), torch.bfloat16)
    assert weights.copies and any(isinstance(c, DTensor) for c in weights.copies)
    plain_step = _step(plain, WorkingWeights(plain, [], torch.bfloat16), 2)
    copied_step = _step(copied, weights, 2)
    for step in range(2):
        data = batches(2)
        a, b = plain_step(data, step=step), copied_step(data, step=step)
        assert torch.equal(a.loss, b.loss) and torch.equal(a.grad_norm, b.grad_norm)
    for (name, p), q in zip(plain.named_parameters(), copied.parameters(), strict=True):
        assert torch.equal(_full(p), _full(q)), name


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def test_expert_weights_under_fsdp_on_a_one_rank_mesh(one_rank_group):
    """moe-debug with expert parallel and FSDP2 (bf16 MixedPrecisionPolicy) on one-rank meshes:
    FSDP2 casts its units' shards itself, and the expert weights it ignores (cast by the experts
    on every use) get copies, as the trainer gives them: two steps of two micro-batches bitwise
    those without copies."""
    from torch.distributed.device_mesh import init_device_mesh

    from graphtrain.parallel import apply_ep, apply_fsdp, expert_params

    cfg = MODEL_PRESETS["moe-debug"]
    mesh = init_device_mesh("cpu", (1, 1), mesh_dim_names=("dp_shard", "ep"))
    models = []
    for _ in range(2):
        model = build_model(cfg)
        apply_ep(model, mesh["ep"])
        apply_fsdp(
            model,
            mesh["dp_shard"],
            param_dtype=torch.bfloat16,
            reduce_dtype=torch.float32,
            ignored_params=set(expert_params(model)),
        )
        model.init_weights(seed=0)
        models.append(model)
    plain, copied = models
    weights = WorkingWeights(copied, expert_params(copied), torch.bfloat16)
    assert len(weights.copies) == 3 * (cfg.num_layers - cfg.first_k_dense)
    steps = [
        _step(model, w, 2, autocast=contextlib.nullcontext())
        for model, w in ((plain, WorkingWeights(plain, [], torch.bfloat16)), (copied, weights))
    ]
    for step in range(2):
        data = batches(2)
        a, b = (s(data, step=step) for s in steps)
        assert torch.equal(a.loss, b.loss) and torch.equal(a.grad_norm, b.grad_norm)
    for (name, p), q in zip(plain.named_parameters(), copied.parameters(), strict=True):
        assert torch.equal(_full(p), _full(q)), name
