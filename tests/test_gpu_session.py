"""benchmarks/gpu_session.sh checked on CPU, so that a GPU stage (minutes of a rarely lent
machine) does not find a slip: the script parses; every `bench` names a benchmark that exists;
every pytest item's selection collects tests; every `graphtrain inspect` item passes inspect's
option and config checks. Its e2e.py commands: tests/test_e2e_benchmark.py."""

import shlex
import subprocess
import sys
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
    for _, name, cap, script, *_ in benches:
        assert (ROOT / "benchmarks" / script).is_file(), (name, script)
        assert int(cap) > 0


@pytest.mark.parametrize(
    "words",
    [w for w in _items("item") if "pytest" in w and w[1] != "tests"],  # `tests`: all GPU tests
    ids=lambda w: w[1],
)
def test_each_pytest_item_selects_tests(words):
    args = [a for a in _after(words, "pytest") if a not in ("-q", "-rfEs")]
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
