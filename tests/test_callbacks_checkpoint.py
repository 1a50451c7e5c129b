"""Checkpoint rotation, atomic writes, a crash or a full disk mid-save, async saving."""

from __future__ import annotations

import errno
import os
import time
import warnings
from pathlib import Path

import lightning.pytorch as L
import pytest
import torch
from test_callbacks_runlog import events, fit

import nanolab.callbacks.checkpoint as checkpoint_module
import nanolab.callbacks.checkpoint_io as io_module
from nanolab.callbacks import (
    CallbackConfigError,
    CheckpointWriteError,
    CostBudget,
    MetricsLog,
    RotatingCheckpoint,
)
from nanolab.callbacks.checkpoint import step_of
from nanolab.errors import size_text
from nanolab.training.resume import find_resume_checkpoint

REAL_SAVE = torch.save


def names(folder) -> set[str]:
    return {p.name for p in folder.iterdir()}


def load(path) -> dict:
    return torch.load(path, map_location="cpu", weights_only=True)


def test_rotation_keeps_last_k_best_j_and_last(tmp_path, char_dataset):
    run = tmp_path / "run"
    # Validation every 2 steps with a scripted loss: the best (1.0) is at step 4, long gone
    # from the last-2 window by step 12.
    vals = [3.0, 1.0, 2.0, 2.5, 2.7, 2.9]
    ckpt = RotatingCheckpoint(every_n_steps=2, keep_last=2, keep_best=1)
    fit(
        run, char_dataset, [MetricsLog(), ckpt], max_steps=12, eval_every=2,
        module_kwargs={"val_losses": vals},
    )  # fmt: skip
    folder = run / "checkpoints"
    assert names(folder) == {
        "step-00000004.ckpt", "step-00000010.ckpt", "step-00000012.ckpt", "last.ckpt",
    }  # fmt: skip
    assert os.path.samefile(folder / "last.ckpt", folder / "step-00000012.ckpt")  # no 2nd write
    assert load(folder / "last.ckpt")["global_step"] == 12
    assert ckpt.best_model_path.endswith("step-00000004.ckpt")
    records = events(run / "metrics.jsonl", "checkpoint")
    assert [r["step"] for r in records] == [2, 4, 6, 8, 10, 12]
    deleted = [name for r in records for name in r["deleted"]]
    assert sorted(deleted) == ["step-00000002.ckpt", "step-00000006.ckpt", "step-00000008.ckpt"]
    assert all(r["bytes"] > 0 and r["async"] is False for r in records)
    assert find_resume_checkpoint(run).chosen.path.name == "step-00000012.ckpt"


def test_checkpoint_holds_what_an_exact_resume_needs(tmp_path, char_dataset):
    run = tmp_path / "run"
    fit(
        run, char_dataset,
        [MetricsLog(), RotatingCheckpoint(every_n_steps=4), CostBudget(patience=5)],
        max_steps=4, eval_every=4,
    )  # fmt: skip
    ckpt = load(run / "checkpoints" / "step-00000004.ckpt")  # plain data: weights_only loads it
    for key in ("state_dict", "optimizer_states", "lr_schedulers", "loops", "global_step"):
        assert key in ckpt
    assert {"rng", "gpt"} <= set(ckpt["nanolab"])
    states = ckpt["callbacks"]
    assert states["RunClock"]["tokens"] > 0 and states["RunClock"]["gpu_hours"] > 0
    # Saved after the step-4 validation, so the budget history includes it.
    assert [h[0] for h in states["CostBudget"]["history"]] == [4]
    assert states["RotatingCheckpoint"]["val_by_step"].keys() == {"4"}
    assert states["MetricsLog"]["run_id"]


def test_time_based_saving(tmp_path, char_dataset):
    run = tmp_path / "run"
    ckpt = RotatingCheckpoint(every_n_steps=None, every_n_minutes=1e-6, keep_last=100, keep_best=0)
    fit(run, char_dataset, [ckpt], max_steps=5, eval_every=100)
    steps = sorted(step_of(p) for p in (run / "checkpoints").iterdir() if step_of(p) is not None)
    assert steps == [1, 2, 3, 4, 5]


def failing_save_at(call: int, partial: bytes = b"PK\x03\x04 torn"):
    """A torch.save that writes some bytes and then hits a full disk on the ``call``-th save."""
    calls = {"n": 0}

    def save(obj, f, *args, **kwargs):
        calls["n"] += 1
        if calls["n"] == call:
            f.write(partial)
            raise OSError(errno.ENOSPC, "No space left on device")
        return REAL_SAVE(obj, f, *args, **kwargs)

    return save


def test_full_disk_mid_save_keeps_the_previous_checkpoint(tmp_path, char_dataset, monkeypatch):
    monkeypatch.setattr(io_module.torch, "save", failing_save_at(2))
    run = tmp_path / "run"
    with pytest.raises(
        CheckpointWriteError,
        match=r"^no space left on device writing .*step-00000004\.ckpt \(.* free, checkpoint "
        r"needs .*\); the previous checkpoints are intact",
    ):
        fit(run, char_dataset, [MetricsLog(), RotatingCheckpoint(every_n_steps=2)], max_steps=6)
    folder = run / "checkpoints"
    assert names(folder) == {"step-00000002.ckpt", "last.ckpt"}  # no torn file, no .tmp
    assert load(folder / "last.ckpt")["global_step"] == 2
    end = events(run / "metrics.jsonl", "end")[-1]
    assert end["reason"] == "error" and "no space left on device" in end["error"]
    assert end["step"] == 4


class FullDisk:
    """A file on a disk with ``room`` bytes left: a write past it fails with ENOSPC, as the
    kernel's would, so torch's own zip writer turns it into what it raises on a full disk."""

    def __init__(self, f, room: int) -> None:
        self.f, self.room, self.used = f, room, 0

    def write(self, data) -> int:
        n = memoryview(data).nbytes
        if self.used + n > self.room:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        self.used += n
        return self.f.write(data)

    def __getattr__(self, name):
        return getattr(self.f, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return self.f.__exit__(*exc)


@pytest.mark.parametrize("room", [0, 5_000, 90_000])
def test_torch_writer_error_on_a_full_disk_is_named(tmp_path, monkeypatch, room):
    state = {"w": torch.zeros(50_000), "tied": [torch.ones(10_000)] * 2}  # 240 kB of storage
    target = tmp_path / "step-00000004.ckpt"
    target.write_bytes(b"previous")

    def open_on_full_disk(path, mode="r", *args, **kwargs):
        return FullDisk(open(path, mode, *args, **kwargs), room)

    monkeypatch.setattr(io_module, "open", open_on_full_disk, raising=False)
    with pytest.raises(CheckpointWriteError) as info:
        io_module.atomic_torch_save(state, target)
    message = str(info.value)
    assert message.startswith(f"no space left on device writing {target} (")
    assert "checkpoint needs at least 0.24 MB" in message and "inline_container" not in message
    assert info.value.errno == errno.ENOSPC
    # torch raised RuntimeError (or OSError at close); both are the same full disk.
    assert isinstance(info.value.__cause__, (RuntimeError, OSError))
    assert names(tmp_path) == {"step-00000004.ckpt"} and target.read_bytes() == b"previous"


def test_torch_writer_error_without_an_oserror_is_judged_by_free_space(tmp_path, monkeypatch):
    """Some torch builds drop the OSError behind the writer's RuntimeError: then free space
    smaller than the checkpoint means a full disk; more than enough means another failure."""

    def torn_save(obj, f, *args, **kwargs):
        f.write(b"PK\x03\x04")
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 64 vs 0")

    monkeypatch.setattr(io_module.torch, "save", torn_save)
    usage = io_module.shutil.disk_usage(tmp_path)
    monkeypatch.setattr(io_module.shutil, "disk_usage", lambda p: usage._replace(free=1000))
    with pytest.raises(
        CheckpointWriteError, match=r"\(1 kB free, checkpoint needs at least 0\.40 MB\)"
    ):
        io_module.atomic_torch_save({"w": torch.zeros(100_000)}, tmp_path / "a.ckpt")
    monkeypatch.setattr(io_module.shutil, "disk_usage", lambda p: usage._replace(free=10**12))
    with pytest.raises(RuntimeError, match="inline_container") as info:
        io_module.atomic_torch_save({"w": torch.zeros(100_000)}, tmp_path / "a.ckpt")
    assert not isinstance(info.value, CheckpointWriteError)
    assert names(tmp_path) == set()


def test_async_saves_complete_before_old_ones_are_deleted(tmp_path, char_dataset, monkeypatch):
    seen: list[tuple[str, bool]] = []
    real_delete = checkpoint_module.unlink_in

    def slow_save(obj, f, *args, **kwargs):
        time.sleep(0.3)  # a slow disk: the training thread must not wait for it
        return REAL_SAVE(obj, f, *args, **kwargs)

    def watched_delete(folder, path):
        newer = [p for p in path.parent.iterdir() if (step_of(p) or -1) > step_of(path)]
        seen.append((path.name, all(load(p)["global_step"] == step_of(p) for p in newer)))
        real_delete(folder, path)

    monkeypatch.setattr(io_module.torch, "save", slow_save)
    monkeypatch.setattr(checkpoint_module, "unlink_in", watched_delete)
    run = tmp_path / "run"
    ckpt = RotatingCheckpoint(every_n_steps=2, keep_last=1, keep_best=0, async_save=True)
    fit(run, char_dataset, [MetricsLog(), ckpt], max_steps=8, eval_every=100)

    folder = run / "checkpoints"
    assert names(folder) == {"step-00000008.ckpt", "last.ckpt"}
    assert load(folder / "last.ckpt")["global_step"] == 8
    assert [name for name, _ in seen] == [f"step-0000000{s}.ckpt" for s in (2, 4, 6)]
    assert all(complete for _, complete in seen)
    records = events(run / "metrics.jsonl", "checkpoint")
    assert [r["step"] for r in records] == [2, 4, 6, 8] and all(r["async"] for r in records)
    # The write took the slow disk's 0.3 s; the loop waited only for the snapshot, not for it.
    assert all(r["write_seconds"] >= 0.3 and r["seconds"] < r["write_seconds"] for r in records)
    # The end record comes after the last checkpoint is complete.
    kinds = [r["event"] for r in events(run / "metrics.jsonl", None)]
    assert kinds[-2:] == ["checkpoint", "end"]


def test_async_full_disk_surfaces_and_keeps_the_previous(tmp_path, char_dataset, monkeypatch):
    monkeypatch.setattr(io_module.torch, "save", failing_save_at(2))
    run = tmp_path / "run"
    ckpt = RotatingCheckpoint(every_n_steps=2, keep_last=1, keep_best=0, async_save=True)
    with pytest.raises(CheckpointWriteError, match="no space left on device"):
        fit(run, char_dataset, [MetricsLog(), ckpt], max_steps=8, eval_every=100)
    folder = run / "checkpoints"
    assert names(folder) == {"step-00000002.ckpt", "last.ckpt"}
    assert load(folder / "last.ckpt")["global_step"] == 2


def test_disk_cap_deletes_oldest_first_and_never_the_newest(tmp_path, char_dataset, capsys):
    run = tmp_path / "run"
    probe = RotatingCheckpoint(every_n_steps=2)
    fit(tmp_path / "probe", char_dataset, [probe], max_steps=2, eval_every=100)
    size = (tmp_path / "probe" / "checkpoints" / "step-00000002.ckpt").stat().st_size
    cap_gb = 2.5 * size / 1e9  # room for two checkpoints
    ckpt = RotatingCheckpoint(every_n_steps=2, keep_last=5, keep_best=0, max_disk_gb=cap_gb)
    fit(run, char_dataset, [ckpt], max_steps=10, eval_every=100)
    assert names(run / "checkpoints") == {"step-00000008.ckpt", "step-00000010.ckpt", "last.ckpt"}

    tiny = RotatingCheckpoint(every_n_steps=2, keep_last=5, keep_best=0, max_disk_gb=size / 4e9)
    capsys.readouterr()
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # one plain line, not a Python warning
        fit(tmp_path / "tiny", char_dataset, [tiny], max_steps=4, eval_every=100)
    assert names(tmp_path / "tiny" / "checkpoints") == {"step-00000004.ckpt", "last.ckpt"}
    said = [line for line in capsys.readouterr().err.splitlines() if "max_disk_gb" in line]
    assert said == [
        f"nanolab: warning: checkpoint.max_disk_gb {size / 4e9} is smaller than one checkpoint "
        f"({size_text(size)} on disk); keeping the newest anyway"
    ], said  # a unit that does not round a small checkpoint to "0.000 GB"


def test_stale_tmp_files_are_cleaned_and_never_mistaken_for_checkpoints(tmp_path, char_dataset):
    """A save cut short leaves its temp file (an older nanolab's fixed ``<name>.tmp``, or
    today's ``.<name>.<16 hex>.tmp``): the claim deletes it. It deleted every ``*.tmp`` file
    of the folder, a user's ``notes.tmp`` too; those stay."""
    run = tmp_path / "run"
    folder = run / "checkpoints"
    folder.mkdir(parents=True)
    (folder / "step-00000002.ckpt.tmp").write_bytes(b"torn")
    (folder / ".last.ckpt.0123456789abcdef.tmp").write_bytes(b"torn")
    theirs = {"notes.tmp", ".notes.0123456789abcdef.tmp", "step-00000002.tmp", ".step.tmp"}
    for name in theirs:
        (folder / name).write_text("mine")
    assert find_resume_checkpoint(run).chosen is None
    fit(run, char_dataset, [RotatingCheckpoint(every_n_steps=2)], max_steps=2, eval_every=100)
    assert names(folder) == {"step-00000002.ckpt", "last.ckpt", *theirs}
    assert all((folder / name).read_text() == "mine" for name in theirs)


def test_a_sharded_save_cut_short_leaves_no_folder_behind(tmp_path, char_dataset):
    """A sharded save (DeepSpeed, FSDP2: a folder) cut short leaves its hidden temp folder,
    a new name at every save: the claim at the next launch removed leftover temp files but not
    folders, so each interrupted save kept a full set of shards on the disk for good.

    Mutations caught: folders left (the unlink on a folder failed, silently); any ``.tmp``
    folder deleted (one of another name is not a save's); a link followed out of the folder."""
    run = tmp_path / "run"
    folder = run / "checkpoints"
    folder.mkdir(parents=True)
    torn = folder / ".step-00000004.ckpt.0123456789abcdef.tmp"
    torn.mkdir()
    (torn / "mp_rank_00_model_states.pt").write_bytes(b"\0" * 1000)
    (folder / "mine.tmp").mkdir()  # not a name a save makes: not nanolab's to delete
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep.txt").write_text("x")
    (folder / ".last.ckpt.fedcba9876543210.tmp").symlink_to(outside, target_is_directory=True)
    fit(run, char_dataset, [RotatingCheckpoint(every_n_steps=2)], max_steps=2, eval_every=100)
    assert names(folder) == {"step-00000002.ckpt", "last.ckpt", "mine.tmp"}
    assert (outside / "keep.txt").read_text() == "x"


def test_a_removal_cut_short_and_only_nanolab_temp_folders_are_cleared(tmp_path, char_dataset):
    """A sharded checkpoint or temp folder renamed to ``.<name>.deleting`` whose removal was
    cut short was never cleared again; a user's hidden ``.<x>.<16 hex>.tmp`` folder was.

    Mutations caught: ``.deleting`` folders kept; any temp-shaped folder deleted; a
    ``.deleting`` of another name deleted; a link followed out of the folder."""
    run = tmp_path / "run"
    folder = run / "checkpoints"
    folder.mkdir(parents=True)
    for doomed in (
        ".step-00000004.ckpt.deleting",
        ".last.ckpt.deleting",
        "..step-00000006.ckpt.0123456789abcdef.tmp.deleting",
    ):
        (folder / doomed).mkdir()
        (folder / doomed / "mp_rank_00_model_states.pt").write_bytes(b"\0" * 1000)
    kept = {".notes.0123456789abcdef.tmp", ".mine.deleting", ".link.ckpt.deleting"}
    (folder / ".notes.0123456789abcdef.tmp").mkdir()  # a user's hidden folder of that shape
    (folder / ".notes.0123456789abcdef.tmp" / "keep.txt").write_text("x")
    (folder / ".mine.deleting").mkdir()
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep.txt").write_text("x")
    (folder / ".step-00000008.ckpt.deleting").symlink_to(outside, target_is_directory=True)
    kept.add(".step-00000008.ckpt.deleting")
    kept.discard(".link.ckpt.deleting")
    fit(run, char_dataset, [RotatingCheckpoint(every_n_steps=2)], max_steps=2, eval_every=100)
    assert names(folder) == {"step-00000002.ckpt", "last.ckpt", *kept}
    assert (outside / "keep.txt").read_text() == "x"


def test_temp_names_are_recognised_by_their_shape():
    from nanolab.atomic import is_temp_name, temp_name

    assert is_temp_name(temp_name("/x/step-00000002.ckpt").name)
    assert not is_temp_name("step-00000002.ckpt.tmp")  # an older fixed name, or another tool's
    assert not is_temp_name(".step-00000002.ckpt.tmp")
    assert not is_temp_name(".step.0123456789ABCDEF.tmp")  # a save writes lower-case hex
    assert not is_temp_name("..0123456789abcdef.tmp")


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"every_n_steps": 0}, "checkpoint.every_n_steps"),
        ({"every_n_minutes": -1.0}, "checkpoint.every_n_minutes"),
        ({"keep_last": -1}, "checkpoint.keep_last"),
        ({"max_disk_gb": 0}, "checkpoint.max_disk_gb"),
        # another folder: a restart would not find them and would rotate them away
        ({"dirpath": "/elsewhere"}, "checkpoint.dirpath /elsewhere: checkpoints live in"),
    ],
)
def test_bad_checkpoint_settings(kwargs, message):
    with pytest.raises(CallbackConfigError, match=message):
        RotatingCheckpoint(**kwargs)


def test_async_snapshot_is_a_point_in_time_copy_that_keeps_tied_weights_shared():
    from nanolab.callbacks.checkpoint_io import cpu_snapshot

    weight = torch.nn.Parameter(torch.randn(64, 8))
    state = {"state_dict": {"wte": weight.detach(), "head": weight.detach()}, "step": 3}
    before = weight.detach().clone()
    snap = cpu_snapshot(state)
    with torch.no_grad():
        weight.add_(1.0)  # training goes on while the writer thread serialises
    assert torch.equal(snap["state_dict"]["wte"], before)
    assert snap["state_dict"]["wte"] is snap["state_dict"]["head"]  # saved once, as sync would
    assert snap["step"] == 3


def test_async_save_that_cannot_apply_says_so_in_one_plain_line(tmp_path, char_dataset, capsys):
    """A CheckpointIO of the user's own (as DeepSpeed and FSDP2 have) cannot save on a thread:
    ``async_save`` is then one ``warning:`` line from rank zero, not a Python warning per rank,
    and the saves are still made whole by the rename."""
    from lightning.pytorch.plugins.io import TorchCheckpointIO

    class OwnIO(TorchCheckpointIO):
        pass

    ckpt = RotatingCheckpoint(every_n_steps=2, async_save=True)
    capsys.readouterr()
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        fit(tmp_path / "run", char_dataset, [ckpt], max_steps=2, eval_every=100, plugins=[OwnIO()])
    said = [line for line in capsys.readouterr().err.splitlines() if "async_save" in line]
    assert said == [
        "nanolab: warning: checkpoint.async_save is ignored with SingleDeviceStrategy / OwnIO: "
        "saves are synchronous (set checkpoint.async_save false to silence this)"
    ], said
    assert names(tmp_path / "run" / "checkpoints") == {"step-00000002.ckpt", "last.ckpt"}


class PlantLinks(L.Callback):
    """After the first step (the run has claimed its folders, clearing what a crash left), hard
    links into another file at the fixed temporary names a save would once have used
    (``<name>.tmp``), as another tool leaves them."""

    def __init__(self, other: Path, names: list[str]) -> None:
        self.other, self.names = other, names

    def on_train_batch_end(self, trainer: L.Trainer, *args: object) -> None:
        if trainer.global_step != 1:
            return
        folder = Path(trainer.default_root_dir) / "checkpoints"
        folder.mkdir(parents=True, exist_ok=True)
        for name in self.names:
            os.link(self.other, folder / name)


class SaveNowAt(L.Callback):
    """The preemption handler's own save (no checkpoint callback with ``save_now``)."""

    def on_train_batch_end(self, trainer: L.Trainer, *args: object) -> None:
        if trainer.global_step == 2:
            from nanolab.callbacks.preemption import save_checkpoint_now

            save_checkpoint_now(trainer)


@pytest.mark.parametrize("writer", ["atomic_io", "own_io", "preemption"])
def test_a_link_planted_at_a_temporary_name_is_never_written_through(
    tmp_path, char_dataset, writer
):
    """Every checkpoint writer (nanolab's CheckpointIO, the rename after someone else's
    CheckpointIO, the preemption handler's fallback, ``last.ckpt``) writes a new file of its
    own: the file a planted hard link leads to is untouched, and the link is left as it was."""
    from lightning.pytorch.plugins.io import TorchCheckpointIO

    other = tmp_path / "other-run.ckpt"
    other.write_bytes(b"another run's checkpoint")
    planted = ["step-00000002.ckpt.tmp", "last.ckpt.tmp", ".step-00000002.ckpt.tmp"]
    callbacks: list[L.Callback] = [PlantLinks(other, planted)]
    kwargs: dict[str, object] = {}
    if writer == "preemption":
        callbacks.append(SaveNowAt())
    else:
        callbacks.append(RotatingCheckpoint(every_n_steps=2))
    if writer == "own_io":
        kwargs["plugins"] = [type("OwnIO", (TorchCheckpointIO,), {})()]
    fit(tmp_path / "run", char_dataset, callbacks, max_steps=2, eval_every=100, **kwargs)
    assert other.read_bytes() == b"another run's checkpoint"
    folder = tmp_path / "run" / "checkpoints"
    assert load(folder / "step-00000002.ckpt")["global_step"] == 2
    assert all(os.path.samefile(folder / name, other) for name in planted)
    saved = {"step-00000002.ckpt"} | ({"last.ckpt"} if writer != "preemption" else set())
    assert names(folder) == saved | set(planted)  # no temporary file of its own left behind
