"""collect_run_info / write_run_info."""

import json
import platform

import torch

from graphtrain.metrics import collect_run_info, write_run_info


def test_collect():
    info = collect_run_info()
    assert info["python"] == platform.python_version()
    assert info["torch"] == torch.__version__
    for name in ("triton", "tensordict", "safetensors", "tokenizers"):
        assert name in info and (info[name] is None or isinstance(info[name], str))
    assert info["device_name"] == ("cpu" if not torch.cuda.is_available() else info["device_name"])
    assert isinstance(info["hostname"], str) and info["world_size"] >= 1
    assert isinstance(info["git"]["commit"], str) and info["git"]["dirty"] in (None, True, False)
    assert isinstance(info["command"], list)


def test_world_size_from_env(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "8")
    assert collect_run_info()["world_size"] == 8


def test_write(tmp_path):
    path = write_run_info(tmp_path / "run", {"config": {"lr": 3e-4, "dir": tmp_path}})
    assert path == tmp_path / "run" / "run_info.json"
    data = json.loads(path.read_text())
    assert data["config"] == {"lr": 3e-4, "dir": str(tmp_path)}
    assert data["torch"] == torch.__version__
    assert not list((tmp_path / "run").glob("*.tmp"))
