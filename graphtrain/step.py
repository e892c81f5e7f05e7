"""One optimizer step: micro-batches -> forward/backward -> gradients finished -> clip ->
optimizer -> statistics. A batch enters here from the loop (graphtrain.trainer) and leaves as
an optimizer update; nothing of it goes back to the loop but a StepStats.

What
    ForwardLoss(model, device, attention, autocast, weights)(batch, stats) -> the micro-batch's
        mean loss; training and validation share it. Whoever calls it installs the bf16
        working copies `weights` around the forward and the backward (weights.installed()).
    TrainStep(...)(batches, step=...) -> StepStats: each micro-batch's loss weighted by its
        share of the step's labelled tokens (the step's loss is the mean over all its tokens
        on this rank), backward, fp32 accumulation for chosen parameters, the layout's
        gradient finishing, clipping, the optimizer step, the working copies refreshed from
        the updated masters, zero_grad. num_micro_batches(consumed_tokens) says how many
        batches the loop hands it (the batch size schedule).

Step statistics (StepStats.extra), the one place to add a per-step device statistic: what the
model's forward writes with `stats[name] = detached device tensor` (logged as the loss-weighted
mean over the micro-batches; the model gets an object, not a dict, which FSDP2 would copy) and
each step hook's statistics() (a hook's micro_batch(weight) context is entered around each
micro-batch): graphtrain.balance.RouterBalance, graphtrain.compile.step_hooks. The loop logs
every entry at log steps with one host sync for all of them.
The full account (the step's order, the hook protocol): docs/design/step.md.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Protocol

import torch
from tensordict import TensorDict
from torch import nn
from torch.distributed.fsdp import FSDPModule

from graphtrain.attention import build_attention_mask
from graphtrain.metrics import model_training_flops
from graphtrain.optim import (
    AdamWCopies,
    BatchSizeSchedule,
    FP32GradAccumulator,
    LRSchedule,
    WorkingWeights,
    clip_grad_norm_,
    scale_grads_,
)


@dataclasses.dataclass(frozen=True)
class StepStats:
    """One optimizer step, as the loop sees it. Tensors are on the device, detached."""

    loss: torch.Tensor  # fp32 scalar: the step's mean loss on this rank
    grad_norm: torch.Tensor  # scalar: global norm over all ranks, before clipping
    lr: float
    num_micro_batches: int
    tokens: int  # tokens of the step over all data-parallel ranks
    flops: int  # training FLOPs of this rank's micro-batches (whole matmuls: before tp splits)
    extra: dict[str, torch.Tensor]  # step hooks' statistics, see the module docstring


class StepHook(Protocol):
    def micro_batch(self, weight: float) -> contextlib.AbstractContextManager[None]: ...

    def statistics(self) -> dict[str, torch.Tensor]: ...


def model_inputs(batch: TensorDict, device: torch.device, attention: str) -> dict[str, Any]:
    """A loader batch on `device` as the model's keyword arguments: input_ids, labels,
    position_ids, the attention mask built from the document ids for the chosen attention, and
    the document ids (MTP's shifts stay inside documents)."""
    if device.type == "cuda":
        batch = batch.pin_memory()  # so that the copy below is really asynchronous
    # varlen's spans are found in the loader's ids, on the CPU (no wait for the device)
    ids = batch["document_ids"]
    batch = batch.to(device, non_blocking=True)
    return {
        "input_ids": batch["input_ids"],
        "labels": batch["labels"],
        "position_ids": batch["position_ids"],
        "attn_mask": build_attention_mask(
            ids if attention == "varlen" else batch["document_ids"], attention, device
        ),
        "document_ids": batch["document_ids"],
    }


class _Into:
    """`stats` as the model gets it: `stats[name] = value` writes into the caller's dict. Not a
    dict itself: FSDP2's cast of the forward's inputs rebuilds every dict it is given, so the
    model would fill a copy and the statistics would never reach the log."""

    __slots__ = ("target",)

    def __init__(self, target: dict[str, torch.Tensor]) -> None:
        self.target = target

    def __setitem__(self, name: str, value: torch.Tensor) -> None:
        self.target[name] = value


@dataclasses.dataclass(frozen=True)
class ForwardLoss:
    """batch -> the model's mean loss over it (training and validation alike)."""

    model: nn.Module
    device: torch.device
    attention: str
    autocast: contextlib.AbstractContextManager  # reusable: torch.autocast or nullcontext
    weights: WorkingWeights  # bf16 working copies; callers install them around forward+backward

    def __call__(
        self, batch: TensorDict, stats: dict[str, torch.Tensor] | None = None
    ) -> torch.Tensor:
        inputs = model_inputs(batch, self.device, self.attention)
        with self.autocast:
            return self.model(**inputs, stats=None if stats is None else _Into(stats))


def loss_sums(forward: ForwardLoss, batches: Iterable[TensorDict]) -> torch.Tensor:
    """[sum of the batches' token losses, labelled tokens] in fp32 on the device, with no host
    sync: each batch's mean loss weighted by its labelled tokens, so that sum / tokens is the
    loss per token for any micro-batch size (validation, `graphtrain eval`). The caller holds
    no_grad and the model's eval mode."""
    total = torch.zeros(2, device=forward.device)
    for batch in batches:
        loss, n = forward(batch).float(), batch["num_label_tokens"]
        if n:  # a batch of padding only (every rank runs it) has a 0/0 loss
            total[0] += loss * n
        total[1] += n
    return total


@dataclasses.dataclass(frozen=True)
class TrainStep:
    forward: ForwardLoss
    optimizer: torch.optim.Optimizer
    lr_schedule: LRSchedule
    batch_schedule: BatchSizeSchedule
    fp32_grads: FP32GradAccumulator
    finish_gradients: Callable[[], None]  # graphtrain.parallel.GradientFinisher
    max_norm: float
    hooks: Sequence[StepHook]
    model_cfg: Any  # for the FLOPs count
    micro_batch_size: int
    seq_len: int
    dp_size: int
    # graphtrain.parallel.pipeline.PipelineRunner under pipeline parallelism: it runs the
    # micro-batches through its schedule, and clipping takes the norm over every stage.
    pipeline: Any = None

    def num_micro_batches(self, consumed_tokens: int) -> int:
        """Micro-batches per rank of the step that starts after `consumed_tokens`."""
        return self.batch_schedule.micro_batches_per_step(
            consumed_tokens,
            micro_batch_size=self.micro_batch_size,
            seq_len=self.seq_len,
            dp_world_size=self.dp_size,
        )

    def __call__(self, batches: list[TensorDict], *, step: int) -> StepStats:
        """Train on `batches` (this rank's micro-batches of the step) as optimizer step `step`
        (0-based). No host sync."""
        lr = self.lr_schedule.apply(self.optimizer, step)
        # Installed for every backward too: activation checkpointing recomputes the forward there.
        with self.forward.weights.installed():
            if self.pipeline is None:
                loss, flops, model_stats = self._forward_backward(batches)
            else:
                loss, flops, model_stats = self._pipeline_forward_backward(batches)
        self.fp32_grads.finalize()
        if self.pipeline is not None:
            self.pipeline.reduce_copies()
        self.finish_gradients()
        params = list(self.forward.model.parameters())
        # graphtrain's AdamW multiplies the gradients by the clip coefficient as it reads them.
        scale = scale_grads_
        if isinstance(self.optimizer, AdamWCopies):
            scale = self.optimizer.scale_grads_in_step
        if self.pipeline is None:
            grad_norm = clip_grad_norm_(params, self.max_norm, scale=scale)
        else:
            grad_norm = self.pipeline.clip_grad_norm_(params, self.max_norm, scale=scale)
        self.optimizer.step()  # step pre-hooks run first (MoE expert biases)
        self.forward.weights.refresh()  # the one cast of the step: masters -> working copies
        self.optimizer.zero_grad(set_to_none=True)
        extra = model_stats
        for hook in self.hooks:
            extra.update(hook.statistics())
        return StepStats(
            loss=loss,
            grad_norm=grad_norm,
            lr=lr,
            num_micro_batches=len(batches),
            tokens=len(batches) * self.micro_batch_size * self.seq_len * self.dp_size,
            flops=flops,
            extra=extra,
        )

    def _pipeline_forward_backward(
        self, batches: list[TensorDict]
    ) -> tuple[torch.Tensor, int, dict[str, torch.Tensor]]:
        """_forward_backward through the pipeline's schedule: its micro-batches are the step's,
        each weighted by its share of the labelled tokens as below; FLOPs: this stage's share;
        the statistics of the MTP depths in this rank's stages."""
        flops = sum(
            model_training_flops(
                self.model_cfg,
                num_tokens=batch["input_ids"].numel(),
                num_attention_pairs=int(batch["num_attention_pairs"]),
            )
            for batch in batches
        )
        with self.forward.autocast:  # the runner's stages run fp32_grads after each backward
            loss = self.pipeline.forward_backward(batches, self.hooks)
        return loss, flops // self.pipeline.pp, self.pipeline.statistics

    def _forward_backward(
        self, batches: list[TensorDict]
    ) -> tuple[torch.Tensor, int, dict[str, torch.Tensor]]:
        """Gradients of the step's loss accumulated over `batches`; (loss, FLOPs, the model's
        statistics: their loss-weighted mean over the micro-batches)."""
        step_loss = torch.zeros((), device=self.forward.device)
        model_stats: dict[str, torch.Tensor] = {}
        # Counts come from the loader (CPU tensors): no device sync.
        num_labels = [batch["num_label_tokens"] for batch in batches]
        flops = 0
        # HSDP (dp_replicate > 1): each micro-batch's gradient is reduce-scattered within its
        # replica and summed there; the all-reduce over the replicas (across nodes) runs once,
        # on the last micro-batch (FSDP2's set_requires_all_reduce; a no-op without replicas).
        model = self.forward.model
        hsdp = model if isinstance(model, FSDPModule) else None
        for i, (batch, n) in enumerate(zip(batches, num_labels, strict=True)):
            if hsdp is not None:
                hsdp.set_requires_all_reduce(i == len(batches) - 1)
            # Exact FLOPs of this rank's micro-batch (document-causal attention pairs
            # included), counted on the host from the loader's CPU-side numbers.
            flops += model_training_flops(
                self.model_cfg,
                num_tokens=batch["input_ids"].numel(),
                num_attention_pairs=int(batch["num_attention_pairs"]),
            )
            weight = n / max(sum(num_labels), 1)
            with contextlib.ExitStack() as scopes:
                for hook in self.hooks:
                    scopes.enter_context(hook.micro_batch(weight))
                batch_stats: dict[str, torch.Tensor] = {}
                loss = self.forward(batch, batch_stats)
                (loss * weight).backward()
            self.fp32_grads.after_backward()
            step_loss += loss.detach().float() * weight
            for name, value in batch_stats.items():
                model_stats[name] = model_stats.get(name, 0.0) + value.detach().float() * weight
        return step_loss, flops, model_stats
