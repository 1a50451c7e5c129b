"""``benches/latency.py`` times the tree it is given, or says why it cannot."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
from conftest import REPO

spec = importlib.util.spec_from_file_location("latency", REPO / "benches" / "latency.py")
assert spec is not None and spec.loader is not None
latency = importlib.util.module_from_spec(spec)
spec.loader.exec_module(latency)


def _main(argv: list[str], capsys) -> tuple[int, list[str]]:
    code = latency.main(argv)
    return code, capsys.readouterr().err.strip().splitlines()


def test_a_tree_without_nanolab_is_refused_in_one_line(tmp_path: Path, capsys) -> None:
    """It exited 0 with timings labelled /missing: PYTHONPATH=/missing fell through to the
    installed nanolab."""
    code, err = _main(
        ["--tree", str(tmp_path / "missing"), "--tree", str(REPO), "--rounds", "1"], capsys
    )
    assert code == 2 and len(err) == 1, err
    assert err[0].startswith(
        f"latency: error: --tree {tmp_path / 'missing'}: no nanolab/__init__.py"
    )


def test_a_tree_whose_nanolab_is_shadowed_is_refused(tmp_path: Path) -> None:
    """A nanolab imported from elsewhere (a ``sitecustomize`` putting another path first) would
    be timed under this tree's name."""
    tree = tmp_path / "tree"
    (tree / "nanolab").mkdir(parents=True)
    (tree / "nanolab" / "__init__.py").write_text("")
    (tree / "sitecustomize.py").write_text(f"import sys; sys.path.insert(0, {str(REPO)!r})\n")
    latency.check_tree(tree)  # it looks like a tree
    with pytest.raises(latency.BadTree, match=rf"imports {REPO}.*not this tree's nanolab"):
        latency.check_imported_from(tree, tmp_path / "cache", tmp_path)
    latency.check_imported_from(REPO, tmp_path / "cache", tmp_path)  # the real one passes
    # asked from the folder the commands run in (``python -c`` puts it first on the path): from
    # a scratch folder another tree is itself, from inside this repository it would not be
    other = tmp_path / "other"
    (other / "nanolab").mkdir(parents=True)
    (other / "nanolab" / "__init__.py").write_text("")
    latency.check_imported_from(other, tmp_path / "cache", tmp_path)
    with pytest.raises(latency.BadTree, match=f"imports {REPO}"):
        latency.check_imported_from(other, tmp_path / "cache", REPO)
