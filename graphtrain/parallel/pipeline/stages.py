"""The model cut into this rank's stages: the pruned meta-device model, its init reproducing
the whole model's values, and the stage modules the schedule runs."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Shard
from torch.overrides import TorchFunctionMode

from graphtrain.parallel.init import RANDOM_INPLACE
from graphtrain.parallel.pipeline.layout import StageSpec, stage_rank


def _scratch(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    # Low-precision tensors are drawn in fp32 (graphtrain.parallel.init).
    dtype = torch.float32 if tensor.element_size() < 4 else tensor.dtype
    return torch.empty(tensor.shape, dtype=dtype, device=device)


def _meta_draw(fn: Callable[..., Any], device: torch.device) -> Callable[..., Any]:
    """fn, except that on a meta tensor (a part of the model another stage holds) it draws the
    same random numbers on a scratch tensor and drops them: the draws that follow then give
    this stage's parameters the whole model's values."""

    def init(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if not tensor.is_meta:
            return fn(tensor, *args, **kwargs)
        fn(_scratch(tensor, device), *args, **kwargs)
        return tensor

    return init


class _MetaDraws(TorchFunctionMode):
    """_meta_draw for the random in-place Tensor methods, which an init may call directly (the
    Gated DeltaNet's A_log and dt_bias: torch.empty_like(param).uniform_(...)): on a meta tensor
    they draw on a scratch tensor, whose numbers are dropped."""

    def __init__(self, device: torch.device) -> None:
        super().__init__()
        self.device = device

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in RANDOM_INPLACE and args and args[0].is_meta:
            func(_scratch(args[0], self.device), *args[1:], **kwargs)
            return args[0]
        return func(*args, **kwargs)


class _StageInit:
    """model.init_weights of a cut model: the whole model's init on a skeleton (the whole model
    on the meta device with this rank's parts put in), meta parts drawn and dropped."""

    def __init__(self, model: nn.Module, build: Callable[[], nn.Module]) -> None:
        self.model, self.build = model, build

    def __call__(self, seed: int | None = None) -> None:
        model = self.model
        with torch.device("meta"):
            skeleton = self.build()
        for name in ("tok_embeddings", "norm", "output"):
            if hasattr(model, name):
                setattr(skeleton, name, getattr(model, name))
        for name, layer in model.layers.items():
            skeleton.layers[name] = layer
        for name, layer in getattr(model, "mtp_layers", {}).items():
            skeleton.mtp_layers[name] = layer
        skeleton.rope = model.rope  # a buffer: init_weights fills it in place
        device = model.rope.device
        names = [n for n in dir(nn.init) if n.endswith("_") and not n.startswith("_")]
        originals = {n: getattr(nn.init, n) for n in names}
        try:
            for name, fn in originals.items():
                setattr(nn.init, name, _meta_draw(fn, device))
            with _MetaDraws(device):
                type(skeleton).init_weights(skeleton, seed)
        finally:
            for name, fn in originals.items():
                setattr(nn.init, name, fn)


class PipelineStageModule(nn.Module):
    """One stage as the schedule runs it: its parts of the cut model (registered here too, so
    the schedule sees their parameters), its inputs from the previous stage (or the token ids)
    and the micro-batch's side inputs (positions, mask, labels) from the runner by index.
    An MTP stage also holds the embedding, final norm and head (copies where another rank's
    stage owns them: graphtrain.parallel.pipeline.runner reduces their gradients).

    shared_embedding: the embedding where two stages of this rank run it (a V schedule puts the
    MTP stage beside the embedding's): not a child of either, so that under FSDP2 it is a root
    of its own (fsdp_roots; one unit under two stage roots is refused), yet among both stages'
    parameters(), which a zero-bubble schedule's weight half differentiates."""

    def __init__(self, model: nn.Module, spec: StageSpec, shared_embedding: bool = False) -> None:
        super().__init__()
        self.spec = spec
        self.__dict__["_model"] = model  # not a child: its parameters are not this stage's
        self.__dict__["shared_embedding"] = None
        if (spec.embedding or spec.mtp) and shared_embedding:
            self.__dict__["shared_embedding"] = model.tok_embeddings
        elif spec.embedding or spec.mtp:
            self.tok_embeddings = model.tok_embeddings
        self.layers = nn.ModuleList([model.layers[str(i)] for i in spec.layers])
        if spec.head or spec.mtp:
            self.norm, self.output = model.norm, model.output
        if spec.mtp:
            self.mtp_layers = nn.ModuleList([model.mtp_layers[str(k)] for k in spec.mtp])
        self.micro_batches: list[dict[str, Any]] = []
        self.weights: list[float] = []  # each micro-batch's loss weight (its token share)
        self.balance: Any = None  # graphtrain.balance.RouterBalance of an MoE model
        # The routers of its layers and MTP depths (models.moe's names for them).
        self.router_layers = {f"layers.{i}" for i in spec.layers}
        self.router_layers |= {f"mtp_layers.{k}.block" for k in spec.mtp}
        self.tp_mesh: Any = None  # set under tensor parallel: activations are Shard(1) on it
        # The main head's and MTP depths' statistics of the step (with MTP), weighted by each
        # micro-batch's loss weight.
        self.stats: dict[str, torch.Tensor] = {}
        # Views of the step's outputs under a zero-bubble schedule (the runner's
        # _split_backward says why), else None.
        self.graphs: list[torch.Tensor] | None = None

    def parameters(self, recurse: bool = True) -> Iterator[nn.Parameter]:
        yield from super().parameters(recurse)
        if recurse and self.shared_embedding is not None:
            yield from self.shared_embedding.parameters()

    def forward(
        self, h: torch.Tensor, *loss: torch.Tensor, micro_batch: torch.Tensor
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """h: token ids (B, T) on the first stage, else the previous stage's (B, T, dim); an
        MTP stage after the head's also gets the head's loss (1,). micro_batch: a CPU tensor
        holding the micro-batch's index (no device sync)."""
        out = self._forward(h, loss, int(micro_batch))
        if self.graphs is not None:
            outputs = out if isinstance(out, tuple) else (out,)
            self.graphs += [t.view_as(t) for t in outputs if t.requires_grad]
        return out

    def _forward(self, h: torch.Tensor, loss: tuple, micro_batch: int) -> Any:
        if self.balance is None or not self.training:
            return self._run(h, loss, micro_batch)
        # MoE: this stage's routers get the micro-batch's aux-loss scale and count its tokens
        # after its forward (with no activation checkpointing, nothing recomputes it).
        with self.balance.micro_batch(self.weights[micro_batch], self.router_layers):
            return self._run(h, loss, micro_batch)

    def _run(self, h: torch.Tensor, loss: tuple, micro_batch: int) -> Any:
        inputs = self.micro_batches[micro_batch]
        model = self._model
        rope = model.rope[inputs["position_ids"]]  # (B, T, D/2, 2)
        if self.spec.embedding:
            h = model.tok_embeddings(h)
        elif self.tp_mesh is not None:
            # Sequence parallel: the previous stage sent its (B, T/tp, dim) slice, plain (the
            # schedule's point-to-point needs no DTensor support that way, on any torch).
            h = DTensor.from_local(h, self.tp_mesh, [Shard(1)], run_check=False)
        mask, documents = inputs["attn_mask"], inputs.get("document_ids")
        for layer in self.layers:
            # The model says what each layer takes (a hybrid's recurrent blocks: the documents).
            h = layer(h, *model.block_inputs(layer, rope, mask, documents))
        # The model's flag (validation sets it, not the stages'): MTP is a training loss only.
        training = model.training
        if self.spec.head:
            if not (training and model.cfg.mtp_depth):
                loss = (model.head_loss(h, inputs["labels"]),)
            else:  # as GPT.forward: the main head's call counts hits as the depths' do
                stats = self._micro_batch_stats(micro_batch)
                loss = (model.scored_head_loss(h, inputs["labels"], stats, depth=0),)
            if self.spec.hidden_to_mtp and training:
                # A copy, not a view: the zero-bubble schedules detach a stage's outputs in
                # place after its input backward, which a view refuses.
                return self._send(h), loss[0].reshape(1).clone()
        if self.spec.mtp and training:
            mtp = model.mtp_loss(
                h, inputs["input_ids"], inputs["labels"], rope, inputs["attn_mask"],
                inputs["document_ids"], self._micro_batch_stats(micro_batch),
            )  # fmt: skip
            loss = (loss[0].reshape(()) + mtp,)
        if loss:
            # (1,): the schedule concatenates stage outputs, which a 0-d loss cannot be.
            return loss[0].reshape(1)
        return self._send(h)

    def _micro_batch_stats(self, micro_batch: int) -> _WeightedStats:
        return _WeightedStats(self.stats, self.weights[micro_batch])

    def _send(self, h: torch.Tensor) -> torch.Tensor:
        """The hidden state this stage sends on: under sequence parallel its (B, T/tp, dim)
        slice, plain (the schedule's point-to-point needs no DTensor support that way, on any
        torch). to_local() gives a view, which a zero-bubble schedule (self.graphs set) cannot
        detach in place after the input backward: there, a copy."""
        if not isinstance(h, DTensor):
            return h
        return h.to_local().clone() if self.graphs is not None else h.to_local()


class _WeightedStats:
    """`stats` as a stage's model calls get it: `stats[name] = value` adds the value, weighted
    by the micro-batch's loss weight, to the stage's step statistics (as TrainStep sums the
    micro-batches' without pp)."""

    __slots__ = ("target", "weight")

    def __init__(self, target: dict[str, torch.Tensor], weight: float) -> None:
        self.target, self.weight = target, weight

    def __setitem__(self, name: str, value: torch.Tensor) -> None:
        self.target[name] = self.target.get(name, 0.0) + value.float() * self.weight


def cut_model(
    model: nn.Module,
    specs: Sequence[StageSpec],
    pp_rank: int,
    pp: int,
    schedule: str,
    build: Callable[[], nn.Module],
) -> list[PipelineStageModule]:
    """Prune `model` (on the meta device, before parallelize_model) in place to the parts of
    this rank's stages, make model.init_weights reproduce the whole model's values, and return
    this rank's stage modules in stage order. build(): the whole model (for the init)."""
    mine = [s for s in specs if stage_rank(s.index, len(specs), pp, schedule) == pp_rank]
    layers = {i for s in mine for i in s.layers}
    for name in list(model.layers):
        if int(name) not in layers:
            del model.layers[name]
    if not any(s.embedding or s.mtp for s in mine):
        del model.tok_embeddings
    if not any(s.head or s.mtp for s in mine):
        del model.norm, model.output
    depths = {k for s in mine for k in s.mtp}
    for name in list(getattr(model, "mtp_layers", {})):
        if int(name) not in depths:
            del model.mtp_layers[name]
    model.init_weights = _StageInit(model, build)
    shared = sum(bool(s.embedding or s.mtp) for s in mine) > 1
    return [PipelineStageModule(model, s, shared_embedding=shared) for s in mine]


def fsdp_roots(stages: Sequence[PipelineStageModule]) -> list[nn.Module]:
    """The FSDP2 roots of this rank's stages: each stage, and before them the embedding where
    two stages share it (PipelineStageModule's shared_embedding; PipelineRunner reduces its
    gradients once per step, as torch's schedule does a stage's)."""
    shared = next((s.shared_embedding for s in stages if s.shared_embedding is not None), None)
    return [*stages] if shared is None else [shared, *stages]
