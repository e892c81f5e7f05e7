"""peak_flops table lookups and memory statistics on CPU."""

import pytest
import torch

from graphtrain.metrics import memory_stats, peak_flops, peak_flops_for_name, reset_memory_stats


def test_cpu_has_no_peak():
    for dtype in (torch.bfloat16, torch.float32, torch.float8_e4m3fn):
        assert peak_flops(torch.device("cpu"), dtype) is None


@pytest.mark.parametrize(
    ("name", "bf16"),
    [
        ("NVIDIA H100 80GB HBM3", 989.4e12),
        ("NVIDIA H100 PCIe", 756e12),
        ("NVIDIA H100 NVL", 835.5e12),
        ("NVIDIA H200", 989.4e12),
        ("NVIDIA GH200 480GB", 989.4e12),
        ("NVIDIA B200", 2250e12),
        ("NVIDIA A100-SXM4-80GB", 312e12),
        ("NVIDIA L40S", 362.05e12),
        ("NVIDIA L40", 181.05e12),
        ("NVIDIA L4", 121e12),
    ],
)
def test_table(name, bf16):
    assert peak_flops_for_name(name, torch.bfloat16) == bf16
    assert peak_flops_for_name(name, torch.float16) == bf16


def test_fp8_and_fp32_columns():
    # fp8 is 2x bf16 on Hopper; the A100 has no fp8 tensor cores.
    h100 = "NVIDIA H100 80GB HBM3"
    assert peak_flops_for_name(h100, torch.float8_e4m3fn) == 2 * 989.4e12
    assert peak_flops_for_name(h100, torch.float8_e5m2) == 2 * 989.4e12
    assert peak_flops_for_name("NVIDIA A100-SXM4-40GB", torch.float8_e4m3fn) is None
    assert peak_flops_for_name(h100, torch.float32) == 67e12
    assert peak_flops_for_name(h100, torch.int8) is None


def test_unknown_gpu():
    assert peak_flops_for_name("Tesla T4", torch.bfloat16) is None


def test_cpu_memory_stats():
    stats = memory_stats(torch.device("cpu"))
    assert set(stats) == {"memory/max_rss_gib"}
    assert 0.01 < stats["memory/max_rss_gib"] < 1024
    reset_memory_stats(torch.device("cpu"))  # no-op, must not fail


@pytest.mark.gpu
def test_cuda_memory_stats_and_peak():
    device = torch.device("cuda")
    reset_memory_stats(device)
    x = torch.empty(256 * 1024**2, dtype=torch.uint8, device=device)  # 0.25 GiB
    stats = memory_stats(device)
    assert stats["memory/peak_allocated_gib"] >= 0.25
    assert stats["memory/peak_reserved_gib"] >= stats["memory/peak_allocated_gib"]
    del x
    peak = peak_flops(device, torch.bfloat16)
    name = torch.cuda.get_device_name(device)
    if any(key in name for key in ("H100", "H200", "A100", "B200")):
        assert peak is not None and peak > 1e14, name
