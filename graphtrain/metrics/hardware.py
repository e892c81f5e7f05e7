"""Peak FLOP/s of known GPUs (for MFU) and memory statistics.

What: `peak_flops` looks the CUDA device name up in a table of dense (no sparsity) tensor-core
peaks from the vendor datasheets; `memory_stats` / `reset_memory_stats` report peak device memory
on CUDA and the process max RSS on CPU; `rank_memory` is what one rank may plan for (the GPU's
memory, or the machine's shared by the ranks on it), which the trainer checks its plan against.

Why a table: there is no API that reports peak FLOP/s. Datasheets quote tensor-core numbers "with
sparsity", which are 2x the dense numbers; MFU uses the dense ones. An unknown GPU or a CPU gives
None: MFU is then not reported unless the user passes peak_tflops, because a guessed peak would be
a wrong MFU.

Columns: bf16 (also used for fp16: the same tensor-core rate), fp8 (2x bf16 on Hopper, Ada and
Blackwell; None where the GPU has no fp8 tensor cores), fp32 (plain FP32 CUDA-core rate, not TF32;
None where the datasheet number is not known to us).
"""

from __future__ import annotations

import os
import resource
import sys
from pathlib import Path

import torch

# (substring of torch.cuda.get_device_name(), bf16, fp8, fp32) in FLOP/s, dense.
# Hopper's FP8 rate is exactly 2x its BF16 rate; the datasheets' rounded numbers differ by <0.1%.
# The first matching substring wins, so more specific names come first ("H100 NVL" before
# "H100", "GH200" before "H200", "L40S" before "L40").
_PEAK_TABLE: list[tuple[str, float, float | None, float | None]] = [
    # https://www.nvidia.com/en-us/data-center/grace-hopper-superchip/ (the Hopper GPU of GH200
    # has the H100 SXM rates)
    ("GH200", 989.4e12, 2 * 989.4e12, 67e12),
    # https://www.nvidia.com/en-us/data-center/h100/ (datasheet: BF16 1,979 / 1,513 / 1,671
    # TFLOPS with sparsity for SXM / PCIe / NVL; FP8 3,958 / 3,026 / 3,341; FP32 67 / 51 / 60)
    ("H100 NVL", 835.5e12, 2 * 835.5e12, 60e12),
    ("H100 PCIe", 756e12, 2 * 756e12, 51e12),
    ("H100", 989.4e12, 2 * 989.4e12, 67e12),  # SXM and other variants (e.g. "H100 80GB HBM3")
    # https://www.nvidia.com/en-us/data-center/h200/ (H200 SXM: as H100 SXM; H200 NVL: as H100 NVL)
    ("H200 NVL", 835.5e12, 2 * 835.5e12, 60e12),
    ("H200", 989.4e12, 2 * 989.4e12, 67e12),
    # https://www.nvidia.com/en-us/data-center/hgx/ (HGX B200, 8 GPUs: FP8 72 PFLOPS sparse,
    # BF16 36 PFLOPS sparse, FP32 600 TFLOPS; divided by 8 GPUs and by 2 for sparsity)
    ("B200", 2250e12, 4500e12, 75e12),
    # https://www.nvidia.com/en-us/data-center/a100/ (BF16 312 dense; FP32 19.5; no fp8)
    ("A100", 312e12, None, 19.5e12),
    # https://www.nvidia.com/en-us/data-center/l40s/ (BF16 362.05 dense, FP8 733 dense, FP32 91.6)
    ("L40S", 362.05e12, 733e12, 91.6e12),
    # https://www.nvidia.com/en-us/data-center/l40/ (BF16 181.05 dense, FP8 362 dense, FP32 90.5)
    ("L40", 181.05e12, 362e12, 90.5e12),
    # https://www.nvidia.com/en-us/data-center/l4/ (BF16 242 sparse, FP8 485 sparse, FP32 30.3)
    ("L4", 121e12, 242.5e12, 30.3e12),
]

_FP8_DTYPES = {
    getattr(torch, name)
    for name in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz")
    if hasattr(torch, name)
}

_GIB = 1024**3


def peak_flops_for_name(device_name: str, dtype: torch.dtype) -> float | None:
    """Dense peak FLOP/s for a CUDA device name and a compute dtype; None if unknown."""
    for key, bf16, fp8, fp32 in _PEAK_TABLE:
        if key in device_name:
            if dtype in (torch.bfloat16, torch.float16):
                return bf16
            if dtype in _FP8_DTYPES:
                return fp8
            if dtype == torch.float32:
                return fp32
            return None
    return None


def peak_flops(device: torch.device, dtype: torch.dtype) -> float | None:
    """Dense peak FLOP/s of `device` for matmuls in `dtype`; None on CPU or an unknown GPU."""
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    if torch.version.hip is not None:
        return None  # ROCm device names are not in the table
    return peak_flops_for_name(torch.cuda.get_device_name(device), dtype)


def memory_stats(device: torch.device) -> dict[str, float]:
    """Peak memory since the last reset, in GiB.

    CUDA: "memory/peak_allocated_gib", "memory/peak_reserved_gib" (caching allocator) and
    "memory/alloc_retries" (cudaMalloc retries after freeing the cache: a sign of fragmentation
    or memory pressure). CPU: "memory/max_rss_gib", the process's peak resident set size since it
    started (the OS keeps no resettable peak).
    """
    device = torch.device(device)
    if device.type == "cuda":
        stats = torch.cuda.memory_stats(device)
        return {
            "memory/peak_allocated_gib": stats.get("allocated_bytes.all.peak", 0) / _GIB,
            "memory/peak_reserved_gib": stats.get("reserved_bytes.all.peak", 0) / _GIB,
            "memory/alloc_retries": float(stats.get("num_alloc_retries", 0)),
        }
    max_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    # ru_maxrss is in KiB on Linux and in bytes on macOS.
    max_rss_bytes = max_rss if sys.platform == "darwin" else max_rss * 1024
    return {"memory/max_rss_gib": max_rss_bytes / _GIB}


def _host_memory() -> int | None:
    """Bytes of memory this process may use: MemTotal, or a cgroup's limit below it."""
    try:
        meminfo = Path("/proc/meminfo").read_text()
    except OSError:
        return None
    total = next(
        (
            int(line.split()[1]) * 1024
            for line in meminfo.splitlines()
            if line.startswith("MemTotal:")
        ),
        None,
    )
    for limit_file in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            limit = Path(limit_file).read_text().strip()
        except OSError:
            continue
        if limit.isdigit() and total is not None:
            total = min(total, int(limit))
    return total


def rank_memory(device: torch.device) -> tuple[int, str] | None:
    """(bytes one rank may plan for, what that is, for a message); None where unknown. CUDA: the
    GPU's memory; CPU: the machine's (or its cgroup's) memory split over the ranks on this node
    (LOCAL_WORLD_SIZE, set by torchrun)."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory, "the GPU"
    total = _host_memory()
    if total is None:
        return None
    local = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    shared = f" shared by {local} ranks" if local > 1 else ""
    return total // local, f"this machine's memory{shared}"


_MEMORY_WORDS = {
    "memory/peak_allocated_gib": "peak allocated {:.2f} GiB",
    "memory/peak_reserved_gib": "peak reserved {:.2f} GiB",
    "memory/alloc_retries": "{:.0f} allocation retries",
    "memory/max_rss_gib": "peak resident {:.2f} GiB",
}


def describe_memory(stats: dict[str, float]) -> str:
    """memory_stats in words with units, e.g. "peak resident 0.54 GiB"."""
    return ", ".join(_MEMORY_WORDS.get(k, k + " {:.2f}").format(v) for k, v in stats.items())


def reset_memory_stats(device: torch.device) -> None:
    """Reset the CUDA peak-memory counters (call after each log step); no-op on CPU."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
