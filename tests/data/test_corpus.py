"""The default corpus: deterministic, disjoint, non-empty split of the stdlib source."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from graphtrain.data import corpus
from graphtrain.data.corpus import default_corpus_files


def test_split_is_deterministic_disjoint_and_nonempty() -> None:
    train, val = default_corpus_files("train"), default_corpus_files("val")
    assert train == default_corpus_files("train") and val == default_corpus_files("val")
    assert train and val
    assert not set(train) & set(val)
    root = corpus.stdlib_root()
    for files in (train, val):
        rel = [p.relative_to(root).as_posix() for p in files]
        assert rel == sorted(rel)
        assert all(p.suffix == ".py" for p in files)
        assert not any("site-packages" in r.split("/") for r in rel)
    # About 2% of files are held out.
    assert 0.005 < len(val) / (len(train) + len(val)) < 0.05


def test_excludes_third_party_and_venvs(tmp_path: Path) -> None:
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "mod.py").write_text("x = 1\n")
    (tmp_path / "top.py").write_text("y = 2\n")
    (tmp_path / "notes.txt").write_text("not python\n")
    for excluded in ("site-packages", "dist-packages", "myvenv"):
        (tmp_path / excluded).mkdir()
        (tmp_path / excluded / "third_party.py").write_text("z = 3\n")
    (tmp_path / "myvenv" / "pyvenv.cfg").write_text("home = /usr\n")
    found = [rel for rel, _ in corpus._all_stdlib_files(tmp_path)]
    assert found == ["pkg/mod.py", "top.py"]


def test_split_depends_only_on_relative_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    names = [f"m{i}.py" for i in range(300)]
    splits = []
    for root in (tmp_path / "a", tmp_path / "b" / "nested"):
        root.mkdir(parents=True)
        for name in names:
            (root / name).write_text("pass\n")
        monkeypatch.setattr(corpus, "stdlib_root", lambda root=root: root)
        splits.append([p.name for p in default_corpus_files("val")])
    assert splits[0] == splits[1] and splits[0]


def test_no_files_is_a_clear_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(corpus, "stdlib_root", lambda: tmp_path)
    with pytest.raises(FileNotFoundError, match=re.escape(str(tmp_path))):
        default_corpus_files("train")
    with pytest.raises(ValueError, match="'test'"):
        default_corpus_files("test")
