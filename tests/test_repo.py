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


# Size limits of the library's sources (graphtrain/ and models/): files, functions outside the
# Triton kernels, module docstrings (what, contract, numerics; design prose goes to
# docs/design/). Each allowlist holds what is over today and only shrinks: an entry that is
# back under its limit must leave the list.
MAX_FILE_LINES, MAX_FUNCTION_LINES, MAX_DOCSTRING_LINES = 600, 80, 25
LONG_FILES: set[str] = set()
LONG_FUNCTIONS: set[str] = set()
LONG_DOCSTRINGS: set[str] = set()


def _sources() -> list[Path]:
    return sorted((*REPO.glob("graphtrain/**/*.py"), *REPO.glob("models/**/*.py")))


def _is_triton_kernel(node) -> bool:
    import ast

    def name(d):
        d = d.func if isinstance(d, ast.Call) else d
        return d.attr if isinstance(d, ast.Attribute) else getattr(d, "id", "")

    return any(name(d) in ("jit", "autotune", "heuristics") for d in node.decorator_list)


def _oversized() -> dict[str, set[str]]:
    """{"files"|"functions"|"docstrings": the sources over their limit}."""
    import ast

    out: dict[str, set[str]] = {"files": set(), "functions": set(), "docstrings": set()}
    for path in _sources():
        rel, text = str(path.relative_to(REPO)), path.read_text(encoding="utf-8")
        if text.count("\n") > MAX_FILE_LINES:
            out["files"].add(rel)
        tree = ast.parse(text)
        doc = ast.get_docstring(tree, clean=False) or ""
        if len(doc.splitlines()) > MAX_DOCSTRING_LINES:
            out["docstrings"].add(rel)
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION_LINES and not _is_triton_kernel(node):
                    out["functions"].add(f"{rel}::{node.name}")
    return out


@pytest.mark.parametrize(
    ("kind", "allowed", "limit"),
    [
        ("files", LONG_FILES, MAX_FILE_LINES),
        ("functions", LONG_FUNCTIONS, MAX_FUNCTION_LINES),
        ("docstrings", LONG_DOCSTRINGS, MAX_DOCSTRING_LINES),
    ],
)
def test_sizes_stay_under_their_limits(kind, allowed, limit):
    found = _oversized()[kind]
    assert not found - allowed, f"{kind} over {limit} lines (split them): {sorted(found - allowed)}"
    assert not allowed - found, f"back under {limit} lines: remove {sorted(allowed - found)}"


def test_size_check_sees_a_long_function(tmp_path, monkeypatch):
    """The check itself: a long plain function is found, a long Triton kernel is not."""
    body = "".join(f"    x{i} = {i}\n" for i in range(MAX_FUNCTION_LINES))
    pkg = tmp_path / "graphtrain"
    pkg.mkdir()
    (pkg / "long.py").write_text(
        f"import triton\n\n\ndef plain():\n{body}\n\n@triton.jit\ndef _kernel():\n{body}"
    )
    monkeypatch.setattr(sys.modules[__name__], "REPO", tmp_path)
    assert _oversized()["functions"] == {"graphtrain/long.py::plain"}
