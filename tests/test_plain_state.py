"""A checkpoint holds plain data only: fit refuses to save a state no reader can load, and the
readers name the class they refused (a fork callback's numpy float)."""

from __future__ import annotations

import textwrap
import threading
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import nanolab_here, tiny_overrides, write_config

from nanolab.callbacks.checkpoint_io import AsyncAtomicCheckpointIO, AtomicCheckpointIO
from nanolab.model.checkpoint import CheckpointError, load_checkpoint
from nanolab.model.plain_state import UnloadableStateError, unloadable_value
from nanolab.training.evaluate import EvaluateError, eval_target
from nanolab.training.resume import inspect_checkpoint

NUMPY_STATE = {"best": np.float64(1.5), "history": np.zeros(3)}


def checkpoint(**callbacks: object) -> dict:
    return {
        "state_dict": {"w": torch.ones(4)},
        "optimizer_states": [{"state": {0: {"step": torch.tensor(3.0)}}}],
        "global_step": 3,
        "callbacks": {"Plain": {"best": 1.5, "seen": [1, 2]}, **callbacks},
        "loops": {},
    }


def test_plain_data_is_accepted():
    assert unloadable_value(checkpoint()) is None


def test_a_numpy_value_is_named_by_callback_key_and_type():
    """Mutation caught: the check skipped, or naming the refused global without the callback."""
    line = unloadable_value(checkpoint(BestTracker=NUMPY_STATE))
    assert line is not None
    assert line.startswith("callback BestTracker's state_dict()['best'] is a numpy.float64")
    assert "weights_only=True" in line and "float(x)" in line


def test_a_numpy_value_in_the_modules_section_names_the_module():
    ckpt = {**checkpoint(), "nanolab": {"stats": [1.0, np.int64(3)]}}
    line = unloadable_value(ckpt)
    assert line is not None
    assert line.startswith("the module's checkpoint section['stats'][1] is a numpy.int64")


@dataclass(frozen=True)
class Frozen:
    best: float = 1.5


def test_a_value_the_check_cannot_even_serialize_is_its_one_line():
    """A frozen dataclass (Lightning's tensor walk refuses to rebuild it) or a value pickle
    cannot write (a lock, a lambda) crashed the check itself with a raw ValueError or
    PicklingError; each is the check's line naming the owner and the type."""
    for value, kind, why in (
        (Frozen(), f"{__name__}.Frozen", f"which refuses {__name__}.Frozen;"),
        (threading.Lock(), "_thread.lock", "torch.save cannot write it (TypeError: cannot pickle"),
        (lambda x: x, "builtins.function", "torch.save cannot write it (AttributeError: "),
    ):
        line = unloadable_value(checkpoint(Mine={"seen": [1, {"v": value}]}))
        assert line is not None
        assert line.startswith(f"callback Mine's state_dict()['seen'][1]['v'] is a {kind}, "), line
        assert why in line and line.endswith("dicts and lists of those)"), line


def test_a_class_the_fork_allowed_still_counts_and_the_allowlist_is_kept():
    """generate and export import no fork: a class a fork's module allowed for its own process
    is refused by them, so fit refuses it too, and the fork's allowance is left in place."""
    allowed = [np.dtype, type(np.dtype(np.float64)), np._core.multiarray.scalar]
    torch.serialization.add_safe_globals(allowed)
    try:
        assert unloadable_value(checkpoint(BestTracker={"best": np.float64(1)})) is not None
        assert set(allowed) <= set(torch.serialization.get_safe_globals())
    finally:
        torch.serialization.clear_safe_globals()


@pytest.mark.parametrize("io_class", [AtomicCheckpointIO, AsyncAtomicCheckpointIO])
def test_the_save_is_refused_before_anything_is_written(tmp_path: Path, io_class: type):
    """Mutation caught: the checkpoint written (and last.ckpt replaced) before the check."""
    good = tmp_path / "step-00000002.ckpt"
    torch.save(checkpoint(), good)
    before = good.read_bytes()
    io = io_class()
    with pytest.raises(UnloadableStateError) as err:
        io.save_checkpoint(checkpoint(BestTracker=NUMPY_STATE), good)
    assert str(err.value).endswith("before writing step-00000002.ckpt; its checkpoints are intact")
    with pytest.raises(UnloadableStateError, match="its checkpoints are intact"):
        io.save_checkpoint(checkpoint(BestTracker=NUMPY_STATE), tmp_path / "step-00000004.ckpt")
    io.teardown()
    assert good.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == [good.name]


@pytest.fixture
def numpy_checkpoint(tmp_path: Path) -> Path:
    """A run directory whose only checkpoint a fork's numpy state made unreadable (written as
    nanolab fit did before it checked)."""
    path = tmp_path / "run" / "checkpoints" / "step-00000004.ckpt"
    path.parent.mkdir(parents=True)
    torch.save(checkpoint(BestTracker=NUMPY_STATE), path)
    return path


def test_the_readers_name_the_refused_class(numpy_checkpoint: Path):
    """Mutation caught: "not written by nanolab fit" / "holds no checkpoint" for a file fit
    wrote (the readers dropping torch's "Unsupported global")."""
    with pytest.raises(CheckpointError) as err:
        load_checkpoint(numpy_checkpoint)
    assert "holds a pickled numpy._core.multiarray.scalar" in str(err.value)
    assert "written by nanolab fit" not in str(err.value)
    cand = inspect_checkpoint(numpy_checkpoint)
    assert cand.error is not None and "numpy._core.multiarray.scalar" in cand.error
    with pytest.raises(EvaluateError) as err:
        eval_target(None, numpy_checkpoint.parents[1], "validate", has_init_from=False)
    assert "holds no readable checkpoint to validate: step-00000004.ckpt (it holds a " in str(
        err.value
    )
    assert "train it first" not in str(err.value)


def test_fit_stops_with_one_line_before_saving(char_dataset, tmp_path, monkeypatch):
    """The reviewer's case end to end: a fork callback keeping its best loss as a numpy float."""
    (tmp_path / "forkcb.py").write_text(
        textwrap.dedent(
            """
            import numpy as np
            from lightning.pytorch import Callback

            class BestTracker(Callback):
                def __init__(self):
                    self.best = np.float64(np.inf)

                def state_dict(self):
                    return {"best": self.best}
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    cfg = tiny_overrides(char_dataset, tmp_path / "runs", trainer__max_steps=3)
    cfg["trainer"]["callbacks"] = [{"class_path": "forkcb.BestTracker"}]
    config = write_config(tmp_path / "c.yaml", cfg)
    result = nanolab_here("fit", "--config", str(config), cwd=tmp_path)
    assert result.returncode == 2, result.stderr
    errors = [line for line in result.stderr.splitlines() if "error" in line]
    assert errors == [
        "nanolab fit: error: callback BestTracker's state_dict()['best'] is a numpy.float64, "
        "which no checkpoint can hold: every nanolab reader loads a checkpoint with "
        "weights_only=True, which refuses numpy._core.multiarray.scalar; store plain data "
        "instead (float(x), int(x), x.tolist(), torch.tensor(x), dicts and lists of those). "
        "The run stopped before writing step-00000003.ckpt; it has none yet"
    ]
    assert "Traceback" not in result.stderr
    assert not list((tmp_path / "runs" / "tiny" / "checkpoints").glob("*.ckpt"))
