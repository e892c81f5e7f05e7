"""Energy per token: off without NVML (never an error), the counter's arithmetic with a stand-in
for the pynvml module."""

import sys
import types

import pytest
import torch

import graphtrain.metrics.energy as energy_module
from graphtrain.metrics.energy import EnergyMeter, energy_metrics


def test_off_on_cpu_and_without_pynvml(monkeypatch, caplog):
    assert not EnergyMeter(torch.device("cpu")).available
    assert EnergyMeter(torch.device("cpu")).joules_since_last() == 0.0
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import fails: not installed
    monkeypatch.setenv("RANK", "0")
    with caplog.at_level("WARNING", logger="graphtrain"):
        assert energy_module._nvml_handle(torch.device("cuda", 0)) is None
    # Off on a GPU, but said: the package to install is named (issue 26, defect 4).
    assert "nvidia-ml-py" in caplog.text
    caplog.clear()
    monkeypatch.setenv("RANK", "1")  # other ranks stay quiet
    with caplog.at_level("WARNING", logger="graphtrain"):
        assert energy_module._nvml_handle(torch.device("cuda", 0)) is None
    assert caplog.text == ""


def _fake_nvml(readings_mj, fail=False):
    nvml = types.SimpleNamespace()
    nvml.nvmlInit = lambda: None
    nvml.nvmlDeviceGetHandleByUUID = lambda uuid: ("handle", uuid)

    def total_energy(handle):
        if fail:
            raise RuntimeError("NVML_ERROR_NOT_SUPPORTED")
        return readings_mj.pop(0)

    nvml.nvmlDeviceGetTotalEnergyConsumption = total_energy
    return nvml


def test_joules_between_reads_with_a_stand_in_counter(monkeypatch):
    props = types.SimpleNamespace(uuid="1234-abcd")
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: props)
    # The probe read, the construction read, then two windows.
    nvml = _fake_nvml([5_000, 10_000, 310_000, 460_500])
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    meter = EnergyMeter(torch.device("cuda", 0))
    assert meter.available
    assert meter.joules_since_last() == pytest.approx(300.0)
    assert meter.joules_since_last() == pytest.approx(150.5)
    # A GPU without the counter: off, no error.
    monkeypatch.setitem(sys.modules, "pynvml", _fake_nvml([], fail=True))
    assert not EnergyMeter(torch.device("cuda", 0)).available


def test_energy_metrics():
    m = energy_metrics(300.0, 1200.0, tokens=4000, seconds=2.0)
    assert m == {
        "energy/joules_rank0": 300.0,
        "energy/avg_power_w_rank0": 150.0,
        "energy/joules_total": 1200.0,
        "energy/joules_per_token": 0.3,
    }
