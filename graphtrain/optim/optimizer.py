"""AdamW construction with weight-decay parameter groups.

What: `build_optimizer` splits a model's trainable parameters into a "decay" group and a "no decay"
group and returns a `torch.optim.AdamW` (fused or foreach), AdamWBF16 (bf16 moment states), or
AdamWCopies (graphtrain's kernel, whose step also writes the bf16 working copies) over them.

Why: weight decay on norms, biases and (usually) embeddings hurts LLM training, so those are excluded
by name patterns and by shape (every parameter with fewer than 2 dimensions). The fused kernel is the
fastest of torch's AdamW kernels on CUDA and on CPU (torch >= 2.4); foreach is the portable
fallback. "graphtrain" takes AdamWCopies: with working copies of fp32 masters
(graphtrain.optim.working_weights) it moves fewer bytes than the clip, the fused step and the
copies' refresh, in one pass (graphtrain.optim.adamw_copies). "auto" takes it where it was
measured, fp32 parameters on CUDA: 9.1 against 13.7 ms for moe-1b's step and +3% tokens/s on
the 1b training step (NVIDIA H200, benchmarks/RESULTS.md); elsewhere torch's fused kernel.

DTensor parameters (FSDP2 / tensor parallel) work with both implementations: AdamW is elementwise,
so DTensor runs it shard by shard on the local tensors (checked on CPU with gloo, torch 2.13).
"""

from __future__ import annotations

import fnmatch
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from graphtrain.optim.adamw_bf16 import AdamWBF16
from graphtrain.optim.adamw_copies import AdamWCopies

_IMPLEMENTATIONS = ("auto", "fused", "foreach", "graphtrain")


def _fused_supported_device_types() -> set[str]:
    """Device types with a fused AdamW kernel in this torch build."""
    try:
        # Private helper, present since torch 2.2; the fallback covers a rename.
        from torch.optim.optimizer import _get_fused_kernels_supported_devices

        return set(_get_fused_kernels_supported_devices())
    except ImportError:  # pragma: no cover - depends on torch internals
        return {"cuda", "cpu"}


def _is_no_decay(names: list[str], param: torch.Tensor, patterns: list[str]) -> bool:
    """True when any name of `param` matches a pattern, or the parameter has < 2 dims."""
    if param.ndim < 2:
        return True
    return any(fnmatch.fnmatchcase(name, pat) for name in names for pat in patterns)


def _choose_implementation(params: list[torch.Tensor], implementation: str) -> str:
    """Resolve "auto": "graphtrain" where every parameter is an fp32 CUDA tensor (measured
    faster there), else "fused" where every parameter's device and dtype allow it, else
    "foreach"."""
    if implementation not in _IMPLEMENTATIONS:
        raise ValueError(
            f"unknown optimizer implementation {implementation!r}; expected one of {_IMPLEMENTATIONS}"
        )
    if implementation != "auto":
        return implementation
    # For a DTensor, .device and .dtype are its local shard's: what the kernels see.
    if params and all(p.device.type == "cuda" and p.dtype == torch.float32 for p in params):
        return "graphtrain"
    supported = _fused_supported_device_types()
    if params and all(p.device.type in supported and p.is_floating_point() for p in params):
        return "fused"
    return "foreach"


def build_optimizer(
    model: nn.Module,
    *,
    lr: float,
    betas: tuple[float, float],
    eps: float,
    weight_decay: float,
    no_decay_patterns: list[str],
    implementation: str = "auto",
    state_dtype: str = "float32",
) -> torch.optim.Optimizer:
    """Build AdamW with two parameter groups: decayed and not decayed.

    A parameter gets no weight decay if it has fewer than 2 dimensions (norm weights, biases) or if
    any of its names (a tied parameter has several, e.g. "tok_embeddings.weight" and
    "output.weight") matches one of `no_decay_patterns` with fnmatch on the full dotted name
    ("*norm*", "*bias", "tok_embeddings.*"). Tied parameters appear once. Frozen parameters
    (requires_grad False) are left out. Empty groups are dropped.

    `implementation`: "fused", "foreach", "graphtrain" (AdamWCopies; fp32 parameters), or "auto"
    (_choose_implementation: graphtrain for fp32 CUDA parameters, else fused where the device
    type has the kernel, else foreach). Any other value is a ValueError.
    `state_dtype`: "float32" or "bfloat16" (bf16 moments, fp32 math): AdamWCopies takes either;
    torch's AdamW has no bf16 moments, so "fused" and "foreach" become AdamWBF16 there.
    """
    if implementation not in _IMPLEMENTATIONS:
        raise ValueError(
            f"unknown optimizer implementation {implementation!r}; expected one of {_IMPLEMENTATIONS}"
        )
    # remove_duplicate=False lists every name of a tied parameter; group the names by identity.
    names_by_param: dict[int, list[str]] = {}
    params_by_id: dict[int, nn.Parameter] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        if not param.requires_grad:
            continue
        names_by_param.setdefault(id(param), []).append(name)
        params_by_id.setdefault(id(param), param)

    decay: list[nn.Parameter] = []
    no_decay: list[nn.Parameter] = []
    for key, param in params_by_id.items():
        if _is_no_decay(names_by_param[key], param, no_decay_patterns):
            no_decay.append(param)
        else:
            decay.append(param)
    if not decay and not no_decay:
        raise ValueError("build_optimizer: the model has no trainable parameters")

    groups = []
    for params, wd in ((decay, weight_decay), (no_decay, 0.0)):
        # Plain tensors and DTensors in separate groups: the fused/foreach kernels take one
        # list per group and refuse a mix (tensor parallelism leaves MoE layers plain).
        for kind in (False, True):
            chosen = [p for p in params if isinstance(p, DTensor) == kind]
            if chosen:
                groups.append({"params": chosen, "weight_decay": wd})

    if state_dtype not in ("float32", "bfloat16"):
        raise ValueError(f"optimizer state_dtype must be float32 or bfloat16, got {state_dtype!r}")
    chosen = _choose_implementation(decay + no_decay, implementation)
    if chosen == "graphtrain":
        return AdamWCopies(
            groups,
            lr=lr,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            state_dtype=getattr(torch, state_dtype),
        )
    if state_dtype == "bfloat16":
        return AdamWBF16(groups, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
    return torch.optim.AdamW(
        groups,
        lr=lr,
        betas=betas,
        eps=eps,
        weight_decay=weight_decay,
        fused=chosen == "fused",
        foreach=chosen == "foreach",
    )


def describe_optimizer(optimizer: torch.optim.Optimizer) -> str:
    """Which AdamW kernel `optimizer` runs, for the start banner: "AdamWCopies (graphtrain's
    kernel)", "AdamWBF16", "torch AdamW, fused" or "torch AdamW, foreach"."""
    if isinstance(optimizer, AdamWCopies):
        return "AdamWCopies (graphtrain's kernel)"
    if isinstance(optimizer, AdamWBF16):
        return "AdamWBF16"
    return f"torch AdamW, {'fused' if optimizer.defaults.get('fused') else 'foreach'}"


def optimizer_from_config(model: nn.Module, optim: Any) -> torch.optim.Optimizer:
    """build_optimizer with the keys of the config's `optim` section (graphtrain.config.OptimConfig)."""
    return build_optimizer(
        model,
        lr=optim.lr,
        betas=tuple(optim.betas),
        eps=optim.eps,
        weight_decay=optim.weight_decay,
        no_decay_patterns=optim.no_decay,
        implementation=optim.implementation,
        state_dtype=optim.state_dtype,
    )
