"""optimizer_state_bytes: two moments per local parameter element, in the smaller dtype."""

import torch
from torch import nn

from graphtrain.optim import optimizer_state_bytes


def test_two_moments_per_element_in_the_smaller_dtype():
    model = nn.Sequential(nn.Linear(3, 5), nn.Linear(5, 2, bias=False))  # 20 + 10 elements
    fp32 = optimizer_state_bytes(model, state_dtype=torch.float32, master_dtype=torch.float32)
    assert fp32 == {"optim_state_bytes": 2 * 30 * 4, "optim_state_bytes_fp32": 2 * 30 * 4}
    bf16 = optimizer_state_bytes(model, state_dtype=torch.bfloat16, master_dtype=torch.float32)
    assert bf16 == {"optim_state_bytes": 2 * 30 * 2, "optim_state_bytes_fp32": 2 * 30 * 4}
    pure = optimizer_state_bytes(model, state_dtype=torch.float32, master_dtype=torch.bfloat16)
    assert pure["optim_state_bytes"] == 2 * 30 * 2
