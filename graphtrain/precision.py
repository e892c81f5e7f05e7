"""Mixed precision: every dtype decision of a run, made once from the config, the parallel
layout and the device (graphtrain.run builds it; the model, the step and the optimizer get
what it says).

    master       training.master_dtype: the parameters as stored, reduced into and stepped
    compute      the matmuls' dtype: the master's when it is 16-bit (pure low precision), else
                 training.dtype ("auto": bf16 on CUDA, fp32 elsewhere)
    reduce       training.reduce_dtype: FSDP2's gradient reduction
    state        optim.state_dtype: AdamW's moments
    autocast     autocast casts per use: 16-bit compute, no data parallelism (FSDP2 casts its
                 shards itself, once per all-gather); with 16-bit masters too, where it keeps
                 the ops it runs in fp32 (softmax, norms) in fp32
    working      training.working_weights with fp32 masters and 16-bit compute: the masters that
                 would be cast on every use get 16-bit copies (working_masters), except those
                 the compiled graph casts itself (graph_cast: concatenated, or FP8)
    pipeline     the activations between pipeline stages: the compute dtype where FSDP2 or
                 16-bit masters make it the residual's, else fp32 (autocast keeps the residual
                 in fp32)
"""

from __future__ import annotations

import contextlib
import dataclasses

import torch
from torch import nn

from graphtrain.config import JobConfig
from graphtrain.optim import working_weight_params
from graphtrain.parallel import ParallelDims, expert_params
from graphtrain.passes.fp8_linear import fp8_weights
from graphtrain.passes.fuse_sibling_grouped_mm import concatenated_weights

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclasses.dataclass(frozen=True)
class Precision:
    master: torch.dtype
    compute: torch.dtype
    reduce: torch.dtype
    state: torch.dtype
    autocast: bool
    working: bool
    pipeline: torch.dtype
    data_parallel: bool  # FSDP2 or DDP-style replicas: who casts for compute

    @classmethod
    def of(cls, cfg: JobConfig, dims: ParallelDims, device: torch.device) -> Precision:
        t = cfg.training
        master = DTYPES[t.master_dtype]
        if master != torch.float32:  # pure low precision: compute in it too
            compute = master
        elif t.dtype == "auto":
            compute = torch.bfloat16 if device.type == "cuda" else torch.float32
        else:
            compute = DTYPES[t.dtype]
        mixed = master == torch.float32 and compute != torch.float32
        data_parallel = dims.dp_size > 1
        return cls(
            master=master,
            compute=compute,
            reduce=DTYPES[t.reduce_dtype],
            state=DTYPES[cfg.optim.state_dtype],
            autocast=compute != torch.float32 and not data_parallel,
            working=mixed and t.working_weights,
            pipeline=compute if data_parallel or master != torch.float32 else torch.float32,
            data_parallel=data_parallel,
        )

    def autocast_context(self, device: torch.device) -> contextlib.AbstractContextManager:
        """torch.autocast where autocast casts for compute, else a no-op context."""
        if not self.autocast:
            return contextlib.nullcontext()
        return torch.autocast(device.type, dtype=self.compute)

    def working_masters(self, model: nn.Module, cfg: JobConfig) -> list[nn.Parameter]:
        """The fp32 master weights that get 16-bit working copies, as they would otherwise be
        cast on every use: the matmul weights under autocast (no data parallelism), or under
        FSDP2 the expert-parallel weights it leaves alone (the experts cast them to the
        activations' dtype). Not the weights the compiled graph casts itself (graph_cast).
        None without copies."""
        if not self.working:
            return []
        masters = expert_params(model) if self.data_parallel else working_weight_params(model)
        cast = {id(p) for p in graph_cast(model, cfg)}
        return [p for p in masters if id(p) not in cast]


def graph_cast(model: nn.Module, cfg: JobConfig) -> list[nn.Parameter]:
    """The weights the compiled graph casts itself from the fp32 master, to which a working
    copy would add its bytes and save no cast: those it concatenates (the experts' w1 and w3,
    concatenated_weights: the concatenation casts) and the FP8 linears' (fp8_weights: the op's
    FP8 cast reads the master, 4 bytes a weight where a copy costs its write, its read and the
    gradient's widening; docs/design/working_weights.md)."""
    return [*concatenated_weights(model, cfg.compile), *fp8_weights(model, cfg)]
