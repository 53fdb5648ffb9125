"""The embedded stdlib corpus: file listing, subset selection and document reading."""

from __future__ import annotations

import logging

import pytest

from slipstream.corpus import read_documents, select_files, stdlib_files, stdlib_root


def test_stdlib_files_exist_sorted_without_site_packages():
    """The default corpus is the stdlib's .py files in sorted relative order, no site-packages."""
    files = stdlib_files()
    root = stdlib_root()
    assert len(files) > 500
    relative = [path.relative_to(root).as_posix() for path in files]
    assert relative == sorted(relative)
    assert all(path.suffix == ".py" and path.is_file() for path in files)
    assert not any("site-packages" in rel or "dist-packages" in rel for rel in relative)
    assert "os.py" in relative and "json/__init__.py" in relative
    assert stdlib_files() == files


def test_stdlib_files_on_a_tree(tmp_path):
    """Order is by relative path, not creation order; site/dist-packages anywhere are excluded."""
    for rel in ["b.py", "a/z.py", "a/b.py", "a.py", "x/site-packages/m.py", "dist-packages/n.py",
                "notes.txt", "c/d/e.py"]:
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text("pass\n")
    relative = [path.relative_to(tmp_path).as_posix() for path in stdlib_files(tmp_path)]
    assert relative == ["a.py", "a/b.py", "a/z.py", "b.py", "c/d/e.py"]


def test_missing_root_is_an_error(tmp_path):
    """A root that does not exist is reported, not silently an empty corpus."""
    with pytest.raises(FileNotFoundError, match="does-not-exist"):
        stdlib_files(tmp_path / "does-not-exist")


def test_select_files_is_deterministic_and_spread():
    """max_bytes picks the same evenly spread subset every time, close to the budget."""
    files = stdlib_files()
    subset = select_files(files, 2_000_000)
    assert subset == select_files(files, 2_000_000)
    num_bytes = sum(path.stat().st_size for path in subset)
    assert 1_000_000 < num_bytes < 2_000_000 + max(path.stat().st_size for path in subset)
    assert subset[0] == files[0]
    assert files.index(subset[-1]) > 0.8 * len(files)  # reaches the end of the sorted list
    assert select_files(files, None) == files
    with pytest.raises(ValueError, match="max_bytes"):
        select_files(files, 0)


def test_read_documents_skips_invalid_utf8(tmp_path, caplog):
    """Undecodable files are skipped with a log line; valid files come back as whole texts."""
    good, bad = tmp_path / "good.py", tmp_path / "bad.py"
    good.write_text("x = 'ünïcode 😀'\n", encoding="utf-8")
    bad.write_bytes("y = 'caf\xe9'\n".encode("latin-1"))
    with caplog.at_level(logging.INFO, logger="slipstream.corpus"):
        documents = list(read_documents([bad, good]))
    assert documents == ["x = 'ünïcode 😀'\n"]
    assert "bad.py" in caplog.text
