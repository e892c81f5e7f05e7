"""What the optimizer's state costs on this rank, reported once at start-up."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor


def optimizer_state_bytes(
    model: nn.Module, *, state_dtype: torch.dtype, master_dtype: torch.dtype
) -> dict[str, int]:
    """Bytes of AdamW's two moments for this rank's shard of `model`'s parameters, as kept
    ("optim_state_bytes": torch's AdamW keeps them in the parameters' dtype, AdamWBF16 in
    state_dtype, so the smaller of the two) and as they would be in float32
    ("optim_state_bytes_fp32")."""
    local_numel = sum(
        (p.to_local() if isinstance(p, DTensor) else p).numel() for p in model.parameters()
    )
    return {
        "optim_state_bytes": 2 * local_numel * min(state_dtype.itemsize, master_dtype.itemsize),
        "optim_state_bytes_fp32": 2 * local_numel * 4,
    }
