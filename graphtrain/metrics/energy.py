"""Energy per token from the GPU's own energy counter (NVML), where there is one.

What: `EnergyMeter(device)` reads the total energy the GPU has consumed
(nvmlDeviceGetTotalEnergyConsumption, millijoules since the driver loaded, Volta and newer);
`joules_since_last()` gives this rank's joules since the previous call. The trainer sums them
over the ranks at log steps, so the logged energy/joules_per_token is the whole job's energy
over the whole job's tokens of the window, validation and checkpoint saves in it included
(what the trained tokens cost).

Why the counter and not power samples: the counter integrates in the driver, so short spikes
between two reads are counted; sampling power at log steps would miss them.

Absent NVML (no `nvidia-ml-py` installed, no NVIDIA driver, a CPU run, a GPU without the
counter) the meter is off: no metric and never an error. On a CUDA device rank 0 logs once
why it is off (a missing package names the one to install), so a missing metric is never silent.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch
import torch.distributed as dist

logger = logging.getLogger("graphtrain")


def _nvml_handle(device: torch.device) -> tuple[Any, Any] | None:
    """(pynvml module, device handle) of `device`, or None where NVML cannot tell its energy."""
    if device.type != "cuda":
        return None
    try:
        import pynvml  # the nvidia-ml-py package; optional
    except ImportError:
        if os.environ.get("RANK", "0") == "0":
            logger.warning(
                "energy per token not logged: the pynvml module is missing "
                "(pip install nvidia-ml-py to log energy/joules_per_token)"
            )
        return None
    try:
        pynvml.nvmlInit()
        # By UUID: CUDA's device index and NVML's differ under CUDA_VISIBLE_DEVICES.
        uuid = str(torch.cuda.get_device_properties(device).uuid)
        handle = pynvml.nvmlDeviceGetHandleByUUID(
            uuid if uuid.startswith("GPU-") else f"GPU-{uuid}"
        )
        pynvml.nvmlDeviceGetTotalEnergyConsumption(handle)  # raises where unsupported
    except Exception as error:  # NVMLError and its many subclasses; any failure means "off"
        if os.environ.get("RANK", "0") == "0":
            logger.info("energy per token not logged: NVML cannot read the energy (%s)", error)
        return None
    return pynvml, handle


class EnergyMeter:
    """This rank's GPU energy between calls to `window`; `available` False means no metric."""

    def __init__(self, device: torch.device) -> None:
        found = _nvml_handle(device)
        self.available = found is not None
        if dist.is_initialized():
            # On only where every rank can read its GPU: the trainer's sum is a collective.
            flag = torch.tensor(int(self.available), device=device)
            dist.all_reduce(flag, op=dist.ReduceOp.MIN)
            self.available = bool(flag.item())
            found = found if self.available else None
        self._nvml, self._handle = found if found is not None else (None, None)
        self._last_mj = self._read_mj() if self.available else 0

    def _read_mj(self) -> int:
        return int(self._nvml.nvmlDeviceGetTotalEnergyConsumption(self._handle))

    def joules_since_last(self) -> float:
        """Joules this GPU consumed since the previous call (or since construction)."""
        if not self.available:
            return 0.0
        now = self._read_mj()
        joules, self._last_mj = (now - self._last_mj) / 1000.0, now
        return joules


def energy_metrics(
    local_joules: float, total_joules: float, *, tokens: int, seconds: float
) -> dict[str, float]:
    """The logged numbers: this rank's joules and average power, the job's joules per token
    (total_joules: summed over the ranks; tokens: the job's tokens in the same window)."""
    return {
        "energy/joules_rank0": local_joules,
        "energy/avg_power_w_rank0": local_joules / seconds if seconds > 0 else 0.0,
        "energy/joules_total": total_joules,
        "energy/joules_per_token": total_joules / tokens if tokens else 0.0,
    }
