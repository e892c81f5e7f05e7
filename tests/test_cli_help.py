"""`graphtrain --help` imports no torch; `import graphtrain` still registers the backend."""

import subprocess
import sys

import pytest

from graphtrain.cli import PRESET_NAMES
from graphtrain.config import JOB_PRESETS

# Runs `python -m graphtrain ARGS` in this interpreter and prints, after it exits, whether
# torch was imported: runpy does what `-m` does.
_HELP = """
import runpy, sys
sys.argv = ["graphtrain", *sys.argv[1:]]
try:
    runpy.run_module("graphtrain", run_name="__main__", alter_sys=True)
except SystemExit as e:
    code = e.code
print("exit", code, "torch imported:", "torch" in sys.modules)
"""


@pytest.mark.parametrize(
    "args", [["--help"], [], ["export", "--help"], ["plan", "--help"], ["nonsense"]]
)
def test_help_imports_no_torch(args):
    done = subprocess.run(
        [sys.executable, "-c", _HELP, *args], capture_output=True, text=True, check=True
    )
    assert "torch imported: False" in done.stdout, done.stdout + done.stderr
    assert "usage: graphtrain" in done.stdout + done.stderr


def test_usage_lists_the_job_presets():
    assert PRESET_NAMES == tuple(JOB_PRESETS)


@pytest.mark.parametrize(
    "imports",
    [
        "import graphtrain; import torch",  # the backend registered when torch._dynamo loads
        "import graphtrain.data; import torch",  # torch._dynamo first loaded by tensordict
    ],
)
def test_import_graphtrain_registers_the_backend(imports):
    code = f"""{imports}
import sys
import torch._dynamo
print("registered", "graphtrain" in torch._dynamo.list_backends(), "graphtrain.compile" in sys.modules)
"""
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout
    assert "registered True True" in out, out
