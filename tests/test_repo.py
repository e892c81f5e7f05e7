"""House rules that a reviewer would otherwise have to check by eye."""

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def tracked_files() -> list[Path]:
    out = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True)
    if out.returncode != 0:
        pytest.skip("not a git checkout")
    return [REPO / f for f in out.stdout.splitlines() if (REPO / f).is_file()]


@pytest.mark.parametrize(
    "args", [["check", "."], ["format", "--check", "."]], ids=["lint", "format"]
)
def test_ruff_is_clean(args):
    # The interpreter's own ruff: `./launch.sh test` runs the venv's python without activating
    # the venv, so a PATH lookup would miss it.
    if importlib.util.find_spec("ruff") is None:
        pytest.skip("ruff is not installed (pip install -e '.[dev]')")
    out = subprocess.run(
        [sys.executable, "-m", "ruff", *args], cwd=REPO, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stdout + out.stderr


def test_sources_are_ascii():
    bad = []
    for path in tracked_files():
        if path.suffix in (".py", ".md", ".toml", ".sh") or path.name == "run":
            try:
                path.read_bytes().decode("ascii")
            except UnicodeDecodeError as e:
                bad.append(f"{path.relative_to(REPO)}: byte {e.start}")
    assert not bad, bad
