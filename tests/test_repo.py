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


def _graphtrain_imports(path: Path) -> set[str]:
    """The modules of graphtrain (and models) that `path` imports, at any depth of the file."""
    import ast

    package = ".".join(path.relative_to(REPO).with_suffix("").parts[:-1])
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolve against the file's package
                parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*parent, base] if base else parent)
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)
    return {m for m in found if m.split(".")[0] in ("graphtrain", "models")}


def _breaches(files: str, forbidden: tuple[str, ...]) -> list[str]:
    bad = []
    for path in sorted(REPO.glob(files)):
        for module in sorted(_graphtrain_imports(path)):
            if any(module == f or module.startswith(f + ".") for f in forbidden):
                bad.append(f"{path.relative_to(REPO)} imports {module}")
    return bad


@pytest.mark.parametrize(
    ("files", "forbidden"),
    [
        # Models are plain PyTorch: graphtrain changes them from outside.
        ("models/**/*.py", ("graphtrain",)),
        # Ops are below the compiler and the job: usable from any pass or script.
        (
            "graphtrain/custom_ops/**/*.py",
            (
                "graphtrain.passes",
                "graphtrain.config",
                "graphtrain.trainer",
                "graphtrain.run",
                "graphtrain.step",
            ),
        ),
        # Passes rewrite graphs; the loop that runs the compiled model is not theirs to know.
        ("graphtrain/passes/**/*.py", ("graphtrain.trainer", "graphtrain.run", "graphtrain.step")),
        # The step and the loop know no op: the passes put the ops in, compile.step_hooks
        # hands over what the ops count.
        ("graphtrain/step.py", ("graphtrain.custom_ops",)),
        ("graphtrain/trainer.py", ("graphtrain.custom_ops",)),
        ("graphtrain/run.py", ("graphtrain.custom_ops",)),
    ],
    ids=["models", "custom_ops", "passes", "step", "trainer", "run"],
)
def test_layering(files, forbidden):
    assert list(REPO.glob(files)), files
    assert not _breaches(files, forbidden)


def test_layering_check_sees_an_import():
    """The check itself: an import of an op in step.py would be found."""
    step = _graphtrain_imports(REPO / "graphtrain" / "step.py")
    assert "graphtrain.optim" in step
    assert _breaches("graphtrain/step.py", ("graphtrain.optim",))
