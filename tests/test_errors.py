"""One error type: every error a user can fix is a NanolabError, and one handler prints it."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

from nanolab.errors import NanolabError, RunConfigError, one_line_errors

PACKAGE = Path(__file__).resolve().parents[1] / "nanolab"
#: Not a user's mistake: a write that failed (a full disk); fit still reports it in one line.
NOT_USER_ERRORS = {"nanolab.callbacks.checkpoint_io.CheckpointWriteError"}


def _error_classes() -> list[str]:
    found = []
    for path in PACKAGE.rglob("*.py"):
        if "templates" in path.parts:
            continue
        module = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        for node in ast.parse(path.read_text(encoding="utf-8")).body:
            if isinstance(node, ast.ClassDef) and node.name.endswith("Error"):
                found.append(f"{module.removesuffix('.__init__')}.{node.name}")
    return sorted(found)


def test_every_error_class_is_a_nanolab_error() -> None:
    classes = _error_classes()
    assert len(classes) > 30
    outside = []
    for qualified in classes:
        module, _, name = qualified.rpartition(".")
        cls = getattr(importlib.import_module(module), name)
        if qualified not in NOT_USER_ERRORS and not issubclass(cls, NanolabError):
            outside.append(qualified)
    assert not outside, f"error classes outside NanolabError: {outside}"


def test_field_problem_and_fix_make_one_line() -> None:
    err = NanolabError("must be >= 1, got 0", field="data.micro_batch_size", fix="give 1 or more")
    assert str(err) == "data.micro_batch_size: must be >= 1, got 0; give 1 or more"
    assert (err.field, err.problem, err.fix) == ("data.micro_batch_size", "must be >= 1, got 0", "give 1 or more")  # fmt: skip
    assert str(NanolabError("plain")) == "plain" and isinstance(err, ValueError)


def test_the_handler_prints_one_line_and_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    @one_line_errors("nanolab demo")
    def main(argv: list[str]) -> int:
        if argv:
            raise RunConfigError("run.name is empty; give a name")
        return 0

    assert main([]) == 0
    assert main(["x"]) == 2
    assert capsys.readouterr().err == "nanolab demo: error: run.name is empty; give a name\n"

    @one_line_errors("nanolab demo")
    def broken(argv: list[str]) -> int:
        raise KeyError("a bug of ours keeps its traceback")

    with pytest.raises(KeyError):
        broken([])
