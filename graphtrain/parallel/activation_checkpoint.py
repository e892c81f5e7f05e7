"""Activation checkpointing: keep only each block's inputs in forward, recompute the block in
backward. Trades one extra forward per block for the activations of all blocks.

How: each block's call (the compiled one when the block is compiled) is wrapped in
torch.utils.checkpoint.checkpoint(use_reentrant=False) through `Module._compiled_call_impl`, the
slot nn.Module.__call__ dispatches to (it is what Module.compile fills). The module tree is not
touched, so named_parameters(), state_dict() and the TP/FSDP plans keep the Llama names. It is
applied AFTER compile (graphtrain.parallel.parallelize_model): the checkpoint sits around the
compiled region, whose saved tensors it drops and recomputes like any autograd Function's.
FSDP2: its hooks on the block run inside the checkpoint; FSDP2 skips its pre/post-forward logic
during the recompute (training state PRE_BACKWARD), its pre-backward hook has gathered the
parameters by then.
The alternatives tried on torch 2.13 and why each failed: docs/design/parallel.md.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn
from torch.utils.checkpoint import checkpoint

AC_MODES = ("none", "full")


def _checkpointed(call: Callable[..., Any]) -> Callable[..., Any]:
    def checkpointed_call(*args: Any, **kwargs: Any) -> Any:
        # Non-reentrant: works with inputs that do not require grad, with kwargs, and with
        # compiled code inside. RNG state is preserved (the default) so a block that draws
        # random numbers (dropout, random routing) recomputes the same values.
        return checkpoint(call, *args, use_reentrant=False, **kwargs)

    return checkpointed_call


def apply_ac(model: nn.Module, mode: str) -> None:
    """Activation checkpointing of every block of model.layers and every MTP depth's layer, in
    place: mode "none" or "full".

    Apply after compile (a later Module.compile would replace the wrapped call and silently drop
    the checkpoint) and before FSDP.
    """
    if mode not in AC_MODES:
        raise ValueError(f"activation checkpoint mode must be one of {AC_MODES}, got {mode!r}")
    if mode == "none":
        return
    for block in [*model.layers.values(), *getattr(model, "mtp_layers", {}).values()]:
        call = block._compiled_call_impl or block._call_impl
        block._compiled_call_impl = _checkpointed(call)
