"""graphtrain.step: the train step on its own (no loop, no run directory): micro-batch weights,
step hooks around each micro-batch, model statistics into StepStats.extra."""

import contextlib

import numpy as np
import torch
from parallel_dist import run_ranks
from torch import nn

from graphtrain.data.packing import pack_rows
from graphtrain.optim import BatchSizeSchedule, FP32GradAccumulator, LRSchedule, WorkingWeights
from graphtrain.step import ForwardLoss, TrainStep
from models import MODEL_PRESETS, build_model

CFG = MODEL_PRESETS["debug"]
SEQ = 16


class WithStats(nn.Module):
    """The debug GPT, reporting its loss and a count through `stats` as a model may."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inner = build_model(CFG)
        self.inner.init_weights(seed=0)

    def forward(self, stats=None, **inputs):
        loss = self.inner(**inputs)
        if stats is not None:
            stats["test/loss"], stats["test/one"] = loss.detach(), torch.ones(())
        return loss


class Recorder:
    """A step hook that records what happens inside its micro_batch scope."""

    def __init__(self, model: nn.Module) -> None:
        self.model, self.events = model, []

    @contextlib.contextmanager
    def micro_batch(self, weight: float):
        self.events.append(("enter", weight))
        yield
        grads = [p.grad is not None for p in self.model.parameters()]
        self.events.append(("exit", all(grads)))

    def statistics(self):
        return {"test/events": torch.tensor(float(len(self.events)))}


def make_step(model: nn.Module, hooks, num_micro: int) -> TrainStep:
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return TrainStep(
        forward=ForwardLoss(
            model,
            torch.device("cpu"),
            "sdpa",
            contextlib.nullcontext(),
            WorkingWeights(model, [], torch.float32),  # fp32 compute: no copies
        ),
        optimizer=optimizer,
        lr_schedule=LRSchedule(
            lr=1e-3, min_lr=0.0, warmup_steps=0, decay_steps=0, total_steps=10, decay_style="linear"
        ),
        batch_schedule=BatchSizeSchedule.parse(num_micro * 2 * SEQ),
        fp32_grads=FP32GradAccumulator(model, []),
        finish_gradients=lambda: None,
        max_norm=1.0,
        hooks=hooks,
        model_cfg=CFG,
        micro_batch_size=2,
        seq_len=SEQ,
        dp_size=1,
    )


def batches(num: int) -> list:
    rng = np.random.default_rng(0)
    # eos_id 1: documents end inside rows, so the micro-batches hold different label counts.
    return [pack_rows(rng.integers(1, 8, size=(2, SEQ + 1)), eos_id=1) for _ in range(num)]


def test_step_weights_micro_batches_by_labels_and_collects_model_statistics():
    model = WithStats()
    recorder = Recorder(model)
    step = make_step(model, [recorder], num_micro=3)
    assert step.num_micro_batches(0) == 3
    data = batches(3)
    labels = [td["num_label_tokens"] for td in data]
    assert len(set(labels)) > 1
    with torch.no_grad():
        losses = [step.forward(td) for td in data]
    stats = step(data, step=0)

    weights = [n / sum(labels) for n in labels]
    expected = torch.zeros(())
    for loss, w in zip(losses, weights, strict=True):
        expected += loss.float() * w
    assert torch.equal(stats.loss, expected)
    # The model's statistics: the loss-weighted mean over the micro-batches, the same sums.
    assert torch.equal(stats.extra["test/loss"], stats.loss)
    torch.testing.assert_close(stats.extra["test/one"], torch.tensor(1.0))
    assert stats.extra["test/events"].item() == 6
    # Each hook scope spans the forward and the backward of its micro-batch.
    assert recorder.events == [e for w in weights for e in (("enter", w), ("exit", True))]
    assert stats.num_micro_batches == 3 and stats.tokens == 3 * 2 * SEQ and stats.flops > 0
    assert all(p.grad is None for p in model.parameters())  # zero_grad after the step
    # The sums restart at every step.
    again = step(data, step=1)
    assert torch.equal(again.extra["test/loss"], again.loss)


def test_a_model_without_statistics_adds_nothing():
    model = build_model(CFG)
    model.init_weights(seed=0)
    stats = make_step(model, [], num_micro=1)(batches(1), step=0)
    assert stats.extra == {}
    assert torch.isfinite(stats.loss) and torch.isfinite(stats.grad_norm)


def test_model_statistics_survive_fsdp2(one_rank_group):
    """FSDP2 casts the forward's inputs by rebuilding every dict: a stats dict would be filled
    as a copy and the model's statistics (MTP's loss and acceptance) would vanish under
    dp_shard > 1. The step hands the model an object that writes into its own dict."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    model = WithStats()
    mesh = init_device_mesh("cpu", (1,))
    fully_shard(model, mesh=mesh, mp_policy=MixedPrecisionPolicy(param_dtype=torch.float32))
    stats = make_step(model, [], num_micro=1)(batches(1), step=0)
    assert torch.equal(stats.extra["test/loss"], stats.loss)


def _hsdp_rank(rank: int, world_size: int) -> tuple[int, list[torch.Tensor]]:
    """The step on 2 ranks as HSDP replicas (dp_replicate=2, dp_shard=1), 3 micro-batches:
    FSDP2's all-reduces over the replicas, and the parameters after the step."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = WithStats()
    mesh = init_device_mesh("cpu", (world_size, 1), mesh_dim_names=("dp_replicate", "dp_shard"))
    fully_shard(model, mesh=mesh)
    replicas = mesh.get_group("dp_replicate")
    all_reduce, calls = dist.all_reduce, []

    def counted(tensor, *args, **kwargs):
        calls.append(kwargs.get("group") is replicas)
        return all_reduce(tensor, *args, **kwargs)

    dist.all_reduce = counted
    try:
        make_step(model, [], num_micro=3)(batches(3), step=0)
    finally:
        dist.all_reduce = all_reduce
    return sum(calls), [p.full_tensor() for p in model.parameters()]


def test_hsdp_all_reduces_over_the_replicas_once_per_step():
    """HSDP with gradient accumulation: each micro-batch's gradient is reduce-scattered within
    the replica, the all-reduce over the replicas (across nodes) runs once per step, not once
    per micro-batch; the step's update equals one process's (both replicas see the same
    batches: their mean gradient is one process's)."""
    model = WithStats()
    make_step(model, [], num_micro=3)(batches(3), step=0)
    for count, params in run_ranks(_hsdp_rank, 2):
        assert count == 1
        for got, want in zip(params, model.parameters(), strict=True):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
