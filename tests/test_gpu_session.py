"""benchmarks/gpu_session.sh checked on CPU, so that a GPU stage (minutes of a rarely lent
machine) does not find a slip: the script parses; every `bench` names a benchmark that exists;
every pytest item's selection collects tests; every `graphtrain inspect` item passes inspect's
option and config checks; a chain of stages runs each in turn within the 8 files a device run
brings back; FlashAttention-4's two carried halves are joined, checked and installed. Its e2e.py
commands: tests/test_e2e_benchmark.py."""

import hashlib
import os
import re
import shlex
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from graphtrain.config import load_config
from graphtrain.inspect.cli import _split

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "gpu_session.sh"


def _items(kind: str) -> list[list[str]]:
    """The script's `item` or `bench` calls, continuation lines joined, as argument lists."""
    lines = SCRIPT.read_text().replace("\\\n", " ").splitlines()
    return [shlex.split(line) for line in lines if line.strip().startswith(f"{kind} ")]


def _after(words: list[str], marker: str) -> list[str]:
    return words[words.index(marker) + 1 :]


def test_the_script_parses_and_its_benchmarks_exist():
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True)
    benches = _items("bench")
    assert len(benches) >= 12, benches
    for _, name, _, script, *_ in benches:
        assert (ROOT / "benchmarks" / script).is_file(), (name, script)
    for _, name, cap, *_ in [*benches, *_items("item")]:
        if name == "$name":  # bench's own call of item
            continue
        cap, _, least = cap.partition(":")  # CAP[:LEAST]
        assert 20 <= int(least or 20) < int(cap), name


@pytest.mark.parametrize(
    "words",
    [w for w in _items("item") if "pytest" in w and w[1] != "tests"],  # `tests`: all GPU tests
    ids=lambda w: w[1],
)
def test_each_pytest_item_selects_tests(words):
    # "${xdist[@]}": the stage's own options (pytest-xdist's, where it imports)
    args = [a for a in _after(words, "pytest") if a not in ("-q", "-rfEs", "${xdist[@]}")]
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]  # 5: none selected


def test_each_inspect_item_passes_inspects_checks():
    inspects = [w for w in _items("item") if "inspect" in w]
    assert len(inspects) >= 3, inspects
    for words in inspects:
        source, own, rest = _split(_after(words, "inspect"))
        assert source is None and own["device"] == "cuda" and own["profile"].isdigit(), words
        assert load_config(rest).preset, words  # every --section.key=value a known key


def _stage_items() -> dict[str, list[str]]:
    """Stage -> the names of its items, in the order of the script's `stages` function."""
    body = SCRIPT.read_text().replace("\\\n", " ")
    body = body[body.index("\nstages() {") : body.index("\ninstall_wheels\n")]
    stages: dict[str, list[str]] = {}
    for line in body.splitlines():
        label = re.fullmatch(r"    ([\w-]+)\)", line)
        if label:
            stages[label.group(1)] = current = []
        elif line.strip().startswith(("item ", "bench ")):
            current.append(line.split()[1])
    return stages


def _session(
    args: list[str], tmp_path: Path, script: Path = SCRIPT, **env: str
) -> subprocess.CompletedProcess:
    """gpu_session.sh ARGS with TMPDIR in tmp_path/tmp and no wheels to install."""
    tmp = tmp_path / "tmp"
    tmp.mkdir(exist_ok=True)
    env = {**os.environ, "TMPDIR": str(tmp), "PYTHON": sys.executable,
           "GRAPHTRAIN_WHEELS": str(tmp_path / "no-wheels"), **env}  # fmt: skip
    return subprocess.run(
        ["bash", str(script), *args], env=env, capture_output=True, text=True, timeout=300
    )


def test_a_chain_runs_its_stages_in_turn_within_the_files_that_come_back(tmp_path):
    """Five stages in one call (GPU_SESSION_DRY_RUN: each item named, not run): every item of
    each stage starts, in the chain's order, with its output in its stage's log, and LOG_DIR
    holds the 8 files a device run brings back at most. A sixth stage, or an unknown one, is
    refused before anything runs."""
    chain = ["mtp", "hybrid", "kernels", "loss", "fp8"]
    logs = tmp_path / "logs"
    # PYTHON=true: no preflight imports (seconds; the FlashAttention-4 tests run them).
    run = _session([",".join(chain), str(logs)], tmp_path, GPU_SESSION_DRY_RUN="1", PYTHON="true")
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    files = {p.name for p in logs.iterdir()}
    assert files == {"summary.txt", "preflight.log", "results.md"} | {f"{s}.log" for s in chain}
    summary = (logs / "summary.txt").read_text()
    started = re.findall(r"^=== ([\w-]+) \(cap \d+ s", summary, re.MULTILINE)
    items = _stage_items()
    assert started == [name for stage in chain for name in items[stage]], summary
    assert "SKIPPED" not in summary and len(re.findall(r": exit 0 after", summary)) == len(started)
    for stage in chain:
        logged = re.findall(r"^=== ([\w-]+) ", (logs / f"{stage}.log").read_text(), re.MULTILINE)
        assert logged == items[stage]
    for bad in ("e2e,bogus", ",".join([*chain, "e2e"])):
        run = _session([bad, str(tmp_path / "refused")], tmp_path)
        assert run.returncode == 2 and "usage" in run.stderr, run.stderr
        assert not (tmp_path / "refused").exists()


def test_an_item_short_of_the_time_it_needs_is_skipped_and_leaves_it_to_the_next(tmp_path):
    """With 100 s of BUDGET, e2e's items (each names 120 s: a compile before its first row) are
    skipped and say so; the kernels stage's, which show rows sooner, start in that time."""
    logs = tmp_path / "logs"
    env = dict(GPU_SESSION_DRY_RUN="1", PYTHON="true", BUDGET="100")
    run = _session(["e2e,kernels", str(logs)], tmp_path, **env)
    summary = (logs / "summary.txt").read_text()
    skipped = re.findall(r"^=== ([\w-]+): SKIPPED, \d+ s left of 100, it needs 120$", summary, re.M)
    assert skipped == ["e2e-1b", "e2e-moe-1b"], summary
    started = re.findall(r"^=== ([\w-]+) \(cap \d+ s", summary, re.MULTILINE)
    assert started == _stage_items()["kernels"], summary
    assert run.returncode == 1  # a skipped item counts as not done


def _fake_fa4_wheel(path: Path) -> None:
    """A wheel laid out as FlashAttention-4's cutlass-dsl: `import flash_attn.cute` imports
    `cutlass`, which lives in nvidia_cutlass_dsl/dsl_packages (a .pth puts it on sys.path)."""
    files = {
        "flash_attn/__init__.py": "",
        "flash_attn/cute/__init__.py": "import cutlass\n",
        "nvidia_cutlass_dsl/__init__.py": "",
        "nvidia_cutlass_dsl/dsl_packages/cutlass/__init__.py": "",
        "fake_fa4-1.0.dist-info/METADATA": "Metadata-Version: 2.1\nName: fake-fa4\nVersion: 1.0\n",
        "fake_fa4-1.0.dist-info/WHEEL": "Wheel-Version: 1.0\nRoot-Is-Purelib: true\n"
        "Tag: py3-none-any\n",
    }
    files["fake_fa4-1.0.dist-info/RECORD"] = "".join(f"{name},,\n" for name in files)
    with zipfile.ZipFile(path, "w") as z:
        for name, text in files.items():
            z.writestr(name, text)


@pytest.mark.parametrize("case", ["both", "one", "corrupt"])
def test_flashattention_4_halves_are_joined_checked_and_installed(tmp_path, case):
    """first_contact_prepare.sh --fa4 cuts the wheel in two (.fa4/one, .fa4/two: one per call);
    the script joins them, checks the sha256, installs, and puts cutlass-dsl's package folder on
    the path; with a half missing or a bad join it says so in summary.txt and installs nothing."""
    root = tmp_path / "repo"
    (root / "benchmarks").mkdir(parents=True)
    (root / "benchmarks" / "gpu_session.sh").write_text(SCRIPT.read_text())
    wheel = tmp_path / "fake_fa4-1.0-py3-none-any.whl"
    _fake_fa4_wheel(wheel)
    data = wheel.read_bytes()
    one, two = root / ".fa4" / "one", root / ".fa4" / "two"
    one.mkdir(parents=True)
    (one / f"{wheel.name}.part1").write_bytes(data[:100])
    (one / f"{wheel.name}.sha256").write_text(hashlib.sha256(data).hexdigest() + "\n")
    if case != "one":
        two.mkdir()
        (two / f"{wheel.name}.part2").write_bytes(data[100:] + (b"x" if case == "corrupt" else b""))
    logs, tmp = tmp_path / "logs", tmp_path / "tmp"
    # The refusals are the script's own (bash): no preflight imports for them (PYTHON=true).
    python = {} if case == "both" else {"PYTHON": "true"}
    script = root / "benchmarks" / "gpu_session.sh"
    run = _session(["preflight", str(logs)], tmp_path, script, **python)
    summary = (logs / "summary.txt").read_text()
    installed = tmp / "graphtrain-wheels" / "flash_attn" / "cute" / "__init__.py"
    if case == "both":
        assert "flash_attn.cute: ok" in run.stdout, run.stdout + run.stderr
        assert installed.is_file() and "FlashAttention-4" not in summary
    else:
        assert not installed.exists(), run.stdout + run.stderr
        why = "carry .fa4/two with the next call" if case == "one" else "fails its sha256"
        assert why in summary, summary
